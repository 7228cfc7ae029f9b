"""FX helpers every layer reads graphs with: the name of a node's op, and which ops are views.

    op_name(aten.add.Tensor) == "aten::add.Tensor"     the schema name (messages, markers)
    op_label(aten.view.default) == "aten.view.default"  as torch prints the overload (the driver's census)
    op_short_name(aten.add.Tensor) == "add"             the overload packet (the cost model's op tables)

Python callables (meshc's ops, operator.getitem) are named by `__name__` in all three.

A node's inputs are addressed by path (tensor_args, get_arg, set_arg): (i,) for args[i], (i, j) for the
j-th tensor of a list in args[i], (name,) for kwargs[name].

Two sets of view ops, one inside the other:
    RESHAPE_OPS   view, reshape, _unsafe_view: the same elements in another shape (what the sharding and
                  fusion passes walk through);
    VIEW_NAMES    short names of the ops whose output shares its input's storage (reshapes, transposes,
                  slices, splits...) or that compute nothing (_assert_tensor_metadata): no kernel runs
                  and nothing new is kept for backward (the cost model).
"""
from __future__ import annotations

import os
from typing import Any

import torch
import torch.fx as fx

from meshc.compiler.ir import torch_compat as compat

aten = torch.ops.aten

RESHAPE_OPS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)
VIEW_NAMES = frozenset({
    "view", "_unsafe_view", "reshape", "t", "transpose", "permute", "expand", "slice", "select", "unsqueeze",
    "squeeze", "split", "split_with_sizes", "chunk", "alias", "detach", "_assert_tensor_metadata", "unbind",
    "as_strided", "view_as", "expand_as", "flatten", "unflatten", "movedim", "narrow", "lift_fresh_copy",
    "numpy_T", "mT", "adjoint"})


# Grouped matmuls `(rows (S, K), weight (E, K, N), offsets (E,))`: rows sorted by expert, offsets the running
# count per expert; transformers' CPU/fallback op and torch's own.
GROUPED_MM = frozenset({"transformers::grouped_mm_fallback", "aten::_grouped_mm", "aten::grouped_mm"})


def is_grouped_mm(node: Any) -> bool:
    """A call of a grouped matmul (GROUPED_MM)."""
    return isinstance(node, fx.Node) and node.op == "call_function" and op_name(node.target).split(".")[0] in GROUPED_MM


def grouped_mm_args(node: fx.Node) -> tuple[Any, Any, Any, Any]:
    """(rows, weight, offsets, bias) of a grouped matmul call; offsets None for the batched form (3-D rows)."""
    args, kw = list(node.args) + [None] * (4 - len(node.args)), node.kwargs
    return (args[0], args[1], args[2] if args[2] is not None else kw.get("offs"),
            args[3] if args[3] is not None else kw.get("bias"))


def op_name(target: Any) -> str:
    """The schema name of an ATen or custom op ("aten::add.Tensor"); a Python callable's `__name__`."""
    name = getattr(target, "name", None)
    if callable(name):
        return name()
    return getattr(target, "__name__", None) or str(target)


def op_label(target: Any) -> str:
    """An op overload as torch prints it ("aten.view.default"); a Python callable's `__name__`."""
    if hasattr(target, "_schema"):  # an ATen or custom op overload
        return str(target)
    return getattr(target, "__name__", None) or str(target)


def op_short_name(target: Any) -> str:
    """The overload packet's name of an ATen op ("add" for aten.add.Tensor); a Python callable's `__name__`."""
    packet = getattr(target, "overloadpacket", None)
    if packet is not None:
        return packet.__name__
    return getattr(target, "__name__", str(target))


def is_call(node: Any, *targets: Any) -> bool:
    """Is `node` an fx call_function node of one of `targets`?"""
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in targets


def is_reshape(node: Any) -> bool:
    """A view, reshape or _unsafe_view node (RESHAPE_OPS)."""
    return is_call(node, *RESHAPE_OPS)


def is_model_input(node: Any) -> bool:
    """Is `node` a model input (a placeholder of role "input"), maybe reshaped?"""
    while is_reshape(node):
        node = node.args[0]
    return isinstance(node, fx.Node) and node.op == "placeholder" and node.meta.get("meshc.role") == "input"


def val_nbytes(node: fx.Node) -> int:
    """Bytes of the tensor(s) a node's "val" metadata holds (a tuple's tensors summed; none: 0)."""
    val = node.meta.get("val")
    vals = val if isinstance(val, (tuple, list)) else (val,)
    # a value whose size is known only at run time (rows picked by nonzero) at its trace's bound
    return sum(compat.number_bound(v.numel()) * v.element_size() for v in vals if isinstance(v, torch.Tensor))


def is_view(target: Any) -> bool:
    """An op that runs no kernel of its own: a view of its input, or a metadata assertion (VIEW_NAMES)."""
    return op_short_name(target) in VIEW_NAMES


def is_op_call(node: Any) -> bool:
    """A call of an op overload (ATen or a registered custom op)."""
    return isinstance(node, fx.Node) and node.op == "call_function" and compat.is_op_overload(node.target)


def is_alias(node: Any) -> bool:
    """A view of its input (its result aliases it), not an in-place op (whose result is its written input: later
    reads take that result, so writing into a copy of it is seen)."""
    return is_op_call(node) and compat.op_returns_view(node.target) and not compat.op_is_mutable(node.target)


def written_in_place(value: fx.Node) -> fx.Node | None:
    """An op that writes in place into `value` or a view of it (as its first argument), if any."""
    todo, seen = [value], set()
    while todo:
        current = todo.pop()
        for user in current.users:
            if user in seen or not is_op_call(user):
                continue
            seen.add(user)
            if compat.op_is_mutable(user.target) and user.args and user.args[0] is current:
                return user
            if is_alias(user) and user.args and user.args[0] is current:
                todo.append(user)
    return None


# ---------------------------------------------------------------------------------------- arg paths
def tensor_args(node: fx.Node) -> list[tuple[tuple, fx.Node]]:
    """(path, node) of every tensor-valued input (an input whose "val" is a tensor)."""
    out = []
    for i, a in enumerate(node.args):
        if isinstance(a, fx.Node) and _is_tensor(a):
            out.append(((i,), a))
        elif isinstance(a, (list, tuple)):
            out += [((i, j), b) for j, b in enumerate(a) if isinstance(b, fx.Node) and _is_tensor(b)]
    out += [((k,), v) for k, v in node.kwargs.items() if isinstance(v, fx.Node) and _is_tensor(v)]
    return out


def _is_tensor(node: fx.Node) -> bool:
    return isinstance(node.meta.get("val"), torch.Tensor)


def get_arg(node: fx.Node, path: tuple) -> Any:
    """The input of `node` at `path`."""
    if isinstance(path[0], str):
        return node.kwargs[path[0]]
    value = node.args[path[0]]
    return value[path[1]] if len(path) > 1 else value


def set_arg(node: fx.Node, path: tuple, new: Any) -> None:
    """Replace the input of `node` at `path` by `new`."""
    if isinstance(path[0], str):
        node.update_kwarg(path[0], new)
    elif len(path) == 1:
        node.update_arg(path[0], new)
    else:
        seq = list(node.args[path[0]])
        seq[path[1]] = new
        node.update_arg(path[0], type(node.args[path[0]])(seq))


def model_source(node: fx.Node) -> str:
    """The model's line that made `node` (`File "...", line N, in f: code`), from its stack_trace: the innermost
    frame outside torch (outside torch.nn's layers where the model is torch's own), else the innermost."""
    lines = [line.strip() for line in (node.meta.get("stack_trace") or "").strip().splitlines() if line.strip()]
    frames = [(a, b) for a, b in zip(lines, lines[1:]) if a.startswith("File ") and not b.startswith("File ")]
    if not frames:
        return lines[-1] if lines else ""
    torch_dir = os.path.dirname(os.path.abspath(torch.__file__))
    layers = (os.path.join(torch_dir, "nn") + os.sep, os.path.join(torch_dir, "functional.py"))
    path = lambda frame: frame[0].split('"')[1] if frame[0].count('"') >= 2 else ""
    for keep in (lambda f: not path(f).startswith(torch_dir + os.sep), lambda f: not path(f).startswith(layers)):
        chosen = [f for f in frames if keep(f)]
        if chosen:
            return f"{chosen[-1][0]}: {chosen[-1][1]}"
    return f"{frames[-1][0]}: {frames[-1][1]}"
