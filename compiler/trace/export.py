"""Tracing: nn.Module + example inputs -> Program, through torch.export (ATen training IR).

Strict export (TorchDynamo) is tried first; if it fails, non-strict export (which runs the model's
Python directly) follows. If both fail, a TraceError names the cause, the innermost module that was
running and the model's source line, not a torch stack dump.

Parameters and buffers arrive as placeholders carrying their FQNs. Tied weights (one tensor under
several FQNs, e.g. an embedding shared with the LM head) get one placeholder per alias from
torch.export; they are merged here into one placeholder under the canonical FQN (the name
`named_parameters()` reports), so that no later pass shards or reduces a tied weight twice.
"""
from __future__ import annotations

import logging
import time
import traceback
from typing import Any

import torch
import torch.fx as fx
from torch.export.graph_signature import InputKind, OutputKind

from meshc.compiler.trace.aliases import canonical_aliases
from meshc.compiler.trace.autograd_functions import functions_as_ops
from meshc.compiler.trace.constant_indices import slices_for_constant_indices
from meshc.compiler.trace.elementwise_functions import annotate_elementwise
from meshc.compiler.trace.grad_regions import inline_grad_regions
from meshc.compiler.ir.errors import MeshcValueError, TraceError, internal_folders, is_internal
from meshc.compiler.ir.mesh_spec import as_spec
from meshc.compiler.ir.program import ParamSpec, Program, replicated

log = logging.getLogger("meshc.trace")



def export(model: torch.nn.Module, args: tuple, kwargs: dict,
           mode: str = "auto") -> tuple[torch.export.ExportedProgram, str]:
    """torch.export; returns the program and the mode that worked.

    "auto" (the default) tries non-strict first, then strict: non-strict keeps what the model computes
    (user autograd.Functions become custom ops with their own backward, compiler/trace/autograd_functions.py;
    strict export drops their backward) and is several times faster on Hugging Face models.
    """
    if mode in ("auto", "non-strict"):
        tracker = _ModuleTracker(model)
        try:
            with tracker, functions_as_ops():
                return torch.export.export(model, args, kwargs, strict=False), "non-strict"
        except TraceError:
            raise
        except Exception as error:  # noqa: BLE001 - turned into a readable TraceError below, or strict is tried
            if mode == "non-strict":
                raise TraceError(_describe_failure(model, error, tracker.innermost()), error) from None
            log.info("non-strict export failed (%s: %s); trying strict", type(error).__name__, _first_line(error))
            first = (error, tracker.innermost())
    try:
        return torch.export.export(model, args, kwargs, strict=True), "strict"
    except Exception as strict_error:  # noqa: BLE001 - a readable TraceError
        error, where = (strict_error, None) if mode == "strict" else first
        raise TraceError(_describe_failure(model, error, where), error) from None


def trace(model: torch.nn.Module, args: tuple, kwargs: dict | None = None, *, mesh, plan,
          rank: int | None = None, prefix: str = "") -> tuple[Program, dict[str, torch.Tensor]]:
    """Trace `model(*args, **kwargs)` into a Program; also return the full tensors by canonical FQN.

    `mesh` is a MeshSpec (or a runtime Mesh: its topology is taken); `rank` defaults to the Mesh's own.
    `prefix` is stripped from every FQN (a wrapper module's attribute name for the model it wraps).
    """
    if rank is None:
        rank = getattr(mesh, "rank", None)
        if rank is None:
            raise MeshcValueError("trace: expected a rank to compile for with a MeshSpec, got none; pass rank=")
    device = getattr(mesh, "device", None)
    if as_spec(mesh).size("dpr") != plan.replicas:  # hybrid sharding's sub-axes (a runtime Mesh: its groups)
        mesh = mesh.hybrid(plan.replicas)
    mesh = as_spec(mesh)
    device = device or torch.device(mesh.device_type)
    kwargs = dict(kwargs or {})
    on_meta = _on_meta(model)
    # values never matter on meta: traced on fake tensors of the rank's device, or on meta where this machine lacks
    # that device (a simulated mesh)
    on_fakes = on_meta and _fakes_on(device)
    t0 = time.perf_counter()
    with _in_dtype(model, plan.param_dtype):
        if plan.param_dtype is not None:
            args, kwargs = _cast_floating((tuple(args), kwargs), plan.param_dtype)
        if on_fakes:
            with _as_fakes(model, device) as fake:
                ep, mode = export(model, *fake((tuple(args), kwargs)), plan.trace)
        else:
            if on_meta:  # inputs join the parameters on meta
                args, kwargs = _to_meta((tuple(args), kwargs))
            ep, mode = export(model, tuple(args), kwargs, plan.trace)
    if on_meta and not on_fakes:
        _devices_from_meta(ep.graph_module, device)
    program, tensors = _program_from_export(ep, model, mesh, plan, rank, mode, prefix)
    canonical_aliases(program.gm)  # torch.concatenate is cat
    regions = inline_grad_regions(program.gm)  # no_grad blocks: their ops seen, their results detached
    if regions:
        program.notes.append(f"trace: {regions} torch.no_grad()/enable_grad() region(s) inlined")
    annotate_elementwise(program.gm)  # user Functions the sharding rules may see through
    slices_for_constant_indices(program.gm, tensors)  # x[..., [-2], :] is a slice
    if on_meta:
        _refuse_meta_constants(model, tensors)
    program.notes.append(f"trace: torch.export ({mode}) in {time.perf_counter() - t0:.2f} s, "
                         f"{len(program.gm.graph.nodes)} nodes")
    return program, tensors


def _program_from_export(ep, model, mesh, plan, rank, mode, prefix) -> tuple[Program, dict[str, torch.Tensor]]:
    gm: fx.GraphModule = ep.graph_module
    nodes = {n.name: n for n in gm.graph.nodes if n.op == "placeholder"}
    canonical, aliases, by_name = _canonical_names(model, prefix)
    axes = tuple(mesh.sizes)
    params: dict[str, ParamSpec] = {}
    buffers: dict[str, ParamSpec] = {}
    tensors: dict[str, torch.Tensor] = {}
    placed: dict[str, fx.Node] = {}
    input_names: list[str] = []
    for spec in ep.graph_signature.input_specs:
        node = nodes[spec.arg.name]
        if spec.kind == InputKind.USER_INPUT:
            node.meta["meshc.role"] = "input"
            input_names.append(node.name)
            continue
        if spec.kind not in (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR):
            raise TraceError(f"trace: expected parameters, buffers, constants and tensor inputs, got a "
                             f"{spec.kind.name} input {spec.arg.name!r}; meshc cannot run such a graph")
        fqn = canonical.get(spec.target, spec.target)
        if fqn in placed:  # a tied alias: route its uses to the canonical placeholder
            node.replace_all_uses_with(placed[fqn])
            gm.graph.erase_node(node)
            continue
        placed[fqn] = node
        tensor = by_name[fqn] if fqn in by_name else ep.constants[spec.target]
        tensors[fqn] = tensor
        kind = {InputKind.PARAMETER: "param", InputKind.BUFFER: "buffer"}.get(spec.kind, "constant")
        node.meta["meshc.role"] = "param" if kind == "param" else "buffer"
        node.meta["meshc.fqn"] = fqn
        target = params if kind == "param" else buffers
        target[fqn] = ParamSpec(
            fqn=fqn, shape=tuple(tensor.shape), dtype=tensor.dtype, placements=replicated(axes), kind=kind,
            requires_grad=kind == "param" and tensor.requires_grad, aliases=aliases.get(fqn, ()),
        )
    mutated = []
    for spec in ep.graph_signature.output_specs:
        if spec.kind == OutputKind.BUFFER_MUTATION:
            mutated.append(canonical.get(spec.target, spec.target))
        elif spec.kind != OutputKind.USER_OUTPUT:
            raise TraceError(f"trace: expected the model to return tensors, got a {spec.kind.name} output "
                             f"{spec.arg.name!r}; if the model writes into an input in place, clone it first")
    gm.graph.lint()
    gm.recompile()
    program = Program(
        gm=gm, params=params, buffers=buffers, input_names=input_names,
        in_spec=ep.call_spec.in_spec, out_spec=ep.call_spec.out_spec, mutated_buffers=mutated,
        mesh=mesh, plan=plan, rank=rank, trace_mode=mode,
    )
    return program, tensors


class _in_dtype:
    """Mixed precision: trace with the parameters in the compute dtype (restored afterwards, bitwise), so
    that the graph computes in it; the masters keep the original dtype."""

    def __init__(self, model: torch.nn.Module, dtype):
        self.model, self.dtype, self.saved = model, dtype, []

    def __enter__(self):
        if self.dtype is not None:
            for p in self.model.parameters():
                if p.is_floating_point():
                    self.saved.append((p, p.data))
                    p.data = p.data.to(self.dtype)
        return self

    def __exit__(self, *exc):
        for p, data in self.saved:
            p.data = data
        return False


def _on_meta(model: torch.nn.Module) -> bool:
    """Was the model built on the meta device (any parameter or buffer without storage)?"""
    return any(t.device.type == "meta" for t in [*model.parameters(), *model.buffers()])


def _fakes_on(device: torch.device) -> bool:
    """Whether a meta-built model is traced on fake tensors of `device` (this machine has it), else on meta."""
    return device.type == "cpu" or (device.type == "cuda" and torch.cuda.is_available())


class _as_fakes:
    """A meta-built model traced on fake tensors of the rank's device: its parameters and buffers swapped for fakes
    (ties kept) and restored after; the context gives a function that fakes the inputs in the same mode. Model code
    that reads a tensor's device then takes the branch the rank will run (transformers' experts count tokens with
    histc on float on a CPU, on int elsewhere: traced on meta, a CPU rank ran histc on int, which CPUs lack)."""

    def __init__(self, model: torch.nn.Module, device: torch.device):
        from meshc.compiler.ir.torch_compat import fake_tensor_mode

        self.model, self.device, self.mode, self.saved = model, device, fake_tensor_mode(), []

    def _fake(self, t: torch.Tensor) -> torch.Tensor:
        with self.mode:
            return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=self.device)

    def __enter__(self):
        from meshc.compiler.ir.torch_compat import tree_map

        memo: dict[int, torch.Tensor] = {}
        for module in self.model.modules():
            own = [*module.named_parameters(recurse=False, remove_duplicate=False),
                   *module.named_buffers(recurse=False, remove_duplicate=False)]
            for name, t in own:
                if id(t) not in memo:
                    fake = self._fake(t)
                    memo[id(t)] = torch.nn.Parameter(fake, t.requires_grad) if isinstance(t, torch.nn.Parameter) else fake
                self.saved.append((module, name, t))
                setattr(module, name, memo[id(t)])  # a registered name: it stays a parameter (buffer) of the module
        return lambda tree: tree_map(lambda x: self._fake(x) if isinstance(x, torch.Tensor) else x, tree)

    def __exit__(self, *exc):
        for module, name, t in self.saved:
            setattr(module, name, t)
        return False


def _to_meta(tree):
    from meshc.compiler.ir.torch_compat import tree_map

    return tree_map(lambda x: x.to("meta") if isinstance(x, torch.Tensor) else x, tree)


def _devices_from_meta(gm: fx.GraphModule, device: torch.device) -> None:
    """A model traced on meta: every `device=meta` the graph recorded (arange, to, new tensors) becomes the
    device the rank runs on, so that the program creates its tensors where its parameters live."""
    meta = torch.device("meta")

    def fix(value):
        if isinstance(value, torch.device) and value == meta:
            return device
        if isinstance(value, (list, tuple)):
            return type(value)(fix(v) for v in value)
        return value
    for node in gm.graph.nodes:
        if node.op == "call_function":
            node.args = fix(node.args)
            node.kwargs = {k: fix(v) for k, v in node.kwargs.items()}
    gm.recompile()
    _refresh_vals(gm, device)


def _refresh_vals(gm: fx.GraphModule, device: torch.device) -> None:
    """Every node's "val" again (fake tensors), with the placeholders on `device` instead of meta."""
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    from meshc.compiler.ir.torch_compat import fake_tensor_mode

    mode = fake_tensor_mode()
    args = []
    with mode:
        for node in gm.graph.nodes:
            if node.op != "placeholder":
                continue
            val = node.meta.get("val")
            if isinstance(val, torch.Tensor):
                val = torch.empty_strided(val.shape, val.stride(), dtype=val.dtype, device=device)
            args.append(val)
    FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*args)


def _refuse_meta_constants(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """A tensor the forward creates on the model's device becomes a constant of the graph: built on meta it
    has no value, and no initializer can give it one."""
    own = {id(t) for t in [*model.parameters(), *model.buffers()]}
    from meshc.compiler.ir.torch_compat import is_fake

    lost = [fqn for fqn, t in tensors.items() if (t.device.type == "meta" or is_fake(t)) and id(t) not in own]
    if lost:
        raise TraceError(f"trace: expected every tensor the model's forward creates to have a value, got "
                         f"{', '.join(lost)} on the meta device (a tensor made in forward with the parameters' "
                         "device); register it as a buffer in the module's __init__, or build the model on cpu")


def _cast_floating(tree, dtype):
    from meshc.compiler.ir.torch_compat import tree_map

    return tree_map(lambda x: x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x, tree)


def _canonical_names(model: torch.nn.Module, prefix: str = ""):
    """FQN -> canonical FQN for every parameter and buffer alias; canonical -> other aliases; canonical -> tensor.

    Canonical names (and aliases) have `prefix` stripped; the keys are the names torch.export uses.
    """
    canonical: dict[str, str] = {}
    aliases: dict[str, tuple[str, ...]] = {}
    by_name: dict[str, torch.Tensor] = {}
    first_by_id: dict[int, str] = {}
    named = list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False))
    strip = lambda n: n[len(prefix):] if prefix and n.startswith(prefix) else n
    for name, tensor in named:
        first = first_by_id.setdefault(id(tensor), strip(name))
        canonical[name] = first
        by_name.setdefault(first, tensor)
        if first != strip(name):
            aliases[first] = aliases.get(first, ()) + (strip(name),)
    return canonical, aliases, by_name


class _ModuleTracker:
    """Remembers which submodule's forward was running when tracing failed (non-strict export only)."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.stack: list[str] = []
        self.failed_in: list[str] = []
        self.handles: list[Any] = []

    def __enter__(self):
        for name, module in self.model.named_modules():
            self.handles.append(module.register_forward_pre_hook(self._enter(name)))
            self.handles.append(module.register_forward_hook(self._leave()))
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
        if exc[0] is not None and not self.failed_in:
            self.failed_in = list(self.stack)
        return False

    def _enter(self, name):
        def hook(module, args):
            self.stack.append(name)
        return hook

    def _leave(self):
        def hook(module, args, output):
            if self.stack:
                self.stack.pop()
        return hook

    def innermost(self) -> tuple[str, str] | None:
        if not self.failed_in:
            return None
        name = self.failed_in[-1]
        return (name or "<root>", type(self.model.get_submodule(name)).__name__)


def _first_line(error: BaseException, limit: int = 300) -> str:
    lines = [ln.strip() for ln in str(error).strip().splitlines() if ln.strip()]
    text = lines[0] if lines else type(error).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _user_frame(error: BaseException) -> traceback.FrameSummary | None:
    """The innermost frame of the traceback that is model code (not torch's, not meshc's)."""
    frames, folders = traceback.extract_tb(error.__traceback__), internal_folders()
    for frame in reversed(frames):
        if frame.filename.startswith("<") or is_internal(frame.filename, folders):
            continue
        return frame
    return None


_LOOP_HINT = ("  What to do: this is a Python loop whose count depends on the data (a mixture of experts looping over "
              "the experts a batch routes to is the common case): compute every expert at once instead, as a grouped "
              "matmul over the stacked expert weights (torch.nn.functional.grouped_mm, or transformers' "
              "experts_implementation=\"grouped_mm\"), or every token through every expert by bmm; meshc shards "
              "either over ep and tp. A loop over every expert (`for expert in self.experts:`, each taking its "
              "rows with torch.where) traces too, and tp shards each expert's layers.")


def _describe_failure(model, error: BaseException, module: tuple[str, str] | None) -> str:
    where = []
    if module:
        where.append(f"in module '{module[0]}' ({module[1]})")
    frame = _user_frame(error)
    line = (frame.line or "").strip() if frame else ""
    if frame:
        where.append(f"at {frame.filename}:{frame.lineno} in {frame.name}" + (f": `{line}`" if line else ""))
    hint = ("  What to do: make that code traceable (data-dependent Python branches -> torch.where or "
            "torch.cond; .item()/.tolist() on tensors -> keep values as tensors), or move it out of forward.")
    if line.startswith("for ") and "DataDependent" in type(error).__name__:
        hint = _LOOP_HINT
    if "in output, which is not a known type" in str(error):  # torch.export's words for an unregistered class
        hint = ("  What to do: the model returns an object torch.export cannot flatten (transformers' KV cache, a "
                "DynamicCache, where the config says use_cache=True): build the model with use_cache=False (and "
                "that of its text_config, where it has one), or return tensors, tuples, lists, dicts or dataclasses "
                "registered as pytrees.")
    return (
        f"trace: torch.export could not trace {type(model).__name__}: {type(error).__name__}: "
        f"{_first_line(error)}\n  {' '.join(where) or 'outside any submodule'}\n{hint}"
    )
