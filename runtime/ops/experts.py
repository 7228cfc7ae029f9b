"""Expert parallelism's dispatch and combine: what the graph nodes inserted by passes/experts.py call.

Rows arrive sorted by global expert id, `offsets` the running count per expert (the grouped matmul's own
argument). Rank i of the ep group owns experts [i·E/ep, (i+1)·E/ep), so the rows for each rank are one
contiguous run. `dispatch` exchanges the per-expert counts, then the rows (`all_to_all_single` with
those split sizes: dropless, no capacity factor), and reorders what it received from (source rank, local
expert) to (local expert, source rank), the layout a grouped matmul over the local experts needs.
`combine` is its inverse. Both are autograd-aware: the backward of one is the other's exchange.

On fake tensors (compile-time shape propagation) the row count of the balanced case is assumed: a rank
receives as many rows as it sends, which is also what the cost model counts.
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator

import torch

from meshc.compiler.ir import torch_compat as compat


class RoutingLog:
    """Rows each local expert received, per expert layer, over the forwards of one step (load balance)."""

    def __init__(self) -> None:
        self.rows: dict[int, torch.Tensor] = {}  # layer -> (E/ep,) rows

    def add(self, layer: int, rows: torch.Tensor) -> None:
        rows = rows.detach().to("cpu", torch.int64)
        self.rows[layer] = self.rows[layer] + rows if layer in self.rows else rows

    def lines(self, ep_index: int) -> list[str]:
        """One line per layer: rows per local expert (global expert ids) and the busiest against the mean."""
        out = []
        for layer, rows in sorted(self.rows.items()):
            first_expert = ep_index * len(rows)
            total = int(rows.sum())
            each = ", ".join(f"{first_expert + i}: {int(n)}" for i, n in enumerate(rows))
            share = f"; busiest {int(rows.max()) / max(total / len(rows), 1e-9):.2f}x the mean" if total else ""
            out.append(f"expert layer {layer}: {total} rows here (expert: rows) {each}{share}")
        return out


_LOG: contextvars.ContextVar[RoutingLog | None] = contextvars.ContextVar("meshc_routing_log", default=None)


@contextlib.contextmanager
def recording(log: RoutingLog) -> Iterator[RoutingLog]:
    """Count the rows every dispatch of this step delivers to the local experts into `log`."""
    token = _LOG.set(log)
    try:
        yield log
    finally:
        _LOG.reset(token)


class _Exchange(torch.autograd.Function):
    """Rows exchanged over the group; backward sends the gradients back the way the rows came."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list, in_splits: list, group: str):
        ctx.out_splits, ctx.in_splits, ctx.group = out_splits, in_splits, group
        return compat.all_to_all_single(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return compat.all_to_all_single(grad, ctx.in_splits, ctx.out_splits, ctx.group), None, None, None


def _counts(offsets: torch.Tensor) -> torch.Tensor:
    """Rows per expert from the running counts: (E,) int64."""
    ends = offsets.to(torch.int64)
    return ends - torch.cat([ends.new_zeros(1), ends[:-1]])


def _regroup(received: torch.Tensor) -> torch.Tensor:
    """The order that turns rows laid out (source, local expert) into (local expert, source).

    `received[s, e]` rows came from source s for local expert e."""
    flat = received.reshape(-1)
    starts = (torch.cumsum(flat, 0) - flat).view_as(received)
    by_expert = received.t().reshape(-1)  # (local expert, source) order
    first = starts.t().reshape(-1)
    total = int(flat.sum())
    run_start = torch.cumsum(by_expert, 0) - by_expert
    within = torch.arange(total, device=received.device) - torch.repeat_interleave(run_start, by_expert)
    return torch.repeat_interleave(first, by_expert) + within


def dispatch(x: torch.Tensor, offsets: torch.Tensor, *, group: str, size: int, layer: int = 0):
    """(rows for this rank's experts, their running counts per local expert, the counts received (ep, E/ep)).

    x: (S, H) rows sorted by global expert; offsets: (E,) running counts, E divisible by `size`; `layer` names
    the expert layer in the routing log (explain()'s load balance)."""
    experts = offsets.shape[0]
    local = experts // size
    if compat.is_fake(x):
        return (x.new_empty(x.shape), offsets.new_empty(local),
                offsets.new_empty((size, local), dtype=torch.int64))
    sent = _counts(offsets).view(size, local)  # (destination, its local expert)
    received = compat.all_to_all_single(sent.reshape(-1), [local] * size, [local] * size, group).view(size, local)
    rows = _Exchange.apply(x, received.sum(1).tolist(), sent.sum(1).tolist(), group)  # (R, H) by (source, expert)
    ordered = rows[_regroup(received)]
    local_offsets = torch.cumsum(received.sum(0), 0).to(offsets.dtype)
    log = _LOG.get()
    if log is not None and not compat.in_backward():  # a recompute under remat is not another forward
        log.add(layer, received.sum(0))
    return ordered, local_offsets, received


def sort_rows(rows: torch.Tensor, ids: torch.Tensor, *, experts: int):
    """The gathered form made grouped: (rows sorted by expert id, running counts per expert (E,), the order).
    rows: (S, ...) with one expert id each (ids: (S,) integers in [0, E))."""
    order = torch.argsort(ids, stable=True)
    counts = torch.zeros(experts, dtype=torch.int64, device=ids.device).index_add_(0, ids, torch.ones_like(ids))
    return rows[order], torch.cumsum(counts, 0), order


def even_offsets(rows: torch.Tensor, *, experts: int) -> torch.Tensor:
    """Running counts of rows that come T for each expert in expert order (the dense form, rows (E·T, H))."""
    return torch.arange(1, experts + 1, device=rows.device) * (rows.shape[0] // experts)


def local_ids(rows: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Each row's local expert (0 .. E/ep-1) after dispatch, from the local running counts (rows come grouped)."""
    if compat.is_fake(rows):
        return offsets.new_empty(rows.shape[0], dtype=torch.int64)
    counts = _counts(offsets)
    return torch.repeat_interleave(torch.arange(counts.numel(), device=rows.device), counts, output_size=rows.shape[0])


def unsort_rows(rows: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """sort_rows undone: row i of the result is the row that `order` moved away from i."""
    back = torch.empty_like(order)
    back[order] = torch.arange(order.numel(), device=order.device)
    return rows[back]


def combine(y: torch.Tensor, received: torch.Tensor, offsets: torch.Tensor, *, group: str, size: int) -> torch.Tensor:
    """The rows `dispatch` took away, computed, sent back to where they came from, in their original order.

    y: (R, H) in dispatch's output order; received: dispatch's counts; offsets: the original running counts."""
    if compat.is_fake(y):
        return y.new_empty(y.shape)  # balanced: as many rows come back as went out
    by_source = unsort_rows(y, _regroup(received))  # (source, local expert) order again
    sent = _counts(offsets).view(size, -1).sum(1)
    return _Exchange.apply(by_source, sent.tolist(), received.sum(1).tolist(), group)
