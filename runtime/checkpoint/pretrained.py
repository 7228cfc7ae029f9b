"""job.load_pretrained: weights from files straight into each rank's shards, no full copy anywhere.

Sources, by what `path` is:
    a meshc checkpoint folder (meshc.json)      job.load, weights and buffers only
    a folder with model.safetensors.index.json  Hugging Face's sharded layout (save_pretrained(max_shard_size=...))
    a folder with model.safetensors             one file
    a .safetensors file                         one file
    any other file                              a torch state dict (torch.load, memory-mapped, weights only)

Each rank asks, tensor by tensor, only for its slices (sharding.read_local): a safetensors file is read
through `safe_open(...).get_slice`, one rectangle per run of consecutive indices, so a rank's reads are its
shards' bytes (a ZeRO flat shard also reads the rest of the rows its window starts and ends in). Files are
read one after the other and each is closed when done: the pages of one file's memory map at a time.

Keys: the model's own state_dict keys, tied aliases included; where the file's keys carry or lack the model's
`base_model_prefix` ("model.", "transformer."), or say gamma/beta for weight/bias (old Hugging Face files),
they are renamed. Dtypes are cast to the job's (bf16 files into fp32 masters). Strict by default: a missing
or unexpected key, or a shape that differs, is an error naming it and its file. Buffers absent from the
files and left on the meta device are computed as init_weights computes them.
"""
from __future__ import annotations

import itertools
import json
import math
import os
from dataclasses import dataclass, field

import torch

from meshc.compiler.ir.errors import MeshcValueError

from meshc.runtime.checkpoint.format import MANIFEST
from meshc.runtime.sharding import take

INDEX, SINGLE = "model.safetensors.index.json", "model.safetensors"


@dataclass
class LoadStats:
    """What a rank read: tensors touched and the bytes its slices hold, against the bytes of those tensors."""

    tensors: int = 0
    bytes_read: int = 0
    bytes_whole: int = 0
    files: list[str] = field(default_factory=list)


def load_pretrained(job, path, *, strict: bool = True) -> LoadStats:
    path = os.path.abspath(os.fspath(path))
    if os.path.isdir(path) and os.path.exists(os.path.join(path, MANIFEST)):
        job.load(path, optimizers=[])
        return LoadStats(files=[path])
    source = open_source(path)
    try:
        return _load(job, source, strict)
    finally:
        source.close()


def _load(job, source, strict: bool) -> LoadStats:
    keys = _match(job, source)
    missing = sorted(set(job.state_dict_keys.values()) - set(keys))
    known = set(keys.values()) | set(job.state_dict_keys) | set(job.program.params) | set(job.program.buffers)
    unexpected = sorted(k for k in source.keys() if k not in known)
    if strict and (missing or unexpected):
        parts = ([f"{len(missing)} missing ({_listed(missing)})"] if missing else []) + \
                ([f"{len(unexpected)} unexpected ({_listed(unexpected)})"] if unexpected else [])
        raise MeshcValueError(f"load_pretrained {source.where}: expected the model's keys, got {' and '.join(parts)}; "
                              "load weights saved from this architecture, or pass strict=False to skip them")
    stats = LoadStats(files=source.files())
    specs = {**job.program.params, **job.program.buffers}
    params, buffers = {f for f, _ in job.named_parameters()}, {f for f, _ in job.named_buffers()}
    by_file = itertools.groupby(sorted(keys.items(), key=lambda item: source.file_of(item[1])),
                                key=lambda item: source.file_of(item[1]))
    for file, items in by_file:  # file by file, each let go when read: one file's mapped pages at a time
        for fqn, key in items:
            shape = source.shape(key)
            if tuple(shape) != tuple(specs[fqn].shape):
                raise MeshcValueError(f"load_pretrained {file}: expected {key} of shape {tuple(specs[fqn].shape)} "
                                      f"(the model's {fqn}), got {tuple(shape)}; the file is of another configuration")
            if fqn not in params and fqn not in buffers:
                continue  # a pipeline stage on another rank holds it
            before = source.bytes_read
            read = lambda indices, key=key: source.read(key, indices)  # noqa: E731
            (job.load_part if fqn in params else job.load_buffer_part)(fqn, read)
            stats.tensors += 1
            stats.bytes_read += source.bytes_read - before
            stats.bytes_whole += source.nbytes(key)
        source.release(file)
    if job.pending():
        job.init_buffers([f for f in job.pending() if f in job.program.buffers])
    left = job.pending()
    if left:
        raise MeshcValueError(f"load_pretrained {source.where}: expected values for every parameter, got none for "
                              f"{', '.join(left[:8])}; they are not in the files (strict=False skipped them): "
                              "initialize them with job.init_weights(seed) before loading, or load complete weights")
    return stats


def _listed(names: list[str], limit: int = 8) -> str:
    return ", ".join(names[:limit]) + (", ..." if len(names) > limit else "")


def _match(job, source) -> dict[str, str]:
    """canonical FQN -> file key, under the renaming (prefix, gamma/beta) that matches the most keys."""
    alias = dict(job.state_dict_keys)
    alias.update({f: f for f in job.program.params})
    alias.update({f: f for f in job.program.buffers})
    prefix = getattr(job.model_meta, "base_model_prefix", "") or ""
    renames = [lambda k: k]
    if prefix:
        renames += [lambda k: f"{prefix}.{k}", lambda k: k[len(prefix) + 1:] if k.startswith(prefix + ".") else k]
    best: dict[str, str] = {}
    for rename in renames:
        found: dict[str, str] = {}
        for key in source.keys():
            name = _legacy(rename(key), alias)
            if name in alias:
                found.setdefault(alias[name], key)
        if len(found) > len(best):
            best = found
    return best


def _legacy(name: str, alias: dict) -> str:
    if name in alias:
        return name
    for old, new in ((".gamma", ".weight"), (".beta", ".bias")):
        if name.endswith(old) and name[: -len(old)] + new in alias:
            return name[: -len(old)] + new
    return name


# ---------------------------------------------------------------------------------------- sources
def open_source(path: str):
    if os.path.isdir(path):
        if os.path.exists(os.path.join(path, INDEX)):
            return _Safetensors.from_index(path)
        if os.path.exists(os.path.join(path, SINGLE)):
            return _Safetensors(path, {None: os.path.join(path, SINGLE)})
        raise MeshcValueError(f"load_pretrained {path}: expected a meshc checkpoint ({MANIFEST}) or a Hugging Face folder "
                              f"({INDEX} or {SINGLE}), got a folder with neither; point at the folder save_pretrained "
                              "wrote, or at one weights file")
    if not os.path.exists(path):
        raise MeshcValueError(f"load_pretrained {path}: expected a weights file or folder, got nothing at that path")
    if path.endswith(".safetensors"):
        return _Safetensors(path, {None: path})
    return _StateDict(path)


class _Safetensors:
    def __init__(self, where: str, files: dict):
        from safetensors import safe_open

        self.where, self.bytes_read = where, 0
        self.handles, self.key_file = {}, {}
        for key, file in files.items():
            if file not in self.handles:
                try:
                    self.handles[file] = safe_open(file, framework="pt")
                except Exception as error:  # noqa: BLE001 - safetensors' errors become one that names the file
                    raise MeshcValueError(f"load_pretrained {file}: expected a safetensors file, got one that cannot "
                                          f"be opened ({str(error).strip()[:200]}): truncated or not safetensors; "
                                          "write it again (save_pretrained / safetensors.torch.save_file)") from None
            if key is None:
                self.key_file.update({k: file for k in self.handles[file].keys()})
            else:
                self.key_file[key] = file

    @classmethod
    def from_index(cls, folder: str) -> "_Safetensors":
        index_path = os.path.join(folder, INDEX)
        try:
            with open(index_path) as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, ValueError, KeyError) as error:
            raise MeshcValueError(f"load_pretrained {index_path}: expected a JSON index with a weight_map, got "
                                  f"{type(error).__name__}: {error}") from None
        files = {k: os.path.join(folder, v) for k, v in weight_map.items()}
        for file in sorted(set(files.values())):
            if not os.path.exists(file):
                raise MeshcValueError(f"load_pretrained {index_path}: expected the file {os.path.basename(file)} it "
                                      "lists, got none; copy every shard of the checkpoint")
        return cls(folder, files)

    def keys(self) -> list[str]:
        return list(self.key_file)

    def files(self) -> list[str]:
        return sorted(set(self.key_file.values()))

    def file_of(self, key: str) -> str:
        return self.key_file[key]

    def shape(self, key: str) -> tuple:
        return tuple(self._slice(key).get_shape())

    def nbytes(self, key: str) -> int:
        sl = self._slice(key)
        return math.prod(sl.get_shape()) * _DTYPE_BYTES.get(sl.get_dtype(), 4)

    def _slice(self, key: str):
        return self._handle(self.key_file[key]).get_slice(key)

    def _handle(self, file: str):
        if file not in self.handles:
            from safetensors import safe_open

            self.handles[file] = safe_open(file, framework="pt")
        return self.handles[file]

    def release(self, file: str) -> None:
        """Close `file` (its memory map goes with it); it is opened again if asked for."""
        self.handles.pop(file, None)

    def read(self, key: str, indices: list[torch.Tensor]) -> torch.Tensor:
        sl = self._slice(key)
        runs = [_runs(ix) for ix in indices]
        try:
            out = _assemble(sl, runs, 0, ())
        except Exception as error:  # noqa: BLE001 - a short read names the file
            raise MeshcValueError(f"load_pretrained {self.file_of(key)}: expected to read {key}, got "
                                  f"{type(error).__name__}: {str(error).strip()[:200]}; the file is truncated or "
                                  "corrupt: write it again") from None
        self.bytes_read += out.numel() * out.element_size()
        return out

    def close(self) -> None:
        self.handles.clear()


class _StateDict:
    def __init__(self, path: str):
        self.where, self.bytes_read = path, 0
        try:
            self.tensors = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        except Exception as error:  # noqa: BLE001 - torch.load's errors become one that names the file
            raise MeshcValueError(f"load_pretrained {path}: expected a safetensors file or a torch state dict, got "
                                  f"one torch.load cannot read ({str(error).strip().splitlines()[0][:200]})") from None
        if not isinstance(self.tensors, dict):
            raise MeshcValueError(f"load_pretrained {path}: expected a state dict (name -> tensor), got a "
                                  f"{type(self.tensors).__name__}")

    def keys(self) -> list[str]:
        return [k for k, v in self.tensors.items() if isinstance(v, torch.Tensor)]

    def files(self) -> list[str]:
        return [self.where]

    def file_of(self, key: str) -> str:
        return self.where

    def release(self, file: str) -> None:
        """The state dict stays mapped until close(): one file."""

    def shape(self, key: str) -> tuple:
        return tuple(self.tensors[key].shape)

    def nbytes(self, key: str) -> int:
        t = self.tensors[key]
        return t.numel() * t.element_size()

    def read(self, key: str, indices: list[torch.Tensor]) -> torch.Tensor:
        out = take(self.tensors[key], indices)
        self.bytes_read += out.numel() * out.element_size()
        return out

    def close(self) -> None:
        self.tensors = {}


_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}


def _runs(ix: torch.Tensor) -> list[tuple[int, int]]:
    """Consecutive runs of an index tensor, as (start, stop) pairs, in its order."""
    values = ix.tolist()
    runs: list[tuple[int, int]] = []
    for v in values:
        if runs and runs[-1][1] == v:
            runs[-1] = (runs[-1][0], v + 1)
        else:
            runs.append((v, v + 1))
    return runs


def _assemble(sl, runs: list, dim: int, box: tuple) -> torch.Tensor:
    """The cross product of per-dim runs, read one rectangle at a time and joined in order."""
    if dim == len(runs):
        return sl[box] if box else sl[:]
    parts = [_assemble(sl, runs, dim + 1, box + (slice(a, b),)) for a, b in runs[dim]]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)
