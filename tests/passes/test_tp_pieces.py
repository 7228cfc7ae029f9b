"""torch's own attention and the reference ViT's packed qkv on tp=2 and tp=4, checked on one rank's compiled
program (a MeshSpec, no processes): every block weight sharded (issue 49: nn.Transformer at >= 0.9), and the
cross-attention's in_proj_weight, cut into q and k|v before two linears, sharded as its q|k|v blocks
(passes/tp_parts.py weight_pieces). Numerics: tests/models/test_plain_parity.py."""
from __future__ import annotations

import pytest
import torch

import meshc
from meshc.compiler.compile import compile_program
from meshc.compiler.ir.mesh_spec import MeshSpec
from meshc.compiler.ir.placement import Shard
from tests import parity, plain_models

MODELS = {"seq2seq": lambda: (plain_models.seq2seq(), torch.zeros(2, plain_models.SEQ, dtype=torch.long)),
          "encoder_lm": lambda: (plain_models.encoder_lm(), torch.zeros(2, plain_models.SEQ, dtype=torch.long)),
          "vit": lambda: (plain_models.vit(), torch.zeros(2, 3, plain_models.IMAGE, plain_models.IMAGE)),
          "mha_variants": lambda: (plain_models.mha_variants(), torch.ones(2, plain_models.SEQ, dtype=torch.long))}


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("name", list(MODELS))
def test_every_block_weight_is_sharded(name, tp):
    model, x = MODELS[name]()
    _, program, _ = compile_program(model, (x,), {}, mesh=MeshSpec({"tp": tp}), plan=meshc.Plan(trace="non-strict"),
                                    rank=0)
    local = {f: tuple(s.local_shape(program.mesh.sizes)) for f, s in program.params.items()}
    assert parity.block_coverage(local, model, tp) == pytest.approx(1.0), program.tp_why
    if name == "seq2seq":  # the decoder's cross-attention: q | k | v blocks, each 1/tp per rank, bias alike
        for i in range(2):
            w = program.params[f"transformer.decoder.layers.{i}.multihead_attn.in_proj_weight"]
            b = program.params[f"transformer.decoder.layers.{i}.multihead_attn.in_proj_bias"]
            assert w.placements["tp"] == Shard(0, 3) and b.placements["tp"] == Shard(0, 3), (w.placements, b.placements)
            assert local[w.fqn] == (3 * 32 // tp, 32)
            out = program.params[f"transformer.decoder.layers.{i}.multihead_attn.out_proj.weight"]
            assert out.placements["tp"] == Shard(1)
    if name == "mha_variants":  # separate q/k/v weights, their biases one in_proj_bias cut in three: q|k|v blocks
        for i in range(2):
            assert all(program.params[f"cross.{i}.{p}_proj_weight"].placements["tp"] == Shard(0) for p in "qkv")
            assert program.params[f"cross.{i}.in_proj_bias"].placements["tp"] == Shard(0, 3)
            assert program.params[f"self_attn.{i}.in_proj_weight"].placements["tp"] == Shard(0, 3)
