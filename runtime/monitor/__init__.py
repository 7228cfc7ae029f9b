"""Watching real runs: failures that never hang, the per-rank timeline (job.trace), the collective census."""
