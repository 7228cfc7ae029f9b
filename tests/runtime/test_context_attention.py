"""Context-parallel attention (runtime/ops/context.py) against single-process SDPA, on real gloo ranks.

One launch per world size (2 and 4) runs every method × masking and returns each rank's rows; the tests
compare them with the reference rows at `positions(...)`: output and the gradients of q, k, v.
"""
from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from meshc.compiler.ir import torch_compat as compat
from meshc.runtime.ops.context import METHODS, RingCensus, context_attention, positions
from tests.harness import run_ranks

B, HQ, HK, S, D = 2, 4, 2, 32, 8  # grouped-query: each kv head serves 2 query heads
# fp32 throughout. The ring merges per-block softmaxes by LSE and the other methods reorder the key axis,
# so sums are reassociated: measured max abs error 1.9e-6 over every method, masking, rank and tensor at cp 2
# and 4 (the ring's dk, causal and boolean masks; 2026-12-04), on values up to 5.4 in size: a few fp32 ulps
# (2^-21 = 4.8e-7 between 4 and 8). The bound, 4e-6 absolute, leaves 2x that margin; a misplaced block or a
# missing gradient hop moves rows by the size of the values (order 1). docs/parallelism.md quotes this bound.
TOL = dict(atol=4e-6, rtol=0.0)


def _inputs():
    """Global q, k, v, loss weights and the maskings; the same on every rank (fixed seed)."""
    gen = torch.Generator().manual_seed(1234)
    q, k, v = (torch.randn(B, h, S, D, generator=gen) for h in (HQ, HK, HK))
    weights = torch.randn(B, HQ, S, D, generator=gen)
    eye = torch.eye(S, dtype=torch.bool)
    sparse = (torch.rand(B, 1, S, S, generator=gen) < 0.3) | eye  # (b, 1, S, S): diagonal kept, no empty row
    dist_ = (torch.arange(S)[None, :] - torch.arange(S)[:, None]).abs().float()
    alibi = -torch.tensor([0.5, 0.25, 0.125, 0.0625])[:, None, None] * dist_  # (hq, S, S) float bias
    empty = torch.rand(S, S, generator=gen) < 0.5
    empty[3] = False  # (S, S) with a row that sees nothing: SDPA gives zeros there
    maskings = {"causal": dict(causal=True), "bool": dict(mask=sparse), "float": dict(mask=alibi), "none": {},
                "empty_row": dict(mask=empty)}
    return q, k, v, weights, maskings


def _reference(q, k, v, weights, mask=None, causal=False):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=True)
    (out * weights).sum().backward()
    return [out.detach(), q.grad, k.grad, v.grad]


def _local(q, k, v, weights, pos, method, group, size, index, mask=None, causal=False):
    q, k, v = (t[:, :, pos].clone().requires_grad_() for t in (q, k, v))
    out = context_attention(q, k, v, mask, causal=causal, scale=None, method=method, group=group, size=size,
                            index=index)
    (out * weights[:, :, pos]).sum().backward()
    return [out.detach(), q.grad, k.grad, v.grad]


def _rank():
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    size, index, group = dist.get_world_size(), dist.get_rank(), dist.group.WORLD.group_name
    q, k, v, weights, maskings = _inputs()
    pos = positions(index, size, S // size)
    rows = {}
    for masking, kw in maskings.items():
        want = [t[:, :, pos] for t in _reference(q, k, v, weights, **kw)]
        for method in METHODS:
            rows[method, masking] = (_local(q, k, v, weights, pos, method, group, size, index, **kw), want)
    census = {}
    for masking in ("causal", "none"):
        with RingCensus() as c:
            _local(q, k, v, weights, pos, "ring", group, size, index, **maskings[masking])
        census[masking] = dict(c.sent)
    return {"pos": pos, "rows": rows, "census": census}


@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"cp{n}")
def ranks(request):
    return request.param, run_ranks(_rank, request.param, timeout=120)


@pytest.mark.parametrize("masking", ["causal", "bool", "float", "none", "empty_row"])
@pytest.mark.parametrize("method", METHODS)
def test_rows_match_sdpa(ranks, method, masking):
    _, results = ranks
    for rank, result in enumerate(results):
        got, want = result["rows"][method, masking]
        for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
            assert not g.isnan().any(), f"rank {rank} {name}: NaN"
            torch.testing.assert_close(g, w, **TOL, msg=lambda m: f"rank {rank} {name}: {m}")


def test_ring_sends_exactly_the_formula(ranks):
    size, results = ranks
    s = S // size
    forward = (size - 1) * B * HK * s * (D + D)  # = (cp-1)/cp · b·S·hk·2d: K,V sent cp-1 times
    for result in results:
        for masking in ("causal", "none"):  # skipping causal blocks saves compute, never a send
            assert result["census"][masking] == {"forward": forward, "backward": 2 * forward}


def test_positions_zigzag():
    assert positions(0, 2, 4).tolist() == [0, 1, 6, 7]
    assert positions(1, 2, 4).tolist() == [2, 3, 4, 5]
    assert sorted(torch.cat([positions(i, 4, 6) for i in range(4)]).tolist()) == list(range(24))


def test_fake_tensors_give_the_shape_without_communicating():
    with compat.fake_tensor_mode():
        q, k, v = torch.empty(B, HQ, 8, D), torch.empty(B, HK, 8, D), torch.empty(B, HK, 8, 5)
        for method in METHODS:
            out = context_attention(q, k, v, causal=True, scale=None, method=method, group="unregistered",
                                    size=4, index=1)
            assert compat.is_fake(out) and out.shape == (B, HQ, 8, 5) and out.dtype == q.dtype


def test_all_to_all_refuses_heads_that_do_not_divide():
    q, k = torch.randn(1, 3, 4, D), torch.randn(1, 1, 4, D)
    with pytest.raises(ValueError, match="3 query heads .* cp size 2"):
        context_attention(q, k, k, causal=True, scale=None, method="all_to_all", group="unregistered", size=2,
                          index=0)
