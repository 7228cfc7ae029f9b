"""CommCensus: count the collectives a rank really runs, and their bytes, by mesh axis.

    with CommCensus(mesh) as census:
        job.step(x, y, loss_fn)
    census.by_kind()   # {("all_reduce", "dp"): (calls, bytes)}

It intercepts torch's functional collectives (the ops meshc's graphs and runtime call) at dispatch,
in forward and backward alike, and records each call's payload: the tensor this rank contributes.
Tests and benchmarks compare it with the compile-time census of `job.explain()`.
"""
from __future__ import annotations

from collections import defaultdict

from meshc.compiler.ir import torch_compat as compat

_KINDS = {
    "all_reduce": "all_reduce", "all_reduce_": "all_reduce",
    "all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter",
    "all_to_all_single": "all_to_all", "broadcast": "broadcast", "broadcast_": "broadcast",
}


class CommCensus(compat.dispatch_mode_base()):
    def __init__(self, mesh):
        super().__init__()
        self.axis_of = mesh.axis_of_groups()
        self.calls: list[tuple[str, str, int]] = []  # (kind, axis, bytes)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "_c10d_functional" and compat.op_name(func) in _KINDS:
            tensor = args[0]
            group = args[-1] if isinstance(args[-1], str) else kwargs.get("group_name")
            self.calls.append((_KINDS[compat.op_name(func)], self.axis_of.get(group, str(group)),
                               tensor.numel() * tensor.element_size()))
        return func(*args, **kwargs)

    def by_kind(self) -> dict[tuple[str, str], tuple[int, int]]:
        """(kind, axis) -> (number of calls, total bytes)."""
        out: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])
        for kind, axis, nbytes in self.calls:
            out[(kind, axis)][0] += 1
            out[(kind, axis)][1] += nbytes
        return {k: (v[0], v[1]) for k, v in out.items()}
