"""What an attention mask computed from constants only is: causal, nothing, or something else.

transformers builds a (B, 1, S, S) mask from positions (aranges) inside the traced graph even when it only says
"causal". Under context parallelism a whole mask on every rank costs B·S² bytes, the one thing that would not
shrink with cp; a causal flag costs nothing and lets the ring skip the blocks a query cannot see. When the mask's
value depends on no placeholder (no input, parameter or buffer) it is the same every step, so it is evaluated once
here, at compile time, on real tensors (up to MAX_ELEMENTS; beyond that the caller keeps the mask and says what it
costs), and compared with the causal mask exactly: a boolean mask must equal tril(ones(S, S)) under its
broadcast; an additive float mask must be 0 there and at most the dtype's lowest value / 2 elsewhere (softmax
then gives those keys exactly 0 weight, as SDPA's own masking does; no row is fully masked under causal).
"""
from __future__ import annotations

import torch
import torch.fx as fx

from meshc.compiler.ir import torch_compat as compat

MAX_ELEMENTS = 1 << 28  # 256 Mi elements: a boolean (1, 1, 16384, 16384) mask


def constant_nodes(mask: fx.Node) -> list[fx.Node] | None:
    """The nodes computing `mask` in graph order, when none is a placeholder (else None)."""
    seen: set[fx.Node] = set()
    stack = [mask]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        if node.op != "call_function":
            return None
        seen.add(node)
        stack.extend(node.all_input_nodes)
    return [n for n in mask.graph.nodes if n in seen]


def mask_form(mask: fx.Node) -> tuple[str, int]:
    """("causal" | "all" | "other" | "unknown", elements): what the mask computes, and its element count."""
    val = mask.meta.get("val")
    numel = int(val.numel()) if isinstance(val, torch.Tensor) else 0
    nodes = constant_nodes(mask)
    if nodes is None or not isinstance(val, torch.Tensor) or val.dim() < 2 or numel > MAX_ELEMENTS:
        return "unknown", numel
    try:
        with compat.real_tensors():  # a compile on fake tensors (meshc explain) evaluates the same constant
            return _compare(_evaluate(nodes)), numel
    except Exception:  # noqa: BLE001 - an op that cannot run here: the mask stays as it is
        return "unknown", numel


def _compare(value: torch.Tensor) -> str:
    rows, cols = value.shape[-2:]
    causal = torch.ones(rows, cols, dtype=torch.bool).tril()
    if value.dtype == torch.bool:
        allowed = value
    elif value.is_floating_point():
        low = torch.finfo(value.dtype).min / 2
        if not bool(((value == 0) | (value <= low)).all()):
            return "other"
        allowed = value == 0
    else:
        return "other"
    if bool(allowed.all()):
        return "all"
    if rows == cols and bool((allowed == causal).all()):
        return "causal"
    return "other"


def _evaluate(nodes: list[fx.Node]) -> torch.Tensor:
    values: dict[fx.Node, object] = {}
    for node in nodes:
        args = fx.node.map_arg(node.args, lambda a: values[a])
        kwargs = fx.node.map_arg(node.kwargs, lambda a: values[a])
        kwargs = {k: (torch.device("cpu") if k == "device" else v) for k, v in kwargs.items()}
        values[node] = node.target(*args, **kwargs)
    return values[nodes[-1]]
