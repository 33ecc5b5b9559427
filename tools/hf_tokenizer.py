#!/usr/bin/env python3
"""The model's tokenizer for `strata generate` (which runs this; off the hot path).

    hf_tokenizer.py encode DIR   < text          -> {"ids": [...], "eos": [...]}
    hf_tokenizer.py decode DIR   < {"ids": [...], "prefix": [...]} -> {"text": "..."}

DIR is a Hugging Face model directory (model.from_pretrained, an export, or --tokenizer).
encode adds the special tokens the tokenizer adds (Llama's BOS) and reports the ids generation
stops at (generation_config.json's eos_token_id, else the tokenizer's EOS); decode gives the
text of `ids` as it reads after `prefix` (the prompt's ids). Uses transformers'
AutoTokenizer when installed, else the `tokenizers` library on tokenizer.json. A failure is one
line on stderr and exit 1.
"""
import json
import os
import sys


def load(d):
    try:
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(d)
        return (lambda text: tok(text)["input_ids"],
                lambda ids: tok.decode(ids, skip_special_tokens=True), tok.eos_token_id)
    except ImportError:
        pass
    try:
        from tokenizers import Tokenizer
    except ImportError:
        sys.exit("hf_tokenizer.py needs transformers or tokenizers: pip install transformers")
    path = os.path.join(d, "tokenizer.json")
    if not os.path.isfile(path):
        sys.exit(f"{path}: missing (without transformers only tokenizer.json is read)")
    tok = Tokenizer.from_file(path)
    eos = None
    cfg = os.path.join(d, "tokenizer_config.json")
    if os.path.isfile(cfg):
        name = json.load(open(cfg)).get("eos_token")
        name = name.get("content") if isinstance(name, dict) else name
        eos = tok.token_to_id(name) if name else None
    return (lambda text: tok.encode(text).ids,
            lambda ids: tok.decode(ids, skip_special_tokens=True), eos)


def stop_ids(d, eos):
    path = os.path.join(d, "generation_config.json")
    if os.path.isfile(path):
        e = json.load(open(path)).get("eos_token_id")
        if e is not None:
            return e if isinstance(e, list) else [e]
    return [eos] if eos is not None else []


def main():
    if len(sys.argv) != 3 or sys.argv[1] not in ("encode", "decode"):
        sys.exit(__doc__.strip().split("\n\n")[1])
    mode, d = sys.argv[1], sys.argv[2]
    try:
        encode, decode, eos = load(d)
        if mode == "encode":
            text = sys.stdin.read()
            print(json.dumps({"ids": encode(text), "eos": stop_ids(d, eos)}))
        else:
            req = json.load(sys.stdin)
            ids, prefix = req["ids"], req.get("prefix", [])
            # The continuation as it reads after the prefix (a sentencepiece decode of the new
            # ids alone drops the space their first token starts with).
            whole, head = decode(prefix + ids), decode(prefix)
            text = whole[len(head):] if whole.startswith(head) else decode(ids)
            print(json.dumps({"text": text}))
    except (OSError, ValueError, KeyError) as e:
        sys.exit(f"hf_tokenizer.py {mode} {d}: {e}")


if __name__ == "__main__":
    main()
