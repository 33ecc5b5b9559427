#!/usr/bin/env python3
"""Checks that strata's masked (SFT) loss is transformers' loss with labels = -100.

tests/fixtures/chat/tiny_chat.jsonl goes through tools/prepare_data.py --chat with the tiny
Llama fixture's tokenizer (tests/fixtures/hf/llama) and the ChatML template
(tests/fixtures/chat/chatml.jinja; the fixture's tokenizer has none): a token file and its loss
mask. `strata eval --json` on them (fp32, T = 32) gives the mean loss over the assistant
tokens of the packed windows. The reference: the same windows (packed as src/train/loss_mask.h
documents: whole conversations from a conversation start, a longer one cut every T) through
transformers' LlamaForCausalLM with labels = -100 outside the assistant turns, all in one
batch: transformers' mean over the labels that count. With data.packing "sequence" (strata's
default: each conversation attends only to itself, positions restarting) every conversation
of a window is its own row of the reference; with "window" each window is one row. Both must
agree within 1e-5 relative, over the same number of tokens.

Needs torch and transformers (never a dependency of the build): without them it prints why and
exits 77, which ctest reports as skipped (tests/hf.cmake, sft_loss_transformers).

usage: check_sft_loss.py --strata build/tools/strata [--work DIR]
"""
import json
import os
import struct
import subprocess
import sys

from check_hf_export import start  # tools/, beside this script

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
T = 32


def read(path):
    """(tokens, mask bytes) of a prepare_data --chat output."""
    with open(path, "rb") as f:
        data = f.read()
    n = struct.unpack("<3i", data[:12])[2]
    fmt = "H" if struct.unpack("<i", data[:4])[0] == 20240520 else "I"
    tokens = list(struct.unpack(f"<{n}{fmt}", data[1024:]))
    with open(path + ".mask", "rb") as f:
        mask = f.read()[1024:]
    return tokens, mask


def windows(mask, T):
    """(offset, length) of the packed windows with a loss target (src/train/loss_mask.h)."""
    out, pos, end = [], 0, len(mask)
    while pos + 1 < end:
        limit = min(pos + T + 1, end)
        stop = nxt = limit
        if limit < end:
            s = limit
            while s > pos and not mask[s] & 2:
                s -= 1
            if s > pos:
                stop = nxt = s
            else:
                nxt = pos + T
        if any(mask[i] & 1 for i in range(pos + 1, stop)):
            out.append((pos, stop - pos))
        pos = nxt
    return out


def rows(wins, mask, per_sequence):
    """(offset, length) of the reference's rows: the windows, or each window's conversations."""
    if not per_sequence:
        return wins
    out = []
    for off, n in wins:
        start = off
        for j in range(off + 1, off + n):
            if mask[j] & 2:
                out.append((start, j - start))
                start = j
        out.append((start, off + n - start))
    return out


def reference(torch, model, tokens, mask, rows_):
    """transformers' mean loss (labels = -100 outside the assistant turns) and its count."""
    ids = torch.zeros(len(rows_), T + 1, dtype=torch.long)
    labels = torch.full((len(rows_), T + 1), -100, dtype=torch.long)
    for r, (off, n) in enumerate(rows_):
        ids[r, :n] = torch.tensor(tokens[off:off + n])
        for j in range(1, n):
            if mask[off + j] & 1:
                labels[r, j] = tokens[off + j]
    with torch.no_grad():
        # The last input's logits predict nothing (labels shift left by one).
        want = model(input_ids=ids, labels=labels).loss.item()
    return want, int((labels[:, 1:] != -100).sum())


def main():
    started = start("sft", ["torch", "transformers"])
    if started is None:
        return 77
    args, work, (torch, transformers) = started
    model_dir = os.path.join(ROOT, "tests", "fixtures", "hf", "llama")
    chat = os.path.join(ROOT, "tests", "fixtures", "chat")
    data = os.path.join(work, "chat.bin")
    p = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "prepare_data.py"), "--chat",
                        "--model", model_dir, "--chat-template",
                        os.path.join(chat, "chatml.jinja"), "--input",
                        os.path.join(chat, "tiny_chat.jsonl"), "--out", data],
                       capture_output=True, text=True)
    if p.returncode != 0:
        print(f"FAIL: prepare_data --chat exited {p.returncode}\n{p.stderr[-2000:]}")
        return 1
    with open(os.path.join(ROOT, "configs", "tiny-cpu.json")) as f:
        cfg = json.load(f)
    cfg["model"] = {"from_pretrained": model_dir, "context": T}
    cfg["data"] = {"source": data}
    cfg["bf16"] = {"enabled": False}
    cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    cfg.update(train_batch_size=4, train_micro_batch_size_per_gpu=4,
               gradient_accumulation_steps=1)
    cfg["train"]["checkpoint_dir"] = os.path.join(work, "ckpt")
    tokens, mask = read(data)
    wins = windows(mask, T)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    failed = 0
    for packing in ("sequence", "window"):
        cfg["data"]["packing"] = packing
        cfg_path = os.path.join(work, f"config-{packing}.json")
        with open(cfg_path, "w") as f:
            json.dump(cfg, f)
        p = subprocess.run([args.strata, "eval", "--config", cfg_path, "--json"],
                           capture_output=True, text=True)
        if p.returncode != 0:
            print(f"FAIL: strata eval (data.packing {packing}) exited {p.returncode}\n"
                  f"{p.stderr[-2000:]}")
            return 1
        got = json.loads(p.stdout.strip().split("\n")[-1])
        ref_rows = rows(wins, mask, packing == "sequence")
        want, count = reference(torch, model, tokens, mask, ref_rows)
        rel = abs(got["loss"] - want) / want
        ok = rel <= 1e-5 and got["tokens"] == count
        failed += not ok
        print(f"{'ok  ' if ok else 'FAIL'} llama, data.packing {packing}: {len(wins)} packed "
              f"windows of T = {T} ({len(ref_rows)} reference rows), {count} assistant tokens; "
              f"strata eval {got['loss']:.7f} over {got['tokens']} tokens, transformers "
              f"(labels = -100) {want:.7f}; relative difference {rel:.2e}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
