"""Local values after a pass changed layouts: every node's "val" recomputed on fake tensors, and every view made valid.

A pass that shards a value (tensor_parallel, context, experts, fuse_comm) changes the shapes and strides of what
follows it. A `view` the trace recorded may be valid only at the traced layout: `out.transpose(1, 2).contiguous()
.view(bs, seqlen, -1)` records no copy where the transposed tensor happened to be contiguous, and after the heads
are split over tp it no longer is. `refresh_vals` propagates the local values node by node; a view that cannot
view its input's new layout becomes a reshape (the same values; a copy only where the layout needs one), unless
something writes through the view in place (a reshape's copy would drop the write): that is an error naming the
node and the model's line, with what to write instead. No pass can then leave a graph that fails later on a
layout.
"""
from __future__ import annotations

import torch
import torch.fx as fx
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from meshc.compiler.ir import torch_compat as compat
from meshc.compiler.ir.errors import MeshcValueError
from meshc.compiler.ir.fx_ops import model_source
from meshc.compiler.ir.program import Program

aten = torch.ops.aten


def refresh_vals(program: Program) -> None:
    """Recompute every node's "val" with local shapes (fake tensors), as the rank will see them; views made valid."""
    mode = compat.fake_tensor_mode(like=program.gm)
    sizes = program.mesh.sizes
    args = []
    with mode:
        for node in program.placeholders():
            spec = program.params.get(node.meta.get("meshc.fqn")) or program.buffers.get(node.meta.get("meshc.fqn"))
            val = node.meta.get("val")
            if spec is not None:
                args.append(torch.empty(spec.local_shape(sizes, program.local_axes), dtype=val.dtype, device=val.device))
            elif isinstance(val, torch.Tensor):
                args.append(torch.empty(val.shape, dtype=val.dtype, device=val.device))
            else:
                args.append(val)
    prop = _LayoutSafe(program.gm, mode)
    prop.propagate_dont_convert_inputs(*args)
    if prop.reshaped:
        program.gm.recompile()
        program.notes.append(f"{len(prop.reshaped)} view(s) made reshapes, their input no longer viewable at the local "
                             f"layout: {', '.join('%' + n.name for n in prop.reshaped[:4])}")


class _LayoutSafe(FakeTensorProp):
    def __init__(self, gm: fx.GraphModule, mode):
        super().__init__(gm, mode)
        self.reshaped: list[fx.Node] = []

    def run_node(self, n: fx.Node):
        if n.op == "call_function" and n.target is aten.view.default and not _viewable(self.env[n.args[0]], n.args[1]):
            written = _written_through(n)
            if written is not None:
                raise MeshcValueError(
                    f"layout: expected a view whose input can still be viewed after sharding, got {n.format_node()} on "
                    f"a {tuple(self.env[n.args[0]].shape)} input of strides {self.env[n.args[0]].stride()}, which "
                    f"{written.format_node()} then writes in place (a copy would lose that write); model source: "
                    f"{model_source(n) or '(no stack trace)'}. Write .reshape() or make the input .contiguous() before the view there, or keep that "
                    "module replicated (Plan(tp={'<module glob>': 'replicate'}))")
            n.target = aten.reshape.default
            n.meta["meshc.why"] = "a view of a value whose local layout it cannot view: a reshape"
            self.reshaped.append(n)
        return super().run_node(n)


def _viewable(value, shape) -> bool:
    if not isinstance(value, torch.Tensor):
        return True
    probe = torch.empty_strided(tuple(value.shape), tuple(value.stride()), dtype=value.dtype, device="meta")
    try:
        probe.view(shape)
    except (RuntimeError, ValueError):  # eager's error, and the fake tensor's under a FakeTensorMode
        return False
    return True


def _written_through(node: fx.Node) -> fx.Node | None:
    """A node that writes in place to `node`'s value or a view of it, if any."""
    todo, seen = [node], set()
    while todo:
        current = todo.pop()
        for user in current.users:
            if user in seen or user.op != "call_function" or not compat.is_op_overload(user.target):
                continue
            seen.add(user)
            if compat.op_is_mutable(user.target):
                return user
            if compat.op_returns_view(user.target):
                todo.append(user)
    return None
