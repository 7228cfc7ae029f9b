"""Expert parallelism on a Mixtral-shaped model (8 experts, top-2): step time, bytes moved and per-rank memory
with the experts replicated, over ep=2 and over ep=4, side by side with DeepSpeed-MoE in the same run.

    make bench-deps                      # DeepSpeed
    python benchmarks/moe_bench.py [--steps 6] [--layers 4] [--only meshc,ds]

Model: transformers' MixtralForCausalLM from a MixtralConfig (hidden 256, intermediate 512, `--layers` blocks,
8 heads, 4 kv heads, vocabulary 8000, 8 local experts, top-2, router_aux_loss_coef 0), built from seed 0 on
every rank; AdamW (lr 1e-4), one sequence of 128 tokens per rank and step (rank r's tokens from seed r); 4 gloo
ranks, one thread each, MALLOC_MMAP_THRESHOLD_=131072 so that freed tensors go back to the OS.

meshc: meshc.mesh(dp=4, ep=E) (ep a sub-group of dp: experts sharded over ep, replicated over edp = dp/ep),
meshc.compile(..., Plan(trace="non-strict")), job.step + opt.step. DeepSpeed (0.19.x, DS_ACCELERATOR=cpu, gloo,
ZeRO stage 0): each block's MixtralSparseMoeBlock replaced by deepspeed.moe.layer.MoE(num_experts=8, k=2,
ep_size=E, drop_tokens=False, top2_2nd_expert_sampling=False) around a gated-MLP expert, with the router's and
the experts' weights copied from the same HF model (so both frameworks start from the same weights and route
alike), torch's AdamW over split_params_into_different_moe_groups_for_optimizer's groups.

Per rank (the largest over the ranks): step = median seconds of `--steps` steps after one warm-up, ranks aligned
by a barrier before each; expert MiB = bytes of the expert parameters this rank holds; params MiB = all the
parameters it holds; held MiB = parameters + gradients + optimizer states after the steps; peak MiB = VmHWM
during the steps (reset through /proc/self/clear_refs before them) minus RSS before the model was built; growth
MiB = the same peak minus RSS just before the steps. Bytes per step (rank 0, one step: forward, backward,
optimizer): what each collective call's input holds, by kind and axis (ep: the expert group, edp: the replicas
of an expert, dp: all ranks); meshc's from CommCensus, DeepSpeed's from torch.distributed's calls. a2a: the
all-to-alls; dp: every other collective (gradient all-reduces over dp and edp, DeepSpeed's capacity all-reduce over
ep); wire: what each rank sends on a ring for all of them (common.wire_bytes: a collective over a group of one
sends nothing, an all-to-all counts its whole input). "loss 1" is the first step's loss averaged over the ranks
(the same in every row when the frameworks agree). Goal: expert MiB / replicated expert MiB = 1/ep exactly;
meshc's step no slower than DeepSpeed-MoE's at the same ep. meshc's held MiB is job.held_bytes(); DeepSpeed's
the same sum over its module's parameters, their gradients and the optimizer's states.
"""
from __future__ import annotations

import importlib.util
import os
import sys
from contextlib import contextmanager

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import last_error, arg_parser, launch, median_step, report, rss_mib, run_worker, table, wire_bytes  # noqa: E402

SEQ, VOCAB, EXPERTS, TOP_K, RANKS = 128, 8000, 8, 2, 4
HIDDEN, INTER, HEADS, KV_HEADS = 256, 512, 8, 4
MIB = 2**20


def _model(layers: int):
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    cfg = MixtralConfig(num_hidden_layers=layers, hidden_size=HIDDEN, intermediate_size=INTER,
                        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, vocab_size=VOCAB,
                        max_position_embeddings=SEQ, num_local_experts=EXPERTS, num_experts_per_tok=TOP_K,
                        router_aux_loss_coef=0.0, use_cache=False, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return MixtralForCausalLM(cfg)


def _batch(rank: int):
    import torch

    g = torch.Generator().manual_seed(rank)
    tokens = torch.randint(0, VOCAB, (1, SEQ + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _loss(out, y):
    import torch.nn.functional as F

    logits = out.logits if hasattr(out, "logits") else out
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))


def _reset_peak() -> None:
    """Start VmHWM again from the current RSS (Linux: clear_refs 5), so that the next peak is the steps'."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _held(params, optimizer) -> int:
    """Bytes of parameters, their gradients and the optimizer's states (tensors with a dimension)."""
    params = list(params)
    tensors = params + [p.grad for p in params if p.grad is not None]
    tensors += [v for st in optimizer.state.values() for v in st.values() if hasattr(v, "dim") and v.dim() > 0]
    return sum(t.numel() * t.element_size() for t in tensors)


def _measure(cfg: dict, one_step, comm, base: float, loss_of) -> dict:
    """Census of one step, then the timed steps; memory from the first step on."""
    import torch.distributed as dist

    before = rss_mib()
    _reset_peak()
    with comm() as counted:
        loss = one_step()
    by_axis = counted()
    step = median_step(one_step, warmup=1, steps=cfg["steps"], barrier=dist.barrier)
    hwm = rss_mib("VmHWM")
    return {"step": step, "peak": hwm - base, "growth": hwm - before, "comm": by_axis, "loss1": loss_of(loss)}


def _meshc(cfg: dict, base: float) -> dict:
    import torch

    import meshc
    from meshc.runtime.monitor.census import CommCensus

    mesh = meshc.mesh(dp=RANKS, ep=cfg["ep"])
    x, y = _batch(mesh.rank)
    model = _model(cfg["layers"])
    job = meshc.compile(model, mesh, example_inputs=(x,), plan=meshc.Plan(trace="non-strict"))
    del model  # the job keeps its shards only
    opt = job.optimizer(torch.optim.AdamW, lr=1e-4)

    def one_step():
        loss = job.step(x, y, _loss)
        opt.step()
        opt.zero_grad()
        return loss

    @contextmanager
    def comm():
        with CommCensus(mesh) as census:
            yield lambda: {f"{kind}@{axis}": nbytes for (kind, axis), (_, nbytes) in census.by_kind().items()}

    out = _measure(cfg, one_step, comm, base, lambda loss: loss.item())
    named = dict(job.named_parameters())
    out["expert"] = sum(p.numel() * p.element_size() for f, p in named.items() if ".experts." in f)
    out["params"] = sum(p.numel() * p.element_size() for p in named.values())
    out["held"] = sum(job.held_bytes().values())
    out["expert_shapes"] = sorted({str(tuple(p.shape)) for f, p in named.items() if ".experts." in f})
    return out


def _ds_moe(layer, ep: int, ep_rank: int):
    """A DeepSpeed MoE block with `layer`'s (a MixtralSparseMoeBlock) router and this ep rank's experts."""
    import torch
    from deepspeed.moe.layer import MoE

    class GatedMLP(torch.nn.Module):  # one Mixtral expert: (silu(x W_gate) * x W_up) W_down
        def __init__(self):
            super().__init__()
            self.gate = torch.nn.Linear(HIDDEN, INTER, bias=False)
            self.up = torch.nn.Linear(HIDDEN, INTER, bias=False)
            self.down = torch.nn.Linear(INTER, HIDDEN, bias=False)

        def forward(self, x):
            return self.down(torch.nn.functional.silu(self.gate(x)) * self.up(x))

    class Block(torch.nn.Module):  # (B, T, H) -> (B, T, H); drops l_aux (coefficient 0) and the counts
        def __init__(self):
            super().__init__()
            self.moe = MoE(hidden_size=HIDDEN, expert=GatedMLP(), num_experts=EXPERTS, ep_size=ep, k=TOP_K,
                           use_residual=False, drop_tokens=False, capacity_factor=float(EXPERTS),
                           top2_2nd_expert_sampling=False)

        def forward(self, hidden):
            return self.moe(hidden.reshape(-1, hidden.shape[-1]))[0].reshape(hidden.shape)

    block = Block()
    with torch.no_grad():
        block.moe.deepspeed_moe.gate.wg.weight.copy_(layer.gate.weight)
        local = block.moe.deepspeed_moe.experts.deepspeed_experts
        for i, expert in enumerate(local):
            e = ep_rank * len(local) + i
            gate_up, down = layer.experts.gate_up_proj[e], layer.experts.down_proj[e]
            expert.gate.weight.copy_(gate_up[:INTER])
            expert.up.weight.copy_(gate_up[INTER:])
            expert.down.weight.copy_(down)
    return block


@contextmanager
def _dist_census(groups: dict):
    """Count torch.distributed's collectives (what DeepSpeed's comm calls): {kind@axis: input bytes}."""
    import torch.distributed as dist

    kinds = {"all_reduce": "all_reduce", "all_to_all_single": "all_to_all", "broadcast": "broadcast",
             "all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter"}
    counts: dict[str, int] = {}
    saved = {name: getattr(dist, name) for name in kinds}

    def wrap(name, fn):
        def call(*args, **kwargs):
            tensor = kwargs.get("input", kwargs.get("tensor", kwargs.get("input_tensor")))
            if tensor is None:
                tensor = args[1] if name in ("all_to_all_single", "all_gather_into_tensor",
                                             "reduce_scatter_tensor") else args[0]
            axis = next((a for a, g in groups.items() if g is kwargs.get("group")), "dp")
            key = f"{kinds[name]}@{axis}"
            counts[key] = counts.get(key, 0) + tensor.numel() * tensor.element_size()
            return fn(*args, **kwargs)
        return call

    for name, fn in saved.items():
        setattr(dist, name, wrap(name, fn))
    try:
        yield lambda: dict(counts)
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


def _deepspeed(cfg: dict, base: float) -> dict:
    os.environ["DS_ACCELERATOR"] = "cpu"
    import deepspeed
    import torch
    import torch.distributed as dist
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
    from deepspeed.utils import groups

    deepspeed.init_distributed(dist_backend="gloo")
    ep, rank = cfg["ep"], dist.get_rank()
    model = _model(cfg["layers"])
    for layer in model.model.layers:
        layer.mlp = _ds_moe(layer.mlp, ep, rank % ep)  # ep groups: consecutive ranks (as meshc's)
    groups_ = split_params_into_different_moe_groups_for_optimizer(
        [{"params": list(model.parameters()), "name": "all"}])
    opt = torch.optim.AdamW(groups_, lr=1e-4)
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 0},
              "zero_allow_untested_optimizer": True, "steps_per_print": 10**9}
    engine, opt, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    name = f"ep_size_{ep}"
    axes = {"ep": groups._get_expert_parallel_group(name), "edp": groups._get_expert_data_parallel_group(name)}
    x, y = _batch(rank)

    def one_step():
        loss = _loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        return loss

    def mean_loss(loss):
        loss = loss.detach().clone()
        dist.all_reduce(loss)
        return loss.item() / dist.get_world_size()

    out = _measure(cfg, one_step, lambda: _dist_census(axes), base, mean_loss)
    params = list(model.parameters())
    experts = [p for p in params if not getattr(p, "allreduce", True)]
    out["expert"] = sum(p.numel() * p.element_size() for p in experts)
    out["params"] = sum(p.numel() * p.element_size() for p in params)
    out["held"] = _held(params, getattr(opt, "optimizer", opt))
    out["expert_shapes"] = [f"{len(experts) // (3 * cfg['layers'])} local experts"]
    return out


def worker(cfg: dict) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    base = rss_mib()
    out = (_deepspeed if cfg["framework"] == "ds" else _meshc)(cfg, base)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, out)
    report({"ranks": everyone})
    dist.destroy_process_group()


def _row(label: str, ep: int, ranks: list) -> dict:
    comm = ranks[0]["comm"]
    a2a = sum(v for k, v in comm.items() if k.startswith("all_to_all"))
    census = {tuple(k.split("@")): (0, v) for k, v in comm.items()}
    wire = wire_bytes(census, {"dp": RANKS, "ep": ep, "edp": RANKS // ep})
    return {"framework": label, "ep": ep, "step s": max(r["step"] for r in ranks),
            "expert MiB/rank": max(r["expert"] for r in ranks) / MIB,
            "params MiB/rank": max(r["params"] for r in ranks) / MIB,
            "held MiB/rank": max(r["held"] for r in ranks) / MIB,
            "peak MiB/rank": max(r["peak"] for r in ranks), "growth MiB/rank": max(r["growth"] for r in ranks),
            "a2a MiB/step": a2a / MIB, "dp MiB/step": (sum(comm.values()) - a2a) / MIB, "wire MiB/step": wire / MIB,
            "by axis MiB": ", ".join(f"{k} {v / MIB:.2f}" for k, v in sorted(comm.items())),
            "loss 1": f"{ranks[0]['loss1']:.5f}", "_expert": ranks[0]["expert"]}


def main() -> None:
    p = arg_parser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--eps", default="1,2,4")
    p.add_argument("--only", default="meshc,ds", help="frameworks to run: meshc, ds (DeepSpeed-MoE)")
    args = p.parse_args()
    if run_worker(args, worker):
        return
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "131072"
    ds_ready = _deepspeed_ready()
    rows = []
    for framework, label in [("meshc", "meshc"), ("ds", "DeepSpeed-MoE")]:
        if framework not in args.only.split(","):
            continue
        for ep in [int(e) for e in args.eps.split(",")]:
            if framework == "ds" and ds_ready is not True:
                rows.append({"framework": label, "ep": ep, "by axis MiB": ds_ready})
                continue
            cfg = {"framework": framework, "ep": ep, "layers": args.layers, "steps": args.steps}
            try:
                out = launch(os.path.abspath(__file__), RANKS, cfg, timeout=3600)
            except RuntimeError as e:
                print(str(e), file=sys.stderr, flush=True)
                rows.append({"framework": label, "ep": ep, "by axis MiB": "failed: " + last_error(str(e))})
                print(rows[-1], flush=True)
                continue
            rows.append(_row(label, ep, out["ranks"]))
            print({**rows[-1], "expert shapes": out["ranks"][0]["expert_shapes"]}, flush=True)
    print(f"\nMixtral-shaped ({args.layers} layers, hidden {HIDDEN}, {EXPERTS} experts top-{TOP_K}), {RANKS} gloo "
          f"ranks, AdamW, 1x{SEQ} tokens per rank, median of {args.steps} steps")
    print(table(rows, ["framework", "ep", "step s", "expert MiB/rank", "params MiB/rank", "held MiB/rank",
                       "peak MiB/rank", "growth MiB/rank", "a2a MiB/step", "dp MiB/step", "wire MiB/step",
                       "by axis MiB", "loss 1"]))
    for label in ("meshc", "DeepSpeed-MoE"):
        mine = [r for r in rows if r["framework"] == label and "_expert" in r]
        full = next((r["_expert"] for r in mine if r["ep"] == 1), None)
        if full:
            ratios = ", ".join(f"ep={r['ep']}: {r['_expert'] / full:.6g} (1/ep = {1 / r['ep']:.6g})" for r in mine)
            print(f"\n{label} expert memory ratio vs replicated: {ratios}")


def _deepspeed_ready():
    """True, or why the DeepSpeed-MoE rows cannot run here."""
    if importlib.util.find_spec("deepspeed") is None:
        return "not installed: make bench-deps"
    return True


if __name__ == "__main__":
    main()
