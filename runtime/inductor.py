"""Per-rank programs lowered by Inductor (Program.decisions["inductor"] on).

    programs = InductorPrograms()
    run = programs.runner(program.gm)     # a callable with the graph's calling convention
    outs = run(*params, *buffers, *inputs)

Each graph is compiled on its first call, from that call's tensors (their shapes, dtypes and whether they
require gradients: AOTAutograd traces the joint forward-backward graph where some do, partitions it, and
Inductor compiles the forward at once and the backward at the first backward). The collectives in the graph
are functional collectives (`_c10d_functional.*` + `wait_tensor`), which Inductor keeps as calls in the
generated code and schedules for overlap (OVERLAP below); meshc's autograd-aware collectives
(runtime/ops/collectives.py) are traced through, their backward's collectives landing in the compiled backward
graph.

A call whose tensors differ from the compiled ones in shape, strides, dtype, requires_grad or grad mode compiles again
(generated code is specialized to what it was compiled for); each compilation is counted with its seconds.
Inductor's FX graph cache (TORCHINDUCTOR_CACHE_DIR) serves every graph: a graph compiled before, by another rank or
in another run, is not generated and built again (AOTAutograd still traces and partitions it, so each is counted
and told to on_graph). It needs the example inputs as fake tensors with a ShapeEnv (compat.inductor_compile), as
TorchDynamo gives them; with real ones Inductor bypassed it, so that before 2026-12-06 nothing was ever reused.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.fx as fx

from meshc.compiler.ir import fx_ops, torch_compat as compat
from meshc.compiler.ir.errors import MeshcInternalError, MeshcRuntimeError
from meshc.runtime.ops.zero import no_context, zero_reduce, zero_reduce_into
from meshc.runtime import regions
from meshc.runtime.compile_once import compiling_once, graph_key, signature
from meshc.runtime.compiled_split import DEFERRED, DeferredWeights, split_backward


# Communication overlap by scheduling: Inductor's passes move each collective up to where its inputs are ready
# (raise_comms), each wait down to its first consumer (sink_waits) and independent compute between the two
# (reorder_compute_for_overlap). Measured on 2 gloo ranks, benchmarks/compiled_ranks.py, 2026-12-04: compiled dp step
# 164.1 -> 151.4 ms, tp 194.6 -> 184.6 ms (docs/benchmarks.md#compiled-per-rank-programs).
OVERLAP = {"reorder_for_compute_comm_overlap": True,
           "reorder_for_compute_comm_overlap_passes": ["sink_waits", "raise_comms", "reorder_compute_for_overlap"]}
# A graph whose parameter gathers are recomputed in backward (ZeRO-3, compat.mark_recompute): raise_comms would issue
# every bucket's gather at the top of the forward (their inputs, the shards, are ready there), holding the whole
# model gathered at once, which ZeRO-3 exists to avoid (seen in the generated code: four buckets' gathers alive
# before the first matmul). Inductor's reorder_communication_preserving_peak_memory moves a collective up only while
# the estimated peak does not grow: one bucket's gather issued while the previous bucket computes, in forward and in
# backward (tests/models/test_inductor_parity.py counts the gathered buffers alive in the generated code).
OVERLAP_MEMORY_BOUND = {"reorder_for_compute_comm_overlap": True,
                        "reorder_for_compute_comm_overlap_passes": ["sink_waits",
                                                                    "reorder_communication_preserving_peak_memory"]}


@dataclass
class CompileStats:
    """What Inductor compiled for a job: graphs by kind and the seconds spent in Inductor on them."""

    forward: int = 0
    backward: int = 0
    seconds: float = 0.0
    programs: int = 0  # graph + input signature pairs compiled (each gives one forward, and one backward once run)
    cache_hits: int = 0  # graphs Inductor's FX graph cache served (compiled before: by another rank, or another run)
    collectives: list = field(default_factory=list)  # per graph compiled: "forward"/"backward", its collectives in order
    code: list = field(default_factory=list)  # per graph compiled: "forward"/"backward", the code Inductor generated
    saved_gathered: list = field(default_factory=list)  # per forward graph: {group: gathered values saved for backward}
    forward_out_bytes: list = field(default_factory=list)  # per forward graph: bytes it returns (outputs + saved)
    regions: int = 0  # compiled regions of programs cut around ops that run eagerly (regions.py)
    eager: list = field(default_factory=list)  # those ops, by node name

    def line(self) -> str:
        cut = f"; {self.regions} region(s) around {len(self.eager)} op(s) run as FX code ({', '.join(self.eager[:4])}" \
              f"{', ...' if len(self.eager) > 4 else ''})" if self.eager else ""
        return (f"{self.programs} program(s) compiled: {self.forward} forward and {self.backward} backward graph(s), "
                f"{self.seconds:.1f} s in Inductor, {self.cache_hits} from its cache{cut}")


@dataclass
class InductorPrograms:
    stats: CompileStats = field(default_factory=CompileStats)
    _compiled: dict = field(default_factory=dict)
    _prepared: dict = field(default_factory=dict)  # id(program graph) -> (the graph compiled, master FQNs it takes)
    # id(program graph) -> (the graph, kept so that its id is not reused; its regions' top module or None)
    _cuts: dict = field(default_factory=dict)
    _runners: dict = field(default_factory=dict)  # (id(program graph), weights) -> its runner (one per micro-batch)
    aliases: dict = field(default_factory=dict)  # group name -> the axis's alias on every rank (Mesh.aliases)

    def runner(self, gm: fx.GraphModule, name: str = "program",
               masters: Callable[[str], torch.Tensor] | None = None, weights: int | None = None) -> Callable[..., Any]:
        """`gm`'s calling convention, each distinct input signature compiled by Inductor on first use. A ZeRO-2
        graph also receives its buckets' master shards, `masters(fqn)`, ahead of its own inputs (with_masters).
        `weights`: a zero-bubble stage, whose first `weights` inputs are parameters and buffers: its backward is
        compiled as two halves (runtime/compiled_split.py), the gradients of its other inputs (activations) in
        the first. A program with ops no traced graph holds runs as regions (regions.py), each compiled alone."""
        key = (id(gm), weights)
        if key not in self._runners:  # a pipeline asks again for every micro-batch; gm is kept alive by _cuts
            names = None if weights is None else {p.name for p in _placeholders(gm)[weights:]}
            self._runners[key] = self._runner(gm, name, masters, names)
        return self._runners[key]

    def _runner(self, gm: fx.GraphModule, name: str, masters: Callable[[str], torch.Tensor] | None,
                activation_names: set | None) -> Callable[..., Any]:
        if id(gm) not in self._cuts:
            top = regions.cut(gm)
            self._cuts[id(gm)] = (gm, top)
            # a region's activations: its inputs computed from the program's (a weight's view is not one: its
            # gradient is the weight half's)
            inner = None if activation_names is None else _dependents(gm, activation_names)
            for k, region in enumerate(top.regions if top is not None else ()):
                run = self._runner(getattr(top, region), f"{name}, region {k}", masters, inner)
                delattr(top, region)
                setattr(top, region, run)  # the top module's code calls self.<region>(...)
            if top is not None:
                self.stats.regions += len(top.regions)
                self.stats.eager += top.eager
        if self._cuts[id(gm)][1] is not None:
            return self._cuts[id(gm)][1]
        if id(gm) not in self._prepared:
            self._prepared[id(gm)] = with_masters(gm)
        graph, fqns = self._prepared[id(gm)]
        if fqns and masters is None:
            raise MeshcInternalError(f"inductor: expected the master shards of the {name}'s ZeRO-2 buckets, got none")
        activations = None if activation_names is None else frozenset(
            len(fqns) + i for i, p in enumerate(_placeholders(gm)) if p.name in activation_names)

        def run(*args: Any) -> Any:
            if fqns:
                args = (*(masters(f) for f in fqns), *args)
            key = (id(graph), torch.is_grad_enabled(), activations, tuple(signature(a) for a in args))
            entry = self._compiled.get(key)
            if entry is None:
                deferred = None if activations is None else DeferredWeights(activations)
                entry = self._compiled[key] = (self._compile(graph, list(args), name, deferred), deferred)
            fn, deferred = entry
            outs = fn(*args)
            node = compat.compiled_function_node(outs) if deferred is not None else None
            if node is not None:  # backward_input finds the split here (compiled_split.py)
                node.metadata[DEFERRED] = deferred
            return outs
        return run

    def _compile(self, gm: fx.GraphModule, args: list, name: str,
                 deferred: DeferredWeights | None = None) -> Callable[..., Any]:
        named = {alias: name for name, alias in self.aliases.items()}  # what the stats say: the groups' own names

        def on_graph(graph: fx.GraphModule, is_backward: bool, seconds: float, code: str) -> None:
            if is_backward:
                self.stats.backward += 1
            else:
                self.stats.forward += 1
            self.stats.seconds += seconds
            kind = "backward" if is_backward else "forward"
            self.stats.collectives.append((kind, [_renamed(c, named) for c in _collectives(graph)]))
            self.stats.code.append((kind, _renamed(code, named)))
            if not is_backward:
                self.stats.saved_gathered.append({named.get(g, g): n for g, n in saved_gathered(graph).items()})
                self.stats.forward_out_bytes.append(sum(fx_ops.val_nbytes(a)
                                                        for a in graph.graph.output_node().all_input_nodes))
        try:
            # compile_fx may rewrite the graph it is handed; the program's own graph stays as the passes left it
            bound = any(compat.recomputed(node) for node in gm.graph.nodes)
            graph = views_as_reshapes(rename_groups(copy.deepcopy(gm), self.aliases))
            options = OVERLAP_MEMORY_BOUND if bound else OVERLAP
            with compiling_once(graph_key(graph, args, (options, deferred is not None, torch.is_grad_enabled()))), \
                    no_context():  # the step's ZeRO context serves gathers run as FX code, not the traced ones
                hits = compat.inductor_cache_hits()
                fn = compat.inductor_compile(graph, args, on_graph=on_graph, config_patches=options,
                                             split_backward=split_backward(deferred) if deferred is not None else None)
                self.stats.cache_hits += compat.inductor_cache_hits() - hits
        except Exception as error:  # noqa: BLE001 - re-raised with what to do; the cause chained
            raise MeshcRuntimeError(f"inductor: expected Inductor to compile the {name} of this rank, got "
                                    f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}; "
                                    "run it as FX code with Plan(inductor=False) and report the failure") from error
        self.stats.programs += 1
        return fn


def views_as_reshapes(gm: fx.GraphModule) -> fx.GraphModule:
    """`gm` (in place) with each aten.view that nothing writes through, nor into its base, made a reshape: the same
    view where the strides allow one, a copy where they do not. The trace's strides need not hold in Inductor's
    trace: its decomposition of a cat whose other inputs are empty returns a clone of the one left, in that one's
    layout (torch 2.13), where the trace's cat was contiguous, and a view of it then fails to compile (a rotary over
    the whole head, its pass-through part empty: GPT-NeoX-Japanese; plain torch.compile fails on such code too)."""
    changed = False
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is not torch.ops.aten.view.default or \
                not isinstance(node.args[0], fx.Node):
            continue
        base = node.args[0]
        while fx_ops.is_alias(base) and base.args and isinstance(base.args[0], fx.Node):
            base = base.args[0]
        if fx_ops.written_in_place(base) is None and fx_ops.written_in_place(node) is None:
            node.target = torch.ops.aten.reshape.default
            changed = True
    if changed:
        gm.recompile()
    return gm


def with_masters(gm: fx.GraphModule) -> tuple[fx.GraphModule, list[str]]:
    """ZeRO-2's buckets as a graph: a copy of `gm` whose zero_reduce nodes call zero_reduce_into with their master
    shards, taken as new leading placeholders (one per FQN), so that the compiled backward returns each bucket's
    reduce-scattered gradients as the masters' own (autograd accumulates them into .grad) instead of writing them
    behind the graph; and the FQNs in placeholder order. A graph without zero_reduce comes back as it is."""
    if not any(n.op == "call_function" and n.target is zero_reduce for n in gm.graph.nodes):
        return gm, []
    gm = copy.deepcopy(gm)
    graph = gm.graph
    reduces = [n for n in graph.nodes if n.op == "call_function" and n.target is zero_reduce]
    fqns = [f for n in reduces for f in n.kwargs["fqns"]]
    slots = {}
    with graph.inserting_before(next(iter(graph.nodes))):
        for i, fqn in enumerate(fqns):
            slots[fqn] = graph.placeholder(f"master_{i}")
    for node in reduces:
        node.target = zero_reduce_into
        node.args = (*node.args, *(slots[f] for f in node.kwargs["fqns"]))
    gm.recompile()
    return gm, fqns


def rename_groups(gm: fx.GraphModule, aliases: dict[str, str]) -> fx.GraphModule:
    """`gm` with every process-group name its calls take replaced by the axis's alias (Mesh.aliases), in place."""
    if not aliases:
        return gm
    swap = (lambda a: aliases.get(a, a) if isinstance(a, str) else a)
    for node in gm.graph.nodes:
        if node.op == "call_function":
            node.args = fx.node.map_aggregate(node.args, swap)
            node.kwargs = fx.node.map_aggregate(node.kwargs, swap)
    gm.recompile()
    return gm


def _renamed(text: str, named: dict[str, str]) -> str:
    """Compiled code or a collective's line with each alias back to its group's own name."""
    for alias, name in named.items():
        text = text.replace(f"'{alias}'", f"'{name}'").replace(f"({alias})", f"({name})")
    return text


def _collectives(graph: fx.GraphModule) -> list[str]:
    """The functional collectives a graph handed to Inductor calls, in order, as "op(group)"."""
    out = []
    for node in graph.graph.nodes:
        target = node.target
        if node.op == "call_function" and getattr(target, "namespace", None) == "_c10d_functional" \
                and compat.op_name(target) != "wait_tensor":
            group = next((a for a in node.args if isinstance(a, str) and a not in ("sum", "avg", "max", "min")), "")
            out.append(f"{compat.op_name(target)}({group})")
    return out


# ops that hand on a gathered parameter's values unchanged (a view, a copy, a cast, a piece of the bucket)
_CARRY = {"wait_tensor", "view", "_unsafe_view", "reshape", "slice", "clone", "permute", "t", "transpose", "_to_copy",
          "split", "split_with_sizes", "as_strided", "select", "unsqueeze", "squeeze", "expand", "alias", "getitem"}


def saved_gathered(graph: fx.GraphModule) -> dict[str, int]:
    """Per process group, how many of a partitioned forward graph's outputs hold the result of an all-gather over
    it (or a view or copy of one): values the compiled forward keeps for backward. Over ZeRO-3's group these are
    gathered parameters, which backward gathers again instead (none, unless a bucket is kept on purpose:
    Plan.zero_keep_last); over sequence parallelism's, gathered activations, saved as eager autograd saves them."""
    group_of: dict = {}
    for node in graph.graph.nodes:
        if node.op != "call_function":
            continue
        name = compat.op_name(node.target) if compat.is_op_overload(node.target) else \
            getattr(node.target, "__name__", "")
        if name == "all_gather_into_tensor":
            group_of[node] = node.args[2]
        elif name in _CARRY:
            source = next((a for a in node.all_input_nodes if a in group_of), None)
            if source is not None:
                group_of[node] = group_of[source]
    out: dict[str, int] = {}
    for a in graph.graph.output_node().all_input_nodes:
        if a in group_of:
            out[group_of[a]] = out.get(group_of[a], 0) + 1
    return out


def _placeholders(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "placeholder"]


def _dependents(gm: fx.GraphModule, names: set) -> set:
    """Names of the nodes of `gm` computed from its placeholders named in `names` (those included)."""
    out = set(names)
    for n in gm.graph.nodes:
        if any(a.name in out for a in n.all_input_nodes):
            out.add(n.name)
    return out
