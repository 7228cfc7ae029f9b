"""Activation memory per layer with remat none / selective / full, against Korthikanti et al. (2022).

    python benchmarks/remat_memory.py [--tp 2]

On tp ranks with sequence parallelism, the reference Transformer's forward runs under a dispatch mode
that keeps a weak reference to every tensor storage it creates (parameters' storages excluded); at the
end of forward the storages still alive are what backward will read (activations kept by autograd or by
checkpointing). Running
with 2 and 4 layers and subtracting isolates one layer: (M4 - M2) / 2 per rank.
Formulas (bytes, 16-bit activations, per layer): TP+SP without recompute sbh(34/t + 5as/(ht)),
selective recompute 34sbh/t, full recompute 2sbh; fp32 here doubles them.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import arg_parser, launch, report, run_worker, table  # noqa: E402

DIM, HEADS, VOCAB, SEQ, BATCH = 256, 8, 1024, 128, 4


def _live_after_forward(job, x) -> int:
    from torch.multiprocessing.reductions import StorageWeakRef

    from meshc.compiler.ir import torch_compat as compat

    refs: dict[int, tuple] = {}
    held = [*dict(job.named_parameters()).values(), *job.compute_copies().values(), *dict(job.named_buffers()).values()]
    before = {StorageWeakRef(t.untyped_storage()).cdata for t in held}  # parameters: not activations

    class Meter(compat.dispatch_mode_base()):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in compat.tree_flatten(out)[0]:
                if hasattr(t, "untyped_storage") and t.device.type != "meta":
                    st = t.untyped_storage()
                    ref = StorageWeakRef(st)
                    if ref.cdata not in before:
                        refs.setdefault(ref.cdata, (ref, st.nbytes()))
            return out
    with Meter():
        out = job(x)
    alive = sum(nbytes for ref, nbytes in refs.values() if not ref.expired())
    del out
    return alive


def worker(config: dict) -> None:
    import torch
    from torch.testing._internal.distributed._tensor.common_dtensor import ModelArgs, Transformer

    import meshc

    torch.set_num_threads(1)
    mesh = meshc.mesh(tp=config["tp"], timeout_s=300)
    x = torch.randint(0, VOCAB, (BATCH, SEQ))
    live = {}
    for layers in (2, 4):
        torch.manual_seed(0)
        model = Transformer(ModelArgs(n_layers=layers, vocab_size=VOCAB, max_seq_len=SEQ, dim=DIM, n_heads=HEADS,
                                      dropout_p=0.0))
        job = meshc.compile(model, mesh, example_inputs=(x,),
                            plan=meshc.Plan(sequence_parallel=True, remat=config["remat"]))
        job(x)  # warm
        live[layers] = _live_after_forward(job, x)
    report({"per_layer": (live[4] - live[2]) / 2})


def main() -> None:
    p = arg_parser()
    p.add_argument("--tp", type=int, default=2)
    args = p.parse_args()
    if run_worker(args, worker):
        return
    t, s, b, h, a = args.tp, SEQ, BATCH, DIM, HEADS
    formula = {"none": s * b * h * (34 / t + 5 * a * s / (h * t)), "selective": 34 * s * b * h / t, "full": 2 * s * b * h}
    rows = []
    for remat in ("none", "selective", "full"):
        got = launch(os.path.abspath(__file__), t, {"tp": t, "remat": remat})["per_layer"]
        want = 2 * formula[remat]  # fp32
        rows.append({"remat": remat, "measured KiB per layer per rank": got / 1024,
                     "formula KiB (fp32)": want / 1024, "measured / formula": got / want})
        print(rows[-1], flush=True)
    print()
    print(table(rows, list(rows[0])))


if __name__ == "__main__":
    main()
