"""ZeRO: meshc stages 0-3 side by side with DDP and FSDP2 (`fully_shard`) on the same model, ranks and
batch, in one run: median step time, bytes each rank sends, model-state bytes and peak RSS per rank.

    python benchmarks/zero_bench.py [--dp 2] [--steps 10] [--replicas R]

With --replicas R (R divides dp): also hybrid sharding, FSDP2's (fully_shard on a (replicate, shard) = (R, dp/R)
DeviceMesh) and meshc's (Plan(zero=3, replicas=R)), the shards within groups of dp/R consecutive ranks.

Model: torch's reference Transformer (4 layers, dim 256, vocab 1024, tied head; 3.4M parameters),
batch 8 x 128 tokens (global), fp32, AdamW; gloo on loopback, one thread per rank. Bytes: meshc's are
counted at dispatch (CommCensus); DDP's and FSDP2's by wrapping torch.distributed's collective calls
for the measured step. All converted to ring wire bytes per rank.
"""
from __future__ import annotations

import json
import os
import resource
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import arg_parser, launch, lm_loss, median_step, report, run_worker, table, wire_bytes  # noqa: E402
from tp_bench import _data, _model  # noqa: E402


class _CountC10d:
    """Count the payload of torch.distributed's collective calls (what FSDP2 uses), by wrapping them."""

    def __init__(self):
        import torch.distributed as dist

        self.dist, self.calls, self.saved = dist, {}, {}

    def __enter__(self):
        for name, kind, at in (("all_reduce", "all_reduce", 2), ("all_gather_into_tensor", "all_gather", 2),
                               ("reduce_scatter_tensor", "reduce_scatter", 3), ("all_gather_single", "all_gather", 2),
                               ("reduce_scatter_single", "reduce_scatter", 3)):
            original = getattr(self.dist, name)
            self.saved[name] = original

            def wrapped(*args, _original=original, _kind=kind, _at=at, **kwargs):
                tensor = kwargs.get("input_tensor", kwargs.get("input", kwargs.get("tensor")))  # the payload
                if tensor is None:
                    tensor = args[1] if _kind != "all_reduce" else args[0]
                group = kwargs.get("group", args[_at] if len(args) > _at else None)
                key = (_kind, f"group{self.dist.get_world_size(group)}")  # wire bytes by the group's size
                calls, nbytes = self.calls.get(key, (0, 0))
                self.calls[key] = (calls + 1, nbytes + tensor.numel() * tensor.element_size())
                return _original(*args, **kwargs)
            setattr(self.dist, name, wrapped)
        return self

    def __exit__(self, *exc):
        for name, fn in self.saved.items():
            setattr(self.dist, name, fn)
        return False


def _state_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def _torch_peer(impl: str, mesh, x, y, replicas: int = 1):
    import torch

    model = _model()
    ddp_bytes = {}
    if impl == "ddp":
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model, process_group=mesh.group("dp"))

        def counting_hook(group, bucket):  # DDP's own all-reduce, with its bucket payload counted
            calls, nbytes = ddp_bytes.get(("all_reduce", "dp"), (0, 0))
            buffer = bucket.buffer()
            ddp_bytes[("all_reduce", "dp")] = (calls + 1, nbytes + buffer.numel() * buffer.element_size())
            return allreduce_hook(group, bucket)
        model.register_comm_hook(mesh.group("dp"), counting_hook)
    else:
        from torch.distributed.fsdp import fully_shard

        dm = mesh.device_mesh["dp"]
        if replicas > 1:  # HSDP: a 2-D (replicate, shard) mesh, shard groups of consecutive ranks
            from torch.distributed.device_mesh import init_device_mesh

            dp = mesh.size("dp")
            dm = init_device_mesh("cpu", (replicas, dp // replicas), mesh_dim_names=("replicate", "shard"))
        for layer in model.layers:
            fully_shard(layer, mesh=dm)
        fully_shard(model, mesh=dm)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step():
        lm_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()

    def state():
        lm_loss(model(x), y).backward()  # measured with gradients held, as after backward
        local = [getattr(p, "_local_tensor", p) for p in model.parameters()]
        grads = [getattr(p.grad, "_local_tensor", p.grad) for p in model.parameters() if p.grad is not None]
        states = [getattr(v, "_local_tensor", v) for s in opt.state.values() for v in s.values()
                  if isinstance(v, torch.Tensor) and v.dim() > 0]
        held = _state_bytes(local) + _state_bytes(grads) + _state_bytes(states)
        opt.zero_grad()
        return held
    return step, state, ddp_bytes


def worker(config: dict) -> None:
    import torch
    import torch.distributed as dist

    import meshc
    from meshc.runtime.monitor.census import CommCensus

    torch.set_num_threads(1)
    mesh = meshc.mesh(timeout_s=300)
    x, y = (mesh.shard_batch(t) for t in _data())
    impl = config["impl"]
    if impl == "meshc":
        job = meshc.compile(_model(), mesh, example_inputs=(x,),
                            plan=meshc.Plan(zero=config["zero"], replicas=config.get("replicas", 1)))
        opt = job.optimizer(torch.optim.AdamW, lr=1e-3)

        def step():
            job.step(x, y, lm_loss)
            opt.step()
            opt.zero_grad()

        def state():
            job.step(x, y, lm_loss)  # measured with gradients held, as after backward
            held = sum(job.held_bytes().values())
            opt.zero_grad()
            return held
        counter, sizes = CommCensus(job.mesh), job.mesh.sizes
    else:
        step, state, ddp_bytes = _torch_peer(impl, mesh, x, y, config.get("replicas", 1))
        counter, sizes = _CountC10d(), {**mesh.sizes, **{f"group{n}": n for n in range(1, mesh.world_size + 1)}}
    seconds = median_step(step, steps=config["steps"], barrier=dist.barrier)
    if impl == "ddp":
        ddp_bytes.clear()
    with counter:
        step()
    counts = counter.by_kind() if hasattr(counter, "by_kind") else {**counter.calls, **ddp_bytes}
    counts = {k: v for k, v in counts.items() if k[1] not in ("tp", "pp") and v[1] > 64}  # not the loss average
    report({"impl": impl, "step_s": seconds, "wire_bytes": wire_bytes(counts, sizes), "state_bytes": state(),
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024})
    dist.barrier()


def main() -> None:
    p = arg_parser()
    p.add_argument("--dp", type=int, default=2)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--replicas", type=int, default=1, help="also hybrid sharding with this many replica groups")
    args = p.parse_args()
    if run_worker(args, worker):
        return
    script = os.path.abspath(__file__)
    configs = [("DDP", {"impl": "ddp"}), ("FSDP2", {"impl": "fsdp2"})] + [
        (f"meshc ZeRO-{z}" if z else "meshc DP", {"impl": "meshc", "zero": z}) for z in (0, 1, 2, 3)]
    if args.replicas > 1:
        configs += [(f"FSDP2 HSDP {args.replicas}x{args.dp // args.replicas}", {"impl": "fsdp2", "replicas": args.replicas}),
                    (f"meshc ZeRO-3 replicas={args.replicas}", {"impl": "meshc", "zero": 3, "replicas": args.replicas})]
    rows = []
    for name, config in configs:
        result = launch(script, args.dp, {**config, "steps": args.steps})
        rows.append({"run": name, "step (s)": result["step_s"], "MiB sent per rank": result["wire_bytes"] / 2**20,
                     "model state MiB per rank": result["state_bytes"] / 2**20,
                     "peak RSS MiB per rank": result["peak_rss_mib"]})
        print(name, json.dumps(result), flush=True)
    base = {r["run"]: r["step (s)"] for r in rows}
    for r in rows:
        r["vs FSDP2"] = r["step (s)"] / base["FSDP2"]
    print()
    print(table(rows, ["run", "step (s)", "vs FSDP2", "MiB sent per rank", "model state MiB per rank",
                       "peak RSS MiB per rank"]))


if __name__ == "__main__":
    main()
