"""The name a graph's compile lock takes (runtime/compile_once.py): equal for equal compiles on two ranks, different
wherever Inductor would generate other code (a constant's value, an input's shape or stride, the options)."""
from __future__ import annotations

import torch
from torch import fx

from meshc.runtime.compile_once import graph_key


class _Scaled(torch.nn.Module):
    def __init__(self, scale: float):
        super().__init__()
        self.register_buffer("scale", torch.tensor(scale))  # a 0-dim constant, as a rank's offset may be

    def forward(self, x):
        return torch.relu(x) * self.scale


def test_graph_key_tells_apart_what_inductor_would_compile_differently():
    x = torch.randn(4, 8)
    key = graph_key(fx.symbolic_trace(_Scaled(2.0)), [x], "options")
    assert key == graph_key(fx.symbolic_trace(_Scaled(2.0)), [x.clone()], "options")  # another rank, same compile
    assert key != graph_key(fx.symbolic_trace(_Scaled(3.0)), [x], "options")  # a constant's value
    assert key != graph_key(fx.symbolic_trace(_Scaled(2.0)), [torch.randn(4, 9)], "options")  # a shape
    assert key != graph_key(fx.symbolic_trace(_Scaled(2.0)), [torch.randn(8, 4).t()], "options")  # a stride
    assert key != graph_key(fx.symbolic_trace(_Scaled(2.0)), [x], "other options")
