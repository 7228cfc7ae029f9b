"""The context pass on compiled graphs (one process, MeshSpec): what each cp rank holds and sends.

Parity on real ranks is tests/models/test_cp_parity.py; the attention kernels' numerics are
tests/runtime/test_context_attention.py.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import meshc
from meshc.compiler.compile import compile_program
from meshc.compiler.ir.errors import MeshcValueError
from meshc.compiler.ir.mesh_spec import MeshSpec
from meshc.compiler.ir.placement import Shard
from meshc.runtime.mesh import sequence_shard, sequence_unshard
from meshc.runtime.ops.context import context_attention, positions
from meshc.runtime.ops.sequence import seq_gather, seq_slice, zigzag_pad, zigzag_slice
from tests import zoo

SEQ, BATCH = 64, 2


def _compile(model, cp: int, tp: int = 1, rank: int = 0, seq: int = SEQ, **plan):
    spec = MeshSpec({"dp": cp, "cp": cp, "tp": tp})
    x = torch.randint(0, zoo.VOCAB, (BATCH, seq // cp))
    return compile_program(model, (x,), {}, mesh=spec, plan=meshc.Plan(trace="non-strict", **plan), rank=rank)[1]


def _from_inputs(program) -> dict[str, torch.Size]:
    """Local shapes of the values computed from the tokens (activations), by node name."""
    out, dep = {}, set()
    for node in program.gm.graph.nodes:
        if node.op == "placeholder":
            if node.meta.get("meshc.role") == "input":
                dep.add(node)
            continue
        if any(a in dep for a in node.all_input_nodes):
            dep.add(node)
            if isinstance(node.meta.get("val"), torch.Tensor):
                out[node.name] = node.meta["val"].shape
    return out


def test_zigzag_layout_round_trip_and_positions():
    t = torch.arange(2 * 32).view(2, 32)
    for cp in (2, 4):
        shards = [sequence_shard(t, c, cp) for c in range(cp)]
        assert torch.equal(sequence_unshard(shards), t)
        for c, s in enumerate(shards):  # rank c holds chunks c and 2cp-1-c: the positions attention masks by
            assert torch.equal(s[0], positions(c, cp, 32 // cp)), (cp, c)
        work = [sum(int(p) + 1 for p in positions(c, cp, 32 // cp)) for c in range(cp)]
        assert len(set(work)) == 1, work  # causal keys seen per rank: equal (the point of the zigzag)


def test_mesh_folds_cp_into_dp():
    spec = MeshSpec({"dp": 4, "cp": 2, "tp": 2})
    assert spec.world_size == 8 and spec.sizes["cp"] == 2
    assert spec.group_ranks("cp", 0) == (0, 2) and spec.group_ranks("dp", 0) == (0, 2, 4, 6)
    assert spec.coords(6) == {"pp": 0, "dp": 3, "tp": 0, "cp": 1}
    assert "cp=2" in spec.describe()
    with pytest.raises(MeshcValueError, match="cp to divide dp"):
        MeshSpec({"dp": 3, "cp": 2})
    with pytest.raises(MeshcValueError, match="not supported yet"):
        MeshSpec({"dp": 4, "cp": 2, "ep": 2})


@pytest.mark.parametrize("cp", [2, 4])
def test_llama_activations_are_sequence_shards(cp):
    """Every activation of the cp program is the cp=1 program's divided by cp on one dim (the sequence), the
    attention's K and V are the kv heads' local rows (no whole K/V anywhere), and the ring's bytes are exact."""
    one = _from_inputs(_compile(zoo.llama(layers=2), 1))
    program = _compile(zoo.llama(layers=2), cp, rank=cp - 1)
    local = _from_inputs(program)
    for name, shape in local.items():
        if name in one and one[name].numel():
            assert one[name].numel() == cp * shape.numel(), (name, one[name], shape)
    # nothing beyond the cp=1 program's share: K and V copies per query head are gone from both (context attention
    # reads the kv heads, as the gqa pass makes the cp=1 program's SDPA do)
    assert sum(s.numel() for s in local.values()) * cp <= sum(s.numel() for s in one.values())
    attn = [n for n in program.gm.graph.nodes if n.target is context_attention]
    assert len(attn) == 2
    hk, d = 2, 8  # kv heads and head dim of zoo.llama: the ring carries them, not their copies per query head
    for node in attn:
        q, k, v = (a.meta["val"].shape for a in node.args[:3])
        assert tuple(k) == tuple(v) == (BATCH, hk, SEQ // cp, d) and q[1] == 4, (q, k)
        forward = [r for r in node.meta["meshc.comm"] if r.phase == "forward"]
        elements = sum(r.bytes * r.count for r in forward) // 4
        assert elements == (cp - 1) * BATCH * (SEQ // cp) * hk * d * 2  # = (cp-1)/cp · b·S·h_kv·d·2
    gathers = [n for n in program.gm.graph.nodes if n.target is seq_gather]
    assert not gathers, [n.format_node() for n in gathers]
    slices = [n for n in program.gm.graph.nodes if n.target is seq_slice]
    assert len(slices) == 2 * 2  # per layer the rotary cos and sin tables, cut to this rank's global positions


def test_learned_positions_are_sliced_and_tensor_parallel_shards_heads():
    program = _compile(zoo.builtin_gpt(seq=SEQ), 2, tp=2)
    slices = [n for n in program.gm.graph.nodes if n.target is seq_slice]
    assert [n.args[0].target for n in slices] == [torch.ops.aten.embedding.default]  # the position embedding
    for node in (n for n in program.gm.graph.nodes if n.target is context_attention):
        assert tuple(node.args[0].meta["val"].shape) == (BATCH, 2, SEQ // 2, 8)  # 4 heads over tp, S over cp


class _DropoutAttention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(zoo.VOCAB, 16)

    def forward(self, x):
        h = self.emb(x).view(x.shape[0], x.shape[1], 2, 8).transpose(1, 2)
        return F.scaled_dot_product_attention(h, h, h, dropout_p=0.1, is_causal=True).sum()


def test_refusals_name_what_to_change():
    with pytest.raises(MeshcValueError, match="attention dropout 0.1.*set the attention dropout to 0"):
        _compile(_DropoutAttention(), 2)
    with pytest.raises(MeshcValueError, match="not divisible by 2·cp = 8"):
        _compile(zoo.llama(layers=1), 4, seq=36)  # 36 tokens: 9 per rank, but not two equal chunks each
    with pytest.raises(MeshcValueError, match="Plan.cp_attention"):
        meshc.Plan(cp_attention="ulysses")


def test_written_out_attention_becomes_context_attention():
    """Eager attention (matmul, scale, mask add, softmax, cast, dropout 0, matmul) is found and made one op: no
    gathered scores, the kv heads' local rows on the ring, as with SDPA."""
    program = _compile(zoo.llama(layers=2, attention="eager"), 2)
    attn = [n for n in program.gm.graph.nodes if n.target is context_attention]
    assert len(attn) == 2 and all(n.kwargs["scale"] == pytest.approx(8 ** -0.5) for n in attn)
    assert all(tuple(n.args[1].meta["val"].shape) == (BATCH, 2, SEQ // 2, 8) for n in attn)
    assert not [n for n in program.gm.graph.nodes if n.target in (seq_gather, torch.ops.aten.softmax.int)]


def test_constant_masks_become_a_causal_flag_or_stay():
    """transformers' causal (b, 1, S, S) mask is computed from positions only: evaluated at compile time, found
    causal, replaced by the flag and its nodes erased. Mistral's sliding-window mask is not causal: kept whole."""
    llama = _compile(zoo.llama(layers=2), 2)
    attn = [n for n in llama.gm.graph.nodes if n.target is context_attention]
    assert [(n.args[3], n.kwargs["causal"]) for n in attn] == [(None, True)] * 2
    assert not [n for n in llama.gm.graph.nodes if n.target in (torch.ops.aten.le.Tensor, torch.ops.aten.cumsum.default)]
    mistral = _compile(zoo.build("mistral"), 2)
    attn = [n for n in mistral.gm.graph.nodes if n.target is context_attention]
    assert all(n.args[3] is not None and not n.kwargs["causal"] for n in attn) and len(attn) == 2
    assert tuple(attn[0].args[3].meta["val"].shape) == (BATCH, 1, SEQ, SEQ)


class _Pooled(torch.nn.Module):
    """tests/zoo.py's prompt LM (learned prompt vectors put before the tokens, a `cat` on the sequence as CPM-Ant does,
    cut off again before the head), with a pooled (batch, vocabulary) output beside its logits: as many features as
    the sequence has positions (zoo.VOCAB == SEQ)."""

    def __init__(self):
        super().__init__()
        self.lm = zoo.prompt_lm()

    def forward(self, tokens):
        logits = self.lm(tokens)
        return logits, logits.mean(dim=1)


def test_an_output_gathered_whole_on_its_way_keeps_the_inputs_sequence_shards():
    # the cat of a whole prompt with the token shards gathers the tokens whole; the logits then came out whole, the
    # global sequence's rows against the rank's own targets (CPM-Ant, Gemma 3 at cp=2: "Expected input batch_size
    # (64) to match target batch_size (32)"); they are sliced back to the rank's positions, the pooled output stays whole
    assert zoo.VOCAB == SEQ
    program = _compile(_Pooled(), 2)
    logits, pooled = [n for n in program.gm.graph.nodes if n.op == "output"][0].args[0]
    assert logits.target is seq_slice and tuple(logits.meta["val"].shape) == (BATCH, SEQ // 2, zoo.VOCAB)
    assert logits.meta["meshc.placement"]["cp"] == Shard(1)
    assert pooled.target is not seq_slice and tuple(pooled.meta["val"].shape) == (BATCH, SEQ)
    assert any(n.target is seq_gather for n in program.gm.graph.nodes)


def test_attention_over_each_positions_own_values_runs_on_the_rank_s_positions():
    # the sequence in SDPA's heads dim (each position attends over its own two streams): q, k and v split there and
    # plain attention on each rank's positions, no ring and no gather for it; before, the rule sliced its query
    # positions (size 1) as a sequence ("dim 2 of size 1 does not split into 2·cp = 4 chunks": Inkling2 at cp=2)
    program = _compile(zoo.prompt_lm(), 2)
    attentions = [n for n in program.gm.graph.nodes if n.target is torch.ops.aten.scaled_dot_product_attention.default]
    (mixing,) = [n for n in attentions if n.args[0].meta["val"].shape[2] == 1]
    for arg, length in zip(mixing.args[:3], (1, 2, 2)):
        assert tuple(arg.meta["val"].shape) == (BATCH, SEQ // 2, length, 32), arg
    assert mixing.meta["meshc.placement"]["cp"] == Shard(1)
    assert not any(n.target is seq_gather for n in mixing.all_input_nodes)


def test_a_sequence_of_no_positions_splits_into_empty_parts():
    # a buffer empty on the sequence and on another dim (Inkling2's, made by `new_zeros`) sliced or padded over cp:
    # "cannot reshape tensor of 0 elements into shape [-1, 4, 0, 64]" before
    empty = torch.zeros(2, 0, 3, 0)
    assert zigzag_slice(empty, 1, 1, 2, 1).shape == (2, 0, 3, 0)
    assert zigzag_pad(empty, 1, 1, 2, 1).shape == (2, 0, 3, 0)
