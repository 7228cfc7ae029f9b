"""meshc.kernels: fused ops next to communication (one torch.library custom op per file).

Importing this package registers the `meshc::*` ops (torch.ops.meshc.<name>); triton itself is
imported only when a kernel first runs, so this import works where triton is not installed.

    bias_dropout_add_norm   after a row-parallel all-reduce / sequence-parallel reduce-scatter
    bias_act                bias + GeLU / SwiGLU after a column-parallel linear
    zero_copy               ZeRO-3 pack_cast before, unpack after the parameter all-gather
    grad_prologue           flatten + cast + pre-scale + pad before the gradient reduce-scatter
"""
from meshc.kernels import bias_act, bias_dropout_add_norm, grad_prologue, zero_copy

__all__ = ["bias_act", "bias_dropout_add_norm", "grad_prologue", "zero_copy"]
