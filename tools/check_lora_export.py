#!/usr/bin/env python3
"""Checks that peft loads what `strata export --adapter` writes and gives strata's eval loss,
and that transformers loads a LoRA run's merged `strata export` with the same loss.

For each base fixture (tests/fixtures/hf/{llama,qwen2,gpt2,mixtral,qwen2-moe}) and each lora
section of
RUNS (r 4, alpha 8, every block linear layer; then PEFT's wider vocabulary: lora_dropout,
use_rslora, target_modules "all-linear" and regular expressions): `strata train` a LoRA run (6
steps at lr 1e-2, fp32, so B is far from its zero start) from model.from_pretrained; `strata
eval --json` of its checkpoint over the fixture's eval_tokens (eval runs without dropout, as
peft's eval()); then
  - `strata export --adapter DIR`, peft.PeftModel.from_pretrained(base, DIR): its mean
    next-token loss over the same windows must be strata's (1e-5 relative);
  - `strata export --out DIR` (the base with the adapters merged), transformers'
    AutoModelForCausalLM.from_pretrained(DIR): the same loss (1e-5 relative);
  - the adapter_config.json peft loaded keeps the section's r, lora_alpha, lora_dropout,
    use_rslora, target_modules (a pattern as given) and target_parameters (the mixtures'
    routed experts), and peft's loaded LoraConfig has them.

Needs torch, transformers and peft (a throwaway venv; never a dependency of the build).
Without them it prints why and exits 77, which ctest reports as skipped (tests/lora.cmake,
lora_export_peft; STRATA_HF_PYTHON names the interpreter that has them).

usage: check_lora_export.py --strata build/tools/strata [--work DIR]
"""
import argparse
import json
import os
import struct
import subprocess
import sys
import tempfile

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# (run name, base fixture, lora section)
RUNS = [
    ("llama", "llama", {"r": 4, "lora_alpha": 8, "target_modules": ALL}),
    ("qwen2", "qwen2", {"r": 4, "lora_alpha": 8, "target_modules": ALL}),
    ("gpt2", "gpt2", {"r": 4, "lora_alpha": 8, "target_modules": ["c_attn", "c_proj", "c_fc"]}),
    ("llama-all-linear-rslora-dropout", "llama",
     {"r": 4, "lora_alpha": 8, "target_modules": "all-linear", "use_rslora": True,
      "lora_dropout": 0.1}),
    ("qwen2-regex-dropout", "qwen2",
     {"r": 4, "lora_alpha": 8, "lora_dropout": 0.05,
      "target_modules": r"model\.layers\.\d+\.(self_attn\.(q|v)_proj|mlp\.down_proj)"}),
    ("gpt2-regex-rslora", "gpt2",
     {"r": 4, "lora_alpha": 8, "use_rslora": True,
      "target_modules": r"transformer\.h\.\d+\.(attn\.c_attn|mlp\.c_fc)"}),
    # The mixtures: "all-linear" is the attention (and Qwen2-MoE's shared expert and its gate);
    # the router and the experts are not linear layers in transformers.
    ("mixtral-all-linear-dropout", "mixtral",
     {"r": 4, "lora_alpha": 8, "target_modules": "all-linear", "lora_dropout": 0.05}),
    ("qwen2-moe-all-linear", "qwen2-moe",
     {"r": 4, "lora_alpha": 8, "target_modules": "all-linear"}),
    # The routed experts' fused parameters (peft's target_parameters): the merged export adds
    # each expert's delta to its weights.
    ("mixtral-experts", "mixtral",
     {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"],
      "target_parameters": ["experts.gate_up_proj", "experts.down_proj"]}),
    # The experts alone (peft's target_modules=[]).
    ("qwen2-moe-experts-rslora", "qwen2-moe",
     {"r": 4, "lora_alpha": 8, "use_rslora": True, "target_modules": [],
      "target_parameters": ["mlp.experts.down_proj"]}),
]
# What strata's adapter_config.json lists as target_parameters: each adapted parameter with its
# module ("experts.down_proj"), as peft matches it.
TARGET_PARAMETERS = {"mixtral-experts": ["experts.down_proj", "experts.gate_up_proj"],
                     "qwen2-moe-experts-rslora": ["experts.down_proj"]}
# What peft saves for "all-linear": the names of the layers it became.
ALL_LINEAR = {"mixtral": ["q_proj", "k_proj", "v_proj", "o_proj"],
              "qwen2-moe": ALL + ["shared_expert_gate"]}
T = 16


def windows_loss(torch, F, model, corpus):
    """The mean next-token loss over the windows strata eval reads (start 0, T, 2T, ...)."""
    total, count, s = 0.0, 0, 0
    with torch.no_grad():
        while s + T + 1 <= corpus.numel():
            lg = model(input_ids=corpus[s:s + T][None]).logits.float()[0]
            total += F.cross_entropy(lg.double(), corpus[s + 1:s + T + 1], reduction="sum").item()
            count += T
            s += T
    return total / count


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--strata", required=True)
    ap.add_argument("--work", default=None)
    args = ap.parse_args()
    try:
        import peft
        import torch
        import torch.nn.functional as F
        import transformers
        from safetensors.torch import load_file
    except ImportError as e:
        print(f"SKIPPED: {e.name} is not installed for {sys.executable} (set STRATA_HF_PYTHON "
              "to a python with torch, transformers, safetensors and peft)")
        return 77
    work = args.work or tempfile.mkdtemp(prefix="strata_lora_export_check_")
    with open(os.path.join(ROOT, "configs", "tiny-cpu.json")) as f:
        base_cfg = json.load(f)
    base_cfg.pop("model")
    failed = 0
    for name, fixture, lora in RUNS:
        src = os.path.join(ROOT, "tests", "fixtures", "hf", fixture)
        run = os.path.join(work, name)
        os.makedirs(os.path.join(run, "swap"), exist_ok=True)
        ref = load_file(os.path.join(src, "reference.safetensors"))
        corpus = ref["eval_tokens"].long()
        corpus_path = os.path.join(run, "eval.u32")
        with open(corpus_path, "wb") as f:
            f.write(struct.pack(f"<{corpus.numel()}I", *corpus.tolist()))
        cfg = json.loads(json.dumps(base_cfg))
        cfg["model"] = {"from_pretrained": src, "context": T}
        cfg["lora"] = lora
        cfg["bf16"] = {"enabled": False}
        cfg["optimizer"]["params"].update({"lr": 1e-2})
        cfg["scheduler"]["params"]["warmup_num_steps"] = 1
        cfg["train_batch_size"], cfg["gradient_accumulation_steps"] = 8, 2
        cfg["train"].update({"steps": 6, "eval_interval": 0, "checkpoint_dir": run + "/ckpt"})
        cfg["zero_optimization"]["offload_optimizer"]["nvme_path"] = run + "/swap"
        cfg_path = os.path.join(run, "config.json")
        with open(cfg_path, "w") as f:
            json.dump(cfg, f)
        adapter, merged = os.path.join(run, "adapter"), os.path.join(run, "merged")
        ckpt = run + "/ckpt"
        cmds = [[args.strata, "train", "--config", cfg_path, "--quiet"],
                [args.strata, "eval", "--config", cfg_path, "--checkpoint", ckpt, "--json",
                 "--set", f'data.source="{corpus_path}"', "--set", 'data.format="uint32"'],
                [args.strata, "export", "--config", cfg_path, "--checkpoint", ckpt, "--adapter",
                 adapter],
                [args.strata, "export", "--config", cfg_path, "--checkpoint", ckpt, "--out",
                 merged]]
        strata_loss = None
        for cmd in cmds:
            p = subprocess.run(cmd, capture_output=True, text=True)
            if p.returncode != 0:
                print(f"FAIL {name}: {' '.join(cmd)} exited {p.returncode}\n{p.stderr[-2000:]}")
                return 1
            if "--json" in cmd:
                strata_loss = json.loads(p.stdout.strip().splitlines()[-1])["loss"]
        base = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
        base_loss = windows_loss(torch, F, base.eval(), corpus)
        with open(os.path.join(adapter, "adapter_config.json")) as f:
            written = json.load(f)
        loaded = peft.PeftConfig.from_pretrained(adapter)
        for key in ("r", "lora_alpha", "lora_dropout", "use_rslora", "target_modules",
                    "target_parameters"):
            want = lora.get(key, {"lora_dropout": 0.0, "use_rslora": False}.get(key))
            if key == "target_parameters":
                want = TARGET_PARAMETERS.get(name)
            elif key == "target_modules" and not isinstance(want, str):
                want = sorted(want)
            elif key == "target_modules" and want == "all-linear":
                want = sorted(ALL_LINEAR.get(fixture, ALL))
            for where, got in (("adapter_config.json", written.get(key)),
                               ("peft's LoraConfig", getattr(loaded, key))):
                if isinstance(got, (list, set)):
                    got = sorted(got)
                if got != want:
                    print(f"FAIL {name}: {where} has {key} {got!r}, the run's lora section "
                          f"{want!r}")
                    failed += 1
        model = peft.PeftModel.from_pretrained(base, adapter).eval()
        peft_loss = windows_loss(torch, F, model, corpus)
        merged_model = transformers.AutoModelForCausalLM.from_pretrained(
            merged, dtype=torch.float32).eval()
        merged_loss = windows_loss(torch, F, merged_model, corpus)
        for what, loss in (("peft adapter", peft_loss), ("merged export", merged_loss)):
            rel = abs(loss - strata_loss) / abs(strata_loss)
            ok = rel <= 1e-5
            failed += not ok
            print(f"{'ok  ' if ok else 'FAIL'} {name}: {what} eval loss {loss:.6f}, strata eval "
                  f"{strata_loss:.6f} (relative difference {rel:.1e}; the base alone "
                  f"{base_loss:.6f})")
        if abs(strata_loss - base_loss) < 1e-3:
            print(f"FAIL {name}: the trained adapters do not change the loss")
            failed += 1
    print(f"{'all passed' if not failed else f'{failed} failed'}; peft {peft.__version__}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
