"""Plan: what the user asks of the compiler. A small frozen dataclass, validated on construction.

Only what meshc implements today has a field; asking for something it cannot do yet is an error at
construction, never a silently ignored setting.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from typing import Any, Callable

import torch

from meshc.compiler.ir.errors import MeshcTypeError, MeshcValueError
from meshc.compiler.ir.schedule import V_SHAPED


CP_ATTENTION = ("ring", "all_gather", "all_to_all")
TP_STYLES = ("colwise", "rowwise", "vocab", "replicate")
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zbv", "dualpipev")
SPLIT_BACKWARD = ("zb-h1", "zbv", "dualpipev")  # schedules that run backwards as input- and weight-gradient halves
DEFAULT_BUCKET_MB = 25.0  # gradient bucket MiB where the cost model has nothing to decide (compiler/cost/buckets.py)


@dataclass(frozen=True)
class Decision:
    """One choice the compiler made for a Plan field left to it (or the user's value): what, and why.

    Keys (Program.decisions): "fusion.<kernel>" for each fused kernel, "collective_matmul", "bucket_mb",
    "inductor"."""

    value: Any
    why: str

    def line(self, key: str) -> str:
        shown = {True: "on", False: "off"}.get(self.value, self.value) if isinstance(self.value, bool) else self.value
        return f"{key}: {shown} ({self.why})"


@dataclass(frozen=True, kw_only=True)
class Plan:
    """How to parallelize one model.

    Fields:
        bucket_mb: gradient buckets for the data-parallel all-reduce, in MiB. Parameters are grouped in
            the order the forward first uses them; each bucket is reduced as one flat tensor as soon as
            backward has produced all of its gradients. None (default): the cost model picks the size for
            the device at hand (compiler/cost/buckets.py; explain() says why).
        disable: names of passes to switch off (see `meshc.compiler.driver.PASS_NAMES`); for debugging.
        debug_dir: if set, the driver writes each pass's graph before and after into this folder.
        verify: check the compiler's invariants after every pass (tests turn this on).
        tp: explicit tensor-parallel styles by module FQN glob, e.g. {"*.attn.c_attn": "colwise",
            "*.mlp.c_proj": "rowwise", "*.lm_head": "replicate"}; styles: colwise (split output
            features), rowwise (split input features), vocab (embedding rows / LM head vocabulary),
            replicate. They override the automatic Megatron plan for the modules they match (later
            entries win). The automatic plan makes q/k/v and MLP up/gate column-parallel and the
            attention output and MLP down row-parallel, wherever the graph shows that pattern.
        sequence_parallel: keep activations between tensor-parallel regions sharded on the sequence
            dim (norms, dropout, residual adds on sequence shards): all-gather before column-parallel
            and reduce-scatter after row-parallel layers instead of all-reduce.
        vocab_parallel: shard the token embedding's rows and the LM head's columns over tp (Megatron's
            default), the loss a vocabulary-parallel cross-entropy where a plain one reads the logits in the
            graph. None (default): the cost model's choice (compiler/cost/vocab.py): on where tp > 1, the
            vocabulary divides over tp and the head's compute it saves outweighs the collectives it adds (tiny
            vocabularies on CPU stay replicated); explain() says which and why.
        cp_attention: how attention sees the whole sequence under context parallelism (a mesh with cp > 1):
            "ring" (K/V chunks passed around the cp ring, overlapping the local block's attention; no
            rank holds the whole sequence's K/V), "all_gather" (K/V gathered whole on every rank) or
            "all_to_all" (DeepSpeed-Ulysses: heads exchanged for sequence; needs heads divisible by cp).
        zero: ZeRO stage on the dp axis. 1: optimizer states sharded (each rank updates its slice of
            the parameters, gradients reduce-scattered and updated slices all-gathered at the step);
            2: gradients too (reduce-scattered in backward as buckets complete); 3: parameters too
            (stored as flat shards, all-gathered before use, freed after, gathered again for backward).
        replicas: hybrid sharding (HSDP; DeepSpeed's hpZ/MiCS): the data-parallel ranks (dp × cp) split into this
            many replica groups of consecutive ranks (a node, where tp × dp/replicas ranks fill one); ZeRO shards
            states (and for zero=3 parameters) within a group, gradients are reduce-scattered within it and the
            shards all-reduced across the groups. 1 (default): shard over all of them. Needs zero >= 1.
        zero_bucket_mb: ZeRO-3 gathers parameters in buckets of about this many MiB, grouped by block.
        zero_keep_last: ZeRO-3 keeps the bucket used last in forward gathered for backward, which needs it
            first (as FSDP2 keeps its root module's parameters): one all-gather of it fewer per step.
        param_dtype: compute dtype of the parameters (e.g. torch.bfloat16) with fp32 master shards;
            needs zero >= 1. Floating inputs are cast to it.
        reduce_dtype: dtype in which ZeRO reduces gradients (default: param_dtype, or fp32); needs zero >= 1.
        microbatches: micro-batches per step (m): the dp-local batch is split into m equal parts, run
            through the pipeline stages in the order `schedule` gives, gradients accumulated.
        schedule: "gpipe", "1f1b", "interleaved" (needs virtual >= 2 and m a multiple of pp), "zb-h1"
            (zero-bubble: backward split into input- and weight-gradient halves) or "zbv" (zero-bubble with
            two stages per rank placed in a V: rank r holds stages r and 2pp-1-r; half ZB-H1's bubble at the
            same peak activations once m >= 2pp-1; a tied embedding and head share rank 0) or "dualpipev" (the
            same V, m >= 2pp; its steady state pairs one stage's forward with the other's full backward, which
            meshc runs one after the other; only the backwards at both ends are split).
        virtual: pipeline stages per pp rank (interleaved 1F1B; the V schedules' 2, set when left at 1); pp x
            virtual stages in all.
        split_points: module names, in forward order, before which a stage begins (pp x virtual - 1
            of them); default: the compiler balances the stages. A meshc.pipe_split() call in the model
            marks a cut too.
        remat: activation checkpointing: "none", "full" (each block recomputed in backward) or
            "selective" (matmul and collective outputs kept, cheap elementwise ops and softmax recomputed;
            not with schedule="zb-h1", "zbv" or "dualpipev", whose two backward halves torch's selective
            checkpoint cannot run).
        fusion: rewrite the chains next to collectives into meshc's fused kernels (bias-dropout-add-norm,
            bias+GeLU/SwiGLU, ZeRO copy-in/out and gradient prologue). None (default): the cost model decides
            kernel by kernel for the device at hand (fused only where it predicts the kernel faster than the
            chain: on GPUs the Triton kernels; on CPUs, whose kernels are pure torch, only what `meshc
            calibrate` measured faster); True or False force every kernel on or off. explain() says why.
        require_fusion: raise if an eligible chain stayed unfused (the error says why); implies fusion on.
        collective_matmul: overlap sequence parallelism's all-gather and reduce-scatter with the matmuls
            next to them (chunks passed around a ring of point-to-point transfers). None (default): the cost
            model decides where sequence_parallel=True (on where it predicts the ring faster than the
            collective and the matmul one after the other); True needs sequence_parallel=True and fusion not
            False (the fusion pass inserts them).
        offload: where the optimizer's element-wise states (and, with offload_params, ZeRO-3's parameter
            shards) live between uses; needs zero >= 1. None: in the device's memory. "nvme" (ZeRO-Infinity):
            in a scratch file under offload_dir, streamed through a bounded pool of buffers during the
            optimizer step (the next bucket read while the current one updates, writes asynchronous).
            "cpu" (ZeRO-Offload): in host memory, streamed the same way; on a CPU device host memory is the
            device's, so it is the identity placement (explain() says so).
        offload_dir: folder for "nvme" offload files (this run's scratch: a meshc-offload-* folder per rank,
            removed at exit), or a function of the global rank returning one (a local disk per rank or node, as
            DeepSpeed's nvme_path is node-local). A rank's resource, not part of the plan: ranks may name
            different folders. Missing, unwritable or too full is an error on that rank before the first step.
        offload_params: with zero=3 and offload="nvme", the parameter shards too live in the file; each
            bucket is read before its all-gather and the updated shards are written back by the step.
        offload_buffer_mb: the pool of offload buffers, in MiB (three buckets: one updating, one being read,
            one being written; parameters are cut into pieces to fit). None: 1/32 of the bytes offloaded,
            between 1 and 64 MiB.
        inductor: Inductor lowers each per-rank program, forward and backward (AOTAutograd's joint graph,
            partitioned, compiled by compile_fx; the collectives stay functional collectives in the graphs). None
            (default): the cost model's choice for the device (on on CUDA; off on CPU, where Inductor's step
            measured ~6% faster than eager for seconds of compile per program) wherever the plan's programs
            are graphs Inductor can trace; True forces it (an error naming what blocks it where the plan has run-
            time state: ZeRO-2/3, pipeline stages, experts, context parallelism, collective matmul, remat); False
            runs the programs as FX code. explain() says which and why. Under torch.compile(model,
            backend=meshc.backend(...)), True compiles each region's program.
        trace: "auto" tries non-strict torch.export and falls back to strict (TorchDynamo); "strict" or
            "non-strict" forces one. Non-strict comes first because it keeps user autograd.Functions'
            backward (strict export drops it: wrong gradients) and is several times faster.
        min_tp_coverage: with tp > 1, the least fraction (0 to 1] of the blocks' weight bytes the plan must
            hold sharded on tp (compiler/ir/coverage.py says what counts); less is an error naming each
            replicated module and why. None (default): below one half warns (MeshcWarning) instead.
        check_trace: compare the traced program's loss and gradients with eager on the example batch
            before sharding, raising on the first parameter whose gradient differs. None (default): on
            when the model's parameters are real tensors of at most 16M elements in all (the check costs
            one forward and backward of each); True/False force it.
    """

    bucket_mb: float | None = None
    disable: tuple[str, ...] = field(default=())
    debug_dir: str | None = None
    verify: bool = False
    trace: str = "auto"
    check_trace: bool | None = None
    tp: dict[str, str] | None = None
    min_tp_coverage: float | None = None
    sequence_parallel: bool = False
    vocab_parallel: bool | None = None
    cp_attention: str = "ring"
    zero: int = 0
    replicas: int = 1
    zero_bucket_mb: float = 25.0
    zero_keep_last: bool = True
    param_dtype: Any = None
    reduce_dtype: Any = None
    microbatches: int = 1
    schedule: str = "1f1b"
    virtual: int = 1
    split_points: tuple[str, ...] | None = None
    remat: str = "none"
    fusion: bool | None = None
    require_fusion: bool = False
    collective_matmul: bool | None = None
    inductor: bool | None = None
    offload: str | None = None
    offload_dir: str | os.PathLike | Callable[[int], str] | None = None
    offload_params: bool = False
    offload_buffer_mb: float | None = None

    def __post_init__(self) -> None:
        if self.bucket_mb is not None and (isinstance(self.bucket_mb, bool) or not isinstance(self.bucket_mb, (int, float))
                                           or not self.bucket_mb > 0):
            raise MeshcValueError(f"Plan.bucket_mb: expected a positive number of MiB or None (the cost model's "
                                  f"choice), got {self.bucket_mb!r}")
        if isinstance(self.disable, str) or not all(isinstance(n, str) for n in self.disable):
            raise MeshcTypeError(
                f"Plan.disable: expected a tuple of pass names, got {self.disable!r}; "
                f"write disable=({self.disable!r},) for one pass"
            )
        object.__setattr__(self, "disable", tuple(self.disable))
        if self.tp is not None:
            if not isinstance(self.tp, dict):
                raise MeshcTypeError(f"Plan.tp: expected a dict of module glob -> style, got {type(self.tp).__name__}")
            bad = {k: v for k, v in self.tp.items() if v not in TP_STYLES}
            if bad:
                glob, style = next(iter(bad.items()))
                raise MeshcValueError(f"Plan.tp[{glob!r}]: expected a style among {', '.join(TP_STYLES)}, got "
                                      f"{style!r}")
        if self.min_tp_coverage is not None and (isinstance(self.min_tp_coverage, bool) or not isinstance(
                self.min_tp_coverage, (int, float)) or not 0 < self.min_tp_coverage <= 1):
            raise MeshcValueError(f"Plan.min_tp_coverage: expected a fraction in (0, 1] of the blocks' weight bytes, "
                                  f"got {self.min_tp_coverage!r}; e.g. min_tp_coverage=0.9, or None for a warning only")
        if self.cp_attention not in CP_ATTENTION:
            raise MeshcValueError(f"Plan.cp_attention: expected one of {', '.join(CP_ATTENTION)}, got "
                                  f"{self.cp_attention!r}")
        if self.zero not in (0, 1, 2, 3):
            raise MeshcValueError(f"Plan.zero: expected a ZeRO stage 0, 1, 2 or 3, got {self.zero!r}")
        if isinstance(self.replicas, bool) or not isinstance(self.replicas, int) or self.replicas < 1:
            raise MeshcValueError(f"Plan.replicas: expected a positive int (replica groups of ZeRO's hybrid sharding), "
                                  f"got {self.replicas!r}")
        if self.replicas > 1 and self.zero == 0:
            raise MeshcValueError(f"Plan.replicas={self.replicas}: hybrid sharding shards ZeRO's states within replica "
                                  f"groups; expected zero=1, 2 or 3 with it, got zero=0 (plain data parallelism "
                                  f"replicates everything already)")
        if not isinstance(self.zero_bucket_mb, (int, float)) or self.zero_bucket_mb <= 0:
            raise MeshcValueError("Plan.zero_bucket_mb: expected a positive number of MiB, got "
                                  f"{self.zero_bucket_mb!r}")
        self._check_precision_and_fusion()
        self._check_pipeline()
        self._check_offload()
        if self.trace not in ("auto", "strict", "non-strict"):
            raise MeshcValueError(f"Plan.trace: expected 'auto', 'strict' or 'non-strict', got {self.trace!r}")

    def _check_precision_and_fusion(self) -> None:
        for name in ("param_dtype", "reduce_dtype"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, torch.dtype) and value.is_floating_point):
                raise MeshcTypeError(f"Plan.{name}: expected a floating torch.dtype such as torch.bfloat16, got "
                                     f"{value!r}")
        if self.param_dtype is not None and self.zero == 0:
            raise MeshcValueError("Plan.param_dtype: expected zero >= 1 (mixed precision keeps fp32 master shards), "
                                  "got zero=0; use zero=1, which communicates as much as plain data parallelism")
        if self.reduce_dtype is not None and self.zero == 0:
            raise MeshcValueError("Plan.reduce_dtype: expected zero >= 1 (ZeRO's reduce-scatters are what casts "
                                  "gradients), got zero=0; use zero=1, which communicates as much as plain data "
                                  "parallelism")
        for name in ("fusion", "collective_matmul", "inductor", "vocab_parallel"):
            if getattr(self, name) not in (None, True, False):
                raise MeshcTypeError(f"Plan.{name}: expected True, False or None (the cost model decides), got "
                                     f"{getattr(self, name)!r}")
        if self.collective_matmul and not self.sequence_parallel:
            raise MeshcValueError("Plan.collective_matmul: expected sequence_parallel=True (it overlaps sequence "
                                  "parallelism's all-gather and reduce-scatter with the matmuls next to them), got "
                                  "sequence_parallel=False; turn sequence parallelism on, or drop collective_matmul")
        if self.fusion is False and (self.collective_matmul or self.require_fusion):
            name = "collective_matmul" if self.collective_matmul else "require_fusion"
            raise MeshcValueError(f"Plan.{name}: expected fusion=True or None (the fuse_comm pass makes the fused "
                                  "kernels and collective matmuls, and fusion=False turns it off), got fusion=False; "
                                  f"keep fusion on or leave it to the cost model, or drop {name}")

    def _check_pipeline(self) -> None:
        for name in ("microbatches", "virtual"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise MeshcValueError(f"Plan.{name}: expected a positive int, got {value!r}")
        if self.schedule not in SCHEDULES:
            raise MeshcValueError(f"Plan.schedule: expected one of {', '.join(SCHEDULES)}, got {self.schedule!r}")
        if self.schedule in V_SHAPED:
            if self.virtual not in (1, 2):
                raise MeshcValueError(f"Plan.virtual: schedule={self.schedule!r} runs two stages per rank: expected "
                                      f"virtual=2 (or 1, read as 2), got {self.virtual}; use 'interleaved' for more")
            object.__setattr__(self, "virtual", 2)
        elif (self.schedule == "interleaved") != (self.virtual > 1):
            raise MeshcValueError(f"Plan.schedule: the interleaved schedule and virtual > 1 go together, got "
                                  f"schedule={self.schedule!r} with virtual={self.virtual}")
        if self.split_points is not None:
            if isinstance(self.split_points, str) or not all(isinstance(p, str) for p in self.split_points):
                raise MeshcTypeError(f"Plan.split_points: expected a list of module names, got {self.split_points!r}")
            object.__setattr__(self, "split_points", tuple(self.split_points))
        if self.remat not in ("none", "full", "selective"):
            raise MeshcValueError(f"Plan.remat: expected 'none', 'full' or 'selective', got {self.remat!r}")
        if self.remat == "selective" and self.schedule in SPLIT_BACKWARD:
            raise MeshcValueError(f"Plan.remat: expected 'none' or 'full' with schedule={self.schedule!r} (its input- and "
                                  "weight-gradient halves run backward twice over each block, and torch's selective "
                                  "checkpoint lets a block run backward once), got 'selective'; use remat='full', "
                                  "or another schedule")

    def _check_offload(self) -> None:
        if self.offload not in (None, "cpu", "nvme"):
            raise MeshcValueError(f"Plan.offload: expected None, 'cpu' or 'nvme', got {self.offload!r}")
        if self.offload is not None and self.zero == 0:
            raise MeshcValueError(f"Plan.offload: expected zero >= 1 (offload moves ZeRO's optimizer-state shards), "
                                  f"got zero=0 with offload={self.offload!r}; use zero=1, which communicates as much as "
                                  "plain data parallelism")
        if self.offload == "nvme" and not (isinstance(self.offload_dir, (str, os.PathLike)) or
                                           callable(self.offload_dir)):
            raise MeshcValueError(f"Plan.offload_dir: expected a folder for offload='nvme' (a fast local disk), or a "
                                  f"function of the rank returning one, got {self.offload_dir!r}")
        if self.offload_dir is not None and self.offload != "nvme":
            raise MeshcValueError(f"Plan.offload_dir: expected offload='nvme' with it, got offload={self.offload!r}; "
                                  "drop offload_dir or set offload='nvme'")
        if self.offload_params and (self.zero != 3 or self.offload != "nvme"):
            raise MeshcValueError(f"Plan.offload_params: expected zero=3 and offload='nvme' (only ZeRO-3 keeps "
                                  f"parameters as shards), got zero={self.zero}, offload={self.offload!r}")
        mb = self.offload_buffer_mb
        if mb is not None and (isinstance(mb, bool) or not isinstance(mb, (int, float)) or mb <= 0):
            raise MeshcValueError(f"Plan.offload_buffer_mb: expected a positive number of MiB, got {mb!r}")
        if mb is not None and self.offload is None:
            raise MeshcValueError("Plan.offload_buffer_mb: expected offload='nvme' or 'cpu' with it, got offload=None")

    def describe(self) -> str:
        """One line with the fields that differ from their defaults."""
        default = Plan()
        changed = [f"{f.name}={getattr(self, f.name)!r}" for f in fields(self)
                   if getattr(self, f.name) != getattr(default, f.name)]
        return "Plan(" + ", ".join(changed) + ")"
