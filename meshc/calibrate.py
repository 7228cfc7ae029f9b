"""`meshc calibrate`: measure this machine as a hardware profile for the cost model ("this CPU over gloo").

A short measurement on N local processes (torchrun, gloo on loopback, one thread per process, as meshc's
CPU jobs run): FLOP/s of linear layers forward and backward, memory bandwidth of elementwise ops, the overhead of one graph op (forward
and backward, through torch.ops as the compiled graphs call them), AdamW's update (timed as a step sees it:
from a barrier on every rank to the slowest rank's end), each fused kernel's time against the chain
it replaces (forward and backward: the fusion decision's input, compiler/cost/fusion.py), and each collective's latency and
bandwidth (all-reduce, all-gather, reduce-scatter through the functional collectives the graphs use;
send as a ping-pong of isend/irecv), fitted to hardware.Link's α-β model. Every process measures at once,
so shared memory bandwidth and cores are accounted as a job sees them. The disk that Plan.offload="nvme"
would use (`disk_dir`) is measured from the launcher: a file written and fsynced, dropped from the page
cache (posix_fadvise DONTNEED), read back; each rank's share is the measured rate over the rank count, as
every rank streams at once. The profile is written as JSON where `load("cpu")` reads it
(hardware.default_cpu_path()).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import types

import torch
import torch.distributed as dist

from meshc.compiler.ir import torch_compat as compat
from meshc.compiler.ir.errors import MeshcRuntimeError
from meshc.compiler.cost.hardware import Hardware, Link, fit_alpha_beta, latency_steps, wire_bytes

# payload bytes; up to 8 MiB either way: a step's gradient buckets are MiBs, and a fit from 2 MiB down (2 ranks,
# 2026-12-03) priced 6 MiB collectives at 0.7-1.5x their time where one with 8 MiB was within 1.2x
SIZES = (2**12, 2**16, 2**19, 2**21, 2**23)


def _median_time(fn, reps: int, barrier=None, repeat: int = 1, before=None) -> float:
    """Seconds per call: the median over `reps` samples of `repeat` calls each, after a warm-up.

    Compute samples are made tens of milliseconds long (`repeat`), as long as the stretches of compute in
    a training step: on a shared machine a short sample runs at full speed on the credit the scheduler gives
    a process that slept, where a step gets only its share of a core. `before` runs untimed before each
    sample (after the barrier)."""
    return statistics.median(_samples(fn, reps, barrier, repeat, before))


def _samples(fn, reps: int, barrier=None, repeat: int = 1, before=None) -> list[float]:
    """Seconds per call of each of `reps` samples (_median_time's), after a warm-up call."""
    fn()  # warm-up
    times = []
    for _ in range(reps):
        if barrier:
            barrier()
        if before:
            before()
        t0 = time.perf_counter()
        for _ in range(repeat):
            fn()
        times.append((time.perf_counter() - t0) / repeat)
    return times


LINEAR_SHAPES = ((512, 128, 384), (512, 384, 128), (1024, 256, 256))  # (tokens, in, out) of a small model's linears


def measure_compute(quick: bool = True) -> dict[str, float]:
    """FLOP/s of fp32 linear layers' forward and backward, bytes/s of an elementwise add, seconds per graph
    op (fwd + bwd) and zero-bubble's split overhead, on this rank (AdamW's figures: measure_optimizer)."""
    reps = 5 if quick else 20
    flops = _linear_rate(reps)
    x, y = torch.randn(2**22), torch.randn(2**22)
    seconds = _median_time(lambda: torch.add(x, y), reps, repeat=8)
    bandwidth = 3 * x.numel() * 4 / seconds
    overhead = _op_overhead(100 if quick else 400)
    return {"flops": flops, "mem_bandwidth": bandwidth, "op_overhead": overhead, "split_overhead": split_overhead(reps)}


def measure_optimizer(quick: bool = True) -> dict[str, float]:
    """AdamW's elements per second and seconds per tensor as a step sees them (every rank calls this at once):
    each timed update starts at a barrier and ends when the slowest rank's does (_step_seconds), as a step's
    update starts together after its gradient all-reduce. Timed per rank instead, on 4 ranks over 2 cores
    (2026-12-02), the ranks drifted out of step and measured 150-340 M elements/s where the aligned update ran
    at 140, and a GPT step's update took 2x the time priced from the per-rank figures."""
    rate, per_tensor = _adam_costs(quick, timer=_step_seconds)
    return {"adam_rate": rate, "adam_tensor_overhead": per_tensor}


def split_overhead(reps: int, layers: int = 8, width: int = 256) -> float:
    """Seconds zero-bubble's split (runtime/pipeline/backward_split.py) adds per op with a weight over a plain backward:
    (I + W - B) over W's intermediates, on a stack of linear layers fed a received activation."""
    from meshc.runtime.pipeline.backward_split import backward_input, backward_weight

    stack = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(layers)))
    x = torch.randn(256, width, requires_grad=True)
    g = torch.randn(256, width)
    ops = []

    def plain() -> None:
        torch.autograd.backward([stack(x)], [g], inputs=[x, *stack.parameters()])

    def split() -> None:
        _, work = backward_input([stack(x)], [g], [x])
        ops.append(len(work.edges))
        backward_weight(work)
    plain(), split()  # warm-up
    extra = []
    for _ in range(2 * reps):  # paired samples, one right after the other: a shared core's drift cancels
        t0 = time.perf_counter()
        for _ in range(4):
            plain()
        t1 = time.perf_counter()
        for _ in range(4):
            split()
        extra.append((time.perf_counter() - t1 - (t1 - t0)) / 4)
    return max(statistics.median(extra), 0.0) / max(ops[-1], 1)


def _linear_rate(reps: int) -> float:
    """FLOP/s of aten.linear forward and backward (3 matmuls, two of them on transposed operands) at a few
    small-model shapes: the rate the cost model's 3 × forward FLOPs run at. A square matmul alone runs
    ~1.7× faster on one CPU thread than the backward's skinny, transposed ones, and would underpredict."""
    layers = [(torch.randn(m, k, requires_grad=True), torch.randn(n, k, requires_grad=True), torch.randn(m, n))
              for m, k, n in LINEAR_SHAPES]

    def fwd_bwd() -> None:
        for x, w, g in layers:
            torch.nn.functional.linear(x, w).backward(g)
    flops = sum(6.0 * m * k * n for m, k, n in LINEAR_SHAPES)
    return flops / _median_time(fwd_bwd, reps, repeat=5)  # samples of ~60 ms


FUSION_SHAPE = (1024, 256, 512)  # (tokens, hidden, tp-local ffn) of a small model's block on one rank


def measure_fusion(quick: bool = True) -> dict[str, float]:
    """Unfused over fused seconds of each fused kernel fuse_comm can insert, forward and backward, on this
    device (what the cost model's fusion decision reads): > 1 where the fused kernel is faster."""
    reps = 5 if quick else 15
    out = {}
    for kernel, (unfused, fused) in _fusion_cases().items():
        out[kernel] = _median_time(unfused, reps, repeat=4) / _median_time(fused, reps, repeat=4)
    return out


def _fusion_cases() -> dict:
    """kernel -> (the chain as the traced graph runs it, the fused kernel), each a forward and backward."""
    import torch.nn.functional as F

    from meshc.kernels.bias_act import bias_gelu, bias_swiglu
    from meshc.kernels.bias_dropout_add_norm import bias_dropout_add_norm
    from meshc.runtime.ops.zero import _pack, unpack_bucket

    tokens, hidden, ffn = FUSION_SHAPE
    leaf = lambda *shape: torch.randn(*shape, requires_grad=True)  # noqa: E731
    x, res, w, b, nb = leaf(tokens, hidden), leaf(tokens, hidden), leaf(hidden), leaf(hidden), leaf(hidden)
    g, u, fb = leaf(tokens, ffn), leaf(tokens, ffn), leaf(ffn)

    def norm_chain():
        s = res + F.dropout(x + b, 0.1, True)
        (F.layer_norm(s, (hidden,), w, nb).sum() + s.sum()).backward()

    def norm_fused():
        y, s = bias_dropout_add_norm(x, b, res, w, nb, p=0.1, norm="layernorm", eps=1e-5)
        (y.sum() + s.sum()).backward()
    shapes = [(hidden, hidden)] * 4 + [(ffn, hidden), (hidden, ffn), (ffn,), (hidden,)]
    params = [torch.randn(*s) for s in shapes]
    sizes = [-(-math.prod(s) // 2) for s in shapes]
    meta = types.SimpleNamespace(n=2, sizes=sizes, numels=[math.prod(s) for s in shapes], shapes=shapes)
    copies = {}
    for fused in (False, True):
        def copy(fused=fused):  # ZeRO-3's copy-in (cast + pack) and copy-out of a block's bucket
            unpack_bucket(_pack(params, sizes, torch.float32, 2, fused), types.SimpleNamespace(**vars(meta),
                                                                                               fused=fused))
        copies[fused] = (copy, lambda fused=fused: _pack(params, sizes, torch.float32, 2, fused).div_(2))
    return {
        "bias_dropout_add_norm": (norm_chain, norm_fused),
        "bias_gelu": (lambda: F.gelu(g + fb, approximate="tanh").sum().backward(),
                      lambda: bias_gelu(g, fb, "tanh").sum().backward()),
        "bias_swiglu": (lambda: (F.silu(g) * u).sum().backward(), lambda: bias_swiglu(g, u).sum().backward()),
        "zero_copy": (copies[False][0], copies[True][0]),
        "grad_prologue": (copies[False][1], copies[True][1]),
    }


def median_of(rounds: list[dict[str, float]]) -> dict[str, float]:
    """Each figure's median over several rounds of measure_compute (or over ranks)."""
    return {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}


def _op_overhead(ops: int) -> float:
    """Seconds of one tiny aten op called through torch.ops, forward and its backward under autograd."""
    aten = torch.ops.aten
    w = torch.randn(8, requires_grad=True)

    def chain():
        x = w
        for _ in range(ops // 2):
            x = aten.mul.Tensor(x, 1.0001)
            x = aten.add.Tensor(x, w)
        x.sum().backward()
    return _median_time(chain, 5, repeat=16) / ops


def measure_links(group_name: str, size: int, quick: bool = True) -> dict[str, list[tuple[float, float, float]]]:
    """Samples (latency steps, wire bytes, seconds) per collective kind over the named group of `size` ranks.

    Each collective is timed from the end of a short compute burst on every rank, as it runs inside a
    training step: a rank that reaches a collective first sleeps in it and must be woken, which on an
    oversubscribed CPU costs milliseconds that back-to-back collectives (or ones right after a barrier)
    never show."""
    barrier = dist.barrier
    samples: dict[str, list] = {"all_reduce": [], "all_gather": [], "reduce_scatter": [], "send": []}
    reps = 5 if quick else 15
    a = torch.randn(256, 256)

    def burst() -> None:  # ~5 ms: the compute between two of a tensor-parallel step's collectives
        for _ in range(16):
            torch.mm(a, a)
    for nbytes in SIZES:
        t = torch.randn(nbytes // 4)
        runs = {"all_reduce": lambda: compat.all_reduce_sum(t, group_name),
                "all_gather": lambda: compat.all_gather(t, size, group_name),
                "reduce_scatter": lambda: compat.reduce_scatter_sum(t, size, group_name),
                "send": lambda: _ping_pong(t)}
        for kind, fn in runs.items():
            seconds = _median_time(fn, reps, barrier, before=burst)
            if kind == "send":
                seconds /= 2
            samples[kind].append((float(latency_steps(kind, size)), float(wire_bytes(kind, size, nbytes)), seconds))
    return samples


def _ping_pong(t: torch.Tensor) -> None:
    rank = dist.get_rank()
    if rank > 1:
        return
    peer = 1 - rank
    if rank == 0:
        dist.send(t, peer)
        dist.recv(t, peer)
    else:
        dist.recv(t, peer)
        dist.send(t, peer)


def calibrate_rank(quick: bool = True) -> dict:
    """One rank's part of a calibration (run on every rank at once); rank 0's result is the profile dict."""
    import meshc

    torch.set_num_threads(1)
    mesh = meshc.mesh(timeout_s=120)
    dist.barrier()
    probe = ScaleProbe(mesh, quick)  # timed first, between the compute and link figures, and last
    probe.time()
    compute = measure_compute(quick)
    compute.update({f"fused.{k}": v for k, v in measure_fusion(quick).items()})
    probe.time()
    samples = measure_links(mesh.group_name("dp"), mesh.size("dp"), quick)
    everyone = [None] * mesh.world_size
    dist.all_gather_object(everyone, compute)
    hw = Hardware.from_dict(profile({**median_of(everyone), **measure_optimizer(quick)}, samples, mesh.world_size))
    hw = runtime_overheads(hw, mesh, quick, probe)
    return hw.to_dict()


def _adam_costs(quick: bool, elements: int = 2**20, few: int = 4, many: int = 256,
                timer=_median_time) -> tuple[float, float]:
    """(elements per second, seconds per tensor) of torch.optim.AdamW's step (its default implementation): the
    same elements in a few large tensors and in many small ones; what the many cost beyond the few is per tensor
    (a model's norms and biases are many small tensors: on CPU their step is mostly this). `timer(fn, reps)`:
    seconds per call (measure_optimizer passes _step_seconds)."""
    def seconds(count: int) -> float:
        params = [torch.nn.Parameter(torch.randn(elements // count)) for _ in range(count)]
        for p in params:
            p.grad = torch.randn_like(p)
        return timer(torch.optim.AdamW(params, lr=1e-3).step, 5 if quick else 15)
    t_few, t_many = seconds(few), seconds(many)
    per_tensor = max(0.0, (t_many - t_few) / (many - few))
    return elements / max(t_few - few * per_tensor, 1e-9), per_tensor


class _Blocks(torch.nn.Module):
    """A few linear blocks: the smallest model meshc can split into pipeline stages."""

    def __init__(self, width: int = 64, layers: int = 2):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh())
                                          for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:  # each a whole block: the pipeline split may cut between any two
            x = layer(x)
        return x


def _mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


def runtime_overheads(hw: Hardware, mesh, quick: bool, probe: ScaleProbe) -> Hardware:
    """The compute scale (a small GPT's data-parallel step against its roofline: `probe`, timed once more here
    after its earlier timings), then meshc's own per-step and per-pipeline-action overheads (a tiny job
    measured against its prediction)."""
    import dataclasses

    probe.time()
    hw = dataclasses.replace(hw, compute_scale=probe.scale(hw))
    hw = dataclasses.replace(hw, step_overhead=max(0.0, _job_excess(hw, {"dp": mesh.world_size}, 1, quick)))
    if mesh.world_size >= 2:
        hw = dataclasses.replace(hw, action_overhead=_action_overhead(hw, mesh.world_size, quick))
    return hw


def _action_overhead(hw: Hardware, world: int, quick: bool) -> float:
    """Seconds a pipeline action costs beyond its compute: a pipeline over every rank (pp = world, so that with
    more ranks than cores they contend for them as a real pipeline's ranks do; a 2-stage pipeline beside idle
    ranks measured 0 on 4 ranks over 2 cores) of linear blocks with a few ms of work per action, at 1 and at 8
    micro-batches of the same size. The time the 7 extra micro-batches add beyond the prediction, over what they
    add to the prediction per second of overhead (the simulated critical path's extra actions)."""
    import dataclasses

    from meshc.compiler.cost.compiled import estimate_compiled

    runs = {m: _measured_job({"pp": world}, m, quick, width=256, layers=2 * world, rows=128) for m in (1, 8)}

    def predicted(m: int, overhead: float) -> float:
        return estimate_compiled(runs[m][0].compiled, dataclasses.replace(hw, action_overhead=overhead)).step_time
    probe = 1e-3
    free = {m: predicted(m, 0.0) for m in runs}
    excess = {m: runs[m][1] - free[m] for m in runs}
    per_second = {m: (predicted(m, probe) - free[m]) / probe for m in runs}
    return max(0.0, (excess[8] - excess[1]) / max(per_second[8] - per_second[1], 1.0))


class ScaleProbe:
    """The compute scale's job: a 2-layer GPT (width 128, 128 tokens × 4 sequences per rank) on `mesh` (dp),
    compiled once and timed (`_step_seconds`) at several points of a calibration. On a shared machine one
    timing catches whatever the neighbours did in those seconds (profiles measured a minute apart on the
    2-core machine: compute scale 0.88-1.65 on 4 ranks); the median over points spread across the
    calibration is the machine's typical speed."""

    def __init__(self, mesh, quick: bool):
        import meshc
        from meshc import models

        torch.manual_seed(0)
        net = models.GPT(models.GPTConfig(vocab_size=512, seq_len=128, layers=2, heads=4, dim=128))
        self.x = torch.randint(0, 512, (4, 128))
        self.job = meshc.compile(net, mesh, example_inputs=(self.x,), plan=meshc.Plan(trace="non-strict"))
        self.opt = self.job.optimizer(torch.optim.AdamW, lr=1e-3)
        self.loss = models.lm_loss
        self.reps = 7 if quick else 20
        self.times: list[float] = []

    def step(self) -> None:
        self.job.step(self.x, self.x, self.loss)
        self.opt.step()
        self.opt.zero_grad()

    def time(self) -> None:
        self.times.append(_step_seconds(self.step, self.reps))

    def scale(self, hw: Hardware) -> float:
        """The compute scale from the median of the timings so far."""
        return compute_scale(hw, self.job.compiled, statistics.median(self.times))


def compute_scale(hw: Hardware, compiled, seconds: float) -> float:
    """Measured over predicted compute of a job's step (`compiled`, timed at `seconds`): the part of the step
    that is not communication, optimizer or overhead, over its roofline; clamped to 0.5-4. Calibration prices
    ScaleProbe's step with it; benchmarks/planner_suite.py the same step timed between the plans it measures."""
    import dataclasses

    from meshc.compiler.cost.compiled import estimate_compiled

    est = estimate_compiled(compiled, dataclasses.replace(hw, compute_scale=1.0))
    compute = est.time["compute"] + est.time["recompute"]
    return min(max((seconds - (est.step_time - compute)) / compute, 0.5), 4.0)


def _job_excess(hw: Hardware, sizes: dict, m: int, quick: bool) -> float:
    """Measured minus predicted step time of a tiny job on this world (every rank runs it)."""
    from meshc.compiler.cost.compiled import estimate_compiled

    job, measured = _measured_job(sizes, m, quick)
    return measured - estimate_compiled(job.compiled, hw).step_time


def _measured_job(sizes: dict, m: int, quick: bool, width: int = 64, layers: int = 2, rows: int = 8):
    """(job, step seconds: _step_seconds) of `layers` linear blocks of `width` on a mesh of `sizes`,
    `rows` per micro-batch and `m` micro-batches (every rank runs it)."""
    import meshc

    torch.manual_seed(0)
    mesh = meshc.mesh(timeout_s=120, **sizes)
    x, y = torch.randn(rows * m, width), torch.randn(rows * m, width)
    job = meshc.compile(_Blocks(width, layers), mesh, example_inputs=(x,),
                        plan=meshc.Plan(trace="non-strict", microbatches=m))
    opt = job.optimizer(torch.optim.AdamW, lr=1e-3)

    def step():
        job.step(x, y, _mse)
        opt.step()
        opt.zero_grad()
    return job, _step_seconds(step, 7 if quick else 20)


def _step_seconds(step, reps: int) -> float:
    """Seconds of a training step as the cost model predicts it: each of `reps` steps starts at a barrier and
    ends when its slowest rank ends (every rank's clock gathered, the max per step); the median over steps.
    (A per-rank median, or rank 0's clock alone, misses the rank that came last, which on an oversubscribed
    CPU is a different rank from step to step.)"""
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, _samples(step, reps, dist.barrier))
    return statistics.median(max(times) for times in zip(*everyone))


def profile(compute: dict[str, float], samples: dict, ranks: int, name: str = "cpu-gloo") -> dict:
    """The hardware profile (as a dict) from the measured compute figures and collective samples."""
    kinds = {}
    for kind, rows in samples.items():
        lat, bw = fit_alpha_beta(rows)
        kinds[kind] = (bw, lat)
    bw, lat = kinds.pop("all_reduce")
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / ranks
    intra = Link(bandwidth=bw, latency=lat, kinds=kinds)
    inter = Link(bandwidth=bw / 10, latency=lat * 4)  # no second node to measure: a 10x slower network, guessed
    fused = {k.split(".", 1)[1]: v for k, v in compute.items() if k.startswith("fused.")}
    hw = Hardware(name=name, flops=compute["flops"], mem_bandwidth=compute["mem_bandwidth"],
                  op_overhead=compute["op_overhead"], adam_rate=compute.get("adam_rate", 0.0),
                  adam_tensor_overhead=compute.get("adam_tensor_overhead", 0.0),
                  split_overhead=compute.get("split_overhead", 0.0),
                  memory=float(memory), ranks_per_node=ranks, cores=len(os.sched_getaffinity(0)), intra=intra,
                  inter=inter, overlap=0.0, fused_speedup=fused,
                  description=f"this machine: {ranks} processes over gloo on loopback, one thread each, measured "
                              f"by meshc calibrate on {time.strftime('%Y-%m-%d %H:%M')}")
    return hw.to_dict()


def measure_disk(folder: str, nbytes: int) -> tuple[float, float]:
    """(read, write) bytes/s of one file of `nbytes` in `folder`, the write fsynced, the read from the disk."""
    block = torch.ones(8 * 2**20, dtype=torch.uint8).numpy()
    fd, path = tempfile.mkstemp(prefix="meshc-calibrate-", dir=folder)
    try:
        t = time.perf_counter()
        for _ in range(nbytes // block.size):
            os.write(fd, block)
        os.fsync(fd)
        write = nbytes / (time.perf_counter() - t)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # the read below comes from the disk
        buf = bytearray(block.size)
        t = time.perf_counter()
        for i in range(nbytes // block.size):
            os.preadv(fd, [buf], i * block.size)
        read = nbytes / (time.perf_counter() - t)
    finally:
        os.close(fd)
        os.remove(path)
    return read, write


def calibrate(out: str, nproc: int = 2, quick: bool = False, timeout: float = 300.0,
              disk_dir: str | None = None) -> Hardware:
    """Launch the measurement on `nproc` local processes under torchrun; write and return the profile."""
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "profile.json")
        env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", "MESHC_CALIBRATE_OUT": result}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               "-m", "meshc", "calibrate", "--worker"] + (["--quick"] if quick else [])
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            raise MeshcRuntimeError(f"meshc calibrate: the measurement failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
        with open(result) as f:
            hw = Hardware.from_dict(json.load(f))
    read, write = measure_disk(disk_dir or tempfile.gettempdir(), (64 if quick else 512) * 2**20)
    hw = dataclasses.replace(hw, disk_read=read / nproc, disk_write=write / nproc)
    hw.save(out)
    return hw


def worker(quick: bool) -> int:
    """Under torchrun: measure, and rank 0 writes the profile where the launcher asked."""
    data = calibrate_rank(quick)
    if dist.get_rank() == 0:
        with open(os.environ["MESHC_CALIBRATE_OUT"], "w") as f:
            json.dump(data, f)
    dist.barrier()
    dist.destroy_process_group()
    return 0
