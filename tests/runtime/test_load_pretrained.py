"""job.load_pretrained: Hugging Face folders (sharded safetensors), single files, torch state dicts, meshc
checkpoints, straight into each rank's shards of a meta-built model.

Loaded weights are compared bitwise with the files (a copy, no arithmetic); the first step's loss with
from_pretrained in one process within the parity bound 2e-5 (tests/parity.py). What a rank reads is counted
by wrapping safetensors' own get_slice, independently of meshc's count.
"""
from __future__ import annotations

import math
import os

import pytest
import torch

import meshc
from tests import zoo
from tests.harness import run_ranks

BATCH = 8


def _meta(name: str) -> torch.nn.Module:
    with torch.device("meta"):
        return zoo.build(name)


class _Counting:
    """safetensors.safe_open, counting the bytes of every slice read through it."""

    read = 0

    def __init__(self, path, framework):
        import safetensors

        self._h = safetensors._meshc_real_safe_open(path, framework=framework)

    def keys(self):
        return self._h.keys()

    def get_slice(self, key):
        inner = self._h.get_slice(key)

        class Slice:
            def get_shape(self):
                return inner.get_shape()

            def get_dtype(self):
                return inner.get_dtype()

            def __getitem__(self, box):
                out = inner[box]
                _Counting.read += out.numel() * out.element_size()
                return out
        return Slice()


def load_rank(folder: str, name: str, mesh_sizes: dict, plan: dict) -> dict:
    import safetensors

    safetensors._meshc_real_safe_open = safetensors.safe_open
    safetensors.safe_open = _Counting
    mesh = meshc.mesh(timeout_s=90, **mesh_sizes)
    x, y = zoo.batches(1, BATCH)[0]
    job = meshc.compile(_meta(name), mesh, example_inputs=(mesh.shard_batch(x),),
                        plan=meshc.Plan(trace="non-strict", **plan))
    stats = job.load_pretrained(folder)
    bound = 0  # this rank's slices, plus the partial rows a flat shard's window starts and ends in
    for fqn, p in job.named_parameters():
        shape = job.program.params[fqn].shape
        local = job.compute_copies().get(fqn, p)
        bound += (local.numel() + 2 * math.prod(shape[1:])) * p.element_size()
    state = job.state_dict()
    loss = job.step(mesh.shard_batch(x), mesh.shard_batch(y), zoo.lm_loss).item()
    return {"state": state, "loss": loss, "counted": _Counting.read, "stats": stats, "bound": bound}


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama")
    zoo.build("llama", seed=3).save_pretrained(folder, max_shard_size="20KB")
    assert len([f for f in os.listdir(folder) if f.endswith(".safetensors")]) > 2
    return str(folder)


@pytest.mark.parametrize("mesh_sizes,plan", [({"dp": 2}, {"zero": 3}), ({"tp": 2}, {}),
                                             ({"pp": 2}, {"microbatches": 2})], ids=["dp2-zero3", "tp2", "pp2"])
def test_sharded_hf_folder_loads_into_shards(llama_folder, mesh_sizes, plan):
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(llama_folder)
    x, y = zoo.batches(1, BATCH)[0]
    ref_loss = zoo.lm_loss(ref(x), y).item()
    ranks = run_ranks(load_rank, math.prod(mesh_sizes.values()), llama_folder, "llama", mesh_sizes, plan, timeout=240)
    whole = sum(t.numel() * t.element_size() for t in ref.state_dict().values())
    for rank, out in enumerate(ranks):
        for key, value in ref.state_dict().items():
            assert torch.equal(out["state"][key], value), f"rank {rank}: {key} differs from the files"
        assert abs(out["loss"] - ref_loss) < 2e-5, (rank, out["loss"], ref_loss)
        assert out["counted"] == out["stats"].bytes_read, (out["counted"], out["stats"])
        assert out["counted"] <= out["bound"], f"rank {rank} read {out['counted']} bytes, its slices hold {out['bound']}"
        assert out["counted"] < 0.75 * whole, f"rank {rank} read {out['counted']} of {whole} bytes"


def test_single_file_torch_file_and_checkpoint_load(tmp_path):
    mesh = meshc.mesh()
    src = zoo.build("gpt2", seed=4)
    x, y = zoo.batches(1, 2)[0]
    expected = src.state_dict()
    src.save_pretrained(tmp_path / "hf")  # one model.safetensors, bf16 variant below
    torch.save({k: v.to(torch.bfloat16) for k, v in expected.items()}, tmp_path / "bf16.pt")
    job = meshc.compile(_meta("gpt2"), mesh, example_inputs=(x,), plan=meshc.Plan(trace="non-strict", zero=1))
    job.load_pretrained(tmp_path / "hf")
    assert all(torch.equal(job.state_dict()[k], v) for k, v in expected.items())
    job.save(tmp_path / "ckpt")
    job.load_pretrained(tmp_path / "bf16.pt")  # bf16 values into the fp32 masters: the cast, exactly
    assert all(torch.equal(job.state_dict()[k], v.to(torch.bfloat16).float()) for k, v in expected.items())
    again = meshc.compile(_meta("gpt2"), mesh, example_inputs=(x,), plan=meshc.Plan(trace="non-strict"))
    again.load_pretrained(tmp_path / "ckpt")
    assert all(torch.equal(again.state_dict()[k], v) for k, v in expected.items())


def hf_round_trip_rank(folder: str, out: str) -> None:
    mesh = meshc.mesh(timeout_s=90, tp=2)
    x, _ = zoo.batches(1, BATCH)[0]
    job = meshc.compile(_meta("llama"), mesh, example_inputs=(mesh.shard_batch(x),),
                        plan=meshc.Plan(trace="non-strict"))
    job.load_pretrained(folder)
    job.save(out)


def test_hf_to_meshc_to_hf_is_bitwise(llama_folder, tmp_path):
    """Hugging Face files -> a tp=2 job's shards -> a meshc checkpoint -> `meshc checkpoint export --to hf`:
    every tensor of the exported file equals the original files' (safetensors, bitwise)."""
    from safetensors.torch import load_file

    from meshc.runtime.checkpoint import save_load as checkpoint

    run_ranks(hf_round_trip_rank, 2, llama_folder, str(tmp_path / "ckpt"), timeout=240)
    exported = load_file(checkpoint.export(str(tmp_path / "ckpt"), to="hf", out=str(tmp_path / "out.safetensors")))
    original = {}
    for name in os.listdir(llama_folder):
        if name.endswith(".safetensors"):
            original.update(load_file(os.path.join(llama_folder, name)))
    assert set(original) <= set(exported), sorted(set(original) - set(exported))
    for key, value in original.items():
        assert torch.equal(exported[key], value), key


def test_bad_weights_are_named(tmp_path):
    from safetensors.torch import save_file

    mesh = meshc.mesh()
    x, _ = zoo.batches(1, 2)[0]
    job = meshc.compile(_meta("llama"), mesh, example_inputs=(x,), plan=meshc.Plan(trace="non-strict"))
    state = {k: v.contiguous() for k, v in zoo.build("llama").state_dict().items()}
    missing = dict(state)
    del missing["model.norm.weight"]
    save_file(missing, tmp_path / "missing.safetensors")
    with pytest.raises(meshc.MeshcError, match=r"1 missing \(model\.norm\.weight\).*strict=False"):
        job.load_pretrained(tmp_path / "missing.safetensors")
    save_file({**state, "extra.weight": torch.zeros(2)}, tmp_path / "extra.safetensors")
    with pytest.raises(meshc.MeshcError, match=r"1 unexpected \(extra\.weight\)"):
        job.load_pretrained(tmp_path / "extra.safetensors")
    save_file({**state, "model.norm.weight": torch.ones(8)}, tmp_path / "shape.safetensors")
    with pytest.raises(meshc.MeshcError, match=r"shape\.safetensors: expected model\.norm\.weight of shape \(32,\).*got \(8,\)"):
        job.load_pretrained(tmp_path / "shape.safetensors")
    save_file(state, tmp_path / "cut.safetensors")
    data = (tmp_path / "cut.safetensors").read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(meshc.MeshcError, match=r"cut\.safetensors: .*truncated"):
        job.load_pretrained(tmp_path / "cut.safetensors")
    with pytest.raises(meshc.MeshcError, match=r"a folder with neither"):
        job.load_pretrained(tmp_path)
    assert job.pending(), "a failed load must not count as values"
    with pytest.raises(meshc.MeshcError, match=r"none for model\.norm\.weight.*init_weights"):
        job.load_pretrained(tmp_path / "missing.safetensors", strict=False)


def test_meta_model_needs_example_inputs():
    mesh = meshc.mesh()
    with pytest.raises(meshc.MeshcError, match=r"example_inputs.*shapes"):
        meshc.compile(_meta("gpt"), mesh, example_inputs=None)
