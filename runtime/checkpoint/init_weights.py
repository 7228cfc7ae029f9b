"""Initialization one tensor at a time: a model's own init, applied to each parameter alone, seeded per name.

The same procedure runs in one process (meshc.init_weights) and on every rank of a job (job.init_weights),
so the assembled weights are bitwise the same under every plan and mesh size:

    for each parameter (and each buffer left on the meta device), by canonical FQN:
        every other tensor of the model stays on meta (init ops on them cost nothing, draw nothing);
        this one gets a fresh CPU tensor filled with a sentinel (NaN; the lowest integer);
        the RNG is seeded from (seed, FQN);
        the module that holds it under that name and its ancestors, children first as Module.apply goes, run
            1. their own reset_parameters(), as their constructors did (torch's convention, FSDP2's);
            2. the model's _init_weights(module), where the model defines one (Hugging Face's convention;
               the nearest ancestor that defines it: composite models dispatch to each sub-model's own);
        no sentinel may survive: a tensor no initializer wrote is an error naming it, never garbage.

A tied tensor is initialized by the module of its canonical (first) name, as a constructor that ties
`output.weight = embedding.weight` leaves it.

So one full tensor exists at a time; a rank then keeps only its slices (ParamStore.load_full). Buffers
that a constructor computes (rotary inv_freq, position ids) are recomputed where the model's
_init_weights recomputes them (Hugging Face models do, for every buffer they register); a buffer
that no initializer writes is refused by name.
"""
from __future__ import annotations

import hashlib

import torch

from meshc.compiler.ir import torch_compat as compat
from meshc.compiler.ir.errors import MeshcValueError

_SALT = "meshc.init_weights"


class Initializer:
    """Fresh values of a model's tensors by canonical FQN; the model's tensors are put on meta while it lives
    (`restore()` puts them back)."""

    def __init__(self, model: torch.nn.Module, seed: int):
        self.model, self.seed = model, int(seed)
        self.order = {id(m): i for i, m in enumerate(_post_order(model))}
        self.parents = _parents(model)
        self.slots: dict[str, list[tuple[torch.nn.Module, str, bool]]] = {}
        first: dict[int, str] = {}
        for module_name, module in model.named_modules(remove_duplicate=False):
            for name, t, is_param in _own(module):
                canonical = first.setdefault(id(t), f"{module_name}.{name}" if module_name else name)
                slots = self.slots.setdefault(canonical, [])
                if all(m is not module or n != name for m, n, _ in slots):
                    slots.append((module, name, is_param))
        self.tensors = {fqn: getattr(slots[0][0], slots[0][1]) for fqn, slots in self.slots.items()}
        for fqn, slots in self.slots.items():
            for module, name, is_param in slots:
                _put(module, name, is_param, _meta_like(self.tensors[fqn], is_param))

    def restore(self) -> None:
        """Put the model's own tensors back in their slots."""
        for fqn, slots in self.slots.items():
            for module, name, is_param in slots:
                _put(module, name, is_param, self.tensors[fqn])

    @torch.no_grad()
    def tensor(self, fqn: str) -> torch.Tensor:
        """The initialized value of `fqn` (a new CPU tensor of its shape and dtype)."""
        if fqn not in self.slots:
            raise MeshcValueError(f"init_weights: the model has no parameter or buffer {fqn!r}")
        slots = self.slots[fqn]
        like = self.tensors[fqn]
        value = torch.empty(like.shape, dtype=like.dtype, device="cpu")
        value.fill_(_sentinel(value.dtype))
        is_param = slots[0][2]
        held = torch.nn.Parameter(value, requires_grad=like.requires_grad) if is_param else value
        version = compat.version(value)
        for module, name, p in slots:
            _put(module, name, p, held)
        try:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(_seed_of(self.seed, fqn))
                for module in self._chain(slots[0][0]):
                    _initialize(module, self._init_fn(module))
        finally:
            for module, name, p in slots:
                _put(module, name, p, _meta_like(like, p))
        if _unwritten(value, version):
            owners = ", ".join(f"{type(m).__name__} {n!r}" for m, n, _ in slots)
            raise MeshcValueError(
                f"init_weights: no initializer wrote {fqn} (of {owners}): its module has no reset_parameters() and "
                "the model's _init_weights(module) leaves it; give the module a reset_parameters() that sets it, "
                "or build the model on cpu and load its weights (job.load_pretrained)")
        return value.detach()

    def _chain(self, module: torch.nn.Module) -> list[torch.nn.Module]:
        """`module` (the holder of a tensor's canonical name) and all its ancestors, in Module.apply's order
        (children first)."""
        return sorted(self._lineage(module), key=lambda m: self.order[id(m)])

    def _init_fn(self, module: torch.nn.Module):
        """The model's _init_weights that governs `module`: its own or its nearest ancestor's."""
        for m in self._lineage(module):
            fn = getattr(m, "_init_weights", None)
            if callable(fn):
                return fn
        return None

    def _lineage(self, module: torch.nn.Module) -> list[torch.nn.Module]:
        """`module`, then its ancestors nearest first (each once: a module may be registered under several)."""
        out, seen, level = [], set(), [module]
        while level:
            fresh = []
            for m in level:
                if id(m) not in seen:
                    seen.add(id(m))
                    fresh.append(m)
            out.extend(fresh)
            level = [p for m in fresh for p in self.parents.get(id(m), ())]
        return out


def init_weights(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Initialize `model` in this process with meshc's procedure (module docstring): every parameter, and
    every buffer on the meta device, gets a new CPU tensor; returns the model. A meta-built model comes out
    materialized on CPU, bitwise equal to what job.init_weights(seed) assembles under any plan."""
    init = Initializer(model, seed)
    values = {}
    try:
        for fqn, t in init.tensors.items():
            if isinstance(t, torch.nn.Parameter) or t.device.type == "meta":
                values[fqn] = init.tensor(fqn)
    finally:
        init.restore()
    for fqn, value in values.items():
        slots = init.slots[fqn]
        if slots[0][2]:  # one Parameter in every slot: a tied weight stays one leaf
            value = torch.nn.Parameter(value, requires_grad=getattr(slots[0][0], slots[0][1]).requires_grad)
        for module, name, is_param in slots:
            _put(module, name, is_param, value)
    return model


def _initialize(module: torch.nn.Module, init_fn) -> None:
    reset = getattr(module, "reset_parameters", None)
    if callable(reset):
        reset()
    if init_fn is not None:
        init_fn(module)


def _own(module: torch.nn.Module):
    for name, p in module.named_parameters(recurse=False, remove_duplicate=False):
        yield name, p, True
    for name, b in module.named_buffers(recurse=False, remove_duplicate=False):
        yield name, b, False


def _put(module: torch.nn.Module, name: str, is_param: bool, value: torch.Tensor) -> None:
    if is_param and not isinstance(value, torch.nn.Parameter):
        value = torch.nn.Parameter(value, requires_grad=False)
    setattr(module, name, value)


def _meta_like(t: torch.Tensor, is_param: bool) -> torch.Tensor:
    meta = torch.empty(t.shape, dtype=t.dtype, device="meta")
    return torch.nn.Parameter(meta, requires_grad=t.requires_grad) if is_param else meta


def _sentinel(dtype: torch.dtype):
    if dtype.is_floating_point or dtype.is_complex:
        return float("nan")
    if dtype == torch.bool:
        return False
    return torch.iinfo(dtype).min


def _unwritten(value: torch.Tensor, version: int) -> bool:
    """Does any element still hold the sentinel (booleans: was the tensor never written at all)?"""
    if value.dtype == torch.bool:
        return compat.version(value) == version and not bool(value.any())
    if value.dtype.is_floating_point or value.dtype.is_complex:
        return bool(torch.isnan(value).any())
    return bool((value == torch.iinfo(value.dtype).min).any())


def _seed_of(seed: int, fqn: str) -> int:
    digest = hashlib.sha256(f"{_SALT}:{seed}:{fqn}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def _post_order(model: torch.nn.Module) -> list[torch.nn.Module]:
    out: list[torch.nn.Module] = []
    seen: set[int] = set()

    def visit(m: torch.nn.Module) -> None:
        if id(m) in seen:
            return
        seen.add(id(m))
        for child in m.children():
            visit(child)
        out.append(m)
    visit(model)
    return out


def _parents(model: torch.nn.Module) -> dict[int, list[torch.nn.Module]]:
    parents: dict[int, list[torch.nn.Module]] = {}
    for m in model.modules():
        for child in m.children():
            parents.setdefault(id(child), []).append(m)
    return parents
