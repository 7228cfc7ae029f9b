"""meshc::pack_cast and meshc::unpack: layout, CPU and Triton paths against plain torch, autograd, opcheck.

These ops only move and cast, so results are exact: a cast on both sides is the same IEEE rounding,
except in Triton's interpreter, which truncates fp32 -> bf16 where torch rounds to nearest. Exact
comparisons use fp32 -> fp16 there (numpy rounds it to nearest, as torch and the GPU do); the
fp32 -> bf16 path is held to one bf16 ulp (rtol 2**-7, atol 0) there and to exact on a GPU.
"""
from __future__ import annotations

import pytest
import torch

from meshc.kernels import zero_copy

SHAPES = [(5, 7), (37,), (8, 16), (3,), (0,)]  # odd sizes, an empty one
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])  # opcheck on CUDA runs the Triton kernels


def tensors(shapes=SHAPES, dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=g).to(dtype).to(device) for s in shapes]


def reference_pack(ts, dtype, world_size):
    """Rank r's segment holds chunk r (ceil(numel / W) elements, zero-padded) of every tensor, in order."""
    segments = []
    for r in range(world_size):
        for t in ts:
            n = -(-t.numel() // world_size)
            chunk = t.reshape(-1)[r * n:(r + 1) * n].to(dtype)
            segments += [chunk, torch.zeros(n - chunk.numel(), dtype=dtype, device=t.device)]
    return torch.cat(segments)


def assert_cast_equal(actual, expected, device):
    if actual.dtype == torch.bfloat16 and device == "cpu":  # interpreter: truncation, see the docstring
        torch.testing.assert_close(actual.float(), expected.float(), rtol=2**-7, atol=0)
    else:
        assert torch.equal(actual, expected)


@pytest.mark.parametrize("world_size", [1, 3])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cpu_op_layout(world_size, dtype):
    ts = tensors()
    flat = zero_copy.pack_cast(ts, dtype, world_size=world_size)
    assert torch.equal(flat, reference_pack(ts, dtype, world_size))
    back = zero_copy.unpack(flat, [t.shape for t in ts], world_size=world_size, dtype=torch.float32)
    for b, t in zip(back, ts):
        assert torch.equal(b, t.to(dtype).float())


def test_all_gather_then_unpack_gives_the_full_parameters():
    """Simulated all-gather: each rank packs its own shards; the concatenation unpacks to the parameters."""
    world_size, ts = 4, tensors()
    numels = [-(-t.numel() // world_size) for t in ts]

    def shard(t, r, n):  # rank r's stored shard: its chunk, zero-padded to n elements, as ZeRO-3 keeps it
        chunk = t.reshape(-1)[r * n:(r + 1) * n]
        return torch.nn.functional.pad(chunk, (0, n - chunk.numel()))

    sends = [zero_copy.pack_cast([shard(t, r, n) for t, n in zip(ts, numels)], torch.bfloat16)
             for r in range(world_size)]  # (S,) each
    params = zero_copy.unpack(torch.cat(sends), [t.shape for t in ts], world_size=world_size)
    for p, t in zip(params, ts):
        assert torch.equal(p, t.to(torch.bfloat16))


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_matches_cpu(triton_device, world_size, dtype):
    ts = tensors(device=triton_device)
    numels = [-(-t.numel() // world_size) for t in ts]
    flat = zero_copy.triton_to_flat(ts, dtype, world_size, numels)
    expected = reference_pack(ts, dtype, world_size)
    assert_cast_equal(flat, expected, triton_device)
    back = zero_copy.triton_from_flat(expected, [list(t.shape) for t in ts], torch.float32, numels)
    for b, t in zip(back, ts):
        assert torch.equal(b, t.to(dtype).float())


def test_triton_aligned_and_mixed_dtypes(triton_device):
    """16-byte aligned sizes take the vectorized path; mixed input dtypes launch once per dtype."""
    ts = tensors([(16, 8), (64,), (8,)], device=triton_device) + [torch.ones(24, device=triton_device).half()]
    numels = [t.numel() for t in ts]
    flat = zero_copy.triton_to_flat(ts, torch.float16, 1, numels)
    assert torch.equal(flat, torch.cat([t.reshape(-1).half() for t in ts]))
    with pytest.raises(ValueError, match=r"shard_numels\[3\]"):
        zero_copy.pack_cast(ts, torch.float16, world_size=2, shard_numels=[64, 32, 4, 11])  # 2 * 11 < 24


def test_autograd_pack_then_unpack_roundtrip():
    """fp32 shards -> bf16 buffer -> parameters: grads come back to the shards as fp32, through both ops."""
    ts = [t.requires_grad_() for t in tensors([(4, 3), (5,)])]
    params = zero_copy.unpack(zero_copy.pack_cast(ts, torch.bfloat16), [(4, 3), (5,)])
    assert [p.dtype for p in params] == [torch.bfloat16] * 2
    (params[0].float() * 2).sum().backward()  # params[1] unused: its grad is zero
    assert ts[0].grad.dtype == torch.float32
    assert torch.equal(ts[0].grad, torch.full((4, 3), 2.0))
    assert torch.equal(ts[1].grad, torch.zeros(5))


def test_unpack_backward_is_the_padded_layout():
    flat = torch.arange(2 * 8, dtype=torch.float32).requires_grad_()  # W = 2, S = 8: n = (5, 3)
    a, b = zero_copy.unpack(flat, [(9,), (2, 3)], world_size=2, shard_numels=[5, 3])
    assert torch.equal(a, torch.tensor([0, 1, 2, 3, 4, 8, 9, 10, 11.0]))
    assert torch.equal(b, torch.tensor([[5, 6, 7], [13, 14, 15.0]]))
    (a.sum() + 10 * b.sum()).backward()
    assert torch.equal(flat.grad, torch.tensor([1, 1, 1, 1, 1, 10, 10, 10, 1, 1, 1, 1, 0, 10, 10, 10.0]))


def test_gradcheck_float64():
    ts = [t.double().requires_grad_() for t in tensors([(3, 2), (5,)])]
    assert torch.autograd.gradcheck(lambda *ts: zero_copy.pack_cast(ts, torch.float64, world_size=2), ts)
    flat = torch.randn(2 * 6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda f: zero_copy.unpack(f, [(3, 2), (5,)], world_size=2), (flat,))


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    ts = [t.requires_grad_() for t in tensors([(3, 2), (5,)], device=device)]
    torch.library.opcheck(torch.ops.meshc.pack_cast.default, (ts, torch.bfloat16, 2, None))
    flat = torch.randn(2 * 6, device=device, requires_grad=True)
    torch.library.opcheck(torch.ops.meshc.unpack.default, (flat, [3, 2, 5], [2, 1], [3, 3], torch.float32))


def test_export_keeps_unpack():
    class Gather(torch.nn.Module):
        def forward(self, flat):
            w, b = zero_copy.unpack(flat, [(2, 3), (3,)], world_size=1)
            return w.sum(0) + b

    flat = torch.randn(9)
    ep = torch.export.export(Gather(), (flat,))
    assert any(n.target is torch.ops.meshc.unpack.default for n in ep.graph.nodes)
    torch.testing.assert_close(ep.module()(flat), Gather()(flat))


def test_bad_input_says_the_rule():
    with pytest.raises(ValueError, match="unpack gathered: expected a 1-D tensor"):
        zero_copy.unpack(torch.zeros(7), [(2, 2)], world_size=2)
    with pytest.raises(ValueError, match="world_size: expected >= 1"):
        zero_copy.pack_cast([torch.zeros(3)], torch.float32, world_size=0)
