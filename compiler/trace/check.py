"""check_trace: the traced program computes what the model computes, loss and gradients, before any sharding.

A trace that changes a model's semantics trains silently wrong under every plan (a custom backward
dropped, an op exported differently). So, on the example batch, both the eager model and the traced
program (lifted: parameters, buffers and inputs as arguments) run forward, a probe loss
sum(output * r) over every floating output with fixed random weights r, and backward; the loss and every
parameter's gradient must agree, else a TraceError names the first parameter whose gradient differs.

Tolerance: both sides run the same ATen ops on the same fp32 values, so they agree to rounding (measured:
bitwise, or ~1e-7 relative where export picks another matmul or attention path); a semantic change shows
as a relative difference of 1e-3 and more (a dropped straight-through backward: 100%). A gradient passes
when max|g_traced - g_eager| <= 1e-4 * max|g_eager| + 1e-6.

The RNG is forked and reseeded identically for both runs (dropout draws the same masks); buffers the model
mutates (BatchNorm statistics) are restored after the eager run. Skipped, with a note: fake or meta tensors
(nothing to run), mixed precision (the program was traced in the compute dtype).
"""
from __future__ import annotations

import torch

from meshc.compiler.ir.torch_compat import is_fake, tree_flatten, tree_unflatten
from meshc.compiler.ir.errors import TraceError
from meshc.compiler.ir.program import GRAD_REGION, Program

AUTO_LIMIT = 16 * 2**20  # elements of parameters up to which Plan(check_trace=None) checks
RTOL, ATOL = 1e-4, 1e-6


def wanted(plan, tensors: dict[str, torch.Tensor]) -> bool:
    """Does `plan` ask for the check on a model holding `tensors`?"""
    if plan.check_trace is not None:
        return plan.check_trace
    return sum(t.numel() for t in tensors.values()) <= AUTO_LIMIT


def check_trace(model: torch.nn.Module, traced: Program, tensors: dict[str, torch.Tensor], args: tuple,
                kwargs: dict) -> str:
    """Compare the traced program with `model` on the example inputs; returns a note, raises on a difference."""
    values = list(tensors.values()) + [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor)]
    if any(v.device.type == "meta" or is_fake(v) for v in values):
        return "check_trace: skipped (fake or meta tensors)"
    if traced.plan.param_dtype is not None:
        return "check_trace: skipped (mixed precision: traced in the compute dtype)"
    params = [f for f, s in traced.params.items() if s.requires_grad and tensors[f].requires_grad]
    saved = {f: tensors[f].detach().clone() for f in traced.buffers}
    eager_loss, eager = _run(lambda: model(*args, **kwargs), [tensors[f] for f in params])
    with torch.no_grad():
        for f, value in saved.items():
            tensors[f].copy_(value)
    flat = tree_flatten((args, kwargs))[0]
    inputs = [tensors[f] for f in traced.params] + [saved[f].clone() for f in traced.buffers]

    def program():
        outs = traced.gm(*inputs, *flat)
        return tree_unflatten(list(outs[len(traced.mutated_buffers):]), traced.out_spec)
    traced_loss, got = _run(program, [tensors[f] for f in params])
    if not torch.allclose(traced_loss, eager_loss, rtol=RTOL, atol=ATOL):
        raise TraceError(_message(traced, "the probe loss", (traced_loss - eager_loss).abs().item(), eager_loss))
    for fqn, g, e in zip(params, got, eager):
        if (g is None) != (e is None):
            raise TraceError(_message(traced, f"the gradient of {fqn}", float("inf"), None,
                                      f"(a gradient on {'the traced' if g is not None else 'the eager'} side only)"))
        if g is not None and (g - e).abs().max() > RTOL * e.abs().max() + ATOL:
            raise TraceError(_message(traced, f"the gradient of {fqn}", (g - e).abs().max().item(), e))
    return f"check_trace: loss and {len(params)} gradients equal eager on the example batch"


def _run(fn, params: list[torch.Tensor]) -> tuple[torch.Tensor, list]:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1234)
        out = fn()
    loss = _probe(out)
    if loss is None:
        raise TraceError("check_trace: expected the model to return floating-point tensors (in any nesting of "
                         "tuples, lists, dicts or model-output classes), got none to compare; Plan(check_trace=False) "
                         "skips this check")
    if not loss.requires_grad:
        return loss.detach(), [None] * len(params)
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    return loss.detach(), list(grads)


def _probe(out) -> torch.Tensor | None:
    """sum(output * r) over the floating outputs, r fixed random weights (the same on both sides)."""
    gen = torch.Generator().manual_seed(0)
    total = None
    for leaf in tree_flatten(out)[0]:
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point():
            r = torch.randn(leaf.shape, generator=gen, dtype=torch.float64).to(leaf.device)
            term = (leaf.double() * r).sum().cpu()
            total = term if total is None else total + term
    return total


def _message(traced: Program, what: str, diff: float, expected, extra: str = "") -> str:
    scale = f" (largest |eager| value {expected.abs().max().item():.3g})" if isinstance(expected, torch.Tensor) else ""
    suspects = [n for n in traced.gm.graph.nodes if n.meta.get(GRAD_REGION)  # a no_grad region's result
                or "autograd_function" in str(n.target)]
    hint = ""
    if suspects:
        line = (suspects[0].meta.get("stack_trace") or "").strip().splitlines()[-1:] or [suspects[0].format_node()]
        hint = (f"; the trace holds a torch.autograd.Function whose backward the export dropped, at {line[0].strip()}"
                f": trace with Plan(trace=\"non-strict\"), or register it as a torch.library custom op")
    return (f"check_trace: expected the traced program ({traced.trace_mode} torch.export) to compute what the model "
            f"computes, got {what} {diff:.3g} away from eager{scale}{' ' + extra if extra else ''}{hint}. The model "
            "would train differently under every plan; Plan(check_trace=False) skips this check")
