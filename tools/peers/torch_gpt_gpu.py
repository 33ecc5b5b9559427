"""PyTorch GPU peer of strata's GPU check 'train' rows (GPT-2 124M, everything on the device).

Same shape as tools/gpu_check.py's GPT-2 row: 12 x 768, 12 heads, T 1024, vocab 50304 (padded),
micro-batch 8, 2 micro-batches per step, bf16 autocast, fused AdamW, clipping 1.0, tied head.
Prints one JSON line per mode: eager, and torch.compile when --compile is given.
"""
import argparse
import json
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
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for b in self.blocks:
            x = b(x)
        logits = self.ln_f(x) @ self.wte.weight.t()
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))


def run(a, compile_):
    torch.manual_seed(1)
    model = Gpt(a.layers, a.heads, a.width, a.vocab, a.context).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1,
                            fused=True)
    fwd = torch.compile(model) if compile_ else model
    data = torch.randint(0, a.vocab, (a.accum, a.micro_batch, a.context + 1), device="cuda")
    times = []
    for step in range(a.warmup + a.steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for m in range(a.accum):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = fwd(data[m, :, :-1], data[m, :, 1:]) / a.accum
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    t = sorted(times[a.warmup:])[len(times[a.warmup:]) // 2]
    n = sum(p.numel() for p in model.parameters())
    tok = a.accum * a.micro_batch * a.context
    flops_per_token = 6 * n + 6 * a.layers * a.width * a.context
    print(json.dumps({"peer": "torch", "mode": "compile" if compile_ else "eager",
                      "params": n, "step_ms": round(t * 1e3, 1), "tokens_per_s": round(tok / t),
                      "mfu_989": round(tok / t * flops_per_token / 989e12, 4),
                      "peak_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
                      "loss": round(loss.item() * a.accum, 4)}), flush=True)


def main():
    p = argparse.ArgumentParser()
    for name, default in [("layers", 12), ("heads", 12), ("width", 768), ("vocab", 50304),
                          ("context", 1024), ("micro-batch", 8), ("accum", 2), ("steps", 10),
                          ("warmup", 3)]:
        p.add_argument("--" + name, type=int, default=default)
    p.add_argument("--compile", action="store_true")
    a = p.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = True
    run(a, False)
    if a.compile:
        run(a, True)


if __name__ == "__main__":
    main()
