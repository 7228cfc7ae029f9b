"""Tensor parallelism: meshc against PyTorch DTensor TP (`parallelize_module`) on the same model, ranks
and batch, in one run; and the bytes meshc sends against Megatron's formula.

    python benchmarks/tp_bench.py [--tp 2] [--steps 10]

Model: torch's reference Transformer (4 layers, dim 256, 8 heads, vocab 1024, tied head), batch 8,
seq 128, fp32, AdamW; gloo on loopback, one thread per rank. Median step (forward + backward + AdamW).
Bytes: every collective intercepted at dispatch (CommCensus), converted to ring wire bytes per rank, and
compared with 8·b·s·h·(t−1)/t elements per layer per micro-batch (Megatron-LM's TP volume).
"""
from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import (arg_parser, launch, lm_loss, median_step, reference_transformer, report, run_worker,  # noqa: E402
                    table, token_batch, wire_bytes)

LAYERS, DIM, HEADS, VOCAB, SEQ, BATCH = 4, 256, 8, 1024, 128, 8


def _model():
    """The model of this benchmark (and of zero_bench, backend_bench, checkpoint_bench): tied head."""
    return reference_transformer(LAYERS, DIM, HEADS, VOCAB, SEQ)


def _data():
    return token_batch(BATCH, SEQ, VOCAB)


def worker(config: dict) -> None:
    import torch
    import torch.distributed as dist

    import meshc
    from meshc.runtime.monitor.census import CommCensus

    torch.set_num_threads(1)
    x, y = _data()
    impl = config["impl"]
    if impl == "single":
        model = _model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

        def step():
            lm_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        report({"impl": impl, "step_s": median_step(step, steps=config["steps"]), "loss": lm_loss(model(x), y).item()})
        return
    mesh = meshc.mesh(tp=config["tp"], timeout_s=300)
    if impl == "meshc":
        job = meshc.compile(_model(), mesh, example_inputs=(x,), plan=meshc.Plan(**config.get("plan", {})))
        opt = job.optimizer(torch.optim.AdamW, lr=1e-3)

        def step():
            job.step(x, y, lm_loss)
            opt.step()
            opt.zero_grad()
    else:  # torch's own tensor parallelism on the same groups
        model = _model()
        model = type(model).parallelize(model, mesh.device_mesh["tp"], use_seq_parallel=config.get("sp", False),
                                        local_output_for_attn=True)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

        def step():
            lm_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    seconds = median_step(step, steps=config["steps"], barrier=dist.barrier)
    with CommCensus(mesh) as census:
        step()
    counts = census.by_kind()
    report({"impl": impl, "step_s": seconds, "wire_bytes": wire_bytes(counts, mesh.sizes),
            "calls": sum(c for c, _ in counts.values()), "census": {f"{k}/{a}": v for (k, a), v in counts.items()}})
    dist.barrier()


def main() -> None:
    p = arg_parser()
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--steps", type=int, default=10)
    args = p.parse_args()
    if run_worker(args, worker):
        return
    script = os.path.abspath(__file__)
    t = args.tp
    formula = LAYERS * 8 * BATCH * SEQ * DIM * (t - 1) / t * 4  # bytes per rank per step, fp32
    rows = []
    configs = [("single process", 1, {"impl": "single"}),
               ("DTensor TP", t, {"impl": "dtensor", "tp": t}),
               ("meshc TP", t, {"impl": "meshc", "tp": t}),
               ("DTensor TP+SP", t, {"impl": "dtensor", "tp": t, "sp": True}),
               ("meshc TP+SP", t, {"impl": "meshc", "tp": t, "plan": {"sequence_parallel": True}}),
               ("meshc TP, vocab-parallel", t, {"impl": "meshc", "tp": t, "plan": {"vocab_parallel": True}})]
    for name, nproc, config in configs:
        result = launch(script, nproc, {**config, "steps": args.steps})
        row = {"run": name, "ranks": nproc, "step (s)": result["step_s"]}
        if "wire_bytes" in result:
            row["MiB sent per rank"] = result["wire_bytes"] / 2**20
            row["collective calls"] = result["calls"]
        rows.append(row)
        print(name, json.dumps(result), flush=True)
    dtensor = {r["run"]: r["step (s)"] for r in rows}
    for r in rows:
        base = "DTensor TP+SP" if "SP" in r["run"] else "DTensor TP"
        if r["run"].startswith("meshc"):
            r["vs DTensor"] = r["step (s)"] / dtensor[base]
    print()
    print(table(rows, ["run", "ranks", "step (s)", "vs DTensor", "MiB sent per rank", "collective calls"]))
    meshc_tp = next(r for r in rows if r["run"] == "meshc TP")
    ratio = meshc_tp["MiB sent per rank"] * 2**20 / formula
    print(f"\nmeshc TP bytes per rank per step: {meshc_tp['MiB sent per rank'] * 2**20:,.0f}; "
          f"formula 8·b·s·h·(t−1)/t·L·4 B = {formula:,.0f}; ratio {ratio:.4f}")


if __name__ == "__main__":
    main()
