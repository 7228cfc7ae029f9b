"""A user's model on the command line: `--model path.to.module:factory`.

The factory is any callable that returns an nn.Module, or a pair (module, example inputs) where the inputs are a
tuple of tensors holding one *global* batch (dim 0 the batch, for a language model dim 1 the sequence). The
command line calls it under fake tensors (`meshc explain`, `meshc plan`), so that a model of any size costs no
memory: it must build the module from torch ops (no `.numpy()`, no reading weights from disk). `--layers N` is
passed to it as `layers=N`.
"""
from __future__ import annotations

import importlib
import os
import sys
import warnings
from dataclasses import dataclass

import torch
import torch.nn as nn

from meshc.compiler.ir.errors import MeshcTypeError, MeshcValueError


SEQ = 128  # the sequence of a factory's model that returns no example inputs (--seq changes it)


def is_factory(name: str) -> bool:
    """Does `--model` name a factory (module:callable) rather than a built-in model or a config file?"""
    return ":" in name and not name.endswith(".json") and not os.path.exists(name)


@dataclass(frozen=True)
class UserModel:
    module: nn.Module
    inputs: tuple[torch.Tensor, ...] | None  # one global batch, or None: token ids of the command's --batch, --seq


def build(spec: str, **kwargs) -> UserModel:
    """Import `path.to.module:factory` (the current folder on the import path, as `python -m` has it) and call
    the factory with `kwargs`; a clear error for each way this can fail."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise MeshcValueError(f"--model {spec!r}: expected path.to.module:factory, e.g. mypkg.models:build_llama")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise MeshcValueError(f"--model {spec!r}: cannot import {module_name!r} ({e}); run from the folder that "
                              "holds it or add that folder to PYTHONPATH") from e
    factory = module
    for part in attr.split("."):
        factory = getattr(factory, part, None)
    if not callable(factory):
        raise MeshcValueError(f"--model {spec!r}: {module_name} has no callable {attr!r}")
    try:
        with warnings.catch_warnings():  # torch's own modules (nn.TransformerEncoder) read data pointers at init
            warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
            out = factory(**kwargs)
    except TypeError as e:
        if kwargs and "unexpected keyword" in str(e):
            raise MeshcTypeError(f"--model {spec!r}: the factory takes no {', '.join(kwargs)} argument ({e}); "
                                 "drop --layers or give the factory a `layers` parameter") from e
        raise _failed(spec, e) from e
    except Exception as e:  # noqa: BLE001 - whatever the user's code raised, said with what to do
        raise _failed(spec, e) from e
    model, inputs = out if isinstance(out, tuple) and len(out) == 2 else (out, None)
    if not isinstance(model, nn.Module):
        raise MeshcTypeError(f"--model {spec!r}: expected the factory to return an nn.Module or (module, example "
                             f"inputs), got {type(out).__name__}")
    if inputs is not None:
        inputs = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
        if not inputs or not all(isinstance(t, torch.Tensor) and t.dim() >= 1 for t in inputs):
            raise MeshcTypeError(f"--model {spec!r}: expected the example inputs as a tuple of tensors with a batch "
                                 f"dim, got {[type(t).__name__ for t in inputs]}")
    return UserModel(model, inputs)


def _failed(spec: str, e: Exception) -> MeshcValueError:
    return MeshcValueError(f"--model {spec!r}: the factory failed under fake tensors ({type(e).__name__}: {e}); "
                           "the command line builds models without memory, so the factory must create its "
                           "weights with torch ops (no .numpy(), no files read); or pass a transformers config .json")


def local_inputs(inputs: tuple[torch.Tensor, ...], data_ranks: int, cp: int) -> tuple[torch.Tensor, ...]:
    """One rank's part of a global batch: dim 0 split over the data-parallel ranks, dim 1 over cp (as
    mesh.shard_batch splits a batch)."""
    out = []
    for t in inputs:
        if t.shape[0] % data_ranks:
            raise MeshcValueError(f"--model: the factory's example batch of {t.shape[0]} does not split over "
                                  f"{data_ranks} data-parallel ranks; return a batch divisible by it")
        part = t[: t.shape[0] // data_ranks]
        if cp > 1:
            if t.dim() < 2 or t.shape[1] % cp:
                raise MeshcValueError(f"--model: cp={cp} splits dim 1 of every input (the sequence); the factory's "
                                      f"input of shape {tuple(t.shape)} does not split")
            part = part[:, : t.shape[1] // cp]
        out.append(part)
    return tuple(out)
