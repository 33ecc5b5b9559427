"""PyTorch GPU peer of tools/gpu_check.py's 'Llama ~1B' device row: TinyLlama-1.1B's shape (22 x 2048,
32 query / 4 key-value heads, SwiGLU 5632, vocab 32000, untied head), micro-batch 4 x 2048,
bf16 autocast, fused AdamW, clipping 1.0, activation checkpointing per block (strata recomputes).
One JSON line; MFU with gpu_check's FLOPs per token: 6 (N - V C) + 6 L C T."""
import json, sys, time
import torch, torch.nn as nn, torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

L, C, NH, KV, I, V, T, B = 22, 2048, 32, 4, 5632, 32000, 2048, 4
hs = C // NH

def rope(x, cos, sin):
    x1, x2 = x[..., : hs // 2], x[..., hs // 2:]
    return x * cos + torch.cat((-x2, x1), -1) * sin

class Block(nn.Module):
    def __init__(s):
        super().__init__()
        s.n1, s.n2 = nn.RMSNorm(C), nn.RMSNorm(C)
        s.q, s.k, s.v = nn.Linear(C, C, bias=False), nn.Linear(C, KV * hs, bias=False), nn.Linear(C, KV * hs, bias=False)
        s.o = nn.Linear(C, C, bias=False)
        s.g, s.u, s.d = nn.Linear(C, I, bias=False), nn.Linear(C, I, bias=False), nn.Linear(I, C, bias=False)
    def forward(s, x, cos, sin):
        h = s.n1(x)
        q = s.q(h).view(B, T, NH, hs).transpose(1, 2)
        k = s.k(h).view(B, T, KV, hs).transpose(1, 2)
        v = s.v(h).view(B, T, KV, hs).transpose(1, 2)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + s.o(y.transpose(1, 2).reshape(B, T, C))
        h = s.n2(x)
        return x + s.d(F.silu(s.g(h)) * s.u(h))

class Llama(nn.Module):
    def __init__(s):
        super().__init__()
        s.emb = nn.Embedding(V, C); s.blocks = nn.ModuleList(Block() for _ in range(L))
        s.norm = nn.RMSNorm(C); s.head = nn.Linear(C, V, bias=False)
        inv = 1.0 / (10000 ** (torch.arange(0, hs, 2).float() / hs))
        f = torch.outer(torch.arange(T).float(), inv); f = torch.cat((f, f), -1)
        s.register_buffer("cos", f.cos()); s.register_buffer("sin", f.sin())
    def forward(s, idx, tgt):
        x = s.emb(idx)
        for b in s.blocks:
            x = checkpoint(b, x, s.cos, s.sin, use_reentrant=False)
        logits = s.head(s.norm(x))
        return F.cross_entropy(logits.float().view(-1, V), tgt.reshape(-1))

torch.manual_seed(1)
m = Llama().cuda()
opt = torch.optim.AdamW(m.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
data = torch.randint(0, V, (B, T + 1), device="cuda")
times = []
for step in range(8):
    torch.cuda.synchronize(); t0 = time.perf_counter()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = m(data[:, :-1], data[:, 1:])
    loss.backward()
    torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
    opt.step(); opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize(); times.append(time.perf_counter() - t0)
t = sorted(times[3:])[len(times[3:]) // 2]
N = sum(p.numel() for p in m.parameters())
fpt = 6 * (N - V * C) + 6 * L * C * T
print(json.dumps({"peer": "torch", "model": "llama-1.1b", "params": N, "step_ms": round(t * 1e3, 1),
                  "tokens_per_s": round(B * T / t), "mfu_989": round(B * T / t * fpt / 989e12, 4),
                  "peak_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2)}), flush=True)
