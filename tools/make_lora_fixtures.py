#!/usr/bin/env python3
"""Writes the LoRA fixtures of tests/lora_test.cc (tests/fixtures/hf/lora-<base>/) with peft.

For each base fixture (tests/fixtures/hf/{llama,qwen2,gpt2}, tools/make_hf_fixtures.py) in fp32:
peft.get_peft_model(base, LoraConfig(r=4, lora_alpha=8, every linear layer of a block)), its
lora_A and lora_B drawn at random (std 0.2: B at PEFT's zero would give dA = 0 and the base's
loss, a test that could not fail), saved with save_pretrained (adapter_config.json +
adapter_model.safetensors, exactly as peft writes them), and a reference.safetensors with what
peft computes on the base fixture's tokens:
  loss             [1]  the mean next-token cross-entropy
  losses           [B, T]
  grad.<name>      d(loss)/d(adapter tensor) under its adapter_model.safetensors name
  eval_loss        [1]  the mean over the base fixture's eval_tokens windows (as its own)

Off the hot path and never a dependency of the build: run it by hand with torch, transformers
and peft installed (`VENV/bin/python tools/make_lora_fixtures.py`). The tests read only
the committed files.
"""
import argparse
import json
import os
import shutil

import peft
import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import load_file, save_file

TARGETS = {
    "llama": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "qwen2": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "gpt2": ["c_attn", "c_proj", "c_fc"],
}
R, ALPHA = 4, 8


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--fixtures", default=os.path.join(os.path.dirname(__file__), "..", "tests",
                                                       "fixtures", "hf"))
    args = ap.parse_args()
    for seed, (name, targets) in enumerate(TARGETS.items()):
        base_dir = os.path.join(args.fixtures, name)
        ref = load_file(os.path.join(base_dir, "reference.safetensors"))
        base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
        cfg = peft.LoraConfig(r=R, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=targets,
                              bias="none", fan_in_fan_out=name == "gpt2")
        model = peft.get_peft_model(base, cfg)
        g = torch.Generator().manual_seed(100 + seed)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_" in n:
                    p.copy_(0.2 * torch.randn(p.shape, generator=g))
        model.eval()
        tokens = ref["tokens"].long()
        targets_t = ref["targets"].long()
        logits = model(input_ids=tokens).logits.float()
        V = logits.shape[-1]
        losses = F.cross_entropy(logits.reshape(-1, V), targets_t.reshape(-1), reduction="none")
        loss = losses.mean()
        loss.backward()
        out_dir = os.path.join(args.fixtures, "lora-" + name)
        shutil.rmtree(out_dir, ignore_errors=True)
        model.save_pretrained(out_dir)
        saved = load_file(os.path.join(out_dir, "adapter_model.safetensors"))
        out = {"loss": loss.detach().reshape(1), "losses": losses.detach().reshape(tokens.shape)}
        for n, p in model.named_parameters():
            if p.grad is None:
                continue
            key = n.replace(".default", "")
            assert key in saved, (key, list(saved)[:4])
            out["grad." + key] = p.grad.detach().float().contiguous()
        corpus = ref["eval_tokens"].long()
        T = tokens.shape[1]
        total, count, s = 0.0, 0, 0
        with torch.no_grad():
            while s + T + 1 <= corpus.numel():
                lg = model(input_ids=corpus[s:s + T][None]).logits.float()[0]
                total += F.cross_entropy(lg.double(), corpus[s + 1:s + T + 1], reduction="sum").item()
                count += T
                s += T
        out["eval_loss"] = torch.tensor([total / count])
        save_file(out, os.path.join(out_dir, "reference.safetensors"))
        readme = os.path.join(out_dir, "README.md")
        if os.path.exists(readme):
            os.remove(readme)
        # The base as a path relative to the repository (peft records the one it was given).
        cfg_path = os.path.join(out_dir, "adapter_config.json")
        with open(cfg_path) as f:
            adapter_cfg = json.load(f)
        adapter_cfg["base_model_name_or_path"] = "tests/fixtures/hf/" + name
        with open(cfg_path, "w") as f:
            json.dump(adapter_cfg, f, indent=2, sort_keys=True)
            f.write("\n")
        print(out_dir, sorted(os.listdir(out_dir)), float(loss), len(saved), "tensors")
    print("peft", peft.__version__, "transformers", transformers.__version__, "torch",
          torch.__version__)


if __name__ == "__main__":
    main()
