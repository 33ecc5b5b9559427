#!/usr/bin/env python3
"""tools/prepare_data.py as a user meets it: every bad input is one line naming the file and the
line (exit 1, no traceback), memory stays bounded on a 16 MB line, an empty training or
validation file is refused (no exit 0), the input is never overwritten (nor removed as a stale
mask), a run killed at any moment leaves the old outputs or the new ones; the output is the
llm.c token file strata reads.

The command runs with a test double of `transformers` (a byte-level AutoTokenizer: id = byte
+ 3, BOS 1, EOS 2) put first on PYTHONPATH, so these run wherever Python 3 does. With the real
transformers installed (STRATA_HF_PYTHON), one more test checks that encoding a document in
pieces gives the whole document's ids with the fixtures' real tokenizer.

usage: prepare_data_test.py  (unittest; ctest prepare_data)
"""
import json
import os
import random
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
import unittest
import zlib

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
TOOL = os.path.join(ROOT, "tools", "prepare_data.py")
sys.path.insert(0, os.path.join(ROOT, "tools"))
import prepare_data  # noqa: E402

# ChatML, as Qwen2's tokenizers carry it (the fixtures' tokenizers have no template).
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

FAKE_TRANSFORMERS = '''
class _Tok:
    bos_token_id, eos_token_id = 1, 2
    def __len__(self):
        return 259
    chat_template = "fake"
    def __call__(self, text, add_special_tokens=True, return_offsets_mapping=False):
        ids = [b + 3 for b in text.encode("utf-8")]
        out = {"input_ids": [1] + ids if add_special_tokens else ids}
        if return_offsets_mapping:  # each byte's character
            out["offset_mapping"] = [(i, i + 1) for i, ch in enumerate(text)
                                     for _ in ch.encode("utf-8")]
        return out
    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False):
        text = "".join("<" + m["role"] + ">" + m["content"] + "|" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")
class AutoTokenizer:
    @staticmethod
    def from_pretrained(path):
        return _Tok()
'''

# Runs the tool and reports its peak resident memory (KiB) on stderr's last line.
# (VmHWM, this process's own peak: getrusage's ru_maxrss keeps the forking parent's across exec.)
WRAPPER = '''
import runpy, sys
sys.argv = sys.argv[1:]
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
finally:
    hwm = [l.split()[1] for l in open("/proc/self/status") if l.startswith("VmHWM:")]
    print("maxrss_kib", hwm[0] if hwm else -1, file=sys.stderr)
'''


def read_tokens(path):
    with open(path, "rb") as f:
        data = f.read()
    magic, version, n = struct.unpack("<3i", data[:12])
    fmt = "H" if magic == 20240520 else "I"
    return list(struct.unpack(f"<{n}{fmt}", data[1024:]))


# Runs the tool and SIGKILLs it just before its k-th os.replace / os.rename / os.unlink (k = 0:
# never): every point at which a run moves or removes a file.
KILLER = '''
import os, runpy, signal, sys
k, count = int(sys.argv[1]), [0]
for name in ("replace", "rename", "unlink"):
    def wrapped(*a, _real=getattr(os, name), **kw):
        count[0] += 1
        if count[0] == k:
            os.kill(os.getpid(), signal.SIGKILL)
        return _real(*a, **kw)
    setattr(os, name, wrapped)
sys.argv = sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
'''


def read_mask(path):
    """(header ints [magic, version, count, token crc, mask crc, conversations, kind (1:
    preference pairs)], mask bytes) of a loss mask, checked against its token file's bytes."""
    with open(path + ".mask", "rb") as f:
        data = f.read()
    header = list(struct.unpack("<7I", data[:28]))
    assert not any(data[28:1024]), "the header's rest is 0"
    with open(path, "rb") as f:
        tokens = f.read()[1024:]
    assert header[3] == zlib.crc32(tokens), "the mask names other tokens"
    assert header[4] == zlib.crc32(data[1024:]), "the mask's own CRC-32"
    return header, list(data[1024:])


CHATS = [
    {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"},
                  {"role": "assistant", "content": "ab"}, {"role": "user", "content": "r"},
                  {"role": "assistant", "content": "c"}]},
    {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
]


class Fixture(unittest.TestCase):
    """A scratch directory with the test double of transformers, and the tool run in it."""

    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="strata_prepare_data_")
        fake = os.path.join(self.dir, "fake", "transformers")
        os.makedirs(fake)
        with open(os.path.join(fake, "__init__.py"), "w") as f:
            f.write(FAKE_TRANSFORMERS)
        with open(os.path.join(self.dir, "wrapper.py"), "w") as f:
            f.write(WRAPPER)

    def tearDown(self):
        shutil.rmtree(self.dir, ignore_errors=True)

    def path(self, name):
        return os.path.join(self.dir, name)

    def tool_env(self):
        """The tool's environment: the test double of transformers ahead of the rest of
        PYTHONPATH (where ctest puts pyarrow and jinja2 when the system's Python lacks them)."""
        path = [os.path.join(self.dir, "fake")] + [p for p in os.environ.get(
            "PYTHONPATH", "").split(os.pathsep) if p]
        return dict(os.environ, PYTHONPATH=os.pathsep.join(path))

    def write(self, name, data):
        with open(self.path(name), "wb") as f:
            f.write(data if isinstance(data, bytes) else data.encode())
        return self.path(name)

    def run_tool(self, *args):
        env = self.tool_env()
        p = subprocess.run([sys.executable, self.path("wrapper.py"), TOOL, "--model", "unused",
                            *args], capture_output=True, text=True, env=env)
        lines = p.stderr.strip().split("\n")
        rss = [int(l.split()[1]) for l in lines if l.startswith("maxrss_kib")]
        err = "\n".join(l for l in lines if not l.startswith("maxrss_kib"))
        return p.returncode, err, rss[0] if rss else -1

    def assert_fails(self, args, message):
        rc, err, _ = self.run_tool(*args)
        self.assertEqual(rc, 1, err)
        self.assertIn(message, err)
        self.assertNotIn("Traceback", err)


class PrepareData(Fixture):
    def test_output_is_the_token_file_strata_reads(self):
        src = self.write("c.jsonl", '{"text": "ab"}\n\n{"text": "c"}\n')
        rc, err, _ = self.run_tool("--input", src, "--out", self.path("t.bin"))
        self.assertEqual(rc, 0, err)
        self.assertEqual(read_tokens(self.path("t.bin")), [1, 100, 101, 2, 1, 102, 2])
        self.assertFalse(os.path.exists(self.path("t.bin.tmp")))

    def test_non_utf8_names_the_file_and_line(self):
        src = self.write("c.jsonl", b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
        self.assert_fails(["--input", src, "--out", self.path("t.bin")],
                          f"{src}:2: not UTF-8 (byte 0xe9")
        txt = self.write("c.txt", b"fine\n\nstill fine\nbad \xff here\n")
        self.assert_fails(["--input", txt, "--out", self.path("t.bin")], f"{txt}:4: not UTF-8")
        self.assertFalse(os.path.exists(self.path("t.bin")), "no output from a failed run")

    def test_invalid_jsonl_lines_name_the_file_and_line(self):
        src = self.write("c.jsonl", '{"text": "a"}\n{"text": "b"\n')
        self.assert_fails(["--input", src, "--out", self.path("t.bin")],
                          f"{src}:2: not valid JSON")
        src = self.write("d.jsonl", '{"text": "a"}\n\n["a list"]\n')
        self.assert_fails(["--input", src, "--out", self.path("t.bin")],
                          f"{src}:3: no string field \"text\"")
        src = self.write("e.jsonl", '{"body": "a"}\n')
        self.assert_fails(["--input", src, "--out", self.path("t.bin")], "--field")

    def test_memory_is_bounded_on_a_16mb_line(self):
        line = ("word " * ((16 << 20) // 5 + 1))[:16 << 20]
        for name, data, n in (("big.jsonl", json.dumps({"text": line}) + "\n", len(line) + 2),
                              ("big.txt", line + "\n", len(line) + 3)):  # + its newline
            src = self.write(name, data)
            rc, err, rss = self.run_tool("--input", src, "--out", self.path("t.bin"))
            self.assertEqual(rc, 0, err)
            self.assertEqual(len(read_tokens(self.path("t.bin"))), n)
            # The line's bytes, its text and (JSONL) its parsed string: about 3 x 16 MB. Holding
            # its ids as Python lists, as a whole-document encode does, costs over 300 MB.
            self.assertLess(rss, 200 * 1024, f"{name}: peak RSS {rss} KiB")

    def test_empty_validation_or_training_file_is_refused(self):
        src = self.write("c.jsonl", "".join(json.dumps({"text": f"doc {i}"}) + "\n"
                                            for i in range(3)))
        self.assert_fails(["--input", src, "--out", self.path("t.bin"), "--val-out",
                           self.path("v.bin"), "--val-fraction", "0.01"],
                          "the validation file would hold 0 tokens (3 documents")
        self.assertFalse(os.path.exists(self.path("t.bin")))
        self.assertFalse(os.path.exists(self.path("v.bin")))
        empty = self.write("empty.txt", "\n\n   \n")
        self.assert_fails(["--input", empty, "--out", self.path("t.bin")],
                          "the training file would hold 0 tokens")
        rc, err, _ = self.run_tool("--input", src, "--out", self.path("t.bin"), "--val-out",
                                   self.path("v.bin"), "--val-fraction", "0.34")
        self.assertEqual(rc, 0, err)
        self.assertEqual(len(read_tokens(self.path("v.bin"))), 1 + 5 + 1)  # one document

    def test_never_overwrites_the_input(self):
        src = self.write("c.txt", "some text\n")
        self.assert_fails(["--input", src, "--out", src], "is the input file")
        self.assert_fails(["--input", src, "--out", self.path("t.bin"), "--val-out", src],
                          "is the input file")
        os.symlink(src, self.path("link.txt"))
        self.assert_fails(["--input", self.path("link.txt"), "--out", src], "is the input file")
        with open(src) as f:
            self.assertEqual(f.read(), "some text\n")

    def test_never_removes_or_overwrites_an_input_named_as_a_mask(self):
        # The input is <out>.mask: a plain run removed it as a stale mask, --chat overwrote it;
        # likewise for --val-out's mask, the temporaries, a hard link and the chat template.
        chat = "".join(json.dumps(c) + "\n" for c in CHATS)
        src = self.write("t.bin.mask", chat)
        out = self.path("t.bin")
        for args in (["--input", src, "--out", out],
                     ["--chat", "--input", src, "--out", out],
                     ["--input", src, "--out", self.path("o.bin"), "--val-out", out],
                     ["--chat", "--input", src, "--out", self.path("o.bin"), "--val-out", out]):
            self.assert_fails(args, "is the input file")
        tmp = self.write("u.bin.tmp", chat)
        self.assert_fails(["--input", tmp, "--out", self.path("u.bin")], "is the input file")
        os.link(src, self.path("hard.bin"))
        self.assert_fails(["--input", src, "--out", self.path("hard.bin")], "is the input file")
        tpl = self.write("tpl.jinja", "x")
        self.assert_fails(["--chat", "--chat-template", tpl, "--input", self.path("c.jsonl"),
                           "--out", self.path("w.bin"), "--val-out", tpl], "is the input file")
        self.assert_fails(["--input", src, "--out", self.path("x.bin"),
                           "--val-out", self.path("x.bin.mask")], "collide")
        for p, text in ((src, chat), (tmp, chat), (tpl, "x")):
            with open(p) as f:
                self.assertEqual(f.read(), text, p)

    def test_killed_at_any_moment_leaves_the_old_set_or_the_new_one(self):
        # SIGKILL at random moments while runs alternate between a chat corpus (tokens + masks,
        # training and validation) and a plain one (no masks: the old masks must go): after each
        # kill the four files are one run's set, or a journal whose completion gives the new set.
        # PREPARE_KILLS sets the count (default 12; 50 for a longer check), PREPARE_SEED the
        # kill times.
        kills = int(os.environ.get("PREPARE_KILLS", "12"))
        seed = int(os.environ.get("PREPARE_SEED", str(int(time.time()))))
        rng = random.Random(seed)
        chats = [{"messages": [{"role": "user", "content": "q" * 200 + str(i)},
                               {"role": "assistant", "content": "a" * 300 + str(i)}]}
                 for i in range(600)]
        corpora = {"chat": self.write("chat.jsonl", "".join(json.dumps(c) + "\n" for c in chats)),
                   "plain": self.write("plain.jsonl", "".join(
                       json.dumps({"text": "p" * 500 + str(i)}) + "\n" for i in range(600)))}
        out, val = self.path("t.bin"), self.path("v.bin")
        names = (out, out + ".mask", val, val + ".mask")
        env = self.tool_env()

        def command(kind):
            return [sys.executable, TOOL, "--model", "unused", "--input", corpora[kind],
                    "--out", out, "--val-out", val, "--val-fraction", "0.1"] + \
                   (["--chat"] if kind == "chat" else [])

        def state():  # each file's CRC-32 (None: missing)
            return tuple(zlib.crc32(open(n, "rb").read()) if os.path.exists(n) else None
                         for n in names)

        sets, took = {}, {}
        for kind in ("chat", "plain"):
            t0 = time.monotonic()
            p = subprocess.run(command(kind), capture_output=True, text=True, env=env)
            took[kind] = time.monotonic() - t0
            self.assertEqual(p.returncode, 0, p.stderr)
            sets[kind] = state()
        self.assertIsNotNone(sets["chat"][1])
        self.assertIsNone(sets["plain"][1])
        current, mixed, journaled = "plain", 0, 0
        for i in range(kills):
            new = "chat" if current == "plain" else "plain"
            p = subprocess.Popen(command(new), stdout=subprocess.DEVNULL,
                                 stderr=subprocess.DEVNULL, env=env)
            time.sleep(rng.uniform(0.0, 1.1 * took[new]))
            p.send_signal(signal.SIGKILL)
            p.wait()
            got = state()
            if os.path.lexists(out + ".commit"):
                journaled += 1
                prepare_data.complete_pending(out)
                self.assertEqual(state(), sets[new], f"seed {seed}, kill {i}: the journal's set")
                got = state()
            if got == sets[new]:
                current = new
            elif got != sets[current]:
                mixed += 1
        self.assertEqual(mixed, 0, f"seed {seed}: {mixed} of {kills} kills left a mix")
        # The next run finishes a killed move and leaves no temporaries.
        rc, err, _ = self.run_tool("--input", corpora["plain"], "--out", out, "--val-out", val,
                                   "--val-fraction", "0.1")
        self.assertEqual(rc, 0, err)
        self.assertEqual(state(), sets["plain"])
        self.assertEqual(sorted(n for n in os.listdir(self.dir) if n.startswith(("t.bin", "v.bin"))),
                         ["t.bin", "v.bin"])

    def test_a_plain_run_removes_a_killed_chat_runs_mask_temporaries(self):
        # A chat run killed while writing leaves <out>.mask.tmp; a plain run after it writes no
        # mask, and left it there for good (found by PREPARE_KILLS=50).
        src = self.write("c.jsonl", "".join(json.dumps({"text": "p" * 50 + str(i)}) + "\n"
                                             for i in range(40)))
        for name in ("t.bin.mask.tmp", "v.bin.mask.tmp"):
            self.write(name, b"half a mask")
        rc, err, _ = self.run_tool("--input", src, "--out", self.path("t.bin"), "--val-out",
                                   self.path("v.bin"), "--val-fraction", "0.1")
        self.assertEqual(rc, 0, err)
        self.assertEqual(sorted(n for n in os.listdir(self.dir) if n.startswith(("t.bin", "v.bin"))),
                         ["t.bin", "v.bin"])

    def test_killed_before_any_rename_or_removal_leaves_the_old_set_or_the_new_one(self):
        # Deterministic: the run kills itself (SIGKILL) just before its k-th rename or removal,
        # for every k, alternating chat and plain runs over the same --out and --val-out.
        chats = [{"messages": [{"role": "user", "content": f"q{i}"},
                               {"role": "assistant", "content": f"a{i}"}]} for i in range(20)]
        corpora = {"chat": self.write("chat.jsonl", "".join(json.dumps(c) + "\n" for c in chats)),
                   "plain": self.write("plain.jsonl", "".join(
                       json.dumps({"text": f"p{i}"}) + "\n" for i in range(20)))}
        with open(self.path("killer.py"), "w") as f:
            f.write(KILLER)
        out, val = self.path("t.bin"), self.path("v.bin")
        names = (out, out + ".mask", val, val + ".mask")
        env = self.tool_env()

        def run(kind, k):
            return subprocess.run(
                [sys.executable, self.path("killer.py"), str(k), TOOL, "--model", "unused",
                 "--input", corpora[kind], "--out", out, "--val-out", val, "--val-fraction",
                 "0.25"] + (["--chat"] if kind == "chat" else []),
                capture_output=True, text=True, env=env).returncode

        def state():  # each file's CRC-32 (None: missing)
            return tuple(zlib.crc32(open(n, "rb").read()) if os.path.exists(n) else None
                         for n in names)

        sets = {}
        for kind in ("chat", "plain"):
            self.assertEqual(run(kind, 0), 0)
            sets[kind] = state()
        current = "plain"
        for new in ("chat", "plain"):
            for k in range(1, 40):
                if run(new, k) == 0:
                    break
                if os.path.lexists(out + ".commit"):
                    prepare_data.complete_pending(out)
                    self.assertEqual(state(), sets[new], f"{new} run killed at {k}: journal")
                self.assertIn(state(), (sets[current], sets[new]),
                              f"{new} run killed before rename/removal {k}: a mix")
                self.assertEqual(run(current, 0), 0)  # back to the old set for the next k
            current = new

    def test_chat_masks_the_assistant_turns_and_marks_conversation_starts(self):
        src = self.write("chat.jsonl", "".join(json.dumps(c) + "\n" for c in CHATS))
        rc, err, _ = self.run_tool("--chat", "--input", src, "--out", self.path("t.bin"))
        self.assertEqual(rc, 0, err)
        tokens = read_tokens(self.path("t.bin"))
        text = "".join(chr(t - 3) for t in tokens)
        # The fake template: "<role>content|" per message; the generation prompt "<assistant>".
        self.assertEqual(text, "<system>s|<user>q|<assistant>ab|<user>r|<assistant>c|"
                               "<user>hi|<assistant>yo|")
        header, mask = read_mask(self.path("t.bin"))
        self.assertEqual(header[:3], [20261125, 1, len(tokens)])
        self.assertEqual(header[5], 2)
        self.assertEqual(header[6], 0)  # plain conversations, not preference pairs
        # Loss on each assistant turn's text after its generation prompt: content and "|".
        self.assertEqual("".join(ch if m & 1 else "." for ch, m in zip(text, mask)),
                         "." * 29 + "ab|" + "." * 19 + "c|" + "." * 20 + "yo|")
        self.assertEqual([i for i, m in enumerate(mask) if m & 2], [0, text.index("<user>hi")])
        # A plain run over the same --out removes the mask that is no longer its.
        plain = self.write("c.jsonl", '{"text": "ab"}\n')
        rc, err, _ = self.run_tool("--input", plain, "--out", self.path("t.bin"))
        self.assertEqual(rc, 0, err)
        self.assertFalse(os.path.exists(self.path("t.bin.mask")))

    def test_chat_validation_split_has_its_own_mask(self):
        chats = [{"messages": [{"role": "user", "content": f"q{i}"},
                               {"role": "assistant", "content": f"a{i}"}]} for i in range(4)]
        src = self.write("chat.jsonl", "".join(json.dumps(c) + "\n" for c in chats))
        rc, err, _ = self.run_tool("--chat", "--input", src, "--out", self.path("t.bin"),
                                   "--val-out", self.path("v.bin"), "--val-fraction", "0.25")
        self.assertEqual(rc, 0, err)
        for name, convs in (("t.bin", 3), ("v.bin", 1)):
            header, mask = read_mask(self.path(name))
            self.assertEqual(header[5], convs, name)
            self.assertEqual(sum(m & 1 for m in mask), 3 * convs, name)  # "aN|" each

    def test_chat_errors_name_the_line(self):
        cases = [
            ('{"messages": [{"role": "user", "content": "q"}]}', "no \"assistant\" message"),
            ('{"text": "not a chat"}', "needs \"messages\""),
            ('{"messages": [{"role": "user", "content": 3}]}', "needs \"messages\""),
            ('{"messages": [', "not valid JSON"),
        ]
        good = json.dumps(CHATS[1])
        for line, message in cases:
            src = self.write("bad.jsonl", good + "\n" + line + "\n")
            self.assert_fails(["--chat", "--input", src, "--out", self.path("t.bin")],
                              f"{src}:2: {message}")
            self.assertFalse(os.path.exists(self.path("t.bin")))
            self.assertFalse(os.path.exists(self.path("t.bin.mask")))

    def test_chat_template_that_rewrites_earlier_turns_is_refused(self):
        def render(messages, add_generation_prompt):  # drops every turn but the last two
            return "".join(m["content"] for m in messages[-2:]) + ("|" if add_generation_prompt
                                                                    else "")

        def encode_offsets(text):
            return [ord(c) for c in text], [(i, i + 1) for i in range(len(text))]

        with self.assertRaisesRegex(ValueError, "message 2 \\(assistant\\)"):
            prepare_data.chat_tokens(render, encode_offsets, CHATS[0]["messages"])

    def test_chat_with_a_real_tokenizer_matches_apply_chat_template(self):
        try:
            from transformers import AutoTokenizer
        except ImportError:
            self.skipTest("transformers is not installed for this python (STRATA_HF_PYTHON)")
        d = os.path.join(self.dir, "model")
        shutil.copytree(os.path.join(ROOT, "tests", "fixtures", "hf", "qwen2"), d)
        with open(os.path.join(self.dir, "t.jinja"), "w") as f:
            f.write(CHAT_TEMPLATE)
        src = self.write("chat.jsonl", "".join(json.dumps(c) + "\n" for c in CHATS))
        p = subprocess.run([sys.executable, TOOL, "--chat", "--model", d, "--chat-template",
                            self.path("t.jinja"), "--input", src, "--out", self.path("t.bin")],
                           capture_output=True, text=True)
        self.assertEqual(p.returncode, 0, p.stderr)
        tok = AutoTokenizer.from_pretrained(d)
        tok.chat_template = CHAT_TEMPLATE
        want = []
        for c in CHATS:
            ids = tok.apply_chat_template(c["messages"], tokenize=True)
            want += list(ids["input_ids"] if hasattr(ids, "keys") else ids)  # 5.x: a dict
        tokens = read_tokens(self.path("t.bin"))
        self.assertEqual(tokens, want)
        _, mask = read_mask(self.path("t.bin"))
        got = tok.decode([t for t, m in zip(tokens, mask) if m & 1])
        self.assertEqual(got, "ab<|im_end|>\nc<|im_end|>\nyo<|im_end|>\n")

    def test_progress_line(self):
        lines = []

        class Stream:
            def write(self, s):
                lines.append(s)

            def flush(self):
                pass

        p = prepare_data.Progress(100, every=0.0, stream=Stream())
        p.update(50, tokens=7, docs=1)
        self.assertIn("50%", "".join(lines))
        self.assertIn("7 tokens", "".join(lines))

    def test_pieces_cut_before_whitespace(self):
        text = "alpha beta\ngamma " * 1000
        parts = list(prepare_data.pieces(text, size=64))
        self.assertEqual("".join(parts), text)
        self.assertTrue(all(len(p) <= 64 for p in parts))
        self.assertTrue(all(p[0].isspace() for p in parts[1:]))

    def test_pieces_encode_as_the_whole_with_a_real_tokenizer(self):
        try:
            from transformers import AutoTokenizer
        except ImportError:
            self.skipTest("transformers is not installed for this python (STRATA_HF_PYTHON)")
        words = ["strata", "trains", "the", "model", "on", "tokens", ",", "again", "\n"]
        text = " ".join(words[(i * 7) % len(words)] for i in range(30000))
        for name in ("llama", "qwen2", "gpt2"):
            tok = AutoTokenizer.from_pretrained(os.path.join(ROOT, "tests", "fixtures", "hf",
                                                             name))
            whole = tok(text, add_special_tokens=False)["input_ids"]
            parts = [i for p in prepare_data.pieces(text, size=4096)
                     for i in tok(p, add_special_tokens=False)["input_ids"]]
            self.assertEqual(parts, whole, name)


if __name__ == "__main__":
    unittest.main()
