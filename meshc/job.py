"""Job: one rank's compiled model, holding its local shards and running its transformed graph.

    job = meshc.compile(model, mesh, example_inputs=(x,))
    opt = job.optimizer(torch.optim.AdamW, lr=3e-4)
    loss = job.step(x, y, loss_fn)       # forward + backward; returns the loss averaged over dp
    opt.step(); opt.zero_grad()

Conventions (DESIGN.md §1): each rank passes its own dp-local batch; `loss_fn(outputs, targets)`
returns the mean over that batch; gradients come out averaged over dp, so training matches one process
running the global batch. A call with new input shapes compiles again and keeps the same parameters.

Big models: the model may be built on the meta device; each rank then allocates only its own shards, and
`job.init_weights(seed)` or `job.load_pretrained(path)` (or `job.load(checkpoint)`) gives them values. The job
keeps no full tensor: after compiling it holds a meta copy of the model (for retracing new input shapes and
for initialization), never the user's weights.
"""
from __future__ import annotations

import copy
import functools
import os
import weakref
from typing import Any, Callable, Iterator

import torch

from meshc.compiler.ir import torch_compat as compat
from meshc.compiler.compile import CompiledRank, compile_program, compile_rank, passes_for_rank
from meshc.compiler.report.explain import Report, explain
from meshc.compiler.cost.compiled import estimate_compiled
from meshc.compiler.cost.hardware import detect as detect_hardware
from meshc.compiler.ir.errors import MeshcValueError, warn
from meshc.compiler.ir.program import Program
from meshc.compiler.pipeline.rank_plan import PipelinePlan
from meshc.compiler.report.html import write_report

from meshc import param_groups
from meshc.runtime.inductor import InductorPrograms
from meshc.runtime import regions
from meshc.runtime.monitor import failures
from meshc.runtime.monitor import trace as tracing
from meshc.runtime.zero.param_store import ParamStore
from meshc.runtime.pipeline.step import Pipelined, weighted
from meshc.runtime.sharding import LocalShard, allocate_local, full_tensor, read_local, take
from meshc.runtime.ops.experts import RoutingLog, recording
from meshc.runtime.ops.zero import zero_gather, zero_reduce
from meshc.runtime.zero.context import ZeroContext, ZeroStats


class Job:
    def __init__(self, model: torch.nn.Module, mesh, plan, example_args: tuple, example_kwargs: dict):
        mesh = mesh.hybrid(plan.replicas)  # hybrid sharding's groups (Plan.replicas > 1), created on every rank
        self.mesh = mesh
        self.plan = plan
        self._traced: dict[Any, Program] = {}
        self._programs: dict[Any, Program] = {}
        self._optimizers: list[weakref.ref] = []
        first, tensors = compile_rank(model, example_args, example_kwargs, mesh=mesh, plan=plan)
        key = _signature(example_args, example_kwargs)
        self._traced[key], self._programs[key] = first.traced, first.program
        self._layout = first.pipeline  # compile-time: stages, schedule, who holds what
        self._pipe = Pipelined(first.pipeline, mesh) if first.pipeline is not None else None
        flat, spec = compat.tree_flatten((example_args, example_kwargs))
        self._pipe_inputs = (_shapes(flat), spec)  # the input shapes and structure the stages were compiled for
        program = first.program
        keep = self._layout.params if self._layout else None
        self._store = ParamStore(program, tensors, mesh, keep=keep)
        self._params = self._store.masters
        self.zero_stats = ZeroStats()
        self.inductor = InductorPrograms(aliases=mesh.aliases)  # what Inductor compiled (stats: graphs, seconds)
        self._holds_zero: dict[int, bool] = {}  # id(program) -> whether its graph gathers or reduces ZeRO buckets
        self._buffers: dict[str, torch.Tensor] = {}
        self._pending_buffers: set[str] = set()
        for fqn, spec in program.buffers.items():
            if self._layout is None or fqn in self._layout.buffers:
                if tensors[fqn].device.type == "meta":
                    self._pending_buffers.add(fqn)
                self._buffers[fqn] = allocate_local(tensors[fqn], spec, mesh)
        del tensors
        self._model = _meta_twin(model)  # shapes and structure only: no full tensor stays with the job
        self._state_keys = _state_dict_keys(model, program)
        self._placements = {fqn: dict(spec.placements) for fqn, spec in program.params.items()}
        _share_rng_state(mesh)

    # ------------------------------------------------------------------------------ running
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Forward on this rank's local batch; returns what the model returns."""
        if self.mesh.size("pp") > 1:
            raise MeshcValueError("job(x): a plan with pipeline stages has no plain forward on one rank; train with "
                                  "job.step(inputs, targets, loss_fn), which runs the schedule")
        self._require_values("job(x)")
        return self._run(self._program_for(args, kwargs), args, kwargs)

    def _run(self, program: Program, args: tuple, kwargs: dict) -> Any:
        self._last = program
        flat, _ = compat.tree_flatten((args, kwargs))
        flat = [self._input(x) for x in flat]
        values = self._store.graph_inputs(program) + [self._buffers[f] for f in program.buffers]
        gm = self._runnable(program)
        if self._zero_context_needed(program):  # gathered parameters recomputed in backward; ZeRO-2 master gradients
            self.zero_stats = ZeroStats()
            with ZeroContext(self._params, self.zero_stats):
                outs = gm(*values, *flat)
        else:
            outs = gm(*values, *flat)
        n = len(program.mutated_buffers)
        with torch.no_grad():
            for fqn, value in zip(program.mutated_buffers, outs[:n]):
                self._buffers[fqn].copy_(value)
        return compat.tree_unflatten(list(outs[n:]), program.out_spec)

    def _runnable(self, program: Program):
        """What runs `program`: Inductor's code where the plan's decision says so (runtime/inductor.py), else the
        FX graph itself (with module marks while job.trace records)."""
        decision = program.decisions.get("inductor")
        if decision is not None and decision.value:
            return self.inductor.runner(program.gm, "program", masters=self._params.__getitem__)
        return tracing.marked(program.gm)

    def _zero_context_needed(self, program: Program) -> bool:
        """ZeRO-2/3 run as FX code need the step's ZeroContext (saved-tensor hooks that re-gather, the master shards
        ZeRO-2's reduce writes); compiled, the graphs hold it all: the partitioner recomputes the gathers in backward
        and the gradient shards are the compiled backward's outputs (runtime/inductor.py), except for gathers that
        run as FX code between compiled regions, read by eager ops only (expert weights: runtime/regions.py), which
        need the context as FX code does; over an axis of one rank there is nothing to gather (passes/zero.py reads
        the shards in place)."""
        if self.plan.zero < 2:
            return False
        if id(program) not in self._holds_zero:  # read once per program, not on every step
            decision = program.decisions.get("inductor")
            gm = program.gm
            self._holds_zero[id(program)] = regions.gathers_run_eagerly(gm) if decision is not None and decision.value \
                else any(n.op == "call_function" and n.target in (zero_gather, zero_reduce) for n in gm.graph.nodes)
        return self._holds_zero[id(program)]

    def _input(self, x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        x = x.to(self.mesh.device)
        if self.plan.param_dtype is not None and x.is_floating_point():
            x = x.to(self.plan.param_dtype)  # mixed precision: compute in the parameters' dtype
        return x

    def step(self, inputs: Any, targets: Any, loss_fn: Callable[[Any, Any], torch.Tensor], *,
             count: Callable[[Any], Any] | None = None) -> torch.Tensor:
        """Forward and backward on this rank's batch; gradients land on `parameters()`, averaged over dp.

        `inputs`: a tensor, a tuple of positional inputs, or a dict of keyword inputs (a transformers batch:
        `{"input_ids": x, "attention_mask": m}`, called as `model(**inputs)`). Returns the loss averaged over dp
        (detached): the single-process loss of the global batch. The first step checks that every rank runs the
        same plan; a dead or stalled peer raises failures.RankFailure.

        `count(targets)`: how many items `loss_fn` averages over in these targets (tokens not ignored:
        `lambda y: (y != -100).sum()`). Given, each rank's (and micro-batch's) mean is weighted by its share of the
        global count, so the step is the mean over every counted token of the global batch, as one process
        computes it, however unevenly they fall on dp and cp ranks (prompt tokens masked at the start of each
        sequence, padding). Without it the ranks' means are averaged, as DDP does.
        """
        self._require_values("job.step")
        failures.preflight(self)
        self._routing = RoutingLog()
        with failures.watching(self.mesh, "job.step"), tracing.region("step", "step"), recording(self._routing):
            return self._step(inputs, targets, loss_fn, count)

    def _step(self, inputs: Any, targets: Any, loss_fn: Callable, count: Callable | None) -> torch.Tensor:
        args, kwargs = ((), dict(inputs)) if isinstance(inputs, dict) else \
            (inputs if isinstance(inputs, tuple) else (inputs,), {})
        if isinstance(targets, torch.Tensor):
            targets = targets.to(self.mesh.device)
        if self._pipe is not None:  # micro-batches through the stages, in the schedule's order
            return self._average(self._pipeline_step(args, kwargs, targets, loss_fn, count), "dp")
        if self._vocab_parallel():  # the loss joins the graph: cross-entropy on vocabulary shards
            loss = self._run(self._step_program(args, kwargs, targets, loss_fn), (*args, targets), kwargs)
        else:
            loss = loss_fn(self(*args, **kwargs), targets)
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise MeshcValueError(f"job.step: expected loss_fn to return a scalar tensor, got {shape}; "
                                  "reduce the loss to its mean over the batch")
        if count is not None:
            loss = weighted(loss, self._count_weights(count, [targets])[0])
        loss.backward()
        return self._average(loss.detach(), "dp")

    def _vocab_parallel(self) -> bool:
        """Whether the job's plan shards the vocabulary: the decision holds Plan.vocab_parallel where it is set, the
        cost model's choice where it is None (compiler/cost/vocab.py)."""
        decision = self.program.decisions.get("vocab_parallel")
        return bool(decision is not None and decision.value)

    def _count_weights(self, count: Callable, targets: list) -> list[torch.Tensor]:
        """Each part's weight (this rank's targets, or its micro-batches'): its count × the dp size / the global
        count (all-reduced over dp, cp included), so that the dp average of the weighted means is the mean over
        every counted item."""
        local = []
        for t in targets:
            c = count(t)
            if not (isinstance(c, (int, float)) or (isinstance(c, torch.Tensor) and c.numel() == 1)):
                raise MeshcValueError(f"job.step: expected count(targets) to return a number, got "
                                      f"{tuple(c.shape) if isinstance(c, torch.Tensor) else type(c).__name__}; "
                                      "count the items loss_fn averages over, e.g. lambda y: (y != -100).sum()")
            local.append(torch.as_tensor(c, dtype=torch.float64, device=self.mesh.device).reshape(()))
        local = torch.stack(local)
        n = self.mesh.size("dp")
        total = local.sum() if n == 1 else compat.all_reduce_sum(local.sum().clone(), self.mesh.group_name("dp"))
        if total.item() == 0:
            raise MeshcValueError("job.step: count(targets) is 0 on every rank: the global batch has nothing to "
                                  "average the loss over")
        return list((local * (n * len(targets)) / total).to(torch.float32).unbind())

    def _pipeline_step(self, args: tuple, kwargs: dict, targets: Any, loss_fn: Callable,
                       count: Callable | None = None) -> torch.Tensor:
        program = self.program
        self._last = program
        inputs, spec = compat.tree_flatten((args, kwargs))
        shapes, compiled_spec = self._pipe_inputs
        if str(spec) != str(compiled_spec):
            raise MeshcValueError(f"job.step: expected the inputs' structure the pipeline was compiled for, "
                                  f"{compiled_spec}, got {spec}; pass positional and keyword inputs as in "
                                  "meshc.compile's example_inputs and example_kwargs")
        for i, (got, want) in enumerate(zip(_shapes(inputs), shapes)):
            if got != want:  # the stages are compiled for one batch shape (they are cut by its costs)
                raise MeshcValueError(
                    f"job.step: expected input {i} of shape {want}, the shape the pipeline stages were compiled for, "
                    f"got {got}; under pipeline stages every step takes the compiled shape: pad or drop a short "
                    "last batch, or compile another job for the other shape")
        flat = [self._input(x) for x in inputs]
        store, buffers = self._store, self._buffers

        def values(stage) -> list:
            return ([store.compute.get(f, store.masters[f]) for f in stage.params] +
                    [buffers[f] for f in stage.buffers])

        def zero_context():
            return ZeroContext(self._params, self.zero_stats)
        if self.plan.zero >= 2:  # what this step's gathers did, as a step without pipeline stages reports it
            self.zero_stats = ZeroStats()
        compiled = program.decisions["inductor"].value
        # a zero-bubble schedule runs each stage's backward as two halves: compiled as two graphs
        split = compiled and self._splits_backward
        runnable = (lambda stage: self.inductor.runner(stage.gm, f"stage {stage.index}", masters=self._params.__getitem__,
                                                       weights=len(stage.params) + len(stage.buffers) if split else None)) \
            if compiled else None
        specs = program.params
        holder = (lambda f: store.compute.get(f)) if self.plan.zero == 1 else (lambda f: store.masters.get(f))
        earlier = self._pipe.set_tied_aside(holder)  # gradient accumulation: only this step's are summed over stages
        weigh = (lambda micro_targets: self._count_weights(count, micro_targets)) if count is not None else None
        loss = self._pipe.step(flat, targets, loss_fn, values, zero_context if self._zero_context_needed(program) else None,
                               runnable, weigh)
        self._pipe.sum_tied(holder, lambda f: _grad_shape(store, specs[f], self.mesh), lambda f: _grad_dtype(store, specs[f]),
                            earlier)
        return loss

    @functools.cached_property
    def _splits_backward(self) -> bool:
        """Whether this rank's schedule runs each stage's backward as two halves (a zero-bubble one: I and W)."""
        return any(getattr(op, "kind", None) == "I" for op in self._pipe.layout.schedule.program(self.mesh.coord("pp")))

    def _average(self, value: torch.Tensor, axis: str) -> torch.Tensor:
        n = self.mesh.size(axis)
        if n == 1:
            return value
        return compat.all_reduce_sum(value.clone(), self.mesh.group_name(axis)) / n

    # ------------------------------------------------------------------------------ weights
    def init_weights(self, seed: int = 0) -> None:
        """Give this rank's shards their initial values with the model's own initialization (runtime/checkpoint/init_weights.py:
        each tensor alone, seeded by (seed, name), then sliced): the assembled weights are bitwise the same under
        every plan and equal meshc.init_weights(model, seed) in one process. Re-initializes every parameter; of
        the buffers, those the model left on the meta device. One full tensor at a time; no collective."""
        self._initialize(list(self._params), sorted(self._pending_buffers), seed)

    def init_buffers(self, fqns: list[str], seed: int = 0) -> None:
        """Compute buffers the model left on the meta device as its initialization computes them."""
        self._initialize([], fqns, seed)

    def _initialize(self, params: list[str], buffers: list[str], seed: int) -> None:
        from meshc.runtime.checkpoint.init_weights import Initializer

        init = Initializer(self._model, seed)
        try:
            for fqn in params:
                self._store.load_full(fqn, init.tensor(fqn))
            for fqn in buffers:
                full = init.tensor(fqn)
                self.load_buffer_part(fqn, lambda indices, full=full: take(full, indices))
        finally:
            init.restore()

    def load_pretrained(self, path, *, strict: bool = True):
        """Read weights into this rank's shards from a Hugging Face folder (model.safetensors, or the sharded
        model.safetensors.index.json), a .safetensors file, a torch state-dict file or a meshc checkpoint;
        each rank reads only the slices it holds (runtime/checkpoint/pretrained.py). Buffers absent from the files and
        left on meta are computed as init_weights computes them. `strict`: missing or unexpected keys are
        an error that lists them. Returns what this rank read (LoadStats: tensors, bytes)."""
        from meshc.runtime.checkpoint.pretrained import load_pretrained

        return load_pretrained(self, path, strict=strict)

    def load_part(self, fqn: str, read) -> None:
        """Write parameter `fqn`'s shards on this rank from `read` (per-dim global indices -> that part of the
        whole tensor; runtime/sharding.read_local)."""
        self._store.load_part(fqn, read)

    def load_buffer_part(self, fqn: str, read) -> None:
        """As load_part, for a buffer this rank holds."""
        with torch.no_grad():
            self._buffers[fqn].copy_(read_local(read, self.program.buffers[fqn], self.mesh))
        self._pending_buffers.discard(fqn)

    @property
    def model_meta(self) -> torch.nn.Module:
        """The model as the job keeps it: its structure on the meta device, no values."""
        return self._model

    def pending(self) -> list[str]:
        """The FQNs this rank holds that have no values yet (a model built on meta, before init_weights,
        load_pretrained or load)."""
        return sorted(self._store.pending | self._pending_buffers)

    def _require_values(self, what: str) -> None:
        missing = self.pending()
        if missing:
            raise MeshcValueError(
                f"{what}: expected every parameter to have a value, got {len(missing)} without one ({missing[0]}, ...): "
                "the model was built on the meta device; call job.init_weights(seed), job.load_pretrained(path) "
                "or job.load(checkpoint) first")

    # ------------------------------------------------------------------------------ parameters
    def named_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        """This rank's local parameter shards, by canonical FQN."""
        return iter(self._params.items())

    def parameters(self) -> Iterator[torch.nn.Parameter]:
        return iter(self._params.values())

    def optimizer(self, cls: type[torch.optim.Optimizer], params: Any = None, **kwargs: Any) -> torch.optim.Optimizer:
        """`cls` (any torch.optim optimizer) over this rank's trainable local parameters, or over `params`: parameter
        groups as torch takes them, each naming its parameters by the model's names (meshc/param_groups.py), e.g.
        `[{"params": decay_names, "weight_decay": 0.1}, {"params": other_names, "weight_decay": 0.0}]`."""
        if params is None:
            params = [p for p in self._params.values() if p.requires_grad]
            if not params and not any(p.requires_grad for p in self._model.parameters()):
                raise MeshcValueError("job.optimizer: expected a trainable parameter, got none: every parameter of the "
                                      "model has requires_grad=False")
            params = params or [{"params": []}]  # this rank's are all frozen (a pipeline stage of frozen layers)
        else:
            names = {n for n, _ in self._model.named_parameters(remove_duplicate=False)}
            params = param_groups.resolve(params, self._params, self._state_keys, names)
        if self._streams_states():
            opt = _offloaded_optimizer(cls, params, kwargs, self)
        else:
            opt = cls(params, **kwargs)
        self._store.attach(opt)
        failures.guard_optimizer(opt, self.mesh)
        self._optimizers.append(weakref.ref(opt))
        return opt

    def _streams_states(self) -> bool:
        """Whether the plan keeps optimizer states away from the device's memory: offload="nvme" always;
        offload="cpu" on a GPU (on a CPU device host memory is the device's: the identity placement)."""
        if self.plan.offload == "nvme" and self.mesh.device.type != "cpu":
            raise MeshcValueError(f"Plan.offload: expected a CPU device for offload='nvme' (its file I/O runs on "
                                  f"host buffers), got {self.mesh.device}; use offload='cpu' on GPUs")
        return self.plan.offload == "nvme" or (self.plan.offload == "cpu" and self.mesh.device.type != "cpu")

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale every gradient so that their global norm (over all shards on all ranks) is at most
        `max_norm`, as torch.nn.utils.clip_grad_norm_ does for one process; returns the norm before."""
        self._store.reduce_pending()
        total = self._store.grad_norm(norm_type, self._layout.tied_copies() if self._layout else frozenset())
        coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
        for p in self._params.values():
            if p.grad is not None:
                p.grad.detach().mul_(coef.to(p.grad.dtype))
        return total.to(torch.float32)

    def grad_state_dict(self) -> dict[str, torch.Tensor]:
        """Whole gradients by canonical FQN (averaged over dp, gathered from every shard): a collective,
        call it on every rank. Under ZeRO-1 it reduces the pending gradients as the optimizer step would."""
        self._store.reduce_pending()
        grads = {f: p.grad for f, p in self._params.items() if p.grad is not None}
        return self.whole_tensors(grads, [f for f in self.program.params if self.program.params[f].requires_grad])

    def offload_dir(self) -> str | None:
        """This rank's folder for Plan.offload="nvme" (Plan.offload_dir, or what its function returns for this
        rank)."""
        where = self.plan.offload_dir
        if callable(where):
            where = where(self.mesh.rank)
            if not isinstance(where, (str, os.PathLike)):
                raise MeshcValueError(f"Plan.offload_dir: expected the function to return a folder for rank "
                                      f"{self.mesh.rank}, got {where!r}")
        return None if where is None else os.fspath(where)

    def held_bytes(self) -> dict[str, int]:
        """Bytes of parameters, gradients and optimizer states this rank really holds (measured)."""
        return self._store.held_bytes(self.live_optimizers())  # offloaded states apart (runtime/zero/offload.py)

    def state_dict(self, sharded: bool = False) -> dict[str, Any]:
        """Full parameters and persistent buffers under the model's own keys (tied aliases included).

        Gathers shards from the other ranks where a placement shards them: call it on every rank. With
        `sharded=True`, nothing is gathered: each entry is this rank's LocalShard (tensor, global shape,
        placement per mesh axis), by canonical FQN.
        """
        program = self.program
        if sharded:
            out = {fqn: LocalShard(p.detach(), program.params[fqn].shape, dict(program.params[fqn].placements))
                   for fqn, p in self._params.items()}
            out.update({fqn: LocalShard(b, program.buffers[fqn].shape, dict(program.buffers[fqn].placements))
                        for fqn, b in self._buffers.items()})
            return out
        full = self.whole_tensors(self._params, list(program.params))
        full.update(self.whole_tensors(self._buffers, list(program.buffers)))
        return {key: full[fqn] for key, fqn in self._state_keys.items()}

    def save(self, path, *, step: int = 0, extra: dict | None = None, optimizers=None, async_: bool = False):
        """Write parameters, optimizer states (of the job's live optimizers, or `optimizers`), RNG states and
        `step`/`extra` (JSON) to the folder `path`, each rank its own shards (a collective). Returns the path. See
        runtime/checkpoint/save_load.py.

        `async_=True` returns a SaveHandle once this rank's state is copied to host memory, and writes the files in
        the background while training goes on (runtime/checkpoint/async_save.py): `handle.wait()` returns the path,
        `handle.blocked_s` is how long the step was held. Any save or load first waits for the one in flight."""
        return self._saver().save(self, path, step=step, extra=extra, optimizers=optimizers, async_=async_)

    def wait_for_save(self):
        """Wait for this job's async save in flight, if any, and return its SaveHandle (None if none); raises
        its error, naming the rank and path. Not a collective."""
        saver = self.__dict__.get("_checkpoint_saver")
        return saver.wait() if saver is not None else None

    def load(self, path, *, optimizers=None) -> tuple[int, dict]:
        """Read a checkpoint saved under any plan (a collective); returns (step, extra) as saved."""
        from meshc.runtime.checkpoint.save_load import load

        self.wait_for_save()
        out = load(self, path, optimizers=optimizers)
        self._store.pending.clear()  # a checkpoint holds every parameter and buffer (load is strict)
        self._pending_buffers.clear()
        return out

    def _saver(self):
        """The job's checkpoint saver (made at the first save): the async save in flight and its process group."""
        # torch.distributed.checkpoint takes ~1 s to import: only when used
        from meshc.runtime.checkpoint.async_save import Saver

        if "_checkpoint_saver" not in self.__dict__:
            self._checkpoint_saver = Saver(self.mesh)
        return self._checkpoint_saver

    def whole_tensors(self, local: dict[str, torch.Tensor], fqns: list[str]) -> dict[str, torch.Tensor]:
        """Whole tensors from this rank's shards (gathered over dp and tp); with pipeline stages, each is
        broadcast from the first pp rank that holds it, so that every rank returns all of them."""
        specs = {**self.program.params, **self.program.buffers}
        if self._pipe is None:
            return {f: full_tensor(local[f], specs[f], self.mesh) for f in fqns if f in local}
        out = {}
        for f in fqns:
            owner = self._layout.owner(f)
            whole = full_tensor(local[f], specs[f], self.mesh) if f in local else None
            if whole is None:
                whole = torch.empty(specs[f].shape, dtype=specs[f].dtype, device=self.mesh.device)
            src = self.mesh.group_ranks("pp")[owner]
            torch.distributed.broadcast(whole, src=src, group=self.mesh.group("pp"))
            out[f] = whole
        return out

    # ------------------------------------------------------------------------------ inspection
    @property
    def compiled(self) -> CompiledRank:
        """What the compiler made for this rank (first compilation): traced and transformed programs and,
        when the plan has them, the pipeline stages and schedule. What explain() and the cost model read."""
        return CompiledRank(next(iter(self._traced.values())), self.program, self._layout)

    def named_buffers(self) -> Iterator[tuple[str, torch.Tensor]]:
        """This rank's buffers (its stages' only, under a pipeline), by canonical FQN."""
        return iter(self._buffers.items())

    def compute_copies(self) -> dict[str, torch.Tensor]:
        """ZeRO-1/2's whole tp-local compute copies the graphs read, by FQN ({} under other plans)."""
        return dict(self._store.compute)

    def live_optimizers(self) -> list[torch.optim.Optimizer]:
        """The optimizers built by job.optimizer() that are still alive."""
        return [opt for ref in self._optimizers if (opt := ref()) is not None]

    @property
    def state_dict_keys(self) -> dict[str, str]:
        """model.state_dict() key -> canonical FQN of the tensor the job holds for it."""
        return dict(self._state_keys)

    def pp_owner(self, fqn: str) -> int:
        """The pp rank that speaks for a parameter or buffer (0 without pipeline stages)."""
        return self._layout.owner(fqn) if self._layout is not None else 0

    def pipeline_timing(self) -> tuple[float, float] | None:
        """(busy, elapsed) seconds of this rank in the last pipelined step (None without a pipeline)."""
        return (self._pipe.last_busy, self._pipe.last_elapsed) if self._pipe is not None else None

    def pipeline_actions(self) -> list[tuple[str, int, int, float]] | None:
        """(kind, stage, micro-batch, seconds) of each compute action this rank ran in the last pipelined step,
        in run order (None without a pipeline): the durations the schedule simulator can replay."""
        if self._pipe is None:
            return None
        return [(a.kind, a.stage, a.microbatch, seconds) for a, seconds in self._pipe.last_actions]

    @property
    def program(self) -> Program:
        """The transformed program of the first compilation (this rank)."""
        return next(iter(self._programs.values()))

    def explain(self) -> Report:
        """The plan, per-rank memory, every collective and why (of the program run last): print it."""
        live = self.live_optimizers()
        lines, resident = self._offload_lines(live)
        routing = self._routing.lines(self.mesh.coord("ep")) if getattr(self, "_routing", None) else []
        if routing:
            routing = ["rows received by this rank's experts in the last step:"] + routing
        compiled = [self.inductor.stats.line()] if self.inductor.stats.programs else []
        return explain(getattr(self, "_last", self.program), live, self._layout, offload=lines, resident=resident,
                       routing=routing, compiled=compiled)

    def _offload_lines(self, live: list) -> tuple[list[str], Any]:
        """explain()'s lines on Plan.offload, and what tells a resident state from an offloaded one."""
        from meshc.compiler.ir.show import human_bytes
        from meshc.runtime.zero.offload import of as offload_of

        plan = self.plan
        if plan.offload is None:
            return [], None
        if not self._streams_states():
            return [f"offload: '{plan.offload}' is the identity placement on a {self.mesh.device.type} device: host "
                    "memory is the device's memory, so the optimizer states stay where they are"], None
        offs = [o for o in map(offload_of, live) if o is not None]
        if not offs:
            return [f"offload: '{plan.offload}' streams the optimizer states once job.optimizer() has made one"], None
        held = self.held_bytes()
        where = f"a scratch file under {self.offload_dir()} (unlinked while open)" if plan.offload == "nvme" else \
            "host memory"
        what = "optimizer states and parameter shards" if plan.offload_params else "optimizer states"
        lines = [f"offload: {what}, {human_bytes(held['offloaded'])} on this rank, in {where}; streamed through a "
                 f"pool of {human_bytes(held['offload_pool'])} ({sum(len(o.buckets) for o in offs)} buckets) by "
                 "the optimizer step, next bucket read while one updates"]
        return lines, (lambda t: not any(o.is_offloaded(t) for o in offs))

    def report(self, path, *, hardware=None, trace=None, graph_ranks: int = 16) -> str:
        """Write the plan as one self-contained HTML page (compiler/report/html.py: mesh, sharding map, graphs,
        collectives, memory, pipeline schedule) to `path`, predicted on `hardware` (default: this device's
        profile); after a call or step, the bytes this rank holds (measured: gradients until zero_grad) are drawn
        beside the prediction; `trace`, a file job.trace wrote, adds its last step's measured timeline. The graph
        picker compiles up to `graph_ranks` representative ranks (1: this rank's graphs only). Returns the path."""
        measured = self.held_bytes() if hasattr(self, "_last") else None
        return str(write_report(path, self.compiled, self.explain(), hardware=hardware or detect_hardware(),
                                measured=measured, trace=trace, graph_ranks=graph_ranks))

    def trace(self, path, *, hardware=None):
        """A context manager that records the steps run inside it on every rank (runtime/monitor/trace.py: each step,
        pipeline action, send and receive, collective and wait) and, on exit, writes them as one Chrome-trace
        JSON to `path` from rank 0 (open it in ui.perfetto.dev or chrome://tracing). Every rank enters it. The
        file's otherData puts each rank's measured exposed communication per step beside the cost model's
        prediction for `hardware` (a profile; default: this machine's, detected)."""
        def predicted() -> dict:
            time = estimate_compiled(self.compiled, hardware or detect_hardware()).time
            # a pipeline's receives wait for the other stage too: the measured p2p time is the simulated bubble
            return {part: time[part] * 1e3 for part in ("tp", "ep", "cp", "pp", "dp", "bubble") if part in time}
        return tracing.record(self.mesh, path, predicted)

    def graph(self, rank: int | None = None, stage: int | None = None) -> torch.fx.GraphModule:
        """The transformed GraphModule that `rank` (default: this one) runs: the whole program, or with pipeline
        stages the graph of stage `stage` (on the pp rank the schedule places it: s % pp, or in a V for zbv and dualpipev;
        default: the rank's first stage)."""
        own = rank is None or rank == self.mesh.rank
        rank = self.mesh.rank if rank is None else rank
        if self._layout is None:
            if stage not in (None, 0):
                raise MeshcValueError(f"job.graph: expected stage 0 (this plan has one pipeline stage), got {stage}")
            return self.program.gm if own else passes_for_rank(next(iter(self._traced.values())), rank).gm
        layout = self._layout if own else PipelinePlan(passes_for_rank(self.compiled.traced, rank), self.plan)
        count = len(layout.all_stages)
        stage = layout.coord if stage is None else stage
        if not 0 <= stage < count:
            raise MeshcValueError(f"job.graph: expected a stage in [0, {count}), got {stage}")
        if layout.schedule.rank_of(stage) != layout.coord:
            raise MeshcValueError(f"job.graph: stage {stage} runs on pp rank {layout.schedule.rank_of(stage)}, rank {rank} "
                                  f"is pp rank {layout.coord}; ask for one of its stages "
                                  f"{list(layout.schedule.stages_of(layout.coord))} or another rank")
        return layout.all_stages[stage].gm

    def _program_for(self, args: tuple, kwargs: dict) -> Program:
        key = _signature(args, kwargs)
        if key not in self._programs:
            traced, program, _ = compile_program(self._model, args, kwargs, mesh=self.mesh, plan=self.plan,
                                                 fixed=self._placements)
            self._traced[key], self._programs[key] = traced, program
        return self._programs[key]

    def _step_program(self, args: tuple, kwargs: dict, targets: Any, loss_fn: Callable) -> Program:
        """model + loss_fn as one graph (keyed by the loss function object: pass the same one each step)."""
        key = ("step", loss_fn, _signature((*args, targets), kwargs))
        if key not in self._programs:
            wrapper = _WithLoss(self._model, loss_fn)
            traced, program, _ = compile_program(wrapper, (*args, targets), kwargs, mesh=self.mesh, plan=self.plan,
                                                 prefix="model.", fixed=self._placements)
            self._traced[key], self._programs[key] = traced, program
        return self._programs[key]


def _offloaded_optimizer(cls, params: list, kwargs: dict, job: Job) -> torch.optim.Optimizer:
    """`cls` over `params` whose element-wise states live where Plan.offload says (runtime/zero/offload.py)."""
    from meshc.runtime.zero.offload import StateOffload, offloaded_class, probe_states
    from meshc.runtime.zero.offload import of as offload_of

    states = probe_states(cls, kwargs, job.mesh.device)
    if not states and not job.plan.offload_params:
        warn(f"Plan.offload={job.plan.offload!r}: {cls.__name__}(**{kwargs}) keeps no state shaped like its "
             "parameters, so nothing is offloaded: it steps in memory (offload_params=True with zero=3 would "
             "offload the parameter shards)")
    opt = offloaded_class(cls)(params, **kwargs)
    names = {id(p): f for f, p in job.named_parameters()}
    plan = job.plan
    if plan.offload_params and any(offload_of(o) is not None for o in job.live_optimizers()):
        raise MeshcValueError("job.optimizer: expected one optimizer with Plan.offload_params (the parameters live in "
                              "its offload store), got a second one; put every parameter in one optimizer's groups")
    opt._meshc_offload = StateOffload(opt, states, names, kind=plan.offload, folder=job.offload_dir(),
                                      rank=job.mesh.rank, pool_mb=plan.offload_buffer_mb, params=plan.offload_params)
    return opt


def _meta_twin(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of `model` whose parameters and buffers are on the meta device (ties kept): what the job retraces
    for new input shapes and initializes from, without holding the user's full tensors."""
    memo: dict[int, Any] = {}
    for t in [*model.parameters(), *model.buffers()]:
        meta = torch.empty(t.shape, dtype=t.dtype, device="meta")
        memo[id(t)] = torch.nn.Parameter(meta, requires_grad=t.requires_grad) if isinstance(t, torch.nn.Parameter) else meta
    for module in model.modules():  # a tensor a forward stored on the module (a recurrent state, a cache), which
        for value in _attribute_tensors(vars(module)):  # autograd made: deepcopy refuses it; its value, detached
            if value.grad_fn is not None and id(value) not in memo:
                memo[id(value)] = value.detach().clone()
    return copy.deepcopy(model, memo)


def _attribute_tensors(value: Any, depth: int = 0) -> Iterator[torch.Tensor]:
    """The tensors in a module's attributes (its parameters and buffers too), inside lists, tuples and dicts."""
    if isinstance(value, torch.Tensor):
        yield value
    elif depth < 4 and isinstance(value, (list, tuple, dict)):
        for item in value.values() if isinstance(value, dict) else value:
            yield from _attribute_tensors(item, depth + 1)


class _WithLoss(torch.nn.Module):
    """`loss_fn(model(*inputs, **kwargs), targets)` as one module, so that the loss is traced with the model."""

    def __init__(self, model: torch.nn.Module, loss_fn: Callable):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        *inputs, targets = args
        return self.loss_fn(self.model(*inputs, **kwargs), targets)


def _share_rng_state(mesh) -> None:
    """Give every rank of a tp group the RNG state of its first rank: replicated computation that draws
    random numbers (dropout on replicated activations) must draw the same ones on every rank."""
    if mesh.size("tp") == 1 or mesh.backend == "fake":
        return
    group = mesh.group_ranks("tp")
    state = [torch.get_rng_state()]
    torch.distributed.broadcast_object_list(state, src=group[0], group=mesh.group("tp"))
    torch.set_rng_state(state[0])
    if mesh.device.type == "cuda":
        cuda = [torch.cuda.get_rng_state()]
        torch.distributed.broadcast_object_list(cuda, src=group[0], group=mesh.group("tp"))
        torch.cuda.set_rng_state(cuda[0])


def _grad_shape(store, spec, mesh) -> tuple:
    if spec.fqn in store.compute and spec.zero == 1:
        return tuple(spec.unflat_shape(mesh.sizes))
    return tuple(spec.local_shape(mesh.sizes))


def _grad_dtype(store, spec) -> torch.dtype:
    if spec.fqn in store.compute and spec.zero == 1:
        return store.compute[spec.fqn].dtype
    return spec.dtype


def _shapes(flat: list) -> list:
    return [tuple(x.shape) if isinstance(x, torch.Tensor) else None for x in flat]


def _signature(args: tuple, kwargs: dict) -> Any:
    """What a compiled graph is specialized on: the input structure, tensor shapes and dtypes, other values."""
    flat, spec = compat.tree_flatten((args, kwargs))
    leaves = tuple((tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else ("value", repr(x)) for x in flat)
    return (str(spec), leaves)


def _state_dict_keys(model: torch.nn.Module, program: Program) -> dict[str, str]:
    """model.state_dict() key -> canonical FQN of the tensor the job holds for it."""
    alias = {a: spec.fqn for spec in list(program.params.values()) + list(program.buffers.values())
             for a in (spec.fqn, *spec.aliases)}
    return {key: alias[key] for key in model.state_dict() if key in alias}
