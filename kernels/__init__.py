"""meshc.kernels: fused ops next to communication (one torch.library custom op per file).

Importing this package registers the `meshc::*` ops (torch.ops.meshc.<name>); triton itself is
imported only when a kernel first runs, so this import works where triton is not installed.

    bias_dropout_add_norm   after a row-parallel all-reduce / sequence-parallel reduce-scatter
    bias_act                bias + GeLU / SwiGLU after a column-parallel linear
    zero_copy               ZeRO-3 pack_cast before, unpack after the parameter all-gather
    grad_prologue           flatten + cast + pre-scale + pad before the gradient reduce-scatter

This folder is the package meshc.kernels. Wherever the repository root is on sys.path (pytest, a script
or a shell started in the root) the bare name `kernels` finds this folder first, and that name belongs to
another distribution (Hugging Face's kernel hub, which transformers imports): a top-level import of this
folder therefore hands over to that distribution (_handover), or fails as if no `kernels` were installed.
"""
from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys


def _handover() -> None:
    """Replace sys.modules["kernels"] (this folder, imported by its bare name) by the installed `kernels`."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = [p for p in sys.path if os.path.abspath(p or os.curdir) != root]
    spec = importlib.machinery.PathFinder.find_spec("kernels", path)
    if spec is None or spec.loader is None:
        del sys.modules["kernels"]
        raise ModuleNotFoundError(f"No module named 'kernels' (the folder {os.path.dirname(__file__)} is "
                                  "meshc.kernels, not a top-level package)", name="kernels")
    module = importlib.util.module_from_spec(spec)
    sys.modules["kernels"] = module  # the import statement returns what sys.modules holds after this runs
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules["kernels"]
        raise


if __name__ == "kernels":
    _handover()
else:
    from meshc.kernels import bias_act, bias_dropout_add_norm, grad_prologue, zero_copy

    __all__ = ["bias_act", "bias_dropout_add_norm", "grad_prologue", "zero_copy"]
