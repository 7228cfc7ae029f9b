"""Where a parameter lives in its model, found from the tensor itself (the torch.compile door).

TorchDynamo names a graph's parameter inputs by the source it read them from; after a graph break inside a
submodule's forward, that source starts at the submodule (`self.feed_forward.w1.weight`), not at the model.
meshc keys placements by the model's FQNs, so the backend finds them from the objects instead: the modules
alive in this process that hold the parameter, their parents, up to the module that has none.
"""
from __future__ import annotations

import gc

import torch

from meshc.compiler.ir import torch_compat as compat


def owners(params: list[torch.Tensor]) -> dict[int, list[tuple[torch.nn.Module, str]]]:
    """id(param) -> the modules (and attribute names) that hold it (several for tied weights), for each of
    `params`, in one pass over the live modules."""
    wanted = {id(p) for p in params}
    out: dict[int, list] = {i: [] for i in wanted}
    for module in _modules():
        for name, p in compat.own_parameters(module).items():
            if id(p) in wanted:
                out[id(p)].append((module, name))
    return out


def model_fqns(tensor: torch.Tensor) -> dict[int, tuple[torch.Tensor, str]]:
    """id -> (tensor, FQN) for every parameter and buffer of the model that holds `tensor` (tied weights: the
    first name, as torch.export and state_dict give); {} when no module holds it. A torch.compile wrapper's
    `_orig_mod.` is not part of a name."""
    modules = _modules()
    parent = {id(child): module for module in modules for child in compat.child_modules(module)}
    holders = [m for m in modules
               if any(t is tensor for t in (*compat.own_parameters(m).values(), *compat.own_buffers(m).values()))]
    if not holders:
        return {}
    root = holders[0]
    while id(root) in parent:
        root = parent[id(root)]
    out: dict[int, tuple[torch.Tensor, str]] = {}
    named = [*root.named_parameters(remove_duplicate=False), *root.named_buffers(remove_duplicate=False)]
    for fqn, t in named:
        out.setdefault(id(t), (t, fqn.replace("_orig_mod.", "")))
    return out


def _modules() -> list[torch.nn.Module]:
    found = []
    for obj in gc.get_objects():
        if issubclass(type(obj), torch.nn.Module):  # type(): isinstance would touch proxies and deprecated aliases
            found.append(obj)
    return found
