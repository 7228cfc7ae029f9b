"""Memory of big models under ZeRO-3 on 4 ranks (not timed): no rank keeps or builds a full copy.

RSS is read from /proc with glibc's mmap threshold fixed at 128 KiB in every rank (mallopt at rank start,
as MALLOC_MMAP_THRESHOLD_=131072 would): freed tensors then go back to the OS and RSS means what is held
(without it glibc's dynamic threshold keeps freed tensor memory in the heap: ../shared/FACTS.md).
"""
from __future__ import annotations

import ctypes
import gc
import math

import torch
import torch.nn.functional as F

import meshc
from tests.harness import run_ranks

M_MMAP_THRESHOLD = -3
SEQ = 32


def _fix_mmap_threshold() -> None:
    ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, 131072)


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise AssertionError(field)


def _qwen2() -> torch.nn.Module:
    """A Qwen2-shaped model of 125M parameters (479 MiB fp32): tied 151,936-token embedding, 17 GQA blocks."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=151936, hidden_size=512, intermediate_size=1408, num_hidden_layers=17,
                      num_attention_heads=8, num_key_value_heads=2, tie_word_embeddings=True, use_cache=False)
    torch.manual_seed(0)
    return Qwen2ForCausalLM(cfg)


def _llama(meta: bool = True) -> torch.nn.Module:
    """A Llama of 164M parameters (655 MiB fp32) whose largest tensor and blocks are small: 8,192-token
    vocabulary (untied), 24 blocks of width 768: what a ZeRO-3 rank holds is mostly its shards."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=8192, hidden_size=768, intermediate_size=2048, num_hidden_layers=24,
                      num_attention_heads=12, num_key_value_heads=4, tie_word_embeddings=False, use_cache=False)
    with torch.device("meta"):
        return LlamaForCausalLM(cfg)


def _batch(rank: int, vocab: int = 151936):
    g = torch.Generator().manual_seed(rank)
    tokens = torch.randint(0, vocab, (1, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _loss(out, y):
    logits = out.logits if hasattr(out, "logits") else out
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def steady_rank(framework: str) -> int:
    """RSS after 2 SGD steps of the materialized model, the user's own reference dropped."""
    _fix_mmap_threshold()
    mesh = meshc.mesh(timeout_s=120)
    x, y = _batch(mesh.rank)
    model = _qwen2()
    if framework == "meshc":
        job = meshc.compile(model, mesh, example_inputs=(x,), plan=meshc.Plan(zero=3, trace="non-strict"))
        del model
        opt, step = job.optimizer(torch.optim.SGD, lr=0.01), lambda: job.step(x, y, _loss)
    else:
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)

        def step():
            loss = _loss(model(x), y)
            loss.backward()
    for _ in range(2):
        step()
        opt.step()
        opt.zero_grad()
    gc.collect()
    return _status("VmRSS")


COMPILER_RESIDUE = 64 * 2**20


def test_steady_state_rss_of_zero3_is_fsdp2s():
    """The 476 MiB case of the issue: meshc used to keep 1,098 MiB per rank against FSDP2's 562 (the full model
    stayed with the job). Measured now: 523 against 470 MiB. Both hold the same tensors (120 MiB of shards);
    the difference is anonymous memory the compiler leaves, not weights: code of the modules torch.export
    imports on first use (~12 MiB: functorch partitioners, networkx, sympy printers), the two FX graphs a job
    keeps (traced and transformed, with their node metadata) and torch's dispatch caches, ~50 MiB in all for
    this 17-block model. Bound: FSDP2's RSS in the same run + 10%, plus COMPILER_RESIDUE for that."""
    fsdp2 = run_ranks(steady_rank, 4, "fsdp2", timeout=300)
    ours = run_ranks(steady_rank, 4, "meshc", timeout=300)
    for rank, (a, b) in enumerate(zip(ours, fsdp2)):
        assert a <= 1.10 * b + COMPILER_RESIDUE, f"rank {rank}: meshc holds {a / 2**20:.0f} MiB, FSDP2 {b / 2**20:.0f} MiB"


def meta_rank() -> dict:
    """Peak RSS growth of a meta-built model from compile through init_weights and one SGD step."""
    _fix_mmap_threshold()
    mesh = meshc.mesh(timeout_s=120)
    x, y = _batch(mesh.rank, 8192)
    model = _llama()
    before = _status("VmRSS")
    job = meshc.compile(model, mesh, example_inputs=(x,), plan=meshc.Plan(zero=3, trace="non-strict"))
    residue = _status("VmRSS") - before  # the compiler's own memory: the shards exist but were never touched
    job.init_weights(seed=0)
    opt = job.optimizer(torch.optim.SGD, lr=0.01)
    job.step(x, y, _loss)
    opt.step()
    peak = _status("VmHWM") - before
    specs = job.program.params
    whole = {f: math.prod(s.shape) * s.dtype.itemsize for f, s in specs.items()}
    buckets = [n.meta["meshc.bucket"] for n in job.program.gm.graph.nodes if n.meta.get("meshc.bucket")]
    return {"peak": peak, "residue": residue, "largest": max(whole.values()), "full": sum(whole.values()),
            "shards": sum(p.numel() * p.element_size() for p in job.parameters()),
            "bucket": max(sum(whole[f] for f in fqns) for fqns in buckets)}


def test_meta_model_never_materializes_on_a_rank():
    """A 655 MiB meta-built model under ZeRO-3 on 4 ranks, initialized and one SGD step: each rank's peak growth
    (VmHWM after the step minus RSS before compile) stays below the full model's bytes (proof that no rank
    built it) and within 20% of what the rank must hold: the compiler's residue (measured after compile,
    when no value exists yet), its parameter and gradient shards, and whole buckets: the reduce-scatters in
    flight (PendingGrads.IN_FLIGHT), the bucket whose gradients backward is producing, the one gathered for
    it, the next one prefetched and the last one kept from forward (init_weights' one whole tensor at a
    time is smaller than a bucket here, and freed before the step). Measured: 560 MiB against a 540 formula."""
    from meshc.runtime.ops.zero import PendingGrads

    for rank, out in enumerate(run_ranks(meta_rank, 4, timeout=300)):
        assert out["largest"] <= out["bucket"], out
        formula = out["residue"] + 2 * out["shards"] + (PendingGrads.IN_FLIGHT + 4) * out["bucket"]
        assert out["peak"] < out["full"], f"rank {rank}: peak growth {out['peak']} >= the model's {out['full']} bytes"
        assert abs(out["peak"] - formula) <= 0.2 * formula, \
            f"rank {rank}: peak growth {out['peak'] / 2**20:.0f} MiB, formula {formula / 2**20:.0f} MiB ({out})"
