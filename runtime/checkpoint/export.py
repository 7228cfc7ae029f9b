"""A sharded checkpoint as ordinary files: Hugging Face safetensors shards, or one torch.save state dict.

    export("ckpt/step_100", to="hf", out="hf/model.safetensors", max_shard_size="5GB")
    meshc checkpoint export ckpt/step_100 --to hf --out hf/model.safetensors --max-shard-size 5GB

One process, no torch.distributed: DCP's own resharding reads the saved pieces into whole tensors under the
model's state_dict keys (tied ones included, each key its own copy), so the original model loads the result with
load_state_dict, and a transformers model with from_pretrained (beside its config.json).

Streamed (`to="hf"`): the keys are cut, in the model's order, into shards of at most `max_shard_size` bytes of
tensor data (a tensor larger than that alone in its shard; tied keys together, as they share one read), and each
shard is read, written and dropped before the next: peak memory is about one shard (its tensors, plus
safetensors' serialization of them), never the model. One shard is written to `out` itself (default
PATH.safetensors); several are named as Hugging Face names them after `out` (`model.safetensors` ->
`model-00001-of-00003.safetensors`, ...) beside `model.safetensors.index.json` (total_size, weight_map).
`to="torch"` writes one torch.save file, which holds the whole model in memory by construction.
"""
from __future__ import annotations

import json
import os
import re
import warnings

import torch

from meshc.compiler.ir.errors import MeshcValueError
from meshc.runtime.checkpoint.format import Piece, check_folder, model_key, parse_dtype, read_pieces

DEFAULT_SHARD = "5GB"  # transformers 4's save_pretrained default (5 says 50GB): export's peak memory stays small
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def export(path: str | os.PathLike, to: str = "hf", out: str | os.PathLike | None = None,
           max_shard_size: int | str = DEFAULT_SHARD) -> str:
    """Write the checkpoint at `path` as safetensors shards (`to="hf"`) or one torch.save file (`to="torch"`).
    Returns the file written: `out`, or with several shards their index (OUT.index.json)."""
    if to not in ("hf", "torch"):
        raise MeshcValueError(f"checkpoint export: expected --to hf or torch, got {to!r}")
    path = os.path.abspath(os.fspath(path))
    limit = parse_size(max_shard_size)
    manifest = check_folder(path)
    out = os.fspath(out) if out is not None else path.rstrip("/") + (".safetensors" if to == "hf" else ".pt")
    if to == "torch":
        full = read_whole(path, manifest, _keys_by_fqn(manifest))
        torch.save({key: full[fqn] for key, fqn in manifest["state_dict_keys"].items()}, out)
        return out
    try:
        from safetensors.torch import save_file
    except ImportError:
        raise MeshcValueError("checkpoint export --to hf: expected the safetensors package, got none installed; "
                              "pip install safetensors, or export with --to torch") from None
    shards = plan_shards(manifest, limit)
    names = [out] if len(shards) == 1 else [_shard_name(out, i, len(shards)) for i in range(len(shards))]
    weight_map, total = {}, 0
    for name, shard in zip(names, shards):
        full = read_whole(path, manifest, shard)
        state = {}
        for fqn, keys in shard.items():
            for j, key in enumerate(keys):  # tied keys: safetensors stores no shared storage, each its own copy
                state[key] = full[fqn] if j == 0 else full[fqn].clone()
                weight_map[key] = os.path.basename(name)
                total += state[key].numel() * state[key].element_size()
        save_file(state, name, metadata={"format": "pt"})
        del full, state
    if len(shards) == 1:
        return out
    index = out + ".index.json"
    with open(index, "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2, sort_keys=True)
    return index


def plan_shards(manifest: dict, limit: int) -> list[dict[str, list[str]]]:
    """The model's state_dict keys, in order, cut into shards of at most `limit` bytes: each shard
    {fqn: [keys]} (tied keys with their tensor; a tensor over the limit alone)."""
    tensors = manifest["tensors"]
    shards: list[dict[str, list[str]]] = [{}]
    used = 0
    for fqn, keys in _keys_by_fqn(manifest).items():
        md = tensors[model_key(fqn)]
        size = len(keys) * _nbytes(md)
        if shards[-1] and used + size > limit:
            shards.append({})
            used = 0
        shards[-1][fqn] = keys
        used += size
    return shards


def read_whole(path: str, manifest: dict, fqns) -> dict[str, torch.Tensor]:
    """The whole tensors `fqns` of the checkpoint, and nothing else (DCP reads only their chunks)."""
    full = {}
    for fqn in fqns:
        md = manifest["tensors"][model_key(fqn)]
        full[fqn] = torch.empty(md["shape"], dtype=parse_dtype(md["dtype"]))
    items = {model_key(f): (tuple(t.shape), [Piece((0,) * t.dim(), tuple(t.shape), t)] if t.numel() else [])
             for f, t in full.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP warns that it runs without torch.distributed: that is the intent
        read_pieces(path, manifest, items, no_dist=True)
    return full


def parse_size(size: int | str) -> int:
    """Bytes from 1000000, "500MB", "5GB" or "2GiB" (Hugging Face's max_shard_size spelling)."""
    if isinstance(size, int) and not isinstance(size, bool):
        n = size
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*", str(size).upper())
        if m is None or m.group(2) not in _UNITS:
            raise MeshcValueError(f"checkpoint export: expected a shard size such as 5GB, 500MB or 2GiB, got {size!r}")
        n = int(float(m.group(1)) * _UNITS[m.group(2)])
    if n <= 0:
        raise MeshcValueError(f"checkpoint export: expected a positive shard size, got {size!r}")
    return n


def _keys_by_fqn(manifest: dict) -> dict[str, list[str]]:
    """state_dict key groups by the tensor they name, in the model's order (first key first)."""
    out: dict[str, list[str]] = {}
    for key, fqn in manifest["state_dict_keys"].items():
        out.setdefault(fqn, []).append(key)
    return out


def _nbytes(md: dict) -> int:
    n = 1
    for d in md["shape"]:
        n *= d
    return n * torch.empty((), dtype=parse_dtype(md["dtype"])).element_size()


def _shard_name(out: str, i: int, n: int) -> str:
    stem = out[:-len(".safetensors")] if out.endswith(".safetensors") else out
    return f"{stem}-{i + 1:05d}-of-{n:05d}.safetensors"
