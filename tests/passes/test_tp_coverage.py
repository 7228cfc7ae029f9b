"""Coverage of the tensor-parallel plan: explain() reports the share of the blocks' weight bytes held sharded
and why each replicated module stays whole; compile warns below one half and Plan(min_tp_coverage=...) refuses."""
from __future__ import annotations

import warnings

import pytest
import torch

import meshc
from meshc.compiler.compile import compile_rank
from meshc.compiler.report.explain import explain
from meshc.compiler.ir.coverage import coverage
from meshc.compiler.ir.errors import MeshcValueError, MeshcWarning
from meshc.compiler.ir.mesh_spec import MeshSpec
from tests import zoo
from tests.parity import block_coverage


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(16, 16)

    def forward(self, x):
        return x + torch.softmax(self.proj(x), dim=-1)  # a softmax over the features: no column split survives it


class Blocks(torch.nn.Module):
    """Two blocks of `block_cls` applied in turn, under `blocks.0` and `blocks.1` as the plan expects."""

    def __init__(self, block_cls):
        super().__init__()
        self.blocks = torch.nn.ModuleList(block_cls() for _ in range(2))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def _compile(model, **plan):
    torch.manual_seed(0)
    plan = meshc.Plan(trace="non-strict", check_trace=False, **plan)
    result, _ = compile_rank(model, (torch.randn(2, 4, 16),), {}, mesh=MeshSpec({"tp": 2}), plan=plan, rank=0)
    return result.program


def test_nothing_sharded_warns_with_modules_and_reasons():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        program = _compile(Blocks(_Block))
    texts = [str(w.message) for w in caught if issubclass(w.category, MeshcWarning) and "shards 0.00" in str(w.message)]
    assert len(texts) == 1, [str(w.message) for w in caught]
    assert "blocks.0.proj: " in texts[0] and "blocks.1.proj: " in texts[0] and "softmax" in texts[0]
    report = str(explain(program))
    assert "sharded: tp 0.00" in report and "replicated on tp: blocks.0.proj: " in report


def test_min_tp_coverage_makes_it_an_error():
    with pytest.raises(MeshcValueError, match=r"min_tp_coverage: expected at least 0.90 .* got 0.00; "
                                              r"replicated: blocks.0.proj: .*softmax"):
        _compile(Blocks(_Block), min_tp_coverage=0.9)


@pytest.mark.parametrize("bad", [0, 1.5, True, "0.9"])
def test_min_tp_coverage_is_validated(bad):
    with pytest.raises(MeshcValueError, match="Plan.min_tp_coverage: expected a fraction"):
        meshc.Plan(min_tp_coverage=bad)


def test_sharded_model_reports_full_coverage_and_does_not_warn():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        traced = zoo.build("llama")
        plan = meshc.Plan(trace="non-strict", check_trace=False, min_tp_coverage=0.99)
        result, _ = compile_rank(traced, (zoo.batches(1, 2)[0][0],), {}, mesh=MeshSpec({"tp": 2}), plan=plan, rank=0)
    assert not [w for w in caught if "blocks' weight bytes" in str(w.message)]
    program = result.program
    assert coverage(program.params, {"tp": 2}).fractions == {"tp": 1.0}
    assert "block weights" in str(explain(program)) and "sharded: tp 1.00" in str(explain(program))


class _HandLinears(torch.nn.Module):
    """An MLP block whose linears are written by hand, as Falcon's are: x @ weight.T, torch.matmul(h, weight.t())."""

    def __init__(self):
        super().__init__()
        self.up = torch.nn.Parameter(torch.randn(32, 16))  # (out, in), as nn.Linear stores it
        self.down = torch.nn.Parameter(torch.randn(16, 32))

    def forward(self, x):
        return x + torch.matmul(torch.relu(x @ self.up.T), self.down.t())


def test_matmul_by_a_transposed_weight_is_a_linear_layer():
    program = _compile(Blocks(_HandLinears), min_tp_coverage=1.0)
    for i in range(2):
        assert str(program.params[f"blocks.{i}.up"].placements["tp"]) == "S(0)"  # column-parallel
        assert str(program.params[f"blocks.{i}.down"].placements["tp"]) == "S(1)"  # row-parallel


@pytest.mark.parametrize("name", ["falcon_mha", "gpt_neox", "gptj"])
def test_fused_and_interleaved_projections_shard_at_tp4(name):
    """tp=4 (parity at tp=2 is tests/models/test_tp_parity.py's): >= 90% of the blocks' weight bytes held in
    parts, read from the local shapes the plan gives each parameter."""
    model = zoo.build(name)
    plan = meshc.Plan(trace="non-strict", check_trace=False)
    result, _ = compile_rank(model, (zoo.batches(1, 2)[0][0],), {}, mesh=MeshSpec({"tp": 4}), plan=plan, rank=0)
    local = {fqn: spec.local_shape({"tp": 4}) for fqn, spec in result.program.params.items()}
    assert block_coverage(local, model, 4) >= 0.9


class _Swish(torch.autograd.Function):
    """An activation written for its backward (as BLOOM's GeLU is): elementwise in forward and backward."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * torch.sigmoid(x)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        s = torch.sigmoid(x)
        return g * (s + x * s * (1 - s))


class _RowNorm(torch.autograd.Function):
    """Not elementwise: each output reads its whole row (a reduction over the features)."""

    @staticmethod
    def forward(ctx, x):
        return x / x.abs().sum(-1, keepdim=True)

    @staticmethod
    def backward(ctx, g):
        return g


class _Noisy(torch.autograd.Function):
    """Not elementwise for sharding: it draws random numbers (a shard would draw other ones)."""

    @staticmethod
    def forward(ctx, x):
        return x + torch.rand_like(x)

    @staticmethod
    def backward(ctx, g):
        return g


def _function_mlp(fn):
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down = torch.nn.Linear(16, 32), torch.nn.Linear(32, 16)

        def forward(self, x):
            return x + self.down(fn.apply(self.up(x)))

    return Blocks(Block)


def test_an_elementwise_function_is_seen_through():
    program = _compile(_function_mlp(_Swish), min_tp_coverage=1.0)
    for i in range(2):
        assert str(program.params[f"blocks.{i}.up.weight"].placements["tp"]) == "S(0)"
        assert str(program.params[f"blocks.{i}.down.weight"].placements["tp"]) == "S(1)"
    fn = [n for n in program.gm.graph.nodes if "meshc_fn" in str(n.target)]
    assert len(fn) == 2 and all(tuple(n.args[0][0].meta["val"].shape) == (2, 4, 16) for n in fn)  # 32 / tp=2


@pytest.mark.parametrize("fn, why", [(_RowNorm, "calls aten.sum"), (_Noisy, "calls aten.rand_like")])
def test_an_opaque_function_keeps_its_layer_whole_and_says_why(fn, why):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        program = _compile(_function_mlp(fn))
    report = str(explain(program))
    assert "replicated on tp: blocks.0.up: " in report
    assert f"(a user autograd.Function: its forward or backward {why}" in report
    assert str(program.params["blocks.0.up.weight"].placements["tp"]) == "R"
    assert any("shards 0.00" in str(w.message) for w in caught)
