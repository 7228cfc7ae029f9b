"""ShardedParam: a module parameter whose rank holds only its local shard, for the torch.compile door.

Under `torch.compile(model, backend=meshc.backend(...))` the model's own parameters are what
TorchDynamo traces and what the user's optimizer updates. meshc shards each in place: the original
Parameter (which the optimizer holds) keeps only this rank's shard, and the module's attribute becomes a
ShardedParam around it, which keeps presenting the global shape:

  * while TorchDynamo traces (fake tensors), any op on it computes as if on the whole tensor, so the
    model's own code (views to heads, ...) traces unchanged and meshc's passes see global shapes;
  * at run time the compiled graph takes its local shard (`local(p)`: the original Parameter, so the
    gradient lands where the optimizer looks);
  * eagerly, elementwise ops (what optimizers do: mul_, lerp_, addcdiv_, zeros_like, ...) apply to the
    local shards; anything else raises, saying to run the model through the compiled module.

It carries only a local tensor and meshc's ParamSpec: no DTensor at run time (DESIGN.md §4).
"""
from __future__ import annotations

import torch

from meshc.compiler.ir import torch_compat as compat
from meshc.compiler.ir.errors import MeshcRuntimeError
from meshc.compiler.ir.program import ParamSpec

aten = torch.ops.aten
_VIEWS_OF_SELF = {aten.detach.default, aten.alias.default}


class ShardedParam(torch.Tensor):
    _local: torch.Tensor
    _spec: ParamSpec

    @staticmethod
    def __new__(cls, local: torch.Tensor, spec: ParamSpec, requires_grad: bool = False):
        out = compat.make_wrapper_subclass(cls, spec.shape, dtype=local.dtype, device=local.device,
                                           requires_grad=requires_grad)
        out._local = local
        out._spec = spec
        return out

    __torch_function__ = compat.disabled_torch_function

    def __repr__(self) -> str:
        return f"ShardedParam({self._spec.fqn}, global {tuple(self.shape)}, local {tuple(self._local.shape)})"

    def __tensor_flatten__(self):
        return ["_local"], self._spec

    @staticmethod
    def __tensor_unflatten__(inner, spec, outer_size, outer_stride):
        return ShardedParam(inner["_local"], spec)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        params = [a for a in compat.tree_flatten((args, kwargs))[0] if isinstance(a, ShardedParam)]
        if any(compat.is_fake(p._local) for p in params):  # being traced: behave as the whole tensor
            if func in _VIEWS_OF_SELF:
                return ShardedParam(func(args[0]._local), args[0]._spec)
            mode = next(p._local.fake_mode for p in params if compat.is_fake(p._local))
            with mode:
                whole = {id(p): torch.empty(p.shape, dtype=p.dtype, device=p._local.device) for p in params}
            swapped = compat.tree_map(lambda a: whole[id(a)] if isinstance(a, ShardedParam) else a, (args, kwargs))
            return func(*swapped[0], **swapped[1])
        if not _elementwise(func):
            raise MeshcRuntimeError(f"{func}: {params[0]._spec.fqn} is sharded by meshc (only its local shard is here); "
                               "run the model through the module torch.compile returned, not eagerly")
        spec = params[0]._spec
        unwrapped = compat.tree_map(lambda a: a._local if isinstance(a, ShardedParam) else a, (args, kwargs))
        out = func(*unwrapped[0], **unwrapped[1])
        if compat.op_is_mutable(func) or func.name().endswith("_"):  # in place: the (wrapped) inputs changed
            return args[0]
        return compat.tree_map(lambda t: ShardedParam(t, spec) if isinstance(t, torch.Tensor)
                               and t.shape == spec_local(params[0]) else t, out)


def spec_local(p: ShardedParam) -> torch.Size:
    return p._local.shape


def _elementwise(func) -> bool:
    if torch.Tag.pointwise in func.tags:
        return True
    name = func.name()
    return any(name.startswith(f"aten::{op}") for op in (
        "zeros_like", "empty_like", "ones_like", "full_like", "copy_", "clone", "detach", "alias", "lerp",
        "addcmul", "addcdiv", "_foreach_", "zero_", "fill_", "_to_copy", "mul", "add", "sub", "div", "sqrt",
        "maximum", "neg", "sign", "abs"))


def local(p: torch.Tensor) -> torch.Tensor:
    """The tensor this rank computes with: a ShardedParam's local shard (the original Parameter, which the
    optimizer holds: gradients land on it), else `p` itself."""
    return p._local if isinstance(p, ShardedParam) else p
