"""Offload to disk (Plan.offload="nvme") under ZeRO-3: peak and steady RSS per rank and step time, without
offload, with the optimizer states in the file, with states and parameter shards; side by side with DeepSpeed
ZeRO-3 offloading to nvme in the same run.

    make bench-deps                      # DeepSpeed and libaio (its nvme path's async I/O library)
    python benchmarks/offload_bench.py [--nproc 2,4] [--layers 8] [--steps 4]

Model: meshc's built-in GPT at gpt2-medium's width (dim 1024, 16 heads) with `--layers` blocks and GPT-2's
vocabulary (152M parameters at 8 layers), AdamW, one sequence of 128 tokens per rank and step; gloo ranks, one
thread each, MALLOC_MMAP_THRESHOLD_=131072 so that freed tensors go back to the OS and RSS means what is held.
The model is built on the meta device and each rank initializes its shards (job.init_weights; DeepSpeed:
zero.Init). Per rank: init peak = VmHWM once the optimizer is made, minus RSS before the model is built; peak =
VmHWM of the steps alone (reset through /proc/self/clear_refs after initialization) minus the same; steady =
RSS after the steps minus the same; step = median seconds of the steps after the first (forward, backward, optimizer step). "offloaded" is
what meshc's job.held_bytes() counts in the store; "RSS saved" is the no-offload row's peak minus this row's,
as a fraction of the bytes offloaded (goal: at least 0.9); "step vs none" is the step time over the same
framework's ZeRO-3 without offload (goal: meshc's below DeepSpeed's); DeepSpeed's "offloaded" is the formula
(8 bytes of AdamW states per parameter over the ranks, 4 more with the parameters). The offload files live in a temporary folder of
`--dir` (default: the system's temporary folder); the page cache is not the process's memory, and reads of
recently written states come from it, as on any buffered file system.

DeepSpeed (0.19.8, DS_ACCELERATOR=cpu): stage 3 with offload_optimizer (and offload_param) to nvme through its
async_io op (libaio); its CPU accelerator has no DeepSpeedCPUAdam, so its step runs torch's AdamW on the
swapped-in states (zero_force_ds_cpu_optimizer off).
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import last_error, arg_parser, launch, report, rss_mib, run_worker, table  # noqa: E402

SEQ = 128


def _model(layers: int, meta: bool = False):
    import torch

    from meshc import models

    torch.manual_seed(0)
    with torch.device("meta" if meta else "cpu"):
        return models.build("gpt2-medium", layers=layers, seq_len=SEQ)


def _reset_peak() -> None:
    """Start VmHWM again from the current RSS (Linux: clear_refs 5), so that the next peak is the steps'."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _batch(rank: int):
    import torch

    g = torch.Generator().manual_seed(rank)
    tokens = torch.randint(0, 50257, (1, SEQ + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _loss(out, y):
    import torch.nn.functional as F

    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def _meshc(cfg: dict, base: float) -> dict:
    import torch

    import meshc

    mesh = meshc.mesh()
    x, y = _batch(mesh.rank)
    extra = {}
    if cfg["mode"] != "none":
        extra = dict(offload="nvme", offload_dir=cfg["dir"], offload_params=cfg["mode"] == "states+params")
    job = meshc.compile(_model(cfg["layers"], meta=True), mesh, example_inputs=(x,),
                        plan=meshc.Plan(zero=3, trace="non-strict", **extra))
    job.init_weights(seed=0)  # each rank builds only its shards
    opt = job.optimizer(torch.optim.AdamW, lr=1e-4)
    init_peak = rss_mib("VmHWM") - base
    _reset_peak()
    times, losses = [], []
    for _ in range(cfg["steps"]):
        t = time.perf_counter()
        losses.append(job.step(x, y, _loss).item())
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t)
    held = job.held_bytes()
    return {"times": times, "losses": losses, "offloaded": held.get("offloaded", 0) / 2**20,
            "pool": held.get("offload_pool", 0) / 2**20, "steady": rss_mib() - base, "init_peak": init_peak}


def _deepspeed(cfg: dict, base: float) -> dict:
    os.environ["DS_ACCELERATOR"] = "cpu"
    import deepspeed
    import torch
    import torch.distributed as dist

    deepspeed.init_distributed(dist_backend="gloo")
    nvme = {"device": "nvme", "nvme_path": cfg["dir"], "pin_memory": False}
    zero = {"stage": 3} if cfg["mode"] == "ds-none" else {"stage": 3, "offload_optimizer": dict(nvme, buffer_count=4)}
    if cfg["mode"] == "ds-states+params":
        zero["offload_param"] = dict(nvme, buffer_count=5, buffer_size=int(2.6e7), max_in_cpu=0)  # > largest shard
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": zero, "zero_allow_untested_optimizer": True,
              "zero_force_ds_cpu_optimizer": False,
              "aio": {"block_size": 1048576, "queue_depth": 8, "thread_count": 1, "single_submit": False,
                      "overlap_events": True}}
    with deepspeed.zero.Init(config_dict_or_path=config):
        model = _model(cfg["layers"])  # zero.Init partitions each module as it is constructed
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    init_peak = rss_mib("VmHWM") - base
    _reset_peak()
    x, y = _batch(dist.get_rank())
    times, losses = [], []
    for _ in range(cfg["steps"]):
        t = time.perf_counter()
        loss = _loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - t)
        losses.append(loss.item())
    psi = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
    n = dist.get_world_size()  # what it offloads, from the formula (its swapper keeps no count we can read)
    offloaded = 0 if cfg["mode"] == "ds-none" else (8 + (4 if cfg["mode"] == "ds-states+params" else 0)) * psi / n
    return {"times": times, "losses": losses, "offloaded": offloaded / 2**20, "pool": float("nan"),
            "steady": rss_mib() - base, "init_peak": init_peak}


def worker(cfg: dict) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    base = rss_mib()
    out = (_deepspeed if cfg["mode"].startswith("ds-") else _meshc)(cfg, base)
    out["peak"] = rss_mib("VmHWM") - base
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, out)
    report({"ranks": everyone})
    dist.destroy_process_group()


def _median(xs: list) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2]


def main() -> None:
    p = arg_parser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", default="2,4")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--dir", default=None, help="where the offload files go (a temporary folder inside it)")
    p.add_argument("--only", default="", help="comma-separated rows (none, states, states+params, ds-none, "
                                               "ds-states, ds-states+params); default all")
    args = p.parse_args()
    if run_worker(args, worker):
        return
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "131072"
    wanted = set(filter(None, args.only.split(",")))
    ds_ready = _deepspeed_ready()
    rows = []
    for nproc in [int(n) for n in args.nproc.split(",")]:
        baseline = None
        for label, mode in [("meshc ZeRO-3", "none"), ("meshc ZeRO-3, nvme states", "states"),
                            ("meshc ZeRO-3, nvme states + params", "states+params"),
                            ("DeepSpeed ZeRO-3", "ds-none"),
                            ("DeepSpeed ZeRO-3, nvme states", "ds-states"),
                            ("DeepSpeed ZeRO-3, nvme states + params", "ds-states+params")]:
            if wanted and mode not in wanted:
                continue
            if mode.startswith("ds-") and ds_ready is not True:
                rows.append({"ranks": nproc, "run": label, "losses": ds_ready})
                continue
            folder = tempfile.mkdtemp(prefix="offload-bench-", dir=args.dir)
            try:
                out = launch(os.path.abspath(__file__), nproc, {"mode": mode, "layers": args.layers,
                                                                "steps": args.steps, "dir": folder}, timeout=3600,
                             exit_code_ok=True)  # a rank lost at exit, after its result: shown in "exit"
            except RuntimeError as e:
                if not mode.startswith("ds-"):
                    raise
                rows.append({"ranks": nproc, "run": label, "losses": "failed: " + last_error(str(e))})
                print(rows[-1], flush=True)
                continue
            finally:
                shutil.rmtree(folder, ignore_errors=True)
            ranks = out["ranks"]
            peak = max(r["peak"] for r in ranks)  # of the steps (VmHWM reset after initialization)
            offloaded = max(r["offloaded"] for r in ranks)
            row = {"ranks": nproc, "run": label, "init peak MiB": max(r["init_peak"] for r in ranks), "peak MiB": peak, "steady MiB": max(r["steady"] for r in ranks),
                   "offloaded MiB": offloaded, "pool MiB": max(r["pool"] for r in ranks),
                   "step s": max(_median(r["times"][1:]) for r in ranks),
                   "losses": " ".join(f"{v:.4f}" for v in ranks[0]["losses"]), "exit": out["exit_code"]}
            if mode in ("none", "ds-none"):  # each framework's offload rows against its own ZeRO-3
                baseline = row
            elif baseline is not None:
                row["RSS saved / offloaded"] = (baseline["peak MiB"] - peak) / offloaded if offloaded == offloaded \
                    and offloaded else float("nan")
                row["step vs none"] = row["step s"] / baseline["step s"]
            rows.append(row)
            print(row, flush=True)
    print(f"\nbuilt-in GPT, gpt2-medium width, {args.layers} layers, ZeRO-3, AdamW, 1x{SEQ} tokens per rank")
    print(table(rows, ["ranks", "run", "init peak MiB", "peak MiB", "steady MiB", "offloaded MiB", "pool MiB", "RSS saved / offloaded",
                       "step s", "step vs none", "losses", "exit"]))


def _deepspeed_ready():
    """True, or why DeepSpeed's nvme rows cannot run here."""
    if importlib.util.find_spec("deepspeed") is None:
        return "not installed: make bench-deps"
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        from deepspeed.ops.op_builder import AsyncIOBuilder

        if not AsyncIOBuilder().is_compatible(verbose=False):
            return "DeepSpeed's async_io op needs libaio (make bench-deps installs Debian's libaio-dev)"
    except Exception as e:  # noqa: BLE001 - reported in the table
        return f"DeepSpeed's async_io op unavailable: {e}"
    return True


if __name__ == "__main__":
    main()
