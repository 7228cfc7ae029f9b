"""ZeRO at run time: one step's context, the tensors a job holds for its parameters, offload and its store."""
