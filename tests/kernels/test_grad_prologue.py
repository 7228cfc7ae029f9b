"""meshc::grad_prologue: flatten + cast + pre-scale + pad, CPU and Triton paths against plain torch.

The reference scales in fp32 and casts once, as the op does, so results are exact, except in Triton's
interpreter, which truncates fp32 -> bf16 where torch and the GPU round to nearest: there bf16 is held
to one bf16 ulp (rtol 2**-7, atol 0), and fp16 (rounded by numpy) to exact.
"""
from __future__ import annotations

import pytest
import torch

from meshc.kernels import grad_prologue as gp

SHAPES = [(3, 37), (5, 96), (7,), (1,)]
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])  # opcheck on CUDA runs the Triton kernels


def grads(dtypes=(torch.float32, torch.float32, torch.bfloat16, torch.float32), device="cpu"):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=g).to(dt).to(device) for s, dt in zip(SHAPES, dtypes)]


def reference(gs, dtype, scale, world_size):
    flat = torch.cat([(g.reshape(-1).float() * scale).to(dtype) for g in gs])
    pad = -flat.numel() % world_size
    return torch.cat([flat, flat.new_zeros(pad)])


@pytest.mark.parametrize("world_size", [1, 4, 7])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cpu_op_matches_reference(world_size, dtype):
    gs = grads()
    flat = gp.grad_prologue(gs, dtype, 1 / world_size, world_size)
    assert flat.numel() % world_size == 0 and flat.numel() - sum(g.numel() for g in gs) < world_size
    assert torch.equal(flat, reference(gs, dtype, 1 / world_size, world_size))


@pytest.mark.parametrize("world_size", [1, 8])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_matches_reference(triton_device, world_size, dtype):
    gs = grads(device=triton_device)  # fp32 and bf16 gradients: one launch per input dtype
    flat = gp.triton_grad_prologue(gs, dtype, 1 / world_size, world_size)
    expected = reference(gs, dtype, 1 / world_size, world_size)
    if dtype == torch.bfloat16 and triton_device == "cpu":
        torch.testing.assert_close(flat.float(), expected.float(), rtol=2**-7, atol=0)
    else:
        assert torch.equal(flat, expected)


def test_backward_slices_and_scales():
    gs = [g.requires_grad_() for g in grads((torch.float32,) * 4)]
    flat = gp.grad_prologue(gs, torch.bfloat16, 0.5, 8)
    upstream = torch.arange(flat.numel(), dtype=torch.bfloat16)
    flat.backward(upstream)
    expected = (upstream.float() * 0.5)[:sum(g.numel() for g in gs)].split([g.numel() for g in gs])  # no padding
    for g, e in zip(gs, expected):
        assert torch.equal(g.grad, e.view(g.shape))


def test_gradcheck_float64():
    gs = [torch.randn(s, dtype=torch.float64, requires_grad=True) for s in [(3, 2), (5,)]]
    assert torch.autograd.gradcheck(lambda *gs: gp.grad_prologue(gs, torch.float64, 0.25, 4), gs)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    gs = [torch.randn(s, device=device, requires_grad=True) for s in [(3, 2), (5,)]]
    torch.library.opcheck(torch.ops.meshc.grad_prologue.default, (gs, torch.bfloat16, 0.5, 4))


def test_bad_world_size():
    with pytest.raises(ValueError, match="world_size: expected >= 1, got 0"):
        gp.grad_prologue([torch.zeros(3)], torch.float32, 1.0, 0)
