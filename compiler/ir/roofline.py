"""One node's cost in the roofline terms that the cost model (compiler/cost/compiled.py) and the pipeline split
(passes/pipeline_split.py) share, so that stages are balanced by the time the estimate predicts for them.

    node_flops(node)        forward FLOPs from the shapes in "val" metadata (no dispatch)
    is_compute(node)        whether the node runs a kernel (not a view, getitem or collective)
    node_cost(node)         (FLOPs, bytes read and written, ops) of one node, zeros where it runs no kernel
    Rates.forward_seconds   one forward of ops with those totals on a device: FLOPs at the compute rate, bytes at
                            the memory bandwidth, a third of each op's overhead (measured forward and backward),
                            all at the profile's compute scale (compiler/cost/hardware.Hardware.rates)
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass

import torch.fx as fx
from torch.utils.flop_counter import flop_registry

from meshc.compiler.ir.fx_ops import grouped_mm_args, is_grouped_mm, is_view, op_short_name, val_nbytes
from meshc.compiler.ir import torch_compat as compat

COMPUTE_WITH_COMM = {"context_attention"}  # ops that compute and communicate (their traffic in "meshc.comm")


@dataclass(frozen=True)
class Rates:
    """A device's rates for the roofline, and the pipeline link's bandwidth (what the split balances stages by)."""

    flops: float
    mem_bandwidth: float
    op_overhead: float = 0.0
    compute_scale: float = 1.0
    send_bandwidth: float = float("inf")  # bytes/s of a pipeline send

    def forward_seconds(self, flops: float, nbytes: float, ops: int) -> float:
        return (flops / self.flops + nbytes / self.mem_bandwidth + ops * self.op_overhead / 3) * self.compute_scale


def node_cost(node: fx.Node) -> tuple[float, float, int]:
    """(forward FLOPs, bytes read and written, ops) of one node; zeros for what runs no kernel."""
    if not is_compute(node):
        return 0.0, 0.0, 0
    return node_flops(node), float(sum(val_nbytes(a) for a in node.all_input_nodes) + val_nbytes(node)), 1


def _arg_val(x):
    return x.meta.get("val") if isinstance(x, fx.Node) else x


def node_flops(node: fx.Node) -> float:
    """Forward FLOPs of one node, from the shapes in its inputs' "val" metadata (no dispatch: microseconds).

    matmuls as 2·M·K·N (torch.utils.flop_counter's formulas), aten.linear, scaled-dot-product attention
    (4·B·H·T·S·D, causal masking not discounted, as FlopCounterMode), grouped expert matmuls; other ops 0.
    """
    return float(compat.number_bound(_flops(node)))  # rows known only at run time counted at their bound


def _flops(node: fx.Node):
    if node.op != "call_function":
        return 0.0
    target, name = node.target, op_short_name(node.target)
    args, kwargs = fx.node.map_arg((node.args, node.kwargs), _arg_val)
    try:
        if name == "linear":
            x, w = args[0], args[1]
            return 2.0 * math.prod(x.shape[:-1]) * w.shape[0] * w.shape[1]
        if name in ("scaled_dot_product_attention", "context_attention"):  # context: keys of all cp ranks
            q, key, value = args[:3]
            keys = key.shape[-2] * (int(kwargs.get("size", 1)) if name == "context_attention" else 1)
            return 2.0 * math.prod(q.shape[:-1]) * keys * (q.shape[-1] + value.shape[-1])
        if is_grouped_mm(node):  # every row meets one expert's (K, N) matrix (batched form: 3-D rows)
            rows, weight = (a.meta["val"] for a in grouped_mm_args(node)[:2])
            return 2.0 * math.prod(rows.shape[:-1]) * weight.shape[-2] * weight.shape[-1]
        if name == "matmul":
            x, w = args[0], args[1]
            return 2.0 * math.prod(x.shape) * w.shape[-1]
        formula = flop_registry.get(getattr(target, "overloadpacket", None))
        if formula is not None:
            return float(formula(*args, out_val=node.meta.get("val"), **kwargs))
    except (AttributeError, IndexError, TypeError, ValueError, AssertionError):
        return 0.0
    return 0.0


def is_compute(node: fx.Node) -> bool:
    """An op that runs a kernel (not a view, a getitem or a collective, whose cost is the link's)."""
    if node.op == "call_module":
        return False
    if node.op != "call_function" or node.target is operator.getitem:
        return False
    name = op_short_name(node.target)
    return not is_view(node.target) and ("meshc.comm" not in node.meta or name in COMPUTE_WITH_COMM) \
        and "wait_tensor" != name
