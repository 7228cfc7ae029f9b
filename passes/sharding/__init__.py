"""Sharding decisions made over the whole graph (no imports of passes/: the passes call in, never the reverse)."""
