#!/usr/bin/env python3
"""Writes tests/fixtures/hf/llama/dpo.safetensors: DPO's sigmoid loss (TRL's DPOTrainer,
loss_type "sigmoid", label_smoothing = cDPO) and its gradient by torch, for
tests/hf_compare_test.cc.

The batch: B = 4 rows of T = 16 tokens, two preference pairs (row 2j chosen, 2j + 1 rejected,
both of pair j after the same prompt). Each row is a sequence of prompt, completion and padding;
a target counts only where it is a completion token (the prompt's and the padding's are -1, the
data's loss mask). A row's log-probability pi is the sum of its completion's token
log-probabilities under the fixture's model (tests/fixtures/hf/llama, fp32). The reference
log-probabilities are the policy's own shifted by a few nats, so that z is clearly non-zero, of
one sign in pair 0 and of the other in pair 1:
  z = beta ((pi_c - ref_c) - (pi_r - ref_r))
  L = mean over pairs of -(1 - eps) logsigmoid(z) - eps logsigmoid(-z)
The file holds (as F32):
  tokens, targets    [B, T] (targets -1 where ignored)
  ref                [B] the rows' reference log-probabilities
  logps              [B] the rows' policy log-probabilities pi
  beta, eps          [1] 0.1 and 0.1
  loss               [1] L
  grad.<name>        dL/d(parameter) for every parameter, under its Hugging Face name
  eps0.loss, eps0.grad.<name>   the same with eps = 0 (plain DPO)
When TRL is importable, its own DPOTrainer loss (loss_type "sigmoid") gives the same plain
DPO loss (eps 0) and the same gradient in every token's log-probability (checked here, not in
the test: TRL is never a dependency). TRL 1.x's "sigmoid" ignores label_smoothing (there it is
Robust DPO's and EXO's parameter); the cDPO form above is the one TRL's "sigmoid" computed
before 1.0.

Off the hot path: run it by hand in the virtual environment of tools/make_hf_fixtures.py
(torch, transformers, safetensors; optionally trl): VENV/bin/python tools/make_dpo_fixture.py.
It records its versions in tests/fixtures/hf/VERSIONS under fixtures["llama/dpo"].
"""
import argparse
import importlib.util
import json
import os

import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import save_file

B, T = 4, 16
BETA, EPS = 0.1, 0.1
# Per pair: prompt length, chosen and rejected completion lengths (in tokens of the sequence);
# the rest of the row is padding.
PAIRS = [(4, 7, 9), (6, 8, 5)]
PAD = 0
# Reference = policy + shift, per row: z = beta * (-(shift_c) + shift_r).
SHIFTS = [3.0, -3.0, -2.5, 2.5]


def batch(vocab):
    g = torch.Generator().manual_seed(11)
    tokens = torch.full((B, T), PAD, dtype=torch.long)
    targets = torch.full((B, T), -100, dtype=torch.long)
    for j, (prompt_len, *lens) in enumerate(PAIRS):
        prompt = torch.randint(3, vocab, (prompt_len,), generator=g)
        for k, n in enumerate(lens):
            seq = torch.cat([prompt, torch.randint(3, vocab, (n,), generator=g)])
            assert len(seq) <= T + 1
            row = 2 * j + k
            m = min(len(seq), T)
            tokens[row, :m] = seq[:m]
            # Target t is token t + 1: a completion token when prompt_len <= t + 1 < len(seq).
            for t in range(prompt_len - 1, len(seq) - 1):
                targets[row, t] = seq[t + 1]
    return tokens, targets


def token_logps(model, tokens, targets):
    """[B, T]: each target's log-probability, 0 where it is ignored."""
    logits = model(input_ids=tokens).logits.float()
    losses = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                             ignore_index=-100, reduction="none").reshape(B, T)
    return -losses


def dpo_loss(logps, ref, beta, eps):
    z = beta * ((logps[0::2] - ref[0::2]) - (logps[1::2] - ref[1::2]))
    return (-(1 - eps) * F.logsigmoid(z) - eps * F.logsigmoid(-z)).mean(), z


def trl_loss(per_token_logps, completion, ref, beta):
    """TRL's own DPOTrainer loss (loss_type "sigmoid") on the same per-token log-probabilities
    and reference, through DPOTrainer._compute_loss with the model's outputs given
    (tests/fixtures/dpo/make_losses.py's trl_loss; None without TRL). TRL's "sigmoid" has no
    label smoothing (TRL 1.x: label_smoothing is Robust DPO's and EXO's), so this checks the
    plain loss; cDPO's smoothing is the one TRL's sigmoid had before 1.0, -(1 - eps)
    logsigmoid(z) - eps logsigmoid(-z)."""
    try:
        import trl
    except ImportError:
        return None, None
    here = os.path.dirname(os.path.abspath(__file__))
    spec = importlib.util.spec_from_file_location(
        "make_losses", os.path.join(here, "..", "tests", "fixtures", "dpo", "make_losses.py"))
    losses = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(losses)
    cfg = {"loss_type": ["sigmoid"], "beta": beta}
    return losses.trl_loss(cfg, per_token_logps, completion, ref), trl.__version__


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--fixtures", default=os.path.join(here, "..", "tests", "fixtures", "hf"))
    args = ap.parse_args()
    d = os.path.join(args.fixtures, "llama")
    model = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    model.eval()
    vocab = model.config.vocab_size
    tokens, targets = batch(vocab)
    with torch.no_grad():
        logps0 = token_logps(model, tokens, targets).sum(dim=1)
    ref = (logps0 + torch.tensor(SHIFTS)).detach()
    out = {
        "tokens": tokens.float(),
        "targets": torch.where(targets < 0, -1, targets).float(),
        "ref": ref.float().contiguous(),
        "logps": logps0.float().contiguous(),
        "beta": torch.tensor([BETA]),
        "eps": torch.tensor([EPS]),
    }
    versions = {"torch": torch.__version__, "transformers": transformers.__version__}
    for prefix, eps in (("", EPS), ("eps0.", 0.0)):
        model.zero_grad()
        per_token = token_logps(model, tokens, targets)
        loss, z = dpo_loss(per_token.sum(dim=1), ref, BETA, eps)
        loss.backward()
        print(f"eps {eps}: z {z.tolist()} loss {loss.item():.8f}")
        assert all(abs(v) > 0.3 for v in z.tolist()) and z[0] * z[1] < 0
        if eps == 0.0:
            # TRL's loss and its gradient in each token's log-probability against this one's.
            lp = per_token.detach().double().requires_grad_(True)
            ours, _ = dpo_loss(lp.sum(dim=1), ref.double(), BETA, eps)
            (g_ours,) = torch.autograd.grad(ours, lp)
            lp2 = per_token.detach().double().requires_grad_(True)
            theirs, trl_version = trl_loss(lp2, targets >= 0, ref.double(), BETA)
            if theirs is not None:
                (g_trl,) = torch.autograd.grad(theirs, lp2)
                print(f"  TRL {trl_version}: {theirs.item():.8f}")
                assert abs(theirs.item() - ours.item()) < 1e-9, "TRL's DPO loss differs"
                assert torch.allclose(g_trl, g_ours, rtol=1e-9, atol=1e-12), \
                    "TRL's gradient differs"
                versions["trl"] = trl_version
        out[prefix + "loss"] = loss.detach().reshape(1)
        for name, p in model.named_parameters():
            out[prefix + "grad." + name] = p.grad.detach().float().contiguous()
    save_file(out, os.path.join(d, "dpo.safetensors"))
    path = os.path.join(args.fixtures, "VERSIONS")
    with open(path) as f:
        recorded = json.load(f)
    recorded.setdefault("fixtures", {})["llama/dpo"] = versions
    with open(path, "w") as f:
        json.dump(recorded, f)
        f.write("\n")
    print(f"{d}/dpo.safetensors: {len(out)} tensors")


if __name__ == "__main__":
    main()
