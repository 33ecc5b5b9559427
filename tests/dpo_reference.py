#!/usr/bin/env python3
"""The held-out DPO loss and reward accuracy of a Hugging Face model against a reference model,
computed with transformers over a strata preference token file (tools/prepare_data.py --format
preference): the numbers strata's eval reports for the same pairs.

usage: dpo_reference.py --policy DIR --reference DIR --tokens FILE --seq-len T --beta B
                        [--label-smoothing E] [--loss-type sigmoid|ipo]
Prints one JSON object: {"loss": ..., "accuracy": ..., "pairs": ...}.
Each pair is the mask's conversations 2k (chosen) and 2k + 1 (rejected), each cut at T + 1
tokens; a pair left without a loss target in either sequence is left out, as strata does.
The loss: sigmoid (cDPO with --label-smoothing) or ipo (TRL's: the log-ratios' per-token means,
(mean_c - mean_r - 1/(2 beta))^2); the accuracy compares beta times the summed log-ratios.
"""
import argparse
import json
import math

import numpy as np
import torch
from transformers import AutoModelForCausalLM

LOSS, START = 1, 2


def read_tokens(path):
    head = np.fromfile(path, dtype="<i4", count=256)
    if head[0] == 20240520:
        dtype = "<u2"
    elif head[0] == 20240801:
        dtype = "<u4"
    else:
        raise SystemExit(f"{path}: not an llm.c token file (magic {head[0]})")
    return np.fromfile(path, dtype=dtype, count=int(head[2]), offset=256 * 4).astype(np.int64)


def read_mask(path, n):
    head = np.fromfile(path, dtype="<i4", count=256)
    if head[6] != 1:
        raise SystemExit(f"{path}: not a preference mask (header word 6 is {head[6]})")
    mask = np.fromfile(path, dtype=np.uint8, count=n, offset=256 * 4)
    return mask


def sequences(tokens, mask, T):
    starts = [i for i in range(len(tokens)) if mask[i] & START] + [len(tokens)]
    seqs = []
    for a, b in zip(starts[:-1], starts[1:]):
        b = min(b, a + T + 1)
        ids = tokens[a:b]
        counts = (mask[a + 1:b] & LOSS) != 0
        seqs.append((ids, counts))
    return seqs


def softplus(x):
    return max(x, 0.0) + math.log1p(math.exp(-abs(x)))


def logp(model, ids, counts):
    with torch.no_grad():
        x = torch.tensor(ids[:-1]).unsqueeze(0)
        y = torch.tensor(ids[1:])
        logits = model(x).logits[0].double()
        lp = torch.log_softmax(logits, dim=-1).gather(1, y.unsqueeze(1)).squeeze(1)
        return float(lp[torch.tensor(counts)].sum())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--policy", required=True)
    ap.add_argument("--reference", required=True)
    ap.add_argument("--tokens", required=True)
    ap.add_argument("--seq-len", type=int, required=True)
    ap.add_argument("--beta", type=float, required=True)
    ap.add_argument("--label-smoothing", type=float, default=0.0)
    ap.add_argument("--loss-type", choices=["sigmoid", "ipo"], default="sigmoid")
    a = ap.parse_args()
    tokens = read_tokens(a.tokens)
    mask = read_mask(a.tokens + ".mask", len(tokens))
    seqs = sequences(tokens, mask, a.seq_len)
    policy = AutoModelForCausalLM.from_pretrained(a.policy, dtype=torch.float32).eval()
    reference = AutoModelForCausalLM.from_pretrained(a.reference, dtype=torch.float32).eval()
    loss = correct = pairs = 0
    for k in range(len(seqs) // 2):
        (c, cc), (r, rc) = seqs[2 * k], seqs[2 * k + 1]
        if not cc.any() or not rc.any():
            continue
        lr_c = logp(policy, c, cc) - logp(reference, c, cc)
        lr_r = logp(policy, r, rc) - logp(reference, r, rc)
        rw_c, rw_r = a.beta * lr_c, a.beta * lr_r
        if a.loss_type == "ipo":
            u = lr_c / int(cc.sum()) - lr_r / int(rc.sum())
            loss += (u - 1 / (2 * a.beta)) ** 2
        else:
            z = rw_c - rw_r
            eps = a.label_smoothing
            loss += (1 - eps) * softplus(-z) + eps * softplus(z)
        correct += rw_c > rw_r
        pairs += 1
    print(json.dumps({"loss": loss / pairs, "accuracy": correct / pairs, "pairs": pairs}))


if __name__ == "__main__":
    main()
