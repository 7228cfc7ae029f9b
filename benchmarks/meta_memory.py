"""Memory of starting a model bigger than it should be per rank: meta-device build + initialization (or
loading from a sharded Hugging Face-layout folder) under ZeRO-3, side by side with FSDP2's meta-device init
and with a model materialized on every rank, in one run.

    python benchmarks/meta_memory.py [--nproc 4] [--layers 16] [--before-python PATH]

Model: meshc's built-in GPT at gpt2-medium's width (dim 1024, 16 heads) with `--layers` blocks and GPT-2's
vocabulary: 252M parameters, 1.0 GB in fp32 at 16 layers. ZeRO-3 (FSDP2: fully_shard per block and root) on
`--nproc` gloo ranks, AdamW, 2 steps of 1 sequence of 128 tokens per rank. Every rank runs with
MALLOC_MMAP_THRESHOLD_=131072 so that freed tensors go back to the OS and RSS means what is held.

Per rank: peak = VmHWM at the end minus RSS before the model is built; steady = RSS after the steps (model
and optimizer alive) minus the same; held = bytes of the parameter shards, gradients and optimizer states. The formula: 16 Psi / N (fp32 parameters, gradients and AdamW's two states, each rank its 1/N)
plus the largest parameter (initialization builds one whole tensor at a time). `--before-python` runs the
`materialized` row again with another checkout's interpreter (meshc before meta-device support). DeepSpeed
(`pip install -e ".[bench]"`) runs on CPU with DS_ACCELERATOR=cpu; its zero.Init partitions each module as
the model's constructor builds it.
"""
from __future__ import annotations

import importlib.util
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import arg_parser, launch, report, rss_mib, run_worker, table  # noqa: E402

SEQ, STEPS = 128, 2


def _build(layers: int, meta: bool):
    import torch

    from meshc import models

    if meta:
        with torch.device("meta"):
            return models.build("gpt2-medium", layers=layers, seq_len=SEQ)
    torch.manual_seed(0)
    return models.build("gpt2-medium", layers=layers, seq_len=SEQ)


def _batch(vocab: int, rank: int):
    import torch

    g = torch.Generator().manual_seed(rank)
    tokens = torch.randint(0, vocab, (1, SEQ + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _loss(out, y):
    import torch.nn.functional as F

    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def _meshc(cfg: dict, base: float) -> tuple[list, float, int]:
    import gc

    import torch

    import meshc

    mesh = meshc.mesh(host_malloc=False)  # MALLOC_MMAP_THRESHOLD_ above kept: RSS means what is held
    model = _build(cfg["layers"], meta=cfg["mode"] != "materialized")
    params = sum(p.numel() for p in model.parameters())
    x, y = _batch(50257, mesh.rank)
    job = meshc.compile(model, mesh, example_inputs=(x,), plan=meshc.Plan(zero=3, trace="non-strict"))
    del model  # the user's own reference: what stays is the job's
    gc.collect()
    if cfg["mode"] == "meta-init":
        job.init_weights(seed=0)
    elif cfg["mode"] == "meta-load":
        job.load_pretrained(cfg["folder"])
    ready = (rss_mib() - base, rss_mib("VmHWM") - base)  # held, and peak so far, once weights are ready
    opt = job.optimizer(torch.optim.AdamW, lr=1e-4)
    losses = []
    for _ in range(STEPS):
        losses.append(job.step(x, y, _loss).item())
        opt.step()
        opt.zero_grad()
    return losses, ready, params, sum(job.held_bytes().values()) / 2**20, rss_mib() - base


def _fsdp2(cfg: dict, base: float) -> tuple[list, float, int]:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    model = fsdp2_model(cfg["layers"])
    params = sum(p.numel() for p in model.parameters())
    ready = (rss_mib() - base, rss_mib("VmHWM") - base)  # held, and peak so far, once weights are ready
    x, y = _batch(50257, dist.get_rank())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    losses = []
    for _ in range(STEPS):
        loss = _loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, ready, params, _held(model.parameters(), opt), rss_mib() - base


def fsdp2_model(layers: int):
    """The model built on the meta device, fully_shard per block and root, materialized and initialized sharded."""
    import torch
    from torch.distributed.fsdp import fully_shard

    model = _build(layers, meta=True)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        for m in model.modules():
            if hasattr(m, "reset_parameters"):
                m.reset_parameters()
        model.apply(model._init_weights)
    return model


def _deepspeed(cfg: dict, base: float) -> tuple[list, float, int]:
    os.environ["DS_ACCELERATOR"] = "cpu"
    import deepspeed
    import torch
    import torch.distributed as dist

    deepspeed.init_distributed(dist_backend="gloo")
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
              "zero_allow_untested_optimizer": True}
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=config):
        model = _build(cfg["layers"], meta=False)  # zero.Init partitions each module as it is constructed
    params = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    ready = (rss_mib() - base, rss_mib("VmHWM") - base)  # held, and peak so far, once weights are ready
    x, y = _batch(50257, dist.get_rank())
    losses = []
    for _ in range(STEPS):
        loss = _loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses, ready, params, float("nan"), rss_mib() - base  # its flat partitions live inside its engine


def _held(parameters, opt) -> float:
    """MiB of the local parameter shards, gradients and optimizer states (DTensors: their local parts)."""
    def local(t):
        return t.to_local() if hasattr(t, "to_local") else t
    tensors = [local(p) for p in parameters] + [local(p.grad) for p in opt.param_groups[0]["params"]
                                                  if p.grad is not None]
    tensors += [local(v) for st in opt.state.values() for v in st.values() if hasattr(v, "dim") and v.dim() > 0]
    return sum(t.numel() * t.element_size() for t in tensors) / 2**20


def worker(cfg: dict) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    base = rss_mib()
    run = {"fsdp2": _fsdp2, "deepspeed": _deepspeed}.get(cfg["mode"], _meshc)
    losses, ready, params, held, steady = run(cfg, base)  # steady: measured while the model and optimizer live
    mine = {"peak": rss_mib("VmHWM") - base, "steady": steady, "ready": ready, "held": held}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    report({"ranks": everyone, "losses": losses, "params": params})
    dist.destroy_process_group()


def _save_folder(layers: int, folder: str) -> None:
    """The model's weights as Hugging Face's sharded layout: model-0000k-of-0000n.safetensors + index.json."""
    from safetensors.torch import save_file

    import meshc

    model = meshc.init_weights(_build(layers, meta=True), seed=0)
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "head.weight"}  # tied: saved once
    names, shards, size = list(state), [[]], 0
    for k in names:
        if size > 200 * 2**20:
            shards.append([])
            size = 0
        shards[-1].append(k)
        size += state[k].numel() * state[k].element_size()
    weight_map = {}
    for i, keys in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({k: state[k] for k in keys}, os.path.join(folder, file))
        weight_map.update({k: file for k in keys})
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    del model, state


def main() -> None:
    p = arg_parser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--only", default="", help="comma-separated rows to run (meta-init, meta-load, materialized, "
                                               "fsdp2, deepspeed, before); default all")
    p.add_argument("--before-python", default=None, help="an interpreter whose meshc predates meta-device support")
    args = p.parse_args()
    if run_worker(args, worker):
        return
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "131072"
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        _save_folder(args.layers, folder)
        modes = [("meshc, meta + init_weights", {"mode": "meta-init"}, None),
                 ("meshc, meta + load_pretrained", {"mode": "meta-load", "folder": folder}, None),
                 ("meshc, materialized on every rank", {"mode": "materialized"}, None),
                 ("FSDP2, meta + to_empty + init", {"mode": "fsdp2"}, None),
                 ("DeepSpeed, zero.Init", {"mode": "deepspeed"}, None)]
        if args.before_python:
            modes.append(("meshc before (materialized)", {"mode": "materialized"}, args.before_python))
        wanted = set(filter(None, args.only.split(",")))
        for label, cfg, python in modes:
            name = "before" if python else cfg["mode"]
            if wanted and name not in wanted:
                continue
            if cfg["mode"] == "deepspeed" and importlib.util.find_spec("deepspeed") is None:
                rows.append({"run": label, "losses": "not installed: pip install -e '.[bench]'"})
                continue
            out = launch(os.path.abspath(__file__), args.nproc, {**cfg, "layers": args.layers}, timeout=1800,
                         python=python, exit_code_ok=True)
            psi = out["params"]
            formula = (16 * psi / args.nproc + 1024 * 50257 * 4) / 2**20
            rows.append({"run": label, "init peak MiB": max(r["ready"][1] for r in out["ranks"]),
                         "peak MiB (max rank)": max(r["peak"] for r in out["ranks"]),
                         "steady MiB (max rank)": max(r["steady"] for r in out["ranks"]),
                         "held MiB": max(r["held"] for r in out["ranks"]),
                         "formula MiB": formula,
                         "peak / formula": max(r["peak"] for r in out["ranks"]) / formula,
                         "losses": " ".join(f"{v:.4f}" for v in out["losses"]),
                         "exit": out["exit_code"]})
            print(rows[-1], flush=True)
    print(f"\n{psi / 1e6:.0f}M parameters ({psi * 4 / 2**30:.2f} GiB fp32), ZeRO-3 on {args.nproc} gloo ranks, AdamW")
    print(table(rows, ["run", "init peak MiB", "peak MiB (max rank)", "steady MiB (max rank)", "held MiB", "formula MiB", "peak / formula",
                       "losses", "exit"]))


if __name__ == "__main__":
    main()
