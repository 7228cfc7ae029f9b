"""What Plan.offload costs and saves, priced on a plan's estimate (compiler/cost/formulas.py), for the planner.

Offload moves ZeRO's per-rank optimizer states (and, for "nvme" under ZeRO-3, the parameter shards) off the
device, as runtime/zero/offload.py does, and streams them through a pool of buffers:

    memory   optimizer part -> 0 (and params part -> 0 with the shards), plus the pool
             (1/32 of the bytes moved, 1 to 64 MiB: runtime/zero/offload.py's default)
    time     the optimizer step reads and writes every state once; with the shards, ZeRO-3's gathers read
             them in forward and again in backward, and the step reads and writes them:
                 io = (states + 3 shards) / read bandwidth + (states + shards) / write bandwidth
             The update streams bucket by bucket next to its I/O, so what it adds to the step is
                 offload = max(0, io - optimizer update time)

Bandwidths are the hardware profile's: host_bandwidth (device <-> host, "cpu") and disk_read/disk_write
("nvme"); `meshc calibrate` measures the disk of a CPU machine. "cpu" offload on a CPU device is the identity
(nothing to save), so it is not offered there.
"""
from __future__ import annotations

import dataclasses

from meshc.compiler.cost.formulas import Estimate
from meshc.compiler.cost.hardware import Hardware
from meshc.compiler.ir.show import human_bytes

KINDS = ("cpu", "nvme")
POOL_MIN, POOL_MAX, POOL_FRACTION = 2**20, 64 * 2**20, 32
OFFLOAD_DIR = "<a fast local disk>"  # what a planned "nvme" plan asks the user to fill in


def is_gpu(hw: Hardware) -> bool:
    return not hw.name.startswith("cpu")


def with_offload(plan, estimate: Estimate, hw: Hardware, kind: str):
    """(the plan with Plan.offload=kind, its estimate), or None where that offload does not apply or is not
    priced by the profile."""
    if plan.zero == 0 or (kind == "cpu" and not is_gpu(hw)):
        return None
    read, write = (hw.host_bandwidth, hw.host_bandwidth) if kind == "cpu" else (hw.disk_read, hw.disk_write)
    if not read or not write:
        return None
    states = estimate.memory["optimizer"]
    shards = estimate.memory["params"] if kind == "nvme" and plan.zero == 3 else 0.0
    moved = states + shards
    pool = min(POOL_MAX, max(POOL_MIN, moved / POOL_FRACTION))
    io = (states + 3 * shards) / read + (states + shards) / write
    exposed = max(0.0, io - estimate.time.get("optimizer", 0.0))
    memory = dict(estimate.memory, optimizer=0.0, params=estimate.memory["params"] - shards,
                  buffers=estimate.memory.get("buffers", 0.0) + pool)
    time = dict(estimate.time, offload=exposed)
    where = "host memory" if kind == "cpu" else "disk"
    what = "optimizer states and parameter shards" if shards else "optimizer states"
    note = (f"offload={kind}: {what} ({human_bytes(moved)} per rank) in {where}; {human_bytes(moved + 2 * shards)} "
            f"read and {human_bytes(moved)} written per step at {read / 1e9:.3g}/{write / 1e9:.3g} GB/s")
    new = dataclasses.replace(plan, offload=kind, offload_dir=OFFLOAD_DIR if kind == "nvme" else None,
                              offload_params=bool(shards))
    return new, dataclasses.replace(estimate, memory=memory, time=time, notes=estimate.notes + (note,))
