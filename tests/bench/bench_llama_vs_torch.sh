#!/bin/bash
# A ~110M-parameter Llama on the CPU (docs/BENCHMARKS.md, "Llama and Hugging Face checkpoints"),
# or with MODEL=qwen3 the same shape with Qwen3's attention (heads 128 wide: an attention of 1536
# in the width 768; query/key norms; ~129M parameters):
#   1. import: model.from_pretrained of a transformers-written checkpoint (random weights, bf16,
#      made here with transformers and kept in $WORK, never committed) into each tier, timed by
#      strata's own "loaded ... in S s" line (strata eval on a one-window token file);
#   2. training tokens/s, strata's CPU backend against PyTorch's CPU training of the same model
#      (transformers' LlamaForCausalLM or Qwen3ForCausalLM, bf16 autocast, fp32 AdamW), in
#      alternated runs: strata,
#      torch, strata, torch, ... Each run trains STEPS steps of B x T tokens; the first WARMUP
#      (default 2) steps of each run are dropped; the rest are reported as median tokens/s.
# Both use every core of the machine (strata: device.cpu_threads 0; torch: set_num_threads).
# usage (from the source dir, after building build/tools/strata):
#   PYTHON=/path/to/venv/bin/python [MODEL=llama|qwen3] [WARMUP=2] [IMPORT_RUNS=3] \
#     tests/bench/bench_llama_vs_torch.sh [ROUNDS] [STEPS]
# PYTHON must have torch and transformers (a throwaway venv; never a dependency of strata).
# STRATA_CPU_ISA (docs/ARCHITECTURE.md: the CPU GEMM path, e.g. onednn or avx2) is passed to
# strata as set and printed with each round's result.
set -euo pipefail
rounds=${1:-3}
steps=${2:-6}
py=${PYTHON:-python3}
strata=${STRATA:-build/tools/strata}
model=${MODEL:-llama}
work=${WORK:-/tmp/strata_bench_$model}
warmup=${WARMUP:-2}
import_runs=${IMPORT_RUNS:-3}
B=1 T=256
mkdir -p "$work/swap"
cores=$(nproc)

# The model: L=12, C=768, 12 heads (4 key/value), SwiGLU 1536, vocab 32000, untied head; qwen3:
# the heads 128 wide with query/key norms.
case "$model" in
  llama | qwen3) ;;
  *) echo "MODEL=$model: llama or qwen3" >&2; exit 2 ;;
esac
if [ ! -f "$work/model/config.json" ]; then
  "$py" - "$work/model" "$model" <<'PY'
import sys, torch, transformers
shape = dict(vocab_size=32000, hidden_size=768, intermediate_size=1536, num_hidden_layers=12,
             num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=1024,
             tie_word_embeddings=False)
if sys.argv[2] == "qwen3":
    cfg = transformers.Qwen3Config(head_dim=128, rope_theta=1000000.0, **shape)
else:
    cfg = transformers.LlamaConfig(rope_theta=500000.0, **shape)
torch.manual_seed(0)
m = transformers.AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)
m.config.torch_dtype = torch.bfloat16
m.save_pretrained(sys.argv[1], safe_serialization=True)
print(f"{sys.argv[1]}: {sum(p.numel() for p in m.parameters()):,} parameters (bf16)")
PY
fi
# Tokens: a fixed random corpus over the vocabulary (raw uint32).
"$py" - "$work" $((T + 1)) 2000000 <<'PY'
import sys, numpy as np
rng = np.random.default_rng(0)
rng.integers(0, 32000, int(sys.argv[2]), dtype=np.uint32).tofile(sys.argv[1] + "/window.u32")
rng.integers(0, 32000, int(sys.argv[3]), dtype=np.uint32).tofile(sys.argv[1] + "/train.u32")
PY
cat >"$work/strata.json" <<JSON
{"train_batch_size": $B, "train_micro_batch_size_per_gpu": $B, "gradient_accumulation_steps": 1,
 "steps_per_print": 1, "bf16": {"enabled": true}, "gradient_clipping": 1.0,
 "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "betas": [0.9, 0.95], "eps": 1e-8,
                                           "weight_decay": 0.1}},
 "zero_optimization": {"stage": 3,
   "offload_param": {"device": "none", "nvme_path": "$work/swap"},
   "offload_optimizer": {"device": "none", "nvme_path": "$work/swap"}},
 "model": {"from_pretrained": "$work/model", "context": $T},
 "data": {"source": "$work/train.u32"},
 "device": {"backend": "cpu", "memory_limit": "6GiB"},
 "train": {"steps": $steps, "eval_interval": 0, "checkpoint_interval": 0,
           "checkpoint_dir": "$work/ckpt"}}
JSON

echo "== import into each tier ($import_runs run(s) each; seconds of strata's 'loaded' line)"
for tier in none cpu nvme; do
  for i in $(seq 1 "$import_runs"); do
    "$strata" eval --config "$work/strata.json" --set "data.source=\"$work/window.u32\"" \
      --set "zero_optimization.offload_param.device=\"$tier\"" \
      --set "zero_optimization.offload_optimizer.device=\"$tier\"" 2>&1 >/dev/null |
      sed -n "s/.*loaded .* (\(.*\) of weights) in \(.*\) s/params $tier run $i: \1 in \2 s/p"
  done
done

torch_run() {
  "$py" - "$work/model" "$work/train.u32" "$B" "$T" "$steps" "$cores" "$warmup" <<'PY'
import sys, time, statistics, numpy as np, torch, transformers
path, data, B, T, steps, cores, warmup = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:])
torch.set_num_threads(cores)
model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
model.train()
opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), eps=1e-8,
                        weight_decay=0.1)
tokens = torch.from_numpy(np.fromfile(data, dtype=np.uint32).astype(np.int64))
rng = np.random.default_rng(1)
times = []
for s in range(steps):
    offs = rng.integers(0, len(tokens) - T - 1, B)
    x = torch.stack([tokens[o:o + T] for o in offs])
    y = torch.stack([tokens[o + 1:o + T + 1] for o in offs])
    t0 = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(input_ids=x).logits
    loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                             y.reshape(-1))
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    times.append(time.perf_counter() - t0)
    print(f"  torch step {s + 1}: {times[-1]:.2f} s", flush=True)
kept = times[warmup:]
print(f"torch:  {B * T / statistics.median(kept):8.1f} tokens/s (median of {len(kept)} steps, "
      f"{statistics.median(kept):.2f} s/step; loss {loss.item():.3f})")
PY
}

strata_run() {
  rm -rf "$work/ckpt"
  "$strata" train --config "$work/strata.json" --quiet "$@" >/dev/null 2>"$work/strata.err" ||
    { cat "$work/strata.err"; exit 1; }
  echo "  STRATA_CPU_ISA=${STRATA_CPU_ISA:-(unset)}:" \
    "$(grep -m1 -o 'GEMM on the [a-z0-9]* path' "$work/strata.err" || echo 'GEMM path not logged')"
  "$py" - "$work/ckpt/metrics.jsonl" "$B" "$T" "$warmup" <<'PY'
import sys, json, statistics
rows = [json.loads(l) for l in open(sys.argv[1]) if '"loss"' in l]
B, T, warmup = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
for r in rows:
    print(f"  strata step {r['step']}: {r['step_s']:.2f} s", flush=True)
kept = [r["step_s"] for r in rows if r["step"] > warmup]
print(f"strata: {B * T / statistics.median(kept):8.1f} tokens/s (median of {len(kept)} steps, "
      f"{statistics.median(kept):.2f} s/step; loss {rows[-1]['loss']:.3f})")
PY
}

echo "== training, $B x $T tokens per step, $steps steps per run (first $warmup dropped), alternated"
echo "   load average before: $(cut -d' ' -f1-3 /proc/loadavg)"
for r in $(seq 1 "$rounds"); do
  echo "-- round $r"
  strata_run
  torch_run
done
echo "   load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
