#!/usr/bin/env python3
"""tools/hf_tokenizer.py encode DIR MAX, as strata generate runs it: a prompt past MAX ids is
refused after a piece of it is encoded (its memory bounded whatever the prompt's size), and a
prompt within MAX gives the ids of encoding it whole, whether it is encoded whole or in pieces.

Runs with a test double of `transformers` (a byte-level AutoTokenizer: id = byte + 3, BOS 1),
put first on PYTHONPATH, so it runs wherever Python 3 does.

usage: hf_tokenizer_test.py  (unittest; ctest hf_tokenizer)
"""
import json
import os
import shutil
import subprocess
import sys
import tempfile
import unittest

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
TOOL = os.path.join(ROOT, "tools", "hf_tokenizer.py")

FAKE_TRANSFORMERS = '''
class _Tok:
    bos_token_id, eos_token_id = 1, 2
    def __call__(self, text, add_special_tokens=True):
        ids = [b + 3 for b in text.encode("utf-8")]
        return {"input_ids": [1] + ids if add_special_tokens else ids}
class AutoTokenizer:
    @staticmethod
    def from_pretrained(path):
        return _Tok()
'''

# Runs the tool and reports its peak resident memory (KiB) on stderr's last line.
WRAPPER = '''
import runpy, sys
sys.argv = sys.argv[1:]
sys.path.insert(0, __import__("os").path.dirname(sys.argv[0]))
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
finally:
    hwm = [l.split()[1] for l in open("/proc/self/status") if l.startswith("VmHWM:")]
    print("maxrss_kib", hwm[0] if hwm else -1, file=sys.stderr)
'''


class EncodeBounded(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="strata-hf-tokenizer-")
        self.lib = os.path.join(self.dir, "lib")
        self.model = os.path.join(self.dir, "model")
        os.makedirs(self.lib)
        os.makedirs(self.model)
        with open(os.path.join(self.lib, "transformers.py"), "w") as f:
            f.write(FAKE_TRANSFORMERS)
        with open(os.path.join(self.model, "tokenizer.json"), "w") as f:
            f.write("{}")
        self.wrapper = os.path.join(self.dir, "wrapper.py")
        with open(self.wrapper, "w") as f:
            f.write(WRAPPER)

    def tearDown(self):
        shutil.rmtree(self.dir)

    def encode(self, text, limit=None):
        """(the reply, the tool's peak RSS in MiB)."""
        env = dict(os.environ, PYTHONPATH=self.lib)
        cmd = [sys.executable, self.wrapper, TOOL, "encode", self.model]
        if limit is not None:
            cmd.append(str(limit))
        p = subprocess.run(cmd, input=text.encode("utf-8"), capture_output=True, env=env)
        self.assertEqual(p.returncode, 0, p.stderr.decode())
        rss = int(p.stderr.decode().split("maxrss_kib")[-1]) / 1024
        return json.loads(p.stdout), rss

    def test_a_short_prompt_within_max_is_encoded_whole(self):
        out, _ = self.encode("hello world", 32)
        self.assertEqual(out["ids"], [1] + [b + 3 for b in b"hello world"])
        self.assertEqual(out["eos"], [2])
        self.assertNotIn("more_than", out)

    def test_a_long_prompt_within_max_gives_the_whole_ids(self):
        text = "the quick brown fox\n" * 20000  # 400,000 characters: encoded in pieces
        out, _ = self.encode(text, 10 ** 6)
        self.assertEqual(out["ids"], [1] + [b + 3 for b in text.encode("utf-8")])

    def test_a_short_prompt_past_max_is_refused_with_its_count(self):
        out, _ = self.encode("hello world", 4)
        self.assertIsNone(out["ids"])
        self.assertEqual((out["more_than"], out["counted"], out["chars"]), (4, 12, 11))

    def test_a_5mb_prompt_past_max_is_refused_in_bounded_memory(self):
        for name, text in (("words", "lorem ipsum dolor sit amet " * 200000),
                           ("no whitespace", "x" * 5_000_000)):
            with self.subTest(name):
                out, rss = self.encode(text, 32)
                self.assertIsNone(out["ids"])
                self.assertEqual(out["more_than"], 32)
                self.assertGreater(out["counted"], 32)
                self.assertLessEqual(out["chars"], 1 << 16)
                _, whole = self.encode(text)  # no MAX: every id of 5 MB
                # The input itself (bytes and str, ~10 MB) and the interpreter remain.
                self.assertLess(rss, 48, f"peak RSS {rss:.0f} MiB (whole: {whole:.0f} MiB)")
                self.assertLess(rss, whole / 2, f"peak {rss:.0f} MiB, whole {whole:.0f} MiB")


if __name__ == "__main__":
    unittest.main()
