"""ZeRO-3 copy-in and copy-out around the parameter all-gather: `meshc::pack_cast`, `meshc::unpack`.

    flat = pack_cast(shards, torch.bfloat16)            # (S,): fp32 master shards -> one bf16 buffer
    gathered = all_gather(flat)                         # (W * S,): rank r's buffer at [r*S, (r+1)*S)
    params = unpack(gathered, shapes, world_size=W)     # full parameters, in gathered's dtype

Layout. Parameter t (numel m_t) is cut into W chunks of n_t elements (`shard_numels`, default
ceil(m_t / W)), the last zero-padded: rank r holds elements [r*n_t, (r+1)*n_t) of its flattened
parameter, so dim-0 sharding with padded rows (FSDP2) and flat-parameter sharding (ZeRO-3) both fit.
A rank's send buffer is its chunks back to back: S = sum(n_t), chunk t at offset o_t = sum(n_<t).
`pack_cast(tensors, dtype, world_size=W, shard_numels=n)` writes the whole (W * S,) layout from full
tensors (rank r's segment holds chunk r of each), which is unpack's inverse and its backward; with
W = 1 it is the plain concatenation a rank sends.

Fused: the cast and the copy of every tensor in one launch (a table of tensor addresses, offsets and
sizes, sent through pinned memory; one program column per tensor), instead of one cast and one copy
kernel per parameter. 16-byte aligned sizes and offsets (multiples of 8 bf16 elements) get vector
loads; others run ~20% slower.

Schemas (a custom op takes no list of lists, so unpack's shapes come flattened, ndims[t] sizes each):
    meshc::pack_cast(Tensor[] tensors, ScalarType dtype, SymInt world_size, SymInt[]? shard_numels) -> Tensor
    meshc::unpack(Tensor gathered, SymInt[] shapes, SymInt[] ndims, SymInt[] shard_numels, ScalarType dtype)
        -> Tensor[]
The Python functions `pack_cast` and `unpack` here take nested shapes and defaults.

Why unpack copies. (1) For W > 1 a parameter is not a view of the gathered buffer: its W chunks sit
S apart, and a (W * n_t)-row parameter cannot be viewed from stride-S chunks unless S = n_t. (2) A
custom op's outputs must not alias its inputs (torch.library checks this), so even W = 1 would need
a view op outside the custom-op machinery. (3) Copies free the gathered buffer as soon as unpack has
run, and each parameter can then be freed after its last use (DESIGN.md §4, ZeRO-3 memory); views
would keep the whole buffer alive until the last parameter dies. FSDP2 copies out too
(split_with_sizes_copy). The copy is one read and one write of the buffer, next to a W-times larger
all-gather.

Autograd: pack_cast's backward is unpack (cast back to the tensors' dtype, split); unpack's backward
is pack_cast (flatten into the padded layout, the reduce-scatter's input). Each is differentiable.
"""
from __future__ import annotations

import functools
from typing import Optional, Sequence

import torch
from torch import Tensor

from meshc.compiler.ir.errors import MeshcValueError
from meshc.kernels._lazy import lazy_triton

__all__ = ["pack_cast", "unpack", "triton_to_flat", "triton_from_flat"]

triton = tl = None  # bound by _triton() on first use (kernels/_lazy.py)


def pack_cast(tensors: Sequence[Tensor], dtype: torch.dtype, *, world_size: int = 1,
              shard_numels: Optional[Sequence[int]] = None) -> Tensor:
    """Cast and pack `tensors` into one flat (world_size * S,) buffer of `dtype` (module docstring)."""
    numels = None if shard_numels is None else [int(n) for n in shard_numels]
    return torch.ops.meshc.pack_cast(list(tensors), dtype, int(world_size), numels)


def unpack(gathered: Tensor, shapes: Sequence[Sequence[int]], *, world_size: int = 1,
           shard_numels: Optional[Sequence[int]] = None, dtype: Optional[torch.dtype] = None) -> list[Tensor]:
    """New tensors of `shapes` (in `dtype`, default gathered's) from a (world_size * S,) buffer."""
    shapes = [tuple(int(d) for d in shape) for shape in shapes]
    numels = _shard_numels([_numel(s) for s in shapes], world_size, shard_numels)
    flat_shapes = [d for shape in shapes for d in shape]
    return torch.ops.meshc.unpack(gathered, flat_shapes, [len(s) for s in shapes], numels,
                                  dtype or gathered.dtype)


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _shard_numels(numels: list[int], world_size: int, shard_numels: Optional[Sequence[int]]) -> list[int]:
    """n_t per tensor: given, or ceil(m_t / W); checked to cover each tensor."""
    if world_size < 1:
        raise MeshcValueError(f"zero_copy world_size: expected >= 1, got {world_size}")
    if shard_numels is None:
        return [-(-m // world_size) for m in numels]
    shard_numels = [int(n) for n in shard_numels]
    if len(shard_numels) != len(numels):
        raise MeshcValueError(f"zero_copy shard_numels: expected one per tensor ({len(numels)}), got "
                              f"{len(shard_numels)}")
    for t, (m, n) in enumerate(zip(numels, shard_numels)):
        if n * world_size < m:
            raise MeshcValueError(f"zero_copy shard_numels[{t}]: expected n * world_size >= {m} elements, "
                                  f"got {n} * {world_size}")
    return shard_numels


def _split_shapes(shapes: list[int], ndims: list[int]) -> list[list[int]]:
    if sum(ndims) != len(shapes) or min(ndims, default=0) < 0:
        raise MeshcValueError(f"unpack shapes: expected {sum(ndims)} sizes for ndims {ndims}, got {len(shapes)}")
    out, i = [], 0
    for nd in ndims:
        out.append(list(shapes[i:i + nd]))
        i += nd
    return out


def _offsets(numels: list[int]) -> list[int]:
    out, total = [], 0
    for n in numels:
        out.append(total)
        total += n
    return out


# ----------------------------------------------------------------------------------------------
# pack_cast
# ----------------------------------------------------------------------------------------------
@torch.library.custom_op("meshc::pack_cast", mutates_args=())
def _pack_cast_op(tensors: list[Tensor], dtype: torch.dtype, world_size: int,
                  shard_numels: Optional[list[int]]) -> Tensor:
    """CPU implementation: flatten, pad each tensor to world_size * n_t, interleave by rank, cast."""
    numels = _shard_numels([t.numel() for t in tensors], world_size, shard_numels)
    chunks = []  # each (W, n_t)
    for t, n in zip(tensors, numels):
        flat = t.reshape(-1).to(dtype)
        flat = torch.cat([flat, flat.new_zeros(world_size * n - flat.numel())])
        chunks.append(flat.view(world_size, n))
    if not chunks:
        return torch.empty(0, dtype=dtype)
    return torch.cat(chunks, dim=1).reshape(-1)


@_pack_cast_op.register_fake
def _pack_cast_fake(tensors, dtype, world_size, shard_numels):
    numels = _shard_numels([t.numel() for t in tensors], world_size, shard_numels)
    device = tensors[0].device if tensors else "cpu"
    return torch.empty(world_size * sum(numels), dtype=dtype, device=device)


@_pack_cast_op.register_kernel("cuda")
def _pack_cast_cuda(tensors, dtype, world_size, shard_numels):
    numels = _shard_numels([t.numel() for t in tensors], world_size, shard_numels)
    return triton_to_flat(tensors, dtype, world_size, numels)


def _pack_setup(ctx, inputs, output):
    tensors, _dtype, world_size, shard_numels = inputs
    ctx.shapes = [tuple(t.shape) for t in tensors]
    ctx.dtypes = [t.dtype for t in tensors]
    ctx.world_size = world_size
    ctx.numels = _shard_numels([t.numel() for t in tensors], world_size, shard_numels)


def _pack_backward(ctx, grad):
    if not ctx.shapes:
        return [], None, None, None
    grads = unpack(grad, ctx.shapes, world_size=ctx.world_size, shard_numels=ctx.numels, dtype=ctx.dtypes[0])
    return [g.to(dt) for g, dt in zip(grads, ctx.dtypes)], None, None, None


_pack_cast_op.register_autograd(_pack_backward, setup_context=_pack_setup)


# ----------------------------------------------------------------------------------------------
# unpack
# ----------------------------------------------------------------------------------------------
def _check_unpack(gathered: Tensor, shapes, ndims, shard_numels) -> tuple[list[list[int]], int]:
    """The per-tensor shapes and the world size W = gathered.numel() / S."""
    per_tensor = _split_shapes(shapes, ndims)
    if len(shard_numels) != len(per_tensor):
        raise MeshcValueError(f"unpack shard_numels: expected one per shape ({len(per_tensor)}), got "
                              f"{len(shard_numels)}")
    total = sum(shard_numels)
    if gathered.dim() != 1 or total == 0 or gathered.numel() % total:
        raise MeshcValueError(f"unpack gathered: expected a 1-D tensor of world_size * {total} elements, "
                              f"got shape {tuple(gathered.shape)}")
    world_size = gathered.numel() // total
    _shard_numels([_numel(s) for s in per_tensor], world_size, shard_numels)
    return per_tensor, world_size


@torch.library.custom_op("meshc::unpack", mutates_args=())
def _unpack_op(gathered: Tensor, shapes: list[int], ndims: list[int], shard_numels: list[int],
               dtype: torch.dtype) -> list[Tensor]:
    """CPU implementation: per tensor, its W chunks of the (W, S) buffer, trimmed, reshaped, copied."""
    per_tensor, world_size = _check_unpack(gathered, shapes, ndims, shard_numels)
    rows = gathered.view(world_size, -1)  # (W, S)
    out = []
    for shape, n, off in zip(per_tensor, shard_numels, _offsets(shard_numels)):
        full = rows[:, off:off + n].reshape(-1)[:_numel(shape)]
        out.append(torch.empty(shape, dtype=dtype, device=gathered.device).copy_(full.view(shape)))
    return out


@_unpack_op.register_fake
def _unpack_fake(gathered, shapes, ndims, shard_numels, dtype):
    per_tensor, _ = _check_unpack(gathered, shapes, ndims, shard_numels)
    return [gathered.new_empty(shape, dtype=dtype) for shape in per_tensor]


@_unpack_op.register_kernel("cuda")
def _unpack_cuda(gathered, shapes, ndims, shard_numels, dtype):
    per_tensor, world_size = _check_unpack(gathered, shapes, ndims, shard_numels)
    return triton_from_flat(gathered, per_tensor, dtype, shard_numels)


def _unpack_setup(ctx, inputs, output):
    gathered, shapes, ndims, shard_numels, _dtype = inputs
    ctx.shapes = _split_shapes(shapes, ndims)
    ctx.numels = shard_numels
    ctx.world_size = gathered.numel() // sum(shard_numels)
    ctx.dtype, ctx.device = gathered.dtype, gathered.device


def _unpack_backward(ctx, grads):
    grads = [torch.zeros(shape, dtype=ctx.dtype, device=ctx.device) if g is None else g
             for g, shape in zip(grads, ctx.shapes)]
    flat = pack_cast(grads, ctx.dtype, world_size=ctx.world_size, shard_numels=ctx.numels)
    return flat, None, None, None, None


_unpack_op.register_autograd(_unpack_backward, setup_context=_unpack_setup)


# ----------------------------------------------------------------------------------------------
# The Triton kernel: one program column per tensor (grid axis 1), a grid-stride loop over its
# W * ceil(n_t / BLOCK) blocks (axis 0). TABLE rows: (address, o_t, n_t, m_t), int64.
# ----------------------------------------------------------------------------------------------
def _copy_kernel(TABLE, FLAT, S, W, scale, TO_FLAT: tl.constexpr, LIST_DTYPE: tl.constexpr,
                 SCALE: tl.constexpr, ALIGN: tl.constexpr, BLOCK: tl.constexpr):
    row = TABLE + tl.program_id(1) * 4
    address, off, n, numel = tl.load(row), tl.load(row + 1), tl.load(row + 2), tl.load(row + 3)
    if ALIGN > 1:  # the host checked: addresses 16-byte aligned, o_t, n_t, m_t and S multiples of ALIGN
        address = tl.multiple_of(address, 16)
        off = tl.multiple_of(off, ALIGN)
        n = tl.multiple_of(n, ALIGN)
        numel = tl.multiple_of(numel, ALIGN)
    lst = address.to(tl.pointer_type(LIST_DTYPE))
    blocks = tl.cdiv(n, BLOCK)
    for b in range(tl.program_id(0), W * blocks, tl.num_programs(0)):
        r = b // blocks
        k0 = (b - r * blocks) * BLOCK
        k = k0 + tl.arange(0, BLOCK)
        li = r * n + k  # index in the tensor
        fi = r * S + off + k  # index in the flat buffer
        in_chunk = k < n
        valid = in_chunk & (li < numel)
        if TO_FLAT:
            v = tl.load(lst + li, mask=valid, other=0.0)
            if SCALE:
                v = v.to(tl.float32) * scale
            tl.store(FLAT + fi, v.to(FLAT.dtype.element_ty), mask=in_chunk)
        else:
            v = tl.load(FLAT + fi, mask=valid, other=0.0)
            tl.store(lst + li, v.to(LIST_DTYPE), mask=valid)


# _triton() imports triton and jits these kernels on first use (kernels/_lazy.py)
_triton = lazy_triton(globals(), ("_copy_kernel",))
_BLOCK, _WARPS = 2048, 4  # elements per block, warps per program (measured best on an H200)


def _tl_dtype(dtype: torch.dtype):
    _triton()
    table = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16,
             torch.float64: tl.float64}
    if dtype not in table:
        raise MeshcValueError(f"zero_copy Triton dtype: expected one of {list(table)}, got {dtype}")
    return table[dtype]


@functools.cache
def _sm_count_of(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _sm_count(device: torch.device) -> int:
    return _sm_count_of(device.index if device.index is not None else 0)


def _device_table(rows: list[tuple[int, int, int, int]], device: torch.device) -> Tensor:
    """The (T, 4) int64 table on `device`. On CUDA it goes through pinned memory, so the copy is
    asynchronous: from pageable memory the host would wait for the stream, and could not run ahead."""
    table = torch.tensor(rows, dtype=torch.int64)  # (T, 4)
    if device.type != "cuda":
        return table
    return table.pin_memory().to(device, non_blocking=True)  # torch keeps the pinned block until the copy ran


def _launch(flat: Tensor, tensors: list[Tensor], numels: list[int], world_size: int, to_flat: bool,
            scale: float = 1.0) -> None:
    """One launch per dtype among `tensors` (usually one): copy between them and `flat`."""
    _triton()
    offsets = _offsets(numels)
    total = sum(numels)
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        by_dtype.setdefault(t.dtype, []).append(i)
    for dtype, idx in by_dtype.items():
        rows = [(tensors[i].data_ptr(), offsets[i], numels[i], tensors[i].numel()) for i in idx]
        elem = 16 // min(dtype.itemsize, flat.dtype.itemsize)  # elements in 16 bytes of the narrower dtype
        aligned = (flat.data_ptr() % 16 == 0 and total % elem == 0
                   and all(a % 16 == 0 and o % elem == 0 and n % elem == 0 and m % elem == 0
                           for a, o, n, m in rows))
        most = max(-(-numels[i] // _BLOCK) for i in idx) * world_size
        cap = 4 if flat.device.type != "cuda" else max(1, 16 * _sm_count(flat.device) // len(idx))
        grid = (max(1, min(most, cap)), len(idx))
        _copy_kernel[grid](_device_table(rows, flat.device), flat, total, world_size, float(scale), TO_FLAT=to_flat,
                           LIST_DTYPE=_tl_dtype(dtype), SCALE=scale != 1.0, ALIGN=elem if aligned else 1,
                           BLOCK=_BLOCK, num_warps=_WARPS)


def triton_to_flat(tensors: Sequence[Tensor], dtype: torch.dtype, world_size: int, shard_numels: list[int],
                   scale: float = 1.0, out_numel: Optional[int] = None) -> Tensor:
    """The Triton pack_cast: (world_size * S,) buffer, or (out_numel,) with a zeroed tail."""
    tensors = [t.contiguous() for t in tensors]
    used = world_size * sum(shard_numels)
    device = tensors[0].device if tensors else "cpu"
    flat = torch.empty(used if out_numel is None else out_numel, dtype=dtype, device=device)
    _tl_dtype(dtype)
    if out_numel is not None and out_numel > used:
        flat[used:].zero_()
    if used:
        _launch(flat, tensors, shard_numels, world_size, to_flat=True, scale=scale)
    return flat


def triton_from_flat(gathered: Tensor, shapes: list[list[int]], dtype: torch.dtype,
                     shard_numels: list[int]) -> list[Tensor]:
    """The Triton unpack: new tensors of `shapes` in `dtype`."""
    gathered = gathered.contiguous()
    out = [torch.empty(shape, dtype=dtype, device=gathered.device) for shape in shapes]
    if gathered.numel():
        _launch(gathered, out, list(shard_numels), gathered.numel() // sum(shard_numels), to_flat=False)
    return out
