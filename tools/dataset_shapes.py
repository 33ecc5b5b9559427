"""The rows of a JSONL or Parquet dataset and the shapes fine-tuning data ships in, read for
tools/prepare_data.py (its docstring is the user's description of the shapes).

A Source reads a file as rows: a .jsonl file one JSON object a line (errors name "path:line"),
a .parquet file one row group at a time with pyarrow's ParquetFile.iter_batches, only the
columns a shape needs (errors name "path: row N", N counted from 0 as datasets' Dataset[N]
does), so memory holds one row group of those columns and BATCH_ROWS rows as Python objects,
whatever the file's size. pyarrow is imported only for a Parquet input; without it the error
names `pip install pyarrow`.

detect() picks a Shape from the columns (Parquet: the schema's; JSONL: the first object's keys)
or checks the one --format names; Shape.example(where, row) turns a row into what
prepare_data tokenizes: a document (str) for "text"; for the others an Example:
("chat", messages, first): a conversation rendered with the chat template, loss on the assistant
messages at index >= first; ("completion", prompt, completion): the text prompt + completion,
loss on the completion's tokens; ("pair", chosen, rejected): a preference pair, each side one of
the two before (the chosen and the rejected sequence, in that order). Every error is an Error: one line naming the file, the row (or
line) and the column, and what to do.
"""
import json
import os
from collections import namedtuple

FORMATS = ("auto", "text", "messages", "alpaca", "prompt-completion", "preference")
BATCH_ROWS = 64  # Parquet rows turned into Python objects at a time
ROLE_NAMES = {"human": "user", "gpt": "assistant"}  # ShareGPT's, as TRL's maybe_convert_to_chatml
MESSAGE_LIST = 'a non-empty list of {"role": str, "content": str}'

# ("chat", messages, first) / ("completion", p, c) / ("pair", chosen Example, rejected Example)
Example = namedtuple("Example", "kind a b")


class Error(Exception):
    """A user-facing error: printed as one line, exit status 1."""


def describe(value):
    """A value's kind as an error names it."""
    if value is None:
        return "null"
    return {str: "a string", list: "a list", dict: "an object", bool: "a boolean",
            int: "a number", float: "a number"}.get(type(value), type(value).__name__)


def import_parquet(path):
    try:
        import pyarrow
        import pyarrow.parquet
    except ImportError:
        raise Error(f"{path}: reading Parquet needs pyarrow, an optional dependency of this tool: "
                    "pip install pyarrow") from None
    return pyarrow, pyarrow.parquet


class Source:
    """A .jsonl or .parquet file read as rows. `columns`: the Parquet schema's top-level names,
    or the keys of a JSONL file's first object (None when its first non-blank line is not a
    JSON object: the row reader reports that line). `noun`: "column" or "field"."""

    def __init__(self, path):
        self.path = path
        self.parquet = path.endswith(".parquet")
        self.noun = "column" if self.parquet else "field"
        if self.parquet:
            pa, pq = import_parquet(path)
            try:
                self.file = pq.ParquetFile(path)
            except pa.ArrowException as e:
                raise Error(f"{path}: not a Parquet file pyarrow can read ({e}); datasets ship "
                            "it as .parquet, JSON lines as .jsonl") from None
            self.arrow = pa
            self.columns = list(self.file.schema_arrow.names)
        else:
            self.columns = self.first_keys()

    def first_keys(self):
        with open(self.path, "rb") as f:
            for raw in f:
                if raw.strip():
                    try:
                        obj = json.loads(raw.decode("utf-8"))
                    except (UnicodeDecodeError, json.JSONDecodeError):
                        return None
                    return list(obj) if isinstance(obj, dict) else None
        return []

    def rows(self, columns, progress=None):
        """(where, row) for each row: a Parquet row as a dict of `columns`, a JSONL line's value
        (not necessarily an object). `progress(bytes)` is called as the file is read (Parquet:
        the file's size times the fraction of rows read)."""
        if self.parquet:
            yield from self.parquet_rows(columns, progress)
            return
        with open(self.path, "rb") as f:
            for lineno, raw in enumerate(f, 1):
                if progress:
                    progress(f.tell())
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise Error(f"{self.path}:{lineno}: not UTF-8 (byte 0x{raw[e.start]:02x} at "
                                f"byte {e.start} of the line); re-encode the file as UTF-8 "
                                "(e.g. iconv -f latin1 -t utf-8)") from None
                if not text.strip():
                    continue
                try:
                    obj = json.loads(text)
                except json.JSONDecodeError as e:
                    raise Error(f"{self.path}:{lineno}: not valid JSON ({e.msg} at column "
                                f"{e.colno}); each line of a .jsonl file must be one JSON "
                                "object") from None
                del raw, text  # a long line: hold only its parsed object
                yield f"{self.path}:{lineno}", obj

    def parquet_rows(self, columns, progress):
        # One row group at a time: iter_batches over the whole file reads ahead far past the
        # batch it yields (a file of small row groups is held whole), over one it does not.
        total = max(self.file.metadata.num_rows, 1)
        size = os.path.getsize(self.path)
        i = 0
        try:
            for group in range(self.file.metadata.num_row_groups):
                for batch in self.file.iter_batches(batch_size=BATCH_ROWS, row_groups=[group],
                                                    columns=columns):
                    rows = batch.to_pylist()
                    del batch
                    for row in rows:
                        yield f"{self.path}: row {i}", row
                        i += 1
                    if progress:
                        progress(size * i // total)
        except self.arrow.ArrowException as e:
            raise Error(f"{self.path}: row {i}: pyarrow cannot read it ({e})") from None


def keys_note(src, row):
    """What a row has, for an error: its keys (JSONL) or the file's columns (Parquet)."""
    if src.parquet:
        return f"columns: {', '.join(src.columns)}"
    return f"the line has keys {sorted(row)}" if isinstance(row, dict) else "the line has no object"


class Shape:
    """One of the shapes: `name` (a --format), `columns` (what it reads), `label` (for the line
    saying what was detected), example(where, row)."""

    def __init__(self, src, name, columns, field="text"):
        self.src, self.name, self.columns, self.field = src, name, columns, field
        self.label = f"{name} ({' + '.join(repr(c) for c in columns)})".replace("'", '"')

    @property
    def chat(self):
        """True when the rows are conversations or prompt/completion pairs (a loss mask)."""
        return self.name != "text"

    @property
    def preference(self):
        """True when each row is a preference pair (two sequences: chosen, then rejected)."""
        return self.name == "preference"

    def value(self, where, row, name, want, optional=False):
        """row[name] checked to be of type `want` (None allowed when `optional`)."""
        has = isinstance(row, dict) and name in row
        v = row.get(name) if isinstance(row, dict) else None
        if isinstance(v, want) or (optional and v is None):
            return v
        if not has:
            raise Error(f'{where}: no {self.src.noun} "{name}" ({keys_note(self.src, row)}); '
                        f"every row of --format {self.label} has it")
        wants = "a string" if want is str else "a string or a list of messages"
        raise Error(f'{where}: {self.src.noun} "{name}" is {describe(v)}, not {wants}; fix or '
                    "drop the row")

    def messages(self, where, row, name):
        """row[name] as a list of {"role", "content", ...} (ShareGPT's {"from", "value"}
        mapped; keys whose value is null dropped, as a JSONL line without them reads)."""
        v = row.get(name) if isinstance(row, dict) else None
        problem = None
        if not isinstance(row, dict) or name not in row:
            problem = f"no {self.src.noun} \"{name}\" ({keys_note(self.src, row)})"
        elif not isinstance(v, list) or not v:
            problem = f"it is {describe(v) if v != [] else 'an empty list'}"
        else:
            out = []
            for i, m in enumerate(v):
                if not isinstance(m, dict):
                    problem = f"message {i} is {describe(m)}"
                    break
                m = {k: x for k, x in m.items() if x is not None}
                if "role" not in m and "from" in m:
                    role = m.pop("from")
                    m["role"] = ROLE_NAMES.get(role, role)
                    if "value" in m:
                        m["content"] = m.pop("value")
                bad = [k for k in ("role", "content") if not isinstance(m.get(k), str)]
                if bad:
                    problem = f"message {i}'s \"{bad[0]}\" is {describe(m.get(bad[0]))}"
                    break
                out.append(m)
            if problem is None:
                return out
        raise Error(f'{where}: needs "{name}": {MESSAGE_LIST} ({problem}); one conversation a '
                    "row")

    def example(self, where, row):
        if self.name == "text":
            v = row.get(self.field) if isinstance(row, dict) else None
            if isinstance(v, str):
                return v
            if self.src.parquet:
                raise Error(f'{where}: column "{self.field}" is {describe(v)}, not a string; fix '
                            "or drop the row")
            has = f"keys {sorted(row)}" if isinstance(row, dict) else "no object"
            raise Error(f'{where}: no string field "{self.field}" (the line has {has}); name the '
                        "field with --field")
        if self.name == "messages":
            name = self.columns[0]
            msgs = self.messages(where, row, name)
            if not any(m["role"] == "assistant" for m in msgs):
                raise Error(f'{where}: no "assistant" message: nothing to train on (the loss '
                            "covers the assistant turns only); drop the row")
            return Example("chat", msgs, 0)
        if self.name == "alpaca":
            instruction = self.value(where, row, "instruction", str)
            extra = self.value(where, row, "input", str, optional=True)
            output = self.value(where, row, "output", str)
            user = instruction + ("\n\n" + extra if extra else "")
            return Example("chat", [{"role": "user", "content": user},
                                    {"role": "assistant", "content": output}], 0)
        if self.name == "preference":
            return self.pair(where, row)
        # prompt-completion: two strings, or two message lists (TRL's conversational form).
        p = self.value(where, row, "prompt", (str, list))
        c = self.value(where, row, "completion", (str, list))
        if isinstance(p, str) and isinstance(c, str):
            return Example("completion", p, c)
        if isinstance(p, list) and isinstance(c, list):
            prompt = self.messages(where, row, "prompt")
            completion = self.messages(where, row, "completion")
            if not any(m["role"] == "assistant" for m in completion):
                raise Error(f'{where}: no "assistant" message in "completion": nothing to train '
                            "on (the loss covers the completion's assistant turns); drop the row")
            return Example("chat", prompt + completion, len(prompt))
        raise Error(f'{where}: "prompt" is {describe(p)} and "completion" {describe(c)}; both '
                    "must be strings or both message lists")


    def pair(self, where, row):
        """A preference row (TRL's preference type): "prompt" (optional), "chosen", "rejected",
        all strings or all message lists; without "prompt", chosen and rejected are whole
        conversations and the prompt is their longest common start of whole messages (TRL's
        extract_prompt; each side keeps at least its last message)."""
        has_prompt = isinstance(row, dict) and "prompt" in row
        p = self.value(where, row, "prompt", (str, list)) if has_prompt else None
        c = self.value(where, row, "chosen", (str, list))
        r = self.value(where, row, "rejected", (str, list))
        if isinstance(c, str) and isinstance(r, str):
            if p is None:
                raise Error(f'{where}: "chosen" and "rejected" are strings without a "prompt" '
                            f"{self.src.noun}: the prompt they share cannot be told apart from "
                            'the completions; give a "prompt" (and the completions alone in '
                            '"chosen" and "rejected"), or write them as message lists')
            if not isinstance(p, str):
                raise Error(f'{where}: "prompt" is {describe(p)} and "chosen", "rejected" '
                            "strings; all three must be strings or all message lists")
            for name, v in (("chosen", c), ("rejected", r)):
                if not v:
                    raise Error(f'{where}: "{name}" is an empty string: a completion with '
                                "nothing to prefer; fix or drop the row")
            return Example("pair", Example("completion", p, c), Example("completion", p, r))
        if not (isinstance(c, list) and isinstance(r, list) and (p is None or
                                                                 isinstance(p, list))):
            kinds = ", ".join(f'"{n}" {describe(v)}' for n, v in
                              (("prompt", p), ("chosen", c), ("rejected", r))
                              if n != "prompt" or has_prompt)
            raise Error(f"{where}: {kinds}; all must be strings or all message lists")
        chosen = self.messages(where, row, "chosen")
        rejected = self.messages(where, row, "rejected")
        if p is not None:
            prompt = self.messages(where, row, "prompt")
        else:
            k = 0
            while k < min(len(chosen), len(rejected)) - 1 and chosen[k] == rejected[k]:
                k += 1
            prompt, chosen, rejected = chosen[:k], chosen[k:], rejected[k:]
        sides = []
        for name, completion in (("chosen", chosen), ("rejected", rejected)):
            if not any(m["role"] == "assistant" for m in completion):
                what = "" if p is not None else " after the prompt it shares with the other"
                raise Error(f'{where}: no "assistant" message in "{name}"{what}: an empty '
                            "completion, nothing to prefer (the loss covers the completion's "
                            "assistant turns); drop the row")
            sides.append(Example("chat", prompt + completion, len(prompt)))
        return Example("pair", *sides)


# The shapes --format names, in the order auto detection tries them: the column sets each
# reads (the first found is used; an error names the shortest as expected). Preference first:
# a preference dataset may carry a "messages" column beside its pairs (UltraFeedback's).
SHAPES = [("preference", [["prompt", "chosen", "rejected"], ["chosen", "rejected"]]),
          ("messages", [["messages"], ["conversations"]]),
          ("prompt-completion", [["prompt", "completion"]]),
          ("alpaca", [["instruction", "input", "output"], ["instruction", "output"]]),
          ("text", [["text"]])]


def column_sets(name, field=None):
    return [[field]] if name == "text" and field else dict(SHAPES)[name]


def match(name, columns, field=None):
    """The columns shape `name` reads from a file with `columns`, or None."""
    return next((want for want in column_sets(name, field)
                 if all(c in columns for c in want)), None)


def detect(src, fmt="auto", field=None):
    """The Shape of `src`'s rows: `fmt` (a FORMATS name; "auto": the first of SHAPES whose
    columns are all there) with `field` (the text column; naming it means --format text). A
    JSONL file whose first line is not an object (or that has none) reads as `fmt` (text for
    auto): its rows report the line."""
    if field is not None and fmt not in ("auto", "text"):
        raise Error(f"--field names the text column of --format text, not of --format {fmt}")
    if field is not None:
        fmt = "text"
    cols = src.columns
    if cols is None or (not cols and not src.parquet):
        name = "text" if fmt == "auto" else fmt
        return Shape(src, name, column_sets(name, field)[0], field or "text")
    have = (f"{'columns' if src.parquet else 'the first line has keys'}: "
            f"{', '.join(cols) or 'none'}")
    if fmt == "auto":
        for name, _ in SHAPES:
            want = match(name, cols)
            if want:
                return Shape(src, name, want)
        raise Error(f"{src.path}: no {src.noun}s of a dataset shape ({have}); expected "
                    '"text", "messages" (or "conversations"), "prompt" + "completion", '
                    '"instruction" + "output", or "chosen" + "rejected"; name the text column '
                    "with --field NAME")
    want = match(fmt, cols, field)
    if want:
        return Shape(src, fmt, want, field or "text")
    missing = [c for c in min(column_sets(fmt, field), key=len) if c not in cols]
    guess = next((n for n, _ in SHAPES if match(n, cols)), None)
    if guess == "text":
        fix = "use --field text" if fmt == "text" else "use --format text or --field text"
    elif guess:
        fix = f"use --format {guess}"
    else:
        fix = "name the text column with --field NAME" if fmt == "text" else \
            "choose the --format its columns have"
    names = ", ".join(f'"{c}"' for c in missing)
    raise Error(f"{src.path}: no {src.noun} {names} ({have}); {fix}")
