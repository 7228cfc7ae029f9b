"""meshc::bias_dropout_add_norm: CPU path and Triton path against plain torch, dropout, opcheck, gradcheck.

Tolerances. The reference runs in float64 from the same inputs (F.layer_norm / F.rms_norm, an
explicit mask), rounding s to the residual's dtype as the op does. fp32: the op's fp32 row sums over
H <= 256 are good to ~1e-6 relative, sums over rows (weight and bias grads) to ~1e-5: atol = rtol =
1e-4. bf16 outputs carry one rounding (2**-8 relative), two steps where Triton's interpreter
truncates instead of rounding to nearest: rtol = 1.6e-2 (2 ulps), atol = 1e-2 for values near 0.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from meshc.kernels import bias_dropout_add_norm as bdan

EPS = 1e-5
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])  # opcheck on CUDA runs the Triton kernels
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=1e-2, rtol=1.6e-2)}


def make(shape, dtype=torch.float32, norm="layernorm", bias=True, res_dtype=None, p=0.0, seed=0, device="cpu"):
    """Inputs as the op takes them: x, bias, residual, weight, norm_bias, rng."""
    g = torch.Generator().manual_seed(seed)
    hidden = shape[-1]

    def rand(*s, dt=dtype):
        return torch.randn(*s, generator=g).to(dt).to(device)

    rng = torch.tensor([1234 + seed, 99], dtype=torch.int64, device=device) if p > 0 else None
    return dict(x=rand(*shape), bias=rand(hidden) if bias else None, residual=rand(*shape, dt=res_dtype or dtype),
                weight=1 + 0.5 * rand(hidden), norm_bias=rand(hidden) if norm == "layernorm" else None, rng=rng)


def reference(x, bias, residual, weight, norm_bias, keep, p, norm, s_dtype):
    """Plain torch in float64 on float64 inputs: (y, s). s is rounded to s_dtype, as the op stores it,
    with an identity gradient (the op's backward does not round there either)."""
    h = x + (0 if bias is None else bias)
    if keep is not None:
        h = h * keep.double() / (1 - p)
    s = residual + h
    s = s + (s.to(s_dtype).double() - s).detach()
    shape = (x.shape[-1],)
    if norm == "layernorm":
        y = F.layer_norm(s, shape, weight.double(), norm_bias.double(), EPS)
    else:
        y = F.rms_norm(s, shape, weight.double(), EPS)
    return y, s


def reference_with_grads(inputs, p, norm, dy, ds):
    """Reference outputs and the grads of (x, bias, residual, weight, norm_bias) for grad outputs dy, ds."""
    names = ("x", "bias", "residual", "weight", "norm_bias")
    leaves = {k: None if inputs[k] is None else inputs[k].detach().double().requires_grad_() for k in names}
    keep = None if p == 0 else bdan._keep_mask(inputs["rng"].cpu(), inputs["x"].shape, p).to(inputs["x"].device)
    y, s = reference(*(leaves[k] for k in names), keep, p, norm, inputs["residual"].dtype)
    wanted = [v for v in leaves.values() if v is not None]
    grads = iter(torch.autograd.grad((y, s), wanted, (dy.double(), ds.double())))
    return y, s, {k: None if v is None else next(grads) for k, v in leaves.items()}


def close(actual, expected, dtype):
    torch.testing.assert_close(actual.double(), expected.double(), **TOL[dtype])


CASES = [  # shape, dtype, norm, bias, residual dtype, p
    ((3, 37), torch.float32, "layernorm", True, None, 0.0),
    ((5, 96), torch.float32, "rmsnorm", False, None, 0.0),
    ((5, 96), torch.float32, "layernorm", True, None, 0.3),
    ((3, 37), torch.float32, "rmsnorm", True, None, 0.25),
    ((2, 3, 64), torch.bfloat16, "layernorm", True, None, 0.1),
    ((4, 48), torch.bfloat16, "rmsnorm", True, torch.float32, 0.0),  # fp32 residual stream
]


@pytest.mark.parametrize("shape,dtype,norm,bias,res_dtype,p", CASES)
def test_cpu_op_matches_reference(shape, dtype, norm, bias, res_dtype, p):
    inputs = make(shape, dtype, norm, bias, res_dtype, p)
    leaves = {k: v.clone().requires_grad_() if v is not None and v.is_floating_point() else v
              for k, v in inputs.items()}
    y, s = bdan.bias_dropout_add_norm(leaves["x"], leaves["bias"], leaves["residual"], leaves["weight"],
                                      leaves["norm_bias"], p=p, norm=norm, eps=EPS, rng=leaves["rng"])
    dy, ds = torch.randn_like(y), torch.randn_like(s)
    ry, rs, rgrads = reference_with_grads(inputs, p, norm, dy, ds)
    close(y, ry, dtype)
    close(s, rs, dtype)
    torch.autograd.backward((y, s), (dy, ds))
    for name, expected in rgrads.items():
        if expected is not None:
            close(leaves[name].grad, expected, dtype)


@pytest.mark.parametrize("shape,dtype,norm,bias,res_dtype,p", CASES)
def test_triton_matches_reference(triton_device, shape, dtype, norm, bias, res_dtype, p):
    inputs = make(shape, dtype, norm, bias, res_dtype, p, device=triton_device)
    args = [inputs[k] for k in ("x", "bias", "residual", "weight", "norm_bias", "rng")]
    y, s = bdan.triton_forward(*args, p, norm, EPS)
    dy, ds = torch.randn_like(y), torch.randn_like(s)
    ry, rs, rgrads = reference_with_grads(inputs, p, norm, dy, ds)
    close(y, ry, dtype)
    close(s, rs, dtype)
    # backward from the reference's s: the interpreter truncates s to bf16 where torch rounds, and that
    # one-ulp difference in s would move d_weight by more than the backward's own error
    s_ref = rs.to(s.dtype)
    d_res, d_x, d_params = bdan.triton_backward(dy, ds, s_ref, inputs["weight"], inputs["rng"], p, norm, EPS, dtype)
    close(d_res, rgrads["residual"], dtype)
    close(d_x if d_x.numel() else d_res, rgrads["x"], dtype)
    close(d_params[0], rgrads["weight"], dtype)
    if bias:
        close(d_params[2], rgrads["bias"], dtype)
    if norm == "layernorm":
        close(d_params[1], rgrads["norm_bias"], dtype)


def test_p0_adds_exactly():
    """With p = 0 nothing is dropped or scaled: s is residual + (x + bias) rounded once, and d_x is d_s."""
    inputs = make((4, 40), torch.bfloat16, "layernorm", True, torch.float32)
    x = inputs["x"].clone().requires_grad_()
    residual = inputs["residual"].clone().requires_grad_()
    _, s = bdan.bias_dropout_add_norm(x, inputs["bias"], residual, inputs["weight"], inputs["norm_bias"], p=0.0)
    expected = residual.detach() + (inputs["x"].float() + inputs["bias"].float())
    assert torch.equal(s, expected)
    s.sum().backward()
    assert torch.equal(x.grad.float(), residual.grad.to(torch.bfloat16).float())


def test_triton_p0_adds_exactly(triton_device):
    inputs = make((3, 37), device=triton_device)
    _, s = bdan.triton_forward(*inputs.values(), 0.0, "layernorm", EPS)
    assert torch.equal(s, inputs["residual"] + (inputs["x"] + inputs["bias"]))


def _mask_through_op(rng, shape, p, grad_too=False):
    """s for x = 1, residual = 0: the kept mask times 1/(1-p); with grad_too, also d_x for d_s = 1."""
    x = torch.ones(shape, requires_grad=grad_too)
    _, s = bdan.bias_dropout_add_norm(x, None, torch.zeros(shape), torch.ones(shape[-1]), p=p, rng=rng)
    if not grad_too:
        return s
    s.sum().backward()
    return s, x.grad


def test_dropout_statistics_and_backward_mask():
    p, shape = 0.3, (64, 512)
    s, d_x = _mask_through_op(torch.tensor([7, 0]), shape, p, grad_too=True)
    scale = torch.tensor(1 / (1 - p), dtype=torch.float32)
    assert set(s.unique().tolist()) <= {0.0, scale.item()}  # kept values scaled by 1/(1-p), exactly
    dropped = (s == 0).float().mean().item()
    sigma = (p * (1 - p) / s.numel()) ** 0.5
    assert abs(dropped - p) < 5 * sigma, (dropped, p)  # a binomial fraction: 5 sigma ~ 0.013
    assert torch.equal(d_x, s)  # backward drops and scales exactly where forward did
    assert torch.equal(_mask_through_op(torch.tensor([7, 0]), shape, p), s)  # same rng, same mask
    other = _mask_through_op(torch.tensor([8, 0]), shape, p)
    assert (other != s).float().mean() > 0.3  # another seed: masks agree only by chance (~58%)


def test_rng_offset_selects_rows_of_the_full_mask():
    """Sequence parallel: rank r's rows with offset r * rows * ceil(H/4) equal those rows of the full mask."""
    full = _mask_through_op(torch.tensor([5, 0]), (8, 22), 0.5)
    part = _mask_through_op(torch.tensor([5, 4 * 6]), (4, 22), 0.5)
    assert torch.equal(part, full[4:])


def test_philox_matches_triton_rand4x():
    """philox_uniform4 is tl.rand4x bit for bit: known outputs of Triton's Philox (seed 12345678901, counter 7)."""
    u = bdan.philox_uniform4(torch.tensor([12345678901, 0]), torch.tensor([7]))
    assert u[0, 0].item() == pytest.approx(0.4691, abs=1e-4)  # tl.rand(12345678901, 7), printed by triton 3.9


@pytest.mark.parametrize("shape", [(5, 96), (3, 37)])
def test_mask_matches_between_cpu_and_triton(triton_device, shape):
    rng, p = torch.tensor([2**40 + 3, 2**33 + 5], dtype=torch.int64), 0.4
    cpu = _mask_through_op(rng, shape, p)
    ones = torch.ones(shape, device=triton_device)
    _, s = bdan.triton_forward(ones, None, torch.zeros_like(ones), torch.ones(shape[-1], device=triton_device), None,
                               rng.to(triton_device), p, "rmsnorm", EPS)
    assert torch.equal(s.cpu(), cpu)  # the same Philox stream on both paths, bit for bit


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("norm,p", [("layernorm", 0.0), ("rmsnorm", 0.2), ("layernorm", 0.2)])
def test_opcheck(norm, p, device):
    inputs = make((3, 2, 16), norm=norm, p=p, device=device)
    args = tuple(inputs[k] for k in ("x", "bias", "residual", "weight", "norm_bias", "rng")) + (p, norm, EPS)
    leaves = tuple(a.clone().requires_grad_() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                   for a in args)
    torch.library.opcheck(torch.ops.meshc.bias_dropout_add_norm.default, leaves)
    y, s = torch.ops.meshc.bias_dropout_add_norm(*args)
    bwd_args = (torch.randn_like(y), torch.randn_like(s), s, inputs["weight"], inputs["rng"], p, norm, EPS,
                torch.float32)
    torch.library.opcheck(torch.ops.meshc.bias_dropout_add_norm_backward.default, bwd_args)


@pytest.mark.parametrize("norm", bdan.NORMS)
def test_gradcheck_float64(norm):
    inputs = make((3, 8), torch.float64, norm, p=0.3)
    names = ("x", "bias", "residual", "weight", "norm_bias")
    leaves = [inputs[k].clone().requires_grad_() for k in names if inputs[k] is not None]

    def fn(x, bias, residual, weight, *norm_bias):
        return bdan.bias_dropout_add_norm(x, bias, residual, weight, *norm_bias, p=0.3, norm=norm, eps=EPS,
                                          rng=inputs["rng"])

    assert torch.autograd.gradcheck(fn, leaves)


def test_export_keeps_the_op():
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight, self.bias = torch.nn.Parameter(torch.ones(16)), torch.nn.Parameter(torch.zeros(16))

        def forward(self, x, residual):
            return bdan.bias_dropout_add_norm(x, None, residual, self.weight, self.bias)

    x, residual = torch.randn(2, 16), torch.randn(2, 16)
    ep = torch.export.export(Block(), (x, residual))
    assert any(n.target is torch.ops.meshc.bias_dropout_add_norm.default for n in ep.graph.nodes)
    torch.testing.assert_close(ep.module()(x, residual), Block()(x, residual))


@pytest.mark.parametrize("change,rule", [
    (dict(residual=torch.zeros(3, 9)), "residual: expected shape"),
    (dict(weight=torch.ones(9)), "weight: expected shape"),
    (dict(norm="batchnorm"), "norm: expected one of"),
    (dict(p=1.0), "p: expected 0 <= p < 1"),
    (dict(p=0.5, rng=torch.zeros(3, dtype=torch.int64)), "rng: expected an int64 tensor"),
])
def test_bad_input_says_the_rule(change, rule):
    args = dict(x=torch.zeros(3, 8), bias=None, residual=torch.zeros(3, 8), weight=torch.ones(8), norm_bias=None,
                rng=None, p=0.0, norm="layernorm", eps=EPS)
    args.update(change)
    with pytest.raises(ValueError, match=rule):
        torch.ops.meshc.bias_dropout_add_norm(*args.values())
