"""Fused bias + dropout + residual add + LayerNorm/RMSNorm: `meshc::bias_dropout_add_norm`.

    s = residual + dropout(x + bias, p)        # the new residual stream, returned
    y = norm(s) * weight (+ norm_bias)         # LayerNorm (with norm_bias) or RMSNorm

Where it sits: right after a row-parallel linear's all-reduce (Megatron's attention output and MLP
down projections), or after sequence parallel's reduce-scatter, where the next layer's norm follows.
Unfused, torch reads and writes the (N, H) activation five times (bias add, dropout, mask, add, norm);
fused, one pass reads x and residual and writes y and s, the least a pre-norm block can move.

Dropout randomness. The mask is counter-based, never stored: `rng` is an int64 tensor `[seed, offset]`
on the input's device. Row `row` of the flattened (N, H) input owns the Philox counters
`offset + row * ceil(H / 4) + j`; counter j gives four uniforms (`tl.rand4x`: Philox-4x32, 10 rounds,
as floats in [0, 1)) for columns 4j .. 4j+3, and a column is kept iff its uniform >= p. The Triton
kernels call `tl.rand4x` (one Philox per four elements); the CPU implementation runs the same Philox in
int64 torch arithmetic (`philox_uniform4`), bit for bit, so a mask is the same on CPU and GPU, and
backward regenerates exactly the mask forward used from the saved `rng`. Kept values are scaled by
1/(1-p). Under sequence parallel, `offset = rank * rows * ceil(H / 4)` makes each rank's mask the
matching rows of the unsharded mask. `new_rng(device)` draws a fresh `rng` from torch's generator.

Dtypes: x and residual share the shape (..., H); y comes back in x's dtype, s in residual's dtype
(an fp32 residual stream is allowed); math is fp32; the norm reads s after rounding to its dtype so
backward, which recomputes mean and rstd from the saved s, sees the same numbers.

CUDA runs the Triton kernels: forward one row per program; backward G programs striding over the
rows, each keeping fp32 partial sums of d_weight, d_norm_bias and d_bias in registers, summed by torch.
Triton is imported on first use (see `_triton`), so importing meshc needs no triton.

Schemas:
    meshc::bias_dropout_add_norm(Tensor x, Tensor? bias, Tensor residual, Tensor weight, Tensor? norm_bias,
        Tensor? rng, float p, str norm, float eps) -> (y, s)
    meshc::bias_dropout_add_norm_backward(Tensor grad_y, Tensor? grad_s, Tensor s, Tensor weight, Tensor? rng,
        float p, str norm, float eps, ScalarType x_dtype) -> (d_residual, d_x, d_params)
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
from torch import Tensor

from meshc.compiler.ir.errors import MeshcValueError
from meshc.kernels._lazy import lazy_triton

__all__ = ["bias_dropout_add_norm", "new_rng", "philox_uniform4", "triton_forward", "triton_backward"]

NORMS = ("layernorm", "rmsnorm")
MAX_TRITON_HIDDEN = 32768  # one row lives in registers
_M32 = 0xFFFFFFFF
triton = tl = None  # bound by _triton() on first use (kernels/_lazy.py)


# ----------------------------------------------------------------------------------------------
# Public entry point and checks
# ----------------------------------------------------------------------------------------------
def new_rng(device: torch.device | str = "cpu") -> Tensor:
    """A fresh dropout state `[seed, offset]` (int64) drawn from torch's generator for `device`."""
    return torch.randint(0, 2**62, (2,), dtype=torch.int64, device=device)


def bias_dropout_add_norm(x: Tensor, bias: Optional[Tensor], residual: Tensor, weight: Tensor,
                          norm_bias: Optional[Tensor] = None, *, p: float = 0.0, norm: str = "layernorm",
                          eps: float = 1e-5, rng: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """`(norm(s), s)` with `s = residual + dropout(x + bias, p)`; draws `rng` when p > 0 and none is given."""
    if p > 0 and rng is None:
        rng = new_rng(x.device)
    return torch.ops.meshc.bias_dropout_add_norm(x, bias, residual, weight, norm_bias, rng if p > 0 else None,
                                                 float(p), norm, float(eps))


def _check(x, bias, residual, weight, norm_bias, rng, p, norm):
    hidden = x.shape[-1]
    if x.dim() < 1 or residual.shape != x.shape:
        raise MeshcValueError(f"bias_dropout_add_norm residual: expected shape {tuple(x.shape)}, "
                              f"got {tuple(residual.shape)}")
    for name, t in (("bias", bias), ("weight", weight), ("norm_bias", norm_bias)):
        if t is not None and tuple(t.shape) != (hidden,):
            raise MeshcValueError(f"bias_dropout_add_norm {name}: expected shape ({hidden},), got {tuple(t.shape)}")
    if norm not in NORMS:
        raise MeshcValueError(f"bias_dropout_add_norm norm: expected one of {NORMS}, got {norm!r}")
    if norm == "rmsnorm" and norm_bias is not None:
        raise MeshcValueError("bias_dropout_add_norm norm_bias: expected None for rmsnorm, got a tensor")
    if not 0.0 <= p < 1.0:
        raise MeshcValueError(f"bias_dropout_add_norm p: expected 0 <= p < 1, got {p}")
    if p > 0 and (rng is None or rng.dtype != torch.int64 or tuple(rng.shape) != (2,)):
        got = None if rng is None else f"{rng.dtype} {tuple(rng.shape)}"
        raise MeshcValueError(f"bias_dropout_add_norm rng: expected an int64 tensor [seed, offset] when p > 0 "
                              f"(see new_rng), got {got}")


# ----------------------------------------------------------------------------------------------
# Philox in torch: bit-identical to triton.language.rand
# ----------------------------------------------------------------------------------------------
def _mulhilo32(a: int, x: Tensor) -> tuple[Tensor, Tensor]:
    """High and low 32 bits of a * x for a 32-bit constant and uint32 values held in int64."""
    xh, xl = x >> 16, x & 0xFFFF
    low, high = a * xl, a * xh  # each < 2**48: no int64 overflow
    return (high + (low >> 16)) >> 16, (((high & 0xFFFF) << 16) + low) & _M32


def philox_uniform4(rng: Tensor, counters: Tensor) -> Tensor:
    """`tl.rand4x(seed, counters)` in torch: four float32 uniforms in [0, 1) per counter. # (*c, 4)"""
    c0, c1 = counters & _M32, (counters >> 32) & _M32
    c2 = c3 = torch.zeros_like(c0)
    k0, k1 = rng[0] & _M32, (rng[0] >> 32) & _M32
    for _ in range(10):
        hi_b, lo_b = _mulhilo32(0xCD9E8D57, c2)
        hi_a, lo_a = _mulhilo32(0xD2511F53, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0, k1 = (k0 + 0x9E3779B9) & _M32, (k1 + 0xBB67AE85) & _M32
    words = torch.stack([c0, c1, c2, c3], dim=-1)
    signed = torch.where(words >= 2**31, words - 2**32, words)  # bitcast to int32
    signed = torch.where(signed < 0, ~signed, signed).to(torch.int32)
    return signed.to(torch.float32) * torch.tensor(4.6566127342e-10, dtype=torch.float32, device=rng.device)


def _keep_mask(rng: Tensor, shape, p: float) -> Tensor:
    """The kept elements of a (..., H) tensor (module docstring: Dropout randomness). # (..., H)"""
    hidden = shape[-1]
    rows, quads = 1, -(-hidden // 4)
    for d in shape[:-1]:
        rows *= d
    counters = rng[1] + torch.arange(rows * quads, dtype=torch.int64, device=rng.device)
    u = philox_uniform4(rng, counters).view(rows, quads * 4)[:, :hidden]
    return (u >= torch.tensor(p, dtype=torch.float32, device=u.device)).view(shape)


def _scale(p: float) -> float:
    return 1.0 / (1.0 - p)


def _acc(t: Tensor) -> Tensor:
    """The math dtype of the CPU path: fp32, or fp64 for fp64 inputs (so gradcheck can run)."""
    return t.double() if t.dtype == torch.float64 else t.float()


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


# ----------------------------------------------------------------------------------------------
# The custom ops and their CPU (pure torch) implementations
# ----------------------------------------------------------------------------------------------
def _norm_stats(s: Tensor, norm: str, eps: float) -> tuple[Tensor, Tensor]:
    """xhat and rstd of fp32 rows. # (N, H), (N, 1)"""
    if norm == "layernorm":
        s = s - s.mean(-1, keepdim=True)
    rstd = torch.rsqrt((s * s).mean(-1, keepdim=True) + eps)
    return s * rstd, rstd


@torch.library.custom_op("meshc::bias_dropout_add_norm", mutates_args=())
def _op(x: Tensor, bias: Optional[Tensor], residual: Tensor, weight: Tensor, norm_bias: Optional[Tensor],
        rng: Optional[Tensor], p: float, norm: str, eps: float) -> tuple[Tensor, Tensor]:
    """CPU implementation (any device without a registered kernel): plain torch, fp32 math."""
    _check(x, bias, residual, weight, norm_bias, rng, p, norm)
    h = _acc(x)  # (..., H)
    if bias is not None:
        h = h + _acc(bias)
    if p > 0:
        h = torch.where(_keep_mask(rng, h.shape, p), h * _scale(p), 0.0)
    s = (_acc(residual) + h).to(residual.dtype)
    xhat, _ = _norm_stats(_acc(s), norm, eps)
    y = xhat * _acc(weight)
    if norm_bias is not None:
        y = y + _acc(norm_bias)
    # contiguous as layer_norm's output is: the graph views the results afterwards, and a broadcast over a
    # non-contiguous residual (a transposed activation) would otherwise hand back permuted strides
    return y.to(x.dtype).contiguous(), s.contiguous()


@_op.register_fake
def _op_fake(x, bias, residual, weight, norm_bias, rng, p, norm, eps):
    _check(x, bias, residual, weight, norm_bias, rng, p, norm)
    return x.new_empty(x.shape), residual.new_empty(residual.shape)


@_op.register_kernel("cuda")
def _op_cuda(x, bias, residual, weight, norm_bias, rng, p, norm, eps):
    _check(x, bias, residual, weight, norm_bias, rng, p, norm)
    return triton_forward(x, bias, residual, weight, norm_bias, rng, p, norm, eps)


def _writes_dx(p: float, x_dtype: torch.dtype, s: Tensor) -> bool:
    """Backward returns a separate d_x only when it differs from d_residual."""
    return p > 0 or x_dtype != s.dtype


@torch.library.custom_op("meshc::bias_dropout_add_norm_backward", mutates_args=())
def _bwd_op(grad_y: Tensor, grad_s: Optional[Tensor], s: Tensor, weight: Tensor, rng: Optional[Tensor],
            p: float, norm: str, eps: float, x_dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """`(d_residual, d_x, d_params)`: d_x is empty (0,) when it would equal d_residual; d_params is
    (3, H) = [d_weight, d_norm_bias, d_bias] in fp32 (fp64 for fp64 s). CPU implementation."""
    hidden = s.shape[-1]
    s2, dy = _acc(s.reshape(-1, hidden)), _acc(grad_y.reshape(-1, hidden))  # (N, H)
    xhat, rstd = _norm_stats(s2, norm, eps)
    wdy = dy * _acc(weight)
    ds = wdy - xhat * (xhat * wdy).mean(-1, keepdim=True)
    if norm == "layernorm":
        ds = ds - wdy.mean(-1, keepdim=True)
    ds = ds * rstd
    if grad_s is not None:
        ds = ds + _acc(grad_s.reshape(-1, hidden))
    dx = ds
    if p > 0:
        dx = torch.where(_keep_mask(rng, ds.shape, p), ds * _scale(p), 0.0)
    d_params = torch.stack([(dy * xhat).sum(0), dy.sum(0), dx.sum(0)])  # (3, H)
    d_x = dx.to(x_dtype).view(s.shape) if _writes_dx(p, x_dtype, s) else s.new_empty(0, dtype=x_dtype)
    return ds.to(s.dtype).view(s.shape), d_x, d_params


@_bwd_op.register_fake
def _bwd_op_fake(grad_y, grad_s, s, weight, rng, p, norm, eps, x_dtype):
    d_x = torch.empty_like(s, dtype=x_dtype) if _writes_dx(p, x_dtype, s) else s.new_empty(0, dtype=x_dtype)
    return torch.empty_like(s), d_x, s.new_empty((3, s.shape[-1]), dtype=_acc_dtype(s.dtype))


@_bwd_op.register_kernel("cuda")
def _bwd_op_cuda(grad_y, grad_s, s, weight, rng, p, norm, eps, x_dtype):
    return triton_backward(grad_y, grad_s, s, weight, rng, p, norm, eps, x_dtype)


def _setup_context(ctx, inputs, output):
    x, bias, _residual, weight, norm_bias, rng, p, norm, eps = inputs
    ctx.save_for_backward(output[1], weight, rng)
    ctx.args = (p, norm, eps, x.dtype)
    ctx.dtypes = (None if bias is None else bias.dtype, None if norm_bias is None else norm_bias.dtype)


def _backward(ctx, grad_y, grad_s):
    s, weight, rng = ctx.saved_tensors
    d_res, d_x, d_params = torch.ops.meshc.bias_dropout_add_norm_backward(grad_y, grad_s, s, weight, rng,
                                                                          *ctx.args)
    if d_x.numel() == 0 and d_res.numel() != 0:
        d_x = d_res
    bias_dtype, nb_dtype = ctx.dtypes
    d_bias = None if bias_dtype is None else d_params[2].to(bias_dtype)
    d_nb = None if nb_dtype is None else d_params[1].to(nb_dtype)
    return d_x, d_bias, d_res, d_params[0].to(weight.dtype), d_nb, None, None, None, None


_op.register_autograd(_backward, setup_context=_setup_context)


# ----------------------------------------------------------------------------------------------
# Triton kernels (plain functions here, jitted by _triton() on first use)
# ----------------------------------------------------------------------------------------------
def _fwd_kernel(X, B, R, W, NB, RNG, Y, S, H, stride_x, stride_r, stride_y, stride_s, p, scale, eps,
                HAS_BIAS: tl.constexpr, HAS_NB: tl.constexpr, DROPOUT: tl.constexpr, RMS: tl.constexpr,
                BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    m = cols < H
    h = tl.load(X + row * stride_x + cols, mask=m, other=0.0).to(tl.float32)
    if HAS_BIAS:
        h += tl.load(B + cols, mask=m, other=0.0).to(tl.float32)
    if DROPOUT:
        h = tl.where(_keep(RNG, row, H, p, BLOCK), h * scale, 0.0)
    s = h + tl.load(R + row * stride_r + cols, mask=m, other=0.0).to(tl.float32)
    s = s.to(S.dtype.element_ty)
    tl.store(S + row * stride_s + cols, s, mask=m)
    xhat, _ = _row_stats(s.to(tl.float32), m, H, eps, RMS)
    y = xhat * tl.load(W + cols, mask=m, other=0.0).to(tl.float32)
    if HAS_NB:
        y += tl.load(NB + cols, mask=m, other=0.0).to(tl.float32)
    tl.store(Y + row * stride_y + cols, y.to(Y.dtype.element_ty), mask=m)


def _keep(RNG, row, H, p, BLOCK: tl.constexpr):
    """This row's kept columns: uniform 4j+i is output i of Philox counter offset + row * ceil(H/4) + j."""
    counters = tl.load(RNG + 1) + row * ((H + 3) // 4) + tl.arange(0, BLOCK // 4)
    u0, u1, u2, u3 = tl.rand4x(tl.load(RNG), counters)
    return tl.interleave(tl.interleave(u0, u2), tl.interleave(u1, u3)) >= p


def _row_stats(s, m, H, eps, RMS: tl.constexpr):
    """xhat and rstd of one fp32 row whose masked-off columns hold 0."""
    if not RMS:
        s = tl.where(m, s - tl.sum(s, axis=0) / H, 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(s * s, axis=0) / H + eps)
    return s * rstd, rstd


def _bwd_kernel(DY, DS_IN, S, W, RNG, DRES, DX, PART, N, H, stride_dy, stride_dsi, stride_s, stride_dres,
                stride_dx, p, scale, eps, HAS_DS_IN: tl.constexpr, DROPOUT: tl.constexpr,
                WRITE_DX: tl.constexpr, RMS: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    m = cols < H
    w = tl.load(W + cols, mask=m, other=0.0).to(tl.float32)
    acc_w = tl.zeros((BLOCK,), dtype=tl.float32)
    acc_nb = tl.zeros((BLOCK,), dtype=tl.float32)
    acc_b = tl.zeros((BLOCK,), dtype=tl.float32)
    for r in range(pid, N, tl.num_programs(0)):
        row = tl.cast(r, tl.int64)
        xhat, rstd = _row_stats(tl.load(S + row * stride_s + cols, mask=m, other=0.0).to(tl.float32),
                                m, H, eps, RMS)
        dy = tl.load(DY + row * stride_dy + cols, mask=m, other=0.0).to(tl.float32)
        wdy = w * dy
        ds = wdy - xhat * (tl.sum(xhat * wdy, axis=0) / H)
        if not RMS:
            ds -= tl.sum(wdy, axis=0) / H
        ds *= rstd
        if HAS_DS_IN:
            ds += tl.load(DS_IN + row * stride_dsi + cols, mask=m, other=0.0).to(tl.float32)
        tl.store(DRES + row * stride_dres + cols, ds.to(DRES.dtype.element_ty), mask=m)
        dx = ds
        if DROPOUT:
            dx = tl.where(_keep(RNG, row, H, p, BLOCK), ds * scale, 0.0)
        if WRITE_DX:
            tl.store(DX + row * stride_dx + cols, dx.to(DX.dtype.element_ty), mask=m)
        acc_w += dy * xhat
        acc_nb += dy
        acc_b += dx
    tl.store(PART + pid * 3 * H + cols, acc_w, mask=m)
    tl.store(PART + pid * 3 * H + H + cols, acc_nb, mask=m)
    tl.store(PART + pid * 3 * H + 2 * H + cols, acc_b, mask=m)


# _triton() imports triton and jits these kernels on first use (kernels/_lazy.py)
_triton = lazy_triton(globals(), ("_keep", "_row_stats", "_fwd_kernel", "_bwd_kernel"))


# ----------------------------------------------------------------------------------------------
# Launchers (called by the CUDA kernels; tests call them on CPU tensors under TRITON_INTERPRET=1)
# ----------------------------------------------------------------------------------------------
def _launch_shape(hidden: int, backward: bool = False) -> tuple[int, int]:
    """(BLOCK, num_warps). Measured on an H200 at 8192 rows: forward is at ~80% of the bandwidth with
    4 to 16 warps; backward, which holds three fp32 accumulators besides the row, is best with 8 warps
    at H = 4096 and 8192 (4 spill at 8192, 16 leave fewer rows in flight)."""
    if hidden > MAX_TRITON_HIDDEN:
        raise MeshcValueError(f"bias_dropout_add_norm hidden size: expected <= {MAX_TRITON_HIDDEN} on the Triton "
                              f"path, got {hidden}")
    block = max(4, _triton().next_power_of_2(hidden))  # _keep takes 4 columns per Philox counter
    if backward:
        return block, min(max(block // 512, 1), 8)
    return block, min(max(block // 256, 1), 16)


def _rows(t: Optional[Tensor], hidden: int) -> Optional[Tensor]:
    """(..., H) -> (N, H) with unit column stride."""
    if t is None:
        return None
    t = t.reshape(-1, hidden)
    return t if t.stride(-1) == 1 else t.contiguous()


def triton_forward(x, bias, residual, weight, norm_bias, rng, p, norm, eps) -> tuple[Tensor, Tensor]:
    """The Triton forward: `(y, s)` as the op returns them."""
    hidden = x.shape[-1]
    block, warps = _launch_shape(hidden)
    x2, r2 = _rows(x, hidden), _rows(residual, hidden)  # (N, H)
    y, s = torch.empty(x2.shape, dtype=x.dtype, device=x.device), torch.empty_like(r2, dtype=residual.dtype)
    if x2.shape[0] == 0:
        return y.view(x.shape), s.view(x.shape)
    dummy = weight
    _fwd_kernel[(x2.shape[0],)](
        x2, dummy if bias is None else bias.contiguous(), r2, weight.contiguous(),
        dummy if norm_bias is None else norm_bias.contiguous(), dummy if rng is None else rng, y, s, hidden,
        x2.stride(0), r2.stride(0), y.stride(0), s.stride(0), float(p), _scale(p), float(eps),
        HAS_BIAS=bias is not None, HAS_NB=norm_bias is not None, DROPOUT=p > 0, RMS=norm == "rmsnorm",
        BLOCK=block, num_warps=warps)
    return y.view(x.shape), s.view(x.shape)


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _backward_programs(device: torch.device, rows: int, block: int) -> int:
    """Programs of the backward kernel: two per SM up to H = 4096, one above (measured on an H200)."""
    if device.type == "cuda":
        per_sm = 2 if block <= 4096 else 1
        return max(1, min(rows, per_sm * _sm_count(device.index if device.index is not None else 0)))
    return max(1, min(rows, 2))  # the interpreter runs programs one after another


def triton_backward(grad_y, grad_s, s, weight, rng, p, norm, eps, x_dtype) -> tuple[Tensor, Tensor, Tensor]:
    """The Triton backward: `(d_residual, d_x, d_params)` as the backward op returns them."""
    hidden = s.shape[-1]
    block, warps = _launch_shape(hidden, backward=True)
    s2, dy = _rows(s, hidden), _rows(grad_y, hidden)  # (N, H)
    ds_in = _rows(grad_s, hidden)
    d_res = torch.empty_like(s2)
    write_dx = _writes_dx(p, x_dtype, s)
    d_x = torch.empty(s2.shape, dtype=x_dtype, device=s.device) if write_dx else s.new_empty(0, dtype=x_dtype)
    programs = _backward_programs(s.device, s2.shape[0], block)
    empty = torch.zeros if s2.shape[0] == 0 else torch.empty  # every program writes its partial sums
    part = empty((programs, 3, hidden), dtype=_acc_dtype(s.dtype), device=s.device)
    if s2.shape[0] > 0:
        _bwd_kernel[(programs,)](
            dy, dy if ds_in is None else ds_in, s2, weight.contiguous(), s2 if rng is None else rng, d_res,
            d_x if write_dx else d_res, part, s2.shape[0], hidden, dy.stride(0),
            0 if ds_in is None else ds_in.stride(0), s2.stride(0), d_res.stride(0),
            d_x.stride(0) if write_dx else 0, float(p), _scale(p), float(eps),
            HAS_DS_IN=ds_in is not None, DROPOUT=p > 0, WRITE_DX=write_dx, RMS=norm == "rmsnorm",
            BLOCK=block, num_warps=warps)
    return d_res.view(s.shape), d_x.view(s.shape) if write_dx else d_x, part.sum(0)
