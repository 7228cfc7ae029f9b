"""Models with custom autograd Functions train as eager does: the trace keeps each Function's own backward.

zoo.custom_fn is a Llama whose MLP activation is a straight-through estimator (round forward, identity
backward) followed by a gradient-reversal layer (identity forward, -0.5x backward). A trace that dropped
either backward would give the MLP's gate and up projections other gradients (zero through round, the
opposite sign through the reversal): far outside the parity bounds below.

Tolerances as in test_tp_parity / test_pp_parity (same arithmetic, reordered sums): losses 2e-5, step-1
gradients 2e-6, parameters after 5 AdamW steps 5e-5. Rounding to 1/8 is discontinuous, so a reordered sum
could in principle round one element differently; measured here the runs agree to ~1e-6 on losses.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

import meshc
from meshc.compiler.compile import compile_program
from meshc.compiler.ir.mesh_spec import MeshSpec
from tests import parity, zoo
from tests.harness import run_ranks

STEPS, BATCH = 5, 8
CASES = [({"dp": 2}, {}), ({"tp": 2}, {}), ({"pp": 2}, {"microbatches": 2}),
         ({"dp": 2}, {"inductor": True})]  # compiled: the Functions' recomputing backward traced into the graph


def test_trace_keeps_the_functions_backward():
    model = zoo.build("custom_fn")
    x = zoo.batches(1, 2)[0][0]
    traced, _, _ = compile_program(model, (x,), {}, mesh=MeshSpec({}), plan=meshc.Plan(check_trace=True), rank=0)
    ops = {str(n.target) for n in traced.gm.graph.nodes if n.op == "call_function"}
    assert any("StraightThrough" in o for o in ops) and any("GradReverse" in o for o in ops), ops
    assert any("check_trace: loss and" in note for note in traced.notes)
    # the eager gradient of a gate projection really depends on the Functions' backward: round's own
    # derivative is zero, so without the straight-through backward this gradient would vanish
    zoo.lm_loss(model(x), zoo.batches(1, 2)[0][1]).backward()
    assert model.model.layers[0].mlp.gate_proj.weight.grad.abs().max() > 1e-4


def test_check_trace_catches_a_mis_traced_model():
    """Strict export drops a Function's backward: check_trace refuses the trace, naming the parameter."""
    model = zoo.build("custom_fn")
    x = zoo.batches(1, 2)[0][0]
    with pytest.raises(meshc.TraceError, match=r"check_trace: .*strict torch.export.* gradient of model\.\S+ "
                                               r".*away from eager.*torch.autograd.Function.*non-strict"):
        compile_program(model, (x,), {}, mesh=MeshSpec({}), plan=meshc.Plan(trace="strict", check_trace=True),
                        rank=0)


def test_a_function_with_an_unsupported_argument_is_refused():
    class Scaled(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, table):
            return x * table["scale"]

        @staticmethod
        def backward(ctx, grad):
            return grad, None

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            return Scaled.apply(self.lin(x), {"scale": 2.0})

    with pytest.raises(meshc.TraceError, match=r"Scaled\.apply argument 1 is a dict.*custom op"):
        compile_program(M(), (torch.randn(2, 4),), {}, mesh=MeshSpec({}), plan=meshc.Plan(trace="non-strict"),
                        rank=0)


@pytest.mark.parametrize("case", CASES, ids=["dp2", "tp2", "pp2", "dp2-inductor"])
def test_custom_functions_train_at_parity(case):
    mesh, plan = case
    world = mesh.get("dp", 1) * mesh.get("tp", 1) * mesh.get("pp", 1)
    ref = parity.reference("custom_fn", STEPS, BATCH)
    results = run_ranks(parity.meshc_rank, world, "custom_fn", STEPS, BATCH, mesh, {"check_trace": True, **plan},
                        timeout=240)
    for rank, out in enumerate(results):
        parity.assert_matches(rank, out, ref, STEPS)
    report = results[0]["report"]
    if "tp" in mesh:  # attention really is split (the custom ops themselves get replicated inputs)
        assert "tp:S(" in report
    if "pp" in mesh:  # two stages, each rank holding its own
        assert "stage 1 (pp rank 1)" in report
    if plan.get("inductor"):  # one graph each way, the Functions inside it: none left to run as FX code
        for rank, out in enumerate(results):
            compiled = out["inductor"]
            assert (compiled["forward"], compiled["backward"], compiled["eager"]) == (1, 1, []), (rank, compiled)


class _Noisy(torch.autograd.Function):
    """Forward: x plus noise it draws; backward: the gradient times that noise (it must be the same noise)."""

    @staticmethod
    def forward(ctx, x):
        noise = torch.rand_like(x)
        ctx.save_for_backward(noise)
        return x + noise

    @staticmethod
    def backward(ctx, grad):
        (noise,) = ctx.saved_tensors
        return grad * noise


def test_a_function_drawing_random_numbers_is_differentiated_with_its_own_numbers():
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            return _Noisy.apply(self.lin(x))

    torch.manual_seed(0)
    model, x = M(), torch.randn(3, 4)
    traced, _, _ = compile_program(model, (x,), {}, mesh=MeshSpec({}), plan=meshc.Plan(check_trace=True), rank=0)
    assert any("check_trace: loss and 2 gradients" in note for note in traced.notes)


class _NoisyLinear(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.second = torch.nn.Linear(4, 8), torch.nn.Linear(8, 4)

    def forward(self, x):
        return self.second(torch.tanh(_Noisy.apply(self.first(x))))


def _compiled_noisy_rank() -> dict:
    torch.manual_seed(0)
    model, x = _NoisyLinear(), torch.randn(3, 4)
    job = meshc.compile(model, meshc.mesh(timeout_s=60), example_inputs=(x,),
                        plan=meshc.Plan(trace="non-strict", inductor=True))
    torch.manual_seed(1)
    job.step(x, None, lambda out, _: out.square().sum())
    torch.manual_seed(1)  # eager, the same numbers drawn
    model.second(torch.tanh(_Noisy.apply(model.first(x)))).square().sum().backward()
    return {"grads": job.grad_state_dict(), "eager": {n: p.grad for n, p in model.named_parameters()},
            "inductor": dataclasses.asdict(job.inductor.stats)}


def test_a_compiled_program_runs_a_function_drawing_random_numbers_as_fx_code():
    """Its backward recomputes its forward under the generator state the forward saw, which no traced graph can
    restore: the Function runs between two compiled regions (runtime/regions.py), and the gradients of the weights
    before it (through its noise) are eager's, drawn with the same seed. A gradient through other noise would
    differ by ~the noise itself (uniform in [0, 1)); the bound allows fp32 reordering (~1e-7)."""
    (out,) = run_ranks(_compiled_noisy_rank, 1, timeout=240)
    compiled = out["inductor"]
    assert compiled["regions"] == 2 and len(compiled["eager"]) == 1 and "noisy" in compiled["eager"][0], compiled
    assert compiled["forward"] == 2 and compiled["backward"] == 2, compiled
    assert set(out["grads"]) == set(out["eager"])
    for name, grad in out["eager"].items():
        assert torch.allclose(out["grads"][name], grad, rtol=1e-5, atol=1e-6), name


def test_a_traced_backward_refuses_a_function_drawing_random_numbers():
    """The safety net behind the regions: were such a Function's backward traced into a graph (make_fx here, as
    AOTAutograd traces a joint graph), its recompute would draw new numbers; it raises instead, naming the Function.
    One drawing none (the straight-through estimator) traces."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from meshc.compiler.trace.autograd_functions import functions_as_ops

    def grad_of(fn):
        def traced(x):
            x = x.detach().requires_grad_(True)
            return torch.autograd.grad(fn.apply(x).sum(), x)
        return traced

    with functions_as_ops():
        graph = make_fx(grad_of(zoo.StraightThrough), tracing_mode="fake")(torch.randn(3))
        assert any("StraightThrough" in str(n.target) for n in graph.graph.nodes)
        with pytest.raises(meshc.TraceError, match=r"_Noisy.s backward would recompute .*random.*inductor=False"):
            make_fx(grad_of(_Noisy), tracing_mode="fake")(torch.randn(3))
