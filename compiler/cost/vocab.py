"""Plan.vocab_parallel decided by the cost model: Megatron's default (the token embedding's rows and the LM head's
columns split over tp, the loss a vocabulary-parallel cross-entropy) wherever tp > 1, unless predicted slower.

    True / False   the user's choice;
    None           on where tp > 1, the model has a token embedding indexed by its input whose vocabulary divides
                   over tp, and the time it saves is more than the time it adds:

saved (per step, this rank): the head's matmuls, forward and backward (6·N·h·V·(1 - 1/tp) FLOPs for N tokens),
the softmax over the vocabulary (about six passes over N·V·(1 - 1/tp) fp32 values), the embedding's and head's
gradients and optimizer update over (1 - 1/tp) of their V·h elements;
added: the embedding's lookup becomes a partial sum, all-reduced (N·h values), the head's input gradient is
all-reduced (N·h), and the loss is three all-reduces of N fp32 values (max, sum of exponentials, target logit)
where a plain cross-entropy reads the logits inside the graph (as job.step's graph does for a meshc.compile job of
one stage, whose forward graph returns them); where the logits leave the graph instead (torch.compile's door, a
pipeline's last stage), they are all-gathered (N·V/tp values from each rank).

It also holds (1 - 1/tp) fewer bytes of the embedding's and head's parameters, gradients, optimizer states and
logits, which the decision does not count: memory never argues against it.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.fx as fx

from meshc.compiler.cost.hardware import Hardware
from meshc.compiler.ir.fx_ops import is_model_input
from meshc.compiler.ir.logits import logits_end
from meshc.compiler.ir.plan import Decision
from meshc.compiler.ir.program import Program

aten = torch.ops.aten
LOSS_PASSES = 11.0  # passes over its local logits of runtime/ops/tp_ops.py's vocabulary-parallel cross-entropy
EXTRA_OPS = 30  # ops vocabulary parallelism adds, forward and backward (the lookup's mask, the loss's reductions)
_MATMULS = {aten.linear.default, aten.mm.default, aten.matmul.default}


@dataclass(frozen=True)
class VocabShape:
    """What the decision needs: tokens on this rank, width, vocabulary, the heads' count, whether the head is the
    embedding (tied), where the logits go ("loss": a plain cross-entropy in the graph; "output": returned)."""

    tokens: int
    hidden: int
    vocab: int
    heads: int
    tied: bool
    logits: str
    itemsize: int = 4


def predicted(hw: Hardware, tp: int, s: VocabShape) -> tuple[float, float]:
    """(seconds saved, seconds added) per step on this rank by vocabulary parallelism (module docstring)."""
    cut = 1 - 1 / tp
    flops = 6.0 * s.tokens * s.hidden * s.vocab * cut * s.heads
    # the fused cross-entropy reads and writes the whole logits ~6 times (log-softmax and its gradient); the
    # vocabulary-parallel one ~11 times its 1/tp (max, shift, exp, sum, pick; softmax, one-hot, scale, casts)
    passes = 6.0 - (LOSS_PASSES / tp if s.logits == "loss" else 6.0 / tp)
    softmax = passes * s.tokens * s.vocab * 4 * s.heads
    elements = s.vocab * s.hidden * cut * (1 if s.tied else 1 + s.heads)
    saved = flops / hw.flops * hw.compute_scale + softmax / hw.mem_bandwidth + hw.adam_time(elements) \
        + 2 * elements * 4 / hw.mem_bandwidth  # gradients: zeroed and accumulated
    link = hw.link(1, tp)
    act = s.tokens * s.hidden * s.itemsize
    added = link.time("all_reduce", tp, act) * (1 + s.heads) + EXTRA_OPS * hw.op_overhead
    if s.logits == "loss":
        added += 3 * link.time("all_reduce", tp, s.tokens * 4)
    else:
        added += link.time("all_gather", tp, s.tokens * s.vocab / tp * s.itemsize) * s.heads
    return saved, added


def decide_vocab_parallel(program: Program, hw: Hardware) -> Decision:
    """Decision for Plan.vocab_parallel (module docstring)."""
    plan, tp = program.plan, program.mesh.size("tp")
    if plan.vocab_parallel is not None:
        return Decision(bool(plan.vocab_parallel), f"Plan.vocab_parallel={plan.vocab_parallel}")
    if tp == 1:
        return Decision(False, "tp = 1: nothing to split")
    found = vocab_shape(program)
    if isinstance(found, str):
        return Decision(False, found)
    if found.vocab % tp:
        return Decision(False, f"the vocabulary of {found.vocab} does not divide over tp={tp} (pad it to a multiple "
                               f"of {tp}, as Megatron does, to shard it)")
    if found.logits == "output" and program.step_loss:  # job.step reads them in its own graph: loss-parallel
        found = dataclasses.replace(found, logits="loss")
        where = "job.step's loss vocabulary-parallel; job(x) gathers the logits"
    else:
        where = "the loss vocabulary-parallel" if found.logits == "loss" else "the logits all-gathered at the output"
    saved, added = predicted(hw, tp, found)
    verdict = f"saves {saved * 1e3:.3g} ms, adds {added * 1e3:.3g} ms of collectives ({where})"
    return Decision(saved > added, f"{hw.name} profile: sharding the vocabulary of {found.vocab} over tp={tp} "
                                   f"{verdict}")


def decide_from_shape(hw: Hardware, tp: int, tokens: int, hidden: int, vocab: int, tied: bool) -> bool:
    """The same choice from a model's sizes alone (the formulas' plans; the loss inside the step)."""
    if tp == 1 or vocab % tp:
        return False
    saved, added = predicted(hw, tp, VocabShape(tokens, hidden, vocab, 1, tied, "loss"))
    return saved > added


def vocab_shape(program: Program) -> VocabShape | str:
    """The token embedding and the LM heads of the traced graph (matmuls over a (V, h) weight whose logits reach
    the output or a cross-entropy), or why vocabulary parallelism has nothing to split."""
    nodes = program.param_nodes()
    params = set(nodes.values())
    embedding = next((n for n in program.gm.graph.nodes if n.op == "call_function" and n.target == aten.embedding.default
                      and n.args[0] in params and is_model_input(n.args[1])), None)
    if embedding is None:
        return "no token embedding indexed by a model input"
    weight = embedding.args[0]
    vocab, hidden = (int(d) for d in weight.meta["val"].shape)
    tokens = int(embedding.args[1].meta["val"].numel())
    heads, ends = [], set()
    for param in params:
        val = param.meta.get("val")
        if not isinstance(val, torch.Tensor) or tuple(val.shape) not in ((vocab, hidden), (hidden, vocab)):
            continue
        for matmul in _matmuls_of(param):
            end = logits_end(matmul)
            if end is not None and int(matmul.meta["val"].shape[-1]) == vocab:
                heads.append(param)
                ends.add(end)
    if not heads:
        return f"no LM head: no matmul over the embedding's vocabulary of {vocab} whose logits reach the output or " \
               "a cross-entropy"
    itemsize = weight.meta["val"].element_size()
    return VocabShape(tokens, hidden, vocab, len(heads), any(h is weight for h in heads),
                      "output" if "output" in ends else "loss", itemsize)


def _matmuls_of(param: fx.Node) -> list[fx.Node]:
    """The matmuls that read `param` as their weight (through a transpose)."""
    out = []
    for user in param.users:
        if user.target in (aten.t.default, aten.permute.default):
            out += [u for u in user.users if u.target in _MATMULS and len(u.args) > 1 and u.args[1] is user]
        elif user.target in _MATMULS and len(user.args) > 1 and user.args[1] is param:
            out.append(user)
    return out
