"""What a plan really did on a rank, read off the job around real steps: parity alone holds when an option took
no effect (a plan that shards nothing, fuses nothing or offloads nothing trains like one process too).

    with effects.Counting() as ops:      # around one job.step: the fused kernels it dispatched
        job.step(...)
    ran = effects.record(job, mesh, ops)  # after the steps: bytes held, pipeline actions, what the graphs call
    problems = effects.check(ran, expected)
"""
from __future__ import annotations

import dataclasses
import math

import torch

from meshc.compiler.ir import torch_compat as compat
from meshc.compiler.ir.named_schedule import schedule as named_schedule
from meshc.runtime.ops.collective_matmul import all_gather_matmul, matmul_reduce_scatter
from meshc.runtime.ops.remat import Remat

COLLECTIVE_MATMULS = (all_gather_matmul, matmul_reduce_scatter)


class Counting(compat.dispatch_mode_base()):
    """Counts the meshc custom ops (the fused kernels: meshc::bias_gelu, meshc::pack_cast, ...) dispatched inside
    the `with`, forward and backward. Higher-order operators pass through it too (Inductor's code calls
    run_and_save_rng_state where a recomputed block draws random numbers), run as they are."""

    supports_higher_order_operators = True

    def __init__(self):
        super().__init__()
        self.kernels = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if getattr(func, "namespace", None) == "meshc":
            self.kernels += 1
        return func(*args, **(kwargs or {}))


def _graphs(job, actions: list) -> list[torch.fx.GraphModule]:
    stages = sorted({stage for _, stage, _ in actions})
    return [job.graph(stage=s) for s in stages] if stages else [job.graph()]


def _regions(gm: torch.fx.GraphModule) -> list[Remat]:
    return [m for n in gm.graph.nodes if n.op == "call_module" and isinstance(m := gm.get_submodule(n.target), Remat)]


def _nodes(gm: torch.fx.GraphModule) -> list:
    """Every node `gm` runs, the remat regions' own graphs included."""
    return [*gm.graph.nodes, *(n for r in _regions(gm) for n in r.block.graph.nodes)]


def record(job, mesh, ops: Counting | None = None) -> dict:
    """This rank's effects: held bytes (job.held_bytes), the pipeline actions of the last step as (kind, stage,
    micro-batch), what the graphs it runs call (remat regions; collective matmuls and fused-kernel sites, inside
    the regions too: a kernel node, or a ZeRO gather/reduce flagged fused), the kernels `ops` counted in a step,
    the local parameter shapes, the rank's mesh coordinates and what Inductor compiled for it (its remat is blocks
    marked for the partitioner, not regions)."""
    actions = [a[:3] for a in job.pipeline_actions() or []]
    graphs = _graphs(job, actions)
    calls = [n for gm in graphs for n in _nodes(gm) if n.op == "call_function"]
    return {"held": job.held_bytes(), "actions": actions, "coords": mesh.coords(), "dp_group": mesh.group_name("dp"),
            "group_axes": {mesh.group_name(axis): axis for axis in mesh.spec.sizes if mesh.size(axis) > 1},
            "kernels": None if ops is None else ops.kernels,
            "kernel_sites": sum(1 for n in calls if getattr(n.target, "__module__", "").startswith("meshc.kernels")
                                or n.kwargs.get("fused") is True),
            "collective_matmuls": sum(1 for n in calls if n.target in COLLECTIVE_MATMULS),
            "remat": sum(len(_regions(gm)) for gm in graphs),
            # compiled, remat is the partitioner's: each checkpointed block's nodes marked with its region number
            "remat_marked": len({n.meta["ac_graph_id"] for gm in graphs for n in gm.graph.nodes
                                 if "ac_graph_id" in n.meta}),
            "inductor": dataclasses.asdict(job.inductor.stats),  # graphs Inductor compiled (forward, backward), ...
            "zero_stats": dataclasses.asdict(job.zero_stats),  # the last step's ZeRO context (gathers run as FX code)
            "local_shapes": {fqn: tuple(p.shape) for fqn, p in job.named_parameters()}}


def held_share(ran: dict, model: torch.nn.Module) -> float:
    """The elements this rank holds (its local shapes) over those of the whole parameters they belong to: about
    1/dp under ZeRO's shards, about 1/tp of the blocks under tp, 1 when nothing of its own is split."""
    full = {n: p.numel() for n, p in model.named_parameters()}
    return sum(math.prod(s) for s in ran["local_shapes"].values()) / sum(full[n] for n in ran["local_shapes"])


def assert_gathers_recomputed(where: str, ran: dict, model: torch.nn.Module, dp: int) -> None:
    """ZeRO-3 compiled: the rank holds 1/dp of its parameters; no forward graph saves gathered parameters for
    backward but the bucket kept on purpose (Plan.zero_keep_last, one per stage), and the backward graphs gather
    again (how many gathers Inductor's schedule holds at once: tests/models/test_inductor_parity.py)."""
    assert held_share(ran, model) <= 1.05 / dp, f"{where}: holds {held_share(ran, model):.2f}"
    stats, group = ran["inductor"], ran["dp_group"]
    saved = [graph.get(group, 0) for graph in stats["saved_gathered"]]
    assert saved and all(n <= 1 for n in saved), f"{where}: gathered parameters saved for backward: {saved}"
    regathers = [c for kind, calls in stats["collectives"] if kind == "backward" for c in calls
                 if c == f"all_gather_into_tensor({group})"]
    assert regathers, f"{where}: no bucket gathered again in backward: {stats['collectives']}"


def expected_actions(name: str, pp: int, microbatches: int, virtual: int | None, coord: int) -> list[tuple]:
    """(kind, stage, micro-batch) of the compute actions the named schedule gives pp rank `coord`, in order; none
    where a job runs no pipeline (one stage, one micro-batch). `virtual` None: the schedule's own."""
    sched = named_schedule(name, pp, microbatches, virtual)
    if sched.num_stages == 1 and microbatches == 1:
        return []
    return [(a.kind, a.stage, a.microbatch) for a in sched.actions[coord]]
