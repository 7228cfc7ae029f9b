"""The torch.compile door: `torch.compile(model, backend="meshc")` or `backend=meshc.backend(mesh, plan)`.

TorchDynamo hands the backend one FX graph per region of the model (several when the code has graph
breaks), whose inputs are the model's own parameters and buffers (identified by their sources) and the
user's inputs. The backend lowers each to the same ATen IR as meshc.compile (torch.export of the graph
with the parameters lifted under their FQNs, on fake tensors of their global shapes) and runs the same
passes; the per-rank program runs on local tensors, and autograd derives backward from its collectives.

Parameters are sharded once per model, not once per graph: the first graph that uses a parameter
decides its placement, later graphs (other regions, recompilations for new input shapes) take it as
fixed, and the parameter is swapped in place for a ShardedParam holding only this rank's shard, so the
user's optimizer (built over model.parameters()) updates the shards. A graph break inside a sharded
block, or a plan the backend cannot honour (pipeline stages or ZeRO-1/2, which need the whole model in
one program), is an error that says to use meshc.compile.
"""
from __future__ import annotations

import contextlib
import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from meshc.compiler.ir.errors import MeshcInternalError, MeshcRuntimeError, MeshcValueError
from meshc.runtime import regions
from meshc.runtime.global_param import ShardedParam, local
from meshc.runtime.mesh import Mesh, last_mesh
from meshc.runtime.sharding import full_tensor, local_shard
from meshc.runtime.inductor import InductorPrograms
from meshc.runtime.zero.context import ZeroContext, ZeroStats

from meshc.compiler.ir import torch_compat as compat
from meshc import module_tree
from meshc.compiler.driver import run_passes
from meshc.compiler.report.explain import Report, explain
from meshc.compiler.ir.placement import Replicate
from meshc.compiler.ir.plan import Plan
from meshc.compiler.ir.program import Program
from meshc.compiler.trace.autograd_functions import apply_bodies
from meshc.compiler.trace.export import trace

_SOURCE = re.compile(r"_(modules|parameters|buffers)\['([^']+)'\]")
_BLOCK = re.compile(r"^(.*?\.\d+)\.")


@dataclass
class Compiled:
    """What the backend compiled last: each graph's per-rank program, and the report of the latest."""

    programs: list[Program] = field(default_factory=list)
    inductor_graphs: list[fx.GraphModule] = field(default_factory=list)  # what Inductor compiled (inductor=True)

    @property
    def graphs(self) -> list[fx.GraphModule]:
        return [p.gm for p in self.programs]

    def explain(self) -> Report:
        return explain(self.programs[-1])


_LAST = Compiled()


def last_compiled() -> Compiled:
    """The graphs (and explain()) of the most recent torch.compile(..., backend=meshc) compilation."""
    return _LAST


class MeshcBackend:
    """A configured backend: `torch.compile(model, backend=meshc.backend(mesh, plan))`."""

    def __init__(self, mesh: Mesh | None = None, plan: Plan | None = None):
        self._mesh, self.plan = mesh, plan or Plan()
        if self.plan.zero in (1, 2) or self.plan.microbatches > 1:
            raise MeshcValueError("meshc.backend: expected zero 0 or 3 and one micro-batch, got "
                                  f"zero={self.plan.zero}, microbatches={self.plan.microbatches}; ZeRO-1/2 and "
                                  "micro-batches need the whole training step: use meshc.compile(model, mesh, ...) "
                                  "instead")
        if self.plan.offload is not None:
            raise MeshcValueError(f"meshc.backend: expected offload=None, got offload={self.plan.offload!r}; offload "
                                  "streams the optimizer's states through the optimizer job.optimizer makes, and this "
                                  "door steps the user's own: use meshc.compile(model, mesh, ...) instead")
        self.inductor = InductorPrograms()  # what Inductor compiled for the regions (inductor=True)
        self.placements: dict[str, dict] = {}  # FQN -> placements, decided by the first graph using it
        self.block_graphs: dict[str, set[frozenset]] = {}
        self.swaps: dict[str, list] = {}  # FQN -> [spec, Parameter, shard leaf]: swapped after the first backward
        self._queued: set[str] = set()  # callbacks queued for the end of the current backward
        self._counting = None
        self._fqn_of: dict[int, tuple[torch.Tensor, str]] = {}  # id -> (parameter or buffer, FQN)
        self._lowered: dict[Any, tuple[Program, list, Any, list]] = {}

    @property
    def mesh(self) -> Mesh:
        if self._mesh is None:
            from meshc.runtime.mesh import mesh as make_mesh

            self._mesh = last_mesh() or make_mesh()
        if self._mesh.size("dpr") != self.plan.replicas:  # hybrid sharding's groups, created on every rank
            self._mesh = self._mesh.hybrid(self.plan.replicas)
        if self._mesh.size("pp") > 1:
            raise MeshcValueError("meshc.backend: pipeline stages need the whole model in one graph, and torch.compile "
                                  "hands over regions of it; use meshc.compile(model, mesh, ...) instead")
        return self._mesh

    def __call__(self, gm: fx.GraphModule, example_inputs: list) -> Any:
        if self.mesh.size("cp") > 1:  # TorchDynamo's regions see sequence shards whose global layout they cannot know
            raise MeshcValueError(f"meshc.backend: context parallelism (cp={self.mesh.size('cp')}) is not supported "
                                  "behind torch.compile yet; use meshc.compile(model, mesh, ...) with cp, or a mesh "
                                  "without cp here")
        _functions_as_ops(gm)
        runner = _Runner(self, gm)
        if not any(_symbolic(a) for a in example_inputs):  # lowered now, so that errors surface at compile time
            runner.program_for(example_inputs)
        # else Dynamo made a size dynamic (a recompilation for a new shape): lowered per concrete shape at run time
        return runner

    def roles(self, kinds: list[tuple[str, str]], example_inputs) -> list[tuple[str, str]]:
        """("param" | "buffer", FQN in the model) or ("input", name) for each of the graph's inputs, found from
        the tensors themselves: Dynamo runs one graph for every module of the same code (the blocks of a
        model, each block's parameters its inputs), so the same graph serves several FQNs."""
        roles = list(kinds)
        for i, ((kind, name), value) in enumerate(zip(roles, example_inputs)):
            if kind == "input":
                continue
            known = self._fqn_of.get(id(value))
            if known is None or known[0] is not value:
                self._fqn_of.update(module_tree.model_fqns(value))
                known = self._fqn_of.get(id(value))
            if known is None or known[0] is not value:
                raise MeshcValueError(f"meshc.backend: graph input {name!r} is a {kind} that no live module holds; "
                                      "compile the model itself (torch.compile(model, ...))")
            roles[i] = (kind, known[1])
        self._check_blocks(roles)
        return roles

    def lowered(self, gm: fx.GraphModule, roles, args: list) -> tuple[Program, list, Any, list]:
        """(program, slot of each graph input among its parameters and buffers, what runs it, the values of
        those slots no graph input fills), cached by the graph's code and its inputs' global shapes: after the
        parameters are swapped for their shards Dynamo retraces the same region, which then reuses the program
        (and Inductor's code) already built."""
        body = "\n".join(line for line in gm.code.splitlines() if not line.startswith("def forward("))  # no annotations
        key = (body, tuple(roles), tuple((tuple(a.shape), a.dtype, local(a).requires_grad)
                                            if isinstance(a, torch.Tensor) else repr(a) for a in args))
        if key not in self._lowered:
            program, constants = self.lower(gm, roles, args)
            index = {("param", f): i for i, f in enumerate(program.params)}
            index.update({("buffer", f): len(program.params) + i for i, f in enumerate(program.buffers)})
            slots = [index.get(r) for r in roles]
            filled = [None] * len(index)  # the constants the trace lifted: no graph input of Dynamo's holds them
            for fqn, value in constants.items():
                filled[index[("buffer", fqn)]] = value
            missing = [name for name, i in index.items() if i not in slots and filled[i] is None]
            if missing:
                raise MeshcInternalError(f"meshc.backend: expected every parameter and buffer of the lowered region "
                                         f"to come from a graph input or a traced constant, got none for {missing[:3]}")
            run = program.gm
            if self.plan.inductor:  # the region's per-rank program lowered as meshc.compile lowers it (AOTAutograd,
                # compile_fx: runtime/inductor.py), its collectives kept as calls, ZeRO-3's gathers recomputed
                self.inductor.aliases = self.mesh.aliases
                run = self.inductor.runner(program.gm, "region")
                _LAST.inductor_graphs.append(program.gm)
            self._lowered[key] = (program, slots, run, filled)
        return self._lowered[key]

    def lower(self, gm: fx.GraphModule, roles, args: list) -> tuple[Program, dict[str, torch.Tensor]]:
        """The per-rank program of one region for these input shapes, and this rank's values of the tensor
        constants the trace lifted (e.g. the index list of `x[..., [-2]]` becomes a constant tensor input);
        shards newly placed parameters."""
        wrapper, fake_inputs = _wrapper(gm, roles, args)
        fixed = dict(self.placements)
        # non-strict always: the graph is TorchDynamo's already, and a strict export would run TorchDynamo again
        # inside its own backend (measured: intermittent crashes in the frame that called the compiled model)
        plan = dataclasses.replace(self.plan, trace="non-strict")
        traced, tensors = trace(wrapper, tuple(fake_inputs), mesh=self.mesh, plan=plan, prefix="model.")
        _scopes_from_parameters(traced)
        program = run_passes(traced.replace(fixed_placements=fixed or None))
        self._shard(program, roles, args)
        _LAST.programs.append(program)
        constants = {fqn: local_shard(tensors[fqn], spec, self.mesh).to(self.mesh.device)
                     for fqn, spec in program.buffers.items() if spec.kind == "constant"}
        return program, constants

    def _shard(self, program: Program, roles, example_inputs) -> None:
        """Record the placements of parameters this graph places first; a sharded one is queued for its swap
        to a ShardedParam (apply_swaps, after the first backward)."""
        for (kind, fqn), value in zip(roles, example_inputs):
            if kind != "param" or fqn in self.placements:
                continue
            spec = program.params[fqn]
            self.placements[fqn] = dict(spec.placements)
            if isinstance(value, ShardedParam) or all(isinstance(p, Replicate) for p in spec.placements.values()):
                continue
            self.swaps[fqn] = [spec, None, None]  # the Parameter and its shard's leaf: made at the first run

    def apply_swaps(self) -> None:
        """Shard each newly placed parameter in place: the Parameter object (which the user's optimizer
        holds) takes this rank's shard and its gradient; its modules get a ShardedParam around it. Queued at
        the end of the first backward, so the optimizer's first step already sees shards."""
        ready = {fqn: entry for fqn, entry in self.swaps.items() if entry[1] is not None}
        if not ready:
            return
        owners = module_tree.owners([value for _, value, _ in ready.values()])  # one pass over the modules
        for fqn, (spec, value, shard) in ready.items():
            with torch.no_grad():
                value.data = shard.detach()
            value.grad = shard.grad
            sharded = ShardedParam(value, spec)  # what the model's code (and Dynamo) sees from now on
            self._fqn_of[id(sharded)] = (sharded, fqn)
            for module, name in owners[id(value)]:
                compat.replace_parameter(module, name, sharded)
            del self.swaps[fqn]

    def local(self, value: torch.Tensor, fqn: str) -> torch.Tensor:
        """What a region computes with: the shard. A parameter not swapped yet (the first run) computes with
        a fresh leaf holding its shard: autograd never sees the whole parameter, whose shape is about to
        change (a gradient accumulator made for the whole shape would refuse the shard's gradient)."""
        if fqn not in self.swaps or isinstance(value, ShardedParam):
            return local(value)
        entry = self.swaps[fqn]
        if entry[1] is None:
            spec = entry[0]
            shard = local_shard(value.detach(), spec, self.mesh).to(value.device).requires_grad_(value.requires_grad)
            if shard.requires_grad:
                shard.register_hook(self._queue_swaps)
            entry[1:] = [value, shard]
        return entry[2]

    def _queue_swaps(self, grad: torch.Tensor) -> torch.Tensor:
        self._after_backward(self.apply_swaps)
        return grad

    def queue_eager_check(self, grad: torch.Tensor) -> torch.Tensor:
        self._after_backward(self._check_eager_use)
        return grad

    def _after_backward(self, fn) -> None:
        """Run `fn` once when the current backward ends, however many hooks ask for it."""
        if fn.__name__ in self._queued:
            return
        self._queued.add(fn.__name__)

        def run():
            self._queued.discard(fn.__name__)
            fn()
        compat.queue_backward_callback(run)

    def _check_eager_use(self) -> None:
        """A parameter that got a gradient but is in no compiled graph ran outside them (TorchDynamo runs
        some frames eagerly, e.g. one whose loop holds a graph break): its gradient was never averaged over
        dp nor its shards used; refuse rather than train it wrong."""
        eager = sorted(fqn for t, fqn in self._fqn_of.values() if fqn not in self.placements
                       and not isinstance(t, ShardedParam) and t.grad is not None)
        if eager:
            raise MeshcRuntimeError(f"meshc.backend: parameters {eager[:4]}{' ...' if len(eager) > 4 else ''} were used "
                               "outside the compiled graphs (TorchDynamo ran that code eagerly: a graph break in "
                               "a loop skips its whole frame), so their gradients were not synchronised; move the "
                               "break out of the loop, or use meshc.compile(model, mesh, ...)")

    @contextlib.contextmanager
    def counting(self, mode):
        """Run the compiled regions' forward under the dispatch mode `mode` (a CommCensus): TorchDynamo runs a
        frame eagerly when a dispatch mode is active around the compiled module, so count inside it."""
        self._counting = mode
        try:
            yield mode
        finally:
            self._counting = None

    def state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The model's whole parameters and buffers, gathered from this rank's shards (a collective: every
        rank calls it), under the model's own state_dict keys: what model.load_state_dict takes."""
        self.apply_swaps()
        out = {}
        for key, value in model.state_dict(keep_vars=True).items():
            whole = full_tensor(value._local, value._spec, self.mesh) if isinstance(value, ShardedParam) else value
            out[key] = whole.detach().clone()
        return out

    def _check_blocks(self, roles) -> None:
        """Under tensor parallelism a block must sit in one graph: its regions would not match up."""
        if self.mesh.size("tp") == 1:
            return
        blocks: dict[str, set[str]] = {}
        for kind, fqn in roles:
            match = _BLOCK.match(fqn) if kind == "param" else None
            if match:
                blocks.setdefault(match.group(1), set()).add(fqn)
        for block, ids in blocks.items():
            seen = self.block_graphs.setdefault(block, set())
            seen.add(frozenset(ids))
            if len(seen) > 1:
                raise MeshcValueError(f"meshc.backend: the sharded block {block!r} is split over two graphs by a graph "
                                      "break inside it (a print, .item(), a Python branch on a tensor); remove the "
                                      "break or use meshc.compile(model, mesh, ...), which traces the whole model")


def backend(mesh: Mesh | None = None, plan: Plan | None = None) -> MeshcBackend:
    """A torch.compile backend running meshc's passes on `mesh` (default: the mesh meshc.mesh() built last in
    this process, else the whole world as dp) with `plan`."""
    return MeshcBackend(mesh, plan)


_DEFAULT: list[MeshcBackend] = []


def default_backend(gm: fx.GraphModule, example_inputs: list) -> Any:
    """`torch.compile(model, backend="meshc")`: the default mesh and plan (registered as an entry point)."""
    if not _DEFAULT:
        _DEFAULT.append(MeshcBackend())
    return _DEFAULT[0](gm, example_inputs)


class _Runner:
    """A compiled region: the per-rank program (one per input signature) on local tensors."""

    def __init__(self, backend: MeshcBackend, gm: fx.GraphModule):
        self.backend, self.gm = backend, gm
        self.kinds = [_role(n) for n in gm.graph.nodes if n.op == "placeholder"]
        self._roles: dict[tuple, list] = {}  # ids of the parameter and buffer inputs -> roles
        self.programs: dict[Any, tuple[Program, list, Any, list, list]] = {}
        self.checked: set[int] = set()
        self.eager_gathers: dict[int, bool] = {}  # program id -> whether ZeRO-3 gathers of it run as FX code

    def roles_for(self, args) -> list[tuple[str, str]]:
        ids = tuple(id(a) for (kind, _), a in zip(self.kinds, args) if kind != "input")
        if ids not in self._roles:
            self._roles[ids] = self.backend.roles(self.kinds, args)
        return self._roles[ids]

    def program_for(self, args) -> tuple[Program, list, Any, list, list]:
        roles = self.roles_for(args)
        key = (tuple(roles), tuple((tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else repr(a)
                                   for (kind, _), a in zip(roles, args) if kind == "input"))
        if key not in self.programs:  # a new input shape: lowered again, the parameters' shards reused
            self.programs[key] = (*self.backend.lowered(self.gm, roles, list(args)), roles)
        return self.programs[key]

    def zero_hooks(self, program: Program) -> bool:
        """ZeRO-3's gathers need the context's saved-tensor hooks where they run as FX code: every gather, or compiled,
        those only eager ops read (expert weights between compiled regions: runtime/regions.py)."""
        if self.backend.plan.zero != 3:
            return False
        if not self.backend.plan.inductor:
            return True
        if id(program) not in self.eager_gathers:
            self.eager_gathers[id(program)] = regions.gathers_run_eagerly(program.gm)
        return self.eager_gathers[id(program)]

    def __call__(self, *args):
        program, order, run, constants, roles = self.program_for(args)
        values: list[Any] = list(constants)
        inputs = []
        for slot, arg, (_, fqn) in zip(order, args, roles):
            if slot is None:
                inputs.append(arg)
            else:
                values[slot] = self.backend.local(arg, fqn)
        zero = ZeroContext({}, ZeroStats(), overlap=False) if self.zero_hooks(program) else contextlib.nullcontext()
        with zero, self.backend._counting or contextlib.nullcontext():
            outs = run(*values, *inputs)
        n = len(program.mutated_buffers)
        if id(program) not in self.checked and self.backend.mesh.world_size > 1:  # its first run: check its backward
            self.checked.add(id(program))
            for out in outs[n:]:
                if isinstance(out, torch.Tensor) and out.requires_grad:
                    out.register_hook(self.backend.queue_eager_check)
        return compat.tree_unflatten(list(outs[n:]), program.out_spec)


def _functions_as_ops(gm: fx.GraphModule) -> None:
    """TorchDynamo's graph holds each user torch.autograd.Function as an autograd_function_apply of its forward and
    backward bodies; an export of the graph would keep neither the backward nor the gradient through the forward
    (its body runs under no_grad). Each becomes a call of apply_bodies, a meshc_fn custom op with that backward,
    as meshc.compile's trace makes of the Function (compiler/trace/autograd_functions)."""
    changed = False
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is torch.ops.higher_order.autograd_function_apply:
            node.target = apply_bodies
            changed = True
    if changed:
        gm.recompile()


def _scopes_from_parameters(program: Program) -> None:
    """Give each op the module scope (nn_module_stack) of the parameters last used before or at it.

    Re-exporting a Dynamo graph records every op under the one module that runs it, while the passes group
    by block (ZeRO-3 buckets, remat, the block check): an op belongs to the module whose parameter it, or
    the latest op before it that takes a parameter, uses, which in execution order is where the model
    code was (a block's last residual add stays with that block)."""
    scope: dict = {}
    for node in program.gm.graph.nodes:
        if node.op != "call_function":
            continue
        fqns = [a.meta["meshc.fqn"] for a in node.all_input_nodes if a.meta.get("meshc.role") == "param"]
        if fqns:
            parts = fqns[0].split(".")[:-1]
            scope = {f"meshc_scope_{i}": (".".join(parts[: i + 1]), "torch.nn.Module") for i in range(len(parts))}
        node.meta["nn_module_stack"] = dict(scope)


def _symbolic(value: Any) -> bool:
    if isinstance(value, torch.SymInt):
        return True
    return isinstance(value, torch.Tensor) and any(isinstance(d, torch.SymInt) for d in value.shape)


def _role(node: fx.Node) -> tuple[str, str]:
    """("param" | "buffer", FQN) for a model parameter or buffer input, ("input", name) otherwise."""
    source = node.meta.get("grapharg")
    name = source.source.name if source is not None else ""
    parts = _SOURCE.findall(name)
    if parts and parts[-1][0] in ("parameters", "buffers"):
        return ("param" if parts[-1][0] == "parameters" else "buffer"), ".".join(p[1] for p in parts)
    return "input", node.name


def _wrapper(gm: fx.GraphModule, roles, example_inputs):
    """A module holding fake parameters and buffers of their global shapes under their FQNs, whose forward
    calls `gm` with them and the user inputs: torch.export of it lifts them like the model's own."""
    mode = compat.fake_tensor_mode()
    with mode:
        root = torch.nn.Module()
        fakes = []
        for (kind, fqn), value in zip(roles, example_inputs):
            if kind == "input":
                fakes.append(torch.empty(value.shape, dtype=value.dtype, device=value.device)
                             if isinstance(value, torch.Tensor) else value)
                continue
            owner, name = _owner(root, fqn)
            t = torch.empty(value.shape, dtype=value.dtype, device=value.device)
            if kind == "param":
                owner.register_parameter(name, torch.nn.Parameter(t, requires_grad=local(value).requires_grad))
            else:
                owner.register_buffer(name, t)
    gathered = [(kind, fqn) for kind, fqn in roles]

    class Region(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = root
            self.region = gm

        def forward(self, *inputs):
            it = iter(inputs)
            args = [next(it) if kind == "input" else _get(self.model, fqn) for kind, fqn in gathered]
            return self.region(*args)
    return Region(), fakes


def _owner(root: torch.nn.Module, fqn: str):
    *path, name = fqn.split(".")
    module = root
    for part in path:
        if not hasattr(module, part):
            module.add_module(part, torch.nn.Module())
        module = getattr(module, part)
    return module, name


def _get(root: torch.nn.Module, fqn: str):
    *path, name = fqn.split(".")
    module = root
    for part in path:
        module = getattr(module, part)
    return getattr(module, name)
