"""Where an LM head's logits go: into a plain cross-entropy (which can run vocabulary-parallel) or out of the graph.

The cost model's vocabulary decision (compiler/cost/vocab.py) and the tp placement pass (passes/tp_placement.py,
which shards the heads it finds) ask the same question of a matmul over the vocabulary; the tp rule of the loss
(passes/tp_vocab.py) asks whether a cross-entropy is one the vocabulary-parallel loss computes.
"""
from __future__ import annotations

import torch
import torch.fx as fx

aten = torch.ops.aten

# ops the logits pass through on their way to the loss or the output, keeping their vocabulary dim
LOGIT_VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.contiguous.default,
               aten.clone.default, aten._to_copy.default, aten.to.dtype, aten.to.dtype_layout, aten.slice.Tensor,
               aten.flatten.using_ints}
_CHECKS = {aten._assert_tensor_metadata.default}  # export's checks of a value: read nothing into the result


def logits_end(node: fx.Node, pointwise: bool = False) -> str | None:
    """Where the output of a matmul over the vocabulary goes, through views, casts and slices (and pointwise ops, a
    logit scale or softcap, with `pointwise`): "loss" (only into plain cross-entropies, which run vocabulary-parallel),
    "output" (returned, at least in part), None (something else reads it: not an LM head's logits)."""
    todo, seen, ends = [node], set(), set()
    while todo:
        cur = todo.pop()
        for user in cur.users:
            if user in seen:
                continue
            seen.add(user)
            if user.target in LOGIT_VIEWS or pointwise and torch.Tag.pointwise in getattr(user.target, "tags", ()):
                todo.append(user)
            elif user.target in _CHECKS:
                continue
            elif user.op == "output":
                ends.add("output")
            elif user.target == aten.cross_entropy_loss.default and plain_cross_entropy(user):
                ends.add("loss")
            else:
                return None
    return ("output" if "output" in ends else "loss") if ends else None


def plain_cross_entropy(loss: fx.Node) -> bool:
    """A cross-entropy the vocabulary-parallel loss computes: 2-D logits, no class weights, no label smoothing."""
    weight = loss.args[2] if len(loss.args) > 2 else loss.kwargs.get("weight")
    smoothing = loss.args[5] if len(loss.args) > 5 else loss.kwargs.get("label_smoothing", 0.0)
    shape = loss.args[0].meta.get("meshc.shape")
    if shape is None and isinstance(loss.args[0].meta.get("val"), torch.Tensor):
        shape = loss.args[0].meta["val"].shape
    return weight is None and not smoothing and shape is not None and len(shape) == 2
