"""Tracing real models to ATen FX Programs: FQNs, tied weights, module stacks, and readable failures."""
from __future__ import annotations

import pytest
import torch

import meshc
from meshc.compiler.trace.export import trace
from tests import zoo


@pytest.mark.parametrize("name", ["reference", "gpt2", "llama", "bert"])
def test_trace_real_model(name, single_mesh):
    model = zoo.build(name)
    x = zoo.batches(1, 2)[0][0]
    program, tensors = trace(model, (x,), mesh=single_mesh, plan=meshc.Plan())
    # every parameter appears once, under the name named_parameters() gives it
    assert sorted(program.params) == sorted(n for n, _ in model.named_parameters())
    assert list(program.params) == [n.meta["meshc.fqn"] for n in program.placeholders("param")]
    for fqn, spec in program.params.items():
        assert spec.shape == tuple(model.get_parameter(fqn).shape)
        assert tensors[fqn] is model.get_parameter(fqn)
    # nn_module_stack survives on the computation
    calls = [n for n in program.gm.graph.nodes if n.op == "call_function"]
    assert sum("nn_module_stack" in n.meta for n in calls) > 0.9 * len(calls)
    # the lifted graph computes what the model computes: the same ATen ops on the same weights, so fp32
    # results agree to a few ulps (bitwise on most runs; export may pick another SDPA/matmul path)
    values = [tensors[f] for f in program.params] + [tensors[f] for f in program.buffers]
    out = program.gm(*values, x)
    expected = model(x)
    expected = expected.logits if hasattr(expected, "logits") else expected
    torch.testing.assert_close(out[len(program.mutated_buffers)], expected, rtol=1e-6, atol=1e-6)


def test_tied_weights_get_one_placeholder(single_mesh):
    model = zoo.reference_transformer()
    assert model.output.weight is model.tok_embeddings.weight
    program, _ = trace(model, (zoo.batches(1, 2)[0][0],), mesh=single_mesh, plan=meshc.Plan())
    fqns = [n.meta["meshc.fqn"] for n in program.placeholders("param")]
    assert "output.weight" not in fqns and fqns.count("tok_embeddings.weight") == 1
    assert program.params["tok_embeddings.weight"].aliases == ("output.weight",)
    node = program.param_nodes()["tok_embeddings.weight"]
    assert len(node.users) == 2  # the embedding lookup and the output projection


class _DataDependent(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = _Branchy()

    def forward(self, x):
        return self.inner(x) * 2


class _Branchy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        if y.sum().item() > 0:  # data-dependent Python branch: untraceable
            return y
        return -y


def test_untraceable_model_names_module_and_line(single_mesh):
    with pytest.raises(meshc.TraceError) as info:
        trace(_DataDependent(), (torch.randn(2, 4),), mesh=single_mesh, plan=meshc.Plan())
    message = str(info.value)
    assert "module 'inner' (_Branchy)" in message
    assert "test_trace.py" in message and "y.sum().item() > 0" in message
    assert "Traceback" not in message
    assert info.value.original is not None


class _ExpertLoop(torch.nn.Module):
    """A mixture of experts written as a loop over the experts the batch routes to (a data-dependent count)."""

    def __init__(self):
        super().__init__()
        self.router = torch.nn.Linear(4, 3)
        self.experts = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(3))

    def forward(self, x):
        ids = self.router(x).argmax(-1)
        out = torch.zeros_like(x)
        for e in torch.unique(ids):  # the experts hit: how many depends on the data
            rows = torch.where(ids == e)[0]
            out = out.index_add(0, rows, self.experts[e](x[rows]))
        return out


def test_loop_over_experts_hit_says_to_compute_all_experts_at_once(single_mesh):
    with pytest.raises(meshc.TraceError) as info:
        trace(_ExpertLoop(), (torch.randn(8, 4),), mesh=single_mesh, plan=meshc.Plan(trace="non-strict"))
    message = str(info.value)
    assert "for e in torch.unique(ids)" in message, message
    assert "a Python loop whose count depends on the data" in message and "grouped_mm" in message, message


class _ReturnsCache(torch.nn.Module):
    """A decoder returning transformers' KV cache beside its logits, as models built with use_cache=True do."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        from transformers import DynamicCache

        return self.lin(x), DynamicCache()


def test_a_returned_kv_cache_says_to_build_with_use_cache_off(single_mesh):
    with pytest.raises(meshc.TraceError) as info:
        trace(_ReturnsCache(), (torch.randn(2, 4),), mesh=single_mesh, plan=meshc.Plan(trace="non-strict"))
    message = str(info.value)
    assert "DynamicCache" in message and "use_cache=False" in message, message


class _Concatenating(torch.nn.Module):
    """A column layer's output joined along the rows by torch.concatenate and torch.concat (cat's aliases), then a
    row layer added to the input."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.out = torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)

    def forward(self, x):
        h = self.a(x)
        g = torch.concat([torch.concatenate([h.relu(), h.sigmoid()], dim=1)] * 2, dim=0)
        return x.repeat(2, 2, 1) + self.out(g)


def test_cats_aliases_are_traced_as_cat_and_shard_as_it_does():
    """aten::concatenate and aten::concat became aten::cat: the rules know cat alone (xLSTM's blocks, written with
    torch.concatenate, stayed whole: "no tensor-parallel rule or DTensor strategy for aten::concatenate")."""
    from meshc.compiler.compile import compile_program
    from meshc.compiler.ir.mesh_spec import MeshSpec
    from meshc.compiler.ir.placement import Shard

    aten = torch.ops.aten
    traced, program, _ = compile_program(_Concatenating(), (torch.randn(2, 4, 8),), {}, mesh=MeshSpec({"tp": 2}),
                                         plan=meshc.Plan(trace="non-strict"), rank=0)
    targets = [n.target for n in traced.gm.graph.nodes]
    assert targets.count(aten.cat.default) == 2
    assert aten.concatenate.default not in targets and aten.concat.default not in targets
    assert {f: s.placements["tp"] for f, s in program.params.items() if f.endswith("weight")} == {
        "a.weight": Shard(0), "out.weight": Shard(1)}


class _Refine(torch.nn.Module):
    """A block applied three times, the first two under torch.no_grad() (HRM's early cycles), the second of those
    turning gradients back on for a side branch: only the last application and the side branch train the block."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(zoo.VOCAB, 16)
        self.up, self.down, self.side = (torch.nn.Linear(16, 32), torch.nn.Linear(32, 16), torch.nn.Linear(16, 16))
        self.head = torch.nn.Linear(16, zoo.VOCAB)

    def forward(self, tokens):
        h = self.emb(tokens)
        z = h
        with torch.no_grad():
            z = z + self.down(self.up(z).relu())
            with torch.enable_grad():
                s = self.side(h)
            z = z + self.down(self.up(z).relu())
        z = z + self.down(self.up(z + h).relu())
        return self.head(z + s)


def test_no_grad_regions_are_inlined_and_train_as_eager(fake_mesh):
    """torch.export keeps a no_grad block as one op (wrap_with_set_grad_enabled), opaque to every pass: inlined,
    its ops are the graph's own (the block's layers shard on tp), and its results are detached, so no gradient
    crosses it. check_trace compares the loss and every gradient with eager (up/down's from the last application
    alone, side's through its enable_grad branch); `test_tp_parity.py -k hrm` trains such a model sharded."""
    from meshc.compiler.compile import compile_program
    from meshc.compiler.ir.mesh_spec import MeshSpec

    model = _Refine()
    x = zoo.batches(1, 2)[0][0]
    traced, program, _ = compile_program(model, (x,), {}, mesh=MeshSpec({"tp": 2}),
                                         plan=meshc.Plan(trace="non-strict", check_trace=True), rank=0)
    nodes = list(traced.gm.graph.nodes)
    assert not any("wrap_with_set_grad_enabled" in str(n.target) for n in nodes)
    # torch.export cuts the no_grad block around its enable_grad branch: two regions, each handing z on detached
    assert "trace: 2 torch.no_grad()/enable_grad() region(s) inlined" in traced.notes
    assert sum(bool(n.meta.get("meshc.grad_region")) for n in nodes) == 2
    assert sum(n.target == torch.ops.aten.linear.default for n in nodes) == 8  # 3 ups, 3 downs, side and head
    assert any("loss and 9 gradients equal eager" in note for note in traced.notes + program.notes)
    from meshc.compiler.ir.placement import Shard
    assert program.params["up.weight"].placements["tp"] == Shard(0)
    assert program.params["down.weight"].placements["tp"] == Shard(1)


def test_a_region_left_whole_does_not_stop_the_next_from_being_inlined():
    """A region whose tuple of results is read whole cannot be inlined (its results are not one value each): it stays
    one op, and the regions after it are inlined all the same."""
    import operator

    from meshc.compiler.trace.grad_regions import inline_grad_regions

    gm = torch.export.export(_Refine(), (zoo.batches(1, 2)[0][0],), strict=False).graph_module
    regions = [n for n in gm.graph.nodes if "wrap_with_set_grad_enabled" in str(n.target)]
    assert len(regions) == 2
    with gm.graph.inserting_after(regions[0]):  # the first region's tuple read whole
        whole = gm.graph.call_function(operator.length_hint, (regions[0],))
    assert inline_grad_regions(gm) == 1
    left = [n for n in gm.graph.nodes if "wrap_with_set_grad_enabled" in str(n.target)]
    assert left == [regions[0]] and whole.args == (regions[0],)
