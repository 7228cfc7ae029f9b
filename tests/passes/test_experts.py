"""The experts pass on traced graphs (no process group): what it recognises, what it rewrites, what stops it.

Training parity under expert parallelism is in tests/models/test_ep_parity.py and test_ep_routing.py.
"""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

import meshc
from meshc.compiler.compile import compile_program
from meshc.compiler.ir.errors import MeshcWarning
from meshc.compiler.ir.mesh_spec import MeshSpec
from meshc.compiler.ir.placement import Replicate, Shard
from meshc.runtime.ops.experts import combine, dispatch
from tests import zoo

PLAN = meshc.Plan(trace="non-strict", verify=True, check_trace=False)


class TinyMoE(torch.nn.Module):
    """A mixture of experts written out by hand (not a transformers class): linear router, softmax, top-2, rows
    sorted by expert, torch's grouped matmul over stacked (E, K, N) weights, the weighted sum back per token.
    `mix_rows` puts an op that mixes rows (a mean over them) between the two grouped matmuls. In bf16: torch's
    grouped matmul has no other dtype on CPU (the pass only compiles it here)."""

    def __init__(self, experts: int = 4, hidden: int = 8, inner: int = 16, mix_rows: bool = False):
        super().__init__()
        self.router = torch.nn.Linear(hidden, experts, bias=False, dtype=torch.bfloat16)
        self.w_in = torch.nn.Parameter(torch.randn(experts, hidden, inner, dtype=torch.bfloat16))
        self.w_out = torch.nn.Parameter(torch.randn(experts, inner, hidden, dtype=torch.bfloat16))
        self.experts, self.mix_rows = experts, mix_rows

    def forward(self, x):  # (T, H)
        probs = F.softmax(self.router(x), dim=-1)
        top, index = torch.topk(probs, 2, dim=-1)
        ids, order = torch.sort(index.reshape(-1))
        rows = x[order // 2]
        offsets = torch.cumsum(torch.histc(ids.float(), bins=self.experts, min=0, max=self.experts - 1), 0,
                               dtype=torch.int32)
        h = F.silu(torch._grouped_mm(rows, self.w_in, offs=offsets))
        if self.mix_rows:
            h = h - h.mean(dim=0, keepdim=True)
        out = torch._grouped_mm(h, self.w_out, offs=offsets)
        back = torch.empty_like(order)
        back[order] = torch.arange(order.numel())
        return (out[back].view(-1, 2, x.shape[-1]) * top.unsqueeze(-1)).sum(1)


def _compile(model, x, **sizes):
    traced, program, _ = compile_program(model, (x,), {}, mesh=MeshSpec(sizes), plan=PLAN, rank=0)
    return traced, program


def _calls(program, fn) -> list:
    return [n for n in program.gm.graph.nodes if n.op == "call_function" and n.target is fn]


def test_mixtral_experts_sharded_with_dispatch_and_combine():
    model = zoo.mixtral()
    x = torch.randint(0, zoo.VOCAB, (2, zoo.SEQ))
    traced, program = _compile(model, x, dp=4, ep=2)
    experts = [f for f in program.params if ".experts." in f]
    assert len(experts) == 4
    for fqn, spec in program.params.items():
        assert spec.placements["ep"] == (Shard(0) if fqn in experts else Replicate()), fqn
    placeholders = {n.meta["meshc.fqn"]: n for n in program.placeholders("param")}
    assert tuple(placeholders[experts[0]].meta["val"].shape) == (2, 128, 32)  # E/ep of (4, 128, 32)
    sends, backs = _calls(program, dispatch), _calls(program, combine)
    assert len(sends) == len(backs) == 2
    rows = 2 * zoo.SEQ * 2  # tokens × top-2
    for node in sends + backs:  # payload of the balanced case: S rows of the hidden width, fp32, each way
        assert [(r.kind, r.axis, r.bytes, r.phase) for r in node.meta["meshc.comm"]] == [
            ("all_to_all", "ep", rows * 32 * 4, "forward"), ("all_to_all", "ep", rows * 32 * 4, "backward")]
    assert "2 of 2 expert layer(s) sharded over ep=2" in "\n".join(program.notes)
    assert len(program.experts) == 2 and not any(r.stopped for r in program.experts)


def test_gathered_experts_are_sorted_then_dispatched():
    """transformers' batched_mm experts gather each row's expert weights by id (weight[ids] @ rows): the same
    layer, recognised from the index by a 1-D id tensor into a 3-D parameter whose one user is a bmm; the rows
    are sorted by id before the dispatch and put back in order after the combine."""
    from meshc.runtime.ops.experts import local_ids, sort_rows, unsort_rows

    _, program = _compile(zoo.mixtral(experts="batched_mm"), torch.randint(0, zoo.VOCAB, (2, zoo.SEQ)), dp=2, ep=2)
    assert all(program.params[f].placements["ep"] == Shard(0) for f in program.params if ".experts." in f)
    for fn in (sort_rows, dispatch, local_ids, combine, unsort_rows):
        assert len(_calls(program, fn)) == 2, fn.__name__
    assert all(r.ids is not None and r.offsets is None for r in program.experts)


def test_per_expert_biases_are_read_by_local_ids():
    """GPT-OSS: (E, in, out) experts read as they are, a per-expert bias gathered by the sorted ids after each
    grouped matmul (`out + bias[ids]`), gate and up interleaved (`[..., ::2]`, `[..., 1::2]`): the biases are
    sharded with their experts and gathered by each dispatched row's local expert; the down bias joins the region."""
    from meshc.runtime.ops.experts import local_ids

    _, program = _compile(zoo.gpt_oss(), torch.randint(0, zoo.VOCAB, (2, zoo.SEQ)), dp=2, ep=2)
    experts = [f for f in program.params if ".experts." in f]
    assert len(experts) == 8 and all(program.params[f].placements["ep"] == Shard(0) for f in experts)
    assert len(_calls(program, dispatch)) == 2 and len(_calls(program, local_ids)) == 2
    for region in program.experts:
        assert len(region.biases) == 2 and not region.stopped
        for bias in region.biases:  # bias[local ids] of the E/ep local experts
            ids = bias.args[1][0]
            assert ids.target is local_ids and tuple(bias.args[0].meta["val"].shape)[0] == 2, bias.format_node()
        assert region.exit.target in (torch.ops.aten.add.Tensor, torch.ops.aten.add_.Tensor)


def test_dense_experts_move_evenly():
    """Llama 4: every token through every expert by bmm over rows viewed (E, T, H): the rows are dispatched by an
    even count per expert, the view takes the E/ep local experts, the output (viewed back to rows) is combined."""
    from meshc.runtime.ops.experts import even_offsets

    _, program = _compile(zoo.llama4_moe(), torch.randint(0, zoo.VOCAB, (2, zoo.SEQ)), dp=2, ep=2)
    assert len(_calls(program, even_offsets)) == len(_calls(program, dispatch)) == len(_calls(program, combine)) == 2
    for region in program.experts:
        assert region.dense is not None and not region.stopped and len(region.matmuls) == 2
        view = region.dense
        assert view.args[0].args[0].target is dispatch and view.args[1][0] == 2, view.format_node()
        assert tuple(view.meta["val"].shape) == (2, 2 * (2 * zoo.SEQ), 32)  # E/ep experts, ep × (B·T) rows
    placeholders = {n.meta["meshc.fqn"]: n for n in program.placeholders("param")}
    gate_up = "model.layers.0.feed_forward.experts.gate_up_proj"
    assert tuple(placeholders[gate_up].meta["val"].shape) == (2, 32, 64)


class Interleaved(TinyMoE):
    """Gate and up interleaved in one grouped matmul's output, taken apart by strided slices of the features."""

    def __init__(self):
        super().__init__(inner=16)
        self.w_out = torch.nn.Parameter(torch.randn(self.experts, 8, 8, dtype=torch.bfloat16))

    def forward(self, x):
        probs = F.softmax(self.router(x), dim=-1)
        top, index = torch.topk(probs, 2, dim=-1)
        ids, order = torch.sort(index.reshape(-1))
        offsets = torch.cumsum(torch.histc(ids.float(), bins=self.experts, min=0, max=self.experts - 1), 0,
                               dtype=torch.int32)
        h = torch._grouped_mm(x[order // 2], self.w_in, offs=offsets)
        out = torch._grouped_mm(F.silu(h[..., ::2]) * h[..., 1::2], self.w_out, offs=offsets)
        back = torch.empty_like(order)
        back[order] = torch.arange(order.numel())
        return (out[back].view(-1, 2, x.shape[-1]) * top.unsqueeze(-1)).sum(1)


def test_strided_slices_of_the_features_are_row_wise():
    torch.manual_seed(0)
    _, program = _compile(Interleaved(), torch.randn(8, 8, dtype=torch.bfloat16), dp=2, ep=2)
    assert program.params["w_in"].placements["ep"] == Shard(0) and len(_calls(program, dispatch)) == 1


def test_ep_1_finds_experts_and_changes_nothing():
    _, program = _compile(zoo.mixtral(), torch.randint(0, zoo.VOCAB, (2, zoo.SEQ)), dp=2)
    assert not _calls(program, dispatch)
    assert "experts found, replicated (ep = 1)" in "\n".join(program.notes)
    assert "ep" not in program.mesh.sizes


def test_hand_written_moe_is_recognised_from_ops():
    torch.manual_seed(0)
    _, program = _compile(TinyMoE(), torch.randn(8, 8, dtype=torch.bfloat16), dp=2, ep=2)
    assert program.params["w_in"].placements["ep"] == Shard(0)
    assert program.params["w_out"].placements["ep"] == Shard(0)
    assert program.params["router.weight"].placements["ep"] == Replicate()
    assert len(_calls(program, dispatch)) == 1 and len(_calls(program, combine)) == 1


def test_rows_mixed_between_grouped_matmuls_keep_experts_replicated_and_say_why():
    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, program = _compile(TinyMoE(mix_rows=True), torch.randn(8, 8, dtype=torch.bfloat16), dp=2, ep=2)
    text = "\n".join(str(w.message) for w in caught if issubclass(w.category, MeshcWarning))
    assert "stay replicated" in text and "aten.mean.dim" in text and "is not row-wise" in text, text
    assert program.params["w_in"].placements["ep"] == Replicate()
    assert not _calls(program, dispatch)


def test_experts_not_dividing_ep_stay_replicated():
    with pytest.warns(MeshcWarning, match="4 experts do not divide over ep=3"):
        _, program = _compile(zoo.mixtral(), torch.randint(0, zoo.VOCAB, (3, zoo.SEQ)), dp=3, ep=3)
    assert all(s.placements["ep"] == Replicate() for s in program.params.values())
    assert not _calls(program, dispatch)


class WeightReadTwice(TinyMoE):
    """The experts' weight also read outside the grouped matmuls (a penalty on it): sharded, that read would see
    only this rank's experts."""

    def forward(self, x):
        return super().forward(x) + self.w_in.float().pow(2).sum()


def test_expert_weight_read_elsewhere_keeps_experts_replicated():
    torch.manual_seed(0)
    with pytest.warns(MeshcWarning, match="w_in is also used by .*outside the grouped matmuls"):
        _, program = _compile(WeightReadTwice(), torch.randn(8, 8, dtype=torch.bfloat16), dp=2, ep=2)
    assert program.params["w_in"].placements["ep"] == Replicate()
    assert not _calls(program, dispatch)


class Batched(torch.nn.Module):
    """torch's grouped matmul in its batched form (3-D rows, no offsets): not an expert layer."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(2, 8, 16, dtype=torch.bfloat16))

    def forward(self, x):  # (2, T, 8)
        return torch._grouped_mm(x, self.w).sum(-1)


@pytest.mark.parametrize("sizes", [{"dp": 2}, {"dp": 2, "ep": 2}, {"tp": 2}])
def test_batched_grouped_matmul_is_not_an_expert_layer(sizes):
    _, program = _compile(Batched(), torch.randn(2, 8, 8, dtype=torch.bfloat16), **sizes)
    assert not _calls(program, dispatch) and not program.experts


def test_no_pipeline_stage_begins_inside_an_expert_exchange():
    """A forced cut between an expert layer's dispatch and its combine is refused (the rows there have a
    data-dependent count); the automatic split never puts one there."""
    from meshc.passes.pipeline_split import _outside_expert_exchanges, activations

    model = zoo.MODELS["mixtral4"]()
    x = torch.randint(0, zoo.VOCAB, (2, zoo.SEQ))
    _, program = _compile(model, x, dp=2, ep=2, pp=2)
    order = [n for n in program.gm.graph.nodes if n in activations(program)]
    inside = next(i for i, n in enumerate(order) if n.target is dispatch) + 2
    with pytest.raises(ValueError, match="between an expert layer's dispatch .* and its combine"):
        _outside_expert_exchanges(order, [inside])
    stages = [n.meta["meshc.stage"] for n in order]
    for i, n in enumerate(order):
        if n.target is combine:
            assert stages[i] == stages[order.index(n.args[1].args[0])]


class ScalarAfter(TinyMoE):
    """A scalar added to the last grouped matmul's output (not a per-expert bias): the layer is found all the same."""

    def forward(self, x):
        probs = F.softmax(self.router(x), dim=-1)
        top, index = torch.topk(probs, 2, dim=-1)
        ids, order = torch.sort(index.reshape(-1))
        offsets = torch.cumsum(torch.histc(ids.float(), bins=self.experts, min=0, max=self.experts - 1), 0,
                               dtype=torch.int32)
        h = F.silu(torch._grouped_mm(x[order // 2], self.w_in, offs=offsets))
        out = torch._grouped_mm(h, self.w_out, offs=offsets) + 1.0
        back = torch.empty_like(order)
        back[order] = torch.arange(order.numel())
        return (out[back].view(-1, 2, x.shape[-1]) * top.unsqueeze(-1)).sum(1)


def test_a_scalar_after_the_last_grouped_matmul_is_not_a_bias():
    torch.manual_seed(0)
    _, program = _compile(ScalarAfter(), torch.randn(8, 8, dtype=torch.bfloat16), dp=2, ep=2)
    assert program.params["w_out"].placements["ep"] == Shard(0) and len(_calls(program, combine)) == 1
    assert not program.experts[0].biases


def test_ep_with_no_expert_layer_says_so():
    """Experts kept in a ModuleList and looped over (tests/plain_models.py loop_moe) are not stacked expert weights:
    ep=2 shards nothing, and says so instead of training as dp with no memory saved."""
    with pytest.warns(MeshcWarning, match="ep=2 found no expert layer"):
        _, program = _compile(zoo.build("loop_moe_plain"), torch.randint(0, zoo.VOCAB, (4, zoo.SEQ)), dp=2, ep=2)
    assert all(s.placements.get("ep", Replicate()) == Replicate() for s in program.params.values())
    assert any("found no expert layer" in w for w in program.warnings)


def test_ep_over_a_stack_read_one_expert_at_a_time_names_it():
    """JetMoE loops over its experts, `F.linear(rows, weight[i])` on a stack (E, out, in): ep cannot move rows between
    the unrolled layers, so it shards nothing, and the warning names the stack and what to write instead."""
    with pytest.warns(MeshcWarning, match=r"model\.layers\.0\.\S+_linear\.weight is a stack read one expert at a time"):
        _, program = _compile(zoo.build("jetmoe", layers=1), torch.randint(0, zoo.VOCAB, (4, zoo.SEQ)), dp=2, ep=2)
    assert all(s.placements.get("ep", Replicate()) == Replicate() for s in program.params.values())
