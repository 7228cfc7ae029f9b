"""tensor_parallel: Megatron's collective census per block (graph and run time), placements, and the
errors and warnings of what cannot be split."""
from __future__ import annotations

import operator
import re
from collections import Counter

import pytest
import torch

import meshc
from meshc.compiler.driver import run_passes
from meshc.compiler.ir.placement import Replicate, Shard
from meshc.compiler.trace.export import trace
from meshc.runtime.monitor.census import CommCensus
from tests import zoo
from tests.harness import run_ranks

B, T, H = 2, zoo.SEQ, 32  # batch, sequence, hidden of the zoo models


def _program(mesh, model, batch=B, **plan):
    traced, _ = trace(model, (zoo.batches(1, batch)[0][0],), mesh=mesh,
                      plan=meshc.Plan(verify=True, trace="non-strict", **plan))
    return run_passes(traced)


def _block(node) -> str | None:
    """The transformer block a node belongs to: the innermost module path ending in an index."""
    for path, _ in reversed(list(node.meta.get("nn_module_stack", {}).values())):
        match = re.search(r"^(.*?\.\d+)", path)
        if match:
            return match.group(1)
    return None


def _census_by_block(program) -> dict[str, Counter]:
    out: dict[str, Counter] = {}
    for node, record in program.comm_records():
        block = _block(node)
        if block is not None and record.axis == "tp":
            out.setdefault(block, Counter())[(record.kind, record.phase)] += record.count
    return out


@pytest.mark.parametrize("name", ["reference", "gpt2", "llama", "bert"])
def test_megatron_census_per_block(fake_mesh, name):
    program = _program(fake_mesh(tp=2), zoo.build(name))
    census = _census_by_block(program)
    assert len(census) == 2  # both blocks
    for block, counts in census.items():
        assert counts == Counter({("all_reduce", "forward"): 2, ("all_reduce", "backward"): 2}), block
    for node, record in program.comm_records():  # each one is a (B, T, H) activation in fp32
        if _block(node) is not None:
            assert record.bytes == B * T * H * 4


# fused and hand-written projections (issue 14): forward, one all-reduce per row-parallel output (attention, MLP);
# backward, one f per norm output feeding column-parallel layers (one norm shared by parallel attention and MLP
# in GPT-J and Falcon's old layout) and, with multi-query k and v held whole, one f of each (B, T, head dim);
# Falcon adds its parallel attention's partial output into the MLP's in place (`+=`): one all-reduce for both
FAMILIES = [("phi3", 2, 2, 0), ("gpt_neox", 2, 2, 0), ("gptj", 2, 1, 0), ("falcon_new", 1, 2, 0), ("bloom", 2, 2, 0),
            ("falcon", 1, 1, 2)]


@pytest.mark.parametrize("name, forward, f, kv", FAMILIES, ids=[row[0] for row in FAMILIES])
def test_census_of_fused_projection_families(fake_mesh, name, forward, f, kv):
    program = _program(fake_mesh(tp=2), zoo.build(name))
    census = _census_by_block(program)
    assert len(census) == 2
    # multi-query k and v: transformers < 5.25 fed them whole to attention (their gradients all-reduced, f);
    # >= 5.25 repeats them to every query head first (repeat_kv), of which each rank takes its own heads' copies
    # (no forward traffic; backward, an all-gather of those copies' gradients, heads/tp of them per rank)
    repeated = any(r.kind == "all_gather" for _, r in program.comm_records())
    kv_kind = "all_gather" if repeated else "all_reduce"
    for block, counts in census.items():
        want = Counter({("all_reduce", "forward"): forward, ("all_reduce", "backward"): f})
        want[(kv_kind, "backward")] += kv
        assert counts == want, block
    head_dim = H // 4  # the zoo's 4 query heads
    kv_bytes = B * T * head_dim * 4 * (4 // 2 if repeated else 1)
    sizes = Counter(r.bytes for node, r in program.comm_records() if _block(node) and r.phase == "backward")
    assert sizes == Counter({B * T * H * 4: 2 * f, **({kv_bytes: 2 * kv} if kv else {})})


def test_a_loop_over_experts_reduces_the_gradient_of_their_rows_once(fake_mesh):
    """JetMoE's experts in a loop (one linear per expert on its rows, split by counts) in its attention and its MLP:
    per block, the two layers' outputs all-reduced forward; backward, one f for each loop's rows (on the rows before
    the split, not one per expert's piece), one for k|v's input, one for each layer's routing weights."""
    program = _program(fake_mesh(tp=2), zoo.build("jetmoe"))
    census = _census_by_block(program)
    assert len(census) == 2
    for block, counts in census.items():  # (and the index_add's zeros sliced locally: free)
        reduces = Counter({k: v for k, v in counts.items() if k[0] == "all_reduce"})
        assert reduces == Counter({("all_reduce", "forward"): 2, ("all_reduce", "backward"): 5}), block
    from meshc.runtime.ops.collectives import grad_all_reduce
    fs = [n for n in program.gm.graph.nodes if n.target is grad_all_reduce]
    assert not any(f.args[0].target is operator.getitem for f in fs), [f.args[0].format_node() for f in fs]


def test_layers_whose_flows_meet_in_a_written_buffer_are_sharded_together(fake_mesh):
    """RWKV's time mixing writes each step's output into a buffer made like the key projection's output (`out =
    zeros_like(k); out[:, t] = f(k[:, t], v[:, t])`), the value projection reading another activation: tried on its
    own, value's flow met the buffer whole and stopped ("needs it R"); tried with key, both shard. The channel mixing's
    receptance gates the value layer's output after its reduction: held whole, as Megatron would."""
    program = _program(fake_mesh(tp=2), zoo.build("rwkv"))
    placed = {f: s.placements["tp"] for f, s in program.params.items()}
    for block in ("rwkv.blocks.0", "rwkv.blocks.1"):
        for name in ("key", "value", "receptance"):
            assert placed[f"{block}.attention.{name}.weight"] == Shard(0), (name, placed)
        assert placed[f"{block}.attention.output.weight"] == Shard(1)
        assert placed[f"{block}.feed_forward.key.weight"] == Shard(0)
        assert placed[f"{block}.feed_forward.value.weight"] == Shard(1)
        assert not isinstance(placed[f"{block}.feed_forward.receptance.weight"], Shard)


@pytest.mark.parametrize("name", ["reference", "gpt2", "llama"])
def test_sequence_parallel_census_per_block(fake_mesh, name):
    program = _program(fake_mesh(tp=2), zoo.build(name), sequence_parallel=True)
    census = _census_by_block(program)
    assert len(census) == 2
    want = Counter({("all_gather", "forward"): 2, ("reduce_scatter", "forward"): 2,
                    ("reduce_scatter", "backward"): 2, ("all_gather", "backward"): 2})
    for block, counts in census.items():
        assert counts == want, block
    # norms run on sequence shards: their weights' partial gradients are summed over tp with the buckets
    partial = [f for f, s in program.params.items() if "tp" in s.grad_partial]
    assert any("norm" in f or "ln" in f for f in partial)


def test_fused_qkv_is_split_per_projection(fake_mesh):
    program = _program(fake_mesh(tp=2), zoo.gpt2())
    assert program.params["transformer.h.0.attn.c_attn.weight"].placements["tp"] == Shard(1, 3)
    assert program.params["transformer.h.0.attn.c_attn.bias"].placements["tp"] == Shard(0, 3)
    assert program.params["transformer.h.0.attn.c_proj.weight"].placements["tp"] == Shard(0)
    assert program.params["transformer.h.0.mlp.c_fc.weight"].placements["tp"] == Shard(1)


def test_fewer_kv_heads_than_tp_are_replicated(fake_mesh):
    program = _program(fake_mesh(tp=4), zoo.llama(kv_heads=2))
    assert program.params["model.layers.0.self_attn.q_proj.weight"].placements["tp"] == Shard(0)
    assert program.params["model.layers.0.self_attn.k_proj.weight"].placements["tp"] == meshc.compiler.ir.placement.R
    assert any("k_proj" in w and "replicated" in w for w in program.warnings)


def test_heads_not_divisible_by_tp_is_a_compile_error(fake_mesh):
    from torch.testing._internal.distributed._tensor.common_dtensor import ModelArgs, Transformer

    model = Transformer(ModelArgs(n_layers=1, vocab_size=64, max_seq_len=16, dim=48, n_heads=6, dropout_p=0.0))
    with pytest.raises(ValueError, match=r"layers\.0\.attention\.wq cannot be split over tp=4: .*size 6 "
                                         r"\(e\.g\. heads\), not divisible by tp=4"):
        _program(fake_mesh(tp=4), model)


def test_explicit_plan_on_indivisible_kv_heads_names_the_parameter(fake_mesh):
    with pytest.raises(ValueError, match=r"\(e\.g\. heads\), not divisible by tp=4; it is sharded because "
                                         r"model\.layers\.0\.self_attn\.k_proj\.weight"):
        _program(fake_mesh(tp=4), zoo.llama(kv_heads=2), tp={"*.k_proj": "colwise"})


def test_explicit_plan_glob_must_match(fake_mesh):
    with pytest.raises(ValueError, match=r"Plan.tp\['\*\.atn\.c_attn'\]: expected the glob to match"):
        _program(fake_mesh(tp=2), zoo.gpt2(), tp={"*.atn.c_attn": "colwise"})


def test_explicit_plan_overrides_auto(fake_mesh):
    program = _program(fake_mesh(tp=2), zoo.gpt2(), tp={"*.mlp.*": "replicate"})
    assert program.params["transformer.h.0.mlp.c_fc.weight"].placements["tp"] == meshc.compiler.ir.placement.R
    assert program.params["transformer.h.0.attn.c_attn.weight"].placements["tp"] == Shard(1, 3)


class _Flippy(torch.nn.Module):
    """An MLP whose hidden activation goes through an op without a sharding rule (flip)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(zoo.VOCAB, H)
        self.up = torch.nn.Linear(H, 64)
        self.down = torch.nn.Linear(64, H)
        self.head = torch.nn.Linear(H, zoo.VOCAB)

    def forward(self, tokens):
        x = self.emb(tokens)
        return self.head(x + self.down(torch.flip(torch.relu(self.up(x)), dims=[-1])))


def _flippy_rank() -> dict:
    import warnings

    mesh = meshc.mesh(tp=2, timeout_s=60)
    x, y = zoo.batches(1, 4)[0]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        job = meshc.compile(_Flippy(), mesh, example_inputs=(x,),
                            plan=meshc.Plan(verify=True, tp={"up": "colwise", "down": "rowwise"}))
    loss = job.step(x, y, zoo.lm_loss)
    return {"loss": loss.item(), "warnings": [str(w.message) for w in caught if w.category is meshc.MeshcWarning],
            "where": [w.filename for w in caught if w.category is meshc.MeshcWarning], "report": str(job.explain())}


def test_op_without_rule_is_correct_and_warned():
    ref = zoo.lm_loss(_Flippy()(zoo.batches(1, 4)[0][0]), zoo.batches(1, 4)[0][1]).item()
    for out in run_ranks(_flippy_rank, 2, timeout=120):
        assert abs(out["loss"] - ref) < 1e-5
        assert any("no tensor-parallel rule or DTensor strategy for aten::flip" in w for w in out["warnings"])
        assert out["where"] and set(out["where"]) == {__file__}  # reported at the user's meshc.compile line
        assert "no tensor-parallel rule or DTensor strategy for aten::flip" in out["report"]


def _runtime_census(name: str, sp: bool) -> dict:
    mesh = meshc.mesh(tp=2, timeout_s=60)
    x, y = zoo.batches(1, B)[0]
    job = meshc.compile(zoo.build(name), mesh, example_inputs=(x,),
                        plan=meshc.Plan(trace="non-strict", sequence_parallel=sp))
    with CommCensus(mesh) as forward:
        out = job(x)
    loss = zoo.lm_loss(out, y)
    with CommCensus(mesh) as backward:
        loss.backward()
    graph = Counter()
    for node, r in job.program.comm_records():
        graph[(r.kind, r.axis, r.phase)] += r.count
    return {"forward": forward.by_kind(), "backward": backward.by_kind(), "graph": graph}


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_runtime_collectives_match_the_graph(sp):
    out = run_ranks(_runtime_census, 2, "reference", sp, timeout=120)[0]
    for phase in ("forward", "backward"):
        ran = {k: calls for k, (calls, _) in out[phase].items()}
        planned = {(kind, axis): n for (kind, axis, p), n in out["graph"].items() if p == phase}
        assert ran == planned, phase
    if not sp:  # Megatron: 2 all-reduces per block forward, 2 backward, nothing else
        assert out["forward"] == {("all_reduce", "tp"): (4, 4 * B * T * H * 4)}
        assert out["backward"] == {("all_reduce", "tp"): (4, 4 * B * T * H * 4)}


def test_norm_over_a_sharded_projection_all_reduces_its_statistic(fake_mesh):
    """OLMoE normalizes q and k over the whole projection (all heads): q/k stay column-parallel, each rank's mean
    of squares over its features is divided by tp and all-reduced (a (B, T, 1) statistic), and the norm's weight
    is sliced to the rank's features. Parity: tests/models/test_tp_parity.py (olmoe)."""
    program = _program(fake_mesh(tp=2), zoo.olmoe())
    for fqn in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"):
        assert program.params[fqn].placements["tp"] == Shard(0), fqn
    stats = [n for n in program.gm.graph.nodes if "the mean over a dim sharded" in str(n.meta.get("meshc.why", ""))]
    assert len(stats) == 4  # q and k of 2 layers
    for node in stats:
        (reduce,) = node.users
        assert "all_reduce" in str(reduce.target) and tuple(reduce.meta["val"].shape)[-1] == 1


@pytest.mark.parametrize("tp", [2, 4])
def test_an_l2_norm_between_column_and_row_layers_all_reduces_its_sum(fake_mesh, tp):
    """Dory (nGPT) normalizes by a sum of squares, not a mean: `x * rsqrt(sum(x²) + eps)` over the attention's gated
    heads before o_proj and over the MLP's features before down_proj. Each rank's sum over its features is a partial
    sum of the whole one, all-reduced as a (B, T, 1) statistic (no division, unlike a mean), so the projections on
    both sides keep Megatron's pairing; before, the sum ended the column flow and the blocks stayed whole (0.00 at
    tp=2). Kv heads (2) fewer than tp=4 are held whole, as Megatron does. Parity: tests/models/test_tp_parity.py."""
    program = _program(fake_mesh(tp=tp), zoo.dory())
    for name in ("self_attn.q_proj", "self_attn.gate_proj", "mlp.gate_proj", "mlp.up_proj"):
        assert program.params[f"model.layers.1.{name}.weight"].placements["tp"] == Shard(0), name
    for name in ("self_attn.o_proj", "mlp.down_proj"):
        assert program.params[f"model.layers.1.{name}.weight"].placements["tp"] == Shard(1), name
    kv = program.params["model.layers.1.self_attn.k_proj.weight"].placements["tp"]
    assert kv == (Shard(0) if tp == 2 else Replicate())
    sums = [n for n in program.gm.graph.nodes if n.target == torch.ops.aten.sum.dim_IntList
            and any("all_reduce" in str(u.target) for u in n.users)]
    assert len(sums) == 2 * 4  # the two sub-norms of each of the 4 layer applications (the middle layer looped twice)
    for node in sums:
        assert tuple(node.meta["val"].shape)[-1] == 1


def test_a_buffer_made_like_a_sharded_value_is_sharded_alike(fake_mesh):
    """HY-V4 builds its key heads in `kv.new_empty(*kv.shape[:-1], d)` and copies the no-rope part (kv_b_proj's
    output, sharded by heads) and the rope part (one head expanded to all) into its two slices. The buffer is made at
    its local sizes with kv's head shard, so kv_b_proj stays column-parallel (before: a whole buffer, the copy of a
    shard into it "needs it R", kv_b_proj whole). Parity: tests/models/test_tp_parity.py (hy_v4)."""
    program = _program(fake_mesh(tp=2), zoo.hy_v4())
    assert program.params["model.layers.0.self_attn.kv_b_proj.weight"].placements["tp"] == Shard(0)
    buffers = [n for n in program.gm.graph.nodes if n.target == torch.ops.aten.new_empty.default]
    assert len(buffers) == 2  # one per layer
    for node in buffers:
        assert node.meta["meshc.placement"]["tp"] == Shard(1)
        assert list(node.args[1]) == [B, 4 // 2, zoo.SEQ, 16]  # batch, the rank's 2 of 4 heads, tokens, nope + rope


@pytest.mark.parametrize("model", ["diffllama", "diffllama_kv2"])
def test_heads_chunked_into_pairs_shard_in_two_blocks(fake_mesh, model):
    """DiffLlama pairs head h with head h + H/2 (`chunk(out, 2)` over the heads after attention, v's kv heads cut in
    two the same way): a plain shard of the heads puts both halves' cut on one rank ("chunk across the blocks of a
    shard", q, k and v whole). The trial that failed at the chunk is tried again with q, k and v sharded in two
    blocks, each rank holding its share of each half (S(0)x2), and o_proj reads the pairs' output row-parallel.
    With 2 kv heads each half of k and v is one head, fewer than tp=2: they are held whole, q still in two blocks.
    Parity: tests/models/test_tp_parity.py (diffllama, diffllama_kv2)."""
    program = _program(fake_mesh(tp=2), zoo.build(model))
    kv = Shard(0, 2) if model == "diffllama" else Replicate()
    for name, want in (("q_proj", Shard(0, 2)), ("k_proj", kv), ("v_proj", kv)):
        assert program.params[f"model.layers.0.self_attn.{name}.weight"].placements["tp"] == want, name
    assert program.params["model.layers.0.self_attn.o_proj.weight"].placements["tp"] == Shard(1)
    assert sum("all_reduce" == getattr(n.target, "__name__", "") for n in program.gm.graph.nodes) == 2 * 2  # Megatron's
    if model == "diffllama":  # at tp=4 each half's 2 kv heads are fewer than tp: k and v whole, and the reason says so
        program = _program(fake_mesh(tp=4), zoo.build(model))
        assert program.params["model.layers.0.self_attn.q_proj.weight"].placements["tp"] == Shard(0, 2)
        assert program.params["model.layers.0.self_attn.k_proj.weight"].placements["tp"] == Replicate()
        why = program.tp_why["model.layers.0.self_attn.k_proj"]
        assert "of size 4 (e.g. heads) in 2 blocks of 2, not divisible by tp: 2 < tp=4" in why, why


class _WriteThroughView(torch.nn.Module):
    """An MLP that scales part of its hidden features in place through a view (`h[..., :4].mul_(2)`)."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(zoo.VOCAB, 8)
        self.up, self.down = torch.nn.Linear(8, 16, bias=False), torch.nn.Linear(16, 8, bias=False)

    def forward(self, tokens):
        h = self.up(self.emb(tokens))
        h[..., :4].mul_(2.0)
        return self.down(h)


def test_a_write_through_a_view_of_a_moved_value_is_an_error(fake_mesh):
    """Forced column-parallel, the slice of the first 4 features cuts a rank's shard: its input must be gathered,
    and the in-place write would then scale the gathered copy, not h (the down projection would read h unscaled).
    An error naming the write and the model's line, not a silently different model."""
    with pytest.raises(ValueError, match=r"in-place write into a view .*mul_.*h\[\.\.\., :4\]\.mul_\(2\.0\)"):
        _program(fake_mesh(tp=2), _WriteThroughView(), tp={"up": "colwise", "down": "rowwise"})


class _ChunkStates(torch.nn.Module):
    """A chunkwise scan as xLSTM's mLSTM writes it: keys by head, each chunk's running state written into a buffer
    made by torch.zeros (`states[:, :, i * C:(i + 1) * C] = ...`), read back whole by heads before the output layer."""

    def __init__(self, width: int = 16, heads: int = 4, chunk: int = 4):
        super().__init__()
        torch.manual_seed(0)
        self.heads, self.chunk = heads, chunk
        self.emb = torch.nn.Embedding(zoo.VOCAB, width)
        self.k = torch.nn.Linear(width, width, bias=False)
        self.out = torch.nn.Linear(width, width, bias=False)
        self.head = torch.nn.Linear(width, zoo.VOCAB, bias=False)

    def forward(self, tokens):
        b, t = tokens.shape
        x = self.emb(tokens)
        k = self.k(x).view(b, t, self.heads, -1).transpose(1, 2)  # (b, heads, t, d)
        states = torch.zeros(b, self.heads, t, k.shape[-1])
        carry = torch.zeros(b, self.heads, 1, k.shape[-1])
        for i in range(0, t, self.chunk):
            carry = carry + k[:, :, i:i + self.chunk].cumsum(2)
            states[:, :, i:i + self.chunk] = carry
            carry = carry[:, :, -1:]
        return self.head(x + self.out(states.transpose(1, 2).reshape(b, t, -1)))


@pytest.mark.parametrize("tp", [2, 4])
def test_a_buffer_made_from_sizes_is_sharded_with_the_writes_into_it(fake_mesh, tp):
    """The states buffer is made whole by its sizes; a write of a head-sharded chunk into it needed the chunk whole,
    so k stayed replicated. Its values before the writes are a constant, so it is sharded by head instead, made at its
    local sizes, and each write lands in the rank's own heads: k column-, out row-parallel, the forward's one
    all-reduce Megatron's (passes/sharding/buffers.py). Parity of a model that writes such buffers: xLSTM in
    tests/models/test_tp_parity.py."""
    program = _program(fake_mesh(tp=tp), _ChunkStates())
    assert program.params["k.weight"].placements["tp"] == Shard(0)
    assert program.params["out.weight"].placements["tp"] == Shard(1)
    (states,) = [n for n in program.gm.graph.nodes if n.target == torch.ops.aten.zeros.default and
                 list(n.args[0])[2] == zoo.SEQ]
    assert states.meta["meshc.placement"]["tp"] == Shard(1) and list(states.args[0]) == [B, 4 // tp, zoo.SEQ, 4]
    assert sum("all_reduce" == getattr(n.target, "__name__", "") for n in program.gm.graph.nodes) == 1


class _OddVocab(torch.nn.Module):
    """An MLP block between a token embedding and an LM head of 66 tokens (a vocabulary tp=4 does not divide), its
    logits scaled (Cohere's logit_scale, Gemma's softcapping: an op between the head and the output)."""

    def __init__(self, hidden: int = 64):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(66, 16)
        self.up, self.down = torch.nn.Linear(16, hidden), torch.nn.Linear(hidden, 16)
        self.head = torch.nn.Linear(16, 66)

    def forward(self, tokens):
        x = self.emb(tokens)
        return self.head(x + self.down(self.up(x).relu())) * 0.5


def test_a_size_tp_does_not_divide_is_an_error_only_where_the_layers_would_shard(fake_mesh):
    """The LM head tried column-parallel at tp=4 meets its 66 logits first: indivisible, which was an error ("lm_head
    cannot be split over tp=4"), though no row layer reads the head and it could not shard anyway. It is replicated
    for what stops it at any tp (its logits are the output); an MLP whose hidden size tp does not divide is still an
    error naming the layer and the size."""
    program = _program(fake_mesh(tp=4), _OddVocab())
    assert program.params["up.weight"].placements["tp"] == Shard(0)
    assert program.params["down.weight"].placements["tp"] == Shard(1)
    assert program.params["head.weight"].placements["tp"] == Replicate()
    assert "reaches the graph output" in program.tp_why["head"], program.tp_why
    with pytest.raises(ValueError, match=r"up cannot be split over tp=4: size 6 not divisible by tp=4"):
        _program(fake_mesh(tp=4), _OddVocab(hidden=6))
