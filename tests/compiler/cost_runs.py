"""Measured runs of a small model's plans on 2 gloo ranks: what the cost-model tests count (`count`), and what
benchmarks/cost_speed.py times together with a calibration of this machine taken in the same run (`measure`).

`count(candidates)` (tests/compiler/test_cost.py, once per session): on 2 ranks it compiles every plan, runs a
step, and reports per plan the bytes CommCensus counted for one step, the model state held after backward
(job.held_bytes()) and the compiled-path estimate on cpu-default ("estimate"; memory does not depend on the
profile's speeds). Nothing is timed.

`measure(candidates)` (benchmarks only: timings are no test's business, DESIGN.md §6): on 2 ranks it compiles every plan, then
times them in interleaved rounds, each round preceded by a calibration (linear layers, elementwise, op
overhead, AdamW, and each collective's latency and bandwidth). A plan's "ratio" is the median over rounds
of predicted (on that round's calibration) over measured (that round's median step): a shared machine's
load moves from round to round, and moves a calibration and the steps right after it alike. "hardware"
is the profile of the medians over all rounds (compute scale and runtime overheads fitted at the end);
"load" the machine's 1-minute load average, the higher of before and after the rounds (other jobs on the
cores). Each plan also reports the bytes CommCensus counted for one step, the model state held after
backward (job.held_bytes()), and the compiled-path estimate on the profile ("estimate").
"""
from __future__ import annotations

import functools
import os
import statistics
import time

import torch

DIM, LAYERS, VOCAB, SEQ, BATCH = 128, 2, 256, 128, 8


def _search():
    import meshc
    from meshc.compiler.planner.search import Search

    # fusion off: the cost model charges a fused meshc kernel the bytes of one fused op, as its Triton
    # version runs on a GPU; on CPU its torch reference runs the ops it replaces and more (measured: a tp=2
    # step of this model 151 ms fused, 104 ms unfused, predicted ~90 ms either way; dp=2 60 vs 68 ms).
    return Search(zero=(0, 3), remat=("none",), schedules=("1f1b",), microbatches=(1, 2), sequence_parallel=(False,),
                  vocab_parallel=(False,), base=meshc.Plan(trace="non-strict", fusion=False))


SEARCH = _search()
ROUNDS, STEPS = 4, 3


def model() -> torch.nn.Module:
    """torch's reference Transformer, 2 layers of width 128 (0.45M parameters): large enough that matmuls,
    not Python, dominate a step on this CPU."""
    from torch.testing._internal.distributed._tensor.common_dtensor import ModelArgs, Transformer

    torch.manual_seed(0)
    return Transformer(ModelArgs(n_layers=LAYERS, vocab_size=VOCAB, max_seq_len=SEQ, dim=DIM, n_heads=4,
                                 dropout_p=0.0))


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def compiled_step(sizes: dict, plan, x: torch.Tensor, y: torch.Tensor, timeout_s: float):
    """The test model compiled under `plan` on a mesh of `sizes`, and one training step of it (run once here,
    so that what is timed afterwards is steady): (job, opt, step, mesh, xs, ys)."""
    import meshc
    from tests import zoo

    mesh = meshc.mesh(timeout_s=timeout_s, **sizes)
    xs, ys = mesh.shard_batch(x), mesh.shard_batch(y)
    job = meshc.compile(model(), mesh, example_inputs=(xs,), plan=plan)
    opt = job.optimizer(torch.optim.AdamW, lr=1e-3)

    def step():
        job.step(xs, ys, zoo.lm_loss)
        opt.step()
        opt.zero_grad()
    step()
    return job, opt, step, mesh, xs, ys


def _rank(candidates: list[tuple[dict, object]]) -> dict:
    import torch.distributed as dist

    import meshc
    from meshc import calibrate
    from meshc.compiler.cost.compiled import estimate_compiled
    from meshc.compiler.cost.hardware import Hardware

    torch.set_num_threads(1)
    base = meshc.mesh(timeout_s=120)
    x, y = batch()
    jobs = []
    for sizes, plan in candidates:
        jobs.append(compiled_step(sizes, plan, x, y, timeout_s=120))
    computes, links, load = [], [], os.getloadavg()[0]
    times: list[list[float]] = [[] for _ in jobs]  # [plan][round]: median of the round's steps
    probe = calibrate.ScaleProbe(base, quick=True)  # the compute scale, timed in every round
    for _ in range(ROUNDS):
        probe.time()
        computes.append({**calibrate.measure_compute(quick=True), **calibrate.measure_optimizer(quick=True)})
        links.append(calibrate.measure_links(base.group_name("dp"), base.world_size, quick=True))
        for i, (_job, _opt, step, *_rest) in enumerate(jobs):
            step()
            steps = []
            for _ in range(STEPS):
                dist.barrier()
                t0 = time.perf_counter()
                step()
                steps.append(time.perf_counter() - t0)
            times[i].append(statistics.median(steps))
    everyone = [None] * base.world_size
    dist.all_gather_object(everyone, computes)
    computes = [calibrate.median_of([ranks[r] for ranks in everyone]) for r in range(ROUNDS)]  # per round
    hw = Hardware.from_dict(calibrate.profile(calibrate.median_of(computes), _median_samples(links), base.world_size))
    hw = calibrate.runtime_overheads(hw, base, quick=True, probe=probe)
    overheads = {"step_overhead": hw.step_overhead, "action_overhead": hw.action_overhead,
                 "compute_scale": hw.compute_scale}
    by_round = [Hardware.from_dict({**calibrate.profile(c, lk, base.world_size), **overheads})
                for c, lk in zip(computes, links)]
    out = {"hardware": hw.to_dict(), "plans": [], "load": max(load, os.getloadavg()[0])}
    for i, (job, opt, step, mesh, xs, ys) in enumerate(jobs):
        ratios = [estimate_compiled(job.compiled, h).step_time / t for h, t in zip(by_round, times[i])]
        out["plans"].append({"seconds": statistics.median(times[i]), "ratio": statistics.median(ratios),
                             **_counts(job, opt, step, mesh, xs, ys, hw)})
    return out


def _counts(job, opt, step, mesh, xs, ys, hw) -> dict:
    """One plan's untimed counts: the bytes it holds after a step (gradients held, Adam's states made), the
    collectives a further step runs (CommCensus), the bytes the compiled graphs predict, the estimate on `hw`."""
    from meshc.compiler.cost.compiled import comm_bytes, estimate_compiled
    from meshc.runtime.monitor.census import CommCensus
    from tests import zoo

    job.step(xs, ys, zoo.lm_loss)
    held = job.held_bytes()
    opt.zero_grad()
    with CommCensus(mesh) as census:
        step()
    return {"held": held, "census": census.by_kind(), "bytes": comm_bytes(job.program, job.compiled.pipeline),
            "estimate": estimate_compiled(job.compiled, hw, own_rank=True)}


def _median_samples(rounds: list[dict]) -> dict:
    """Per collective kind and size, the median seconds over rounds of calibrate.measure_links."""
    return {kind: [(steps, wire, statistics.median(r[kind][i][2] for r in rounds))
                   for i, (steps, wire, _) in enumerate(rounds[0][kind])] for kind in rounds[0]}


def _count_rank(candidates: list[tuple[dict, object]]) -> list[dict]:
    torch.set_num_threads(1)
    x, y = batch()
    return [_counts(*compiled_step(sizes, plan, x, y, timeout_s=120), "cpu-default") for sizes, plan in candidates]


# The plans the cost tests and benchmarks/cost_speed.py measure, picked among the planner's candidates.
CASES = {"dp": {"dp": 2, "zero": 0}, "zero3": {"dp": 2, "zero": 3}, "tp": {"tp": 2}, "pp": {"pp": 2, "microbatches": 2}}


def index_of(candidates, **want) -> int:
    """The index of the candidate whose mesh sizes and Plan fields are `want`."""
    for i, (sizes, plan) in enumerate(candidates):
        d = dict(sizes)
        if all((d.get(k) if k in d else getattr(plan, k)) == v for k, v in want.items()):
            return i
    raise AssertionError(f"no candidate {want} among {[c[0] for c in candidates]}")


@functools.lru_cache(maxsize=None)
def count(candidates: tuple) -> list[list[dict]]:
    """Every rank's counts of `candidates` (as measure() takes them): one dict per plan, nothing timed."""
    from tests.harness import run_ranks

    return run_ranks(_count_rank, 2, [(dict(sizes), plan) for sizes, plan in candidates], timeout=300)


@functools.lru_cache(maxsize=None)
def measure(candidates: tuple) -> list[dict]:
    """Every rank's measurements of `candidates`: a tuple of (mesh sizes as sorted items, meshc.Plan)."""
    from tests.harness import run_ranks

    return run_ranks(_rank, 2, [(dict(sizes), plan) for sizes, plan in candidates], timeout=300)


def candidates_of(result) -> tuple:
    """The planner's scored candidates (a PlanResult), as measure() takes them, in the planner's order."""
    return tuple((tuple(sorted(r.candidate.sizes.items())), r.candidate.plan) for r in result.ranked)


def late_rank_steps(late: int, pause: float) -> dict:
    """calibrate._step_seconds of a 'step' in which rank `late` alone works for `pause` seconds."""
    import meshc
    from meshc.calibrate import _step_seconds

    mesh = meshc.mesh(timeout_s=60)
    step = (lambda: time.sleep(pause)) if mesh.rank == late else (lambda: None)
    t0 = time.perf_counter()
    step()
    own = time.perf_counter() - t0
    return {"step": _step_seconds(step, 3), "own": own}
