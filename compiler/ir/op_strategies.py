"""Op strategies from DTensor's registry: the placements an ATen op without a meshc rule can take on one axis.

DTensor registers a sharding strategy for nearly every ATen op (torch.distributed.tensor's op-strategy registry).
At compile time, for an op meshc has no rule of its own for, `decide` asks that registry what the op's inputs
must be and what its output becomes, given the placements its inputs have (a one-dim mesh of the axis' size, no
process group; nothing of DTensor runs at run time: the op runs on the local tensors as they are). The answer is
taken only where meshc can run it: every placement has a meshc form (Shard of one block, Replicate, a partial
sum), and the op run on local-shaped meta tensors gives exactly the local shapes of the output placements (an op
whose arguments hold sizes of the whole tensor would not). Otherwise, and for ops DTensor has no strategy for,
None: the caller replicates and says so.

    decide(node, placements, n) -> (required input placements by arg path, output placement(s)) | None
"""
from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
from torch.distributed.tensor import Partial as DPartial
from torch.distributed.tensor import Replicate as DReplicate
from torch.distributed.tensor import Shard as DShard

from meshc.compiler.ir import torch_compat as compat
from meshc.compiler.ir.placement import P, R, Partial, Replicate, Shard, local_shape
from meshc.compiler.ir.sizes import static_sizes


def decide(node: fx.Node, placements: dict[tuple, Any], n: int) -> tuple[dict[tuple, Any], Any] | None:
    """DTensor's decision for `node` whose tensor inputs (by arg path) have `placements`; None when there is none
    that meshc can run (see the module docstring)."""
    if not compat.is_op_overload(node.target) or not all(_dtensor(p) for p in placements.values()):
        return None
    with compat.real_tensors():  # a compile on fake tensors: the registry's own tensors are real
        return _decide(node, placements, n)


def _decide(node: fx.Node, placements: dict[tuple, Any], n: int) -> tuple[dict[tuple, Any], Any] | None:
    mesh = compat.strategy_mesh(n)
    specs = {path: compat.dtensor_spec(mesh, _dtensor(p), _shape(_arg(node, path)), _arg(node, path).meta["val"].dtype)
             for path, p in placements.items()}
    try:
        found = compat.propagate_sharding(node.target, _with(node.args, specs), _with_kwargs(node.kwargs, specs))
    except Exception:  # a strategy that cannot place these inputs: no decision, the caller replicates
        return None
    if found is None:
        return None
    out_spec, needed = found
    required = {}
    if needed is not None:
        for path, spec in _specs_in(needed[0], needed[1]).items():
            want = _meshc(spec.placements[0])
            if path in placements and want != placements[path]:
                required[path] = want
    out = _out(out_spec)
    if out is None or not _runs_locally(node, {**placements, **required}, out, n):
        return None
    return required, out


def _dtensor(p) -> Any:
    """The torch.distributed.tensor placement of a meshc one, or None where it has none (blocks, Whole, flat)."""
    if isinstance(p, Replicate):
        return DReplicate()
    if isinstance(p, Partial):
        return DPartial("sum")
    if type(p) is Shard and p.chunks == 1:
        return DShard(p.dim)
    return None


def _meshc(p) -> Any:
    if p.is_replicate():
        return R
    if p.is_shard():
        return Shard(p.dim)
    if p.is_partial() and getattr(p, "reduce_op", "sum") == "sum":
        return P
    return None


def _out(spec) -> Any:
    if isinstance(spec, (tuple, list)):
        outs = tuple(R if s is None else _meshc(s.placements[0]) for s in spec)
        return None if any(o is None for o in outs) else outs
    return None if spec is None else _meshc(spec.placements[0])


def _arg(node: fx.Node, path: tuple) -> fx.Node:
    value = node.args[path[0]] if isinstance(path[0], int) else node.kwargs[path[0]]
    return value[path[1]] if len(path) > 1 else value


def _shape(node: fx.Node) -> tuple[int, ...]:
    """DTensor's strategies need every size: a dim known only at run time raises RunTimeSizes (no decision here)."""
    if node.meta.get("meshc.shape") is not None:
        return tuple(int(d) for d in static_sizes(node))
    return tuple(int(d) for d in node.meta["val"].shape)


def _with(args: tuple, specs: dict[tuple, Any]) -> tuple:
    out = []
    for i, a in enumerate(args):
        if isinstance(a, (list, tuple)):
            out.append(type(a)(specs.get((i, j), b) for j, b in enumerate(a)))
        else:
            out.append(specs.get((i,), a))
    return tuple(out)


def _with_kwargs(kwargs: dict, specs: dict[tuple, Any]) -> dict:
    return {k: specs.get((k,), v) for k, v in kwargs.items()}


def _specs_in(args, kwargs) -> dict[tuple, Any]:
    """(arg path -> spec) of the DTensorSpecs in a schema's args and kwargs."""
    out = {}
    for i, a in enumerate(args):
        if isinstance(a, (list, tuple)):
            out.update({(i, j): b for j, b in enumerate(a) if hasattr(b, "placements")})
        elif hasattr(a, "placements"):
            out[(i,)] = a
    out.update({(k,): v for k, v in (kwargs or {}).items() if hasattr(v, "placements")})
    return out


def _local(shape: tuple[int, ...], p, n: int) -> tuple[int, ...] | None:
    """The local shape under `p`, or None where its dim does not divide over the n ranks."""
    return None if isinstance(p, Shard) and shape[p.dim] % n else local_shape(shape, p, n)


def _runs_locally(node: fx.Node, placements: dict[tuple, Any], out, n: int) -> bool:
    """Does the op, run on meta tensors of the inputs' local shapes with its other arguments as they are, give
    the local shapes of `out` (global shapes from "meshc.shape")?"""
    locals_ = {}
    for path, p in placements.items():
        arg = _arg(node, path)
        shape = _local(_shape(arg), p, n)
        if shape is None:
            return False
        locals_[path] = torch.empty(shape, dtype=arg.meta["val"].dtype, device="meta")
    try:
        with torch.no_grad():
            result = node.target(*_with(node.args, locals_), **_with_kwargs(node.kwargs, locals_))
    except Exception:  # no meta kernel, or arguments that do not fit the local shapes
        return False
    results = result if isinstance(result, (tuple, list)) else (result,)
    outs = out if isinstance(out, tuple) else (out,)
    shapes = node.meta.get("meshc.shape")
    shapes = shapes if isinstance(result, (tuple, list)) else (shapes,)
    if shapes is None or len(results) != len(outs) or len(shapes) != len(outs):
        return False
    for value, p, shape in zip(results, outs, shapes):
        if not isinstance(value, torch.Tensor) or shape is None:
            continue
        want = _local(tuple(int(d) for d in shape), p, n)
        if want is None or tuple(value.shape) != want:
            return False
    return True
