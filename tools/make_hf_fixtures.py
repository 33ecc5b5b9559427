#!/usr/bin/env python3
"""Writes the Hugging Face fixtures of tests/hf_compare_test.cc (tests/fixtures/hf/).

Each fixture is a tiny random-weight model saved by `transformers` (config.json + safetensors,
exactly as save_pretrained writes them) and a reference.safetensors with what transformers
computes for fixed tokens:
  tokens, targets  [B, T] (as F32: small integers are exact)
  logits           [B, T, V]
  losses           [B, T] per-token next-token cross-entropy
  loss             [1]    their mean
  grad.<name>      d(loss)/d(parameter) for every parameter, under its Hugging Face name
  eval_tokens      [E] a token corpus for `strata eval` (E = 5*T + 7: five windows of T and a
                   tail too short for a sixth)
  eval_loss        [1] `strata eval`'s number by transformers: the mean next-token
                   cross-entropy over the windows starting at 0, T, 2T, ... while
                   start + T + 1 <= E (inputs [s, s+T), targets [s+1, s+T+1))

Fixtures:
  llama      LlamaForCausalLM: grouped-query attention (4 heads, 2 key/value), untied head,
             rope_theta 50000, vocabulary 100 (strata pads it to 128); saved in shards with
             model.safetensors.index.json
  llama3     LlamaForCausalLM with tied embeddings and Llama 3.1's llama3 rope scaling
  qwen2      Qwen2ForCausalLM: q/k/v biases, grouped-query attention
  qwen3      Qwen3ForCausalLM: query/key norms, heads 16 wide (an attention of 64 in a width of
             32), tied embeddings, a pad_token_id among the reference's tokens
  phi3       Phi3ForCausalLM: q|k|v stored as one qkv_proj, gate|up as one gate_up_proj,
             grouped-query attention, untied head, a pad_token_id among the reference's tokens
  gpt2       GPT2LMHeadModel: Conv1D weights (stored transposed), 32 positions
  llama-bf16 the llama fixture's weights in bfloat16 (the import -> export byte-identity test);
             its reference is computed in fp32 from the bf16 weights

Each fixture also holds a real tokenizer (tools/make_hf_fixtures.py --tokenizers-only writes just
these, leaving the weights and references as they are; --only NAME... limits it to those
fixtures): a 100-token BPE trained with the
`tokenizers` library on a fixed English text (the models' vocabulary is 100), saved as
tokenizer.json with tokenizer_config.json, special_tokens_map.json and generation_config.json,
in each family's conventions: Llama sentencepiece-style, <unk> <s> </s> (ids 0, 1, 2; BOS
added); byte-level (over the text's bytes only) Qwen2
<|endoftext|> <|im_start|> <|im_end|> (no BOS; EOS and padding <|endoftext|>), GPT-2
<|endoftext|> (id 0: BOS, EOS and unknown). AutoTokenizer loads them, so an export's tokenizer
and generate() are tested on them. greedy.json: transformers' greedy continuation (20 tokens) of
"the model writes" from the fixture's weights, which `strata generate` must reproduce.

Weights are drawn wider than transformers' default initialization (std 0.2, norm weights and
biases random too) so that every tensor, the norms' included, changes the loss measurably.

Off the hot path and never a dependency of the build: run it by hand in a throwaway virtual
environment (python3 -m venv VENV && VENV/bin/pip install torch transformers safetensors),
then `VENV/bin/python tools/make_hf_fixtures.py [--out tests/fixtures/hf]`.
The tests read only the committed files.
"""
import argparse
import json
import os
import shutil

import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import save_file

B, T = 2, 16
E = 5 * T + 7


def randomize(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and ("norm" in name or "ln_" in name) and name.endswith("weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))


def first_input_token(vocab, seed):
    """reference()'s first input token: a pad_token_id that occurs in the reference batch, so
    that the missing gradient of its embedding row (nn.Embedding's padding_idx) is checked."""
    g = torch.Generator().manual_seed(seed + 1)
    return int(torch.randint(0, vocab, (B, T + 1), generator=g)[0, 0])


def reference(model, vocab, seed):
    g = torch.Generator().manual_seed(seed + 1)
    seq = torch.randint(0, vocab, (B, T + 1), generator=g)
    tokens, targets = seq[:, :-1].contiguous(), seq[:, 1:].contiguous()
    model.eval()  # no dropout (GPT-2 has 0.1 by default); gradients still flow
    model.zero_grad()
    logits = model(input_ids=tokens).logits.float()
    losses = F.cross_entropy(logits.reshape(-1, vocab), targets.reshape(-1), reduction="none")
    loss = losses.mean()
    loss.backward()
    out = {
        "tokens": tokens.float(),
        "targets": targets.float(),
        "logits": logits.detach().contiguous(),
        "losses": losses.detach().reshape(B, T).contiguous(),
        "loss": loss.detach().reshape(1),
    }
    for name, p in model.named_parameters():
        out["grad." + name] = p.grad.detach().float().contiguous()
    out.update(eval_reference(model, vocab, seed))
    return out


def eval_reference(model, vocab, seed):
    g = torch.Generator().manual_seed(seed + 2)
    corpus = torch.randint(0, vocab, (E,), generator=g)
    total, count, s = 0.0, 0, 0
    with torch.no_grad():
        while s + T + 1 <= E:
            logits = model(input_ids=corpus[s:s + T][None]).logits.float()[0]
            total += F.cross_entropy(logits.double(), corpus[s + 1:s + T + 1],
                                     reduction="sum").item()
            count += T
            s += T
    return {"eval_tokens": corpus.float(), "eval_loss": torch.tensor([total / count])}


CORPUS = """strata trains large language models on one machine with tiered memory. The model
weights live on the device, in host memory or on a fast disk, and the optimizer state moves
between them while the next layer computes. A fine tune starts from a checkpoint that another
library saved, reads its tokenizer and its configuration, and writes the result back so that
the same library loads it again. The quick brown fox jumps over the lazy dog; the five boxing
wizards jump quickly. Every error names the file, the offset and the fix, and nothing that was
written halfway looks complete. Tokens, losses, gradients and learning rates are logged at every
step, and a small model can be asked what it says now.
"""

# Special tokens (ids 0, 1, ...), the BOS a template adds ("" none), and the token names of
# tokenizer_config.json, per family.
TOKENIZERS = {
    "llama": (["<unk>", "<s>", "</s>"], "<s>",
              {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}),
    "qwen2": (["<|endoftext|>", "<|im_start|>", "<|im_end|>"], "",
              {"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"}),
    "gpt2": (["<|endoftext|>"], "",
             {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>",
              "unk_token": "<|endoftext|>"}),
}


def write_tokenizer(d, family, vocab=100):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    specials, bos, names = TOKENIZERS[family]
    unk = names.get("unk_token")
    tok = Tokenizer(models.BPE(unk_token=unk))
    if family == "llama":  # sentencepiece-style
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        tok.decoder = decoders.Metaspace()
    else:  # byte-level, as GPT-2's and Qwen2's (the corpus's bytes only: 100 tokens)
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=specials, show_progress=False)
    tok.train_from_iterator([CORPUS] * 4, trainer)
    if bos:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, specials.index(bos))])
    assert tok.get_vocab_size() <= vocab, tok.get_vocab_size()
    tok.save(os.path.join(d, "tokenizer.json"))
    ids = {k: specials.index(v) for k, v in names.items()}
    config = dict(names, tokenizer_class="PreTrainedTokenizerFast", model_max_length=32,
                  clean_up_tokenization_spaces=False)
    with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
    with open(os.path.join(d, "special_tokens_map.json"), "w") as f:
        json.dump(names, f, indent=2)
        f.write("\n")
    gen = {"bos_token_id": ids.get("bos_token"), "eos_token_id": ids["eos_token"],
           "pad_token_id": ids.get("pad_token")}
    with open(os.path.join(d, "generation_config.json"), "w") as f:
        json.dump({k: v for k, v in gen.items() if v is not None}, f, indent=2)
        f.write("\n")


def write_greedy(d, new_tokens=20):
    """greedy.json: transformers' greedy continuation of a tokenized prompt from the fixture's
    weights (`strata generate` must give the same tokens), in fp32: each token the argmax of
    the model's forward over the sequence so far, an end-of-sequence token too (no stop, and
    none suppressed to reach the length)."""
    tok = transformers.AutoTokenizer.from_pretrained(d)
    model = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    prompt = tok("the model writes", return_tensors="pt")["input_ids"]
    out = prompt
    with torch.no_grad():
        for _ in range(new_tokens):
            nxt = model(input_ids=out, use_cache=False).logits[0, -1].argmax()
            out = torch.cat([out, nxt.view(1, 1)], dim=1)
    with open(os.path.join(d, "greedy.json"), "w") as f:
        json.dump({"prompt": "the model writes", "prompt_ids": prompt[0].tolist(),
                   "ids": out[0, prompt.shape[1]:].tolist()}, f)
        f.write("\n")


FAMILY = {"llama": "llama", "llama3": "llama", "llama-bf16": "llama", "qwen2": "qwen2",
          "qwen3": "qwen2", "gpt2": "gpt2", "mixtral": "llama", "qwen2-moe": "qwen2",
          "qwen3-moe": "qwen2", "phi3": "llama"}


def write(out_dir, name, model, vocab, seed, shard=None, reference_fn=None):
    """Saves `model` as fixture `name` with its reference (reference_fn(d, model, vocab, seed),
    default reference()); a family of FAMILY also gets its tokenizer and greedy.json."""
    d = os.path.join(out_dir, name)
    shutil.rmtree(d, ignore_errors=True)
    kwargs = {"safe_serialization": True}
    if shard:
        kwargs["max_shard_size"] = shard
    model.save_pretrained(d, **kwargs)
    for extra in ("generation_config.json",):
        p = os.path.join(d, extra)
        if os.path.exists(p):
            os.remove(p)
    ref_model = model if next(model.parameters()).dtype == torch.float32 else model.float()
    ref = reference_fn(d, ref_model, vocab, seed) if reference_fn else reference(ref_model, vocab,
                                                                                 seed)
    save_file(ref, os.path.join(d, "reference.safetensors"))
    if name in FAMILY:
        write_tokenizer(d, FAMILY[name])
        write_greedy(d)
    size = sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d))
    print(f"{d}: {sorted(os.listdir(d))} {size} bytes")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "tests",
                                                  "fixtures", "hf"))
    ap.add_argument("--tokenizers-only", action="store_true",
                    help="write only the tokenizer files and greedy.json into the existing "
                    "fixtures")
    ap.add_argument("--only", nargs="+", metavar="NAME", choices=sorted(FAMILY),
                    help="these fixtures alone (VERSIONS records their versions apart)")
    args = ap.parse_args()
    if args.tokenizers_only:
        for name, family in FAMILY.items():
            if args.only and name not in args.only:
                continue
            write_tokenizer(os.path.join(args.out, name), family)
            write_greedy(os.path.join(args.out, name))
        return
    os.makedirs(args.out, exist_ok=True)
    torch.manual_seed(0)
    common = dict(vocab_size=100, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                  rms_norm_eps=1e-5, torch_dtype="float32")

    def llama():
        m = transformers.LlamaForCausalLM(
            transformers.LlamaConfig(rope_theta=50000.0, tie_word_embeddings=False, **common))
        randomize(m, 1)
        write(args.out, "llama", m, 100, 1, shard="40KB")

    def llama3():
        m = transformers.LlamaForCausalLM(
            transformers.LlamaConfig(
                rope_theta=500000.0, tie_word_embeddings=True,
                rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 8},
                **common))
        randomize(m, 2)
        write(args.out, "llama3", m, 100, 2)

    def qwen2():
        m = transformers.Qwen2ForCausalLM(
            transformers.Qwen2Config(rope_theta=1000000.0, tie_word_embeddings=False,
                                     use_sliding_window=False, **common))
        randomize(m, 3)
        write(args.out, "qwen2", m, 100, 3)

    def qwen3():
        m = transformers.Qwen3ForCausalLM(
            transformers.Qwen3Config(rope_theta=1000000.0, tie_word_embeddings=True,
                                     head_dim=16, attention_bias=False,
                                     use_sliding_window=False,
                                     pad_token_id=first_input_token(100, 6), **common))
        randomize(m, 6)
        write(args.out, "qwen3", m, 100, 6)

    def phi3():
        m = transformers.Phi3ForCausalLM(
            transformers.Phi3Config(rope_theta=250000.0, tie_word_embeddings=False,
                                    sliding_window=None, bos_token_id=1, eos_token_id=2,
                                    pad_token_id=first_input_token(100, 7), **common))
        randomize(m, 7)
        write(args.out, "phi3", m, 100, 7)

    def gpt2():
        m = transformers.GPT2LMHeadModel(
            transformers.GPT2Config(vocab_size=100, n_embd=32, n_layer=2, n_head=4,
                                    n_positions=32, bos_token_id=0, eos_token_id=0,
                                    torch_dtype="float32"))
        randomize(m, 4)
        write(args.out, "gpt2", m, 100, 4)

    def llama_bf16():
        m = transformers.LlamaForCausalLM(
            transformers.LlamaConfig(rope_theta=50000.0, tie_word_embeddings=False, **common))
        randomize(m, 1)
        m = m.to(torch.bfloat16)
        m.config.torch_dtype = torch.bfloat16
        write(args.out, "llama-bf16", m, 100, 5)

    # In the order the fixtures were first written (each draws from the seeded generator).
    builders = {"llama": llama, "llama3": llama3, "qwen2": qwen2, "gpt2": gpt2,
                "llama-bf16": llama_bf16, "qwen3": qwen3, "phi3": phi3}
    unknown = set(args.only or []) - set(builders)
    if unknown:
        ap.error(f"--only: {sorted(unknown)} are written by tools/make_moe_fixtures.py")
    for name, build in builders.items():
        if not args.only or name in args.only:
            build()

    versions = {"torch": torch.__version__, "transformers": transformers.__version__}
    path = os.path.join(args.out, "VERSIONS")
    if args.only:  # the others keep the versions they were written with
        with open(path) as f:
            recorded = json.load(f)
        for name in args.only:
            recorded.setdefault("fixtures", {})[name] = versions
        versions = recorded
    with open(path, "w") as f:
        json.dump(versions, f)
        f.write("\n")


if __name__ == "__main__":
    main()
