"""Pipelines at run time: the schedule executor, a job's pipelined step, the backward split in two."""
