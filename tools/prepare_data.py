#!/usr/bin/env python3
"""Tokenizes text, JSONL or Parquet into a strata token file with a Hugging Face model's tokenizer.

    python tools/prepare_data.py --model DIR --input corpus.jsonl --out train.bin \\
        [--field text] [--val-out val.bin --val-fraction 0.01]
    python tools/prepare_data.py --model DIR --input train-00000-of-00001.parquet \\
        --out train.bin [--format auto|text|messages|alpaca|prompt-completion|preference] \\
        [--chat-template FILE] [--val-out val.bin --val-fraction 0.05]

DIR is the model directory model.from_pretrained names (its tokenizer.json /
tokenizer_config.json). Input: a .txt file (one document per blank-line-separated paragraph
block), or a dataset as Hugging Face Hub datasets ship it: .jsonl (one JSON object a line) or
.parquet (read with pyarrow, an optional dependency of this tool: pip install pyarrow), in one
of the shapes below, found from the columns (--format auto, the default; the line "--format X"
on stderr says which) or named with --format. --field NAME reads the text from column NAME
(--format text); --chat is --format messages.

  --format           columns                          tokens                loss (<out>.mask)
  text               "text" (or --field NAME)         each document + EOS   (no mask)
  messages           "messages": [{role, content}]    the chat template     assistant turns
                     (or "conversations", also
                     ShareGPT's {from, value})
  alpaca             "instruction", "input"           the chat template of  the assistant turn
                     (optional), "output"             a user and an
                                                      assistant message
  prompt-completion  "prompt", "completion": strings  BOS + prompt +        the completion's
                                                      completion + EOS      tokens and EOS
                     or message lists                 the chat template of  the completion's
                                                      prompt + completion   assistant turns
  preference         "prompt" (optional), "chosen",   two sequences a row:  each one's
                     "rejected": strings              prompt + chosen, then completion, as
                     or message lists                 prompt + rejected,    prompt-completion's
                                                      each as prompt-
                                                      completion's

Auto detection reads the columns of a Parquet file's schema or a JSONL file's first object and
tries preference first (columns "chosen" and "rejected": a preference dataset may also carry
"messages"), then the others.
Alpaca rows are converted to a conversation: a user message holding the instruction (followed
by a blank line and the input when the input is not empty) and an assistant message holding
the output, then tokenized as messages are. Prompt/completion strings are tokenized as TRL's
SFTTrainer does (completion_only_loss): the text prompt + completion with the tokenizer's
special tokens and an EOS after it, the loss on the tokens that start in the completion and on
the EOS; as message lists (TRL's conversational prompt-completion) they are one conversation,
the loss on the completion's assistant turns only. ShareGPT's "from"/"value" messages read as
"role"/"content" ("human" is "user", "gpt" is "assistant", as TRL's maybe_convert_to_chatml);
a message key whose value is null is left out, as a JSONL line without it reads.

Preference data (TRL's preference type, for DPOTrainer): each row is a pair of sequences, the
chosen one and the rejected one, each made as prompt-completion makes (prompt, completion): as
strings BOS + prompt + completion + EOS, the loss on the completion and EOS; as message lists one
conversation, the loss on the completion's assistant turns. Without a "prompt" column, "chosen"
and "rejected" are whole conversations (message lists) and the prompt is their longest common
start of whole messages (TRL's extract_prompt; each side keeps at least its last message);
strings without a prompt are refused (give the "prompt" column). Conversation 2k of the output
is pair k's chosen sequence, 2k + 1 its rejected one, and the mask's header says so (word 6 =
1); --val-out takes whole pairs. A chosen completion the same as the rejected one is allowed.

Text: each document is encoded with the tokenizer (with its BOS token when the tokenizer adds
one) and followed by the EOS token when it has one, so documents never run together.

Streams: memory stays constant whatever the corpus size (a document is encoded in pieces of
about 1 MB cut before a whitespace, so a 16 MB line costs no more than a short one; a Parquet
file is read a batch of rows at a time with ParquetFile.iter_batches, only the columns of its
shape, so memory holds one row group of them), a progress line goes to stderr every 2 seconds,
and tokens go straight to the output. With --val-out, one document (or conversation) in every
1/val-fraction (spread over the corpus, not its tail) goes to the validation file instead.

Output: llm.c's token file layout, which strata's data reader detects (data.format auto):
a 256 x int32 header (magic, version, token count) then the tokens, little-endian —
uint16 (magic 20240520, version 1) when the vocabulary fits, else uint32 (magic 20240801,
version 7: Llama 3's 128,256-token vocabulary). Each file is written as <out>.tmp; once all
are complete they are moved into place as one set (a journal <out>.commit lists the renames
first, so a run killed at any moment leaves the old files or the new ones: a killed move is
finished by the next run, and strata refuses a token file while its journal is there); a failed
run leaves no file that looks valid.

Chat / SFT data (every shape but text): a conversation is rendered with the model tokenizer's
own chat template (transformers' apply_chat_template; --chat-template FILE gives a Jinja
template instead) and tokenized as apply_chat_template(tokenize=True) does (no special tokens
added beyond the template's). The loss mask marks the assistant turns: the text each assistant
message adds after the generation prompt (its content and the template's end-of-turn text),
found by rendering the conversation up to each assistant message with add_generation_prompt=
True; only those tokens are loss targets, as transformers' labels = -100 elsewhere (TRL's
assistant_only_loss). The mask goes to <out>.mask (and <val-out>.mask): a 256 x int32 header
(magic 20261125, version 1, token count, the token bytes' CRC-32, the mask bytes' CRC-32,
conversations, 1 for preference pairs else 0), then one byte per token: bit 0 = loss target, bit 1 = first token of a
conversation (src/train/loss_mask.h; strata packs whole conversations into its windows with it).
A text run removes a stale <out>.mask.

Errors are one line naming the file, the line (JSONL) or row (Parquet, counted from 0) and the
column, and the fix (exit 1): a line that is not UTF-8 or not JSON, a file without the columns
of its --format (naming the columns it has and the --format they fit), a row whose column is
missing, null or not a string (or not a list of role/content strings), a conversation that is
empty or has no assistant turn, a preference pair whose chosen or rejected completion is empty
(an empty string, no assistant turn after the prompt) or whose strings come without a prompt, a Parquet input without pyarrow installed or that pyarrow cannot
read, an empty training or validation file, an --out or --val-out whose file, .mask or their
.tmp is an input (the corpus, the chat template; also through a link or a hard link), or an
--out and --val-out that collide; a template that cannot render a conversation or whose
rendering of the first messages is not the start of the whole conversation's. Nothing is written
on an error. Off the hot path: needs `transformers` (pip install transformers), and pyarrow for
Parquet, never dependencies of the build.
"""
import argparse
import codecs
import json
import os
import struct
import sys
import time
import zlib

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # also when run by runpy
from dataset_shapes import FORMATS, Error, Source, detect  # noqa: E402

HEADER_INTS = 256
CHUNK_CHARS = 1 << 20  # a document is encoded in pieces of about this many characters
MAX_TOKENS = 2**31 - 1  # the header's int32 count
MASK_MAGIC, MASK_VERSION = 20261125, 1
MASK_LOSS, MASK_START = 1, 2  # a mask byte's bits: loss target, first token of a conversation
MASK_PLAIN, MASK_PREFERENCE = 0, 1  # header word 6: conversations alone, or in pairs
# --help's table of the dataset shapes: the docstring's.
SHAPES_TABLE = __doc__[__doc__.index("  --format "):__doc__.index("\n\nAuto detection")]


def documents(path, shape, progress=None):
    """The documents of a .txt, .jsonl or .parquet file as a stream of events: ("text", str)
    pieces of the current document, then ("end", None). A .txt file is read in pieces of at most
    CHUNK_CHARS bytes, so no line, however long, is held whole; a JSONL line or a Parquet row is
    (read whole: `shape`'s rows). Reads bytes, so every error names its line; `progress(bytes_
    read)` is called as the file is read."""
    if shape is not None:
        for where, row in shape.src.rows(shape.columns, progress):
            yield "text", shape.example(where, row)
            yield "end", None
        return
    decoder = codecs.getincrementaldecoder("utf-8")("strict")
    with open(path, "rb") as f:
        lineno = 1  # of the line `raw` is (part of)
        column = 0  # bytes of this line before `raw`
        in_doc = False
        blank = True  # the line so far is whitespace only
        pending = []  # whitespace-only pieces of the current line, held until it ends
        while True:
            raw = f.readline(CHUNK_CHARS)
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

    def __init__(self, path, u32, mask=False, preference=False):
        self.path, self.tmp, self.u32, self.count = path, path + ".tmp", u32, 0
        self.preference = preference  # the mask's conversations are pairs (header word 6)
        self.mask_path = path + ".mask"
        self.crc = self.mask_crc = self.conversations = 0
        self.f = create_temp(self.tmp)
        self.m = create_temp(self.mask_path + ".tmp") if mask else None
        if not mask and os.path.lexists(self.mask_path + ".tmp"):
            os.unlink(self.mask_path + ".tmp")  # a killed chat run's: no run will move it
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
                            i32(self.mask_crc), self.conversations,
                            MASK_PREFERENCE if self.preference else MASK_PLAIN])
        finish(self.f, [20240801, 7, self.count] if self.u32 else [20240520, 1, self.count])

    def discard(self):
        for f, tmp in ((self.f, self.tmp), (self.m, self.mask_path + ".tmp")):
            if f and not f.closed:
                f.close()
            if f and os.path.lexists(tmp):
                os.unlink(tmp)


class Progress:
    """A progress line on stderr every `every` seconds (and at the end)."""

    def __init__(self, total_bytes, every=2.0, stream=None):
        self.total, self.every, self.stream = total_bytes, every, stream or sys.stderr
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


def span_mask(offsets, spans):
    """The mask bytes of tokens with character `offsets` ((start, end) each): MASK_LOSS on a
    token starting inside one of `spans` (sorted, disjoint (start, end) character ranges)."""
    mask, k = [], 0
    for start, _ in offsets:
        while k < len(spans) and start >= spans[k][1]:
            k += 1
        mask.append(MASK_LOSS if k < len(spans) and spans[k][0] <= start else 0)
    return mask


def chat_tokens(render, encode_offsets, messages, first=0):
    """(ids, mask) of one conversation. `render(messages, add_generation_prompt)` is the chat
    template's text; `encode_offsets(text)` the ids of that text (no special tokens added)
    with each one's (start, end) character offsets. An assistant message's span is the text
    rendering it adds after the generation prompt; a token starting in the span of an assistant
    message at index >= `first` is a loss target. Raises ValueError saying why not."""
    whole = render(messages, False)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant" or i < first:
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
    mask = span_mask(offsets, spans)
    if mask:
        mask[0] |= MASK_START
    return ids, mask


def completion_tokens(encode_offsets, specials, prompt, completion):
    """(ids, mask) of a prompt / completion pair of strings, as TRL's SFTTrainer tokenizes it:
    the text prompt + completion with the tokenizer's special tokens (`specials`: the ids before
    and after a text, EOS last), the loss on the tokens starting in the completion and on the
    closing specials (the model learns to stop)."""
    before, after = specials
    ids, offsets = encode_offsets(prompt + completion)
    mask = [0] * len(before) + span_mask(offsets, [(len(prompt), len(prompt) + len(completion))])
    ids = list(before) + list(ids) + list(after)
    mask += [MASK_LOSS] * len(after)
    if mask:
        mask[0] |= MASK_START
    return ids, mask


def prepare_chat(render, encode_offsets, vocab_size, input_path, out, val_out=None,
                 val_fraction=0.01, progress_every=2.0, shape=None, specials=([], [])):
    """Streams the examples of `input_path` (read as `shape`, a dataset_shapes.Shape; default:
    the "messages" rows of a JSONL file) into `out` (and `val_out`) with their loss masks:
    conversations through chat_tokens, prompt / completion strings through completion_tokens
    (with `specials`); a preference pair as its chosen sequence then its rejected one, both in
    the same file (the held-out split goes by whole pairs), the masks marked as pairs.
    Returns {path: token count}."""
    check_paths(input_path, out, val_out, val_fraction)
    if shape is None:
        shape = detect(Source(input_path), "messages")
    u32 = vocab_size > 65536
    progress = Progress(os.path.getsize(input_path), progress_every)
    pairs = shape.preference
    files = [TokenFile(out, u32, mask=True, preference=pairs)]
    if val_out:
        files.append(TokenFile(val_out, u32, mask=True, preference=pairs))

    def tokens(ex):
        if ex.kind == "chat":
            return chat_tokens(render, encode_offsets, ex.a, ex.b)
        return completion_tokens(encode_offsets, specials, ex.a, ex.b)

    def fill():
        rows = shape.src.rows(shape.columns, lambda b: progress.update(b))
        for n, (where, row) in enumerate(rows):
            ex = shape.example(where, row)
            to_val = val_out and int((n + 1) * val_fraction) > int(n * val_fraction)
            sides = [ex.a, ex.b] if ex.kind == "pair" else [ex]
            try:
                seqs = [tokens(side) for side in sides]
            except (Error, ValueError) as e:
                raise Error(f"{where}: {e}")
            except Exception as e:  # noqa: BLE001 (a Jinja template's own error, any type)
                raise Error(f"{where}: the chat template failed: {type(e).__name__}: {e}")
            for name, (ids, mask) in zip(("chosen", "rejected") if pairs else ("",), seqs):
                if pairs and not any(m & MASK_LOSS for m in mask):
                    raise Error(f'{where}: "{name}" gives no loss token (an empty completion); '
                                "fix or drop the row")
                (files[1] if to_val else files[0]).write(ids, mask)
                progress.update(tokens=len(ids))
            progress.update(docs=1)

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


def document_specials(encode, eos):
    """(ids before, ids after) a document: the tokenizer's special tokens (BOS, ...) and its
    EOS last (added when the tokenizer adds none), so documents never run together."""
    before, after = special_ids(encode)
    return before, after + ([eos] if eos is not None and eos not in after[-1:] else [])


def prepare(encode, eos, vocab_size, input_path, out, shape=None, val_out=None,
            val_fraction=0.01, progress_every=2.0):
    """Streams `input_path` into `out` (and `val_out`): a .txt file's paragraphs, or the rows of
    a .jsonl / .parquet file read as `shape` (a "text" dataset_shapes.Shape; default: the "text"
    field). `encode(text, add_special_tokens)` returns a list of ids. Returns
    {path: token count}."""
    check_paths(input_path, out, val_out, val_fraction)
    if shape is None and input_path.endswith((".jsonl", ".parquet")):
        shape = detect(Source(input_path), "text")
    u32 = vocab_size > 65536
    before, tail = document_specials(encode, eos)
    progress = Progress(os.path.getsize(input_path), progress_every)
    files = [TokenFile(out, u32)]
    if val_out:
        files.append(TokenFile(val_out, u32))

    def fill():
        doc, buf, dst, n = 0, "", None, 0
        for kind, text in documents(input_path, shape, lambda b: progress.update(b)):
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


def input_shape(args):
    """The dataset_shapes.Shape of --input (None: a .txt file) from --format / --chat / --field;
    says on stderr which shape auto detection found."""
    fmt = "messages" if args.chat and args.format == "auto" else args.format
    if args.chat and fmt != "messages":
        raise Error(f"--chat is --format messages; it cannot go with --format {args.format}")
    if not args.input.endswith((".jsonl", ".parquet")) and fmt in ("auto", "text"):
        return None  # plain text: one document a paragraph (any other name reads as JSONL)
    shape = detect(Source(args.input), fmt, args.field)
    if args.format == "auto" and not args.chat and args.field is None:
        print(f"prepare_data: {args.input}: --format {shape.label}", file=sys.stderr)
    return shape


def main():
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="dataset shapes (--format, auto: found from the columns):\n" + SHAPES_TABLE)
    ap.add_argument("--model", required=True, help="Hugging Face model directory (tokenizer)")
    ap.add_argument("--input", required=True, help=".txt, .jsonl or .parquet")
    ap.add_argument("--out", required=True)
    ap.add_argument("--format", default="auto", choices=FORMATS,
                    help="the dataset's shape (table below); auto: found from the columns")
    ap.add_argument("--field", default=None,
                    help="the column holding the text (--format text; default \"text\")")
    ap.add_argument("--val-out", default=None, help="also write one document in 1/fraction here")
    ap.add_argument("--val-fraction", type=float, default=0.01)
    ap.add_argument("--chat", action="store_true",
                    help="the same as --format messages")
    ap.add_argument("--chat-template", default=None,
                    help="a Jinja chat template file instead of the tokenizer's (the chat shapes)")
    args = ap.parse_args()
    try:
        check_paths(args.input, args.out, args.val_out, args.val_fraction,
                    inputs=[args.chat_template] if args.chat_template else [])
        shape = input_shape(args)
    except Error as e:
        sys.exit(f"prepare_data: {e}")
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
    no_template = Error(f"{args.model}: its tokenizer has no chat template (tokenizer_config."
                        "json's chat_template or chat_template.jinja); give --chat-template "
                        "FILE (a Jinja template)")

    def encode(text, specials):
        return tok(text, add_special_tokens=specials)["input_ids"]

    def render(messages, add_generation_prompt):
        if not getattr(tok, "chat_template", None):
            raise no_template
        return tok.apply_chat_template(messages, tokenize=False,
                                       add_generation_prompt=add_generation_prompt)

    def encode_offsets(text):
        enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
        return enc["input_ids"], enc["offset_mapping"]

    try:
        for p in (args.out, args.val_out):
            if p and complete_pending(p):
                print(f"prepare_data: finished moving the files of a killed run into place "
                      f"({p})", file=sys.stderr)
        if args.chat_template:
            with open(args.chat_template) as f:
                tok.chat_template = f.read()
        if shape is not None and shape.chat:
            if (shape.name not in ("prompt-completion", "preference") and
                    not getattr(tok, "chat_template", None)):
                raise no_template
            prepare_chat(render, encode_offsets, len(tok), args.input, args.out, args.val_out,
                         args.val_fraction, shape=shape,
                         specials=document_specials(encode, tok.eos_token_id))
        else:
            prepare(encode, tok.eos_token_id, len(tok), args.input, args.out, shape,
                    args.val_out, args.val_fraction)
    except Error as e:
        sys.exit(f"prepare_data: {e}")
    except OSError as e:
        sys.exit(f"prepare_data: {e.filename or ''}: {e.strerror}")
    except KeyboardInterrupt:
        sys.exit("prepare_data: interrupted; no output written")


if __name__ == "__main__":
    main()
