"""Tensor-parallel coverage over every causal-LM class transformers registers, at generic small sizes.

    python benchmarks/tp_sweep.py [--tp 2] [--only llama,jetmoe] [--json out.json] [--against before.json]

Where benchmarks/tp_coverage.py measures hand-sized configs of chosen families, this builds each class of
`MODEL_FOR_CAUSAL_LM_MAPPING` from its own config with the sizes below set where the config has them (hidden 64,
4 heads, 2 kv heads, 2 layers of each distinct layer type, 4 experts) and compiles rank 0 on fake tensors, as
tp_coverage.py does. Each row: the share of the blocks' weight bytes held sharded, or the error and the stage it
came from ("build": the config or model rejected the generic sizes; "trace": torch.export; "meshc": a pass;
"internal": a MeshcInternalError, always a defect; "memory", "died", "timeout": over the cap, killed, too slow).
`--against` compares with an earlier `--json` file and prints the classes that moved. Generic sizes are crude: a class that fails to build or trace here may train at its own.
"""
from __future__ import annotations

import argparse
import inspect
import json
import multiprocessing as mp
import os
import queue
import resource
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tp_coverage's compile, shared

SEQ, BATCH = 16, 2
MEMORY_GIB, TIMEOUT_S = 6, 300  # per class: a default size the generic ones miss (BLT's byte embeddings) is a row
SIZES = dict(vocab_size=128, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
             intermediate_size=128, head_dim=16, max_position_embeddings=64, num_local_experts=4, num_experts=4,
             n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=64,
             use_cache=False, bos_token_id=0, eos_token_id=0, pad_token_id=0, tie_word_embeddings=False)
# a size the class calls by another name (GPT-2's n_embd): set through the config's attribute_map, when it has one


def config_for(config_cls):
    """The class's config at the generic sizes: each size passed where the config's __init__ or attribute_map
    knows it; layer types cut to one of each distinct kind (at least two layers)."""
    default = config_cls()
    text = default.get_text_config() if hasattr(default, "get_text_config") else default
    params = set(inspect.signature(type(text).__init__).parameters) | set(getattr(type(text), "attribute_map", {}))
    kwargs = {k: v for k, v in SIZES.items() if k in params or hasattr(text, k)}
    types = getattr(text, "layer_types", None)
    if isinstance(types, (list, tuple)) and types:
        distinct = list(dict.fromkeys(types))
        distinct = (distinct * 2)[:max(2, len(distinct))]
        kwargs.update(layer_types=distinct, num_hidden_layers=len(distinct))
    if text is default:
        return config_cls(**kwargs)
    sub = type(text)(**kwargs)
    name = next(k for k, v in vars(default).items() if v is text)
    return config_cls(**{name: sub.to_dict()})


def measure(config_cls, model_cls, tp: int) -> tuple[str, float | None, str]:
    """(stage, coverage, detail) for one class: stage "ok" with the coverage, else where it failed and why."""
    import torch

    from meshc.compiler.ir.errors import MeshcInternalError
    from tp_coverage import coverage_of

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = model_cls(config_for(config_cls))
    except Exception as e:  # noqa: BLE001 - a row of the table
        return "build", None, f"{type(e).__name__}: {e}"
    x = torch.zeros(BATCH, SEQ, dtype=torch.long)
    try:
        frac, replicated = coverage_of(lambda: (model, x), tp)
    except MeshcInternalError as e:
        return "internal", None, str(e)
    except MemoryError:
        return "memory", None, f"MemoryError: over {MEMORY_GIB} GiB"
    except Exception as e:  # noqa: BLE001
        stage = "trace" if "torch.export" in str(e) or "trace" in type(e).__name__.lower() else "meshc"
        return stage, None, f"{type(e).__name__}: {e}"
    return "ok", frac, "; ".join(sorted({r for _, r in replicated}))


def _child(mtype: str, tp: int, out) -> None:
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES as CONFIGS
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as NAMES

    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_GIB << 30, MEMORY_GIB << 30))
    out.put(measure(getattr(transformers, CONFIGS[mtype]), getattr(transformers, NAMES[mtype]), tp))


def _isolated(mtype: str, tp: int) -> tuple[str, float | None, str]:
    """measure() in a process of its own, under a memory cap and a deadline."""
    ctx = mp.get_context("forkserver")
    out = ctx.Queue()
    proc = ctx.Process(target=_child, args=(mtype, tp, out), daemon=True)
    proc.start()
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while time.monotonic() < deadline:
            try:
                return out.get(timeout=1.0)
            except queue.Empty:
                if proc.exitcode is not None:  # died without a result (killed for memory: a build at default sizes)
                    return "died", None, f"exited with code {proc.exitcode} without a result"
        return "timeout", None, f"no result within {TIMEOUT_S} s"
    finally:
        proc.kill()
        proc.join()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--only", default="", help="comma-separated model types (default: all)")
    p.add_argument("--json", default="", help="write the rows here")
    p.add_argument("--against", default="", help="an earlier --json file: print the classes that moved")
    args = p.parse_args()
    mp.get_context("forkserver").set_forkserver_preload(["torch", "transformers", "meshc.compiler.compile"])
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as NAMES

    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES as CONFIGS

    only = {n for n in args.only.split(",") if n}
    rows = {}
    print(f"| model type | class | tp={args.tp} | detail |\n|---|---|---|---|")
    for mtype, cls_name in NAMES.items():
        if only and mtype not in only:
            continue
        model_cls, config_cls = getattr(transformers, cls_name, None), getattr(transformers, CONFIGS.get(mtype, ""), None)
        if model_cls is None or config_cls is None:
            continue
        stage, frac, detail = _isolated(mtype, args.tp)
        rows[mtype] = {"class": cls_name, "stage": stage, "coverage": frac, "detail": detail.splitlines()[0][:300]
                       if detail else ""}
        shown = f"{frac:.2f}" if stage == "ok" else stage
        print(f"| {mtype} | {cls_name} | {shown} | {rows[mtype]['detail'][:160]} |", flush=True)
    ok = [r for r in rows.values() if r["stage"] == "ok"]
    high = sum(r["coverage"] >= 0.9 for r in ok)
    stages = {s: sum(r["stage"] == s for r in rows.values())
              for s in ("build", "trace", "meshc", "internal", "memory", "died", "timeout")}
    print(f"\n{len(rows)} classes: {high} at or above 0.9, {len(ok) - high} below; errors {stages}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    if args.against:
        with open(args.against) as f:
            before = json.load(f)
        for mtype, r in rows.items():
            b = before.get(mtype)
            if b and (b["stage"], b["coverage"]) != (r["stage"], r["coverage"]):
                print(f"moved: {mtype}: {b['stage']} {b['coverage']} -> {r['stage']} {r['coverage']}")


if __name__ == "__main__":
    main()
