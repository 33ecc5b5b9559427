#!/usr/bin/env python3
"""Peer benchmark: DeepSpeed ZeRO-Offload (optimizer state in host RAM, DeepSpeed's CPU Adam)
or ZeRO-Infinity (parameters and optimizer state on NVMe) training a GPT-2-style LM on one
CUDA GPU, 1 process. Not part of strata: tools/gpu_check.py's deepspeed phase runs it beside
strata's offload rows, in a throwaway virtual environment (tools/gpu_peers.py).

Adapted from the CPU peer ds_zero_infinity.py (the same model and DeepSpeed config, which
mirrors configs/hostmem-190m.json) for the CUDA accelerator: NCCL, inputs on the device,
torch.cuda.synchronize around each step.

Model (--arch gpt): learned token + position embeddings, n_layer pre-LN blocks
x = x + proj(causal_sdpa(qkv(LN1(x)))); x = x + fc2(gelu_tanh(fc1(LN2(x)))) (MLP 4x), final LN,
lm_head tied to the token embedding, Linear layers with biases, GPT-2 init. --arch llama:
TinyLlama's layout (RMSNorm, RoPE, --n-kv-head grouped-query heads, SwiGLU of --intermediate,
no biases, untied head), each block recomputed in backward (torch.utils.checkpoint), as
strata's `recompute` and tools/peers/torch_llama_gpu.py do.
DeepSpeed config: bf16, AdamW (lr 3e-4, betas .9/.95, wd 0.1; under ZeRO offload DeepSpeed's
CPU Adam), gradient_clipping 1.0, ZeRO stage 3, stage3_prefetch_bucket_size 1e7,
stage3_param_persistence_threshold 1e4, aio block_size 1 MiB queue_depth 32; --mode offload:
offload_optimizer cpu (parameters on the device); --mode infinity: offload_param and
offload_optimizer nvme (buffer_count 4).

Data: uniformly random tokens from a seeded generator. Timing: --warmup untimed optimizer steps,
then --steps timed ones (grad_accum x forward+backward + engine.step()). Prints ONE JSON line on
stdout (everything else goes to stderr): tokens_per_s (median step), peak_rss_mib (VmHWM),
peak_device_gib, the losses.
"""
import argparse
import json
import math
import os
import shutil
import statistics
import sys
import time


def vm(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024.0  # kB -> MiB
    return None


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=["offload", "infinity"], required=True)
    ap.add_argument("--arch", choices=["gpt", "llama"], default="gpt")
    ap.add_argument("--n-kv-head", type=int, default=0, help="llama: key-value heads")
    ap.add_argument("--intermediate", type=int, default=0, help="llama: SwiGLU width")
    ap.add_argument("--n-layer", type=int, default=15)
    ap.add_argument("--n-head", type=int, default=16)
    ap.add_argument("--n-embd", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--grad-accum", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--nvme-path", default="ds_swap")
    ap.add_argument("--port", type=int, default=29519)
    args = ap.parse_args()

    os.environ.setdefault("DS_ACCELERATOR", "cuda")
    for k, v in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(args.port)), ("RANK", "0"),
                 ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_SIZE", "1")):
        os.environ.setdefault(k, v)
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)  # DeepSpeed's logs and JIT builds go to stderr
    out = os.fdopen(saved, "w")

    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    import deepspeed

    torch.manual_seed(1)
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    deepspeed.init_distributed(dist_backend="nccl")

    class Block(nn.Module):
        def __init__(self, d, h):
            super().__init__()
            self.h = h
            self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

        def forward(self, x):
            B, T, C = x.shape
            q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
            q, k, v = (t.view(B, T, self.h, C // self.h).transpose(1, 2) for t in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
            return x + self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate="tanh"))

    class GPT(nn.Module):
        def __init__(self, L, H, d, V, T):
            super().__init__()
            self.wte, self.wpe = nn.Embedding(V, d), nn.Embedding(T, d)
            self.blocks = nn.ModuleList([Block(d, H) for _ in range(L)])
            self.ln_f = nn.LayerNorm(d)
            self.lm_head = nn.Linear(d, V, bias=False)
            self.lm_head.weight = self.wte.weight
            self.L = L

        def gpt2_init(self):
            for name, p in self.named_parameters():
                with deepspeed.zero.GatheredParameters([p], modifier_rank=0):
                    if len(getattr(p, "ds_shape", p.shape)) == 2:
                        std = 0.02 / math.sqrt(2 * self.L) if name.endswith(
                            ("proj.weight", "fc2.weight")) else 0.02
                        nn.init.normal_(p, 0.0, std)
                    elif name.endswith("bias"):
                        nn.init.zeros_(p)

        def forward(self, idx, targets):
            x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
            for b in self.blocks:
                x = b(x)
            logits = self.lm_head(self.ln_f(x))
            return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))

    class LlamaBlock(nn.Module):
        def __init__(self, d, h, kv, inter, T):
            super().__init__()
            self.h, self.kv, self.hs = h, kv, d // h
            self.n1, self.n2 = nn.RMSNorm(d), nn.RMSNorm(d)
            self.q = nn.Linear(d, d, bias=False)
            self.k = nn.Linear(d, kv * self.hs, bias=False)
            self.v = nn.Linear(d, kv * self.hs, bias=False)
            self.o = nn.Linear(d, d, bias=False)
            self.g, self.u = nn.Linear(d, inter, bias=False), nn.Linear(d, inter, bias=False)
            self.dn = nn.Linear(inter, d, bias=False)

        def forward(self, x, cos, sin):
            B, T, C = x.shape
            hs = self.hs

            def rope(t):
                t1, t2 = t[..., : hs // 2], t[..., hs // 2:]
                return t * cos + torch.cat((-t2, t1), -1) * sin

            a = self.n1(x)
            q = rope(self.q(a).view(B, T, self.h, hs).transpose(1, 2))
            k = rope(self.k(a).view(B, T, self.kv, hs).transpose(1, 2))
            v = self.v(a).view(B, T, self.kv, hs).transpose(1, 2)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            x = x + self.o(y.transpose(1, 2).reshape(B, T, C))
            a = self.n2(x)
            return x + self.dn(F.silu(self.g(a)) * self.u(a))

    class Llama(nn.Module):
        # TinyLlama's layout (untied head, RoPE, grouped-query heads, SwiGLU), each block's
        # activations recomputed in backward as strata's `recompute` does.
        def __init__(self, L, H, kv, d, inter, V, T):
            super().__init__()
            self.emb = nn.Embedding(V, d)
            self.blocks = nn.ModuleList([LlamaBlock(d, H, kv, inter, T) for _ in range(L)])
            self.norm = nn.RMSNorm(d)
            self.head = nn.Linear(d, V, bias=False)
            hs = d // H
            inv = 1.0 / (10000 ** (torch.arange(0, hs, 2).float() / hs))
            f = torch.outer(torch.arange(T).float(), inv)
            f = torch.cat((f, f), -1)
            self.register_buffer("cos", f.cos(), persistent=False)
            self.register_buffer("sin", f.sin(), persistent=False)

        def gpt2_init(self):
            for p in self.parameters():
                with deepspeed.zero.GatheredParameters([p], modifier_rank=0):
                    if len(getattr(p, "ds_shape", p.shape)) == 2:
                        nn.init.normal_(p, 0.0, 0.02)

        def forward(self, idx, targets):
            from torch.utils.checkpoint import checkpoint
            x = self.emb(idx)
            cos, sin = self.cos.to(x.dtype), self.sin.to(x.dtype)
            for b in self.blocks:
                x = checkpoint(b, x, cos, sin, use_reentrant=False)
            logits = self.head(self.norm(x))
            return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))

    swap = os.path.abspath(args.nvme_path)
    zero = {"stage": 3, "stage3_prefetch_bucket_size": 10000000,
            "stage3_param_persistence_threshold": 10000}
    if args.mode == "offload":
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    else:
        shutil.rmtree(swap, ignore_errors=True)
        os.makedirs(swap)
        zero["offload_param"] = {"device": "nvme", "nvme_path": swap, "pin_memory": True}
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": swap, "pin_memory": True,
                                     "buffer_count": 4}
    cfg = {"train_batch_size": args.micro_batch * args.grad_accum,
           "train_micro_batch_size_per_gpu": args.micro_batch,
           "gradient_accumulation_steps": args.grad_accum, "steps_per_print": 1 << 30,
           "gradient_clipping": 1.0, "bf16": {"enabled": True},
           "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8,
                                                     "weight_decay": 0.1}},
           "zero_optimization": zero, "aio": {"block_size": 1 << 20, "queue_depth": 32}}
    print("[ds_zero_gpu] config", json.dumps(cfg), file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    with deepspeed.zero.Init(config_dict_or_path=cfg, pin_memory=True, dtype=torch.bfloat16,
                             remote_device="nvme" if args.mode == "infinity" else None):
        if args.arch == "llama":
            model = Llama(args.n_layer, args.n_head, args.n_kv_head, args.n_embd,
                          args.intermediate, args.vocab, args.context)
        else:
            model = GPT(args.n_layer, args.n_head, args.n_embd, args.vocab, args.context)
    model.gpt2_init()
    n_params = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=cfg)
    init_s = time.perf_counter() - t0
    gen = torch.Generator().manual_seed(2)
    B, T = args.micro_batch, args.context
    times, losses = [], []
    for it in range(args.warmup + args.steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step_losses = []
        for _ in range(args.grad_accum):
            data = torch.randint(0, args.vocab, (B, T + 1), generator=gen).to(dev)
            loss = engine(data[:, :-1], data[:, 1:])
            engine.backward(loss)
            engine.step()
            step_losses.append(loss.item())
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        losses.append(sum(step_losses) / len(step_losses))
        print("[ds_zero_gpu] step %d%s: loss %.4f, %.0f ms, VmHWM %.0f MiB"
              % (it, " (warm-up)" if it < args.warmup else "", losses[-1], dt * 1e3, vm("VmHWM")),
              file=sys.stderr, flush=True)
        if it >= args.warmup:
            times.append(dt)
    med = statistics.median(times)
    tokens = B * T * args.grad_accum
    res = {"impl": "deepspeed", "mode": args.mode, "arch": args.arch, "n_params": n_params,
           "n_layer": args.n_layer, "n_embd": args.n_embd, "context": T, "micro_batch": B,
           "grad_accum": args.grad_accum, "tokens_per_step": tokens,
           "tokens_per_s": tokens / med, "step_s": med, "all_ms": [round(t * 1e3, 2) for t in times],
           "init_s": round(init_s, 2), "losses": [round(x, 5) for x in losses],
           "peak_rss_mib": vm("VmHWM"),
           "peak_device_gib": torch.cuda.max_memory_allocated() / 2**30,
           "optimizer": type(getattr(engine.optimizer, "optimizer", engine.optimizer)).__name__,
           "deepspeed": deepspeed.__version__, "torch": torch.__version__}
    if args.mode == "infinity":
        shutil.rmtree(swap, ignore_errors=True)
    sys.stdout.flush()
    os.dup2(saved, 1)
    out.write(json.dumps(res) + "\n")
    out.flush()


if __name__ == "__main__":
    main()
