"""The rules of passes/rules/scan.py (a state-space mixer's ops) on one-op graphs: where shards go, what inputs must
be, and the local arguments their rewrites write. Mamba-2 end to end: tests/models/test_tp_parity.py -k mamba2."""
from __future__ import annotations

import torch

from meshc.compiler.ir.placement import P, R, S
from meshc.compiler.ir.placement import Whole as W
from tests.passes.test_tp_rules import T, decide

aten = torch.ops.aten


def test_depthwise_conv1d_keeps_its_channel_shard_and_makes_groups_local():
    chunks = (64, W(16), W(16))
    args = (T((2, 96, 16)), T((96, 1, 4)), T((96,)), [1], [3], [1], 96)
    node, dec = decide(aten.conv1d.default, args, [S(1, chunks), R, R])
    assert dec.out == S(1, chunks) and dec.inputs == {(1,): S(0, chunks), (2,): S(0, chunks)}
    dec.rewrite(node)
    assert node.args[6] == 32 + 16 + 16


def test_dense_conv1d_on_sharded_channels_is_replicated():
    args = (T((2, 8, 16)), T((8, 8, 3)), T((8,)), [1], [1], [1], 1)
    _, dec = decide(aten.conv1d.default, args, [S(1), R, R])
    assert dec.out == R and dec.inputs == {(0,): R} and dec.note


def test_einsum_keeps_the_heads_and_slices_a_replicated_operand():
    _, dec = decide(aten.einsum.default, ("bclhn,bcshn->bclsh", [T((2, 2, 8, 8, 4)), T((2, 2, 8, 8, 4))]), [S(3), R])
    assert dec.out == S(4) and dec.inputs == {(1, 1): S(3)}
    _, dec = decide(aten.einsum.default, ("bzch,bzhpn->bchpn", [T((2, 3, 3, 8)), T((2, 3, 8, 4, 4))]), [S(3), S(2)])
    assert dec.out == S(2) and dec.inputs == {}


def test_einsum_over_the_sharded_letter_is_partial():
    _, dec = decide(aten.einsum.default, ("bh,bh->b", [T((2, 8)), T((2, 8))]), [S(1), S(1)])
    assert dec.out == P


def test_pad_and_tensor_split_off_the_shard_keep_it():
    _, dec = decide(aten.pad.default, (T((2, 16, 8)), [0, 0, 0, 8], "constant", 0.0), [S(2)])
    assert dec.out == S(2) and dec.inputs == {}
    _, dec = decide(aten.pad.default, (T((2, 16, 8)), [1, 0]), [S(2)])
    assert dec.out == R and dec.inputs == {(0,): R}
    _, dec = decide(aten.tensor_split.indices, (T((2, 16, 8)), [16], 1), [S(2)])
    assert dec.out == (S(2), S(2))


def test_one_group_repeated_to_the_heads_makes_this_ranks_heads():
    node, dec = decide(aten.repeat_interleave.self_int, (T((2, 16, 1, 8)), 8, 2), [R], n=4, kwargs={"output_size": 8})
    assert dec.out == S(2) and dec.inputs == {}
    dec.rewrite(node)
    assert node.args[1] == 2 and node.kwargs["output_size"] == 2
    node, dec = decide(aten.repeat_interleave.self_int, (T((2, 16, 4, 8)), 2, 2), [S(2)], kwargs={"output_size": 8})
    assert dec.out == S(2)
    dec.rewrite(node)
    assert node.args[1] == 2 and node.kwargs["output_size"] == 4
