#!/usr/bin/env python3
"""tools/prepare_data.py --format preference (TRL's preference type, the data of DPO): each
form (strings with a prompt, message lists with a prompt, whole conversations whose prompt is
their common start) gives, per pair, its chosen sequence then its rejected one, each the tokens
and loss mask the prompt-completion shape makes of (prompt, completion); the mask's header says
"preference pairs" (word 6 = 1) and counts two conversations a pair; the held-out split takes
whole pairs; auto detection finds the shape (also beside a "messages" column); a pair with a
missing, null or empty side, or strings without a prompt, is one line naming the file, the row
and the column, and nothing is written. With the real transformers (STRATA_HF_PYTHON), the
generated fixture tests/fixtures/chat/tiny_preference.jsonl is its generator's output, and its
tokens are apply_chat_template's with the tiny Llama fixture's tokenizer and ChatML.

Runs with prepare_data_test.py's test double of `transformers` (id = byte + 3, BOS 1, EOS 2;
its template renders "<role>content|" per message, "<assistant>" as the generation prompt).

usage: prepare_data_preference_test.py  (unittest; ctest prepare_data_preference)
"""
import filecmp
import json
import os
import shutil
import subprocess
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import prepare_data_test as base  # noqa: E402
from prepare_data_shapes_test import NO_PYARROW, expected, pyarrow  # noqa: E402
from prepare_data_test import ROOT, TOOL, read_mask, read_tokens  # noqa: E402

FIXTURES = os.path.join(ROOT, "tests", "fixtures", "chat")
USER_Q = {"role": "user", "content": "q"}


def msg(role, content):
    return {"role": role, "content": content}


# Rows of each form and their sequences as the fake tokenizer gives them, written by hand (as
# prepare_data_shapes_test's SHAPES: [loss targets] in brackets, B and E the BOS and EOS ids):
# each row's chosen sequence, then its rejected one.
FORMS = {
    "strings": (
        [{"prompt": "The sky is", "chosen": " blue.", "rejected": " green."},
         {"prompt": "2+2=", "chosen": "4", "rejected": "5"}],
        ["BThe sky is[ blue.E]", "BThe sky is[ green.E]", "B2+2=[4E]", "B2+2=[5E]"]),
    "messages with a prompt": (
        [{"prompt": [msg("system", "s"), USER_Q],
          "chosen": [msg("assistant", "yes")], "rejected": [msg("assistant", "no")]}],
        ["<system>s|<user>q|<assistant>[yes|]", "<system>s|<user>q|<assistant>[no|]"]),
    # No "prompt": the common start of whole messages (an earlier assistant turn in it is a
    # shot, no loss); equal sides keep their last message each (TRL's extract_prompt).
    "implicit prompt": (
        [{"chosen": [USER_Q, msg("assistant", "a"), msg("user", "r"), msg("assistant", "good")],
          "rejected": [USER_Q, msg("assistant", "a"), msg("user", "r"), msg("assistant", "bad")]},
         {"chosen": [USER_Q, msg("assistant", "same")],
          "rejected": [USER_Q, msg("assistant", "same")]},
         {"chosen": [USER_Q, msg("assistant", "x")],
          "rejected": [USER_Q, msg("assistant", "y"), msg("user", "more"),
                       msg("assistant", "z")]}],
        ["<user>q|<assistant>a|<user>r|<assistant>[good|]",
         "<user>q|<assistant>a|<user>r|<assistant>[bad|]",
         "<user>q|<assistant>[same|]", "<user>q|<assistant>[same|]",
         "<user>q|<assistant>[x|]", "<user>q|<assistant>[y|]<user>more|<assistant>[z|]"]),
}


class Preference(base.Fixture):
    def write_jsonl(self, name, rows):
        return self.write(name, "".join(json.dumps(r) + "\n" for r in rows))

    def outputs(self):
        return sorted(n for n in os.listdir(self.dir) if n.startswith(("t.bin", "v.bin")))

    def prepared(self, src, *args):
        rc, err, _ = self.run_tool("--input", src, "--out", self.path("t.bin"), *args)
        self.assertEqual(rc, 0, err)
        header, mask = read_mask(self.path("t.bin"))
        return read_tokens(self.path("t.bin")), header, mask, err

    def sources(self, rows):
        out = [self.write_jsonl("p.jsonl", rows)]
        if pyarrow is not None:
            pyarrow.parquet.write_table(pyarrow.Table.from_pylist(rows), self.path("p.parquet"))
            out.append(self.path("p.parquet"))
        return out

    def test_each_form_gives_chosen_then_rejected_per_pair(self):
        for form, (rows, want) in FORMS.items():
            tokens, mask = expected(want)
            for src in self.sources(rows):
                for args in ([], ["--format", "preference"]):
                    what = f"{form} from {os.path.basename(src)} {args}"
                    got, header, got_mask, err = self.prepared(src, *args)
                    self.assertEqual(got, tokens, what)
                    self.assertEqual(got_mask, mask, what)
                    self.assertEqual(header[5], 2 * len(rows), what)  # two sequences a pair
                    self.assertEqual(header[6], 1, what)  # preference pairs
                    if not args:
                        self.assertIn("--format preference (", err, what)
        if pyarrow is None:
            self.skipTest(f"JSONL checked; Parquet not: {NO_PYARROW}")

    def test_each_side_is_what_prompt_completion_makes(self):
        # The same (prompt, completion) rows through --format prompt-completion: the chosen
        # sequences and the rejected ones, the same tokens and mask bytes.
        for form in ("strings", "messages with a prompt"):
            rows = FORMS[form][0]
            tokens, _, mask, _ = self.prepared(self.write_jsonl("p.jsonl", rows))
            sides = []
            for r in rows:
                sides += [{"prompt": r["prompt"], "completion": r[k]}
                          for k in ("chosen", "rejected")]
            want, header, want_mask, _ = self.prepared(self.write_jsonl("pc.jsonl", sides))
            self.assertEqual(header[6], 0, "prompt-completion: plain conversations")
            self.assertEqual((tokens, mask), (want, want_mask), form)

    def test_found_beside_a_messages_column(self):
        # UltraFeedback's columns: the pairs, not the "messages" conversation.
        rows = [dict(FORMS["messages with a prompt"][0][0],
                     messages=[USER_Q, msg("assistant", "m")], score_chosen=8.0)]
        tokens, header, _, err = self.prepared(self.write_jsonl("u.jsonl", rows))
        self.assertIn('--format preference ("prompt" + "chosen" + "rejected")', err)
        self.assertEqual(header[5:7], [2, 1])
        self.assertEqual(tokens, expected(FORMS["messages with a prompt"][1])[0])

    def test_validation_split_takes_whole_pairs(self):
        rows = [{"prompt": f"p{i}", "chosen": f"c{i}", "rejected": f"r{i}"} for i in range(8)]
        rc, err, _ = self.run_tool("--input", self.write_jsonl("p.jsonl", rows), "--out",
                                   self.path("t.bin"), "--val-out", self.path("v.bin"),
                                   "--val-fraction", "0.25")
        self.assertEqual(rc, 0, err)
        # Pairs 3 and 7 (one in four, spread) go to validation, both their sequences, in order.
        for name, pairs in (("t.bin", [0, 1, 2, 4, 5, 6]), ("v.bin", [3, 7])):
            want = []
            for i in pairs:
                want += [f"Bp{i}[c{i}E]", f"Bp{i}[r{i}E]"]
            tokens, mask = expected(want)
            header, got_mask = read_mask(self.path(name))
            self.assertEqual(read_tokens(self.path(name)), tokens, name)
            self.assertEqual(got_mask, mask, name)
            self.assertEqual(header[5:7], [2 * len(pairs), 1], name)

    def test_bad_pairs_name_the_row_and_column_and_write_nothing(self):
        good = {"prompt": "p", "chosen": "c", "rejected": "r"}
        conv = {"prompt": [USER_Q], "chosen": [msg("assistant", "a")],
                "rejected": [msg("assistant", "b")]}
        cases = [  # (rows, the error at JSONL's line 2, at Parquet's row 1 (None: not there))
            ([good, {"prompt": "p", "chosen": "c"}],
             "no field \"rejected\" (the line has keys ['chosen', 'prompt'])", None),
            ([good, {"prompt": "p", "chosen": None, "rejected": "r"}],
             'field "chosen" is null, not a string or a list of messages',
             'column "chosen" is null, not a string or a list of messages'),
            ([good, {"prompt": "p", "chosen": "", "rejected": "r"}],
             '"chosen" is an empty string: a completion with nothing to prefer', None),
            ([good, {"prompt": "p", "chosen": "c", "rejected": [msg("assistant", "b")]}],
             '"prompt" a string, "chosen" a string, "rejected" a list; all must be strings or '
             "all message lists", None),
            ([conv, dict(conv, rejected=[msg("user", "b")])],
             'no "assistant" message in "rejected": an empty completion', None),
            ([conv, dict(conv, chosen=[])],
             'needs "chosen": a non-empty list of {"role": str, "content": str} (it is an '
             "empty list)", None),
            ([{"chosen": [USER_Q, msg("assistant", "a")], "rejected": [USER_Q, msg("assistant",
                                                                                   "b")]},
              {"chosen": [USER_Q, msg("assistant", "a"), msg("user", "x")],
               "rejected": [USER_Q, msg("assistant", "a"), msg("user", "y")]}],
             'no "assistant" message in "chosen" after the prompt it shares with the other',
             None),
        ]
        for rows, in_jsonl, in_parquet in cases:
            src = self.write_jsonl("bad.jsonl", rows)
            self.assert_fails(["--input", src, "--out", self.path("t.bin")], f"{src}:2: {in_jsonl}")
            self.assertEqual(self.outputs(), [], in_jsonl)
            if pyarrow is not None and in_parquet:
                pyarrow.parquet.write_table(pyarrow.Table.from_pylist(rows),
                                            self.path("bad.parquet"))
                self.assert_fails(["--input", self.path("bad.parquet"), "--out",
                                   self.path("t.bin")],
                                  f"{self.path('bad.parquet')}: row 1: {in_parquet}")
                self.assertEqual(self.outputs(), [], in_parquet)
        # Strings without a prompt: refused, naming the fix.
        src = self.write_jsonl("implicit.jsonl", [{"chosen": "Q: hi A: yes", "rejected":
                                                   "Q: hi A: no"}])
        self.assert_fails(["--input", src, "--out", self.path("t.bin")],
                          f'{src}:1: "chosen" and "rejected" are strings without a "prompt" '
                          'field: the prompt they share cannot be told apart from the '
                          'completions; give a "prompt"')
        self.assertEqual(self.outputs(), [])
        # --format preference on a file without the columns names the ones missing.
        src = self.write_jsonl("pc.jsonl", [{"prompt": "p", "completion": "c"}])
        self.assert_fails(["--input", src, "--out", self.path("t.bin"), "--format",
                           "preference"],
                          f'{src}: no field "chosen", "rejected" (the first line has keys: '
                          "prompt, completion); use --format prompt-completion")

    def real_llama(self):
        try:
            from transformers import AutoTokenizer
        except ImportError:
            self.skipTest("transformers is not installed for this python (STRATA_HF_PYTHON)")
        d = os.path.join(self.dir, "llama")
        shutil.copytree(os.path.join(ROOT, "tests", "fixtures", "hf", "llama"), d)
        tok = AutoTokenizer.from_pretrained(d)
        with open(os.path.join(FIXTURES, "chatml.jinja")) as f:
            tok.chat_template = f.read()
        return d, tok

    def test_the_fixture_with_the_tiny_llama_tokenizer(self):
        # The fixture is its generator's output (deterministic).
        subprocess.run([sys.executable, os.path.join(FIXTURES, "make_tiny_preference.py"),
                        self.path("gen.jsonl")], check=True)
        fixture = os.path.join(FIXTURES, "tiny_preference.jsonl")
        self.assertTrue(filecmp.cmp(self.path("gen.jsonl"), fixture, shallow=False),
                        "tiny_preference.jsonl is not make_tiny_preference.py's output")
        d, tok = self.real_llama()
        p = subprocess.run([sys.executable, TOOL, "--model", d, "--input", fixture, "--out",
                            self.path("t.bin"), "--chat-template",
                            os.path.join(FIXTURES, "chatml.jinja")],
                           capture_output=True, text=True)
        self.assertEqual(p.returncode, 0, p.stderr)
        tokens = read_tokens(self.path("t.bin"))
        header, mask = read_mask(self.path("t.bin"))
        with open(fixture) as f:
            rows = [json.loads(line) for line in f]
        self.assertEqual(header[5:7], [2 * len(rows), 1])
        want, starts = [], []
        for r in rows:
            for side in ("chosen", "rejected"):
                ids = tok.apply_chat_template(r["prompt"] + r[side], tokenize=True)
                ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)  # 5.x: a dict
                self.assertLess(len(ids), 64, "the fixture's conversations stay short")
                starts.append(len(want))
                want += ids
        self.assertEqual(tokens, want)
        self.assertEqual([i for i, m in enumerate(mask) if m & 2], starts)
        # The loss: the reply and its end of turn, the end of each sequence (the tiny
        # vocabulary spells the ChatML markers with <unk>); chosen repeats the user's word.
        starts.append(len(tokens))
        for k, r in enumerate(rows):
            for s, side in enumerate(("chosen", "rejected")):
                a, b = starts[2 * k + s], starts[2 * k + s + 1]
                loss = [i for i in range(a, b) if mask[i] & 1]
                self.assertEqual(loss, list(range(loss[0], b)), (k, side))
                self.assertTrue(tok.decode(tokens[loss[0]:b]).startswith(r[side][0]["content"]),
                                (k, side))
            self.assertEqual(r["chosen"][0]["content"], r["prompt"][0]["content"])
            self.assertNotEqual(r["rejected"][0]["content"], r["prompt"][0]["content"])


if __name__ == "__main__":
    unittest.main(verbosity=2)  # each skip says why
