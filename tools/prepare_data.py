#!/usr/bin/env python3
"""Tokenizes text or JSONL into a strata token file with a Hugging Face model's tokenizer.

    python tools/prepare_data.py --model DIR --input corpus.jsonl --out train.bin \\
        [--field text] [--val-out val.bin --val-fraction 0.01]
    python tools/prepare_data.py --chat --model DIR --input chats.jsonl --out train.bin \\
        [--chat-template FILE] [--val-out val.bin --val-fraction 0.05]

DIR is the model directory model.from_pretrained names (its tokenizer.json /
tokenizer_config.json). Input: a .txt file (one document per blank-line-separated paragraph
block), or .jsonl with one object per line whose --field (default "text") holds a document.
Each document is encoded with the tokenizer (with its BOS token when the tokenizer adds one)
and followed by the EOS token when it has one, so documents never run together.

Streams: memory stays constant whatever the corpus size (a document is encoded in pieces of
about 1 MB cut before a whitespace, so a 16 MB line costs no more than a short one), a progress
line goes to stderr every 2 seconds, and tokens go straight to the output. With --val-out, one
document in every 1/val-fraction (spread over the corpus, not its tail) goes to the validation
file instead.

Output: llm.c's token file layout, which strata's data reader detects (data.format auto):
a 256 x int32 header (magic, version, token count) then the tokens, little-endian —
uint16 (magic 20240520, version 1) when the vocabulary fits, else uint32 (magic 20240801,
version 7: Llama 3's 128,256-token vocabulary). Each file is written as <out>.tmp; once all
are complete they are moved into place as one set (a journal <out>.commit lists the renames
first, so a run killed at any moment leaves the old files or the new ones: a killed move is
finished by the next run, and strata refuses a token file while its journal is there); a failed
run leaves no file that looks valid.

--chat: chat / SFT data. Each JSONL line is {"messages": [{"role": ..., "content": ...}, ...]}
(one conversation), rendered with the model tokenizer's own chat template (transformers'
apply_chat_template; --chat-template FILE gives a Jinja template instead) and tokenized as
apply_chat_template(tokenize=True) does (no special tokens added beyond the template's). The loss
mask marks the assistant turns: the text each assistant message adds after the generation prompt
(its content and the template's end-of-turn text), found by rendering the conversation up to
each assistant message with add_generation_prompt=True; only those tokens are loss targets, as
transformers' labels = -100 elsewhere (TRL's assistant_only_loss). The mask goes to <out>.mask
(and <val-out>.mask): a 256 x int32 header (magic 20261125, version 1, token count, the token
bytes' CRC-32, the mask bytes' CRC-32, conversations), then one byte per token: bit 0 = loss
target, bit 1 = first token of a conversation (src/train/loss_mask.h; strata packs whole
conversations into its windows with it). A plain run removes a stale <out>.mask.

Errors are one line naming the file, the line and the fix (exit 1): a line that is not UTF-8 or
not JSON, a document without the field, an empty training or validation file, an --out or
--val-out whose file, .mask or their .tmp is an input (the corpus, the chat template; also
through a link or a hard link), or an --out and --val-out that collide; with --chat, a line without a messages list of role/content
strings, a conversation without an assistant turn, a template that cannot render it or whose
rendering of the first messages is not the start of the whole conversation's. Off the hot path: needs `transformers` (pip install transformers),
never a dependency of the build.
"""
import argparse
import codecs
import json
import os
import struct
import sys
import time
import zlib

HEADER_INTS = 256
CHUNK_CHARS = 1 << 20  # a document is encoded in pieces of about this many characters
MAX_TOKENS = 2**31 - 1  # the header's int32 count
MASK_MAGIC, MASK_VERSION = 20261125, 1
MASK_LOSS, MASK_START = 1, 2  # a mask byte's bits: loss target, first token of a conversation


class Error(Exception):
    """A user-facing error: printed as one line, exit status 1."""


def documents(path, field, progress=None):
    """The documents of a .txt or .jsonl file as a stream of events: ("text", str) pieces of the
    current document, then ("end", None). A .txt file is read in pieces of at most CHUNK_CHARS
    bytes, so no line, however long, is held whole; a JSONL line is (it is parsed whole). Reads
    bytes, so every error names its line; `progress(bytes_read)` is called as the file is read."""
    jsonl = path.endswith(".jsonl")
    decoder = codecs.getincrementaldecoder("utf-8")("strict")
    with open(path, "rb") as f:
        lineno = 1  # of the line `raw` is (part of)
        column = 0  # .txt: bytes of this line before `raw`
        in_doc = False
        blank = True  # .txt: the line so far is whitespace only
        pending = []  # .txt: whitespace-only pieces of the current line, held until it ends
        while True:
            raw = f.readline() if jsonl else f.readline(CHUNK_CHARS)
            if progress:
                progress(f.tell())
            if not raw:
                break
            try:
                text = decoder.decode(raw, final=False)
            except UnicodeDecodeError as e:
                raise Error(f"{path}:{lineno}: not UTF-8 (byte 0x{raw[e.start]:02x} at byte "
                            f"{column + e.start} of the line); re-encode the file as UTF-8 "
                            "(e.g. iconv -f latin1 -t utf-8)")
            ends = raw.endswith(b"\n")
            if jsonl:
                if text.strip():
                    try:
                        obj = json.loads(text)
                    except json.JSONDecodeError as e:
                        raise Error(f"{path}:{lineno}: not valid JSON ({e.msg} at column "
                                    f"{e.colno}); each line of a .jsonl file must be one JSON "
                                    "object")
                    if not isinstance(obj, dict) or not isinstance(obj.get(field), str):
                        has = f"keys {sorted(obj)}" if isinstance(obj, dict) else "no object"
                        raise Error(f"{path}:{lineno}: no string field \"{field}\" (the line "
                                    f"has {has}); name the field with --field")
                    yield "text", obj[field]
                    yield "end", None
            else:
                # Paragraph blocks: a whitespace-only line ends a document.
                if blank and not text.strip():
                    pending.append(text)
                else:
                    blank = False
                    in_doc = True
                    for t in pending + [text]:
                        yield "text", t
                    pending = []
                if ends:
                    if blank and in_doc:
                        yield "end", None
                        in_doc = False
                    blank, pending = True, []
            if ends:
                lineno += 1
                column = 0
            else:
                column += len(raw)
        if in_doc:
            yield "end", None


def pieces(text, size=CHUNK_CHARS):
    """`text` in pieces of at most `size` characters, each but the first starting with a
    whitespace (cut before one, where the tokenizers strata reads split words anyway), so that
    encoding the pieces gives the ids of encoding the whole."""
    start = 0
    while len(text) - start > size:
        cut = start + size
        while cut > start and not text[cut].isspace():
            cut -= 1
        if cut == start:  # no whitespace in a whole piece: cut anyway
            cut = start + size
        yield text[start:cut]
        start = cut
    yield text[start:]


def i32(x):
    """An unsigned 32-bit value as the int32 a header holds."""
    return x - (1 << 32) if x >= 1 << 31 else x


def create_temp(path):
    """`path` created afresh for writing (a killed run's leftover or a planted link at it is
    removed, never followed), with a zeroed header."""
    if os.path.lexists(path):
        os.unlink(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    f = os.fdopen(fd, "wb")
    f.write(b"\0" * (4 * HEADER_INTS))
    return f


def finish(f, header):
    """Writes `header` (ints) at the start of `f`, syncs and closes it."""
    f.seek(0)
    f.write(struct.pack(f"<{HEADER_INTS}i", *(header + [0] * (HEADER_INTS - len(header)))))
    f.flush()
    os.fsync(f.fileno())
    f.close()


def sync_dir(path):
    fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def complete_pending(path):
    """Finishes the replacement a run killed while moving its files into place left recorded in
    <path>.commit (every temporary was complete before it was written): its renames and removals
    are done, then its journals removed. A no-op without the journal."""
    journal = path + ".commit"
    if not os.path.lexists(journal):
        return False
    with open(journal) as f:
        record = json.load(f)
    for op, *paths in record["ops"]:
        if op == "rename" and os.path.lexists(paths[0]):
            os.replace(paths[0], paths[1])
        elif op == "unlink" and os.path.lexists(paths[0]):
            os.unlink(paths[0])
    for j in record["journals"]:
        if os.path.lexists(j):
            os.unlink(j)
    sync_dir(path)
    return True


def commit(files):
    """Moves every file's temporaries into place as one set: a journal (<path>.commit beside
    each output) lists the renames and removals, then they are done, then the journals removed.
    A kill before the journals leaves the old set (and temporaries); a kill after them leaves a
    set complete_pending finishes (the next run, or strata's reader, which refuses the file
    while its journal is there). Masks are moved before their token files and a stale mask
    removed after its new token file, so even a reader that ignores the journal sees a mask
    whose token CRC-32 names other tokens (refused), never a wrong pair it would accept."""
    ops = []
    for f in files:
        if f.m:
            ops.append(["rename", f.mask_path + ".tmp", f.mask_path])
        ops.append(["rename", f.tmp, f.path])
        if not f.m and os.path.lexists(f.mask_path):
            ops.append(["unlink", f.mask_path])  # another run's mask: not this file's
    journals = [f.path + ".commit" for f in files]
    text = json.dumps({"ops": ops, "journals": journals})
    for j in journals:
        tmp = j + ".tmp"
        if os.path.lexists(tmp):
            os.unlink(tmp)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        with os.fdopen(fd, "w") as jf:
            jf.write(text)
            jf.flush()
            os.fsync(jf.fileno())
        os.replace(tmp, j)
    sync_dir(files[0].path)
    complete_pending(files[0].path)


class TokenFile:
    """An llm.c token file written as it streams: <path>.tmp (and with `mask`, its loss mask
    <path>.mask.tmp), moved into place with the other outputs by commit()."""

    def __init__(self, path, u32, mask=False):
        self.path, self.tmp, self.u32, self.count = path, path + ".tmp", u32, 0
        self.mask_path = path + ".mask"
        self.crc = self.mask_crc = self.conversations = 0
        self.f = create_temp(self.tmp)
        self.m = create_temp(self.mask_path + ".tmp") if mask else None
        self.fmt = "<{}I" if u32 else "<{}H"

    def write(self, tokens, mask=None):
        if self.count + len(tokens) > MAX_TOKENS:
            raise Error(f"{self.path}: more than {MAX_TOKENS} tokens (the llm.c header's limit); "
                        "split the corpus and prepare the parts separately")
        data = struct.pack(self.fmt.format(len(tokens)), *tokens)
        self.f.write(data)
        self.crc = zlib.crc32(data, self.crc)
        self.count += len(tokens)
        if self.m:
            m = bytes(mask)
            self.m.write(m)
            self.mask_crc = zlib.crc32(m, self.mask_crc)
            self.conversations += sum(1 for b in m if b & MASK_START)

    def close(self):
        """Completes the temporaries (headers, fsync); commit() moves them into place."""
        if self.m:
            finish(self.m, [MASK_MAGIC, MASK_VERSION, self.count, i32(self.crc),
                            i32(self.mask_crc), self.conversations])
        finish(self.f, [20240801, 7, self.count] if self.u32 else [20240520, 1, self.count])

    def discard(self):
        for f, tmp in ((self.f, self.tmp), (self.m, self.mask_path + ".tmp")):
            if f and not f.closed:
                f.close()
            if f and os.path.lexists(tmp):
                os.unlink(tmp)


class Progress:
    """A progress line on stderr every `every` seconds (and at the end)."""

    def __init__(self, total_bytes, every=2.0, stream=sys.stderr):
        self.total, self.every, self.stream = total_bytes, every, stream
        self.start = self.last = time.monotonic()
        self.bytes = self.tokens = self.docs = 0

    def line(self):
        dt = max(time.monotonic() - self.start, 1e-9)
        pct = f" ({100.0 * self.bytes / self.total:.0f}%)" if self.total else ""
        return (f"prepare_data: {self.bytes / 1e6:.1f} of {self.total / 1e6:.1f} MB{pct} | "
                f"{self.docs:,} documents | {self.tokens:,} tokens | "
                f"{self.bytes / 1e6 / dt:.1f} MB/s")

    def update(self, nbytes=None, tokens=0, docs=0):
        if nbytes is not None:
            self.bytes = nbytes
        self.tokens += tokens
        self.docs += docs
        now = time.monotonic()
        if now - self.last >= self.every:
            self.last = now
            print(self.line(), file=self.stream, flush=True)


def special_ids(encode):
    """The ids `encode(text, True)` puts before and after the text's own (BOS, ...)."""
    core = encode("a", False)
    full = encode("a", True)
    for i in range(len(full) - len(core) + 1):
        if full[i:i + len(core)] == core:
            return full[:i], full[i + len(core):]
    return [], []


def conversations(path, progress=None):
    """(line number, messages) for each conversation of a chat JSONL file: one object a line
    with a "messages" list of {"role": str, "content": str}. Reads bytes, so errors name the
    line; `progress(bytes_read)` is called as the file is read."""
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            if progress:
                progress(f.tell())
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise Error(f"{path}:{lineno}: not UTF-8 (byte 0x{raw[e.start]:02x} at byte "
                            f"{e.start} of the line); re-encode the file as UTF-8")
            if not text.strip():
                continue
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as e:
                raise Error(f"{path}:{lineno}: not valid JSON ({e.msg} at column {e.colno}); "
                            "each line of a chat .jsonl file must be one JSON object")
            msgs = obj.get("messages") if isinstance(obj, dict) else None
            if not isinstance(msgs, list) or not msgs or not all(
                    isinstance(m, dict) and isinstance(m.get("role"), str) and
                    isinstance(m.get("content"), str) for m in msgs):
                raise Error(f"{path}:{lineno}: needs \"messages\": a non-empty list of "
                            "{\"role\": str, \"content\": str} (--chat reads one conversation "
                            "a line)")
            if not any(m["role"] == "assistant" for m in msgs):
                raise Error(f"{path}:{lineno}: no \"assistant\" message: nothing to train on "
                            "(the loss covers the assistant turns only); drop the line")
            yield lineno, msgs


def chat_tokens(render, encode_offsets, messages):
    """(ids, mask) of one conversation. `render(messages, add_generation_prompt)` is the chat
    template's text; `encode_offsets(text)` the ids of that text (no special tokens added)
    with each one's (start, end) character offsets. An assistant message's span is the text
    rendering it adds after the generation prompt; a token starting in a span is a loss target.
    Raises ValueError saying why not."""
    whole = render(messages, False)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = render(messages[:i], True) if i else ""
        through = render(messages[:i + 1], False)
        if not (whole.startswith(before) and whole.startswith(through) and
                len(through) > len(before) and through.startswith(before)):
            raise ValueError(f"message {i} (assistant): the template's rendering of the "
                             "conversation up to it is not the start of the whole "
                             "conversation's, so its turn cannot be located (a template that "
                             "rewrites earlier turns); give --chat-template FILE")
        spans.append((len(before), len(through)))
    ids, offsets = encode_offsets(whole)
    mask, k = [], 0
    for start, _ in offsets:
        while k < len(spans) and start >= spans[k][1]:
            k += 1
        mask.append(MASK_LOSS if k < len(spans) and spans[k][0] <= start else 0)
    if mask:
        mask[0] |= MASK_START
    return ids, mask


def prepare_chat(render, encode_offsets, vocab_size, input_path, out, val_out=None,
                 val_fraction=0.01, progress_every=2.0):
    """Streams the conversations of `input_path` into `out` (and `val_out`) with their loss
    masks (chat_tokens). Returns {path: token count}."""
    check_paths(input_path, out, val_out, val_fraction)
    u32 = vocab_size > 65536
    progress = Progress(os.path.getsize(input_path), progress_every)
    files = [TokenFile(out, u32, mask=True)]
    if val_out:
        files.append(TokenFile(val_out, u32, mask=True))

    def fill():
        for n, (lineno, msgs) in enumerate(conversations(input_path,
                                                         lambda b: progress.update(b))):
            to_val = val_out and int((n + 1) * val_fraction) > int(n * val_fraction)
            try:
                ids, mask = chat_tokens(render, encode_offsets, msgs)
            except ValueError as e:
                raise Error(f"{input_path}:{lineno}: {e}")
            except Exception as e:  # noqa: BLE001 (a Jinja template's own error, any type)
                raise Error(f"{input_path}:{lineno}: the chat template failed: "
                            f"{type(e).__name__}: {e}")
            (files[1] if to_val else files[0]).write(ids, mask)
            progress.update(tokens=len(ids), docs=1)

    return write_outputs(files, fill, input_path, progress, u32)


def output_paths(out, val_out):
    """Every path a run writes or removes: each output, its mask and their temporaries."""
    return [q for p in (out, val_out) if p
            for q in (p, p + ".tmp", p + ".mask", p + ".mask.tmp", p + ".commit",
                      p + ".commit.tmp")]


def same_file(a, b):
    """True when `a` and `b` name one file: the same path, the same target through links, or
    the same inode (a hard link)."""
    if os.path.abspath(a) == os.path.abspath(b) or os.path.realpath(a) == os.path.realpath(b):
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def check_paths(input_path, out, val_out, val_fraction, inputs=()):
    """Refuses an output (or its mask, or a temporary of either) that is an input (the corpus,
    `inputs` such as a chat template), outputs that collide, a bad fraction, no input."""
    outputs = output_paths(out, val_out)
    for src in [p for p in (input_path, *inputs) if p]:
        for p in outputs:
            if same_file(p, src):
                raise Error(f"{p} is the input file {src}; give --out/--val-out another path "
                            "(writing the output, its .mask or their .tmp would overwrite or "
                            "remove the input)")
    if val_out and any(same_file(a, b) for a in output_paths(out, None)
                       for b in output_paths(val_out, None)):
        raise Error(f"--out {out} and --val-out {val_out} collide (one is the other or its "
                    ".mask); give them different paths")
    if val_out and not 0 < val_fraction < 1:
        raise Error(f"--val-fraction {val_fraction} is not between 0 and 1")
    if not os.path.isfile(input_path):
        raise Error(f"{input_path}: no such file")


def check_not_empty(files, docs, input_path):
    for f in files:
        if f.count == 0:
            what = "validation" if f is not files[0] else "training"
            hint = ("raise --val-fraction or give more documents" if what == "validation"
                    else "the input has no documents" if docs == 0
                    else "lower --val-fraction")
            raise Error(f"{f.path}: the {what} file would hold 0 tokens "
                        f"({docs} documents in {input_path}); {hint}")


def write_outputs(files, fill, input_path, progress, u32):
    """Runs fill() (it writes `files`), then refuses an empty one and closes them all (each
    renamed into place), or discards them all on any failure. Returns {path: token count}."""
    try:
        fill()
        check_not_empty(files, progress.docs, input_path)
        for f in files:
            f.close()
        commit(files)
    except BaseException:
        for f in files:
            f.discard()
        raise
    return report(files, progress, u32)


def report(files, progress, u32):
    print(progress.line(), file=sys.stderr)
    for f in files:
        print(f"{f.path}: {f.count} tokens, {'uint32' if u32 else 'uint16'}"
              + (f", loss mask {f.mask_path}" if f.m else ""))
    return {f.path: f.count for f in files}


def prepare(encode, eos, vocab_size, input_path, out, field="text", val_out=None,
            val_fraction=0.01, progress_every=2.0):
    """Streams `input_path` into `out` (and `val_out`). `encode(text, add_special_tokens)`
    returns a list of ids. Returns {path: token count}."""
    check_paths(input_path, out, val_out, val_fraction)
    u32 = vocab_size > 65536
    before, after = special_ids(encode)
    tail = after + ([eos] if eos is not None and eos not in after[-1:] else [])
    progress = Progress(os.path.getsize(input_path), progress_every)
    files = [TokenFile(out, u32)]
    if val_out:
        files.append(TokenFile(val_out, u32))

    def fill():
        doc, buf, dst, n = 0, "", None, 0
        for kind, text in documents(input_path, field, lambda b: progress.update(b)):
            if dst is None:  # a document starts
                # Document i goes to validation when i * fraction crosses an integer: one in
                # every 1/fraction, spread over the corpus.
                to_val = val_out and int((doc + 1) * val_fraction) > int(doc * val_fraction)
                dst = files[1] if to_val else files[0]
                dst.write(before)
                n = len(before)
            if kind == "text":
                buf += text
                if len(buf) < 2 * CHUNK_CHARS:
                    continue
                # Encode the whole pieces; the last (it may end inside a word) waits for more.
                parts = list(pieces(buf))
                buf = parts.pop()
            else:
                parts, buf = [buf], ""
            for part in parts:
                ids = encode(part, False)
                dst.write(ids)
                n += len(ids)
            if kind == "end":
                dst.write(tail)
                progress.update(tokens=n + len(tail), docs=1)
                doc, dst = doc + 1, None

    return write_outputs(files, fill, input_path, progress, u32)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="Hugging Face model directory (tokenizer)")
    ap.add_argument("--input", required=True, help=".txt or .jsonl")
    ap.add_argument("--out", required=True)
    ap.add_argument("--field", default="text", help="JSONL field holding the text")
    ap.add_argument("--val-out", default=None, help="also write one document in 1/fraction here")
    ap.add_argument("--val-fraction", type=float, default=0.01)
    ap.add_argument("--chat", action="store_true",
                    help="JSONL {\"messages\": [...]} conversations: the tokenizer's chat "
                    "template, and a loss mask on the assistant turns (<out>.mask)")
    ap.add_argument("--chat-template", default=None,
                    help="with --chat: a Jinja chat template file instead of the tokenizer's")
    args = ap.parse_args()
    try:
        from transformers import AutoTokenizer
    except ImportError:
        sys.exit("prepare_data.py needs transformers: pip install transformers")
    try:
        tok = AutoTokenizer.from_pretrained(args.model)
    except (OSError, ValueError) as e:
        sys.exit(f"{args.model}: cannot load its tokenizer ({e}); --model must name a Hugging "
                 "Face model directory with tokenizer.json or tokenizer.model")

    tok.model_max_length = MAX_TOKENS  # documents are longer than a window: no warning

    def encode(text, specials):
        return tok(text, add_special_tokens=specials)["input_ids"]

    def render(messages, add_generation_prompt):
        return tok.apply_chat_template(messages, tokenize=False,
                                       add_generation_prompt=add_generation_prompt)

    def encode_offsets(text):
        enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
        return enc["input_ids"], enc["offset_mapping"]

    try:
        check_paths(args.input, args.out, args.val_out, args.val_fraction,
                    inputs=[args.chat_template] if args.chat else [])
        for p in (args.out, args.val_out):
            if p and complete_pending(p):
                print(f"prepare_data: finished moving the files of a killed run into place "
                      f"({p})", file=sys.stderr)
        if args.chat:
            if args.chat_template:
                with open(args.chat_template) as f:
                    tok.chat_template = f.read()
            if not getattr(tok, "chat_template", None):
                raise Error(f"{args.model}: its tokenizer has no chat template (tokenizer_config."
                            "json's chat_template or chat_template.jinja); give --chat-template "
                            "FILE (a Jinja template)")
            prepare_chat(render, encode_offsets, len(tok), args.input, args.out, args.val_out,
                         args.val_fraction)
        else:
            prepare(encode, tok.eos_token_id, len(tok), args.input, args.out, args.field,
                    args.val_out, args.val_fraction)
    except Error as e:
        sys.exit(f"prepare_data: {e}")
    except OSError as e:
        sys.exit(f"prepare_data: {e.filename or ''}: {e.strerror}")
    except KeyboardInterrupt:
        sys.exit("prepare_data: interrupted; no output written")


if __name__ == "__main__":
    main()
