"""Two ranks: meshc's per-rank programs compiled by Inductor against torch's own parallelism under torch.compile,
in one run per mesh, the rows interleaved.

    python benchmarks/compiled_ranks.py [--mesh dp tp] [--rounds 3] [--per-round 3] [--out docs/compiled_ranks.md]

Model and batch of benchmarks/tp_bench.py (torch's reference Transformer, 4 layers, dim 256, 8 heads, vocab 1024,
tied head, global batch 8 x 128), fp32, AdamW, gloo on loopback, one thread per rank, every row from the same
weights. Rows per mesh (all built in the same two processes, then timed in `--rounds` interleaved rounds of
`--per-round` steps after one untimed step, a barrier before each):
  dp=2   DDP + torch.compile; FSDP2 (fully_shard per block) + torch.compile; meshc dp and meshc ZeRO-3, each as FX
         code and with Inductor (ZeRO-3's gathers graph nodes recomputed in backward)
  tp=2   DTensor TP (parallelize_module) + torch.compile; meshc TP as FX code and with Inductor
  pp=2   meshc ZB-H1 (4 micro-batches) as FX code and with Inductor (each stage's backward compiled as an input and a
         weight half, runtime/compiled_split.py), and 1F1B likewise
  ep=2   an MoE of the same size (transformers' Mixtral, 4 layers, 4 experts of 512, top-2, dp=2 x ep=2), meshc as
         FX code and with Inductor (the routing run as FX code between compiled regions, runtime/regions.py)
First-step seconds include tracing and compiling. Ratios against the torch row of the same kind ("vs torch"), and of
each Inductor row against the same plan as FX code ("vs FX").
"""
from __future__ import annotations

import datetime
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import arg_parser, interleaved_times, launch, lm_loss, report, run_worker, table  # noqa: E402
from tp_bench import _data, _model  # noqa: E402

ROWS = {"dp": ["DDP + torch.compile", "FSDP2 + torch.compile", "meshc dp FX", "meshc dp Inductor", "meshc ZeRO-3 FX",
               "meshc ZeRO-3 Inductor"],
        "tp": ["DTensor TP + torch.compile", "meshc TP FX", "meshc TP Inductor"],
        "pp": ["meshc ZB-H1 FX", "meshc ZB-H1 Inductor", "meshc 1F1B FX", "meshc 1F1B Inductor"],
        "ep": ["meshc ep FX", "meshc ep Inductor"]}
PEERS = {"meshc dp": "DDP + torch.compile", "meshc ZeRO-3": "FSDP2 + torch.compile", "meshc TP": "DTensor TP + torch.compile"}


def _torch_row(name: str, mesh, x, y):
    import torch

    model = _model()
    if name.startswith("DDP"):
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model, process_group=mesh.group("dp"))
    elif name.startswith("FSDP2"):
        from torch.distributed.fsdp import fully_shard

        for layer in model.layers:
            fully_shard(layer, mesh=mesh.device_mesh["dp"])
        fully_shard(model, mesh=mesh.device_mesh["dp"])
    else:
        model = type(model).parallelize(model, mesh.device_mesh["tp"], use_seq_parallel=False,
                                        local_output_for_attn=True)
    forward = torch.compile(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step():
        loss = lm_loss(forward(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss
    return step, ""


def _meshc_row(name: str, mesh, x, y):
    import torch

    import meshc

    plan = {"inductor": name.endswith("Inductor"), "zero": 3 if "ZeRO-3" in name else 0}
    if " ZB-H1 " in name or " 1F1B " in name:
        plan.update(microbatches=4, schedule=name.split()[1].lower())
    model = _moe() if " ep " in name else _model()
    job = meshc.compile(model, mesh, example_inputs=(x,), plan=meshc.Plan(trace="non-strict", **plan))
    opt = job.optimizer(torch.optim.AdamW, lr=1e-3)

    def step():
        loss = job.step(x, y, lambda out, t: lm_loss(getattr(out, "logits", out), t))
        opt.step()
        opt.zero_grad()
        return loss
    return step, job


def _moe():
    """transformers' Mixtral at the reference Transformer's size: 4 layers, dim 256, 8 heads, vocab 1024, with 4
    experts of 512 per block, top-2."""
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    return MixtralForCausalLM(MixtralConfig(num_hidden_layers=4, hidden_size=256, num_attention_heads=8,
                                            num_key_value_heads=8, intermediate_size=512, vocab_size=1024,
                                            max_position_embeddings=128, num_local_experts=4, num_experts_per_tok=2,
                                            use_cache=False, bos_token_id=0, eos_token_id=0, pad_token_id=0))


def worker(config: dict) -> None:
    import torch
    import torch.distributed as dist

    import meshc

    torch.set_num_threads(1)
    world = int(os.environ["WORLD_SIZE"])
    sizes = {"dp": world, "ep": world} if config["mesh"] == "ep" else {config["mesh"]: world}
    mesh = meshc.mesh(timeout_s=900, **sizes)
    x, y = (mesh.shard_batch(t) for t in _data())
    steps, first, notes, losses = [], {}, {}, {}
    for name in ROWS[config["mesh"]]:
        dist.barrier()
        t0 = time.perf_counter()
        step, job = (_meshc_row if name.startswith("meshc") else _torch_row)(name, mesh, x, y)
        losses[name] = float(step())
        first[name] = time.perf_counter() - t0
        if job:
            stats = job.inductor.stats
            notes[name] = (f"{stats.forward} fw + {stats.backward} bw graphs compiled" +
                           (f", {stats.regions} regions around {len(stats.eager)} FX ops" if stats.regions else "")) \
                if stats.programs else "FX code"
        steps.append(step)
    times = interleaved_times(steps, config["rounds"], config["per_round"], barrier=dist.barrier)
    report({"median": {n: statistics.median(t) for n, t in zip(ROWS[config["mesh"]], times)}, "first": first,
            "notes": notes, "losses": losses})
    dist.barrier()


def main() -> None:
    p = arg_parser(description=__doc__.splitlines()[0])
    p.add_argument("--mesh", nargs="+", default=["dp", "tp"], choices=sorted(ROWS))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--per-round", type=int, default=3)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if run_worker(args, worker):
        return
    import torch

    text = (f"compiled_ranks, {datetime.date.today()}, torch {torch.__version__}, 2 ranks (gloo, 1 thread each), "
            f"{args.rounds} rounds x {args.per_round} steps\n")
    for kind in args.mesh:
        result = launch(os.path.abspath(__file__), 2, {"mesh": kind, "rounds": args.rounds,
                                                        "per_round": args.per_round}, timeout=1800)
        med = result["median"]
        rows = []
        for name in ROWS[kind]:
            peer = next((v for k, v in PEERS.items() if name.startswith(k)), None)
            fx = name.replace(" Inductor", " FX")
            rows.append({"mesh": f"{kind}=2", "row": name, "first step s": f"{result['first'][name]:.1f}",
                         "median step ms": f"{med[name] * 1e3:.1f}",
                         "vs torch": f"{med[name] / med[peer]:.2f}" if peer else ("1" if name in PEERS.values() else "-"),
                         "vs FX": f"{med[name] / med[fx]:.2f}" if name.endswith(" Inductor") and fx in med else "-",
                         "first loss": f"{result['losses'][name]:.4f}", "note": result["notes"].get(name, "")})
        text += "\n" + table(rows, ["mesh", "row", "first step s", "median step ms", "vs torch", "vs FX",
                                    "first loss", "note"]) + "\n"
        print(text, flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
