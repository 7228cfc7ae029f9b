"""Parity over transformers' causal-LM classes at generic small sizes: a mesh's ranks against one process.

    python benchmarks/parity_sweep.py [--tp 2] [--sequence-parallel] [--only llama,cpmant] [--skip-zoo]
    python benchmarks/parity_sweep.py --mesh pp=2 --plan microbatches=2 [--plan schedule=zbv,virtual=2]
    python benchmarks/parity_sweep.py --mesh dp=2 --plan zero=3

Where benchmarks/tp_sweep.py measures what the automatic plan shards, this trains it: each class is built from its own
config at tp_sweep's generic sizes (every dropout 0), trained 3 SGD steps on the mesh's ranks (tp=2 unless --mesh
says otherwise; gloo, non-strict trace) and in
one process from the same weights, and compared with the test suite's tolerances (tests/parity.py): losses within
2e-5, step-1 gradients within 2e-6 of the tensor's largest element (or of 1), parameters within 5e-5. A class outside
them is measured once more: the same reference in fp32 against fp64 (step-1 gradients, parameters after the steps),
fp32's own rounding on that model. Each row: the share of the blocks' weight bytes held sharded on tp, the share of
the model's parameter elements rank 0 holds (its pipeline stage's, its ZeRO shard: what was really split), and the
worst gradient error (and that noise where the class is outside). Parameters the loss leaves without a gradient are compared as parameters only.
`--skip-zoo` leaves out the families tests/zoo.py trains in `make test`.
"""
from __future__ import annotations

import argparse
import math
import os
import resource
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

STEPS, BATCH = 3, 4
ZOO = {"albert", "bert", "bloom", "deepseek_v3", "diffllama", "falcon", "falcon_h1", "gpt2", "gpt_bigcode", "gpt_neox",
       "gpt_oss", "gptj", "jetmoe", "llama", "llama4", "mamba", "mamba2", "mistral", "mixtral", "olmoe", "phi3", "qwen2",
       "qwen3_5", "qwen3_next", "rwkv", "stablelm", "xlstm", "zamba"}


def register(mtype: str) -> None:
    """Put a builder for `mtype` at the generic sizes into tests/zoo.py's MODELS, under its model type."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES as CONFIGS
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as NAMES

    from tests import zoo
    from tp_sweep import config_for
    config_cls, model_cls = getattr(transformers, CONFIGS[mtype]), getattr(transformers, NAMES[mtype])

    def build(seed: int = 0, **_):
        config = config_for(config_cls)
        for part in {id(c): c for c in (config, getattr(config, "get_text_config", lambda: config)())}.values():
            for key, value in list(vars(part).items()):
                if "drop" in key and isinstance(value, float):  # attention_dropout, resid_pdrop, ...
                    setattr(part, key, 0.0)
        torch.manual_seed(seed)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return model_cls(config)
    zoo.MODELS[mtype] = build


def rank(mtype: str, *args):
    """One rank (tests/parity.py's meshc_rank, the class registered first)."""
    register(mtype)
    from tests import parity
    return parity.meshc_rank(mtype, *args)


def reference(mtype: str, dtype=torch.float32, steps: int = STEPS) -> dict:
    """One process: losses, step-1 gradients (of the parameters that get one), parameters after `steps`."""
    from tests import parity, zoo
    model = zoo.build(mtype).to(dtype)
    opt = parity._optimizer("sgd", model.parameters())
    losses, grads0 = [], {}
    for i, (x, y) in enumerate(zoo.batches_for(mtype, steps, BATCH)):
        loss = zoo.model_loss(mtype, model, x, y)
        loss.backward()
        if i == 0:
            grads0 = {n: p.grad.double() for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "grads0": grads0, "params": {k: v.clone() for k, v in model.state_dict().items()}}


def compare(mtype: str, sizes: dict, plan: dict) -> str:
    """The row's verdict for one class."""
    from tests import parity, zoo
    from tests.harness import run_ranks

    import parity_sweep as me  # the ranks import this module by its name, not as __main__
    register(mtype)
    ref = reference(mtype)
    world = math.prod(sizes.values())
    outs = run_ranks(me.rank, world, mtype, STEPS, BATCH, sizes, {"trace": "non-strict", **plan}, "sgd", timeout=400)
    tp = sizes.get("tp", 1)
    model = zoo.build(mtype)
    share = f"{parity.block_coverage(outs[0]['local_shapes'], model, tp, held_only=sizes.get('pp', 1) > 1):.2f}" \
        if tp > 1 else "-"  # under pp, of the blocks rank 0's stage holds
    held = sum(math.prod(s) for s in outs[0]["local_shapes"].values()) / sum(p.numel() for p in model.parameters())
    share += f" | {held:.2f}"  # what rank 0 holds of the model's parameter elements: its stage's, its ZeRO shard
    problems, grad = [], 0.0
    for r, out in enumerate(outs):
        missing = sorted(set(ref["grads0"]) - set(out["grads0"]))
        if missing:
            return f"{share} | FAIL: rank {r} has no gradient of {missing[:3]}"
        loss = max(abs(a - b) for a, b in zip(out["losses"], ref["losses"]))
        g, where = parity.max_diff({k: out["grads0"][k] for k in ref["grads0"]}, ref["grads0"], scaled=True)
        p, pwhere = parity.max_diff(out["params"], ref["params"])
        grad = max(grad, g)
        if loss >= 2e-5:
            problems.append(f"loss off by {loss:.1e}")
        if g >= 2e-6:
            problems.append(f"gradient of {where} off by {g:.1e}")
        if p >= 5e-5:
            problems.append(f"parameter {pwhere} off by {p:.1e}")
    if not problems:
        return f"{share} | ok, gradients within {grad:.1e}"
    try:
        exact = reference(mtype, torch.float64)
    except RuntimeError as e:  # an op without a float64 kernel (a grouped matmul)
        return f"{share} | outside: {'; '.join(dict.fromkeys(problems))}; no fp64 reference ({str(e)[:80]})"
    noise, where = parity.max_diff(ref["grads0"], exact["grads0"], scaled=True)
    drift, pwhere = parity.max_diff({k: v.double() for k, v in ref["params"].items()},
                                    {k: v.double() for k, v in exact["params"].items()})
    return (f"{share} | outside: {'; '.join(dict.fromkeys(problems))}; fp32 against fp64: step-1 gradient "
            f"{noise:.1e} ({where}), parameters after {STEPS} steps {drift:.1e}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tp", type=int, default=2, help="the tp size, where --mesh is not given")
    p.add_argument("--mesh", default="", help="axis sizes, e.g. pp=2 or dp=2,tp=2 (default: tp=--tp)")
    p.add_argument("--plan", action="append", default=[], help="Plan options as key=value[,key=value] (ints, "
                   "floats, true/false or names), e.g. zero=3 or microbatches=2,schedule=gpipe")
    p.add_argument("--only", default="", help="comma-separated model types (default: every causal-LM class)")
    p.add_argument("--sequence-parallel", action="store_true", help="Plan(sequence_parallel=True)")
    p.add_argument("--memory-gib", type=int, default=8, help="address-space cap of this process and its ranks (a "
                   "class whose default sizes the generic ones miss fails with MemoryError instead of taking the machine)")
    p.add_argument("--skip-zoo", action="store_true", help="leave out the families the test suite trains")
    args = p.parse_args()
    resource.setrlimit(resource.RLIMIT_AS, (args.memory_gib << 30, args.memory_gib << 30))  # ranks fork from here
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as NAMES

    only = [n for n in args.only.split(",") if n] or list(NAMES)
    sizes = {k: int(v) for k, v in (kv.split("=") for kv in args.mesh.split(",") if kv)} or {"tp": args.tp}
    plan = {"sequence_parallel": True} if args.sequence_parallel else {}
    plan.update(_options(",".join(args.plan)))
    where = ",".join(f"{k}={v}" for k, v in sizes.items())
    extra = "".join(f", {k}={v}" for k, v in plan.items())
    print(f"| model type ({where}{extra}) | blocks sharded on tp | rank 0 holds | against one process |\n"
          "|---|---|---|---|")
    for mtype in only:
        if args.skip_zoo and mtype in ZOO:
            continue
        start = time.time()
        try:
            verdict = compare(mtype, sizes, plan)
        except Exception as e:  # noqa: BLE001 - a row of the table (tp_sweep.py says which classes build and trace)
            verdict = f"- | - | error: {type(e).__name__}: {str(e).strip().splitlines()[-1][:200] if str(e).strip() else ''}"
        print(f"| {mtype} | {verdict} ({time.time() - start:.0f} s) |", flush=True)


def _options(text: str) -> dict:
    """"zero=3,schedule=zbv,sequence_parallel=true" -> {"zero": 3, "schedule": "zbv", "sequence_parallel": True}."""
    out: dict = {}
    for kv in (x for x in text.split(",") if x):
        key, value = kv.split("=", 1)
        low = value.lower()
        if low in ("true", "false"):
            out[key] = low == "true"
        else:
            try:
                out[key] = int(value)
            except ValueError:
                try:
                    out[key] = float(value)
                except ValueError:
                    out[key] = value
    return out


if __name__ == "__main__":
    main()
