"""meshc.runtime: what runs on each rank.

    mesh.py         the mesh and its process groups (from a MeshSpec)
    sharding.py     local shards of full tensors and back; global_param.py, host_malloc.py
    ops/            what graph nodes call: collectives, ZeRO gather/reduce, TP, remat, all-to-all
    pipeline/       the schedule executor, a job's pipelined step, the backward split in two
    zero/           one ZeRO step's context, the param store, offload and its store
    checkpoint/     sharded checkpoints and their format, load_pretrained, init_weights
    monitor/        failures that never hang, the per-rank timeline (job.trace), the collective census
"""
