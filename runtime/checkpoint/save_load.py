"""Sharded checkpoints of a job: every rank writes its own shards, and any plan loads them.

    job.save("ckpt/step_100", step=100, extra={"data_position": 100})   # every rank, collectively
    step, extra = job.load("ckpt/step_100")                              # on any plan, any world size
    path = latest("ckpt")                                                # newest complete checkpoint or None

A save is two halves: begin_save (the caller's thread, world group: checks, PATH.partial, this rank's pieces) and
finish_save (DCP's write, then rank 0's manifest and rename); `job.save(..., async_=True)` runs the second half on
staged copies in a background thread (async_save.py). Export to ordinary files: export.py.

What is saved: the parameters as the optimizer sees them (the masters: fp32 flat shards under ZeRO), the
persistent buffers, the state of the job's optimizers (every optimizer made by `job.optimizer(...)` and
still alive, in creation order; pass `optimizers=[...]` to choose), their hyperparameters (learning
rates a scheduler changed included), each rank's RNG states (torch CPU, and CUDA when present) and the
user's `extra` (JSON: the data position, a scheduler's state_dict()). Optimizer states shaped like their
parameter (Adam's exp_avg and exp_avg_sq, SGD's momentum) are resharded exactly as the parameter is; 0-d
states (Adam's step) are stored once per parameter.

Format and why (details in format.py): torch.distributed.checkpoint (DCP) writes and plans,
each rank writing its own file in parallel; a local tensor is given to DCP as the boxes of the whole
tensor it holds (ZeRO's flat padded shards are a few boxes each), so a loader on another plan (dp <->
ZeRO-3, tp 2 -> 4, pp 2 -> 1, more or fewer ranks) reads exactly the overlapping parts with DCP's own
resharding, and parameters and states come back bitwise. The metadata is JSON, not DCP's pickle.

A folder, on disk:
    meshc.json          manifest, written last: step, extra, mesh and plan, tensors, optimizers, files and sizes
    dcp.json            DCP's metadata (chunks of every tensor, where each lies in which file)
    __R_0.distcp        rank R's tensors (torch.save records, read with torch.load(weights_only=True))
    rank_0000R.json     rank R's RNG states and mesh coordinates

Atomicity: a save writes into PATH.partial, and rank 0 renames it to PATH once every rank has finished;
a crash leaves the previous checkpoint at PATH as it was. Loading refuses a folder without its manifest,
with a file missing or of the wrong size, or holding a file the manifest does not list.

RNG on load: on the saving mesh each rank gets its own state back; on another mesh, each rank takes the
state of the saved rank with its dp coordinate (modulo the saved dp size) and tp = pp = 0.
"""
from __future__ import annotations

import base64
import json
import os
import shutil
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from meshc.compiler.ir.errors import MeshcRuntimeError, MeshcValueError
from meshc.compiler.ir.placement import FlatShard, Replicate
from meshc.compiler.ir.mesh_spec import MeshSpec, spec_sizes

from meshc.runtime.monitor import failures

from meshc.runtime.zero import offload
from meshc.runtime.checkpoint.export import export
from meshc.runtime.checkpoint.format import (FORMAT, MANIFEST, VERSION, JsonWriter, Piece, PieceSavePlanner,
                                             check_folder, model_key, parse_dtype, pieces, read_json, read_pieces,
                                             scalar_writer, write_json, writes)

__all__ = ["save", "load", "latest", "export", "full_optimizer_state"]


# ---------------------------------------------------------------------------------------- save
def save(job, path: str | os.PathLike, *, step: int = 0, extra: dict | None = None,
         optimizers: list[torch.optim.Optimizer] | None = None) -> str:
    """Write the job's sharded state to the folder `path` (a collective: call it on every rank, with the
    same arguments). Returns the folder's absolute path."""
    with failures.watching(job.mesh, "job.save"):
        return finish_save(begin_save(job, path, step=step, extra=extra, optimizers=optimizers))


@dataclass
class SaveWork:
    """One save as its caller decided it: where it goes, what this rank writes (`items`: DCP key -> (shape,
    dtype, pieces); views of the live tensors until staged), and what the manifest will say. finish_save
    reads only this, never the job, so that it may run in another thread (async_save.py)."""

    path: str
    tmp: str
    rank: int
    world_size: int
    items: dict
    described: dict
    record: dict
    header: dict


def begin_save(job, path: str | os.PathLike, *, step: int = 0, extra: dict | None = None,
               optimizers: list[torch.optim.Optimizer] | None = None) -> SaveWork:
    """A save's first half, collective over the world group: check the target, make PATH.partial afresh
    (rank 0), and take this rank's pieces, RNG states and manifest fields."""
    path = os.path.abspath(os.fspath(path))
    extra = _json_extra(extra)
    opts = _optimizers(job, optimizers)
    mesh = job.mesh
    _agreed(mesh, lambda: _check_target(path))
    _on_rank0(lambda: _fresh_folder(path + ".partial"))
    items, described = _save_items(job, opts)
    header = {"format": FORMAT, "version": VERSION, "step": int(step), "extra": extra,
              "world_size": mesh.world_size, "mesh": mesh.axes, "plan": job.plan.describe(),
              "state_dict_keys": job.state_dict_keys}
    return SaveWork(path, path + ".partial", mesh.rank, mesh.world_size, items, described, _rank_record(mesh), header)


def finish_save(work: SaveWork, group: dist.ProcessGroup | None = None, staged: bool = False) -> str:
    """A save's second half, collective over `group` (default: the world): every rank writes its files into
    PATH.partial, then rank 0 writes the manifest and renames the folder to PATH. `staged`: the items are
    private copies already (async_save.stage), written as they are."""
    write_json(os.path.join(work.tmp, f"rank_{work.rank:05d}.json"), work.record)
    dcp.save({}, storage_writer=JsonWriter(work.tmp, sync_files=True),
             planner=PieceSavePlanner(work.items, staged=staged), process_group=group)
    gathered = [None] * work.world_size if work.rank == 0 else None
    dist.gather_object(work.described, gathered, dst=0, group=group)
    _on_rank0(lambda: _publish(work, gathered), group=group)
    return work.path


def _save_items(job, opts: list) -> tuple[dict, dict]:
    """The pieces this rank writes, by DCP key, and what it holds (for the manifest)."""
    sizes, coords = job.mesh.sizes, job.mesh.coords()
    items: dict[str, tuple] = {}
    held: dict[str, dict] = {}

    def add(key: str, kind: str, t: torch.Tensor, spec, scalar: bool = False) -> None:
        owner = _owner(job, spec.fqn)
        shape = () if scalar else tuple(spec.shape)
        held[key] = {"kind": kind, "shape": list(shape), "dtype": _dtype_name(t.dtype)}
        chosen = scalar_writer(coords, owner) if scalar else writes(key, spec.placements, sizes, coords, owner)
        if chosen:
            placements = {} if scalar else spec.placements
            items[key] = (shape, t.dtype, pieces(t.detach(), shape, placements, sizes, coords, writer=True))

    for fqn, p in job.named_parameters():
        add(model_key(fqn), "param", p, job.program.params[fqn])
    for fqn, b in job.named_buffers():
        add(model_key(fqn), "buffer", b, job.program.buffers[fqn])
    optim_docs = []
    for i, opt in enumerate(opts):
        fqn_of = {id(p): f for f, p in job.named_parameters()}
        doc = {"class": type(opt).__name__, "groups": [], "state": {}}
        for group in opt.param_groups:
            doc["groups"].append({"hyper": _json_hyper(group, type(opt).__name__),
                                  "params": [fqn_of[id(p)] for p in group["params"]]})
            for p in group["params"]:
                fqn = fqn_of[id(p)]
                doc["state"][fqn] = _describe_state(i, fqn, p, opt.state.get(p, {}), job, add)
        optim_docs.append(doc)
    return items, {"tensors": held, "optimizers": optim_docs}


def _describe_state(i: int, fqn: str, p: torch.Tensor, state: dict, job, add: Callable) -> dict:
    out = {}
    spec = job.program.params[fqn]
    for name, value in state.items():
        key = _optim_key(i, fqn, name)
        if isinstance(value, torch.Tensor) and tuple(value.shape) == tuple(p.shape):
            add(key, "optim", value, spec)
            out[name] = {"kind": "param", "dtype": _dtype_name(value.dtype)}
        elif isinstance(value, torch.Tensor) and value.dim() == 0:
            add(key, "optim", value, spec, scalar=True)
            out[name] = {"kind": "scalar", "dtype": _dtype_name(value.dtype), "cpu": value.device.type == "cpu"}
        elif value is None or isinstance(value, (bool, int, float, str)):
            out[name] = {"kind": "value", "value": value}
        else:
            shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise MeshcValueError(f"job.save: optimizer state {name!r} of {fqn}: expected a tensor shaped like the "
                                  f"parameter's local shard {tuple(p.shape)}, a 0-d tensor or a plain value, got "
                                  f"{shape}; meshc reshards element-wise optimizer states only (Adam, AdamW, SGD, ...)")
    return out


def _publish(work: SaveWork, gathered: list) -> None:
    """Rank 0, after every rank has written: the manifest, then the rename that makes the save visible."""
    tmp, path = work.tmp, work.path
    tensors, optims = {}, []
    for described in gathered:
        tensors.update(described["tensors"])
        for i, doc in enumerate(described["optimizers"]):
            if i == len(optims):
                groups = [dict(g, params=[]) for g in doc["groups"]]
                optims.append({"class": doc["class"], "groups": groups, "state": {}})
            for merged, group in zip(optims[i]["groups"], doc["groups"]):
                merged["params"] += [f for f in group["params"] if f not in merged["params"]]
            optims[i]["state"].update(doc["state"])
    files = {name: os.path.getsize(os.path.join(tmp, name)) for name in sorted(os.listdir(tmp)) if name != PARTIAL_MARK}
    manifest = dict(work.header, tensors=tensors, optimizers=optims, files=files)
    write_json(os.path.join(tmp, MANIFEST), manifest)
    os.remove(os.path.join(tmp, PARTIAL_MARK))  # the manifest now says whose folder this is
    old = path + ".old"
    if os.path.isdir(old):
        _remove_own(old, "checkpoint")
    if os.path.exists(path):
        os.rename(path, old)
    os.rename(tmp, path)
    _fsync_dir(os.path.dirname(path))
    if os.path.isdir(old):
        _remove_own(old, "checkpoint")


# ---------------------------------------------------------------------------------------- load
def load(job, path: str | os.PathLike, *, optimizers: list[torch.optim.Optimizer] | None = None) -> tuple[int, dict]:
    """Read a checkpoint saved under any plan into this job (a collective: call it on every rank).
    Returns (step, extra) as given to save."""
    path = os.path.abspath(os.fspath(path))
    opts = _optimizers(job, optimizers)
    mesh = job.mesh
    with failures.watching(mesh, "job.load"):
        manifest = _agreed(mesh, lambda: check_folder(path))
        _check_optimizers(path, manifest, opts)
        items = _load_items(job, opts, manifest)
        read_pieces(path, manifest, items, no_dist=False)
        for opt, doc in zip(opts, manifest["optimizers"]):
            _restore_hyper(opt, doc)
        _restore_rng(path, manifest, mesh)
    return manifest["step"], manifest["extra"]


def _load_items(job, opts: list, manifest: dict) -> dict[str, tuple]:
    """This rank's destinations, by DCP key: its masters, ZeRO-1/2 compute copies, buffers, optimizer states."""
    sizes, coords = job.mesh.sizes, job.mesh.coords()
    items: dict[str, tuple] = {}

    def dest(key: str, t: torch.Tensor, shape: tuple, placements: dict) -> None:
        parts: list[Piece] = pieces(t.detach(), shape, placements, sizes, coords)
        items.setdefault(key, (tuple(shape), []))[1].extend(parts)

    compute = job.compute_copies()
    for fqn, p in job.named_parameters():
        spec = job.program.params[fqn]
        dest(model_key(fqn), p, spec.shape, spec.placements)
        if fqn in compute:  # ZeRO-1/2: the whole tp-local copy the graph reads (no gather needed)
            whole = {a: Replicate() if isinstance(pl, FlatShard) else pl for a, pl in spec.placements.items()}
            dest(model_key(fqn), compute[fqn], spec.shape, whole)
    for fqn, b in job.named_buffers():
        dest(model_key(fqn), b, job.program.buffers[fqn].shape, job.program.buffers[fqn].placements)
    fqn_of = {id(p): f for f, p in job.named_parameters()}
    for i, (opt, doc) in enumerate(zip(opts, manifest["optimizers"])):
        for group in opt.param_groups:
            for p in group["params"]:
                fqn = fqn_of[id(p)]
                saved = doc["state"].get(fqn, {})
                if not saved:  # it had not stepped when saved
                    opt.state.pop(p, None)
                    continue
                opt.state[p] = state = _fresh_state(p, saved, offload.of(opt))
                spec = job.program.params[fqn]
                for name, desc in saved.items():
                    if desc["kind"] == "param":
                        dest(_optim_key(i, fqn, name), state[name], spec.shape, spec.placements)
                    elif desc["kind"] == "scalar":
                        dest(_optim_key(i, fqn, name), state[name], (), {})
    missing = sorted(k for k in items if k not in manifest["tensors"])
    if missing:
        raise MeshcValueError(f"job.load: expected the checkpoint to hold {missing[0]}, got no such tensor "
                              f"({len(missing)} missing); load a checkpoint of the same model (and optimizer)")
    return items


def _fresh_state(p: torch.Tensor, saved: dict, offloaded=None) -> dict:
    """Destinations for a parameter's saved states: its places in the offload store where the optimizer has one
    (the load writes there, never holding them all in memory), fresh tensors otherwise."""
    state = {}
    for name, desc in saved.items():
        place = offloaded.destination(p, name, parse_dtype(desc["dtype"])) if offloaded and desc["kind"] == "param" else None
        if place is not None:
            state[name] = place
        elif desc["kind"] == "param":
            state[name] = torch.zeros_like(p, dtype=parse_dtype(desc["dtype"]), memory_format=torch.contiguous_format)
        elif desc["kind"] == "scalar":
            state[name] = torch.zeros((), dtype=parse_dtype(desc["dtype"]), device="cpu" if desc["cpu"] else p.device)
        else:
            state[name] = desc["value"]
    return state


def _check_optimizers(path: str, manifest: dict, opts: list) -> None:
    saved = manifest["optimizers"]
    if opts and len(opts) != len(saved):
        raise MeshcValueError(f"job.load: {path} holds {len(saved)} optimizer(s), expected one per live optimizer of "
                              f"the job, got {len(opts)}; pass optimizers=[...] in the order they were saved")
    for opt, doc in zip(opts, saved):
        if type(opt).__name__ != doc["class"]:
            raise MeshcValueError(f"job.load: {path} holds {doc['class']} states, expected {type(opt).__name__}; "
                                  f"create the job's optimizer with {doc['class']}")
        if len(opt.param_groups) != len(doc["groups"]):
            raise MeshcValueError(f"job.load: {path} holds {len(doc['groups'])} parameter groups, expected "
                                  f"{len(opt.param_groups)}; build the optimizer with the same groups")


def _restore_hyper(opt: torch.optim.Optimizer, doc: dict) -> None:
    for group, saved in zip(opt.param_groups, doc["groups"]):
        for k, v in saved["hyper"].items():
            group[k] = tuple(v) if isinstance(group.get(k), tuple) and isinstance(v, list) else v


# ---------------------------------------------------------------------------------------- RNG
def _rank_record(mesh) -> dict:
    record = {"rank": mesh.rank, "coords": mesh.coords(), "rng": {"cpu": _b64(torch.get_rng_state())}}
    if mesh.device.type == "cuda":
        record["rng"]["cuda"] = _b64(torch.cuda.get_rng_state(mesh.device))
    return record


def _restore_rng(path: str, manifest: dict, mesh) -> None:
    # the manifest's mesh as meshc.mesh takes it (world = dp × cp × tp × pp); MeshSpec's dp is the gradient group
    saved = spec_sizes(**{a: n for a, n in manifest["mesh"].items() if a in ("dp", "cp", "tp", "pp", "ep")})
    if manifest["world_size"] == mesh.world_size and MeshSpec(saved).sizes == mesh.sizes:
        rank = mesh.rank
    else:
        rank = mesh.coord("dp") % saved["dp"] * saved["tp"]  # dp coordinate kept, tp = pp = 0
    rng = read_json(os.path.join(path, f"rank_{rank:05d}.json"))["rng"]
    torch.set_rng_state(_unb64(rng["cpu"]))
    if mesh.device.type == "cuda" and "cuda" in rng:
        torch.cuda.set_rng_state(_unb64(rng["cuda"]), mesh.device)


def _b64(state: torch.Tensor) -> str:
    return base64.b64encode(state.cpu().numpy().tobytes()).decode()


def _unb64(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8).clone()


# ---------------------------------------------------------------------------------------- helpers
def latest(root: str | os.PathLike) -> str | None:
    """The complete checkpoint under `root` with the highest step (interrupted saves skipped), or None.
    A PATH.old without PATH (a save that died between its two renames) is the previous checkpoint: taken."""
    root = os.fspath(root)
    best = None
    names = set(os.listdir(root)) if os.path.isdir(root) else set()
    for name in sorted(names):
        folder = os.path.join(root, name)
        if name.endswith(".partial") or (name.endswith(".old") and name.removesuffix(".old") in names):
            continue
        if not os.path.isfile(os.path.join(folder, MANIFEST)):
            continue
        try:
            step = int(read_json(os.path.join(folder, MANIFEST))["step"])
        except (ValueError, KeyError, OSError):
            continue
        if best is None or step >= best[0]:
            best = (step, folder)
    return best[1] if best else None


def full_optimizer_state(job, optimizer: torch.optim.Optimizer) -> dict[str, dict[str, Any]]:
    """{fqn: {state name: whole tensor or value}} gathered from every rank's shards (a collective)."""
    fqn_of = {id(p): f for f, p in job.named_parameters()}
    mine = {fqn_of[id(p)]: st for p, st in optimizer.state.items()}
    names = [None] * job.mesh.world_size  # (shaped like the parameter, value if not) of every state, every rank
    dist.all_gather_object(names, {f: {k: (_shaped(v), None if _shaped(v) else _plain(v)) for k, v in st.items()}
                                   for f, st in mine.items()})
    merged: dict[str, dict] = {}
    for theirs in names:
        for f, st in theirs.items():
            merged.setdefault(f, {}).update(st)
    out: dict[str, dict] = {f: {} for f in merged}
    for f in sorted(merged):
        for name, (shaped, value) in sorted(merged[f].items()):
            if shaped:
                out[f][name] = job.whole_tensors({f: mine[f][name]} if f in mine else {}, [f])[f].clone()
            else:
                out[f][name] = value
    return out


def _shaped(v: Any) -> bool:
    return isinstance(v, torch.Tensor) and v.dim() > 0


def _plain(v: Any) -> Any:
    return v.item() if isinstance(v, torch.Tensor) else v


def _optimizers(job, given) -> list:
    if given is not None:
        return list(given)
    return job.live_optimizers()


def _owner(job, fqn: str) -> int:
    return job.pp_owner(fqn)


def _optim_key(i: int, fqn: str, name: str) -> str:
    return f"optim/{i}/{fqn}/{name}"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _json_extra(extra: dict | None) -> dict:
    extra = {} if extra is None else extra
    try:
        json.dumps(extra)
    except (TypeError, ValueError) as e:
        raise MeshcValueError(f"job.save: expected `extra` to be JSON (numbers, strings, lists, dicts), got {e}; "
                              "convert tensors with .tolist() or keep them in the model") from None
    if not isinstance(extra, dict):
        raise MeshcValueError(f"job.save: expected `extra` to be a dict, got {type(extra).__name__}")
    return extra


def _json_hyper(group: dict, cls: str) -> dict:
    out = {}
    for k, v in group.items():
        if k == "params":
            continue
        v = v.item() if isinstance(v, torch.Tensor) and v.dim() == 0 else v
        try:
            json.dumps(v)
        except (TypeError, ValueError):
            raise MeshcValueError(f"job.save: {cls} hyperparameter {k!r}: expected a JSON value, got "
                                  f"{type(v).__name__}; meshc stores hyperparameters as JSON") from None
        out[k] = v
    return out


PARTIAL_MARK = "meshc-partial"  # the first file of a save in progress: what makes a PATH.partial meshc's own


def _fresh_folder(folder: str) -> None:
    if os.path.isdir(folder):
        _remove_own(folder, "partial")  # a save that did not finish
    os.makedirs(folder)
    with open(os.path.join(folder, PARTIAL_MARK), "w") as f:
        f.write("a meshc checkpoint being written; removed or renamed when the save completes\n")


def _is_own(folder: str, kind: str) -> bool:
    """Did meshc write `folder`: a complete checkpoint (its manifest says so) or a save in progress (its mark)?"""
    if kind == "partial" and os.path.isfile(os.path.join(folder, PARTIAL_MARK)):
        return True
    try:
        return read_json(os.path.join(folder, MANIFEST)).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def _remove_own(folder: str, kind: str) -> None:
    """Delete a folder meshc wrote (`kind` "checkpoint" or "partial"); anything else is refused, untouched."""
    if not _is_own(folder, kind):
        raise MeshcValueError(f"job.save: expected {folder} to be a meshc {kind} folder to replace, got a folder "
                              f"without meshc's {MANIFEST if kind == 'checkpoint' else PARTIAL_MARK}; meshc deletes "
                              "only what it wrote: move it away or save elsewhere")
    shutil.rmtree(folder)


def _check_target(path: str) -> None:
    """Refuse, before anything is written, a save that would replace or delete what meshc did not write."""
    if os.path.exists(path) and not (os.path.isdir(path) and _is_own(path, "checkpoint")):
        what = "a folder" if os.path.isdir(path) else "a file"
        raise MeshcValueError(f"job.save: expected {path} to be absent or a meshc checkpoint, got {what} that is not "
                              f"one (no {MANIFEST} of format {FORMAT}); save into a new path, or move it away")
    for suffix, kind in ((".partial", "partial"), (".old", "checkpoint")):
        if os.path.exists(path + suffix) and not (os.path.isdir(path + suffix) and _is_own(path + suffix, kind)):
            raise MeshcValueError(f"job.save: expected {path + suffix} to be absent or meshc's own {kind} folder, got "
                                  f"something else; meshc would replace it: move it away or save elsewhere")


def _fsync_dir(folder: str) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _on_rank0(fn: Callable[[], None], group: dist.ProcessGroup | None = None) -> None:
    """Run `fn` on rank 0 while the others wait (on `group`, default the world); an error there is raised on
    every rank."""
    status = [None]
    if dist.get_rank() == 0:
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - re-raised below, on every rank
            status[0] = f"{type(e).__name__}: {e}"
            error = e
    dist.broadcast_object_list(status, src=0, group=group)
    if status[0] is not None:
        if dist.get_rank() == 0:
            raise error
        raise MeshcRuntimeError(f"checkpoint: rank 0 failed: {status[0]}")


def _agreed(mesh, fn: Callable[[], Any]) -> Any:
    """`fn()` on every rank; if it raises on any, an error is raised on all (none waits alone)."""
    value, error = None, None
    try:
        value = fn()
    except ValueError as e:
        error = e
    errors = [None] * mesh.world_size
    dist.all_gather_object(errors, None if error is None else str(error))
    if error is not None:
        raise error
    for rank, e in enumerate(errors):
        if e is not None:
            raise MeshcValueError(f"{e} (seen by rank {rank})")
    return value
