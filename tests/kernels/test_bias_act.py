"""meshc::bias_gelu and meshc::bias_swiglu: CPU path and Triton path against plain torch, opcheck, gradcheck.

Tolerances. The reference is torch's own F.gelu / F.silu in float64 on the same inputs, its grads
from autograd. fp32: elementwise math is good to a few ulps; tanh as 1 - 2/(exp(2u) + 1) loses up to
~1e-7 absolute near 0, and bias grads sum <= 70 rows: atol = rtol = 1e-5 (2e-5 for bias grads).
bf16 outputs carry one rounding (2**-8 relative), two where Triton's interpreter truncates: rtol =
1.6e-2, atol = 1e-2 for values near 0; bias grads come back in fp32 from bf16 inputs: same.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from meshc.kernels import bias_act

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=1e-2, rtol=1.6e-2)}
BIAS_TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.bfloat16: dict(atol=1e-2, rtol=1.6e-2)}
SHAPES = [(3, 37), (5, 96), (2, 3, 40)]
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])  # opcheck on CUDA runs the Triton kernels


def rand(*shape, dtype=torch.float32, seed=0, device="cpu"):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype).to(device)


def close(actual, expected, dtype, tol=TOL):
    torch.testing.assert_close(actual.double(), expected.double(), **tol[dtype])


def gelu_reference(x, bias, approximate, dy):
    """(y, d_x, d_bias) from F.gelu in float64."""
    x64 = x.double().requires_grad_()
    b64 = None if bias is None else bias.double().requires_grad_()
    y = F.gelu(x64 if b64 is None else x64 + b64, approximate=approximate)
    grads = torch.autograd.grad(y, [x64] + ([b64] if b64 is not None else []), dy.double())
    return y, grads[0], grads[1] if b64 is not None else None


def swiglu_reference(gate, up, gate_bias, up_bias, dy):
    """(y, d_gate, d_up, d_gate_bias, d_up_bias) from F.silu in float64."""
    leaves = [t.double().requires_grad_() for t in (gate, up, gate_bias, up_bias)]
    y = F.silu(leaves[0] + leaves[2]) * (leaves[1] + leaves[3])
    return (y, *torch.autograd.grad(y, leaves, dy.double()))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("approximate", bias_act.APPROXIMATIONS)
@pytest.mark.parametrize("dtype,with_bias", [(torch.float32, True), (torch.float32, False), (torch.bfloat16, True)])
def test_gelu_cpu_and_triton_match_reference(request, shape, approximate, dtype, with_bias):
    for device in ["cpu"] + ([request.getfixturevalue("triton_device")] if shape[-1] != 40 else []):
        x = rand(*shape, dtype=dtype, device=device).requires_grad_()
        bias = rand(shape[-1], dtype=dtype, seed=1, device=device).requires_grad_() if with_bias else None
        dy = rand(*shape, dtype=dtype, seed=2, device=device)
        ry, rdx, rdb = gelu_reference(x.detach(), None if bias is None else bias.detach(), approximate, dy)
        if device == "cpu":  # the op on CPU tensors: torch
            y = bias_act.bias_gelu(x, bias, approximate)
            y.backward(dy)
            d_x, d_b = x.grad, None if bias is None else bias.grad
        else:  # the Triton launchers, called directly
            y = bias_act.triton_bias_gelu(x.detach(), bias, approximate)
            d_x, d_b = bias_act.triton_bias_gelu_backward(dy, x.detach(), bias, approximate)
        close(y, ry, dtype)
        close(d_x, rdx, dtype)
        if bias is not None:
            close(d_b, rdb, dtype, BIAS_TOL)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_cpu_and_triton_match_reference(request, shape, dtype):
    """gate and up are the two halves of one (..., 2F) projection: strided views on both paths."""
    feats = shape[-1]
    for device in ["cpu"] + ([request.getfixturevalue("triton_device")] if feats != 40 else []):
        packed = rand(*shape[:-1], 2 * feats, dtype=dtype, device=device)
        biases = rand(2 * feats, dtype=dtype, seed=1, device=device)
        dy = rand(*shape, dtype=dtype, seed=2, device=device)
        gate, up = packed.chunk(2, -1)
        gate_bias, up_bias = biases.chunk(2)
        expected = swiglu_reference(gate, up, gate_bias, up_bias, dy)
        if device == "cpu":
            leaves = [t.clone().requires_grad_() for t in (packed, biases)]
            y = bias_act.bias_swiglu_packed(*leaves)
            y.backward(dy)
            got = (y, *leaves[0].grad.chunk(2, -1), *leaves[1].grad.chunk(2))
        else:
            y = bias_act.triton_bias_swiglu(gate, up, gate_bias, up_bias)
            d_gate, d_up, d_biases = bias_act.triton_bias_swiglu_backward(dy, gate, up, gate_bias, up_bias)
            got = (y, d_gate, d_up, d_biases[0], d_biases[1])
        for i, (a, e) in enumerate(zip(got, expected)):
            close(a, e, dtype, BIAS_TOL if i >= 3 else TOL)


def test_swiglu_without_biases(triton_device):
    gate, up, dy = (rand(5, 96, seed=s) for s in range(3))
    y0 = bias_act.bias_swiglu(gate, up)
    y1 = bias_act.triton_bias_swiglu(gate.to(triton_device), up.to(triton_device), None, None)
    close(y0, F.silu(gate.double()) * up.double(), torch.float32)
    close(y1.cpu(), y0, torch.float32)
    d_gate, d_up, d_biases = bias_act.triton_bias_swiglu_backward(
        *(t.to(triton_device) for t in (dy, gate, up)), None, None)
    assert d_biases.numel() == 0
    _, rg, ru, _, _ = swiglu_reference(gate, up, torch.zeros(96), torch.zeros(96), dy)
    close(d_gate.cpu(), rg, torch.float32)
    close(d_up.cpu(), ru, torch.float32)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    x, b, g = (rand(*s, seed=i, device=device) for i, s in enumerate([(4, 24), (24,), (4, 24)]))
    for approximate in bias_act.APPROXIMATIONS:
        torch.library.opcheck(torch.ops.meshc.bias_gelu.default, (x.requires_grad_(), b, approximate))
        torch.library.opcheck(torch.ops.meshc.bias_gelu_backward.default, (g, x.detach(), b, approximate))
    gate, up, g = (rand(2, 3, 16, seed=i, device=device) for i in (3, 4, 5))
    torch.library.opcheck(torch.ops.meshc.bias_swiglu.default, (gate.requires_grad_(), up, None, b[:16]))
    torch.library.opcheck(torch.ops.meshc.bias_swiglu_backward.default, (g, gate.detach(), up, None, b[:16]))


def test_gradcheck_float64():
    x, b = rand(3, 7, dtype=torch.float64), rand(7, dtype=torch.float64, seed=1)
    for approximate in bias_act.APPROXIMATIONS:
        assert torch.autograd.gradcheck(lambda x, b: bias_act.bias_gelu(x, b, approximate),
                                        (x.clone().requires_grad_(), b.clone().requires_grad_()))
    shapes = [(3, 7), (3, 7), (7,), (7,)]
    leaves = [rand(*s, dtype=torch.float64, seed=i).requires_grad_() for i, s in enumerate(shapes)]
    assert torch.autograd.gradcheck(bias_act.bias_swiglu, leaves)


def test_bad_input_says_the_rule():
    with pytest.raises(ValueError, match="approximate: expected one of"):
        bias_act.bias_gelu(torch.zeros(2, 4), None, "exact")
    with pytest.raises(ValueError, match="bias: expected shape"):
        bias_act.bias_gelu(torch.zeros(2, 4), torch.zeros(5))
    with pytest.raises(ValueError, match="bias_swiglu up: expected"):
        bias_act.bias_swiglu(torch.zeros(2, 4), torch.zeros(2, 5))
