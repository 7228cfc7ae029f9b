"""The on-disk format of a meshc checkpoint: where each rank's elements sit in the whole tensor, DCP
planners that write and read them, and metadata kept as JSON (never a pickle).

Layout. A rank holds, for every parameter (and every optimizer state shaped like one), a local tensor
made from the whole by the spec's placements (runtime/sharding.local_shard): a slice along each
`S(dim, chunks)` axis, then, for ZeRO (`F`), a contiguous range of the flattened, zero-padded result.
DTensor cannot express the F ranges, so this module describes a local tensor as *pieces*: boxes of the
whole tensor (offsets, sizes) with the local elements that fill them. A flat range of a row-major
tensor is a few boxes (a partial first row, whole rows, a partial last row, recursively over dims);
each box maps to whole-tensor coordinates dim by dim through the inverse of every S slice (a slice
with c chunks splits a box at block boundaries). Padding is never written.

DCP then does the rest as it does for DTensor: each piece is one chunk (a WriteItem); every rank
writes its own pieces into its own file, in parallel; a loader on any other plan computes the
pieces *it* needs and DCP's resharding reads exactly the overlapping parts of the saved chunks
(`create_read_items_for_chunk_list`). Each box is written by one rank: among the ranks that hold the
same elements (replicas on an R axis, copies of a tied parameter on several pp ranks) the writer is
chosen by a hash of the key, so replicated state is spread over ranks instead of all landing on rank 0.

Safety. DCP writes its Metadata as a pickle (`.metadata`) and reads it with `pickle.load`. Here the
coordinator writes it as JSON instead (`dcp.json`), and the reader rebuilds it from that JSON; the data
files hold tensors written by `torch.save` and are read by DCP with `torch.load(weights_only=True)`,
which refuses anything but tensors. A folder holding any file the manifest does not list (such as a
`.metadata` pickle) is refused before anything is read.
"""
from __future__ import annotations

import bisect
import itertools
import json
import math
import os
import zlib
from dataclasses import dataclass

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex, StorageMeta,
                                                   TensorProperties, TensorStorageMetadata)
from torch.distributed.checkpoint.planner import (LoadPlan, LoadPlanner, ReadItem, SavePlan, TensorWriteData,
                                                  WriteItem, WriteItemType)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from meshc.compiler.ir import torch_compat as compat
from meshc.compiler.ir.errors import MeshcInternalError, MeshcValueError
from meshc.compiler.ir.placement import (FlatShard, Shard, Whole, block_sizes, data_axis, local_blocks, local_length,
                                         owned_elsewhere, split_over)

from meshc.runtime.monitor import failures

FORMAT = "meshc-checkpoint"
VERSION = 1
MANIFEST = "meshc.json"  # written last, by rank 0: a folder without it is an interrupted save
DCP_METADATA = "dcp.json"


@dataclass(frozen=True)
class Piece:
    """A box of the whole tensor and the local elements that fill it (a view into the local tensor)."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    view: torch.Tensor


# ---------------------------------------------------------------------------------------- layout
def pieces(local: torch.Tensor, shape: tuple, placements: dict, sizes: dict, coords: dict,
           writer: bool = False) -> list[Piece]:
    """The boxes of the whole tensor (global `shape`) that `local` holds on the rank at `coords`. With `writer`,
    the boxes of blocks every rank of an axis holds whole (Whole chunks) only on that axis' rank 0, so that the
    ranks' boxes tile the tensor once."""
    shape = tuple(shape)
    if math.prod(shape) == 0 or any(owned_elsewhere(p, coords[a]) for a, p in placements.items()):
        return []  # nothing, or another rank's whole
    steps, dims, lengths = [], list(shape), []
    for axis, p in placements.items():  # the slices local_shard applies, in its order
        if isinstance(p, Shard) and sizes[axis] > 1:
            dims[p.dim] = local_length(p, dims[p.dim], sizes[axis])
            steps.append((p.dim, p.chunks, sizes[axis], coords[axis]))
            lengths.append(dims[p.dim])
    unflat = tuple(dims)
    flat_axes = [a for a, p in placements.items() if isinstance(p, FlatShard)]
    if len(flat_axes) > 1:
        raise MeshcInternalError(f"checkpoint: expected at most one flat (ZeRO) axis, got {flat_axes}")
    if flat_axes:
        n, k = sizes[flat_axes[0]], coords[flat_axes[0]]
        numel = math.prod(unflat)
        s = -(-numel // n)
        lo, hi = k * s, min((k + 1) * s, numel)
        flat = local.reshape(-1)
        boxes = [(start, size, flat[off - lo: off - lo + math.prod(size)].view(size))
                 for start, size, off in _flat_boxes(lo, hi, unflat)]
    else:
        boxes = [((0,) * len(unflat), unflat, local)]
    out = []
    for start, size, view in boxes:
        per_dim = [_segments(d, start[d], size[d], steps, lengths) for d in range(len(unflat))]
        for combo in itertools.product(*per_dim):
            if writer and any(copy for *_, copy in combo):
                continue
            v = view
            for d, (loc, _, length, _) in enumerate(combo):
                v = v.narrow(d, loc - start[d], length)
            out.append(Piece(tuple(g for _, g, _, _ in combo), tuple(n for _, _, n, _ in combo), v))
    return out


def _flat_boxes(a: int, b: int, shape: tuple) -> list[tuple[tuple, tuple, int]]:
    """Elements [a, b) of a row-major tensor of `shape` as boxes: (start, size, flat offset of start)."""
    if a >= b:
        return []
    if not shape:
        return [((), (), 0)]
    inner = math.prod(shape[1:])
    out = []
    row = a // inner
    if a % inner:  # a partial first row
        end = min(b, (row + 1) * inner)
        out += [((row, *st), (1, *sz), row * inner + off) for st, sz, off in
                _flat_boxes(a - row * inner, end - row * inner, shape[1:])]
        a = end
    if a >= b:
        return out
    r0, r1 = a // inner, b // inner
    if r1 > r0:  # whole rows
        out.append(((r0,) + (0,) * (len(shape) - 1), (r1 - r0, *shape[1:]), r0 * inner))
    if b > r1 * inner:  # a partial last row
        out += [((r1, *st), (1, *sz), r1 * inner + off) for st, sz, off in _flat_boxes(0, b - r1 * inner, shape[1:])]
    return out


def _segments(dim: int, start: int, length: int, steps: list, lengths: list) -> list[tuple[int, int, int, bool]]:
    """Local interval [start, start+length) of `dim` as (local start, whole start, length, copy) segments; copy:
    the segment lies in a block held whole by every rank of an axis, and this rank is not that axis' rank 0."""
    segs = [(start, start, length, False)]
    for (d, chunks, n, k), after in reversed(list(zip(steps, lengths))):
        if d != dim:
            continue
        blocks = block_sizes(chunks, after * n)  # tuple chunks are their own sizes
        local = local_blocks(chunks, sum(blocks), n)  # a rank's part of each block
        starts = list(itertools.accumulate([0] + list(local[:-1])))  # where each block's part begins, locally
        begins = list(itertools.accumulate([0] + [int(b) for b in blocks[:-1]]))  # and the block, globally
        out = []
        for loc, cur, left, copy in segs:
            while left > 0:
                b = bisect.bisect_right(starts, cur) - 1
                j = cur - starts[b]
                take = min(left, local[b] - j)
                whole = isinstance(blocks[b], Whole)
                out.append((loc, begins[b] + (0 if whole else k * local[b]) + j, take, copy or (whole and k != 0)))
                loc, cur, left = loc + take, cur + take, left - take
        segs = out
    return segs


def writes(key: str, placements: dict, sizes: dict, coords: dict, pp_owner: int) -> bool:
    """Whether the rank at `coords` writes its pieces of `key`: among the ranks holding the same
    elements (the replicas along axes without a shard), one chosen by a hash of the key."""
    if coords.get("pp", 0) != pp_owner:
        return False
    replicated = [a for a in (data_axis(placements), "dpr", "tp")  # experts' replicas: edp; hybrid ZeRO's: dpr
                  if sizes.get(a, 1) > 1 and not split_over(placements.get(a))]
    choice = zlib.crc32(key.encode()) % max(1, math.prod(sizes[a] for a in replicated))
    for a in reversed(replicated):
        choice, want = divmod(choice, sizes[a])
        if coords[a] != want:
            return False
    return True


def scalar_writer(coords: dict, pp_owner: int) -> bool:
    """0-d values held alike by every rank holding the parameter (an optimizer's step count)."""
    return coords.get("pp", 0) == pp_owner and all(coords.get(a, 0) == 0 for a in ("dp", "tp"))


# ---------------------------------------------------------------------------------------- DCP planners
class PieceSavePlanner(DefaultSavePlanner):
    """Saves given pieces: `items[key] = (global shape, dtype, [Piece])`; DCP's global planning checks
    that the pieces of all ranks tile every tensor exactly (no gap, no overlap)."""

    def __init__(self, items: dict[str, tuple[tuple, torch.dtype, list[Piece]]], staged: bool = False):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.items, self.staged = items, staged
        self._data: dict[tuple[str, tuple], torch.Tensor] = {}

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator: bool = False) -> None:
        self.state_dict, self.is_coordinator = state_dict, is_coordinator

    def create_local_plan(self) -> SavePlan:
        out = []
        for key, (shape, dtype, parts) in self.items.items():
            props = TensorProperties(dtype=dtype)
            for p in parts:
                self._data[(key, p.offsets)] = p.view
                chunk = ChunkStorageMetadata(offsets=torch.Size(p.offsets), sizes=torch.Size(p.sizes))
                data = TensorWriteData(chunk=chunk, properties=props, size=torch.Size(shape))
                out.append(WriteItem(index=MetadataIndex(key, torch.Size(p.offsets)), type=WriteItemType.SHARD,
                                     tensor_data=data))
        self.plan = SavePlan(out)
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor:
        view = self._data[(write_item.index.fqn, tuple(write_item.index.offset))]
        if self.staged:  # a private contiguous CPU copy already (async_save.stage)
            return view
        return view.detach().to("cpu", copy=True).contiguous()  # its own storage: torch.save writes whole storages


class PieceLoadPlanner(LoadPlanner):
    """Loads into given pieces: `items[key] = (global shape, [Piece])`, each view filled in place."""

    def __init__(self, items: dict[str, tuple[tuple, list[Piece]]]):
        self.items = items

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        self.metadata = metadata

    def create_local_plan(self) -> LoadPlan:
        reads: list[ReadItem] = []
        for key, (shape, parts) in self.items.items():
            if not parts:  # nothing held here (an empty tensor)
                continue
            md = self.metadata.state_dict_metadata.get(key)
            if md is None:
                raise MeshcValueError(f"checkpoint: expected a tensor {key!r} in the checkpoint, got none; it was "
                                      "saved from another model or without this optimizer")
            if tuple(md.size) != tuple(shape):
                raise MeshcValueError(f"checkpoint: {key}: expected global shape {tuple(shape)}, got {tuple(md.size)} "
                                      "in the checkpoint; load it into the model it was saved from")
            chunks = [ChunkStorageMetadata(torch.Size(p.offsets), torch.Size(p.sizes)) for p in parts]
            reads += create_read_items_for_chunk_list(key, md, chunks)
        return LoadPlan(reads)

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        return global_plan

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        return central_plan

    def load_bytes(self, read_item: ReadItem, value) -> None:
        raise MeshcValueError(f"checkpoint: {read_item.dest_index.fqn}: expected a tensor, got a pickled object; meshc "
                              "checkpoints hold tensors only")

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        view = self.items[read_item.dest_index.fqn][1][read_item.dest_index.index].view
        for d, (off, n) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            view = view.narrow(d, off, n)
        return view

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass


# ---------------------------------------------------------------------------------------- JSON metadata
class JsonWriter(FileSystemWriter):
    """DCP's file-system writer, with its metadata written as JSON instead of a pickle."""

    def finish(self, metadata: Metadata, results) -> None:
        storage = [wr for rank_results in results for wr in rank_results]
        doc = {"tensors": {key: {"dtype": str(md.properties.dtype).removeprefix("torch."), "size": list(md.size),
                                 "chunks": [[list(c.offsets), list(c.sizes)] for c in md.chunks]}
                           for key, md in metadata.state_dict_metadata.items()},
               "storage": [[wr.index.fqn, list(wr.index.offset), wr.storage_data.relative_path,
                            wr.storage_data.offset, wr.storage_data.length] for wr in storage]}
        write_json(os.path.join(self.path, DCP_METADATA), doc)


class JsonReader(FileSystemReader):
    """DCP's file-system reader over the JSON metadata: nothing read here is unpickled."""

    def __init__(self, path: str, files: set[str]):
        super().__init__(path)
        self.files = files

    def read_metadata(self) -> Metadata:  # no **kwargs: DCP must not fall back to a rank's pickled metadata
        doc = read_json(os.path.join(self.path, DCP_METADATA))
        tensors, storage = {}, {}
        for key, md in doc["tensors"].items():
            chunks = [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in md["chunks"]]
            props = TensorProperties(dtype=parse_dtype(md["dtype"]))
            tensors[key] = TensorStorageMetadata(props, torch.Size(md["size"]), chunks)
        for key, offset, path, start, length in doc["storage"]:
            if path not in self.files:
                raise MeshcValueError(f"checkpoint {self.path}: expected data files listed in {MANIFEST}, got a "
                                      f"reference to {path!r}; the checkpoint is corrupt or was edited")
            storage[MetadataIndex(key, torch.Size(offset))] = compat.dcp_storage_info(path, int(start), int(length))
        meta = StorageMeta(load_id=self.load_id)
        return Metadata(state_dict_metadata=tensors, storage_data=storage, storage_meta=meta)


def read_pieces(path: str, manifest: dict, items: dict, no_dist: bool) -> None:
    """DCP's load of a checkpoint folder into the pieces `items[key] = (global shape, [Piece])`; a file DCP cannot
    read (torch.load(weights_only=True) refuses anything but tensors) becomes a ValueError naming the rank."""
    try:
        dcp.load({}, storage_reader=JsonReader(path, set(manifest["files"])), planner=PieceLoadPlanner(items),
                 no_dist=no_dist)
    except CheckpointException as e:
        if failures.is_comm_failure(e):
            raise
        rank, error = next(iter(e.failures.items()))
        error = error[0] if isinstance(error, tuple) else error  # DCP keeps (exception, stack)
        first = str(error).strip().splitlines()[0][:400] if str(error).strip() else type(error).__name__
        raise MeshcValueError(f"checkpoint {path}: expected readable tensors, got an error on rank {rank}: {first}; "
                              "the checkpoint is corrupt or was edited") from None


def model_key(fqn: str) -> str:
    """The DCP key of a parameter or buffer."""
    return f"model/{fqn}"


def parse_dtype(name: str) -> torch.dtype:
    value = getattr(torch, name, None) if isinstance(name, str) and name.isidentifier() else None
    if not isinstance(value, torch.dtype):
        raise MeshcValueError(f"checkpoint: expected a torch dtype name such as 'float32', got {name!r}")
    return value


def write_json(path: str, doc: dict) -> None:
    """Write and fsync (a checkpoint must be on disk before it is renamed into place)."""
    with open(path, "w") as f:
        json.dump(doc, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())


def read_json(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


# ---------------------------------------------------------------------------------------- folder checks
def check_folder(path: str) -> dict:
    """The manifest of a complete checkpoint folder; a clear error for anything else."""
    if not os.path.isdir(path):
        hint = ""
        if os.path.isdir(path + ".partial"):
            hint = (f"; {path}.partial is a save that did not finish (a crash during job.save): load an "
                    "earlier checkpoint")
        elif os.path.isdir(path + ".old"):
            hint = f"; {path}.old is the previous checkpoint, left by a save interrupted while renaming: rename it back"
        raise MeshcValueError(f"checkpoint: expected a checkpoint folder at {path}, got nothing there{hint}")
    manifest_path = os.path.join(path, MANIFEST)
    if not os.path.isfile(manifest_path):
        raise MeshcValueError(f"checkpoint {path}: expected a complete checkpoint with {MANIFEST}, got a folder "
                              "without it (a partial save, or not a meshc checkpoint); load an earlier checkpoint")
    manifest = read_json(manifest_path)
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise MeshcValueError(f"checkpoint {path}: expected format {FORMAT} version {VERSION}, got "
                              f"{manifest.get('format')!r} version {manifest.get('version')!r}")
    files = manifest["files"]
    for name in files:
        if not isinstance(name, str) or os.path.basename(name) != name or name in ("", ".", ".."):
            raise MeshcValueError(f"checkpoint {path}: expected {MANIFEST} to list plain file names inside the folder, "
                                  f"got {name!r}; the checkpoint is corrupt or was edited")
    for name in sorted(set(os.listdir(path)) - set(files) - {MANIFEST}):
        raise MeshcValueError(f"checkpoint {path}: expected only the files its {MANIFEST} lists, got an unexpected "
                              f"{name!r}; meshc never writes pickles and refuses to read a folder that holds one "
                              "(remove the file if you trust it)")
    for name, size in files.items():
        got = os.path.getsize(os.path.join(path, name)) if os.path.isfile(os.path.join(path, name)) else None
        if got != size:
            raise MeshcValueError(f"checkpoint {path}: expected {name} of {size} bytes, got "
                                  f"{'no file' if got is None else f'{got} bytes'}; the checkpoint is incomplete or "
                                  "corrupt")
    return manifest
