"""Pipelines at compile time: stage extraction, the per-rank PipelinePlan, graphs ready for the I/W split."""
