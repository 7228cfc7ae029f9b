"""Models written in plain PyTorch (tests/plain_models.py) against one process: same weights, same global batches,
3 steps, on the meshes a Megatron or torchtitan user tries first; the shards asserted from each rank's local shapes.

The models: a GPT in nanoGPT's style (tied head, the loss computed inside forward); a Llama 3 with complex rotary embeddings, its own init and a view valid only at the traced layout; a
language model on torch's nn.TransformerEncoder; an encoder-decoder on nn.Transformer (cross-attention); a ViT with
a Conv2d patch embedding and a timm-style packed qkv, trained on images; nn.MultiheadAttention's other forms (masks,
need_weights, separate q/k/v weights over a narrower input). The torch.compile door trains them too
(tests/compiler/test_backend.py, FAMILIES).

Tolerances: the shared ones (tests/parity.py: losses 2e-5, gradients 2e-6 relative, parameters 5e-5), for the
reasons test_tp_parity and test_zero_parity give (sums in another order over shards and ranks: fp32 ulps; measured
here, every case: losses <= 4.8e-7, step-1 gradients <= 3.1e-7 relative, parameters <= 3.2e-7); a missing
all-reduce or a wrong slice moves gradients by more than 1e-3.
"""
from __future__ import annotations

import math
import re

import pytest

from tests import effects, parity, zoo
from tests.harness import run_ranks
from tests.models.test_pp_parity import assert_pipelined

STEPS, BATCH = 3, 8
LAYERS = 2  # every zoo model here has two blocks
MESHES = [
    ({"dp": 2}, {"zero": 3}),
    ({"tp": 2}, {}),  # Llama: q, k, v column-parallel through complex rotary; wo, w2 row-parallel
    ({"pp": 2}, {"microbatches": 2}),  # 1F1B
    ({"dp": 2, "tp": 2}, {"zero": 3}),
    ({"tp": 2, "pp": 2}, {"microbatches": 2}),
]
MODELS = ("nanogpt_plain", "llama3_plain", "encoder_lm", "seq2seq_plain", "vit_plain", "mha_plain")
# The ViT's automatic split puts both blocks on stage 0 and the classifier alone on stage 1: at this size (0.002
# GFLOP a block) sending the (b, 17, 32) residual is predicted to cost more than a block's compute, and
# the pooled class token (b, 32) is the cheapest cut. For a real ViT the automatic split is at a block boundary
# (ViT-Base, 224 px, 12 blocks, pp=2, checked with meshc explain on 2026-12-05: 6 | 6 blocks, 67.9 / 66.9 GFLOP);
# here the cut is named (Plan.split_points), so that each stage holds a block.
SPLITS = {"vit_plain": {"split_points": ("blocks.1",)}}
# mha_plain is not a stack of blocks (its layers are ModuleLists of attention modules and every cross-attention
# reads the side input): the pipeline split finds no block boundary to cut at; it runs on the meshes without pp
CASES = [(model, mesh, {**plan, **(SPLITS.get(model, {}) if "pp" in mesh else {})})
         for model in MODELS for mesh, plan in MESHES if not (model == "mha_plain" and "pp" in mesh)] + [
    ("llama3_plain", {"tp": 2}, {"sequence_parallel": True}),
    ("encoder_lm", {"tp": 2}, {"sequence_parallel": True}),
    ("llama3_plain", {"tp": 2}, {"tp": {"*.wq": "replicate"}}),  # q sliced per rank: the output's view a reshape
    ("encoder_lm_seq_first", {"tp": 2}, {}),  # batch_first=False: the heads merged with the batch, (seq, b*h, d)
    ("llama3_plain", {"cp": 2}, {}),  # complex rotary cut to each rank's zigzag positions
    ("encoder_lm", {"cp": 2}, {}),  # nn.MultiheadAttention's SDPA (its mask found causal) as ring attention
    ("nanogpt_plain", {"cp": 2}, {}),
    # experts in a loop, rows picked by torch.where: sizes known only at run time through the tp rules, the costs of
    # the split and plan choice, the sequence-parallel gathers (written in place: results[b, t] += ...) and Inductor
    ("loop_moe_plain", {"tp": 2}, {"sequence_parallel": True}),
    ("loop_moe_plain", {"tp": 2}, {"inductor": True}),
    # attention as a ModuleList of per-head modules: each tp rank holds and runs whole heads of its own (Owned), the
    # output projection row-parallel; with sequence parallelism (each head's input gathered whole before it), and
    # under ZeRO-3 (a head another rank owns: an empty flat shard) and under pipeline stages
    ("head_list_plain", {"tp": 2}, {"sequence_parallel": True}),
    ("head_list_plain", {"dp": 2, "tp": 2}, {"zero": 3}),
    ("head_list_plain", {"tp": 2, "pp": 2}, {"microbatches": 2}),
]


# the loop MoE's router (width x experts, 128 of its 16,512 block weights) stays whole: its scores go to topk over all
# experts; the experts' w1 are column-parallel and w2 row-parallel, as a dense MLP's
ROUTER_WHOLE = 1 - 128 / 16512


def _id(case):
    model, mesh, plan = case
    return "-".join([model, "x".join(f"{k}{v}" for k, v in mesh.items()), *(k for k in plan)])


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_plain_pytorch_models_match_single_process(case):
    model, mesh, plan = case
    # a key projection's bias (nn.MultiheadAttention's, the ViT's packed qkv) has a zero gradient in exact
    # arithmetic (softmax ignores a shift of a row's scores): fp32 leaves ~5e-10 of noise, in another order on each
    # side, which AdamW scales into +-lr steps (measured 8.8e-5 apart after 3 steps, the other parts 2e-9); SGD keeps
    # that noise at noise. The Llama has no biases: AdamW.
    optimizer = "adamw" if model == "llama3_plain" else "sgd"
    ref = parity.reference(model, STEPS, BATCH, optimizer)
    results = run_ranks(parity.meshc_rank, math.prod(mesh.values()), model, STEPS, BATCH, mesh,
                        {"trace": "non-strict", **plan}, optimizer, timeout=300)
    built = zoo.build(model)
    for rank, out in enumerate(results):
        parity.assert_matches(rank, out, ref, STEPS)
        if "zero" in plan:  # flat shards over dp (of tp shards): ~1/dp of the elements, ~1/(dp*tp) of the blocks'
            # (measured 0.30 at dp2 x tp2: embedding and head replicated on tp); a lost dp or tp split fails it
            share = effects.held_share(out, built)
            assert share <= (0.4 if "tp" in mesh else 0.55), (rank, share)
        elif "cp" in mesh:  # each rank holds half of every sequence: attention runs as the ring, per layer
            made = re.search(r"cp=2: (\d+) attention\(s\) made ring", out["report"])
            assert made and int(made.group(1)) == LAYERS, (rank, out["report"][-3000:])
        elif "pp" not in mesh or model == "head_list_plain":  # the blocks' weights split on tp: all of them, or all
            # but the replicated q projections; under pp, of the blocks the rank's stage holds (its heads whole there)
            floor = 0.85 if "tp" in plan else 1.0  # measured 8/9 with q whole (its 1/9 of the blocks' bytes), else 1
            floor = ROUTER_WHOLE if model == "loop_moe_plain" else floor
            covered = parity.block_coverage(out["local_shapes"], built, mesh["tp"], held_only="pp" in mesh)
            assert covered >= floor - 1e-9, (rank, covered, out["report"])
        if plan.get("inductor"):  # every program compiled: a forward and its backward (none run as FX code)
            assert out["inductor"]["forward"] >= 1 and out["inductor"]["backward"] >= 1, (rank, out["inductor"])
            assert not out["inductor"]["eager"], (rank, out["inductor"])
    if "pp" in mesh:
        assert_pipelined(results, model, mesh, plan)
    moved, _ = parity.max_diff(ref["params"], built.state_dict())
    assert moved > 20 * 5e-5
