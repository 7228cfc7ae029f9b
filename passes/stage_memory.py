"""The memory a pipeline stage's rank holds, predicted for pipeline_split, so that the split it chooses fits.

Per stage s spanning order[a:b] of the forward graph, on the pp rank the schedule gives it:

    states       the local bytes of every parameter the stage reads, times what training keeps per parameter
                 byte under the plan's ZeRO stage over dp (fp32 AdamW: the parameter, its gradient and two
                 states, 4x; ZeRO-1 shards the states, 2 + 2/dp; ZeRO-2 the gradients too, 1 + 3/dp; ZeRO-3
                 everything, 4/dp);
    activations  the bytes of the values the stage computes (views excluded), what backward may keep, per
                 micro-batch (remat="full": only what crosses between its blocks; "selective": half), times the
                 micro-batches the schedule holds in flight on that rank at its peak (schedule_sim.simulate:
                 1F1B holds pp - r on rank r, GPipe all of them).

A rank with several stages (virtual, V schedules) shares its peak between them: each stage is held to the budget
over its rank's stage count. The budget is the hardware profile's memory per device (Program.hardware, set by the
compiler); None leaves the split to time alone. Approximate on purpose: it orders splits the way memory does, and
`explain()` prints each stage's prediction beside its time.
"""
from __future__ import annotations

from bisect import bisect_left

import torch.fx as fx

from meshc.compiler.ir.fx_ops import is_view, val_nbytes
from meshc.compiler.ir.named_schedule import unchecked
from meshc.compiler.ir.program import Program
from meshc.compiler.ir.schedule_sim import simulate

from meshc.passes.blocks import block_of


def state_factor(zero: int, dp: int) -> float:
    """Bytes training keeps per byte of a parameter's local shard (fp32 AdamW), under ZeRO `zero` over dp."""
    return {0: 4.0, 1: 2.0 + 2.0 / dp, 2: 1.0 + 3.0 / dp}.get(zero, 4.0 / dp)


def budget(program: Program) -> float | None:
    """Bytes each stage's rank may hold: the profile's device memory (None: no profile, no bound)."""
    hw = program.hardware
    return float(hw.memory) if hw is not None and getattr(hw, "memory", None) else None


class StageMemory:
    """Predicted bytes of a stage over any span of the forward order (module docstring)."""

    def __init__(self, program: Program, order: list[fx.Node], crossing: list[int], stages: int):
        plan, mesh = program.plan, program.mesh
        factor = state_factor(plan.zero, mesh.size("dp"))
        self.position = {n: i for i, n in enumerate(order)}
        uses: dict[str, list[int]] = {}
        for i, node in enumerate(order):
            for a in node.all_input_nodes:
                if a.op == "placeholder" and a.meta.get("meshc.role") == "param":
                    uses.setdefault(a.meta["meshc.fqn"], []).append(i)
        self.state = [0.0] * (len(order) + 1)  # prefix sums of the parameters read at one position only
        self.shared = []  # (sorted positions, bytes) of parameters read at several (a tied embedding and head)
        for fqn, where in uses.items():
            held = program.params[fqn].local_bytes(mesh.sizes) * factor
            if len(set(where)) == 1:
                self.state[where[0] + 1] += held
            else:
                self.shared.append((sorted(set(where)), held))
        for i in range(len(order)):
            self.state[i + 1] += self.state[i]
        acts = [0.0] * (len(order) + 1)
        for i, node in enumerate(order):
            saved = val_nbytes(node) if not is_view(node.target) else 0
            if plan.remat == "full":  # only the residual stream between blocks is kept
                saved = crossing[i] if i + 1 < len(order) and block_of(order[i + 1]) != block_of(node) else 0
            elif plan.remat == "selective":
                saved /= 2
            acts[i + 1] = acts[i] + saved
        self.acts = acts
        sched = unchecked(plan.schedule, mesh.size("pp"), plan.microbatches, plan.virtual)
        peak = simulate(sched).peak_in_flight
        self.per_rank = [len(sched.stages_of(sched.rank_of(s))) for s in range(stages)]
        self.in_flight = [peak[sched.rank_of(s)] / self.per_rank[s] for s in range(stages)]

    def of(self, stage: int, a: int, b: int) -> float:
        """Bytes stage `stage` holds if it runs order[a:b]."""
        held = self.state[b] - self.state[a]
        for where, nbytes in self.shared:
            k = bisect_left(where, a)
            if k < len(where) and where[k] < b:
                held += nbytes
        return held + (self.acts[b] - self.acts[a]) * self.in_flight[stage]

    def limit(self, stage: int, total: float) -> float:
        """The share of a rank's budget `total` one of its stages may hold."""
        return total / self.per_rank[stage]
