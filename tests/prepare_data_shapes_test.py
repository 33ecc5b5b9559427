#!/usr/bin/env python3
"""tools/prepare_data.py on datasets as the Hugging Face Hub ships them: each shape (text,
messages, ShareGPT conversations, alpaca, prompt-completion as strings and as messages) from
JSONL and from Parquet gives the tokens and the loss mask an independent computation predicts;
the shape is found from the columns or named with --format; a file without the columns, a null
or mistyped value, an empty conversation, a Parquet file pyarrow cannot read or a missing
pyarrow is one line naming the file, the row (or line) and the column, and nothing is written;
a Parquet file of many row groups is read in bounded memory.

Runs with prepare_data_test.py's test double of `transformers` (a byte-level tokenizer: id =
byte + 3, BOS 1, EOS 2; its chat template renders "<role>content|" per message and
"<assistant>" as the generation prompt). The Parquet tests need pyarrow in this python (an
optional dependency of the tool: pip install pyarrow) and say so when they skip (the JSONL
half of a test runs all the same). With the real transformers installed (STRATA_HF_PYTHON), the
prompt-completion (strings and messages) and alpaca tokens and masks are checked against the
fixtures' real tokenizers: TRL's tokenization, apply_chat_template's ids.

usage: prepare_data_shapes_test.py  (unittest; ctest prepare_data_shapes)
"""
import io
import json
import os
import shutil
import subprocess
import sys
import unittest
from contextlib import redirect_stderr, redirect_stdout

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import prepare_data_test as base  # noqa: E402
from prepare_data_test import ROOT, TOOL, prepare_data, read_mask, read_tokens  # noqa: E402

try:
    import pyarrow
    import pyarrow.parquet
except ImportError:
    pyarrow = None
NO_PYARROW = "pyarrow is not installed for this python (pip install pyarrow; STRATA_HF_PYTHON)"

# A pyarrow that is not there, for the tool's missing-dependency error.
NO_PYARROW_MODULE = 'raise ImportError("No module named \'pyarrow\'")\n'

# Rows of each shape, and each row's tokens as the fake tokenizer and template give them,
# written out by hand from the shape's definition (not through the tool's code): the text the
# ids spell, [loss targets] in brackets, B and E the BOS and EOS ids.
SYSTEM = {"role": "system", "content": "be brief"}
SHAPES = {
    "text": ([{"text": "alpha"}, {"text": "beta gamma"}], ["BalphaE", "Bbeta gammaE"]),
    "messages": ([{"messages": [SYSTEM, {"role": "user", "content": "q1"},
                                {"role": "assistant", "content": "a1"},
                                {"role": "user", "content": "q2"},
                                {"role": "assistant", "content": "a22"}]},
                  {"messages": [{"role": "user", "content": "hi"},
                                {"role": "assistant", "content": "yo"}]}],
                 ["<system>be brief|<user>q1|<assistant>[a1|]<user>q2|<assistant>[a22|]",
                  "<user>hi|<assistant>[yo|]"]),
    "conversations": ([{"conversations": [{"from": "system", "value": "s"},
                                          {"from": "human", "value": "q"},
                                          {"from": "gpt", "value": "a"}]},
                       {"conversations": [{"role": "user", "content": "u"},
                                          {"role": "assistant", "content": "v"}]}],
                      ["<system>s|<user>q|<assistant>[a|]", "<user>u|<assistant>[v|]"]),
    "alpaca": ([{"instruction": "add", "input": "1 2", "output": "3"},
                {"instruction": "greet", "input": "", "output": "hello"}],
               ["<user>add\n\n1 2|<assistant>[3|]", "<user>greet|<assistant>[hello|]"]),
    "prompt-completion": ([{"prompt": "The sky is", "completion": " blue."},
                           {"prompt": "2+2=", "completion": "4"}],
                          ["BThe sky is[ blue.E]", "B2+2=[4E]"]),
    "prompt-completion messages": (
        [{"prompt": [SYSTEM, {"role": "user", "content": "1+1"},
                     {"role": "assistant", "content": "2"},  # a shot in the prompt: no loss
                     {"role": "user", "content": "2+2"}],
          "completion": [{"role": "assistant", "content": "4"}]}],
        ["<system>be brief|<user>1+1|<assistant>2|<user>2+2|<assistant>[4|]"]),
}
FORMAT = {"conversations": "messages", "prompt-completion messages": "prompt-completion"}


def expected(rows):
    """(tokens, mask) of `rows` written as SHAPES writes them: a character's byte + 3 (B, E: the
    BOS and EOS ids 1 and 2), loss on the characters in brackets, each row's first token a
    conversation start."""
    tokens, mask = [], []
    for row in rows:
        loss, first = 0, True
        for ch in row:
            if ch in "[]":
                loss = int(ch == "[")
                continue
            tokens.append({"B": 1, "E": 2}.get(ch, ord(ch) + 3))
            mask.append(loss | (2 if first else 0))
            first = False
    return tokens, mask


class Shapes(base.Fixture):
    def write_jsonl(self, name, rows):
        return self.write(name, "".join(json.dumps(r) + "\n" for r in rows))

    def write_parquet(self, name, rows, row_group_size=None):
        if pyarrow is None:
            self.skipTest(NO_PYARROW)
        table = pyarrow.Table.from_pylist(rows)
        pyarrow.parquet.write_table(table, self.path(name), row_group_size=row_group_size)
        return self.path(name)

    def outputs(self):
        return sorted(n for n in os.listdir(self.dir) if n.startswith(("t.bin", "v.bin")))

    def assert_fails_writing_nothing(self, args, message):
        self.assert_fails(args, message)
        self.assertEqual(self.outputs(), [], f"a failed run left files ({message})")

    def prepared(self, src, *args):
        rc, err, _ = self.run_tool("--input", src, "--out", self.path("t.bin"), *args)
        self.assertEqual(rc, 0, err)
        tokens = read_tokens(self.path("t.bin"))
        mask = read_mask(self.path("t.bin"))[1] if os.path.exists(self.path("t.bin.mask")) else None
        return tokens, mask, err

    def test_each_shape_from_jsonl_and_parquet(self):
        for shape, (rows, want) in SHAPES.items():
            tokens, mask = expected(want)
            sources = [self.write_jsonl("d.jsonl", rows)]
            if pyarrow is not None:
                sources.append(self.write_parquet("d.parquet", rows))
            for src in sources:
                fmt = FORMAT.get(shape, shape)
                for args in ([], ["--format", fmt]):
                    got_tokens, got_mask, err = self.prepared(src, *args)
                    what = f"{shape} from {os.path.basename(src)} {args}"
                    self.assertEqual(got_tokens, tokens, what)
                    if shape == "text":
                        self.assertIsNone(got_mask, what)
                    else:
                        self.assertEqual(got_mask, mask, what)
                    if not args:
                        self.assertIn(f"--format {fmt} (", err, what)
        if pyarrow is None:
            self.skipTest(f"JSONL checked; Parquet not: {NO_PYARROW}")

    def test_the_mask_is_the_chat_runs_mask(self):
        # The same conversations as alpaca rows and as messages: the same tokens, the same mask
        # file byte for byte (header, CRC-32s, conversation starts).
        rows = SHAPES["alpaca"][0]
        as_messages = [{"messages": [
            {"role": "user", "content": r["instruction"] + ("\n\n" + r["input"] if r["input"]
                                                            else "")},
            {"role": "assistant", "content": r["output"]}]} for r in rows]
        self.prepared(self.write_jsonl("a.jsonl", rows))
        with open(self.path("t.bin.mask"), "rb") as f:
            alpaca = f.read()
        self.prepared(self.write_jsonl("m.jsonl", as_messages), "--chat")
        with open(self.path("t.bin.mask"), "rb") as f:
            self.assertEqual(f.read(), alpaca)

    def test_field_and_validation_split_from_parquet(self):
        rows = [{"id": i, "body": f"doc {i}"} for i in range(8)]
        src = self.write_parquet("d.parquet", rows, row_group_size=3)
        rc, err, _ = self.run_tool("--input", src, "--out", self.path("t.bin"), "--field", "body",
                                   "--val-out", self.path("v.bin"), "--val-fraction", "0.25")
        self.assertEqual(rc, 0, err)
        # Documents 3 and 7 (one in four, spread) go to validation.
        self.assertEqual(read_tokens(self.path("v.bin")),
                         expected(["Bdoc 3E", "Bdoc 7E"])[0])
        self.assertEqual(len(read_tokens(self.path("t.bin"))), 6 * 7)
        chats = [{"prompt": f"q{i}", "completion": f"a{i}"} for i in range(8)]
        src = self.write_parquet("c.parquet", chats, row_group_size=3)
        rc, err, _ = self.run_tool("--input", src, "--out", self.path("t.bin"),
                                   "--val-out", self.path("v.bin"), "--val-fraction", "0.25")
        self.assertEqual(rc, 0, err)
        for name, convs in (("t.bin", 6), ("v.bin", 2)):
            header, mask = read_mask(self.path(name))
            self.assertEqual(header[5], convs, name)
            self.assertEqual(sum(m & 1 for m in mask), 3 * convs, name)  # "aN" and EOS each

    def test_a_file_without_the_shapes_columns_names_them(self):
        rows, other = [{"id": 1, "text": "a"}], [{"id": 1, "body": "a"}]
        files = [(self.write_jsonl("data.jsonl", rows), self.write_jsonl("other.jsonl", other),
                  "field", "the first line has keys")]
        if pyarrow is not None:
            files.append((self.write_parquet("data.parquet", rows),
                          self.write_parquet("other.parquet", other), "column", "columns"))
        for src, src2, noun, has in files:
            self.assert_fails_writing_nothing(
                ["--input", src, "--out", self.path("t.bin"), "--format", "messages"],
                f'{src}: no {noun} "messages" ({has}: id, text); use --format text or --field text')
            self.assert_fails_writing_nothing(
                ["--input", src, "--out", self.path("t.bin"), "--format", "alpaca"],
                f'{src}: no {noun} "instruction", "output" ({has}: id, text); use --format text')
            self.assert_fails_writing_nothing(
                ["--input", src, "--out", self.path("t.bin"), "--field", "body"],
                f'{src}: no {noun} "body" ({has}: id, text); use --field text')
            self.assert_fails_writing_nothing(
                ["--input", src2, "--out", self.path("t.bin")],
                f'{src2}: no {noun}s of a dataset shape ({has}: id, body); expected "text", '
                '"messages" (or "conversations"), "prompt" + "completion", "instruction" + '
                '"output", or "chosen" + "rejected"; name the text column with --field NAME')
            self.assert_fails_writing_nothing(
                ["--input", src2, "--out", self.path("t.bin"), "--format", "alpaca", "--field",
                 "body"], "--field names the text column of --format text, not of --format alpaca")
        if pyarrow is None:
            self.skipTest(f"JSONL checked; Parquet not: {NO_PYARROW}")

    def test_bad_values_name_the_row_and_column(self):
        msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
        good = {"messages": msgs}
        needs = 'needs "messages": a non-empty list of {"role": str, "content": str} '
        cases = [  # (rows, the error at Parquet's row 1, at JSONL's line 2)
            ([{"text": "a"}, {"text": None}], 'column "text" is null, not a string',
             "no string field \"text\" (the line has keys ['text'])"),
            ([good, {"messages": []}], needs + "(it is an empty list)", None),
            ([good, {"messages": [msgs[0], {"role": "assistant", "content": None}]}],
             needs + "(message 1's \"content\" is null)", None),
            ([good, {"messages": [{"role": "user", "content": "q", "extra": 1}, "hi"]}],
             None, needs + "(message 1 is a string)"),
            ([good, {"messages": msgs[:1]}], 'no "assistant" message: nothing to train on',
             None),
            ([{"instruction": "i", "input": "", "output": "o"},
              {"instruction": "i", "input": None, "output": None}],
             'column "output" is null, not a string', 'field "output" is null, not a string'),
            ([{"prompt": "p", "completion": "c"}, {"prompt": "p", "completion": None}],
             'column "completion" is null, not a string or a list of messages',
             'field "completion" is null, not a string or a list of messages'),
            ([{"prompt": "p", "completion": "c"}, {"prompt": "p", "completion": [msgs[1]]}],
             None, '"prompt" is a string and "completion" a list; both must be strings or both '
             "message lists"),
            ([{"prompt": [msgs[0]], "completion": [msgs[1]]},
              {"prompt": [msgs[0]], "completion": [msgs[0]]}],
             'no "assistant" message in "completion": nothing to train on', None),
        ]
        for rows, in_parquet, in_jsonl in cases:
            src = self.write_jsonl("bad.jsonl", rows)
            self.assert_fails_writing_nothing(["--input", src, "--out", self.path("t.bin")],
                                              f"{src}:2: {in_jsonl or in_parquet}")
            if pyarrow is not None and in_parquet:
                src = self.write_parquet("bad.parquet", rows)
                self.assert_fails_writing_nothing(["--input", src, "--out", self.path("t.bin")],
                                                  f"{src}: row 1: {in_parquet}")
        # A JSONL line without the shape's field names the line and the keys it has.
        src = self.write_jsonl("bad.jsonl", [{"instruction": "i", "output": "o"},
                                             {"instruction": "i", "answer": "o"}])
        self.assert_fails_writing_nothing(
            ["--input", src, "--out", self.path("t.bin")],
            f"{src}:2: no field \"output\" (the line has keys ['answer', 'instruction'])")
        if pyarrow is None:
            self.skipTest(f"JSONL checked; Parquet not: {NO_PYARROW}")

    def test_unreadable_parquet_and_missing_pyarrow(self):
        src = self.write("junk.parquet", b"PAR1 this is not a Parquet file\n")
        if pyarrow is not None:
            self.assert_fails_writing_nothing(["--input", src, "--out", self.path("t.bin")],
                                              f"{src}: not a Parquet file pyarrow can read")
        # Without pyarrow: one line naming the install (a stand-in that fails to import).
        fake = os.path.join(self.dir, "fake", "pyarrow")
        os.makedirs(fake)
        with open(os.path.join(fake, "__init__.py"), "w") as f:
            f.write(NO_PYARROW_MODULE)
        self.assert_fails_writing_nothing(
            ["--input", src, "--out", self.path("t.bin")],
            f"{src}: reading Parquet needs pyarrow, an optional dependency of this tool: pip "
            "install pyarrow")
        shutil.rmtree(fake)
        # A JSONL input never imports it.
        rc, err, _ = self.run_tool("--input", self.write_jsonl("d.jsonl", [{"text": "a"}]),
                                   "--out", self.path("t.bin"))
        self.assertEqual(rc, 0, err)

    def test_progress_over_a_parquet_file(self):
        src = self.write_parquet("d.parquet", [{"text": f"doc {i}"} for i in range(10)],
                                 row_group_size=2)
        shape = prepare_data.detect(prepare_data.Source(src), "auto")
        err = io.StringIO()
        with redirect_stderr(err), redirect_stdout(io.StringIO()):
            prepare_data.prepare(lambda t, s: [1] * s + [ord(c) for c in t], 2, 300, src,
                                 self.path("t.bin"), shape, progress_every=0.0)
        lines = [l for l in err.getvalue().split("\n") if l.startswith("prepare_data:")]
        self.assertGreater(len(lines), 5)
        self.assertIn("(100%) | 10 documents", lines[-1])

    def test_memory_is_bounded_on_a_parquet_file_of_many_row_groups(self):
        # 64 MB of text in 32 row groups of 2 MB. Over a run on one small row group, the peak
        # grows by about 40 MB (the pieces of a 1 MB document as ids, Arrow's pool); a run that
        # holds the file (pyarrow's iter_batches over all row groups reads ahead that far) grows
        # by 240 MB: its Arrow buffers and its rows as Python strings.
        doc = ("word " * ((1 << 20) // 5 + 1))[:1 << 20]
        small = self.write_parquet("small.parquet", [{"text": doc[:1000]}])
        rc, err, base_rss = self.run_tool("--input", small, "--out", self.path("t.bin"))
        self.assertEqual(rc, 0, err)
        schema, n = pyarrow.schema([("text", pyarrow.string())]), 0
        with pyarrow.parquet.ParquetWriter(self.path("big.parquet"), schema) as w:
            for g in range(32):
                rows = [{"text": f"{g} {i} " + doc} for i in range(2)]
                w.write_table(pyarrow.Table.from_pylist(rows, schema=schema))
                n += sum(len(r["text"]) + 2 for r in rows)  # its bytes, BOS and EOS
        self.assertEqual(pyarrow.parquet.ParquetFile(self.path("big.parquet"))
                         .metadata.num_row_groups, 32)
        rc, err, rss = self.run_tool("--input", self.path("big.parquet"), "--out",
                                     self.path("t.bin"))
        self.assertEqual(rc, 0, err)
        self.assertEqual(len(read_tokens(self.path("t.bin"))), n)
        self.assertLess(rss - base_rss, 96 * 1024, f"peak RSS {rss} KiB, {base_rss} KiB for one "
                        "small row group")

    def real_tokenizer(self, name):
        try:
            from transformers import AutoTokenizer
        except ImportError:
            self.skipTest("transformers is not installed for this python (STRATA_HF_PYTHON)")
        d = os.path.join(self.dir, name)
        shutil.copytree(os.path.join(ROOT, "tests", "fixtures", "hf", name), d)
        return d, AutoTokenizer.from_pretrained(d)

    def run_real(self, model, src, *args):
        p = subprocess.run([sys.executable, TOOL, "--model", model, "--input", src, "--out",
                            self.path("t.bin"), *args], capture_output=True, text=True)
        self.assertEqual(p.returncode, 0, p.stderr)
        tokens = read_tokens(self.path("t.bin"))
        return tokens, read_mask(self.path("t.bin"))[1]

    def test_prompt_completion_strings_with_a_real_tokenizer(self):
        # TRL's SFTTrainer: the prompt alone, then prompt + completion + EOS; the loss on what
        # follows the prompt's tokens.
        d, tok = self.real_tokenizer("llama")
        rows = [{"prompt": "Question: what trains the model?\nAnswer:", "completion": " strata"},
                {"prompt": "The sky is", "completion": " blue, again and again."}]
        tokens, mask = self.run_real(d, self.write_jsonl("pc.jsonl", rows))
        want, want_mask = [], []
        for r in rows:
            prompt = tok(r["prompt"])["input_ids"]
            ids = tok(r["prompt"] + r["completion"])["input_ids"] + [tok.eos_token_id]
            self.assertEqual(ids[:len(prompt)], prompt, "the fixture's boundary merges")
            want += ids
            want_mask += [2] + [0] * (len(prompt) - 1) + [1] * (len(ids) - len(prompt))
        self.assertEqual(tokens, want)
        self.assertEqual(mask, want_mask)

    def test_conversational_shapes_with_a_real_tokenizer(self):
        # prompt-completion messages and alpaca rows: apply_chat_template's ids; the loss on
        # the completion's assistant turn (not on the prompt's) and on alpaca's output.
        d, tok = self.real_tokenizer("qwen2")
        tok.chat_template = base.CHAT_TEMPLATE
        with open(self.path("t.jinja"), "w") as f:
            f.write(base.CHAT_TEMPLATE)
        # (Words the fixture's small vocabulary spells: it drops a character it lacks.)
        rows = [{"prompt": [{"role": "user", "content": "hi"},
                            {"role": "assistant", "content": "yo"},  # a shot: no loss
                            {"role": "user", "content": "again"}],
                 "completion": [{"role": "assistant", "content": "ab"}]}]
        alpaca = [{"instruction": "say it", "input": "twice", "output": "c"}]
        for src, convs, loss in (
                (self.write_jsonl("pc.jsonl", rows), [r["prompt"] + r["completion"] for r in rows],
                 "ab<|im_end|>\n"),
                (self.write_jsonl("a.jsonl", alpaca),
                 [[{"role": "user", "content": "say it\n\ntwice"},
                   {"role": "assistant", "content": "c"}]], "c<|im_end|>\n")):
            tokens, mask = self.run_real(d, src, "--chat-template", self.path("t.jinja"))
            want = []
            for c in convs:
                ids = tok.apply_chat_template(c, tokenize=True)
                want += list(ids["input_ids"] if hasattr(ids, "keys") else ids)  # 5.x: a dict
            self.assertEqual(tokens, want, src)
            self.assertEqual(tok.decode([t for t, m in zip(tokens, mask) if m & 1]), loss, src)


if __name__ == "__main__":
    unittest.main(verbosity=2)  # each skip says why
