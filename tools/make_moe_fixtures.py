#!/usr/bin/env python3
"""Writes the mixture-of-experts fixtures of tests/hf_compare_test.cc (tests/fixtures/hf/):
tiny random MixtralForCausalLM, Qwen2MoeForCausalLM and Qwen3MoeForCausalLM checkpoints saved by
`transformers`, and
their reference.safetensors, as tools/make_hf_fixtures.py writes them (tokens, targets, logits,
per-token losses, eval corpus and loss) plus:
  loss      [1] the mean per-token cross-entropy (without the auxiliary loss)
  aux_loss  [1] transformers' load_balancing_loss_func over every layer's router logits
  grad.<n>  d(loss + router_aux_loss_coef * aux_loss)/d(parameter), under the name the
            checkpoint stores it by: transformers 5 keeps a layer's experts stacked in memory
            (experts.gate_up_proj [E, 2I, C], experts.down_proj [E, C, I]) but saves one tensor
            per expert (Mixtral experts.<e>.w1/w3/w2, Qwen2-MoE's and Qwen3-MoE's
            experts.<e>.gate/up/down_proj),
            and the references are split the same way (checked against the saved tensors).

Fixtures (router_aux_loss_coef 0.1, so that the auxiliary loss's gradient is well above the
tests' tolerance):
  mixtral    2 layers, 4 experts of width 48, top 2 (renormalized), grouped-query attention
  qwen2-moe  2 layers, 6 experts of width 24, top 2 not renormalized, a shared expert of width 40
             with its sigmoid gate, q/k/v biases
  qwen3-moe  2 layers, 6 experts of width 24, top 2 renormalized, no shared expert, query/key
             norms, heads 16 wide (an attention of 64 in a width of 32)

Off the hot path; run it by hand in a virtual environment with torch and transformers:
VENV/bin/python tools/make_moe_fixtures.py [--out tests/fixtures/hf] [--only NAME...].
"""
import argparse
import os
import sys

import torch
import torch.nn.functional as F
import transformers
from safetensors import safe_open

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_hf_fixtures import B, T, eval_reference, randomize, write  # noqa: E402

COEF = 0.1


def saved_name(name, kind):
    """The per-expert tensors a stacked parameter is saved as: [(name, expert, rows)]."""
    prefix = name.rsplit(".", 1)[0]  # model.layers.<i>.<moe>.experts
    if kind == "mixtral":
        gate, up, down = "w1", "w3", "w2"
    else:
        gate, up, down = "gate_proj", "up_proj", "down_proj"
    if name.endswith("gate_up_proj"):
        return [(f"{prefix}.{{e}}.{gate}.weight", 0), (f"{prefix}.{{e}}.{up}.weight", 1)]
    return [(f"{prefix}.{{e}}.{down}.weight", None)]


def per_expert(name, tensor, kind):
    """{saved name: tensor} of a (possibly stacked) parameter or its gradient (Mixtral's
    in-memory "mlp." is saved as "block_sparse_moe.")."""
    if kind == "mixtral":
        name = name.replace(".mlp.", ".block_sparse_moe.")
    if not name.endswith("experts.gate_up_proj") and not name.endswith("experts.down_proj"):
        return {name: tensor}
    out = {}
    for pattern, half in saved_name(name, kind):
        for e in range(tensor.shape[0]):
            t = tensor[e]
            if half is not None:
                t = t.chunk(2, dim=0)[half]
            out[pattern.format(e=e)] = t.contiguous()
    return out


def reference(d, model, vocab, seed, kind):
    g = torch.Generator().manual_seed(seed + 1)
    seq = torch.randint(0, vocab, (B, T + 1), generator=g)
    tokens, targets = seq[:, :-1].contiguous(), seq[:, 1:].contiguous()
    model.eval()
    model.zero_grad()
    out = model(input_ids=tokens, output_router_logits=True)
    logits = out.logits.float()
    losses = F.cross_entropy(logits.reshape(-1, vocab), targets.reshape(-1), reduction="none")
    loss = losses.mean()
    (loss + COEF * out.aux_loss).backward()
    ref = {
        "tokens": tokens.float(),
        "targets": targets.float(),
        "logits": logits.detach().contiguous(),
        "losses": losses.detach().reshape(B, T).contiguous(),
        "loss": loss.detach().reshape(1),
        "aux_loss": out.aux_loss.detach().float().reshape(1),
    }
    saved = safe_open(os.path.join(d, "model.safetensors"), "pt")
    for name, p in model.named_parameters():
        weights = per_expert(name, p.detach(), kind)
        for k, v in weights.items():  # the split is the one save_pretrained wrote
            assert torch.equal(saved.get_tensor(k), v), k
        for k, v in per_expert(name, p.grad.detach().float(), kind).items():
            ref["grad." + k] = v
    assert sorted(k[5:] for k in ref if k.startswith("grad.")) == sorted(saved.keys())
    ref.update(eval_reference(model, vocab, seed))
    return ref


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "tests",
                                                  "fixtures", "hf"))
    ap.add_argument("--only", nargs="+", choices=["mixtral", "qwen2-moe", "qwen3-moe"],
                    help="these fixtures alone")
    args = ap.parse_args()
    want = lambda name: not args.only or name in args.only  # noqa: E731
    torch.manual_seed(0)
    common = dict(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=32, rms_norm_eps=1e-5,
                  tie_word_embeddings=False, num_experts_per_tok=2, router_aux_loss_coef=COEF,
                  torch_dtype="float32")
    if want("mixtral"):
        mixtral = transformers.MixtralForCausalLM(transformers.MixtralConfig(
            intermediate_size=48, num_local_experts=4, rope_theta=1e6, sliding_window=None,
            **common))
        randomize(mixtral, 11)
        write(args.out, "mixtral", mixtral, 100, 11,
              reference_fn=lambda d, m, v, s: reference(d, m, v, s, "mixtral"))
    if want("qwen2-moe"):
        qwen = transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
            intermediate_size=64, moe_intermediate_size=24, shared_expert_intermediate_size=40,
            num_experts=6, norm_topk_prob=False, rope_theta=1e6, use_sliding_window=False,
            **common))
        randomize(qwen, 12)
        write(args.out, "qwen2-moe", qwen, 100, 12,
              reference_fn=lambda d, m, v, s: reference(d, m, v, s, "qwen2_moe"))
    if want("qwen3-moe"):
        qwen3 = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            intermediate_size=64, moe_intermediate_size=24, num_experts=6, norm_topk_prob=True,
            head_dim=16, attention_bias=False, rope_theta=1e6, use_sliding_window=False,
            **common))
        randomize(qwen3, 13)
        write(args.out, "qwen3-moe", qwen3, 100, 13,
              reference_fn=lambda d, m, v, s: reference(d, m, v, s, "qwen3_moe"))


if __name__ == "__main__":
    main()
