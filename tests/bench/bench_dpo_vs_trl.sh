#!/bin/bash
# DPO training throughput (README.md, "Preference training (DPO)"): strata's CPU backend against
# TRL's DPOTrainer (PyTorch on the CPU), the same model, the same pairs, the same step:
#   - the model: bench_llama_vs_torch.sh's ~110M Llama (L=12, C=768, 12 heads, 4 key/value,
#     SwiGLU 1536, vocab 32000, untied head; random weights, bf16 on disk), made here with
#     transformers and kept in $WORK, never committed;
#   - the data: NPAIRS (default 2 x STEPS) generated preference pairs of token ids (seed 0), each
#     sequence BOS + 96 prompt tokens + 159 answer tokens + EOS = 257 tokens (T = 256 inputs; no
#     padding on either side). strata gets them as prepare_data.py --format preference writes
#     them (an llm.c uint16 token file, magic 20240520, the vocabulary fitting 16 bits; the
#     <file>.mask sidecar of src/train/loss_mask.h marked as preference pairs); TRL gets the same
#     pairs in its standard string form (JSONL {"prompt", "chosen", "rejected"}) with a word-level
#     tokenizer made here whose word "t<id>" is token <id> ("<s>" 1, "</s>" 2), tokenized by TRL's
#     own code; the TRL run checks that its token ids are the strata file's before it trains;
#   - the step: 2 pairs (B = 4 rows: chosen, rejected), 1 rank, no accumulation, AdamW (betas
#     0.9/0.999, eps 1e-8, no weight decay, constant lr 5e-6, LoRA 5e-5), clipping 1.0, beta 0.1,
#     the sigmoid loss, dropout off; bf16 compute with fp32 weights and AdamW state (strata:
#     bf16.enabled; TRL: DPOConfig(bf16=True, use_cpu=True): torch.autocast on the CPU over the
#     fp32 model). LORA=1 (default): r 16, alpha 32, all-linear, dropout 0 (TRL through PEFT's
#     LoraConfig); LORA=0: full fine-tuning;
#   - the reference: computed once before the first step by both (strata always; TRL with
#     precompute_ref_log_probs=True), timed on its own and not counted in the step rate.
# Runs alternate (strata, TRL, strata, TRL, ...); each trains STEPS steps, drops the first WARMUP
# (default 2) and reports the median pairs/s and tokens/s (4 x 256 tokens a step), the reference
# pass, and the loss of step 1 (ln 2 = 0.6931 for both: the policy is the reference). Both use
# every core (strata: device.cpu_threads 0; torch: set_num_threads(nproc)).
# usage (from the source dir, after building build/tools/strata):
#   PYTHON=/path/to/venv/bin/python [LORA=1|0] [WARMUP=2] [NPAIRS=2*STEPS] [WORK=dir] \
#     tests/bench/bench_dpo_vs_trl.sh [ROUNDS] [STEPS]
# PYTHON must have torch, transformers, trl, datasets and (LORA=1) peft: a throwaway venv. TRL
# and torch are never dependencies of strata. The default (LoRA, 3 rounds of 6 steps) takes about
# ten minutes on a 2-core machine, LORA=0 longer (TRL's full fine-tuning step is the slowest
# part); take the numbers on a quiet machine (the load is printed).
# STRATA_CPU_ISA (docs/ARCHITECTURE.md) is passed to strata as set and printed with its runs.
set -euo pipefail
rounds=${1:-3}
steps=${2:-6}
py=${PYTHON:-python3}
strata=${STRATA:-build/tools/strata}
lora=${LORA:-1}
warmup=${WARMUP:-2}
npairs=${NPAIRS:-$((2 * steps))}
work=${WORK:-/tmp/strata_bench_dpo}
B=4 T=256 PROMPT=96 ANSWER=160
case "$lora" in
  1) lr=5e-5 ;;
  0) lr=5e-6 ;;
  *) echo "LORA=$lora: 1 (LoRA r 16) or 0 (full fine-tuning)" >&2; exit 2 ;;
esac
[ "$warmup" -lt "$steps" ] || { echo "WARMUP=$warmup leaves none of $steps steps" >&2; exit 2; }
mkdir -p "$work/swap"
cores=$(nproc)
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_NO_ADVISORY_WARNINGS=1 TQDM_DISABLE=1

# The model: bench_llama_vs_torch.sh's llama shape.
if [ ! -f "$work/model/config.json" ]; then
  "$py" - "$work/model" <<'PY'
import sys, torch, transformers
cfg = transformers.LlamaConfig(vocab_size=32000, hidden_size=768, intermediate_size=1536,
                               num_hidden_layers=12, num_attention_heads=12,
                               num_key_value_heads=4, max_position_embeddings=1024,
                               tie_word_embeddings=False, rope_theta=500000.0)
torch.manual_seed(0)
m = transformers.AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)
m.config.torch_dtype = torch.bfloat16
m.save_pretrained(sys.argv[1], safe_serialization=True)
print(f"{sys.argv[1]}: {sum(p.numel() for p in m.parameters()):,} parameters (bf16)")
PY
fi

# The pairs: token ids drawn once (seed 0), written for strata (pairs.bin + pairs.bin.mask, the
# layout of tools/prepare_data.py) and for TRL (pairs.jsonl, and the word-level tokenizer tok/).
"$py" - "$work" "$npairs" "$PROMPT" "$ANSWER" <<'PY'
import json, os, struct, sys, zlib
import numpy as np
work, npairs, prompt_len, answer_len = sys.argv[1], *map(int, sys.argv[2:])
V, BOS, EOS = 32000, 1, 2
LOSS, START = 1, 2                                  # src/train/loss_mask.h kMaskLoss, kMaskStart
rng = np.random.default_rng(0)
tokens, mask, rows = [], [], []
for _ in range(npairs):
    prompt = [BOS] + rng.integers(3, V, prompt_len).tolist()
    answers = [rng.integers(3, V, answer_len - 1).tolist() + [EOS] for _ in range(2)]
    for ans in answers:                             # conversation 2k chosen, 2k + 1 rejected
        tokens += prompt + ans
        mask += [START] + [0] * prompt_len + [LOSS] * answer_len
    word = lambda ids: " ".join("<s>" if i == BOS else "</s>" if i == EOS else f"t{i}"
                                for i in ids)
    rows.append({"prompt": word(prompt), "chosen": " " + word(answers[0]),
                 "rejected": " " + word(answers[1])})

def i32(x):
    return x - (1 << 32) if x >= 1 << 31 else x

def header(words):
    return struct.pack("<256i", *(words + [0] * (256 - len(words))))

data = np.asarray(tokens, dtype="<u2").tobytes()    # uint16: the vocabulary fits (prepare_data)
mbytes = bytes(mask)
with open(f"{work}/pairs.bin", "wb") as f:
    f.write(header([20240520, 1, len(tokens)]) + data)
with open(f"{work}/pairs.bin.mask", "wb") as f:
    f.write(header([20261125, 1, len(tokens), i32(zlib.crc32(data)), i32(zlib.crc32(mbytes)),
                    2 * npairs, 1]) + mbytes)
with open(f"{work}/pairs.jsonl", "w") as f:
    for r in rows:
        f.write(json.dumps(r) + "\n")

import tokenizers, transformers
vocab = {"<unk>": 0, "<s>": BOS, "</s>": EOS, **{f"t{i}": i for i in range(3, V)}}
tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                     unk_token="<unk>", pad_token="</s>").save_pretrained(
                                         f"{work}/tok")
print(f"{npairs} pairs of 2 x {len(tokens) // (2 * npairs)} tokens: {work}/pairs.bin(.mask), "
      f"{work}/pairs.jsonl")
PY

lora_json=""
[ "$lora" = 1 ] && lora_json='"lora": {"r": 16, "lora_alpha": 32, "lora_dropout": 0.0,
          "target_modules": "all-linear"},'
cat >"$work/strata.json" <<JSON
{"train_batch_size": $B, "train_micro_batch_size_per_gpu": $B, "gradient_accumulation_steps": 1,
 "steps_per_print": 1, "bf16": {"enabled": true}, "gradient_clipping": 1.0,
 "optimizer": {"type": "AdamW", "params": {"lr": $lr, "betas": [0.9, 0.999], "eps": 1e-8,
                                           "weight_decay": 0.0}},
 "zero_optimization": {"stage": 3,
   "offload_param": {"device": "none", "nvme_path": "$work/swap"},
   "offload_optimizer": {"device": "none", "nvme_path": "$work/swap"}},
 "model": {"from_pretrained": "$work/model", "context": $T},
 $lora_json
 "dpo": {"beta": 0.1, "label_smoothing": 0.0, "loss_type": "sigmoid"},
 "data": {"source": "$work/pairs.bin", "seq_len": $T, "eval_fraction": 0},
 "device": {"backend": "cpu", "cpu_threads": 0, "memory_limit": "6GiB"},
 "train": {"steps": $steps, "eval_interval": 0, "checkpoint_interval": 0,
           "checkpoint_dir": "$work/ckpt"}}
JSON

trl_run() {
  rm -rf "$work/trl_out" "$work/hf_datasets"  # no cached reference log-probs from a run before
  HF_DATASETS_CACHE="$work/hf_datasets" "$py" - "$work" "$B" "$T" "$steps" "$cores" "$warmup" \
    "$lora" "$lr" 2>"$work/trl.err" <<'PY' || { tail -30 "$work/trl.err"; exit 1; }
import sys, time, statistics, numpy as np, torch, transformers, datasets, trl
work, B, T, steps, cores, warmup, lora = sys.argv[1], *map(int, sys.argv[2:8])
lr = float(sys.argv[8])
torch.set_num_threads(cores)
transformers.logging.set_verbosity_error()
datasets.disable_progress_bars()
model = transformers.AutoModelForCausalLM.from_pretrained(f"{work}/model", dtype=torch.float32)
tok = transformers.AutoTokenizer.from_pretrained(f"{work}/tok")
peft_config = None
if lora:
    import peft
    peft_config = peft.LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0,
                                  target_modules="all-linear", task_type="CAUSAL_LM")
args = trl.DPOConfig(
    output_dir=f"{work}/trl_out", use_cpu=True, bf16=True, per_device_train_batch_size=B // 2,
    gradient_accumulation_steps=1, max_steps=steps, learning_rate=lr, lr_scheduler_type="constant",
    warmup_steps=0, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8,
    max_grad_norm=1.0, beta=0.1, loss_type=["sigmoid"], precompute_ref_log_probs=True,
    disable_dropout=True, max_length=None, logging_steps=1, save_strategy="no",
    report_to="none", disable_tqdm=True, dataloader_num_workers=0, seed=0)

class Trainer(trl.DPOTrainer):
    ref_s = 0.0

    def _precompute_ref_logps(self, dataset, name, batch_size):
        t0 = time.perf_counter()
        out = super()._precompute_ref_logps(dataset, name, batch_size)
        Trainer.ref_s += time.perf_counter() - t0
        return out

class Clock(transformers.TrainerCallback):
    def __init__(self):
        self.times, self.losses = [], {}

    def on_step_begin(self, args, state, control, **kw):
        self.t0 = time.perf_counter()

    def on_step_end(self, args, state, control, **kw):
        self.times.append(time.perf_counter() - self.t0)
        print(f"  trl step {len(self.times)}: {self.times[-1]:.2f} s", flush=True)

    def on_log(self, args, state, control, logs=None, **kw):
        if logs and "loss" in logs:
            self.losses[state.global_step] = logs["loss"]

data = datasets.load_dataset("json", data_files=f"{work}/pairs.jsonl", split="train")
clock = Clock()
trainer = Trainer(model=model, args=args, train_dataset=data, processing_class=tok,
                  peft_config=peft_config, callbacks=[clock])
trainer.remove_callback(transformers.PrinterCallback)  # the metrics dict of every step
# The same token ids as strata's file: each pair's chosen then rejected sequence.
ids = np.fromfile(f"{work}/pairs.bin", dtype="<u2", offset=1024).astype(np.int64).tolist()
seqs = []
for ex in trainer.train_dataset:
    seqs += ex["prompt_ids"] + ex["chosen_ids"] + ex["prompt_ids"] + ex["rejected_ids"]
assert seqs == ids, "TRL's tokenized pairs differ from the strata token file"
n = len(trainer.train_dataset)
what = "LoRA (PEFT)" if lora else "full"
print(f"  trl: {what}, optim {args.optim}, bf16 autocast {args.bf16}, weights "
      f"{next(model.parameters()).dtype}, device {trainer.args.device}, {n} pairs")
trainer.train()
kept = clock.times[warmup:]
med = statistics.median(kept)
print(f"trl:    {B // 2 / med:6.3f} pairs/s, {B * T / med:7.1f} tokens/s (median of {len(kept)} "
      f"steps, {med:.2f} s/step); reference {trainer.ref_s:.2f} s for {n} pairs; "
      f"step-1 loss {clock.losses.get(1, float('nan')):.6f} (ln 2 = 0.693147)")
PY
}

strata_run() {
  rm -rf "$work/ckpt"
  "$strata" train --config "$work/strata.json" --quiet >/dev/null 2>"$work/strata.err" ||
    { cat "$work/strata.err"; exit 1; }
  echo "  STRATA_CPU_ISA=${STRATA_CPU_ISA:-(unset)}:" \
    "$(grep -m1 -o 'GEMM on the [a-z0-9]* path' "$work/strata.err" || echo 'GEMM path not logged')"
  local ref
  ref=$(sed -n "s/.*DPO: the reference's log-probabilities of \([0-9]*\) pairs in \([0-9.]*\) s.*/\2 s for \1 pairs/p" \
    "$work/strata.err" | tail -1)
  "$py" - "$work/ckpt/metrics.jsonl" "$B" "$T" "$warmup" "${ref:-(not logged)}" <<'PY'
import sys, json, statistics
rows = [json.loads(l) for l in open(sys.argv[1]) if '"loss"' in l and '"step_s"' in l]
B, T, warmup, ref = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
for r in rows:
    print(f"  strata step {r['step']}: {r['step_s']:.2f} s", flush=True)
kept = [r["step_s"] for r in rows if r["step"] > warmup]
med = statistics.median(kept)
first = next(r["loss"] for r in rows if r["step"] == 1)
print(f"strata: {B // 2 / med:6.3f} pairs/s, {B * T / med:7.1f} tokens/s (median of {len(kept)} "
      f"steps, {med:.2f} s/step); reference {ref}; step-1 loss {first:.6f} (ln 2 = 0.693147)")
PY
}

echo "== DPO $([ "$lora" = 1 ] && echo "LoRA r 16 (lr $lr)" || echo "full fine-tuning (lr $lr)"):" \
  "$((B / 2)) pairs ($B x $T tokens) per step, $steps steps per run (first $warmup dropped)," \
  "$npairs pairs, alternated"
echo "   CPU: $(lscpu | sed -n 's/^Model name: *//p'), $cores cores; flags:" \
  "$(for f in avx2 avx512f avx512_bf16 amx_bf16 amx_tile; do
       grep -qw "$f" /proc/cpuinfo && printf '%s ' "$f"; done)"
echo "   load before: $(uptime)"
: >"$work/results.txt"
for r in $(seq 1 "$rounds"); do
  echo "-- round $r"
  strata_run | tee -a "$work/results.txt"
  trl_run | tee -a "$work/results.txt"
done
echo "   load after: $(uptime)"
"$py" - "$work/results.txt" $((B * T / 2)) <<'PY'
import re, statistics, sys
per_pair = int(sys.argv[2])
rates = {"strata": [], "trl": []}
for line in open(sys.argv[1]):
    m = re.match(r"(strata|trl):\s+([0-9.]+) pairs/s", line)
    if m:
        rates[m[1]].append(float(m[2]))
s, t = statistics.median(rates["strata"]), statistics.median(rates["trl"])
print(f"== medians over {len(rates['strata'])} round(s): strata {s:.3f} pairs/s "
      f"({s * per_pair:.1f} tokens/s), TRL {t:.3f} pairs/s ({t * per_pair:.1f} tokens/s); "
      f"strata / TRL = {s / t:.2f}x")
PY
