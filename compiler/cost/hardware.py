"""Hardware profiles as data: what the cost model needs to know about a device and its links.

A profile is a small frozen dataclass that reads from and writes to JSON. Built-in profiles describe
NVIDIA H100, H200 and A100 nodes (NVLink inside a node, InfiniBand across nodes), from vendor figures
and the bus bandwidths NCCL reaches on them; "this CPU over gloo" is measured by `meshc calibrate`,
which writes a JSON file that `load("cpu")` finds.

Terms:
    flops          dense matmul FLOP/s one device reaches in the compute dtype (a fraction of its peak).
    mem_bandwidth  bytes/s that memory-bound ops (norms, activations, adds, optimizer updates) reach.
    op_overhead    seconds each graph op costs beyond its FLOPs and bytes, forward and backward together
                   (kernel launches on GPUs; Python and dispatch on CPUs).
    link           an α-β model of the collectives over one kind of connection: a collective of kind k
                   over n ranks with payload P (the tensor each rank contributes) takes
                       latency · steps(k, n) + wire(k, n, P) / bandwidth
                   with ring wire bytes (all-reduce 2(n−1)/n·P, reduce-scatter (n−1)/n·P, all-gather
                   (n−1)·P, all-to-all (n−1)/n·P, send P) and tree-like latency steps (all-reduce
                   2·log2 n, others log2 n, send 1). `kinds` overrides (bandwidth, latency) per kind
                   (gloo's all-gather and reduce-scatter are much slower than its all-reduce).
    intra / inter  the link inside one node (NVLink, loopback) and across nodes (InfiniBand); a group
                   of ranks uses `inter` as soon as it spans more than one node.
    overlap        fraction of backward compute that can hide data-parallel collectives (1 on GPUs,
                   where NCCL runs on its own stream; 0 where it cannot be relied on).
    adam_rate      elements per second an AdamW update processes (0: mem_bandwidth / 32 bytes).
    adam_tensor_overhead
                   seconds an AdamW update costs per parameter tensor beyond its elements (torch's per-tensor
                   loop on CPU: ~a dozen small ops each); `meshc calibrate` fits it from many small tensors
                   against a few large ones of the same elements; 0: not measured.
    step_overhead  seconds meshc's runtime adds to each training step beyond the graph (calibrated).
    action_overhead seconds a scheduled pipeline action (F, B, I or W) costs beyond its compute: the executor's
                   own work and, with more ranks than cores, a woken rank's wait for a core (calibrated on a
                   pipeline over the whole world).
    host_bandwidth bytes/s one rank moves between its device and host memory (PCIe; Plan.offload="cpu").
    disk_read, disk_write
                   bytes/s one rank reads and writes its offload files (Plan.offload="nvme"); `meshc
                   calibrate` measures them on this machine; 0: unknown (the planner offers no nvme offload).
    cores          CPU cores one node's ranks share (0: every rank has its own device, as on GPUs). With more
                   ranks on a node than cores, `meshc calibrate` measured the compute figures above with every
                   rank busy at once (each with cores/ranks of a core): in a pipeline, a rank that computes
                   while others wait (in its bubble) runs faster, up to a whole core, and ranks that compute
                   together share the cores (compiler/cost/compiled.py's pipeline makespan, schedule_sim's capacity).
    split_overhead seconds zero-bubble's backward split (runtime/pipeline/backward_split.py) adds per op that takes both
                   a received activation's gradient path and a parameter (one more autograd call in W), as
                   `meshc calibrate` measured it (I + W - B over those ops); 0: not measured (the split is free).
    compute_scale  a real training step's compute time over the roofline's from the figures above: what
                   microbenchmarks on reused tensors miss (fresh allocations, caches, dispatch); fitted by
                   `meshc calibrate` on a small transformer's step; 1 for the GPU profiles.
    fused_speedup  per fused kernel (fuse_comm's: bias_dropout_add_norm, bias_gelu, ...), the unfused chain's
                   time over the fused kernel's, forward and backward, as `meshc calibrate` measured it on this
                   device; a kernel not listed is predicted by compiler/cost/fusion.py from the traffic of
                   each (the fusion decision: fused where this is above 1).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass

import sympy

from meshc.compiler.ir.errors import MeshcTypeError, MeshcValueError
from meshc.compiler.ir.roofline import Rates

GiB = 2**30
KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send", "broadcast")


def _log2(n):
    return sympy.log(n, 2) if isinstance(n, sympy.Basic) else math.log2(n)


def latency_steps(kind: str, n):
    """Latency terms of one collective over n ranks (0 when n = 1: nothing is sent)."""
    if kind == "send":
        return 1
    return (2 if kind == "all_reduce" else 1) * _log2(n)


def wire_bytes(kind: str, n, payload):
    """Bytes each rank sends for one collective with `payload` bytes contributed per rank (ring)."""
    if kind == "all_reduce":
        return 2 * (n - 1) * payload / n
    if kind == "all_gather":
        return (n - 1) * payload
    if kind in ("reduce_scatter", "all_to_all"):
        return (n - 1) * payload / n
    return payload  # send, broadcast and kinds the model does not know: the payload once


@dataclass(frozen=True, kw_only=True)
class Link:
    """α-β model of one kind of connection. bandwidth: bytes/s per rank; latency: seconds per step."""

    bandwidth: float
    latency: float
    kinds: tuple[tuple[str, float, float], ...] = ()  # (kind, bandwidth, latency); a dict {kind: (bw, lat)} too

    def __post_init__(self) -> None:
        if not self.bandwidth > 0 or not self.latency >= 0:
            raise MeshcValueError(f"Link: expected bandwidth > 0 and latency >= 0, got {self.bandwidth!r}, "
                                  f"{self.latency!r}")
        kinds = self.kinds.items() if isinstance(self.kinds, dict) else [(x[0], tuple(x[1:])) for x in self.kinds]
        object.__setattr__(self, "kinds", tuple(sorted((kind, float(bw), float(lat)) for kind, (bw, lat) in kinds)))
        for kind, bw, lat in self.kinds:
            if not bw > 0 or not lat >= 0:
                raise MeshcValueError(f"Link.kinds[{kind!r}]: expected bandwidth > 0 and latency >= 0, got {bw!r}, "
                                      f"{lat!r}")

    def alpha_beta(self, kind: str) -> tuple[float, float]:
        """(latency, bandwidth) for one collective kind."""
        for name, bw, lat in self.kinds:
            if name == kind:
                return lat, bw
        return self.latency, self.bandwidth

    def time(self, kind: str, n, payload):
        """Seconds of one collective over n ranks (numbers or sympy expressions)."""
        if not isinstance(n, sympy.Basic) and n <= 1:
            return 0.0
        lat, bw = self.alpha_beta(kind)
        return lat * latency_steps(kind, n) + wire_bytes(kind, n, payload) / bw


@dataclass(frozen=True, kw_only=True)
class Hardware:
    """One device type and its links. See the module docstring for the terms."""

    name: str
    flops: float
    mem_bandwidth: float
    op_overhead: float
    memory: float  # bytes per device
    ranks_per_node: int
    intra: Link
    inter: Link
    overlap: float = 0.0
    adam_rate: float = 0.0
    adam_tensor_overhead: float = 0.0
    step_overhead: float = 0.0
    action_overhead: float = 0.0
    compute_scale: float = 1.0
    cores: int = 0
    split_overhead: float = 0.0
    host_bandwidth: float = 0.0
    disk_read: float = 0.0
    disk_write: float = 0.0
    fused_speedup: tuple[tuple[str, float], ...] = ()  # (kernel, unfused / fused time); a dict too
    description: str = ""

    def __post_init__(self) -> None:
        pairs = self.fused_speedup.items() if isinstance(self.fused_speedup, dict) else self.fused_speedup
        object.__setattr__(self, "fused_speedup", tuple(sorted((str(k), float(v)) for k, v in pairs)))
        if any(not v > 0 for _, v in self.fused_speedup):
            raise MeshcValueError(f"Hardware.fused_speedup: expected positive ratios, got {self.fused_speedup!r}")
        for name in ("flops", "mem_bandwidth", "memory", "compute_scale"):
            if not getattr(self, name) > 0:
                raise MeshcValueError(f"Hardware.{name}: expected a positive number, got {getattr(self, name)!r}")
        for name in ("op_overhead", "adam_rate", "adam_tensor_overhead", "step_overhead", "action_overhead",
                     "host_bandwidth", "disk_read", "disk_write", "split_overhead"):
            if not getattr(self, name) >= 0:
                raise MeshcValueError(f"Hardware.{name}: expected a number >= 0, got {getattr(self, name)!r}")
        if isinstance(self.ranks_per_node, bool) or not isinstance(self.ranks_per_node, int) or self.ranks_per_node < 1:
            raise MeshcValueError(f"Hardware.ranks_per_node: expected a positive int, got {self.ranks_per_node!r}")
        if isinstance(self.cores, bool) or not isinstance(self.cores, int) or self.cores < 0:
            raise MeshcValueError(f"Hardware.cores: expected an int >= 0 (0: nothing shared), got {self.cores!r}")
        if not 0.0 <= self.overlap <= 1.0:
            raise MeshcValueError(f"Hardware.overlap: expected a fraction in [0, 1], got {self.overlap!r}")

    def adam_time(self, elements, tensors: int = 0) -> float:
        """Seconds of one AdamW update of `elements` parameters held in `tensors` tensors."""
        return elements / (self.adam_rate or self.mem_bandwidth / 32) + tensors * self.adam_tensor_overhead

    def sharing(self, ranks: int) -> float:
        """How many times slower than alone a rank computes while `ranks` ranks of its node compute at once
        (1 where nothing is shared)."""
        return max(1.0, ranks / self.cores) if self.cores else 1.0

    def spans_nodes(self, stride: int, n: int) -> bool:
        """Whether a group of n ranks spaced `stride` apart (tp: 1, dp: tp, pp: dp·tp) spans nodes."""
        return n > 1 and stride * n > self.ranks_per_node

    def link(self, stride: int, n: int) -> Link:
        return self.inter if self.spans_nodes(stride, n) else self.intra

    def rates(self, sizes: dict) -> Rates:
        """The roofline's rates on this device, and a pipeline send's bytes/s on a mesh of these sizes: what the
        cost model prices a graph with and the pipeline split balances stages by (compiler/ir/roofline.py)."""
        dp, tp, pp = sizes.get("dp", 1), sizes.get("tp", 1), sizes.get("pp", 1)
        send = self.link(dp * tp, pp).alpha_beta("send")[1] if pp > 1 else float("inf")
        return Rates(self.flops, self.mem_bandwidth, self.op_overhead, self.compute_scale, send)

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        for key in ("intra", "inter"):
            out[key]["kinds"] = {kind: [bw, lat] for kind, bw, lat in out[key]["kinds"]}
        out["fused_speedup"] = dict(self.fused_speedup)
        return out

    @staticmethod
    def from_dict(data: dict) -> "Hardware":
        data = dict(data)
        for key in ("intra", "inter"):
            link = dict(data[key])
            link["kinds"] = {kind: tuple(value) for kind, value in link.get("kinds", {}).items()}
            data[key] = Link(**link)
        known = {f.name for f in dataclasses.fields(Hardware)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise MeshcValueError(f"hardware profile: unknown field {unknown[0]!r}: expected fields among "
                                  f"{', '.join(sorted(known))}")
        return Hardware(**data)

    def save(self, path: str) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=2)


def _gpu(name, *, peak, hbm, memory, nvlink, ib, pcie, description) -> Hardware:
    # Large GEMMs reach about 70% of the dense peak; NCCL's bus bandwidth about 80% of the link's; copies about
    # 80% of PCIe's. Disks: a node's NVMe array shared by its 8 GPUs, about 6 GB/s read and 3 GB/s written each
    # (vendor figures for 8 data-center drives; `meshc calibrate` measures a real one).
    return Hardware(name=name, flops=0.7 * peak, mem_bandwidth=0.8 * hbm, op_overhead=1.5e-5, memory=memory,
                    ranks_per_node=8, intra=Link(bandwidth=0.8 * nvlink, latency=1e-5),
                    inter=Link(bandwidth=0.8 * ib, latency=2e-5), overlap=1.0, host_bandwidth=0.8 * pcie,
                    disk_read=6e9, disk_write=3e9, description=description)


PROFILES: dict[str, Hardware] = {
    "h100": _gpu("h100", peak=989e12, hbm=3.35e12, memory=80 * GiB, nvlink=450e9, ib=50e9, pcie=64e9,
                 description="8x H100 SXM per node: bf16 989 TFLOP/s dense, HBM3 3.35 TB/s, NVLink4 450 GB/s "
                             "per direction, one 400 Gb/s InfiniBand NIC per GPU"),
    "h200": _gpu("h200", peak=989e12, hbm=4.8e12, memory=140 * GiB, nvlink=450e9, ib=50e9, pcie=64e9,
                 description="8x H200 SXM per node: bf16 989 TFLOP/s dense, HBM3e 4.8 TB/s, NVLink4 450 GB/s "
                             "per direction, one 400 Gb/s InfiniBand NIC per GPU"),
    "a100": _gpu("a100", peak=312e12, hbm=2.04e12, memory=80 * GiB, nvlink=300e9, ib=25e9, pcie=32e9,
                 description="8x A100 80GB SXM per node: bf16 312 TFLOP/s dense, HBM2e 2.04 TB/s, NVLink3 "
                             "300 GB/s per direction, one 200 Gb/s InfiniBand NIC per GPU"),
    # Uncalibrated defaults for a small CPU box (this project's machine, FACTS.md); `meshc calibrate` measures.
    "cpu-default": Hardware(
        name="cpu-default", flops=4e10, mem_bandwidth=5e9, op_overhead=3e-5, memory=8 * GiB, ranks_per_node=2,
        intra=Link(bandwidth=1.1e9, latency=5e-5, kinds={"all_gather": (0.25e9, 5e-5), "reduce_scatter": (0.27e9, 5e-5)}),
        inter=Link(bandwidth=1.2e8, latency=1e-4), overlap=0.0, disk_read=1e9, disk_write=5e8,
        # measured on this project's machine (calibrate.measure_fusion, one thread, 2026-12): the kernels' CPU
        # implementations are pure torch (the dropout mask a Philox in int64 arithmetic), 2-10x slower
        fused_speedup={"bias_dropout_add_norm": 0.10, "bias_gelu": 0.15, "bias_swiglu": 0.37, "zero_copy": 0.48,
                       "grad_prologue": 0.37},
        description="uncalibrated guesses for 2 CPU processes over gloo on loopback; run `meshc calibrate`"),
}


def default_cpu_path() -> str:
    """Where `meshc calibrate` writes the CPU profile and `load("cpu")` reads it ($MESHC_HARDWARE wins)."""
    if os.environ.get("MESHC_HARDWARE"):
        return os.environ["MESHC_HARDWARE"]
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "meshc", "cpu-gloo.json")


def load(spec: "str | Hardware") -> Hardware:
    """A profile by name ("h100", "h200", "a100", "cpu"), from a JSON file path, or as given.

    "cpu" is the calibrated profile `meshc calibrate` wrote, or the uncalibrated default if there is none.
    """
    if isinstance(spec, Hardware):
        return spec
    if not isinstance(spec, str):
        raise MeshcTypeError(f"hardware: expected a profile name or a JSON path, got {type(spec).__name__}")
    key = spec.lower()
    if key in PROFILES:
        return PROFILES[key]
    if key == "cpu":
        path = default_cpu_path()
        return load_file(path) if os.path.exists(path) else PROFILES["cpu-default"]
    if spec.endswith(".json"):
        return load_file(spec)
    raise MeshcValueError(f"hardware: unknown profile {spec!r}: expected one of {', '.join(PROFILES)}, 'cpu', "
                          "or a .json file written by `meshc calibrate`")


def load_file(path: str) -> Hardware:
    if not os.path.exists(path):
        raise MeshcValueError(f"hardware: expected a profile file at {path}, got none; run `meshc calibrate --out "
                              f"{path}`")
    with open(path) as f:
        return Hardware.from_dict(json.load(f))


def detect() -> Hardware:
    """The profile of the device this process runs on: a known GPU by name, else the CPU profile."""
    import torch

    if torch.cuda.is_available():
        name = torch.cuda.get_device_name().lower()
        for key in ("h200", "h100", "a100"):
            if key in name:
                return PROFILES[key]
        return PROFILES["h100"]
    return load("cpu")


def for_device(device_type: str) -> Hardware:
    """The profile a mesh of `device_type` runs on: this GPU's ("cuda"), else the CPU profile."""
    return detect() if device_type == "cuda" else load("cpu")


def fit_alpha_beta(samples: list[tuple[float, float, float]]) -> tuple[float, float]:
    """Least-squares (latency, bandwidth) from samples (latency steps, wire bytes, seconds): t = α·steps + w/β."""
    a11 = sum(s * s for s, _, _ in samples)
    a12 = sum(s * w for s, w, _ in samples)
    a22 = sum(w * w for _, w, _ in samples)
    b1 = sum(s * t for s, _, t in samples)
    b2 = sum(w * t for _, w, t in samples)
    det = a11 * a22 - a12 * a12
    if det <= 0:
        raise MeshcValueError(f"calibrate: expected samples at several sizes, got {len(samples)}")
    alpha = (b1 * a22 - b2 * a12) / det
    inv_beta = (a11 * b2 - a12 * b1) / det
    if alpha < 0:  # noise at small sizes: no latency, bandwidth by least squares through the origin
        alpha = 0.0
        inv_beta = sum(w * t for _, w, t in samples) / a22
    if inv_beta <= 0:  # noise at large sizes (latency-bound): bandwidth from the largest sample's excess
        steps, wire, seconds = max(samples, key=lambda x: x[1])
        inv_beta = max(seconds - alpha * steps, 0.1 * seconds) / wire
    return alpha, 1.0 / inv_beta
