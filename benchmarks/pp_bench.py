"""Pipeline parallelism: meshc's automatic split against torch.distributed.pipelining's manual split
(`pipeline()` + `SplitPoint`) under the same schedule, ranks and micro-batches, in one run; and meshc's
measured bubble against its simulator's prediction.

    python benchmarks/pp_bench.py [--pp 2] [--microbatches 8] [--steps 6] [--schedules gpipe,1f1b,zb-h1,zbv,dualpipev]

Model: torch's reference Transformer, 4 layers, dim 256, 8 heads, vocab 1024, untied head (torch's
pipeline() cannot split a tied weight), batch 16 x 128 tokens, fp32, AdamW; gloo on loopback, one
thread per rank. Measured bubble = (step time - compute time) / compute time on each rank (compute:
the stage forward/backward actions), averaged over ranks; the simulator predicts it from each stage's
forward FLOPs (backward = 2 x forward; zb-h1's I = W = forward), with no communication time, and again from
the actions' measured mean durations per (kind, stage) (what the schedule itself predicts once the real
cost of each action is known: the gap between the two is the FLOP model's, the rest is communication). zb-h1 runs on
meshc only (torch's zero-bubble schedules need several stages per rank); zbv and dualpipev (two stages per rank in a V)
on both, torch's ScheduleZBVZeroBubble and ScheduleDualPipeV over pipeline()'s split into 2·pp stages (torch's runtime,
as meshc's, runs DualPipeV's overlapped forward+backward pairs one after the other unless given an overlap callback).
"""
from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import (arg_parser, launch, lm_loss, median_step, reference_transformer, report, run_worker,  # noqa: E402
                    table, token_batch)

from meshc.compiler.ir.schedule import V_SHAPED  # noqa: E402  (two stages per rank)

LAYERS, DIM, HEADS, VOCAB, SEQ, BATCH = 4, 256, 8, 1024, 128, 16


def _model():
    return reference_transformer(LAYERS, DIM, HEADS, VOCAB, SEQ, tied=False)  # pipeline() cannot split a tied weight


def _data():
    return token_batch(BATCH, SEQ, VOCAB)


def _replayed(schedule, everyone: list) -> tuple[float, dict[str, float]]:
    """The simulator's bubble for `schedule` with each (kind, stage) action costing its measured mean seconds
    (every rank's actions over the timed steps): what the schedule predicts from the actions' real durations."""
    from meshc.compiler.ir.schedule_sim import simulate

    times: dict[tuple[str, int], list[float]] = {}
    for rank_actions in everyone:
        for kind, stage, _mb, seconds in rank_actions:
            times.setdefault((kind, stage), []).append(seconds)
    mean = {key: sum(v) / len(v) for key, v in times.items()}
    ms = {f"{stage}{kind}": round(1e3 * t, 2) for (kind, stage), t in sorted(mean.items(), key=lambda kv: kv[0][::-1])}
    return simulate(schedule, cost=lambda a: mean[(a.kind, a.stage)]).bubble, ms


def worker(config: dict) -> None:
    import torch
    import torch.distributed as dist

    import meshc

    torch.set_num_threads(1)
    pp, m = config["pp"], config["microbatches"]
    mesh = meshc.mesh(pp=pp, timeout_s=300)
    x, y = _data()
    if config["impl"] == "meshc":
        job = meshc.compile(_model(), mesh, example_inputs=(x,),
                            plan=meshc.Plan(microbatches=m, schedule=config["schedule"]))
        opt = job.optimizer(torch.optim.AdamW, lr=1e-3)
        busy, elapsed, actions = [], [], []

        def step():
            job.step(x, y, lm_loss)
            opt.step()
            opt.zero_grad()
            busy.append(job.pipeline_timing()[0])
            elapsed.append(job.pipeline_timing()[1])
            actions.append(job.pipeline_actions())
        seconds = median_step(step, steps=config["steps"], barrier=dist.barrier)
        measured = sum(e for e in elapsed[-config["steps"]:]) / sum(b for b in busy[-config["steps"]:]) - 1
        bubble = torch.tensor([measured])
        dist.all_reduce(bubble)
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, [a for step_actions in actions[-config["steps"]:] for a in step_actions])
        replayed, action_ms = _replayed(job.compiled.pipeline.schedule, everyone)
        report({"step_s": seconds, "bubble": bubble.item() / pp, "predicted": job.compiled.pipeline.simulated.bubble,
                "replayed": replayed, "action_ms": action_ms,
                "stages": [s.blocks for s in job.program.stage_info]})
        return
    from torch.distributed.pipelining import (Schedule1F1B, ScheduleDualPipeV, ScheduleGPipe, ScheduleZBVZeroBubble,
                                              SplitPoint, pipeline)

    model = _model()
    v = 2 if config["schedule"] in V_SHAPED else 1
    count, rank = pp * v, mesh.coord("pp")
    per = LAYERS // count
    spec = {f"layers.{per * k}": SplitPoint.BEGINNING for k in range(1, count)}
    pipe = pipeline(model, mb_args=(x.chunk(m)[0],), split_spec=spec)
    indexes = [rank, count - 1 - rank] if v == 2 else [rank]  # the V: rank r holds stages r and 2pp-1-r
    if v == 2:  # PipelineStage over pipeline()'s stage modules: build_stage's stages open a gloo pair to their own rank
        from torch.distributed.pipelining import PipelineStage
        stages = [PipelineStage(pipe.get_stage_module(i), i, count, torch.device("cpu"), group=mesh.group("pp"))
                  for i in indexes]
        cls = {"zbv": ScheduleZBVZeroBubble, "dualpipev": ScheduleDualPipeV}[config["schedule"]]
        schedule = cls(stages, m, loss_fn=lm_loss)
    else:
        stages = [pipe.build_stage(i, torch.device("cpu"), group=mesh.group("pp")) for i in indexes]
        schedule = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[config["schedule"]](stages[0], m, loss_fn=lm_loss)
    opt = torch.optim.AdamW([p for s in stages for p in s.submod.parameters()], lr=1e-3)
    first, last = 0 in indexes, count - 1 in indexes

    def step():
        schedule.step(*((x,) if first else ()), **({"target": y} if last else {}))
        opt.step()
        opt.zero_grad()
    report({"step_s": median_step(step, steps=config["steps"], barrier=dist.barrier)})


def main() -> None:
    p = arg_parser()
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--schedules", default="gpipe,1f1b,zb-h1,zbv,dualpipev")
    args = p.parse_args()
    if run_worker(args, worker):
        return
    script = os.path.abspath(__file__)
    rows = []
    for schedule in args.schedules.split(","):
        base = {"pp": args.pp, "microbatches": args.microbatches, "steps": args.steps, "schedule": schedule}
        torch_run = launch(script, args.pp, {**base, "impl": "torch"}) if schedule in ("gpipe", "1f1b", *V_SHAPED) else None
        ours = launch(script, args.pp, {**base, "impl": "meshc"})
        torch_s = torch_run["step_s"] if torch_run else float("nan")
        rows.append({"schedule": schedule, "torch.distributed.pipelining (s)": torch_s,
                     "meshc (s)": ours["step_s"], "meshc / torch": ours["step_s"] / torch_s,
                     "measured bubble": ours["bubble"], "simulated (FLOPs)": ours["predicted"],
                     "simulated (measured actions)": ours["replayed"],
                     "(p-1)/m": (args.pp - 1) / args.microbatches})
        print(schedule, json.dumps(torch_run), json.dumps(ours), flush=True)
    print()
    print(table(rows, list(rows[0])))


if __name__ == "__main__":
    main()
