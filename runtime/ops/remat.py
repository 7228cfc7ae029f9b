"""Activation checkpointing of one block, as the remat pass inserts it (a call_module node).

    full       nothing inside the block is kept for backward; backward runs the block's forward again
               (collectives included, as Megatron-LM's full recompute does)
    selective  matmul outputs and tensor-parallel collectives are kept; cheap elementwise ops, norms and
               attention (softmax) are recomputed; ZeRO's parameter gathers (dp group) are recomputed too,
               so gathered parameters are never kept from forward to backward

Built on torch.utils.checkpoint (non-reentrant) and its selective-checkpoint contexts.
"""
from __future__ import annotations

import functools

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

aten = torch.ops.aten
SAVED = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default, aten.linear.default,
         aten.matmul.default}


class Remat(torch.nn.Module):
    def __init__(self, block: torch.fx.GraphModule, policy: str, recompute_groups: tuple[str, ...] = ()):
        super().__init__()
        self.block = block
        self.policy = policy
        self.recompute_groups = tuple(recompute_groups)

    def forward(self, *args):
        if self.policy == "full":
            return checkpoint(self.block, *args, use_reentrant=False)
        context = functools.partial(create_selective_checkpoint_contexts,
                                    functools.partial(_selective, self.recompute_groups))
        return checkpoint(self.block, *args, use_reentrant=False, context_fn=context)


def _selective(recompute_groups: tuple[str, ...], ctx, op, *args, **kwargs) -> CheckpointPolicy:
    if op in SAVED:
        return CheckpointPolicy.MUST_SAVE
    if getattr(op, "namespace", "") == "_c10d_functional":
        group = args[-1] if args and isinstance(args[-1], str) else None
        if group in recompute_groups:  # a ZeRO gather: gathered again rather than kept
            return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE  # tensor-parallel communication is not repeated
    return CheckpointPolicy.PREFER_RECOMPUTE
