#!/usr/bin/env bash
# Adversarial cases, round 3, that need the strata binary (docs/RELIABILITY.md): a LoRA run's
# checkpoint generates the tokens of its merged export (plain, int8 and nf4 bases); `export
# --adapter` has `--out`'s guards (another model, another run's adapter, a missing parent) and
# lands its two files together; `plan --write-config` never writes over a file it did not make.
# usage: hardening3_cli_test.sh STRATA_BINARY REPO_DIR
set -uo pipefail
strata=$1
repo=$2
# shellcheck source=tests/cli_lib.sh
. "$(dirname "$0")/cli_lib.sh"
cd "$work"
mkdir -p swap
fixture="$repo/tests/fixtures/hf/llama"

# lora.json: a LoRA run (r 4) over the llama fixture; plain.json: a config without adapters
# whose model.from_pretrained is $2 (the merged export).
python3 - "$repo" "$fixture" <<'PY'
import json, sys
repo, fixture = sys.argv[1:3]
cfg = json.load(open(repo + "/configs/tiny-cpu.json"))
cfg["model"] = {"from_pretrained": fixture, "context": 32}
cfg["lora"] = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}
cfg["bf16"] = {"enabled": False}
cfg["optimizer"]["params"]["lr"] = 3e-2
cfg["scheduler"]["params"]["warmup_num_steps"] = 1
cfg["train_batch_size"], cfg["gradient_accumulation_steps"] = 8, 2
cfg["train"].update({"steps": 4, "eval_interval": 0, "checkpoint_dir": "ck"})
cfg["zero_optimization"]["offload_optimizer"]["nvme_path"] = "swap"
json.dump(cfg, open("lora.json", "w"), indent=1)
del cfg["lora"]
json.dump(cfg, open("plain.json", "w"), indent=1)
PY
ids() { python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['ids'])" "$1"; }

# A LoRA checkpoint generates what its merged export generates (it generated token 0 forever:
# the decoder read the base modules from the checkpoint, which holds only the adapters).
for quant in none int8 nf4; do
  sets=(--set "lora.base_quantization=\"$quant\"" --set "train.checkpoint_dir=\"ck-$quant\"")
  [ "$quant" = int8 ] && sets+=(--set 'zero_optimization.offload_param.device="none"')
  "$strata" train --config lora.json "${sets[@]}" --quiet >"train-$quant.txt" 2>&1
  check "lora $quant: trains" test $? -eq 0
  "$strata" generate --config lora.json "${sets[@]}" --checkpoint "ck-$quant" --prompt-ids 1,2,3 \
    --max-new-tokens 8 --ignore-eos --json >"gen-$quant.json" 2>"gen-$quant.err"
  check "lora $quant: generate --checkpoint exits 0" test $? -eq 0
  "$strata" export --config lora.json "${sets[@]}" --checkpoint "ck-$quant" --out "merged-$quant" \
    >"export-$quant.txt" 2>&1
  check "lora $quant: export (merged) exits 0" test $? -eq 0
  "$strata" generate --config plain.json --set "model.from_pretrained=\"merged-$quant\"" \
    --prompt-ids 1,2,3 --max-new-tokens 8 --ignore-eos --json >"gen-merged-$quant.json" \
    2>"gen-merged-$quant.err"
  check "lora $quant: generate of the merged export exits 0" test $? -eq 0
  got=$(ids "gen-$quant.json")
  want=$(ids "gen-merged-$quant.json")
  check "lora $quant: the checkpoint generates the merged export's tokens ($got == $want)" \
    test "$got" = "$want"
  check "lora $quant: not token 0 throughout ($got)" test "$got" != "[0, 0, 0, 0, 0, 0, 0, 0]"
done

# pair DIR: the adapter pair DIR holds (r<R>, none, or what is mixed).
pair() { python3 "$repo/tests/adapter_pair.py" "$1"; }

# export --adapter has --out's guards.
ex() { "$strata" export --config lora.json "$@"; }
cp -r "$fixture" model-copy
sum_before=$(cat model-copy/* | md5sum)
ex --checkpoint ck-none --adapter model-copy >a-model.txt 2>&1
check "--adapter into a copy of another model exits 1" test $? -eq 1
check "--adapter into another model names it" grep -q 'holds a model ("LlamaForCausalLM")' a-model.txt
check "--adapter into another model says --force" grep -q -- "--force" a-model.txt
check "--adapter into another model changed nothing" test "$(cat model-copy/* | md5sum)" = "$sum_before"
check "--adapter into another model wrote no adapter" test ! -e model-copy/adapter_config.json
ex --checkpoint ck-none --adapter model-copy --force >a-force.txt 2>&1
check "--adapter --force into another model exits 0" test $? -eq 0
check "--adapter --force leaves the adapter alone (no config.json, no model.safetensors)" \
  test ! -e model-copy/config.json -a ! -e model-copy/model.safetensors -a "$(pair model-copy)" = r4
ex --checkpoint ck-none --adapter deep/er/adapter >a-parent.txt 2>&1
check "--adapter with missing parents exits 0 (created, as --out does)" test $? -eq 0
check "--adapter with missing parents wrote the pair" test "$(pair deep/er/adapter)" = r4
ex --checkpoint ck-none --adapter deep/er/adapter >a-again.txt 2>&1
check "--adapter of the same run again needs no --force" test $? -eq 0
# Another run's adapter (rank 16 over the same base): refused, then replaced with --force.
r16=(--set lora.r=16 --set lora.lora_alpha=32 --set 'train.checkpoint_dir="ck-r16"' --set train.steps=1)
"$strata" train --config lora.json "${r16[@]}" --quiet >train-r16.txt 2>&1
check "a rank-16 run trains" test $? -eq 0
ex "${r16[@]}" --checkpoint ck-r16 --adapter deep/er/adapter >a-other.txt 2>&1
check "--adapter over another run's adapter exits 1" test $? -eq 1
check "--adapter over another run's adapter names it" grep -q "the export of another run" a-other.txt
check "--adapter over another run's adapter changed nothing" test "$(pair deep/er/adapter)" = r4
rm deep/er/adapter/.strata-export.json  # as peft saved it: no lineage
ex "${r16[@]}" --checkpoint ck-r16 --adapter deep/er/adapter >a-peft.txt 2>&1
check "--adapter over a PEFT adapter names it" grep -q "holds a PEFT adapter (of .*, r 4)" a-peft.txt
ex "${r16[@]}" --checkpoint ck-r16 --adapter deep/er/adapter --force >a-force2.txt 2>&1
check "--adapter --force over another run's adapter exits 0" test $? -eq 0
check "--adapter --force wrote the new pair" test "$(pair deep/er/adapter)" = r16
# A merged export and an adapter do not share a directory, even of the same run.
ex --checkpoint ck-none --out merged-none/../shared >a-out.txt 2>&1
ex --checkpoint ck-none --adapter shared >a-shared.txt 2>&1
check "--adapter into this run's merged export is refused" grep -q "this run's merged export" a-shared.txt
check "... and the merged export is still there" test -e shared/config.json -a -e shared/model.safetensors
ex --checkpoint ck-none --adapter "$fixture" >a-base.txt 2>&1
check "--adapter into model.from_pretrained's directory is refused" \
  grep -q "model.from_pretrained's directory" a-base.txt

# The pair lands together: killed (SIGKILL, strace's fault injection) just before each rename,
# exchange or removal an export makes, over the other run's adapter, the directory holds the old
# pair or the new one.
if strace -f -o /dev/null -e trace=rename -e inject=rename:signal=KILL:when=1 true 2>/dev/null; then
  mixes=0 points=0
  for sc in rename renameat renameat2 unlink unlinkat rmdir; do
    for k in $(seq 1 12); do
      ex --checkpoint ck-none --adapter pairs --force >/dev/null 2>&1  # the old pair: r4
      strace -f -o /dev/null -e trace=$sc -e "inject=$sc:signal=KILL:when=$k" \
        "$strata" export --config lora.json "${r16[@]}" --checkpoint ck-r16 --adapter pairs \
        --force >/dev/null 2>&1 &
      { wait $!; } 2>/dev/null
      rc=$?
      got=$(pair pairs)
      case "$got" in
        r4 | r16) ;;
        *) mixes=$((mixes + 1)); echo "  killed before $sc #$k: $got" ;;
      esac
      [ $rc -eq 0 ] && break
      points=$((points + 1))
    done
  done
  check "killed before each of $points renames and removals: the old pair or the new one" \
    test $mixes -eq 0
else
  echo "skipped: killing export --adapter before each rename (strace cannot trace here)"
fi

# plan --write-config writes over no input and no file it did not write (unless --force).
plan=("$strata" plan --seq 16 --backend cpu)
cp -r "$fixture" model-plan
sum_before=$(md5sum <model-plan/config.json)
"${plan[@]}" --hf model-plan --write-config model-plan/config.json >p-model.txt 2>&1
check "plan --write-config over the --hf model's config.json exits 1" test $? -eq 1
check "plan --write-config over the --hf model's config.json names it" \
  grep -q "in --hf's model directory" p-model.txt
check "plan --write-config left the model's config.json alone" \
  test "$(md5sum <model-plan/config.json)" = "$sum_before"
"${plan[@]}" --hf model-plan --write-config model-plan/config.json --force >p-model-f.txt 2>&1
check "plan --write-config into --hf's directory is refused even with --force" test $? -eq 1
cp lora.json input.json
sum_before=$(md5sum <input.json)
"${plan[@]}" --config input.json --write-config input.json >p-input.txt 2>&1
check "plan --write-config over its --config input exits 1" test $? -eq 1
check "plan --write-config over its --config input names it" grep -q "is the --config input" p-input.txt
check "plan --write-config left its input alone" test "$(md5sum <input.json)" = "$sum_before"
echo "notes" >notes.txt
"${plan[@]}" --hf model-plan --write-config notes.txt >p-notes.txt 2>&1
check "plan --write-config over a file it did not write exits 1" test $? -eq 1
check "plan --write-config over a file it did not write says --force" grep -q -- "--force" p-notes.txt
check "plan --write-config left that file alone" test "$(cat notes.txt)" = notes
"${plan[@]}" --hf model-plan --write-config notes.txt --force >p-notes-f.txt 2>&1
check "plan --write-config --force replaces it" grep -q '"written_by": "strata plan"' notes.txt
"${plan[@]}" --hf model-plan --write-config planned.json >p-1.txt 2>&1 &&
  "${plan[@]}" --hf model-plan --write-config planned.json >p-2.txt 2>&1
check "plan --write-config replaces its own config without --force" test $? -eq 0
check "plan's config loads as written (strata.written_by is a key)" \
  "$strata" plan --config planned.json >p-load.txt 2>&1
check "plan --help documents the mark and --force" grep -q "written_by" <("$strata" plan --help)
# --json and --svg likewise: their own earlier output is replaced, nothing else.
"${plan[@]}" --hf model-plan --json report.json --svg chart.svg >p-js1.txt 2>&1 &&
  "${plan[@]}" --hf model-plan --json report.json --svg chart.svg >p-js2.txt 2>&1
check "plan --json/--svg replace their own earlier output" test $? -eq 0
"${plan[@]}" --hf model-plan --json notes.txt >p-json.txt 2>&1
check "plan --json over a file it did not write exits 1" test $? -eq 1
"${plan[@]}" --config input.json --svg input.json >p-svg.txt 2>&1
check "plan --svg over its --config input exits 1" test $? -eq 1
check "plan --svg left its input alone" test "$(md5sum <input.json)" = "$sum_before"

# A token file whose prepare_data journal is still there is refused, naming the way out.
python3 -c "
import struct
with open('tok.bin', 'wb') as f:
    f.write(struct.pack('<256i', 20240520, 1, 64, *([0] * 253)) + struct.pack('<64H', *range(64)))"
echo '{}' >tok.bin.commit
"$strata" eval --config lora.json --set 'data.source="tok.bin"' >journal.txt 2>&1
check "a token file beside its prepare_data journal is refused (rc 1)" test $? -eq 1
check "the journal's message says to run prepare_data again" grep -q "run prepare_data.py again" journal.txt

# Tokenizer failures name the real problem; only a missing library blames STRATA_PYTHON.
gen=("$strata" generate --config lora.json --checkpoint ck-none)
printf 'ab\xffc' >bad-utf8.txt
"${gen[@]}" --prompt-file bad-utf8.txt >g-utf8.txt 2>&1
check "generate: a prompt that is not UTF-8 is named (byte 2)" grep -q "not valid UTF-8: byte 2" g-utf8.txt
check "generate: ... and STRATA_PYTHON is not blamed" test -z "$(grep STRATA_PYTHON g-utf8.txt)"
mkdir -p no-tokenizer truncated
"${gen[@]}" --prompt hi --tokenizer no-tokenizer >g-none.txt 2>&1
check "generate: a directory without tokenizer files is named" grep -q "holds no tokenizer files" g-none.txt
check "generate: ... and STRATA_PYTHON is not blamed" test -z "$(grep STRATA_PYTHON g-none.txt)"
head -c 100 "$fixture/tokenizer.json" >truncated/tokenizer.json
"${gen[@]}" --prompt hi --tokenizer truncated >g-trunc.txt 2>&1
check "generate: a truncated tokenizer.json is named" grep -q "tokenizer.json is not valid JSON" g-trunc.txt
check "generate: ... and STRATA_PYTHON is not blamed" test -z "$(grep STRATA_PYTHON g-trunc.txt)"
"${gen[@]}" --prompt-ids "$(seq -s, 1 40)" >g-long.txt 2>&1
check "generate: a prompt past the context gives its own length" \
  grep -q "the prompt has 40 tokens, more than model.context 32" g-long.txt
# A 5 MB prompt is refused after a piece of it is tokenized (a byte-level test double of
# transformers: the tokenizer's peak memory is that of the piece, not of 5 MB of ids).
mkdir -p fake-transformers
cat >fake-transformers/transformers.py <<'PY'
class _Tok:
    eos_token_id = 2
    def __call__(self, text, add_special_tokens=True):
        ids = [b + 3 for b in text.encode("utf-8")]
        return {"input_ids": [1] + ids if add_special_tokens else ids}
class AutoTokenizer:
    @staticmethod
    def from_pretrained(path):
        return _Tok()
PY
python3 -c "import sys; sys.stdout.write('lorem ipsum dolor sit amet ' * 200000)" >huge-prompt.txt
PYTHONPATH=$PWD/fake-transformers "${gen[@]}" --prompt-file huge-prompt.txt >g-huge.txt 2>&1
check "generate: a 5 MB prompt is refused (rc 1)" test $? -eq 1
check "generate: ... naming the context and the count of its first piece" \
  grep -q "the prompt has more tokens than model.context 32 (its first 65534 characters alone are 65535 tokens)" g-huge.txt

# Absurd LoRA scaling and ranks are refused where they are given.
"$strata" train --config lora.json --set lora.lora_alpha=1e30 --set 'train.checkpoint_dir="x-alpha"' \
  >alpha.txt 2>&1
check "lora_alpha 1e30 is refused (rc 1)" test $? -eq 1
check "lora_alpha 1e30 is refused naming the scaling" grep -q "scaling 2.5e+29" alpha.txt
"$strata" plan --hf "$fixture" --seq 16 --backend cpu --lora 100000 --write-config big-r.json \
  >plan-r.txt 2>&1
check "plan --lora 100000 is refused (rc 1)" test $? -eq 1
check "plan --lora 100000 names lora.r's range" grep -q "lora.r: 100000 out of range" plan-r.txt
check "plan --lora 100000 wrote no config" test ! -e big-r.json
# A rank in range plans without a batch given (the flags' default: one sequence a micro-batch).
"$strata" plan --hf "$fixture" --seq 16 --backend cpu --lora 8 >plan-r8.txt 2>&1
check "plan --lora 8 without a batch plans (rc 0)" test $? -eq 0
check "plan --lora 8 plans the adapters" grep -q "with LoRA r=8" plan-r8.txt

# data.eval_source: a short one is named as such; data.source's own file warns.
python3 -c "
import struct
def w(p, n):
    open(p, 'wb').write(struct.pack('<256i', 20240520, 1, n, *([0] * 253)) +
                        struct.pack(f'<{n}H', *[i % 100 for i in range(n)]))
w('big.bin', 4000); w('short.bin', 10)"
ev=(--config lora.json --set 'data.source="big.bin"' --set 'train.checkpoint_dir="x-ev"')
"$strata" train "${ev[@]}" --set 'data.eval_source="short.bin"' >ev-train.txt 2>&1
check "train: a short data.eval_source is named" grep -q "data.eval_source: 'short.bin' holds 10 tokens" ev-train.txt
"$strata" eval "${ev[@]}" --set 'data.eval_source="short.bin"' >ev-eval.txt 2>&1
check "eval: a short data.eval_source is named" grep -q "data.eval_source: short.bin holds 10 tokens" ev-eval.txt
"$strata" train "${ev[@]}" --set 'data.eval_source="big.bin"' --set train.steps=1 >ev-same.txt 2>&1
check "data.eval_source = data.source warns" grep -q "data.eval_source 'big.bin' is data.source's file" ev-same.txt

# Monitors: a directory that cannot be made is named with the errno text; an empty job_name
# without an output_path is refused (the files would land among the checkpoints).
tr1=(--config lora.json --set train.steps=1)
echo x >afile
"$strata" train "${tr1[@]}" --set 'train.checkpoint_dir="x-tb"' --set tensorboard.enabled=true \
  --set 'tensorboard.output_path="afile/sub"' >tb-bad.txt 2>&1
check "tensorboard: an output_path that cannot be made says why" \
  grep -q "tensorboard.output_path: cannot create 'afile/sub/DeepSpeedJobName': Not a directory" tb-bad.txt
"$strata" train "${tr1[@]}" --set 'train.checkpoint_dir="x-tb2"' --set tensorboard.enabled=true \
  --set 'tensorboard.output_path="tb-new/deeper"' >tb-new.txt 2>&1
check "tensorboard: a new output_path is created with its parents" \
  test -n "$(ls tb-new/deeper/DeepSpeedJobName 2>/dev/null | grep tfevents)"
"$strata" train "${tr1[@]}" --set 'train.checkpoint_dir="x-csv"' --set csv_monitor.enabled=true \
  --set 'csv_monitor.job_name=""' >csv-empty.txt 2>&1
check "csv_monitor.job_name \"\" without output_path is refused" \
  grep -q "csv_monitor.job_name is empty" csv-empty.txt
check "... and no CSV lands among the checkpoints" test -z "$(ls x-csv 2>/dev/null | grep csv)"

# A mixture's sizes from config.json are named by their config.json key.
cp -r "$repo/tests/fixtures/hf/mixtral" mixtral
python3 -c "
import json
c = json.load(open('mixtral/config.json')); c['num_local_experts'] = 70000
json.dump(c, open('mixtral/config.json', 'w'))
c = json.load(open('plain.json')); c['model'] = {'from_pretrained': 'mixtral', 'context': 16}
json.dump(c, open('mixtral.json', 'w'))"
"$strata" train --config mixtral.json >moe.txt 2>&1
check "num_local_experts out of range is named as config.json names it" \
  grep -q "mixtral/config.json: num_local_experts is beyond what strata trains" moe.txt

# strata.optimizer.defer without the overlap it applies to: a warning naming both keys.
"$strata" plan --config lora.json --set strata.optimizer.overlap=false \
  --set 'strata.optimizer.defer="always"' >defer.txt 2>&1
check "defer with overlap off warns" \
  grep -q "strata.optimizer.defer = always has no effect with strata.optimizer.overlap = false" defer.txt

# Resuming with another model: the differing field, and the way from a full fine-tune to LoRA.
"$strata" train --config plain.json --set 'train.checkpoint_dir="full"' --set train.steps=2 \
  >full.txt 2>&1
"$strata" train --config lora.json --set 'train.checkpoint_dir="full"' --set train.steps=3 \
  --resume >full-lora.txt 2>&1
check "resuming a full fine-tune as LoRA says how (export, then from_pretrained)" \
  grep -q "the checkpoint is a full fine-tune and the config adds LoRA adapters.*strata export --out DIR" full-lora.txt
"$strata" train --config lora.json --set 'train.checkpoint_dir="ck-none"' --set train.steps=6 \
  --set model.context=16 --resume >ctx.txt 2>&1
check "resuming with another context names the one field" \
  grep -q "differs from the config's: T 32 in the checkpoint, 16 in the config" ctx.txt

exit $fail
