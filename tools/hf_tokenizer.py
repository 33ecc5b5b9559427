#!/usr/bin/env python3
"""The model's tokenizer for `strata generate` (which runs this; off the hot path).

    hf_tokenizer.py encode DIR   < text          -> {"ids": [...], "eos": [...]}
    hf_tokenizer.py decode DIR   < {"ids": [...], "prefix": [...]} -> {"text": "..."}

DIR is a Hugging Face model directory (model.from_pretrained, an export, or --tokenizer).
encode adds the special tokens the tokenizer adds (Llama's BOS) and reports the ids generation
stops at (generation_config.json's eos_token_id, else the tokenizer's EOS); decode gives the
text of `ids` as it reads after `prefix` (the prompt's ids). Uses transformers'
AutoTokenizer when installed, else the `tokenizers` library on tokenizer.json. A failure is one
line on stderr naming the real problem, and an exit status that says whose it is (strata
generate words its advice by it): 3 neither library is installed for this python (the
interpreter: STRATA_PYTHON), 4 DIR's tokenizer (no tokenizer files, a tokenizer.json that is not
JSON, one the library cannot load), 5 the input (a prompt that is not UTF-8), 1 anything else.
"""
import json
import os
import sys


NO_LIBRARY, BAD_TOKENIZER, BAD_INPUT = 3, 4, 5
# The files a Hugging Face tokenizer is loaded from (fast: tokenizer.json; sentencepiece:
# tokenizer.model; GPT-2's BPE: vocab.json + merges.txt).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "merges.txt")


def fail(code, message):
    print(message, file=sys.stderr)
    sys.exit(code)


def check_dir(d):
    """Refuses a directory without tokenizer files, or whose tokenizer.json is not JSON (a
    truncated copy), before any library is imported."""
    if not os.path.isdir(d):
        fail(BAD_TOKENIZER, f"{d}: no such directory (the tokenizer's: model.from_pretrained or "
             "--tokenizer)")
    if not any(os.path.isfile(os.path.join(d, f)) for f in TOKENIZER_FILES):
        fail(BAD_TOKENIZER, f"{d} holds no tokenizer files ({', '.join(TOKENIZER_FILES)}); give "
             "--tokenizer DIR naming the model's tokenizer, or --prompt-ids")
    path = os.path.join(d, "tokenizer.json")
    if os.path.isfile(path):
        try:
            with open(path, "rb") as f:
                json.loads(f.read())
        except ValueError as e:
            fail(BAD_TOKENIZER, f"{path} is not valid JSON ({e}; {os.path.getsize(path)} bytes: "
                 "truncated or damaged?); copy the model's tokenizer.json again")


def load(d):
    try:
        from transformers import AutoTokenizer
        try:
            tok = AutoTokenizer.from_pretrained(d)
        except Exception as e:  # the library's own errors are not all OSError / ValueError
            fail(BAD_TOKENIZER, f"{d}: transformers cannot load its tokenizer: {e}")
        return (lambda text: tok(text)["input_ids"],
                lambda ids: tok.decode(ids, skip_special_tokens=True), tok.eos_token_id)
    except ImportError:
        pass
    try:
        from tokenizers import Tokenizer
    except ImportError:
        fail(NO_LIBRARY, f"hf_tokenizer.py needs transformers or tokenizers, and {sys.executable} "
             "has neither: pip install transformers")
    path = os.path.join(d, "tokenizer.json")
    if not os.path.isfile(path):
        fail(BAD_TOKENIZER, f"{path}: missing (without transformers only tokenizer.json is read)")
    try:
        tok = Tokenizer.from_file(path)
    except Exception as e:
        fail(BAD_TOKENIZER, f"{path}: tokenizers cannot load it: {e}")
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
    raw = sys.stdin.buffer.read()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        fail(BAD_INPUT, f"the prompt is not valid UTF-8: byte {e.start} (0x{raw[e.start]:02x}) "
             f"{e.reason}; give UTF-8 text, or --prompt-ids")
    check_dir(d)
    try:
        encode, decode, eos = load(d)
        if mode == "encode":
            print(json.dumps({"ids": encode(text), "eos": stop_ids(d, eos)}))
        else:
            req = json.loads(text)
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
