"""Custom autograd Functions kept through the trace: each call becomes a custom op with the Function's backward.

torch.export (strict and non-strict alike, measured on torch 2.13) traces a `torch.autograd.Function`'s
forward into plain ATen ops and drops its backward: a straight-through estimator (forward: round, backward:
identity) would train with the zero gradient of round. While meshc traces, `functions_as_ops(model)` makes
every user-defined Function's `apply` call a custom op instead:

    meshc_fn::<Function>_<n>(Tensor[] tensors) -> Tensor[]

whose forward is the Function's forward and whose autograd formula runs the Function's own backward: it
recomputes the forward from the saved inputs with autograd on and differentiates through it, so whatever
`backward` the user wrote (and whatever it saved in `ctx`) is what gradients see. Non-tensor arguments are
constants of the op (one op per class and distinct constants). Costs: the Function's forward runs twice
per step (forward, and again in backward). Limits, refused with an error naming the Function: arguments
that are neither tensors nor plain constants (None, bool, int, float, str and tuples of them), keyword
arguments, outputs that are not tensors. The op also returns the CPU generator's state from before the
forward (one extra uint8 output, unused by the model), and backward recomputes under that state: a
Function that draws random numbers (its own dropout) is differentiated with the numbers it drew. (CUDA
generators are not captured yet: on a GPU, such a Function would be recomputed with other numbers.)

Functions defined by torch and by meshc itself are left alone.
"""
from __future__ import annotations

import contextlib
import itertools
from typing import Any

import torch

from torch.fx.experimental.proxy_tensor import make_fx

from meshc.compiler.ir import torch_compat as compat
from meshc.compiler.ir.errors import TraceError

_OPS: dict[tuple, Any] = {}  # (Function class, constants, positions) -> custom op, for the process's lifetime
_CALLS: dict[str, Any] = {}  # the op's name ("meshc_fn::X_0") -> call(tensors): the Function's forward, run by apply
_COUNT = itertools.count()
_DRAWS: dict[tuple, str | None] = {}  # (op, input shapes and dtypes) -> random_draw's answer
_PLAIN = (type(None), bool, int, float, str)
STATE_BYTES = torch.get_rng_state().numel()  # the CPU generator's state, as torch.get_rng_state() returns it


def user_functions() -> list[type]:
    """Every live subclass of torch.autograd.Function not defined by torch or meshc."""
    out, stack = [], list(torch.autograd.Function.__subclasses__())
    while stack:
        cls = stack.pop()
        stack.extend(cls.__subclasses__())
        module = getattr(cls, "__module__", "") or ""
        if not module.startswith(("torch.", "meshc.")) and module != "torch":
            out.append(cls)
    return out


@contextlib.contextmanager
def functions_as_ops():
    """While the block runs (an export), user Functions' `apply` calls become meshc_fn custom ops."""
    patched = []
    for cls in user_functions():
        own = cls.__dict__.get("apply")
        if own is not None:  # a Function with an apply of its own: left as it is (check_trace compares it)
            continue
        patched.append(cls)
        cls.apply = classmethod(_as_op)
    try:
        yield
    finally:
        for cls in patched:
            del cls.apply


def _original_apply(cls, *args):
    """The Function's own apply (torch.autograd.Function's), bypassing the patch."""
    return torch.autograd.Function.__dict__["apply"].__func__(cls, *args)


def _as_op(cls, *args, **kwargs):
    if kwargs:
        raise TraceError(f"trace: {cls.__qualname__}.apply was called with keyword arguments {sorted(kwargs)}; "
                         "meshc keeps a Function's backward only for positional arguments: pass them positionally, "
                         "or register the function as a torch.library custom op")
    positions = tuple(i for i, a in enumerate(args) if isinstance(a, torch.Tensor))
    constants = tuple((i, a) for i, a in enumerate(args) if not isinstance(a, torch.Tensor))
    for i, value in constants:
        if not _plain(value):
            raise TraceError(f"trace: {cls.__qualname__}.apply argument {i} is a {type(value).__name__}; meshc keeps "
                             "a Function's backward for tensor and plain constant arguments (None, bool, int, float, "
                             "str): pass it another way, or register the function as a torch.library custom op")
    key = (cls, positions, repr(constants))
    if key not in _OPS:
        _OPS[key] = _define(cls, positions, constants, len(args))
    op, single = _OPS[key]
    outs = op([args[i] for i in positions])[:-1]  # the last output is the RNG state backward recomputes under
    return outs[0] if single[0] else tuple(outs)


def _plain(value) -> bool:
    if isinstance(value, tuple):
        return all(_plain(v) for v in value)
    return isinstance(value, _PLAIN)


def _define(cls, positions: tuple, constants: tuple, n: int):
    name = f"meshc_fn::{_identifier(cls.__qualname__)}_{next(_COUNT)}"
    single = [True]  # whether the Function returns one tensor (set by the first forward, real or fake)

    def call(tensors):
        args = [None] * n
        for i, t in zip(positions, tensors):
            args[i] = t
        for i, value in constants:
            args[i] = value
        out = _original_apply(cls, *args)
        single[0] = isinstance(out, torch.Tensor)
        outs = [out] if single[0] else list(out)
        if not all(isinstance(o, torch.Tensor) for o in outs):
            raise TraceError(f"trace: {cls.__qualname__}.forward returned {type(out).__name__}; meshc keeps a "
                             "Function's backward when it returns tensors: register it as a torch.library custom op")
        return outs

    def forward(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        state = torch.get_rng_state()
        with torch.no_grad():
            outs = call(tensors)
        ptrs = {t.untyped_storage().data_ptr() for t in tensors}
        outs = [o.clone() if o.untyped_storage().data_ptr() in ptrs else o for o in outs]  # ops never alias inputs
        return outs + [state]

    op = torch.library.custom_op(name, forward, mutates_args=(), schema="(Tensor[] tensors) -> Tensor[]")
    _CALLS[name] = call

    @op.register_fake
    def _fake(tensors):
        with torch.no_grad():
            return [o.clone() for o in call(tensors)] + [torch.empty(STATE_BYTES, dtype=torch.uint8)]

    def setup_context(ctx, inputs, output):
        ctx.tensors, ctx.state = inputs[0], output[-1]

    def backward(ctx, grads):
        xs = [t.detach().requires_grad_(t.is_floating_point() or t.is_complex()) for t in ctx.tensors]
        with torch.random.fork_rng(devices=[]), torch.enable_grad():
            if type(ctx.state) is torch.Tensor:  # run: recompute under the forward's generator state
                torch.set_rng_state(ctx.state)
                outs = call(xs)
            else:  # traced (Inductor's joint graph): the state is no value; only a Function drawing no random
                # numbers is traced (runtime/regions.py runs the others as FX code), checked here
                with _refusing_random(cls):
                    outs = call(xs)
        pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
        wanted = [x for x in xs if x.requires_grad]
        if not pairs or not wanted:
            return [None] * len(xs)
        got = iter(torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True))
        return [next(got) if x.requires_grad else None for x in xs]

    op.register_autograd(backward, setup_context=setup_context)
    return op, single


def random_draw(node) -> str | None:
    """The first op drawing random numbers (tagged nondeterministic_seeded) in the forward of the user Function
    behind the meshc_fn `node`, traced with make_fx on meta tensors at its shapes; "unknown" where it cannot be
    traced so; None where it draws none. Such a Function cannot be traced into a compiled backward, whose
    recompute would draw other numbers than the forward drew."""
    call = function_call(node.target)
    ins = [a.meta.get("val") if isinstance(a, torch.fx.Node) else None for a in node.args[0]]
    if call is None or not all(isinstance(t, torch.Tensor) for t in ins):
        return None if call is None else "unknown"
    key = (node.target, tuple((tuple(t.shape), t.dtype) for t in ins))
    if key not in _DRAWS:
        try:
            traced = trace_on_meta(call, ins)
            _DRAWS[key] = next((str(n.target) for n in traced.graph.nodes if n.op == "call_function"
                                and torch.Tag.nondeterministic_seeded in getattr(n.target, "tags", ())), None)
        except Exception:  # noqa: BLE001 - a Function meta tensors cannot run: assume it may draw
            _DRAWS[key] = "unknown"
    return _DRAWS[key]


def trace_on_meta(call, ins: list, outs: list | None = None) -> torch.fx.GraphModule:
    """make_fx of a Function's forward (`call`, as function_call gives it) on meta tensors shaped like `ins`, and,
    where `outs` (its outputs' values) are given, of its backward too (autograd.grad through it, one gradient per
    output): nothing computed, no memory."""
    def fwd_bwd(xs, grads):
        xs = [x.detach().requires_grad_(x.is_floating_point()) for x in xs]
        ys = call(xs)
        pairs = [(y, g) for y, g in zip(ys, grads) if y.requires_grad]
        wanted = [x for x in xs if x.requires_grad]
        if not pairs or not wanted:
            return ys
        got = torch.autograd.grad([y for y, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True)
        return ys, [g for g in got if g is not None]

    meta = [torch.empty(t.shape, dtype=t.dtype, device="meta") for t in ins]
    with compat.real_tensors():
        if outs is None:
            return make_fx(lambda xs: call(xs))(meta)
        return make_fx(fwd_bwd)(meta, [torch.empty(t.shape, dtype=t.dtype, device="meta") for t in outs])


@contextlib.contextmanager
def _refusing_random(cls):
    """While the block traces a Function's recompute: an op drawing random numbers raises a TraceError."""
    class Refuse(compat.dispatch_mode_base()):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if torch.Tag.nondeterministic_seeded in getattr(func, "tags", ()):
                raise TraceError(f"inductor: {cls.__qualname__}'s backward would recompute its forward inside a "
                                 f"compiled graph, drawing other random numbers ({func}) than its forward drew; "
                                 "run the program as FX code with Plan(inductor=False)")
            return func(*args, **(kwargs or {}))

    with Refuse():
        yield


def function_call(target) -> Any:
    """For a meshc_fn op (an overload or packet, as graph nodes carry it): call(tensors), which applies the
    user's Function (its forward, and its backward under autograd) to the op's tensor arguments; else None."""
    name = getattr(target, "name", None)  # OpOverload.name(): "meshc_fn::G_0.default"
    name = name() if callable(name) else None
    return _CALLS.get(name.split(".")[0]) if isinstance(name, str) else None


def _identifier(text: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in text)


def apply_bodies(fwd: torch.fx.GraphModule, bwd: torch.fx.GraphModule, *args, **kwargs):
    """`torch.ops.higher_order.autograd_function_apply(fwd, bwd, *args, **kwargs)`, which is what TorchDynamo
    makes of a user Function's `apply` (fwd: its forward, returning (output, saved values); bwd: its backward,
    taking the output gradients and the saved values), as a meshc_fn custom op whose backward is `bwd`.

    A torch.export of TorchDynamo's graph (the torch.compile door lowers each graph so) would run `fwd` under
    no_grad, as TorchDynamo traced it, and drop `bwd`: measured on BLOOM's GeLU Function, no gradient reached
    anything before it. Refused with a TraceError: a Function that marks outputs dirty (in-place outputs)."""
    if kwargs.get("dirty_idx"):
        raise TraceError("trace: a torch.autograd.Function in the compiled region marks an output dirty "
                         "(ctx.mark_dirty, an in-place output); meshc keeps a Function's backward only for new "
                         "outputs: return a new tensor, or use meshc.compile(model, mesh, ...)")
    cls = getattr(fwd, "_meshc_function", None)
    if cls is None:
        cls = _function_of_bodies(fwd, bwd, tuple(kwargs.get("non_differentiable_idx", ())))
        fwd._meshc_function = cls  # one Function (and one custom op) per region body, however often it is lowered
    return _as_op(cls, *args)


def _function_of_bodies(fwd, bwd, non_differentiable: tuple) -> type:
    """A torch.autograd.Function running TorchDynamo's forward and backward bodies, as torch's own eager
    implementation of autograd_function_apply does."""

    class DynamoFunction(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *args):
            output, saved = torch.fx.Interpreter(fwd).run(*args)
            ctx.saved = tuple(saved)
            outs = output if isinstance(output, (tuple, list)) else (output,)
            marked = [o for i, o in enumerate(outs) if i in non_differentiable and isinstance(o, torch.Tensor)]
            if marked:
                ctx.mark_non_differentiable(*marked)
            return output

        @staticmethod
        def backward(ctx, *grads):
            return torch.fx.Interpreter(bwd).run(*grads, *ctx.saved)

    return DynamoFunction
