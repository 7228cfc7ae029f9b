"""Every plan combination trains at parity with one process or is refused at construction (issue 13).

The options of meshc.Plan and the mesh are crossed pairwise: a covering array (every pair of values of
any two factors appears in some case, not the full product of 124,416) over

    mesh              dp2, tp2, pp2, dp2xtp2, tp2xpp2, dp2xpp2
    zero              0, 1, 2, 3
    remat             none, full, selective
    sequence_parallel off, on
    vocab_parallel    off, on
    schedule          1f1b, gpipe, interleaved (virtual=2), zb-h1, zbv, dualpipev (both virtual=2, in a V)
    param_dtype       fp32, bf16
    fusion            on, off
    collective_matmul off, on
    microbatches      1, 2, 4
    offload           none, nvme (optimizer states), nvme+params (and ZeRO-3's parameter shards)
    inductor          off (FX code), on (every per-rank program compiled by Inductor)

generated here by a deterministic greedy all-pairs search (`covering_array`). A pair counts as covered
only by a case where both values take effect (`in_effect`: sequence and vocab parallelism and collective
matmuls need a tp axis, ZeRO a dp axis, a schedule a pp axis), so the array crosses options that really
run together; cases may still carry settings the mesh makes moot (they must train too).
Combinations meshc does not support (`expected_refusal`) are left out of the pairs, and each such rule
gets one case of its own, which must be refused by Plan(...) or meshc.compile with a MeshcError whose
message names the option. Anything else raised (in job.step, the optimizer step, or a non-meshc error
at construction) is a failure. The inductor factor is crossed with the others in a second, small array:
the first covers every pair of the other factors with Inductor off; the second adds, greedily, cases with
Inductor on until every value in effect of every factor but the mesh has met it (7 cases: six schedules need six
pp cases, and the greedy choice takes one on dp2xtp2 besides). Together they cover every pair of the
twelve factors but inductor with the meshes dp2 and tp2 alone, whose compiled runs are the compiled parity file's
dp2 x tp2 cases (tests/models/test_inductor_parity.py); the compiled cases cost seconds of Inductor each, not the
whole array's (until 2026-12-07 the mesh's values too: 9 cases, two more compiled launches for no plan they alone
ran).

The first array has 56 cases: 48 that must train (19 on dp2xpp2, where alone ZeRO stages meet pipeline
schedules on a real dp axis; 8 on pp2, 7 on tp2xpp2, 6 on dp2xtp2, 5 on dp2, 3 on tp2; 18 of them with
offload; 5 or 6 with each schedule on a pp mesh) and 8 refusals (one per rule in RULES). They run on the reference Transformer (2 layers, dim 32, vocab 64) for 2 AdamW
steps on a global batch of 8: one run_ranks spawn per mesh, whose ranks compile and train each of that
mesh's cases in turn, so six process start-ups in all. About 80 s on 2 CPU cores (up to 2.5 min when the
machine is busy with other work); the compiled cases (nine then) added 136 s with Inductor's cache empty (190 s for the
file against 55 s without them, 2026-12-06), 70 s with it warm. Each compiled case also asserts that Inductor
compiled its ranks' forward and backward graphs, and its remat as blocks marked for the partitioner.

Beyond parity (which holds when an option does nothing), every trained case asserts on every rank that its
options took effect, measured around the real steps (`_took_effect`, tests/effects.py): bytes offloaded, the
pipeline actions run against the schedule's, fused kernels dispatched where the rank's graphs hold fused sites
(none with fusion off), collective matmuls and remat regions in the graphs it runs, tp coverage from local shapes
and the ZeRO share on dp. It found Plan.remat ignored where a fused residual-add + norm straddles two blocks
(REMAT_GAPS, a strict xfail of their own). Mutations caught: 1F1B run as GPipe, the remat pass switched off.

Tolerances: fp32 cases as every parity test (parity.assert_matches: losses 2e-5, step-1 gradients 2e-6,
parameters 5e-5; tests/models/test_pp_parity.py and test_tp_parity.py say why). bf16 cases against
parity.mixed_reference, as tests/runtime/test_zero.py's mixed-precision test: losses within 3e-2, step-1
gradients within GRAD_BOUND = 3% relative L2 per tensor (||g - g_ref|| / ||g_ref||: a wrong gradient is off by its
own size, bf16 rounding of sums taken in another order by about 2^-8 per sum; measured 0.31-1.35% in every case but
one, tp2xpp2 with sequence parallelism, collective matmuls and selective recompute, 7.4% on layers.0's w1 until
2026-12-05, when a block holding a collective matmul came to be checkpointed in full under selective remat: a wrong
gradient, 6.4e-3 off in fp32 too once the split put a checkpointed block there; GRAD_OUTLIERS, judged at 10% here
and at 3% by an xfail(strict) test of their own, is empty), and each tensor's update (final - initial weights) within UPDATE_BOUND = 35%
of the reference's (parity.max_update_error: ||Δ - Δ_ref|| / ||Δ_ref||). Raw parameters are not compared: AdamW
moves a weight by about lr = 1e-3 a step whatever its gradient's size, so a tiny gradient whose sign the rounding
flips leaves a weight up to 2 x lr apart per step, more than the reference moves any weight in 2 steps (2.07e-3):
a run whose optimizer updated nothing sat within the old 4.5e-3 bound. Updates measured (largest over ranks and
tensors): 2.6% on 4 cases, 6.7% (tp2), 7.4% (tp2xpp2 zbv), and 22.3-22.4% on 4 cases (dp2xpp2, pp2 dualpipev,
dp2xtp2, tp2xpp2 selective), all on layers.0.attention_norm.weight, 32 elements one of which has a step-1
gradient of 6.1e-5 (median 1.3e-2): its sign flips, and that element moves about 0 where the reference moves 2 lr.
Mutations, measured: a meshc optimizer with lr = 0 is 100% off on every case (old bound: passed, 2.07e-3); one
skipping its last step 49.9-57.5% off (old bound: passed, <= 2.98e-3). 35% sits between the noise (22.4%, one
flipped sign: two would be about 31%) and one step of two lost (49.9%). Measured here:
fp32 losses <= 2e-6, step-1 gradients <= 4.2e-7, parameters <= 3.9e-6; bf16 losses <= 1.4e-2 (the fused
kernels compute in fp32 inside, so with fusion on meshc's first loss sits nearer the fp32 loss than the
eager bf16 reference does).
"""
from __future__ import annotations

import contextlib
import itertools
import math
import tempfile
import traceback

import pytest
import torch
import torch.distributed as dist

import meshc
from tests import effects, parity, zoo
from tests.harness import RankFailure, run_ranks

MODEL, STEPS, BATCH = "reference", 2, 8
MESHES = {"dp2": {"dp": 2}, "tp2": {"tp": 2}, "pp2": {"pp": 2}, "dp2xtp2": {"dp": 2, "tp": 2},
          "tp2xpp2": {"tp": 2, "pp": 2}, "dp2xpp2": {"dp": 2, "pp": 2}}
FACTORS = {
    "mesh": tuple(MESHES),
    "zero": (0, 1, 2, 3),
    "remat": ("none", "full", "selective"),
    "sequence_parallel": (False, True),
    "vocab_parallel": (False, True),
    "schedule": ("1f1b", "gpipe", "interleaved", "zb-h1", "zbv", "dualpipev"),
    "param_dtype": ("fp32", "bf16"),
    "fusion": (True, False),
    "collective_matmul": (False, True),
    "microbatches": (1, 2, 4),
    "offload": ("none", "nvme", "nvme+params"),
}
DTYPES = {"fp32": None, "bf16": torch.bfloat16}
GRAD_BOUND, UPDATE_BOUND = 0.03, 0.35  # bf16 cases: step-1 gradients and updates, relative L2 per tensor (above)
GRAD_OUTLIER_BOUND = 0.1  # catches a wrong gradient (100% off) in GRAD_OUTLIERS (none at present)
GRAD_OUTLIERS: dict[str, str] = {}  # case -> why its bf16 step-1 gradients exceed GRAD_BOUND (issue 46); empty since
# 2026-12-05: tp2xpp2-z1-selective-1f1b-bf16-m4-sp-vocab-cm-nvme (7.4% off) came within it once a block holding a
# collective matmul is checkpointed in full under selective remat (passes/remat.RINGS: selective around the ring
# was 6.4e-3 off in fp32 too)


REMAT_GAP = ("Plan.remat checkpoints no block: the fused residual-add + norm kernel of a block boundary (fusion on, "
             "tp) straddles two blocks, and the remat pass leaves each block whole ('a value it produces is used "
             "before the block ends', in explain()). Declining that fusion under remat (tried) makes the blocks "
             "checkpointed (it showed selective remat with collective matmuls training wrong, 7.2e-3 in fp32, checkpointed "
             "in full since 2026-12-05: passes/remat.RINGS)")
REMAT_GAPS = {name: REMAT_GAP for name in (  # on every rank, or on the pp rank whose block meets the final norm
    "tp2-z1-full-1f1b-bf16-m2-sp-vocab-cm-nvme", "dp2xtp2-z2-full-1f1b-fp32-m2-sp-cm",
    "dp2xtp2-z2-selective-1f1b-fp32-m4-vocab", "tp2xpp2-z0-selective-gpipe-fp32-m2-sp-vocab-cm",
    "tp2xpp2-z1-selective-1f1b-bf16-m4-sp-vocab-cm-nvme", "tp2xpp2-z0-full-zb-h1-fp32-m1-sp-vocab-cm")}


def _size(case: dict, axis: str) -> int:
    return MESHES[case["mesh"]].get(axis, 1)


def in_effect(case: dict, factor: str) -> bool:
    """Whether `case[factor]` changes what runs on `case["mesh"]` (defaults and off switches always do)."""
    value = case[factor]
    if factor == "zero":
        return value == 0 or _size(case, "dp") > 1
    if factor in ("sequence_parallel", "vocab_parallel", "collective_matmul"):
        return not value or _size(case, "tp") > 1
    if factor == "schedule":
        return _size(case, "pp") > 1
    if factor == "offload":  # streams the optimizer's states whenever ZeRO is on, whatever the dp size
        return value == "none" or case["zero"] >= 1
    return True


# Combinations meshc refuses at construction: the rule, the option its message must name, and when it applies.
RULES = {
    "mixed precision keeps fp32 master shards: zero >= 1": (
        "param_dtype", lambda c: c["param_dtype"] != "fp32" and c["zero"] == 0),
    "interleaved 1F1B: microbatches a multiple of pp": (
        "microbatches", lambda c: c["schedule"] == "interleaved" and c["microbatches"] % _size(c, "pp") != 0),
    "collective matmuls overlap sequence parallelism's collectives": (
        "collective_matmul", lambda c: c["collective_matmul"] and not c["sequence_parallel"]),
    "collective matmuls are made by the fusion pass": (
        "collective_matmul", lambda c: c["collective_matmul"] and not c["fusion"]),
    "zb-h1, zbv and dualpipev run backward twice per block, torch's selective checkpoint once": (
        "remat", lambda c: c["remat"] == "selective" and c["schedule"] in ("zb-h1", "zbv", "dualpipev")),
    "dualpipev: at least as many micro-batches as stages (2 pp)": (
        "microbatches", lambda c: c["schedule"] == "dualpipev" and _size(c, "pp") > 1
        and c["microbatches"] < 2 * _size(c, "pp")),  # pp = 1: 2 stages on one rank, m >= 2 whenever it pipelines
    "offload moves ZeRO's optimizer-state shards: zero >= 1": (
        "offload", lambda c: c["offload"] != "none" and c["zero"] == 0),
    "offload_params moves ZeRO-3's parameter shards: zero = 3": (
        "offload_params", lambda c: c["offload"] == "nvme+params" and c["zero"] not in (0, 3)),
}


def broken_rules(case: dict) -> list[str]:
    return [rule for rule, (_, applies) in RULES.items() if applies(case)]


def expected_refusal(case: dict) -> str | None:
    """The option a MeshcError must name when meshc refuses `case` at construction; None: it must train."""
    rules = broken_rules(case)
    return RULES[rules[0]][0] if rules else None


def _pairs(case: dict) -> int:
    """The case's pairs of values in effect, as a bit set over PAIR_BITS."""
    names = [f for f in FACTORS if in_effect(case, f)]
    bits = 0
    for a, b in itertools.combinations(names, 2):
        bits |= 1 << PAIR_BITS[(a, case[a], b, case[b])]
    return bits


PAIR_BITS = {key: i for i, key in enumerate(
    (a, va, b, vb) for a, b in itertools.combinations(FACTORS, 2) for va in FACTORS[a] for vb in FACTORS[b])}


def _values(case: dict, mesh: bool = True) -> int:
    """The case's values in effect, as a bit set over VALUE_BITS: the pairs each makes with inductor on (without the
    mesh's own value when `mesh` is False)."""
    bits = 0
    for f in FACTORS:
        if in_effect(case, f) and (mesh or f != "mesh"):
            bits |= 1 << VALUE_BITS[(f, case[f])]
    return bits


VALUE_BITS = {key: i for i, key in enumerate((f, v) for f in FACTORS for v in FACTORS[f])}


def _greedy(valid: list[tuple[dict, int]]) -> list[dict]:
    """Repeatedly the first case (in product order) covering the most bits not yet covered, until every bit some
    case covers is."""
    wanted = 0
    for _, bits in valid:
        wanted |= bits
    chosen, covered = [], 0
    while covered != wanted:
        case, bits = max(valid, key=lambda cb: (cb[1] & ~covered).bit_count())
        chosen.append(case)
        covered |= bits
    return chosen


def covering_array() -> list[dict]:
    """Greedy all-pairs over FACTORS with Inductor off; then the pairs of Plan.inductor=True with every value in
    effect of every factor, greedily, in cases compiled by Inductor (the pairs among the other factors are the
    first part's, so that the whole is a covering array of FACTORS and the inductor factor, its compiled part
    small: compiled cases cost seconds of Inductor each); then one case per refusal rule (the first in product
    order that breaks only that rule)."""
    product = [dict(zip(FACTORS, values)) for values in itertools.product(*FACTORS.values())]
    supported = [c for c in product if expected_refusal(c) is None]
    fx = _greedy([(c, _pairs(c)) for c in supported])
    compiled = _greedy([(c, _values(c, mesh=False)) for c in supported])
    refused = {}
    for c in product:
        broken = broken_rules(c)
        if len(broken) == 1:
            refused.setdefault(broken[0], c)
    return ([{**c, "inductor": False} for c in fx] + [{**c, "inductor": True} for c in compiled] +
            [{**refused[rule], "inductor": False} for rule in RULES])


def plan_kwargs(case: dict) -> dict:
    kwargs = {k: case[k] for k in ("zero", "remat", "sequence_parallel", "vocab_parallel", "schedule", "fusion",
                                   "collective_matmul", "microbatches")}
    kwargs["virtual"] = 2 if case["schedule"] == "interleaved" else 1
    kwargs["param_dtype"] = DTYPES[case["param_dtype"]]
    if case["offload"] != "none":  # each rank's scratch file is unlinked at once: nothing is left in the folder
        kwargs.update(offload="nvme", offload_dir=tempfile.gettempdir(), offload_params=case["offload"] == "nvme+params",
                      offload_buffer_mb=0.05)  # several buckets, parameters cut into pieces
    return {**kwargs, "inductor": case["inductor"], "trace": "non-strict", "verify": True}


def case_id(case: dict) -> str:
    parts = [case["mesh"], f"z{case['zero']}", case["remat"], case["schedule"], case["param_dtype"],
             f"m{case['microbatches']}"]
    parts += [name for name, flag in (("sp", case["sequence_parallel"]), ("vocab", case["vocab_parallel"]),
                                      ("nofusion", not case["fusion"]), ("cm", case["collective_matmul"])) if flag]
    parts += [] if case["offload"] == "none" else [case["offload"]]
    parts += ["inductor"] if case["inductor"] else []
    return "-".join(parts)


CASES = covering_array()
N_COMPILED = 7  # cases with Inductor on: every value in effect of every factor but the mesh once at least


# ------------------------------------------------------------------------------ one rank, many plans
def _rank_runs(mesh_sizes: dict, plans: list[dict]) -> list[dict]:
    """Compile and train each plan in turn on one mesh. Per plan: {"refused": "Type: message"} when
    Plan(...) or meshc.compile raised on every rank, else the parity run's results; an error after
    construction ends the loop with {"failed": traceback} (the peers may be stuck in a collective)."""
    mesh = meshc.mesh(timeout_s=60, **mesh_sizes)
    data = zoo.batches(STEPS, BATCH)
    out = []
    for kwargs in plans:
        try:
            job = meshc.compile(zoo.build(MODEL), mesh, example_inputs=(mesh.shard_batch(data[0][0]),),
                                plan=meshc.Plan(**kwargs))
            error = None
        except Exception as e:  # noqa: BLE001 - a refusal, judged by the test
            job, error = None, (type(e).__name__, isinstance(e, meshc.MeshcError), str(e), traceback.format_exc())
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, error is None)
        if not all(every):  # refused; every rank must agree, or the run has diverged
            out.append({"refused": error, "agreed": not any(every)})
            continue
        try:
            opt = job.optimizer(torch.optim.AdamW, lr=parity.LR)
            losses, grads0, ops = [], {}, effects.Counting()
            for i, (x, y) in enumerate(data):
                with ops if i == 0 else contextlib.nullcontext():  # the kernels one step dispatches
                    loss = job.step(mesh.shard_batch(x), mesh.shard_batch(y), zoo.lm_loss)
                if i == 0:
                    grads0 = job.grad_state_dict()
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
            out.append({"losses": losses, "grads0": grads0, "params": job.state_dict(), "report": str(job.explain()),
                        "ran": effects.record(job, mesh, ops)})
        except Exception:  # noqa: BLE001 - after construction, every error is a failure
            out.append({"failed": traceback.format_exc()})
            break
    return out


# ------------------------------------------------------------------------------ the tests
def test_the_array_covers_every_pair():
    """Every pair of values in effect of two factors, and every value in effect with Inductor on and off."""
    covered, compiled, fx = 0, 0, 0
    for c in CASES:
        if expected_refusal(c) is None:
            covered |= _pairs(c)
            compiled |= _values(c, mesh=False) if c["inductor"] else 0
            fx |= 0 if c["inductor"] else _values(c)
    reachable, values, but_mesh = 0, 0, 0
    for v in itertools.product(*FACTORS.values()):
        c = dict(zip(FACTORS, v))
        if expected_refusal(c) is None:
            reachable |= _pairs(c)
            values |= _values(c)
            but_mesh |= _values(c, mesh=False)
    assert covered == reachable and fx == values and compiled == but_mesh
    assert len(CASES) == len({case_id(c) for c in CASES}) == 56 + N_COMPILED, [case_id(c) for c in CASES]
    assert [expected_refusal(c) for c in CASES[-len(RULES):]] == [option for option, _ in RULES.values()]


@pytest.mark.parametrize("kwargs,option", [
    ({"reduce_dtype": torch.float32}, "reduce_dtype"),  # zero=0 reduces in the gradients' dtype
    ({"fusion": False, "require_fusion": True}, "require_fusion"),
    ({"collective_matmul": True}, "collective_matmul"),
    ({"collective_matmul": True, "sequence_parallel": True, "fusion": False}, "collective_matmul"),
])
def test_options_that_would_be_ignored_are_refused_by_plan(kwargs, option):
    with pytest.raises(meshc.MeshcError, match=f"Plan.{option}: expected "):
        meshc.Plan(**kwargs)


_REFS: dict[str, dict] = {}


def _reference(dtype: str) -> dict:
    if dtype not in _REFS:
        _REFS[dtype] = (parity.reference(MODEL, STEPS, BATCH) if dtype == "fp32"
                        else parity.mixed_reference(MODEL, STEPS, BATCH, DTYPES[dtype]))
    return _REFS[dtype]


def _judge(case: dict, results: list[dict]) -> str | None:
    """None if every rank's result for `case` is as expected, else what went wrong."""
    expected = expected_refusal(case)
    first = results[0]
    if "failed" in first or any("failed" in r for r in results):
        return "raised after construction:\n" + next(r["failed"] for r in results if "failed" in r)
    if "refused" in first or any("refused" in r for r in results):
        r = next(r for r in results if "refused" in r)
        if not r["agreed"]:
            return "refused on some ranks only"
        kind, ours, message, tb = r["refused"]
        if expected is None:
            return f"refused, but meshc documents it as supported: {kind}: {message}\n{tb}"
        if not ours or expected not in message:
            return f"refused without a MeshcError naming {expected!r}: {kind}: {message}\n{tb}"
        return None
    if expected is not None:
        return f"trained, but meshc documents it as unsupported ({expected})"
    ref = _reference(case["param_dtype"])
    try:
        for rank, out in enumerate(results):
            if case["param_dtype"] == "fp32":
                parity.assert_matches(rank, out, ref, STEPS)
            else:
                worst = max(abs(a - b) for a, b in zip(out["losses"], ref["losses"]))
                assert worst < 3e-2, f"rank {rank}: losses {out['losses']} against {ref['losses']}"
                rel, where = parity.max_relative(out["grads0"], ref["grads0"])
                bound = GRAD_OUTLIER_BOUND if case_id(case) in GRAD_OUTLIERS else GRAD_BOUND
                assert rel < bound, f"rank {rank}: step-1 gradient of {where} off by {rel:.2%} (relative L2)"
                err, where = parity.max_update_error(out["params"], ref)
                assert err < UPDATE_BOUND, f"rank {rank}: update of {where} off by {err:.2%} (relative L2)"
        _took_effect(case, results)
    except AssertionError as e:
        return f"trained differently: {e}"
    return None


def _took_effect(case: dict, results: list[dict]) -> None:
    """Each option did on every rank what it says, measured (tests/effects.py): bytes offloaded, the schedule's
    actions run in its order, fused kernels dispatched where the rank's graphs hold fused sites (none with fusion
    off), collective matmuls and remat regions in the graphs the ranks run, the blocks sharded on tp (from local
    shapes) and ZeRO's share on dp. Measured 2026-12-04 (local elements / the whole parameters they belong to):
    0.50 at dp2 with ZeRO, 1.00 without; 0.26-0.28 at dp2 x tp2 with ZeRO, 0.55 without; tp2 alone 0.51-0.59
    (norms whole); the optimizer's states are 8 bytes per local element (AdamW's two fp32 states), 0 offloaded."""
    tp, dp, pp, m = _size(case, "tp"), _size(case, "dp"), _size(case, "pp"), case["microbatches"]
    model = zoo.build(MODEL)
    for rank, out in enumerate(results):
        ran = out["ran"]
        where = f"rank {rank} ({ran['coords']})"
        offloaded = ran["held"].get("offloaded", 0)
        assert (offloaded > 0) == (case["offload"] != "none"), f"{where}: {offloaded} bytes offloaded"
        want = effects.expected_actions(case["schedule"], pp, m, 2 if case["schedule"] == "interleaved" else None,
                                        ran["coords"].get("pp", 0))
        assert ran["actions"] == want, f"{where} ran {ran['actions']}, its schedule is {want}"
        assert (ran["kernels"] > 0) == (ran["kernel_sites"] > 0) and (case["fusion"] or not ran["kernel_sites"]), \
            f"{where}: {ran['kernels']} kernel calls in a step, {ran['kernel_sites']} fused sites in its graphs"
        remat = ran["remat_marked"] if case["inductor"] else ran["remat"]  # compiled: blocks marked for the partitioner
        if case_id(case) not in REMAT_GAPS:  # those: some ranks checkpoint no block (the xfail test below)
            assert (remat > 0) == (case["remat"] != "none"), f"{where}: {remat} remat regions"
        compiled = ran["inductor"]
        if case["inductor"]:  # Inductor compiled the rank's programs: forward graphs and, once run, backward ones
            assert compiled["forward"] >= 1 and compiled["backward"] >= 1, f"{where}: Inductor compiled {compiled}"
            if any(kind == "I" for kind, _, _ in ran["actions"]):  # zero-bubble: each stage's backward compiled as
                # an input and a weight half, the first stage's as its weight half alone (it has no input gradient)
                first = any(stage == 0 for _, stage, _ in ran["actions"])
                assert compiled["backward"] == 2 * compiled["forward"] - first, f"{where}: {compiled}"
            if case["zero"] == 3 and dp > 1:
                effects.assert_gathers_recomputed(where, ran, model, dp)
        else:
            assert compiled["forward"] == 0, f"{where}: Inductor compiled {compiled['forward']} graphs, inductor off"
        if not (case["collective_matmul"] and tp > 1):
            assert ran["collective_matmuls"] == 0, f"{where}: collective matmuls without Plan.collective_matmul"
        local = sum(math.prod(s) for s in ran["local_shapes"].values())
        if tp > 1 and case["zero"] < 3:  # over the blocks this rank holds
            covered = parity.block_coverage(ran["local_shapes"], model, tp, held_only=True)
            assert covered >= 0.9, f"{where}: {covered:.2f} of its blocks' weight bytes sharded on tp"
        if dp > 1 and case["zero"] >= 1:  # the rank's parameters are its ZeRO shards: about 1/dp of its share
            share = effects.held_share(ran, model)
            assert share <= 1.1 / dp * (0.6 if tp > 1 else 1.0), f"{where}: holds {share:.3f} of its parameters"
        if case["zero"] >= 1 and case["offload"] == "none":  # AdamW's 2 fp32 states per element of those shards
            assert abs(ran["held"]["optimizer"] - 8 * local) <= 0.05 * 8 * local, \
                f"{where}: states {ran['held']} for {local} elements"
    if case["collective_matmul"] and tp > 1:
        assert any(out["ran"]["collective_matmuls"] for out in results), "no rank runs a collective matmul"


_RUNS: dict[str, list[list[dict]]] = {}


def _mesh_runs(mesh: str) -> list[list[dict]]:
    """Each rank's results for the mesh's cases, in CASES order: one spawn per mesh, kept for the tests below.
    A rank that fails raises RuntimeError, not the harness's AssertionError, so that it can never pass for the
    expected failure of an xfail(raises=AssertionError) test."""
    if mesh not in _RUNS:
        sizes = MESHES[mesh]
        world = sizes.get("dp", 1) * sizes.get("tp", 1) * sizes.get("pp", 1)
        cases = [c for c in CASES if c["mesh"] == mesh]
        try:
            _RUNS[mesh] = run_ranks(_rank_runs, world, sizes, [plan_kwargs(c) for c in cases], timeout=300)
        except RankFailure as e:
            raise RuntimeError(f"the {mesh} ranks failed") from e
    return _RUNS[mesh]


@pytest.mark.parametrize("mesh", list(MESHES))
def test_plans_on_mesh_train_at_parity_or_are_refused(mesh):
    cases = [c for c in CASES if c["mesh"] == mesh]
    sizes = MESHES[mesh]
    world = sizes.get("dp", 1) * sizes.get("tp", 1) * sizes.get("pp", 1)
    per_rank = _mesh_runs(mesh)
    problems = []
    for i, case in enumerate(cases):
        results = [r[i] for r in per_rank if i < len(r)]
        if len(results) < world:
            problems.append(f"{case_id(case)}: not run (an earlier case failed)")
            continue
        problem = _judge(case, results)
        if problem:
            problems.append(f"{case_id(case)}: {problem}")
    assert not problems, f"{len(problems)} of {len(cases)} cases on {mesh}:\n" + "\n\n".join(problems)


@pytest.mark.parametrize("name", [pytest.param(name, marks=pytest.mark.xfail(strict=True, raises=AssertionError,
                                                                             reason=reason))
                                  for name, reason in GRAD_OUTLIERS.items()])
def test_bf16_outlier_gradients_within_the_common_bound(name):
    """The bf16 cases judged above at GRAD_OUTLIER_BOUND, held to GRAD_BOUND as every other case: expected to
    fail (strict, so that a fix shows as XPASS and the case rejoins the others). Everything else about them
    (losses, updates, placements, and a gradient bound that catches a wrong gradient) is judged above."""
    case = next(c for c in CASES if case_id(c) == name)
    index = [c for c in CASES if c["mesh"] == case["mesh"]].index(case)
    ref = _reference(case["param_dtype"])
    for rank, results in enumerate(_mesh_runs(case["mesh"])):
        rel, where = parity.max_relative(results[index]["grads0"], ref["grads0"])
        assert rel < GRAD_BOUND, f"rank {rank}: step-1 gradient of {where} off by {rel:.2%} (relative L2)"


@pytest.mark.parametrize("name", [pytest.param(name, marks=pytest.mark.xfail(strict=True, raises=AssertionError,
                                                                             reason=reason))
                                  for name, reason in REMAT_GAPS.items()])
def test_remat_takes_effect_with_fused_norms(name):
    """The cases whose remat regions _took_effect does not check (REMAT_GAPS: some ranks have none), held to what
    Plan.remat promises: every rank runs checkpointed blocks. Expected to fail (strict: a fix shows as XPASS)."""
    case = next(c for c in CASES if case_id(c) == name)
    index = [c for c in CASES if c["mesh"] == case["mesh"]].index(case)
    for rank, results in enumerate(_mesh_runs(case["mesh"])):
        assert results[index]["ran"]["remat"] > 0, f"rank {rank}: no block checkpointed under remat={case['remat']}"


def test_fusion_on_runs_kernels_on_each_mesh_with_eligible_chains():
    """_took_effect accepts a fusion-on case with no fused site (nothing eligible on its rank); a fusion pass that
    fused nothing anywhere would pass it, so here: on every mesh with tp or ZeRO on a real dp axis (where chains
    are eligible), some fusion-on case dispatches fused kernels."""
    for mesh, sizes in MESHES.items():
        cases = [c for c in CASES if c["mesh"] == mesh]
        runs = _mesh_runs(mesh)
        eligible = [i for i, c in enumerate(cases) if c["fusion"] and expected_refusal(c) is None
                    and (sizes.get("tp", 1) > 1 or (sizes.get("dp", 1) > 1 and c["zero"] >= 1))]
        if eligible:
            assert any(r[i]["ran"]["kernels"] for r in runs for i in eligible if i < len(r)), \
                f"{mesh}: no fusion-on case dispatched a fused kernel"
