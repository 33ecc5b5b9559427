#!/usr/bin/env python3
"""Tokenizes text or JSONL into a strata token file with a Hugging Face model's tokenizer.

    python tools/prepare_data.py --model DIR --input corpus.jsonl --out train.bin \\
        [--field text] [--val-out val.bin --val-fraction 0.01]

DIR is the model directory model.from_pretrained names (its tokenizer.json /
tokenizer_config.json). Input: a .txt file (one document per blank-line-separated paragraph
block), or .jsonl with one object per line whose --field (default "text") holds a document.
Each document is encoded with the tokenizer (with its BOS token when the tokenizer adds one)
and followed by the EOS token when it has one, so documents never run together.

Output: llm.c's token file layout, which strata's data reader detects (data.format auto):
a 256 x int32 header (magic, version, token count) then the tokens, little-endian —
uint16 (magic 20240520, version 1) when every id fits, else uint32 (magic 20240801, version 7:
Llama 3's 128,256-token vocabulary). Off the hot path: needs `transformers` (pip install
transformers), never a dependency of the build.
"""
import argparse
import json
import struct
import sys


def documents(path, field):
    if path.endswith(".jsonl"):
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                obj = json.loads(line)
                if field not in obj or not isinstance(obj[field], str):
                    sys.exit(f"{path}:{n}: no string field \"{field}\" (use --field)")
                yield obj[field]
    else:
        with open(path, encoding="utf-8") as f:
            block = []
            for line in f:
                if line.strip():
                    block.append(line)
                elif block:
                    yield "".join(block)
                    block = []
            if block:
                yield "".join(block)


def write_tokens(path, tokens):
    u32 = max(tokens, default=0) > 65535
    header = [0] * 256
    header[0], header[1], header[2] = (20240801, 7, len(tokens)) if u32 else (20240520, 1,
                                                                              len(tokens))
    with open(path, "wb") as f:
        f.write(struct.pack("<256i", *header))
        f.write(struct.pack(f"<{len(tokens)}{'I' if u32 else 'H'}", *tokens))
    print(f"{path}: {len(tokens)} tokens, {'uint32' if u32 else 'uint16'}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="Hugging Face model directory (tokenizer)")
    ap.add_argument("--input", required=True, help=".txt or .jsonl")
    ap.add_argument("--out", required=True)
    ap.add_argument("--field", default="text", help="JSONL field holding the text")
    ap.add_argument("--val-out", default=None, help="also write the last documents here")
    ap.add_argument("--val-fraction", type=float, default=0.01)
    args = ap.parse_args()
    try:
        from transformers import AutoTokenizer
    except ImportError:
        sys.exit("prepare_data.py needs transformers: pip install transformers")
    tok = AutoTokenizer.from_pretrained(args.model)
    docs = [tok(d)["input_ids"] + ([tok.eos_token_id] if tok.eos_token_id is not None else [])
            for d in documents(args.input, args.field)]
    if not docs:
        sys.exit(f"{args.input}: no documents")
    n_val = int(len(docs) * args.val_fraction) if args.val_out else 0
    train = [t for d in docs[:len(docs) - n_val] for t in d]
    write_tokens(args.out, train)
    if args.val_out:
        write_tokens(args.val_out, [t for d in docs[len(docs) - n_val:] for t in d])


if __name__ == "__main__":
    main()
