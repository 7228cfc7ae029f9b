"""Which user autograd.Functions are elementwise: the fact that lets sharding passes see through them.

A user Function is traced as one opaque `meshc_fn::<Function>_<n>` op (compiler/trace/autograd_functions.py), so
the tensor-parallel rules cannot look inside it. Many such Functions are activations written by hand for
their backward (BLOOM's GeLU): elementwise maps, which commute with any slicing. This module decides that,
per graph node, by tracing the Function's forward *and* backward at the node's shapes (make_fx on meta
tensors, nothing computed) and checking that

- every tensor argument and output has one shape (no broadcasting, no reduction, no reshaping), and
- every op of forward and backward is tagged pointwise by torch, or is a copy/alias/cast or a
  same-shape factory (zeros_like, ...), and every value it makes has that shape or is a 0-dim scalar.

Then applying the Function to a shard is the shard of applying it to the whole, in forward and backward, and
the node may take any one shard placement for all its tensors. Anything else (random numbers, a reduction,
a view, an op that fails on meta tensors) is opaque, with the reason.

    annotate_elementwise(gm)   # node.meta[ELEMENTWISE] = True, or node.meta[OPAQUE] = why
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from meshc.compiler.trace.autograd_functions import function_call, trace_on_meta
from meshc.compiler.ir.program import ELEMENTWISE, OPAQUE

aten = torch.ops.aten
_COPIES = {aten.detach.default, aten.alias.default, aten.clone.default, aten._to_copy.default,
           aten.zeros_like.default, aten.ones_like.default, aten.empty_like.default, aten.full_like.default,
           aten.lift_fresh_copy.default, aten.scalar_tensor.default}


def annotate_elementwise(gm: fx.GraphModule) -> int:
    """Mark every meshc_fn node of `gm` elementwise or opaque (with why); returns how many are elementwise."""
    count = 0
    for node in gm.graph.nodes:
        if node.op != "call_function" or function_call(node.target) is None:
            continue
        why = opaque_reason(node)
        if why is None:
            node.meta[ELEMENTWISE] = True
            count += 1
        else:
            node.meta[OPAQUE] = why
    return count


def opaque_reason(node: fx.Node) -> str | None:
    """None when the Function behind the meshc_fn `node` is elementwise at its shapes, else why not."""
    call = function_call(node.target)
    ins = [a.meta.get("val") for a in node.args[0]]
    outs = list(node.meta.get("val") or [])[:-1]  # the last output is the generator state (not the Function's)
    if not ins or not outs or not all(isinstance(t, torch.Tensor) for t in ins + outs):
        return "its arguments or outputs are not all tensors with known shapes"
    shape = tuple(outs[0].shape)
    if any(tuple(t.shape) != shape for t in ins + outs):
        return "its tensors do not all have one shape"
    try:
        traced = trace_on_meta(call, ins, outs)
    except Exception as e:  # noqa: BLE001 - a Function meta tensors cannot run stays opaque, with the reason
        return f"its forward and backward could not be traced on meta tensors ({type(e).__name__})"
    for n in traced.graph.nodes:
        if n.op != "call_function" or n.target is operator.getitem:
            continue
        if n.target not in _COPIES and torch.Tag.pointwise not in getattr(n.target, "tags", ()):
            return f"its forward or backward calls {n.target}, which is not elementwise"
        val = n.meta.get("val")
        if isinstance(val, torch.Tensor) and val.dim() > 0 and tuple(val.shape) != shape:
            return f"its forward or backward makes a {tuple(val.shape)} value from {shape} tensors ({n.target})"
    return None
