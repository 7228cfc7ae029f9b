"""Context parallelism: exact attention over a sequence sharded on the `cp` axis; what graph nodes call.

The passes/context pass rewrites each `scaled_dot_product_attention` of a cp-sharded model into
`context_attention(q, k, v, mask, causal=..., scale=..., method=..., group=..., size=..., index=...)`:
q, k, v hold this rank's rows of the sequence, the result is exactly this rank's rows of the attention over
the whole sequence, and it is differentiable (one autograd.Function per method).

Layout ("zigzag", which balances causal work): the global sequence of length S is cut into 2·cp chunks of
c = S/(2·cp); rank i holds chunks i and 2·cp−1−i, concatenated in that order (local length s = S/cp).
`positions(i, cp, s)` gives the global positions of rank i's rows. A mask is always the whole global one
(rows: global query positions, columns: global key positions, natural order) and causality is by global
position, so every method indexes the mask or builds the causal mask from positions.

Methods, with the elements each rank sends per layer (b batch, hq/hk query/kv heads, d/dv head dims):

- "ring": K and V travel round the ring (to index+1, from index−1, point-to-point), the next transfer
  started before the current block is computed; partial outputs merge by the log-sum-exp rule in fp32.
  Forward: each rank sends its K,V cp−1 times: (cp−1)/cp · b·S·hk·(d+dv) (= …·2d when dv = d).
  Backward (FlashAttention-2 recompute from the saved LSE): K,V again cp−1 times, and the dK,dV buffer of
  each owner, created at the first remote rank, makes cp−1 hops home (kept in fp32): twice the forward.
  Under causal masking, blocks a query row cannot see are skipped (zigzag: half of each remote block).
  On CPU without a mask, blocks go through torch's fused attention kernel (the one SDPA calls, with its
  log-sum-exp: compat.fused_attention_block) chunk pair by chunk pair, each seen whole, causally (a chunk
  against itself) or not at all: measured 3x faster than the written-out block math, which is what runs
  with a mask or on other devices. `RingCensus` counts these sends.
- "all_gather": K,V all-gathered (backward: dK,dV reduce-scattered), then local queries against all keys:
  (cp−1)/cp · b·S·hk·(d+dv) each way, no overlap, the full K,V held during the layer.
- "all_to_all" (DeepSpeed-Ulysses): q,k,v exchanged from (all heads, local rows) to (hq/cp heads, all
  rows), ordinary attention, the output exchanged back: (cp−1)/cp · b·s·(hq·d + hk'·(d+dv) + hq·dv) forward,
  the same backward. Needs hq % cp == 0; when hk % cp != 0 the kv heads are first repeated to hq (hk' = hq,
  more traffic), otherwise hk' = hk.

Rows with no visible key give zeros (output and gradients), as torch's CPU SDPA does. Dropout is not
supported (the pass refuses it). On fake tensors (compile-time shape propagation) nothing is sent.
"""
from __future__ import annotations

import contextvars
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from meshc.compiler.ir import torch_compat as compat

METHODS = ("ring", "all_gather", "all_to_all")
_KV_TAG, _GRAD_TAG = 0, 1  # point-to-point tags: K/V and the travelling dK/dV never match each other


class RingCensus:
    """Elements this rank's ring sends carried, by direction ("forward", "backward"), while active.

        with RingCensus() as census:
            out = context_attention(..., method="ring", ...); out.sum().backward()
        census.sent  # {"forward": n, "backward": m}

    A backward is counted in the census that was active when its forward ran (autograd may run it on
    another thread); a recompute under activation checkpointing counts as a forward."""

    def __init__(self) -> None:
        self.sent = {"forward": 0, "backward": 0}
        self._token: contextvars.Token | None = None

    def add(self, direction: str, elements: int) -> None:
        self.sent[direction] += elements

    def __enter__(self) -> RingCensus:
        self._token = _CENSUS.set(self)
        return self

    def __exit__(self, *exc) -> None:
        _CENSUS.reset(self._token)


_CENSUS: contextvars.ContextVar[RingCensus | None] = contextvars.ContextVar("meshc_ring_census", default=None)


def positions(index: int, size: int, s_local: int, *, device=None) -> torch.Tensor:
    """Global positions (s_local,) int64 of the rows rank `index` of `size` holds: chunks index, 2·size−1−index."""
    c = s_local // 2
    first = torch.arange(index * c, (index + 1) * c, device=device)
    return torch.cat([first, first + (2 * size - 1 - 2 * index) * c])


def context_attention(q, k, v, mask=None, *, causal: bool, scale: float | None, method: str,
                      group: str, size: int, index: int) -> torch.Tensor:
    """This rank's rows of SDPA(q, k, v, attn_mask=mask, is_causal=causal, scale=scale) over the whole sequence.

    q: (b, hq, s, d), k/v: (b, hk, s, d/dv) local rows in zigzag order, hq % hk == 0 (grouped-query);
    mask: None or the global (…, S, S) mask (bool: True attends; float: added), never requiring grad;
    group/size/index: the cp group's registered name, its size and this rank's index in it.
    Returns (b, hq, s, dv)."""
    _check(q, k, v, mask, causal, method, size)
    b, hq, s, _ = q.shape
    if compat.is_fake(q) and method == "ring":  # shapes being propagated: the ring's transfers are not traceable
        return q.new_empty((b, hq, s, v.shape[-1]))
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if method == "ring":
        qpos = positions(index, size, s, device=q.device)
        spec = _RingSpec(group, size, index, causal, scale, hq // k.shape[1], s // 2, _rows(mask, qpos), q.device)
        return _RingAttention.apply(q, k, v, spec)
    if method == "all_gather":
        return _gathered_attention(q, k, v, mask, causal, scale, group, size, index)
    return _ulysses_attention(q, k, v, mask, causal, scale, group, size, index)


def _check(q, k, v, mask, causal, method, size) -> None:
    if method not in METHODS:
        raise ValueError(f"context attention method: expected one of {METHODS}, got {method!r}")
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"context attention: expected (b, heads, s, d) q, k, v, got {q.shape}, {k.shape}, {v.shape}")
    hq, hk, s = q.shape[1], k.shape[1], q.shape[2]
    if hq % hk or k.shape[1] != v.shape[1] or k.shape[2] != s or v.shape[2] != s:
        raise ValueError(f"context attention: expected hq % hk == 0 and equal local lengths, got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    if s % 2:
        raise ValueError(f"context attention: the zigzag layout holds two chunks per rank, got local length {s}")
    if mask is not None and causal:
        raise ValueError("context attention: expected a mask or causal, got both (SDPA refuses them too)")
    if mask is not None and mask.shape[-1] not in (1, s * size):
        raise ValueError(f"context attention: expected the global mask (…, {s * size}, {s * size}), got {tuple(mask.shape)}")
    if method == "all_to_all" and hq % size:
        raise ValueError(f"context attention all_to_all: {hq} query heads do not divide over cp size {size}; "
                         "use method 'ring' or 'all_gather'")


# ---------------------------------------------------------------------------------------------- masks
def _mask4(mask: torch.Tensor) -> torch.Tensor:
    """The mask viewed as 4-d (b or 1, heads or 1, rows or 1, columns or 1), SDPA's broadcasting."""
    return mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))


def _select(m: torch.Tensor, dim: int, index: torch.Tensor) -> torch.Tensor:
    return m if m.shape[dim] == 1 else m.index_select(dim, index)


def _rows(mask: torch.Tensor | None, qpos: torch.Tensor) -> torch.Tensor | None:
    """The global mask's rows for the local queries (4-d), or None."""
    return None if mask is None else _select(_mask4(mask), 2, qpos)


def _bias(m: torch.Tensor) -> torch.Tensor:
    """A mask as the fp32 term added to scores (bool False -> -inf), as SDPA applies it."""
    if m.dtype == torch.bool:
        return torch.zeros(m.shape, dtype=torch.float32, device=m.device).masked_fill_(~m, float("-inf"))
    return m.float()


def _causal(qpos: torch.Tensor, kpos: torch.Tensor) -> torch.Tensor:
    """(len(qpos), len(kpos)) bool: key position <= query position."""
    return kpos[None, :] <= qpos[:, None]


# ----------------------------------------------------------------------------------------------- ring
@dataclass(frozen=True)
class _RingSpec:
    """What the ring needs besides q, k, v: the group by name (no process group held), the masking."""

    group: str
    size: int
    index: int
    causal: bool
    scale: float
    groups: int  # query heads per kv head
    chunk: int  # c: rows per zigzag chunk
    mask_rows: torch.Tensor | None  # the global mask's rows for the local queries, 4-d
    device: torch.device

    def block(self, owner: int):
        """(row slice, column slice, fp32 bias or None) of the local queries against `owner`'s keys, or None
        when no local query sees any of them. Under causal masking, by zigzag chunk ids: a query chunk sees
        an earlier key chunk fully, its own chunk causally, a later one not at all."""
        c, s = self.chunk, 2 * self.chunk
        if self.mask_rows is not None:
            kpos = positions(owner, self.size, s, device=self.mask_rows.device)
            return slice(0, s), slice(0, s), _bias(_select(self.mask_rows, 3, kpos))
        if not self.causal:
            return slice(0, s), slice(0, s), None
        q_chunks, k_chunks = self._chunks(self.index), self._chunks(owner)
        rows = [r for r, a in enumerate(q_chunks) if min(k_chunks) <= a]
        if not rows:
            return None
        cols = [j for j, b in enumerate(k_chunks) if b <= max(q_chunks[r] for r in rows)]
        row, col = slice(rows[0] * c, (rows[-1] + 1) * c), slice(cols[0] * c, (cols[-1] + 1) * c)
        if all(k_chunks[j] < q_chunks[r] for r in rows for j in cols):
            return row, col, None
        qpos = positions(self.index, self.size, s, device=self.device)[row]
        kpos = positions(owner, self.size, s, device=self.device)[col]
        return row, col, _bias(_causal(qpos, kpos))

    def chunk_pairs(self, owner: int) -> list[tuple[slice, slice, bool]]:
        """(row slice, column slice, causal) of every (query chunk, key chunk) pair with a visible key, for a
        kernel that takes causal only aligned (a chunk against itself): an earlier key chunk is seen whole,
        the same chunk causally, a later one not at all. Without causal masking: one pair, everything."""
        c = self.chunk
        if not self.causal:
            return [(slice(0, 2 * c), slice(0, 2 * c), False)]
        return [(slice(a * c, (a + 1) * c), slice(b * c, (b + 1) * c), key == query)
                for a, query in enumerate(self._chunks(self.index))
                for b, key in enumerate(self._chunks(owner)) if key <= query]

    def _chunks(self, rank: int) -> tuple[int, int]:
        return rank, 2 * self.size - 1 - rank


class _Pending:
    """A started exchange: wait() returns the received tensor."""

    def __init__(self, works, received: torch.Tensor) -> None:
        self.works, self.received = works, received

    def wait(self) -> torch.Tensor:
        for work in self.works:
            work.wait()
        return self.received


class _Ring:
    """This rank's neighbours in the cp group (resolved per call, never stored globally)."""

    def __init__(self, spec: _RingSpec, census: RingCensus | None, direction: str) -> None:
        pg = compat.resolve_process_group(spec.group)
        self.pg, self.census, self.direction = pg, census, direction
        self.next = dist.get_global_rank(pg, (spec.index + 1) % spec.size)
        self.prev = dist.get_global_rank(pg, (spec.index - 1) % spec.size)

    def exchange(self, send: torch.Tensor, tag: int) -> _Pending:
        """Start sending `send` to the next rank and receiving its like from the previous one."""
        received = torch.empty_like(send)
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, send, self.next, self.pg, tag),
                                        dist.P2POp(dist.irecv, received, self.prev, self.pg, tag)])
        if self.census is not None:
            self.census.add(self.direction, send.numel())
        return _Pending(works, received)


def _pack(a: torch.Tensor, b: torch.Tensor, dtype=None) -> torch.Tensor:
    return torch.cat([a.reshape(-1), b.reshape(-1)]).to(dtype or a.dtype)


def _unpack(flat: torch.Tensor, shape_a, shape_b) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of a packed pair (writes through them land in `flat`)."""
    n = math.prod(shape_a)
    return flat[:n].view(shape_a), flat[n:].view(shape_b)


def _repeat(x: torch.Tensor, groups: int) -> torch.Tensor:
    """kv heads repeated for their query heads (SDPA's enable_gqa: head h serves h·g .. h·g+g−1)."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def _fold(x: torch.Tensor, groups: int) -> torch.Tensor:
    """Gradients of repeated kv heads summed back onto the kv heads: (b, hq, n, d) -> (b, hk, n, d)."""
    b, h, n, d = x.shape
    return x if groups == 1 else x.view(b, h // groups, groups, n, d).sum(2)


def _block_forward(q, k, v, bias, scale):
    """(output (b, hq, r, dv) fp32, log-sum-exp (b, hq, r, 1) fp32) of q against one block of keys."""
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale
    if bias is not None:
        scores = scores + bias
    peak = scores.amax(-1, keepdim=True)
    peak = torch.where(torch.isfinite(peak), peak, 0.0)  # a row with no visible key: exp(-inf) = 0, no NaN
    p = torch.exp(scores - peak)
    total = p.sum(-1, keepdim=True)
    out = torch.matmul(p.to(v.dtype), v).float() / total.clamp_min(torch.finfo(torch.float32).tiny)
    return out, peak + torch.log(total)


def _merge(out, lse, rows, block_out, block_lse) -> None:
    """Fold one block's (output, LSE) into the running fp32 accumulators, in place, rows `rows`."""
    old = lse[:, :, rows]
    new = torch.logaddexp(old, block_lse)
    safe = torch.where(torch.isfinite(new), new, 0.0)  # still nothing visible: both weights exp(-inf) = 0
    out[:, :, rows] = out[:, :, rows] * torch.exp(old - safe) + block_out * torch.exp(block_lse - safe)
    lse[:, :, rows] = new


def _fused(spec: _RingSpec, q: torch.Tensor) -> bool:
    """Blocks through torch's fused CPU attention kernel: without a mask (causal or none), on CPU."""
    return spec.mask_rows is None and q.device.type == "cpu"


def _forward_parts(q, kj, vj, owner: int, spec: _RingSpec):
    """(rows, output fp32, LSE (b, hq, r, 1) fp32) of the local queries against `owner`'s keys, by block."""
    g = spec.groups
    if _fused(spec, q):
        for rows, cols, diagonal in spec.chunk_pairs(owner):
            out, lse = compat.fused_attention_block(q[:, :, rows], _repeat(kj[:, :, cols], g),
                                                    _repeat(vj[:, :, cols], g), diagonal, spec.scale)
            yield rows, out.float(), lse.unsqueeze(-1)
        return
    block = spec.block(owner)
    if block is not None:
        rows, cols, bias = block
        yield rows, *_block_forward(q[:, :, rows], _repeat(kj[:, :, cols], g), _repeat(vj[:, :, cols], g), bias,
                                    spec.scale)


def _backward_parts(q, kj, vj, dout, out, lse, delta, owner: int, spec: _RingSpec):
    """(rows, cols, dq, dk, dv) fp32 of `owner`'s block(s), dk/dv folded onto the kv heads."""
    g = spec.groups
    if _fused(spec, q):
        for rows, cols, diagonal in spec.chunk_pairs(owner):
            dq, dk, dv = compat.fused_attention_block_backward(
                dout[:, :, rows], q[:, :, rows], _repeat(kj[:, :, cols], g), _repeat(vj[:, :, cols], g),
                out[:, :, rows], lse[:, :, rows, 0].contiguous(), diagonal, spec.scale)
            yield rows, cols, dq.float(), _fold(dk.float(), g), _fold(dv.float(), g)
        return
    block = spec.block(owner)
    if block is not None:
        rows, cols, bias = block
        dq, dk, dv = _block_backward(q[:, :, rows], _repeat(kj[:, :, cols], g), _repeat(vj[:, :, cols], g),
                                     dout[:, :, rows], bias, lse[:, :, rows], delta[:, :, rows], spec.scale)
        yield rows, cols, dq, _fold(dk, g), _fold(dv, g)


def _ring_forward(q, k, v, spec: _RingSpec, census):
    """(output (b, hq, s, dv) in q's dtype, LSE (b, hq, s, 1) fp32): K,V round the ring, blocks merged."""
    b, hq, s, _ = q.shape
    # laid out (b, s, hq, dv) as torch's fused attention returns it: the usual transpose(1, 2).reshape(b, s, -1)
    # after attention is then a view, not a copy kept alive for the output projection's backward
    out = torch.zeros((b, s, hq, v.shape[-1]), dtype=torch.float32, device=q.device).transpose(1, 2)
    lse = torch.full((b, hq, s, 1), float("-inf"), dtype=torch.float32, device=q.device)
    ring = _Ring(spec, census, "forward") if spec.size > 1 else None
    kv = _pack(k, v)
    for step in range(spec.size):
        pending = ring.exchange(kv, _KV_TAG) if step < spec.size - 1 else None  # overlaps this block
        kj, vj = _unpack(kv, k.shape, v.shape)
        for rows, block_out, block_lse in _forward_parts(q, kj, vj, (spec.index - step) % spec.size, spec):
            _merge(out, lse, rows, block_out, block_lse)
        if pending is not None:
            kv = pending.wait()
    return out.to(q.dtype), lse


def _block_backward(q, k, v, dout, bias, lse, delta, scale):
    """FlashAttention-2's block gradients from the global LSE: (dq, dk, dv) fp32, k/v with repeated heads."""
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale
    if bias is not None:
        scores = scores + bias
    p = torch.exp(scores - lse)  # the global probabilities of this block
    dp = torch.matmul(dout, v.transpose(-1, -2)).float()
    ds = p * (dp - delta)
    dq = torch.matmul(ds.to(q.dtype), k).float() * scale
    dk = torch.matmul(ds.transpose(-1, -2).to(q.dtype), q).float() * scale
    dv = torch.matmul(p.transpose(-1, -2).to(dout.dtype), dout).float()
    return dq, dk, dv


def _ring_backward(q, k, v, out, lse, dout, spec: _RingSpec, census):
    """(dq, dk, dv): K,V round the ring again; each owner's dK,dV travel with them and come home."""
    delta = (dout.float() * out.float()).sum(-1, keepdim=True)  # D = rowsum(dO∘O), (b, hq, s, 1)
    lse = torch.where(torch.isfinite(lse), lse, 0.0)  # rows with no visible key: p = exp(-inf) = 0
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    own = _pack(torch.zeros_like(k, dtype=torch.float32), torch.zeros_like(v, dtype=torch.float32))
    ring = _Ring(spec, census, "backward") if spec.size > 1 else None
    kv, travelling = _pack(k, v), None
    for step in range(spec.size):
        pending = ring.exchange(kv, _KV_TAG) if step < spec.size - 1 else None
        kj, vj = _unpack(kv, k.shape, v.shape)
        parts = list(_backward_parts(q, kj, vj, dout, out, lse, delta, (spec.index - step) % spec.size, spec))
        # the owner's dK,dV: kept here (step 0), created here (step 1), or received from the previous rank
        grads = own if step == 0 else torch.zeros_like(own) if step == 1 else travelling.wait()
        dk, dv = _unpack(grads, k.shape, v.shape)
        for rows, cols, part_q, part_k, part_v in parts:
            dq[:, :, rows] += part_q
            dk[:, :, cols] += part_k
            dv[:, :, cols] += part_v
        if step > 0:  # on to the next holder; after the last step that is the owner
            travelling = ring.exchange(grads, _GRAD_TAG)
        if pending is not None:
            kv = pending.wait()
    if travelling is not None:
        own += travelling.wait()
    dk, dv = _unpack(own, k.shape, v.shape)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _RingAttention(torch.autograd.Function):
    """Ring attention: forward merges the blocks by LSE; backward recomputes them from the saved LSE."""

    @staticmethod
    def forward(ctx, q, k, v, spec: _RingSpec):
        ctx.census = _CENSUS.get()
        out, lse = _ring_forward(q, k, v, spec, ctx.census)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.spec = spec
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _ring_backward(q, k, v, out, lse, dout.contiguous(), ctx.spec, ctx.census)
        return dq, dk, dv, None


# ----------------------------------------------------------------------------------------- all_gather
class _AllGather(torch.autograd.Function):
    """Rows (dim 0) of every rank concatenated; backward: the gradient reduce-scattered back."""

    @staticmethod
    def forward(ctx, x, size: int, group: str):
        ctx.size, ctx.group = size, group
        return compat.all_gather(x, size, group)

    @staticmethod
    def backward(ctx, grad):
        return compat.reduce_scatter_sum(grad, ctx.size, ctx.group), None, None


def _natural_order(size: int, s: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(order, by_rank): the rows of all ranks concatenated in rank order hold positions `by_rank`;
    index_select(order) puts them in natural order, index_select(by_rank) back."""
    by_rank = torch.cat([positions(r, size, s, device=device) for r in range(size)])
    return torch.argsort(by_rank), by_rank


def _gathered_attention(q, k, v, mask, causal, scale, group, size, index):
    """Local queries against the all-gathered keys (natural order); mask rows / causal by positions."""
    b, hk, s, d = k.shape
    flat = _AllGather.apply(_pack(k, v)[None], size, group)  # (cp, n)
    order, _ = _natural_order(size, s, q.device)
    ks, vs = flat[:, :k.numel()], flat[:, k.numel():]
    ks, vs = (t.reshape(size, b, hk, s, -1).permute(1, 2, 0, 3, 4).reshape(b, hk, size * s, -1).index_select(2, order)
              for t in (ks, vs))
    qpos = positions(index, size, s, device=q.device)
    m = _rows(mask, qpos) if mask is not None else _causal(qpos, torch.arange(size * s, device=q.device)) if causal else None
    return F.scaled_dot_product_attention(q, ks, vs, attn_mask=m, scale=scale, enable_gqa=q.shape[1] != hk)


# ----------------------------------------------------------------------------------------- all_to_all
class _AllToAll(torch.autograd.Function):
    """Row i of (cp, n) to rank i; equal splits make it its own adjoint, so backward is the same exchange."""

    @staticmethod
    def forward(ctx, x, size: int, group: str):
        ctx.size, ctx.group = size, group
        return compat.all_to_all_single(x, [1] * size, [1] * size, group)

    @staticmethod
    def backward(ctx, grad):
        return compat.all_to_all_single(grad, [1] * ctx.size, [1] * ctx.size, ctx.group), None, None


def _by_head_group(x: torch.Tensor, size: int) -> torch.Tensor:
    """(b, h, s, d) -> (cp, b·h/cp·s·d): row i holds head group i (the part rank i computes)."""
    b, h, s, d = x.shape
    return x.reshape(b, size, h // size, s, d).transpose(0, 1).reshape(size, -1)


def _ulysses_attention(q, k, v, mask, causal, scale, group, size, index):
    """Heads scattered, the sequence gathered (natural order), ordinary SDPA, and back (DeepSpeed-Ulysses)."""
    b, hq, s, d = q.shape
    if k.shape[1] % size:  # kv heads do not divide: repeat them for every query head (more traffic)
        k, v = _repeat(k, hq // k.shape[1]), _repeat(v, hq // k.shape[1])
    hk, dv, n = k.shape[1], v.shape[-1], size * s
    sent = torch.cat([_by_head_group(t, size) for t in (q, k, v)], dim=1)  # one exchange for q, k, v
    got = _AllToAll.apply(sent, size, group)  # row i: rank i's rows of my head group
    order, by_rank = _natural_order(size, s, q.device)
    widths = [b * (h // size) * s * e for h, e in ((hq, d), (hk, d), (hk, dv))]
    qh, kh, vh = (part.reshape(size, b, h // size, s, e).permute(1, 2, 0, 3, 4).reshape(b, h // size, n, e)
                  .index_select(2, order) for part, h, e in zip(got.split(widths, dim=1), (hq, hk, hk), (d, d, dv)))
    m = None
    if mask is not None:
        m = _mask4(mask)
        m = m if m.shape[1] == 1 else m[:, index * (hq // size):(index + 1) * (hq // size)]
    o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=m, is_causal=causal, scale=scale, enable_gqa=hq != hk)
    o = o.index_select(2, by_rank).reshape(b, hq // size, size, s, dv).permute(2, 0, 1, 3, 4).reshape(size, -1)
    back = _AllToAll.apply(o, size, group)  # row i: my rows of head group i
    return back.reshape(size, b, hq // size, s, dv).transpose(0, 1).reshape(b, hq, s, dv)
