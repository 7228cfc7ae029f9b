"""Placement rules apart from tp_rules and tp_views: their vocabulary (decision: Decision, RuleCtx, handles), and the
rules of the ops a state-space mixer is written with (scan: depthwise conv1d, einsum, pad, tensor_split,
repeat_interleave). Nothing here imports the passes folder: tp_rules lists these rules in its table."""
