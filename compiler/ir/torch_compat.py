"""The one place where meshc touches private torch APIs.

Every private import lives here, each with the public alternative it stands in for, so that a torch
upgrade is checked in one file. Nothing here has behaviour of its own beyond thin adaptation.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.utils._pytree as _pytree  # no public pytree module in torch 2.13
from torch.distributed import distributed_c10d as _c10d

tree_flatten = _pytree.tree_flatten
tree_unflatten = _pytree.tree_unflatten
tree_map = _pytree.tree_map
TreeSpec = _pytree.TreeSpec

# torch's functional collectives: the ops the graphs call (DESIGN.md §4, "Collectives in graphs").
c10d_functional = torch.ops._c10d_functional


def all_reduce_sum(t: torch.Tensor, group_name: str) -> torch.Tensor:
    """Out-of-place sum all-reduce over the named group (gloo has no "avg"), waited."""
    return c10d_functional.wait_tensor(c10d_functional.all_reduce(t, "sum", group_name))


def all_reduce(t: torch.Tensor, op: str, group_name: str) -> torch.Tensor:
    """Out-of-place all-reduce with `op` ("sum", "max", "min"), waited."""
    return c10d_functional.wait_tensor(c10d_functional.all_reduce(t.contiguous(), op, group_name))


def all_gather(t: torch.Tensor, group_size: int, group_name: str) -> torch.Tensor:
    """Concatenate every rank's `t` along dim 0, waited."""
    out = c10d_functional.all_gather_into_tensor(t.contiguous(), group_size, group_name)
    return c10d_functional.wait_tensor(out)


def all_gather_start(t: torch.Tensor, group_size: int, group_name: str) -> torch.Tensor:
    """Issue an all-gather along dim 0 and return its output before it is complete: call wait() first."""
    return c10d_functional.all_gather_into_tensor(t.contiguous(), group_size, group_name)


def wait(t: torch.Tensor) -> torch.Tensor:
    """Wait for the collective that produces `t` (from all_gather_start)."""
    return c10d_functional.wait_tensor(t)


def reduce_scatter_sum(t: torch.Tensor, group_size: int, group_name: str) -> torch.Tensor:
    """Sum over the group, each rank keeping its dim-0 slice, waited."""
    out = c10d_functional.reduce_scatter_tensor(t.contiguous(), "sum", group_size, group_name)
    return c10d_functional.wait_tensor(out)


def reduce_scatter_start(t: torch.Tensor, group_size: int, group_name: str) -> torch.Tensor:
    """Issue a sum reduce-scatter along dim 0 and return its output before it is complete (wait() it)."""
    return c10d_functional.reduce_scatter_tensor(t.contiguous(), "sum", group_size, group_name)


def all_to_all_single(t: torch.Tensor, output_splits: list[int], input_splits: list[int],
                      group_name: str) -> torch.Tensor:
    """Rows of `t` (dim 0, `input_splits[i]` of them to rank i of the group) exchanged; waited."""
    out = c10d_functional.all_to_all_single(t.contiguous(), output_splits, input_splits, group_name)
    return c10d_functional.wait_tensor(out)


# torch 2.13's functional all-gather on gloo (all_gather_into_tensor, through ProcessGroupGloo's coalesced all-gather)
# corrupts the heap when several are in flight at once: two gloo ranks issuing nine gathers before their waits, as a
# compiled ZeRO-3 backward does, abort with "malloc(): unaligned tcache chunk detected" within about 200 rounds
# (tests/runtime/test_gloo_gather.py; the same rounds with all_gather_into_tensor_out, c10d's async
# all_gather_single, functional all_reduce, reduce_scatter or all_to_all_single in flight: none in 4000 rounds).
# On CPU tensors the op therefore runs as c10d's all_gather_single, async, its work registered for wait_tensor.
_GATHER_LIBS: list = []


def _gather_on_cpu(t: torch.Tensor, group_size: int, group_name) -> torch.Tensor:
    group = group_name if isinstance(group_name, dist.ProcessGroup) else _c10d._resolve_process_group(group_name)
    out = t.new_empty((t.shape[0] * group_size, *t.shape[1:]))
    work = dist.all_gather_single(out, t.contiguous(), group=group, async_op=True)
    torch._C._distributed_c10d._register_work(out, work)  # what wait_tensor(out) waits for
    return out


def _gathers_on_cpu(ts: list[torch.Tensor], group_size: int, group_name) -> list[torch.Tensor]:
    return [_gather_on_cpu(t, group_size, group_name) for t in ts]


def safe_cpu_all_gather() -> None:
    """Route the functional all-gathers of CPU tensors (gloo) through c10d's all_gather_single (above); once per
    process. Public alternative: none (the kernel is torch's own; torch.library replaces it for the CPU key only)."""
    if _GATHER_LIBS:
        return
    lib = torch.library.Library("_c10d_functional", "IMPL")
    lib.impl("all_gather_into_tensor", _gather_on_cpu, "CPU")
    lib.impl("all_gather_into_tensor_coalesced", _gathers_on_cpu, "CPU")
    _GATHER_LIBS.append(lib)  # the registration lasts as long as the Library object


def is_view(t: torch.Tensor) -> bool:
    """Whether `t` is a view of another tensor (Tensor._base; no public spelling)."""
    return t._base is not None


def in_backward() -> bool:
    """Whether autograd is running a backward now (an activation-checkpointing recompute runs inside one);
    torch has no public spelling of it."""
    return torch._C._current_autograd_node() is not None


def mark_recompute(node, policy: str = "must", region: int | None = None) -> None:
    """Tell AOTAutograd's partitioner what to do with `node`'s value in backward, as a selective-checkpoint policy
    does: "must" recompute it (never save it), "prefer" recompute it, "save" it. FX tracing copies a node's
    "recompute" and "ac_graph_id" meta onto every op traced from it (torch.fx.proxy's copied meta fields), and the
    min-cut partitioner neither saves a recomputed op's output nor bans recomputing it, collectives included.
    `region` numbers a checkpointed block (ac_graph_id): a value one region produces and a later one reads is
    saved at the boundary. Read back by `recomputed`."""
    from torch.utils.checkpoint import CheckpointPolicy

    node.meta["recompute"] = {"must": CheckpointPolicy.MUST_RECOMPUTE, "prefer": CheckpointPolicy.PREFER_RECOMPUTE,
                              "save": CheckpointPolicy.MUST_SAVE}[policy]
    if region is not None:
        node.meta["ac_graph_id"] = region


def recomputed(node) -> bool:
    """Was `node` marked by mark_recompute to be recomputed ("must" or "prefer")?"""
    from torch.utils.checkpoint import CheckpointPolicy

    return node.meta.get("recompute") in (CheckpointPolicy.MUST_RECOMPUTE, CheckpointPolicy.PREFER_RECOMPUTE)


def queue_backward_callback(fn) -> None:
    """Run `fn` once the current backward pass has finished (what DDP and FSDP use to wait for their
    last gradient reductions); torch has no public spelling of it."""
    from torch.autograd import Variable

    Variable._execution_engine.queue_callback(fn)


def resolve_process_group(group_name: str) -> dist.ProcessGroup:
    """The ProcessGroup registered under `group_name` (torch has no public lookup by name)."""
    return _c10d._resolve_process_group(group_name)


def register_group_alias(alias: str, group: dist.ProcessGroup) -> None:
    """Register `group` under a second name, which functional collectives then resolve to it (until the world is
    destroyed). Public alternative: none (torch names each group itself, by creation order)."""
    torch._C._distributed_c10d._register_process_group(alias, group)


def inductor_cache_hits() -> int:
    """How many graphs this process's Inductor has loaded from its FX graph cache so far. Public alternative: none
    (torch counts them in its internal counters)."""
    from torch._dynamo.utils import counters

    return counters["inductor"]["fxgraph_cache_hit"]


def inductor_cache_dir() -> str:
    """Inductor's cache folder (TORCHINDUCTOR_CACHE_DIR, else its default). Public alternative: none."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return cache_dir()


def preload_inductor() -> None:
    """Do once what each process's first Inductor compile does before compiling: import Inductor's compiler
    (~1 s), pick the CPU's vector instruction set (a probe subprocess each process, ~1 s; a test build of the
    first in a cache folder, ~8 s) and hash torch's own source files, part of every FX graph cache key (~2,900
    files read, 1.6-2 s). A forkserver that calls this hands all three to every process it forks (the tests'
    rank forkserver: tests/rank_warmup.py). Public alternative: none."""
    from torch._inductor import compile_fx  # noqa: F401
    from torch._inductor.codecache import torch_key
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    pick_vec_isa()
    torch_key()


def dcp_storage_info(relative_path: str, offset: int, length: int):
    """DCP's record of where one chunk lies in a data file (torch.distributed.checkpoint.filesystem's
    _StorageInfo; no public name), rebuilt from meshc's JSON metadata instead of DCP's pickle."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    return _StorageInfo(relative_path, offset, length)


def fake_store():
    """torch's FakeStore for the in-process fake backend ("fake"), used for simulated compiles."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()


def make_wrapper_subclass(cls, shape, **kwargs):
    """torch.Tensor._make_wrapper_subclass: a tensor subclass instance of `shape` that owns no storage."""
    return torch.Tensor._make_wrapper_subclass(cls, shape, **kwargs)


disabled_torch_function = torch._C._disabled_torch_function_impl  # subclasses that live at dispatch only


def is_fake(t) -> bool:
    """Is `t` a FakeTensor (a value of compile-time shape propagation)?"""
    from torch._subclasses.fake_tensor import is_fake as _is_fake

    return _is_fake(t)


def fake_tensor_mode(like=None):
    """A FakeTensorMode that also fakes tensors created from real ones (used to trace without memory). With
    `like` (a traced GraphModule), it shares the ShapeEnv of that graph's values: an op whose result depends on
    values (`.item()`, `.tolist()`: tokens routed per expert) gives a fresh symbol bound to the trace's, where a
    mode without one raises, and one with a ShapeEnv of its own would name its symbols as the trace did (u0 again).
    Public alternative: none (torch.export keeps its ShapeEnv on the fake values it leaves in node.meta)."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    env = None
    for node in like.graph.nodes if like is not None else ():
        val = node.meta.get("val")
        if isinstance(val, FakeTensor) and val.fake_mode.shape_env is not None:
            env = val.fake_mode.shape_env
            break
    return FakeTensorMode(allow_non_fake_inputs=True, shape_env=env)


def size_bound(size, like=None) -> int | None:
    """A size as an int: itself where static, else the largest value its trace allows (rows picked by nonzero: at
    most the rows it picked from), None where unbounded. `size` is an int, a SymInt, or a sympy expression of the
    trace whose fake tensor `like` is (its ShapeEnv holds the ranges). Public alternative: none."""
    if isinstance(size, torch.SymInt):
        size = size.node.expr, size.node.shape_env
    else:
        try:
            return int(size)
        except TypeError:  # a symbol
            size = size, getattr(getattr(like, "fake_mode", None), "shape_env", None)
    upper = _upper(*size)
    return int(upper) if upper is not None else None


def number_bound(x):
    """A count computed from sizes (FLOPs, bytes) as a plain number: itself, or where it depends on a size known
    only at run time (a SymInt or SymFloat), the largest value its trace allows (0 where unbounded)."""
    if not isinstance(x, (torch.SymInt, torch.SymFloat)):
        return x
    upper = _upper(x.node.expr, x.node.shape_env)
    return (int(upper) if isinstance(x, torch.SymInt) else float(upper)) if upper is not None else 0


def _upper(expr, env):
    import sympy

    from torch.utils._sympy.numbers import int_oo
    from torch.utils._sympy.value_ranges import bound_sympy

    upper = bound_sympy(expr, env.var_to_range if env is not None else None).upper
    # finite numbers only: an unbounded size's bound is an infinity, sympy's oo or torch's int_oo (which says it is
    # finite), neither of which has an int()
    if upper in (int_oo, -int_oo) or not isinstance(upper, sympy.Expr):
        return None
    return upper if isinstance(upper, (sympy.Integer, sympy.Float)) or (upper.is_number and upper.is_finite) else None


def fx_code_name(name: str, import_str: str, obj: object) -> None:
    """Let FX's generated code refer to `obj` as `name` (an argument whose repr is `name(...)`), imported by
    `import_str`. Public alternative: none (torch.fx.graph._register_custom_builtin, as torch does for inf, device)."""
    from torch.fx.graph import _register_custom_builtin

    _register_custom_builtin(name, import_str, obj)


def dispatch_mode_base():
    """torch's TorchDispatchMode (no public home in torch 2.13), for intercepting collectives."""
    from torch.utils._python_dispatch import TorchDispatchMode

    return TorchDispatchMode


def graph_break() -> None:
    """A TorchDynamo graph break at this line (tests of the torch.compile door: models in several graphs)."""
    import torch._dynamo

    torch._dynamo.graph_break()


def inductor_compile(gm, example_inputs, on_graph=None, config_patches=None, split_backward=None):
    """TorchInductor on one FX graph (what torch.compile(backend="inductor") calls): where inputs require
    gradients, AOTAutograd traces the joint graph, partitions it and Inductor compiles the forward and backward.
    `on_graph(gm, is_backward, seconds, code)` is told of each graph compiled (as handed to Inductor), with the
    Python code Inductor generated for it (CompiledFxGraph.source_code: the order its kernels and collectives run
    in; "" where torch gives none).

    `split_backward(graph, inputs, compile_part)`, where given, takes AOTAutograd's partitioned backward graph
    (inputs: the saved values and the tangents; outputs: one gradient per forward input) and returns the boxed
    callable that runs in its place, built from parts it compiles with `compile_part(part_gm, part_inputs)` (each
    an Inductor backward graph, told to on_graph; called with one list of tensors). AOTAutograd's own cache of
    whole forward-backward pairs is off (it would hand back the backward unsplit), and for such a compile so are
    donated buffers (below). Public
    alternative: none; torch.compile has no hook between the partitioner and Inductor's backward compile.

    The backward is compiled with its forward, not at the first backward (runtime/compile_once.py holds a lock
    around the whole compile)."""
    from torch._functorch import config as functorch_config
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner
    from torch._inductor.output_code import MockFXGraphCacheOutput

    example_inputs = _with_shape_env(example_inputs, gm)
    if on_graph is None and split_backward is None:
        with functorch_config.patch(force_non_lazy_backward_lowering=True):
            return compile_fx(gm, example_inputs, config_patches=config_patches)

    def told(graph, inputs, **kwargs):
        t0 = time.perf_counter()
        before = _snapshot(graph) if on_graph is not None else None  # Inductor's passes rewrite `graph` (not on a hit)
        out = compile_fx_inner(graph, inputs, **kwargs)
        if on_graph is not None:
            on_graph(before, bool(kwargs.get("is_backward")), time.perf_counter() - t0, getattr(out, "source_code", ""))
        return out

    def inner(graph, inputs, **kwargs):
        if not (kwargs.get("is_backward") and split_backward is not None):
            return told(graph, inputs, **kwargs)
        # each part's inputs are its own: the whole graph's static (parameter) input positions do not carry over
        part_kwargs = {**kwargs, "static_input_idxs": []}
        run = split_backward(graph, inputs, lambda part, part_inputs: told(part, part_inputs, **part_kwargs))
        return MockFXGraphCacheOutput(gm=run)  # an OutputCode that calls `run` with the list of inputs

    # AOTAutograd's cache of whole forward-backward pairs would skip `inner` (on_graph's counts, the split) on a hit:
    # off, while Inductor's FX graph cache (the generated code, the costly part) serves each graph `inner` compiles.
    # A split backward is called under retain_graph (backward_split.backward_input): no saved buffer is donated to
    # it for reuse, which AOTAutograd allows only to a backward run once without retain_graph.
    patch = functorch_config.patch(enable_autograd_cache=False, donated_buffer=split_backward is None,
                                   force_non_lazy_backward_lowering=True)
    with patch:
        return compile_fx(gm, example_inputs, inner_compile=inner, config_patches=config_patches)


def _snapshot(gm):
    """A copy of `gm`'s graph as AOTAutograd handed it to Inductor, whose passes then rewrite it in place (an
    all_reduce becomes all_reduce_) unless its FX graph cache had it: on_graph sees the same graph either way."""
    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    return torch.fx.GraphModule(gm, graph)


def _with_shape_env(example_inputs, gm=None):
    """The example inputs as fake tensors of a FakeTensorMode with a ShapeEnv (static shapes, no symbol in it), as
    TorchDynamo hands them to Inductor: without a ShapeEnv Inductor bypasses its FX graph cache ("No shape env") and
    compiles every graph from scratch, in every rank and every run. A graph whose sizes depend on values (rows picked
    by nonzero: torch.export's unbacked symbols) keeps its trace's ShapeEnv, in which a retrace's new symbols get
    new names (a fresh one would name them as the trace did, which AOTAutograd refuses). Inputs a fake tensor
    cannot stand for (a tensor subclass) leave them as they are. Public alternative: none (torch.compile makes
    them itself)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    if not all(type(t) in (torch.Tensor, torch.nn.Parameter) for t in example_inputs if isinstance(t, torch.Tensor)):
        return example_inputs
    dynamic = gm is not None and any(node.meta.get("unbacked_bindings") for node in gm.graph.nodes)
    traced = fake_tensor_mode(like=gm).shape_env if dynamic else None
    mode = FakeTensorMode(shape_env=traced or ShapeEnv(), static_shapes=True)  # the shapes as they are: no symbol
    return [mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in example_inputs]


def split_backward_retained():
    """A context in which a backward compiled with split_backward may run under retain_graph: AOTAutograd refuses
    that where its forward metadata does not say "no donated buffers" ([]), and a split compile leaves it unset
    (None: Inductor donates none, see inductor_compile) unless its first backward happened to retain the graph.
    Public alternative: none; `torch._functorch.config.donated_buffer` is the switch AOTAutograd's message names."""
    from torch._functorch import config as functorch_config

    return functorch_config.patch(donated_buffer=False)


def compiled_function_node(outputs):
    """The autograd node of an AOTAutograd-compiled call (CompiledFunctionBackward) that `outputs` come from, or
    None: their grad_fn, or the one a view of an output was taken from. Public alternative: none (the node's class
    is created per compiled function; its name() is what identifies it)."""
    for t in outputs:
        node = getattr(t, "grad_fn", None)
        for candidate in [node, *((n for n, _ in node.next_functions) if node is not None else ())]:
            if candidate is not None and candidate.name() == "CompiledFunctionBackward":
                return candidate
    return None


# ------------------------------------------------------------------ op overloads and nn.Module internals
def op_name(func) -> str:
    """An OpOverload's bare name ("all_reduce" for _c10d_functional.all_reduce.default): its `_opname`.
    Public alternative: `func.overloadpacket.__name__`, or `func.name()` ("ns::name.overload") parsed."""
    return func._opname


def is_op_overload(target) -> bool:
    """Is a call target an ATen-level OpOverload (torch.ops.<ns>.<op>.<overload>)? `torch._ops.OpOverload`."""
    return isinstance(target, torch._ops.OpOverload)


def op_returns_view(func) -> bool:
    """Does the OpOverload's schema say its result aliases an input (a view)? From `func._schema.returns`."""
    return any(r.alias_info is not None for r in func._schema.returns)


def op_is_mutable(func) -> bool:
    """Does the OpOverload's schema say it writes one of its inputs? `func._schema.is_mutable`: torch has no
    public accessor of an op's FunctionSchema (a trailing "_" in `func.name()` covers only in-place ops)."""
    return func._schema.is_mutable


def own_parameters(module: torch.nn.Module) -> dict:
    """name -> Parameter (or None) registered on `module` itself: `module._parameters`. Public alternative:
    `module.named_parameters(recurse=False, remove_duplicate=False)`, which skips None entries and goes
    through a method a subclass may override; meshc reads every live module's own dict in one pass."""
    return module._parameters


def own_buffers(module: torch.nn.Module) -> dict:
    """name -> buffer (or None) registered on `module` itself: `module._buffers`. Public alternative:
    `module.named_buffers(recurse=False, remove_duplicate=False)` (same caveats as own_parameters)."""
    return module._buffers


def child_modules(module: torch.nn.Module) -> list:
    """The direct submodules of `module` (None entries dropped), from `module._modules`. Public alternative:
    `module.children()`, which also drops a child registered twice and may be overridden by a subclass."""
    return [child for child in module._modules.values() if child is not None]


def replace_parameter(module: torch.nn.Module, name: str, value: torch.Tensor) -> None:
    """Put `value` in the slot of `module`'s parameter `name`: `module._parameters[name] = value`. Public
    alternative: `setattr(module, name, value)` or `register_parameter`, which accept only an nn.Parameter;
    meshc puts a tensor subclass wrapping the Parameter (a ShardedParam) there, which only the dict takes."""
    module._parameters[name] = value


def storage_key(t: torch.Tensor):
    """A hashable identity of `t`'s storage, shared by its views, distinct between live storages (also empty
    ones, which all have data_ptr 0): torch.multiprocessing's StorageWeakRef, which holds no reference."""
    from torch.multiprocessing.reductions import StorageWeakRef

    return StorageWeakRef(t.untyped_storage())


def version(t: torch.Tensor) -> int:
    """`t`'s version counter (bumped by every in-place write, shared with its views): `t._version`. No public
    alternative; meshc reads it to tell whether an initializer wrote a tensor."""
    return t._version


def fused_attention_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                          scale: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(output, log-sum-exp (b, h, s) fp32) of one attention block from torch's fused CPU kernel (the one SDPA
    calls on CPU), or None off CPU. Public SDPA returns no log-sum-exp, which merging blocks needs."""
    if q.device.type != "cpu":
        return None
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)


def fused_attention_block_backward(dout, q, k, v, out, lse, causal: bool, scale: float):
    """(dq, dk, dv) of one block given the whole attention's output and log-sum-exp (FlashAttention-2's
    backward: the block's probabilities are exp(scores − lse)), from torch's fused CPU kernel."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, 0.0, causal, scale=scale)


def real_tensors():
    """A context in which tensors are real again under an active FakeTensorMode (a compile on fake tensors that
    evaluates a constant, e.g. the masks pass): torch's unset_fake_temporarily, which has no public spelling."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    return unset_fake_temporarily()


# DTensor's op-strategy registry, consulted at compile time (compiler/ir/op_strategies.py): no DTensor at run time
_STRATEGY_MESHES: dict[int, object] = {}


def strategy_mesh(n: int):
    """A one-dim DeviceMesh of n ranks that needs no process group (only its size is read by the strategies)."""
    from torch.distributed.device_mesh import DeviceMesh

    if n not in _STRATEGY_MESHES:
        _STRATEGY_MESHES[n] = DeviceMesh("cpu", list(range(n)), _init_backend=False, _rank=0)
    return _STRATEGY_MESHES[n]


def dtensor_spec(mesh, placement, shape, dtype):
    """DTensor's description of a tensor of `shape` placed by `placement` (a torch.distributed.tensor one)."""
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    t = torch.empty(shape, dtype=dtype, device="meta")
    return DTensorSpec(mesh, (placement,), TensorMeta(t.shape, t.stride(), t.dtype))


def propagate_sharding(op, args: tuple, kwargs: dict):
    """(output spec(s), the inputs' required specs or None where they may stay as they are) from DTensor's
    registered strategy for `op`, args holding dtensor_spec()s; None where DTensor has no strategy for `op`."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._op_schema import OpSchema

    prop = DTensor._op_dispatcher.sharding_propagator
    if op not in prop.op_strategy_funcs and op not in prop.op_to_rules:
        return None
    out = prop.propagate_op_sharding(OpSchema(op, args, kwargs))
    needed = out.redistribute_schema
    return out.output_spec, (needed.args_schema, needed.kwargs_schema) if needed is not None else None
