"""Context parallelism against one process: the built-in GPT (learned positions, causal SDPA), transformers Llama
(rotary, grouped-query attention, a (b, 1, S, S) mask found causal at compile time; also its eager attention,
written out as matmul, softmax, matmul), Qwen2 (biased q/k/v) and Mistral (a sliding-window mask, kept and read
per block at global positions), sequences of 64 and 256.

Each case trains 5 AdamW steps on the same global batches as the single-process reference (tests/parity.py) and
checks losses, step-1 gradients and final parameters; it also checks what was sharded: every attention's K and V
are this rank's S/cp rows of the kv heads (never the whole sequence), and, with the ring, that the elements sent
on step 1 are exactly (cp-1)/cp · b·S·h_kv·d·2 per layer forward and twice that backward (runtime RingCensus).

Tolerances: those of data parallelism (tests/models/test_dp_parity.py). Attention over sequence shards computes
the same sums in blocks (the ring merges per-block softmax statistics in fp32); the kernels' own test measures
<= 2e-6 on outputs and gradients. Measured over all cases below (2026-12-01): losses <= 4.8e-7, step-1
gradients <= 3.8e-8, parameters after 5 steps <= 1.1e-5 (the tp case; 2.8e-6 without tp). Bounds: losses 2e-5,
gradients 2e-6, parameters 5e-5 (parity.assert_matches).
"""
from __future__ import annotations

import pytest
import torch

import meshc
from meshc.runtime.ops.context import RingCensus, context_attention
from tests import parity, zoo
from tests.harness import run_ranks

STEPS, BATCH = 5, 4
FAST = {"trace": "non-strict", "verify": True}
KV_HEADS = {"gpt_long": 4, "llama": 2, "llama_eager": 2, "qwen2": 2, "mistral": 2}
HEAD_DIM, LAYERS = 8, 2
CASES = [  # (model, sequence, mesh, plans run one after the other in one launch)
    ("gpt_long", 64, {"dp": 1, "cp": 2}, [{}]),
    ("llama", 256, {"dp": 1, "cp": 4}, [{"cp_attention": m} for m in ("ring", "all_gather", "all_to_all")]),
    ("qwen2", 64, {"dp": 2, "cp": 2, "tp": 2}, [{"cp_attention": "all_gather"}]),
    ("gpt_long", 64, {"dp": 2, "cp": 2}, [{"zero": 3, "cp_attention": "all_to_all"}]),  # 2 batches × 2 halves; ZeRO-3 over 4
    # compiled by Inductor: the all-gather and all-to-all methods are functional collectives; the ring's point-to-point
    # transfers run as FX code between compiled regions (runtime/regions.py)
    ("llama", 64, {"dp": 1, "cp": 2}, [{"cp_attention": m, "inductor": True} for m in ("all_to_all", "ring")]),
    ("mistral", 64, {"dp": 1, "cp": 2}, [{}]),  # a sliding-window mask: read per block by global position
    ("llama_eager", 64, {"dp": 1, "cp": 2, "pp": 2}, [{"microbatches": 2}]),  # written-out attention, found
]


def _cp_rank(model: str, seq: int, mesh_sizes: dict, plans: list[dict]) -> list[dict]:
    mesh = meshc.mesh(timeout_s=90, **mesh_sizes)
    data = zoo.batches(STEPS, BATCH, seq=seq)
    outs = []
    for plan in plans:
        job = meshc.compile(zoo.build(model), mesh, example_inputs=(mesh.shard_batch(data[0][0]),),
                            plan=meshc.Plan(**FAST, **plan))
        opt = job.optimizer(torch.optim.AdamW, lr=parity.LR)
        losses, grads0, census = [], {}, {}
        for i, (x, y) in enumerate(data):
            with RingCensus() as counted:
                loss = job.step(mesh.shard_batch(x), mesh.shard_batch(y), zoo.lm_loss)
            if i == 0:
                grads0, census = job.grad_state_dict(), dict(counted.sent)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        graphs = [job.graph()]  # this rank's program (its one pipeline stage under pp)
        kv = [tuple(n.args[1].meta["val"].shape) for g in graphs for n in g.graph.nodes if n.target is context_attention]
        outs.append({"losses": losses, "grads0": grads0, "params": job.state_dict(), "census": census, "kv": kv,
                     "compiled": (job.inductor.stats.forward, job.inductor.stats.backward, job.inductor.stats.regions),
                     "report": str(job.explain()), "local": {f: p.numel() for f, p in job.named_parameters()}})
    return outs


def _id(case):
    model, seq, mesh, plans = case
    return "-".join([model, str(seq), "x".join(f"{k}{v}" for k, v in mesh.items()),
                     *(f"{k}{v}" for p in plans[:1] for k, v in p.items())])


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_context_parallel_matches_single_process(case):
    model, seq, mesh, plans = case
    world = mesh["dp"] * mesh["cp"] * mesh.get("tp", 1) * mesh.get("pp", 1)  # cp an axis of its own
    ref = parity.reference(model, STEPS, BATCH, seq=seq)
    results = run_ranks(_cp_rank, world, model, seq, mesh, plans, timeout=300)
    cp, tp = mesh["cp"], mesh.get("tp", 1)
    b = BATCH // mesh["dp"] // plans[0].get("microbatches", 1)  # rows per rank (per micro-batch)
    for rank, outs in enumerate(results):
        for plan, out in zip(plans, outs):
            parity.assert_matches(rank, out, ref, STEPS)
            hk = KV_HEADS[model] // tp
            assert out["kv"], f"rank {rank}: no context attention in its graphs"
            for shape in out["kv"]:  # this rank's rows of the kv heads only: no whole-sequence K/V
                assert shape == (b, hk, seq // cp, HEAD_DIM), (rank, plan, shape)
            layers_here = len(out["kv"])
            if plan.get("cp_attention", "ring") == "ring":
                forward = layers_here * (cp - 1) * b * (seq // cp) * hk * HEAD_DIM * 2
                microbatches = plan.get("microbatches", 1)
                assert out["census"] == {"forward": forward * microbatches, "backward": 2 * forward * microbatches}, \
                    (rank, out["census"])
            else:
                assert out["census"] == {"forward": 0, "backward": 0}, (rank, out["census"])  # no ring, nothing counted
            assert "cp" in out["report"]
            if plan.get("inductor"):  # Inductor really compiled the program, forward and backward (the ring: in
                # regions around each block's attention, which the census above saw run)
                assert out["compiled"][0] >= 1 and out["compiled"][1] >= 1, (rank, out["compiled"])
                assert (out["compiled"][2] >= 3) == (plan["cp_attention"] == "ring"), (rank, out["compiled"])
            if plan.get("zero") == 3:  # ZeRO-3 shards over dp × cp, as Megatron's distributed optimizer: ceil(numel / 4)
                whole = {f: p.numel() for f, p in zoo.build(model).named_parameters()}
                assert out["local"] == {f: -(-n // (mesh["dp"] * cp)) for f, n in whole.items()}, rank


def test_alibi_attention_on_sequence_shards_matches_single_process():
    """BLOOM adds its ALiBi bias (heads, 1, keys) to the scores inside a baddbmm: written-out attention that no
    context attention method takes, so its scores' inputs are gathered over cp where the rules ask (the report names
    each gather) and the rest runs on sequence shards. Before 2026-12-06 the column-parallel matmul rule kept a bias
    of more than one dim whole beside the keys' shard: the context pass failed with an internal error."""
    ref = parity.reference("bloom", STEPS, BATCH)
    results = run_ranks(parity.meshc_rank, 2, "bloom", STEPS, BATCH, {"cp": 2}, {"trace": "non-strict"}, timeout=300)
    for rank, out in enumerate(results):
        parity.assert_matches(rank, out, ref, STEPS)
        # the sequence really is split: the scores' operands gathered over cp, per block (2 blocks)
        gathers = [ln for ln in out["report"].splitlines() if "all_gather" in ln and " cp " in ln and "baddbmm" in ln]
        assert len(gathers) == 2, out["report"]


def test_a_prompt_put_before_the_tokens_trains_on_sequence_shards():
    """A prompt cat before the token shards gathers the sequence whole (noted), and the logits, whole after it, are
    sliced back to each rank's positions (passes/context.py `_outputs`): before 2026-12-07 they came out whole and the
    loss met twice the rank's targets (CPM-Ant, Gemma 3 at cp=2)."""
    ref = parity.reference("prompt_lm", STEPS, BATCH)
    results = run_ranks(parity.meshc_rank, 2, "prompt_lm", STEPS, BATCH, {"cp": 2}, {"trace": "non-strict"},
                        timeout=300)
    for rank, out in enumerate(results):
        parity.assert_matches(rank, out, ref, STEPS)
        assert "sliced back to this rank's positions" in out["report"], out["report"]
