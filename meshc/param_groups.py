"""Optimizer parameter groups over a job's local shards, named by the model's own parameter names.

    decay = [n for n, p in model.named_parameters() if p.dim() >= 2]
    rest = [n for n, p in model.named_parameters() if p.dim() < 2]
    opt = job.optimizer(torch.optim.AdamW, [{"params": decay, "weight_decay": 0.1},
                                            {"params": rest, "weight_decay": 0.0}], lr=3e-4)

Names, not the local tensors, are what a group should select by: a rank's local parameter is a shard whose shape
says little of the parameter's (ZeRO's shards are flat, 1-D), so a filter such as `p.dim() < 2` over
`job.named_parameters()` would put every weight in the no-decay group. A name held by another pipeline stage is
left out of this rank's groups (each group is kept, perhaps empty, so that every rank has the same groups and
checkpoints load across plans); a name the model does not have is an error.
"""
from __future__ import annotations

from typing import Any, Iterable

import torch

from meshc.compiler.ir.errors import MeshcValueError


def resolve(groups: Iterable[Any], local: dict[str, torch.Tensor], state_keys: dict[str, str],
            model_params: set[str]) -> list[dict]:
    """`groups` (torch's forms: dicts with "params", or one flat list) -> dicts whose "params" are this rank's
    local parameters. An entry is a parameter name (any of the model's names for it: tied aliases too) or one
    of the job's own local parameters. `local`: canonical FQN -> local parameter; `state_keys`: the model's
    state_dict key -> canonical FQN; `model_params`: every parameter name of the model, on any rank."""
    groups = list(groups)
    if not groups:
        raise MeshcValueError("job.optimizer: expected at least one parameter group, got an empty list; "
                              "leave `params` out to optimize every parameter")
    if not isinstance(groups[0], dict):
        groups = [{"params": groups}]
    by_id = {id(p): p for p in local.values()}
    out, seen = [], {}
    for i, group in enumerate(groups):
        if not isinstance(group, dict) or "params" not in group:
            raise MeshcValueError(f"job.optimizer: expected parameter group {i} to be a dict with 'params', got "
                                  f"{type(group).__name__}; write groups as torch does: [{{'params': [...], ...}}]")
        entries = [group["params"]] if isinstance(group["params"], (str, torch.Tensor)) else list(group["params"])
        params = []
        for entry in entries:
            p = _local(entry, i, local, by_id, state_keys, model_params)
            if p is None:  # held by another pipeline stage
                continue
            if id(p) in seen:
                raise MeshcValueError(f"job.optimizer: parameter {_name(entry)} is in groups {seen[id(p)]} and {i}; "
                                      "put each parameter in one group")
            seen[id(p)] = i
            params.append(p)
        out.append({**group, "params": params})
    return out


def _local(entry: Any, i: int, local: dict, by_id: dict, state_keys: dict, model_params: set):
    if isinstance(entry, torch.Tensor):
        if id(entry) not in by_id:
            raise MeshcValueError(
                f"job.optimizer: parameter group {i} holds a tensor of shape {tuple(entry.shape)} that is not one of "
                "the job's local parameters (the model's own parameters are not the ones trained); name it instead: "
                "'params': [name, ...] with the model's parameter names")
        return entry
    if not isinstance(entry, str):
        raise MeshcValueError(f"job.optimizer: parameter group {i} holds a {type(entry).__name__}; expected parameter "
                              "names (str) or the job's local parameters")
    if entry not in model_params:
        raise MeshcValueError(f"job.optimizer: parameter group {i} names {entry!r}, not a parameter of the model; use "
                              "the names of model.named_parameters()")
    return local.get(state_keys.get(entry, entry))


def _name(entry: Any) -> str:
    return repr(entry) if isinstance(entry, str) else f"of shape {tuple(entry.shape)}"
