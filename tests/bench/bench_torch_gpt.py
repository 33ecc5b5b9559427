"""PyTorch CPU peer of a strata GPT training run, for tests/bench/bench_cpu_vs_torch.sh.

The same model shape as strata's GPT-2 (tied embeddings, pre-LayerNorm blocks, tanh GELU, causal
attention), trained on random tokens with bf16 autocast, fused AdamW and gradient accumulation.
Prints one line: "torch tokens/s <wall> cpu_s <process CPU seconds> steps <n>", measured over the
steps after the warm-up ones.

    python tests/bench/bench_torch_gpt.py --layers 8 --heads 8 --width 512 --vocab 256 --context 128 \
        --micro-batch 2 --accum 2 --steps 12 --warmup 2
"""
import argparse
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, C, H):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(C), nn.LayerNorm(C)
        self.qkv, self.proj = nn.Linear(C, 3 * C), nn.Linear(C, C)
        self.fc, self.fc_proj = nn.Linear(C, 4 * C), nn.Linear(4 * C, C)
        self.H = H

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.H, C // self.H).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.fc_proj(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class Gpt(nn.Module):
    def __init__(self, L, H, C, V, T):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(V, C), nn.Embedding(T, C)
        self.blocks = nn.ModuleList(Block(C, H) for _ in range(L))
        self.ln_f = nn.LayerNorm(C)
        for p in self.parameters():  # GPT-2's normal(0, 0.02) for the matrices (strata's init)
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for b in self.blocks:
            x = b(x)
        logits = self.ln_f(x) @ self.wte.weight.t()
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))


def main():
    p = argparse.ArgumentParser()
    for name, default in [("layers", 8), ("heads", 8), ("width", 512), ("vocab", 256),
                          ("context", 128), ("micro-batch", 2), ("accum", 2), ("steps", 12),
                          ("warmup", 2), ("threads", 2)]:
        p.add_argument("--" + name, type=int, default=default)
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16",
                   help="bf16: autocast to bfloat16 (strata's bf16 peer); fp32: no autocast")
    a = p.parse_args()
    torch.manual_seed(1)
    torch.set_num_threads(a.threads)
    model = Gpt(a.layers, a.heads, a.width, a.vocab, a.context)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1,
                            fused=True)
    data = torch.randint(0, a.vocab, (a.micro_batch, a.context + 1))
    t0 = c0 = None
    for step in range(a.warmup + a.steps):
        if step == a.warmup:
            t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(a.accum):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=a.dtype == "bf16"):
                loss = model(data[:, :-1], data[:, 1:]) / a.accum
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    tokens = a.steps * a.accum * a.micro_batch * a.context
    print(f"torch tokens/s {tokens / wall:.1f} cpu_s {cpu:.2f} steps {a.steps} tokens {tokens} "
          f"loss {loss.item() * a.accum:.4f}")


if __name__ == "__main__":
    main()
