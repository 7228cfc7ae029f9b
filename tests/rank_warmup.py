"""What the rank forkserver imports before it forks (tests/harness.py PRELOAD): every meshc module, and the
parts of torch that a first trace imports lazily (torch.export loads most of its machinery on its first call).

Without this each rank of each launch imported ~440 modules on its own, ~3.5 s per rank on a 2-core machine
(measured with cProfile in a plan-matrix rank: 3.57 s in importlib of its 61 s), i.e. ~7 s of wall time per
4-rank launch. The trace here runs on the meta device: nothing is computed, so no thread pool starts in the
server before it forks.
"""
from __future__ import annotations

import atexit
import gc
import importlib
import pkgutil

import torch

from meshc.compiler.ir import torch_compat as compat
from meshc.compiler.trace.export import export

for _package in ("compiler", "passes", "kernels", "runtime"):
    for _info in pkgutil.walk_packages(importlib.import_module(f"meshc.{_package}").__path__, f"meshc.{_package}."):
        importlib.import_module(_info.name)
for _name in ("meshc.api", "meshc.job", "meshc.dynamo_backend", "meshc.models"):
    importlib.import_module(_name)


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(8)
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.proj(self.norm(x)).view(1, 2, 4, 4).transpose(1, 2)
        return torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True).sum()


with torch.device("meta"):
    _block, _x = _Block(), torch.randn(1, 4, 8)
export(_block, (_x,), {}, "non-strict")

# Inductor's compiler and the CPU's vector ISA, which each rank's first compile (Plan(inductor=True)) would otherwise
# load and probe on its own: ~3.8 s per rank (measured in a world-1 llama step with Inductor's cache warm: 5.9 s -> 2.1 s)
compat.preload_inductor()

# Everything above (torch, transformers, meshc: ~466,000 objects) lives as long as the process: moved out of the
# collector's reach, so that neither the rank's full collections during a trace nor the harness's gc.collect() at its
# end walk them again (that collect alone took 0.30 s per rank, most of a 2-rank launch's 0.7 s; measured 2026-12-06)
gc.freeze()
atexit.register(gc.unfreeze)  # the server itself exits as any process (its ranks leave by os._exit): extension
# objects freed at exit as before (nanobind, in triton, reports every object still alive then as a leak)
