#!/usr/bin/env python3
"""Writes the LoRA fixtures of tests/lora_test.cc (tests/fixtures/hf/lora-<base>/) with peft.

For each base fixture (tests/fixtures/hf/{llama,qwen2,qwen3,phi3,gpt2}, tools/make_hf_fixtures.py, and the
mixtures {mixtral,qwen2-moe,qwen3-moe}, tools/make_moe_fixtures.py) in fp32:
peft.get_peft_model(base, LoraConfig(r=4, lora_alpha=8, every linear layer of a block)), and
for the mixtures' lora-<base>-experts their routed experts' fused parameters too
(target_parameters, peft's ParamWrapper: lora_A [E*r, in], lora_B [out, r*E]), its
lora_A and lora_B drawn at random (std 0.2: B at PEFT's zero would give dA = 0 and the base's
loss, a test that could not fail), saved with save_pretrained (adapter_config.json +
adapter_model.safetensors, exactly as peft writes them), and a reference.safetensors with what
peft computes on the base fixture's tokens:
  loss             [1]  the mean next-token cross-entropy
  losses           [B, T]
  grad.<name>      d(loss)/d(adapter tensor) under its adapter_model.safetensors name
  eval_loss        [1]  the mean over the base fixture's eval_tokens windows (as its own)
Then, for lora-llama, reference_dropout.safetensors: the same (loss, losses, grad.<name>) of one
training pass with lora_dropout 0.1, where each adapter's nn.Dropout is replaced by strata's mask
(strata/kernels.h's dropout_uniform of lora_dropout_key(DROPOUT_KEY, layer, site), the site's
index in the block's order q, k, v, o, gate, up, down): peft's arithmetic around the dropout,
strata's draw. `--only-dropout` writes that file alone, from the committed adapter.

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
    # transformers' mixtures hold their router and experts as parameters, not linear layers:
    # the attention (and Qwen2-MoE's shared expert and its gate) is what target_modules reaches.
    "mixtral": ["q_proj", "k_proj", "v_proj", "o_proj"],
    "qwen2-moe": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                  "shared_expert_gate"],
    # The routed experts' fused parameters, through target_parameters (peft's ParamWrapper),
    # beside some linear layers: both of Mixtral's (nested wrappers on one module), and Qwen2-MoE's
    # gate_up_proj alone, named by its last part.
    "mixtral-experts": ["q_proj", "k_proj", "v_proj", "o_proj"],
    "qwen2-moe-experts": ["q_proj", "v_proj"],
    # Qwen3: its query/key norms frozen with the base, their gradients flowing through.
    "qwen3": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    # Phi-3: its packed linear layers (qkv_proj, gate_up_proj) as they are.
    "phi3": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],
    # Qwen3-MoE: the attention (its mixture has no shared expert).
    "qwen3-moe": ["q_proj", "k_proj", "v_proj", "o_proj"],
}
PARAMETERS = {
    "mixtral-experts": ["experts.gate_up_proj", "experts.down_proj"],
    "qwen2-moe-experts": ["gate_up_proj"],
}
# The mixtures' gradients are of loss + router_aux_loss_coef * aux_loss, as strata trains them
# (tools/make_moe_fixtures.py).
MOE = {"mixtral", "qwen2-moe", "qwen3-moe"}


def base_of(name):
    """The base fixture a LoRA fixture adapts: lora-mixtral-experts adapts mixtral."""
    return name[:-len("-experts")] if name.endswith("-experts") else name
R, ALPHA = 4, 8
DROPOUT, DROPOUT_KEY = 0.1, 0x5EED1234  # tests/lora_test.cc's PeftCompareWithDropout
M64 = (1 << 64) - 1


def _mix(z):
    """strata/kernels.h's dropout_mix (SplitMix64's finalizer), on Python integers."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def strata_keep_scale(key, n, p):
    """Kernels::dropout's factor per element of a call with `key`: 1 / (1 - p) (fp32) or 0."""
    import numpy as np
    i = np.arange(1, n + 1, dtype=np.uint64)
    with np.errstate(over="ignore"):
        z = np.uint64(key) + i * np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    u = (z >> np.uint64(40)).astype(np.float32) * np.float32(1.0 / 16777216.0)
    scale = np.float32(1.0) / (np.float32(1.0) - np.float32(p))
    return torch.from_numpy(np.where(u >= np.float32(p), scale, np.float32(0.0)).astype(np.float32))


class StrataDropout(torch.nn.Module):
    """An adapter's input dropout drawing strata's mask for block `layer`, site `site`."""

    def __init__(self, layer, site, p):
        super().__init__()
        self.key = _mix((_mix((DROPOUT_KEY + layer) & M64) + site) & M64)
        self.p = p

    def forward(self, x):
        m = strata_keep_scale(self.key, x.numel(), self.p).reshape(x.shape)
        return x * m


def dropout_reference(fixtures):
    """lora-llama's reference_dropout.safetensors (see the module's docstring)."""
    base_dir = os.path.join(fixtures, "llama")
    out_dir = os.path.join(fixtures, "lora-llama")
    ref = load_file(os.path.join(base_dir, "reference.safetensors"))
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(base, out_dir, is_trainable=True)
    sites = TARGETS["llama"]
    replaced = 0
    for name, module in model.named_modules():
        if hasattr(module, "lora_dropout") and "default" in module.lora_dropout:
            parts = name.split(".")
            layer = int(parts[parts.index("layers") + 1])
            module.lora_dropout["default"] = StrataDropout(layer, sites.index(parts[-1]), DROPOUT)
            replaced += 1
    assert replaced == len(sites) * base.config.num_hidden_layers, replaced
    model.eval()  # no other dropout; the adapters' is the one above, always on
    tokens = ref["tokens"].long()
    logits = model(input_ids=tokens).logits.float()
    V = logits.shape[-1]
    losses = F.cross_entropy(logits.reshape(-1, V), ref["targets"].long().reshape(-1),
                             reduction="none")
    loss = losses.mean()
    loss.backward()
    saved = load_file(os.path.join(out_dir, "adapter_model.safetensors"))
    out = {"loss": loss.detach().reshape(1), "losses": losses.detach().reshape(tokens.shape)}
    for n, p in model.named_parameters():
        if p.grad is None:
            continue
        key = n.replace(".default", "")
        assert key in saved, (key, list(saved)[:4])
        out["grad." + key] = p.grad.detach().float().contiguous()
    save_file(out, os.path.join(out_dir, "reference_dropout.safetensors"))
    print(out_dir, "reference_dropout.safetensors", float(loss), len(out) - 2, "gradients")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--fixtures", default=os.path.join(os.path.dirname(__file__), "..", "tests",
                                                       "fixtures", "hf"))
    ap.add_argument("--only-dropout", action="store_true")
    ap.add_argument("--only", nargs="+", choices=sorted(TARGETS),
                    help="write only these fixtures (and not the dropout reference)")
    args = ap.parse_args()
    if args.only_dropout:
        dropout_reference(args.fixtures)
        return
    for seed, (name, targets) in enumerate(TARGETS.items()):
        if args.only and name not in args.only:
            continue
        base_name = base_of(name)
        base_dir = os.path.join(args.fixtures, base_name)
        ref = load_file(os.path.join(base_dir, "reference.safetensors"))
        base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
        cfg = peft.LoraConfig(r=R, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=targets,
                              target_parameters=PARAMETERS.get(name), bias="none",
                              fan_in_fan_out=name == "gpt2")
        model = peft.get_peft_model(base, cfg)
        g = torch.Generator().manual_seed(100 + seed)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_" in n:
                    p.copy_(0.2 * torch.randn(p.shape, generator=g))
        model.eval()
        tokens = ref["tokens"].long()
        targets_t = ref["targets"].long()
        moe = base_name in MOE
        out_fw = model(input_ids=tokens, output_router_logits=True) if moe else \
            model(input_ids=tokens)
        logits = out_fw.logits.float()
        V = logits.shape[-1]
        losses = F.cross_entropy(logits.reshape(-1, V), targets_t.reshape(-1), reduction="none")
        loss = losses.mean()
        if moe:
            (loss + base.config.router_aux_loss_coef * out_fw.aux_loss).backward()
        else:
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
        adapter_cfg["base_model_name_or_path"] = "tests/fixtures/hf/" + base_name
        with open(cfg_path, "w") as f:
            json.dump(adapter_cfg, f, indent=2, sort_keys=True)
            f.write("\n")
        print(out_dir, sorted(os.listdir(out_dir)), float(loss), len(saved), "tensors")
    if not args.only:
        dropout_reference(args.fixtures)
    print("peft", peft.__version__, "transformers", transformers.__version__, "torch",
          torch.__version__)


if __name__ == "__main__":
    main()
