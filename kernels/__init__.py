"""meshc.kernels: fused ops next to communication (one torch.library custom op per file)."""
