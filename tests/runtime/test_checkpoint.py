"""Sharded checkpoints: the piece layout against local_shard, the reshard matrix on gloo (saved at dp=2 x tp=2,
loaded at dp=4 ZeRO-3, tp=4, pp=2 x dp=2 and in one process; saved again under each of those and loaded in one
process; saved in one process and loaded at dp=4 ZeRO-3), bitwise resumption in a new process group, atomic
saves, refusal of partial and crafted folders, and export to one ordinary state dict."""
from __future__ import annotations

import json
import math
import os
import pickle
import random
import shutil

import pytest
import torch

import meshc
from meshc.compiler.ir.placement import FlatShard, Replicate, Shard, Whole
from meshc.compiler.ir.program import ParamSpec
from meshc.runtime.checkpoint import save_load as checkpoint
from meshc.runtime.checkpoint.format import pieces, writes
from meshc.runtime.sharding import local_shard
from tests import zoo
from tests.harness import run_ranks

PLAN = dict(trace="non-strict")
LR = 1e-3


# ---------------------------------------------------------------------------------------- layout
class _Sizes:
    """The two things local_shard reads from a mesh: axis sizes and a rank's coordinates."""

    def __init__(self, sizes):
        self.sizes = sizes

    def coords(self, rank):
        out = {}
        for axis in ("tp", "dp", "pp"):
            rank, out[axis] = divmod(rank, self.sizes[axis])
        return out


def test_pieces_match_local_shard_and_writers_tile_the_whole():
    """Random shapes and placements (S with chunks, ZeRO flat shards of tp shards, padding): every rank's
    pieces are exactly its local elements, and the writers' pieces cover every element once."""
    rng = random.Random(0)
    for _ in range(300):
        sizes = {"pp": 1, "dp": rng.choice([1, 2, 3, 4]), "tp": rng.choice([1, 2, 4])}
        shape = [rng.randint(1, 5) for _ in range(rng.choice([0, 1, 2, 3]))]
        placements = {"dp": FlatShard() if rng.random() < 0.6 else Replicate(), "tp": Replicate()}
        if shape and rng.random() < 0.7:
            d, chunks = rng.randrange(len(shape)), rng.choice([1, 3, "unequal", "whole"])
            if chunks == "unequal":  # q|k|v blocks of their own sizes (grouped-query attention)
                chunks = tuple(sizes["tp"] * rng.randint(1, 3) for _ in range(3))
                shape[d] = sum(chunks)
            elif chunks == "whole":  # q sharded, k and v held whole by every tp rank (multi-query)
                chunks = (sizes["tp"] * rng.randint(1, 3), Whole(rng.randint(1, 2)), Whole(rng.randint(1, 2)))
                shape[d] = sum(chunks)
            else:
                shape[d] = chunks * sizes["tp"] * rng.randint(1, 3)
            placements["tp"] = Shard(d, chunks)
        full = torch.arange(1, math.prod(shape) + 1, dtype=torch.float32).reshape(shape)
        spec = ParamSpec("w", tuple(shape), torch.float32, placements)
        mesh, cover = _Sizes(sizes), torch.zeros(shape)
        for rank in range(sizes["dp"] * sizes["tp"]):
            coords = mesh.coords(rank)
            local = local_shard(full, spec, mesh, rank)
            held = 0
            for p in pieces(local, tuple(shape), placements, sizes, coords):
                box = tuple(slice(o, o + n) for o, n in zip(p.offsets, p.sizes))
                assert torch.equal(full[box], p.view), (shape, placements, sizes, rank)
                held += p.view.numel()
            assert held == local.numel() or isinstance(placements["dp"], FlatShard)  # padding is never a piece
            if writes("w", placements, sizes, coords, 0):
                for p in pieces(local, tuple(shape), placements, sizes, coords, writer=True):
                    cover[tuple(slice(o, o + n) for o, n in zip(p.offsets, p.sizes))] += 1
        assert bool((cover == 1).all()), (shape, placements, sizes)


def test_unequal_blocks_give_each_rank_its_part_of_every_block():
    """S(0)x(4+2+2) over tp=2: rank 0 holds rows 0-1 of q, 4 of k and 6 of v; rank 1 the others."""
    full = torch.arange(8.0)
    spec = ParamSpec("w", (8,), torch.float32, {"dp": Replicate(), "tp": Shard(0, (4, 2, 2))})
    mesh = _Sizes({"pp": 1, "dp": 1, "tp": 2})
    assert local_shard(full, spec, mesh, 0).tolist() == [0, 1, 4, 6]
    assert local_shard(full, spec, mesh, 1).tolist() == [2, 3, 5, 7]


def test_whole_blocks_are_held_by_every_rank_and_written_once():
    """S(0)x(4+R2+R2) over tp=2 (multi-query k and v beside q's shard): each rank holds its half of q and all of k
    and v; the writers' pieces hold k and v once."""
    full = torch.arange(8.0)
    spec = ParamSpec("w", (8,), torch.float32, {"dp": Replicate(), "tp": Shard(0, (4, Whole(2), Whole(2)))})
    mesh = _Sizes({"pp": 1, "dp": 1, "tp": 2})
    assert local_shard(full, spec, mesh, 0).tolist() == [0, 1, 4, 5, 6, 7]
    assert local_shard(full, spec, mesh, 1).tolist() == [2, 3, 4, 5, 6, 7]
    assert spec.local_shape({"tp": 2, "dp": 1}) == (6,)
    written = [[(p.offsets, p.sizes) for p in pieces(local_shard(full, spec, mesh, r), (8,), spec.placements,
                                                     mesh.sizes, mesh.coords(r), writer=True)] for r in range(2)]
    assert written == [[((0,), (2,)), ((4,), (2,)), ((6,), (2,))], [((2,), (2,))]]


# ---------------------------------------------------------------------------------------- reshard matrix
TARGETS = {  # name -> (mesh sizes, plan): the plans a (dp=2, tp=2) checkpoint is loaded under
    "dp4_zero3": ({"dp": 4}, {"zero": 3}),
    "tp4": ({"tp": 4}, {}),
    "pp2_dp2": ({"pp": 2, "dp": 2}, {"microbatches": 2}),
}


def _train(sizes: dict, plan: dict, data, seed: int = 0):
    mesh = meshc.mesh(timeout_s=60, **sizes)
    job = meshc.compile(zoo.gpt2(seed), mesh, example_inputs=(mesh.shard_batch(data[0][0]),),
                        plan=meshc.Plan(**PLAN, **plan))
    return mesh, job, job.optimizer(torch.optim.AdamW, lr=LR)


def _params(job) -> dict:
    return {k: v.clone() for k, v in job.state_dict().items()}  # a copy: whole tensors may alias the live ones


def _step(mesh, job, opt, batch) -> float:
    loss = job.step(mesh.shard_batch(batch[0]), mesh.shard_batch(batch[1]), zoo.lm_loss)
    opt.step()
    opt.zero_grad()
    return loss.item()


def _one_rank_save(folder: str) -> dict:
    """A world of one: one step, saved; what it holds (loaded on 4 ranks by _matrix_rank)."""
    data = zoo.batches(1, 8)
    mesh, job, opt = _train({}, {}, data, seed=2)
    _step(mesh, job, opt, data[0])
    job.save(folder, step=1, extra={"data_position": 1})
    return {"params": _params(job), "optim": checkpoint.full_optimizer_state(job, opt)}


def _matrix_rank(folder: str, one_rank: str) -> dict | None:
    """One world of 4 ranks: train 2 steps at dp=2 x tp=2 and save; then, on new meshes over the same world,
    compile each target plan from other weights, load, and take one step more. The dp=4 ZeRO-3 job then
    also loads the checkpoint of a world of one (more ranks)."""
    data = zoo.batches(3, 8)
    mesh, job, opt = _train({"dp": 2, "tp": 2}, {}, data)
    for batch in data[:2]:
        _step(mesh, job, opt, batch)
    job.save(folder, step=2, extra={"data_position": 2})
    out = {"saved": {"params": _params(job), "optim": checkpoint.full_optimizer_state(job, opt),
                     "loss": _step(mesh, job, opt, data[2])}}
    for name, (sizes, plan) in TARGETS.items():
        mesh, job, opt = _train(sizes, plan, data, seed=1)
        step, extra = job.load(folder)
        job.save(f"{folder}_from_{name}", step=step, extra=extra)  # the other way: saved under the target plan
        out[name] = {"step": step, "extra": extra, "params": _params(job),
                     "optim": checkpoint.full_optimizer_state(job, opt), "loss": _step(mesh, job, opt, data[2])}
        if name == "dp4_zero3":
            assert job.load(one_rank) == (1, {"data_position": 1})
            out["more_ranks"] = {"params": _params(job), "optim": checkpoint.full_optimizer_state(job, opt)}
    return out if mesh.rank == 0 else None


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    root = tmp_path_factory.mktemp("matrix")
    folder, one_rank = str(root / "step_2"), str(root / "one_rank")
    saved_by_one = run_ranks(_one_rank_save, 1, one_rank, timeout=120)[0]
    out = run_ranks(_matrix_rank, 4, folder, one_rank, timeout=240)[0]
    return folder, dict(out, one_rank=saved_by_one)


def _assert_same_state(got: dict, want: dict) -> None:
    assert got["params"].keys() == want["params"].keys()
    for key, value in want["params"].items():
        assert torch.equal(got["params"][key], value), key
    assert got["optim"].keys() == want["optim"].keys()
    for fqn, states in want["optim"].items():
        assert got["optim"][fqn].keys() == states.keys(), fqn
        for name, value in states.items():
            mine = got["optim"][fqn][name]
            assert torch.equal(mine, value) if isinstance(value, torch.Tensor) else mine == value, (fqn, name)


@pytest.mark.parametrize("target", list(TARGETS))
def test_reshard_matrix_is_bitwise(matrix, target):
    _, out = matrix
    got, saved = out[target], out["saved"]
    assert (got["step"], got["extra"]) == (2, {"data_position": 2})
    _assert_same_state(got, saved)
    # Same weights and states; the step's arithmetic differs only in the order of tp/dp reductions and
    # micro-batch accumulation: fp32 rounding of a loss of ~4.2, measured below 1e-6 (FACTS: ~1e-5 in logits).
    assert abs(got["loss"] - saved["loss"]) <= 1e-5, (got["loss"], saved["loss"])


def test_load_in_one_process_is_bitwise(matrix, single_mesh):
    """Fewer ranks: 4-rank checkpoints into a world of one (no sharding left), the one saved at dp=2 x tp=2
    and those saved again under each target plan right after its load (ZeRO-3 -> dp, tp=4 -> 1, pp=2 -> 1)."""
    folder, out = matrix
    data = zoo.batches(3, 8)
    job = meshc.compile(zoo.gpt2(1), single_mesh, example_inputs=(data[0][0],), plan=meshc.Plan(**PLAN))
    opt = job.optimizer(torch.optim.AdamW, lr=LR)
    for source in ["", *(f"_from_{name}" for name in TARGETS)]:
        with torch.no_grad():  # nothing of the previous load may survive into this one
            for p in job.parameters():
                p.fill_(float("nan"))
        opt.state.clear()
        assert job.load(folder + source) == (2, {"data_position": 2}), source
        got = {"params": _params(job), "optim": checkpoint.full_optimizer_state(job, opt)}
        _assert_same_state(got, out["saved"])


def test_load_on_more_ranks_is_bitwise(matrix):
    """More ranks: a world of one's checkpoint into dp=4 ZeRO-3 (flat shards of every tensor)."""
    _, out = matrix
    _assert_same_state(out["more_ranks"], out["one_rank"])


def _owned_heads_rank(folder: str) -> dict:
    """tp=2 holding whole heads per rank (a ModuleList of per-head modules, Owned): one AdamW step, saved; then
    loaded into a fresh tp=2 job and into dp=2 (heads whole on every rank), from other weights."""
    data = zoo.batches(1, 8)

    def train(sizes: dict, seed: int):
        mesh = meshc.mesh(timeout_s=60, **sizes)
        job = meshc.compile(zoo.build("head_list_plain", seed), mesh, example_inputs=(mesh.shard_batch(data[0][0]),),
                            plan=meshc.Plan(**PLAN))
        return mesh, job, job.optimizer(torch.optim.AdamW, lr=LR)

    mesh, job, opt = train({"tp": 2}, 0)
    _step(mesh, job, opt, data[0])
    job.save(folder, step=1)
    out = {"held": {f: tuple(p.shape) for f, p in job.named_parameters() if ".heads." in f},
           "saved": {"params": _params(job), "optim": checkpoint.full_optimizer_state(job, opt)}}
    for name, sizes in {"tp2": {"tp": 2}, "dp2": {"dp": 2}}.items():
        mesh, job, opt = train(sizes, 1)
        assert job.load(folder) == (1, {})
        out[name] = {"params": _params(job), "optim": checkpoint.full_optimizer_state(job, opt)}
    return out


def test_whole_heads_held_per_rank_save_and_load_under_any_plan_bitwise(tmp_path, single_mesh):
    folder = str(tmp_path / "heads")
    results = run_ranks(_owned_heads_rank, 2, folder, timeout=240)
    for rank, out in enumerate(results):  # each rank holds two of the four heads whole, none of the others
        mine = {h for h in range(4) if out["held"][f"blocks.0.heads.{h}.query.weight"] == (8, 32)}
        assert mine == {2 * rank, 2 * rank + 1} and all(out["held"][f"blocks.0.heads.{h}.query.weight"] == (0, 32)
                                                        for h in set(range(4)) - mine), out["held"]
        for name in ("tp2", "dp2"):
            _assert_same_state(out[name], results[0]["saved"])
    data = zoo.batches(1, 8)
    job = meshc.compile(zoo.build("head_list_plain", 1), single_mesh, example_inputs=(data[0][0],),
                        plan=meshc.Plan(**PLAN))
    opt = job.optimizer(torch.optim.AdamW, lr=LR)
    assert job.load(folder) == (1, {})
    _assert_same_state({"params": _params(job), "optim": checkpoint.full_optimizer_state(job, opt)},
                       results[0]["saved"])


# ---------------------------------------------------------------------------------------- export
@pytest.mark.parametrize("to", ["hf", "torch"])
def test_export_loads_into_the_original_model(matrix, tmp_path, to):
    import meshc.__main__ as cli

    folder, out = matrix
    target = str(tmp_path / f"model.{to}")
    assert cli.main(["checkpoint", "export", folder, "--to", to, "--out", target]) == 0
    if to == "hf":
        from safetensors.torch import load_file

        state = load_file(target)
    else:
        state = torch.load(target, weights_only=True)
    model = zoo.gpt2(seed=3)
    model.load_state_dict(state)  # strict: every key of the model, tied lm_head.weight included
    for key, value in out["saved"]["params"].items():
        assert torch.equal(model.state_dict()[key], value), key


def test_hf_export_streams_shards_of_bounded_size(matrix, tmp_path, monkeypatch):
    """--max-shard-size 20000 (the model holds ~110 kB): Hugging Face's shard files and index, each file at most
    20000 bytes of tensors, each read of the checkpoint at most one shard's tensors (never the model), the values
    those the job held, and transformers' from_pretrained loads the folder."""
    import meshc.__main__ as cli
    from safetensors import safe_open
    from transformers import GPT2LMHeadModel

    from meshc.runtime.checkpoint import export as export_module

    folder, out = matrix
    limit, reads = 20_000, []
    read_whole = export_module.read_whole

    def recording(path, manifest, fqns):
        full = read_whole(path, manifest, fqns)
        reads.append(sum(t.numel() * t.element_size() for t in full.values()))
        return full
    monkeypatch.setattr(export_module, "read_whole", recording)
    hf = tmp_path / "hf"
    hf.mkdir()
    target = str(hf / "model.safetensors")
    assert cli.main(["checkpoint", "export", folder, "--to", "hf", "--out", target, "--max-shard-size", str(limit)]) == 0
    index = json.loads((hf / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) == len(reads) >= 4 and max(reads) <= limit, (files, reads)
    assert files == [f"model-{i:05d}-of-{len(files):05d}.safetensors" for i in range(1, len(files) + 1)]
    assert not os.path.exists(target)  # several shards: no single file
    state, total = {}, 0
    for name in files:
        with safe_open(str(hf / name), framework="pt") as f:
            shard = {k: f.get_tensor(k) for k in f.keys()}
        data = sum(t.numel() * t.element_size() for t in shard.values())
        assert data <= limit, (name, data)
        assert all(index["weight_map"][k] == name for k in shard)
        state.update(shard)
        total += data
    assert index["metadata"]["total_size"] == total
    model = zoo.gpt2(seed=3)
    model.load_state_dict(state)  # strict: every key, the tied lm_head.weight included
    for key, value in out["saved"]["params"].items():
        assert torch.equal(state[key], value), key
    model.config.save_pretrained(str(hf))
    loaded = GPT2LMHeadModel.from_pretrained(str(hf))
    for key, value in out["saved"]["params"].items():
        assert torch.equal(loaded.state_dict()[key], value), key


def test_shard_sizes_are_read_as_hugging_face_writes_them():
    from meshc.runtime.checkpoint.export import parse_size

    assert [parse_size(s) for s in ("5GB", "500MB", "2GiB", "1.5KB", 123)] == [5 * 10**9, 5 * 10**8, 2 * 2**30, 1500, 123]
    for bad in ("five", "0", "-1MB", "5XB"):
        with pytest.raises(ValueError, match="shard size"):
            parse_size(bad)


# ---------------------------------------------------------------------------------------- safety
class _Evil:
    """A pickle that, when loaded, creates the file `marker`."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_crafted_pickle_is_refused_without_running(matrix, tmp_path, single_mesh):
    folder, _ = matrix
    crafted, marker = str(tmp_path / "crafted"), str(tmp_path / "pwned")
    payload = pickle.dumps(_Evil(marker), protocol=2)
    pickle.loads(payload).close()  # the control: unpickled, the payload runs
    assert os.path.exists(marker)
    os.remove(marker)
    shutil.copytree(folder, crafted)
    with open(os.path.join(crafted, ".metadata"), "wb") as f:  # where DCP looks for its pickled metadata
        pickle.dump(_Evil(marker), f)
    data = zoo.batches(1, 8)
    job = meshc.compile(zoo.gpt2(1), single_mesh, example_inputs=(data[0][0],), plan=meshc.Plan(**PLAN))
    with pytest.raises(ValueError, match=r"unexpected '\.metadata'.*never writes pickles"):
        job.load(crafted)
    assert not os.path.exists(marker)
    # the data files themselves: a pickle in place of a tensor record, same size, is refused by
    # torch.load(weights_only=True) before anything runs
    os.remove(os.path.join(crafted, ".metadata"))
    data_file = os.path.join(crafted, "__0_0.distcp")
    size = os.path.getsize(data_file)
    with open(data_file, "wb") as f:
        f.write(payload + b"\0" * (size - len(payload)))
    with pytest.raises(ValueError, match="expected readable tensors.*[Ww]eights.only"):
        job.load(crafted)
    assert not os.path.exists(marker)


def _edit_manifest(folder: str, edit) -> None:
    path = os.path.join(folder, "meshc.json")
    with open(path) as f:
        manifest = json.load(f)
    edit(manifest)
    with open(path, "w") as f:
        json.dump(manifest, f)


def test_partial_checkpoints_are_refused(matrix, tmp_path):
    folder, _ = matrix
    cases = {
        "no_manifest": (lambda d: os.remove(os.path.join(d, "meshc.json")), "without it"),
        "truncated": (lambda d: os.truncate(os.path.join(d, "__1_0.distcp"), 100),
                      r"__1_0.distcp of \d+ bytes, got 100"),
        "missing_rank": (lambda d: os.remove(os.path.join(d, "rank_00002.json")), "rank_00002.json .* got no file"),
        "outside": (lambda d: _edit_manifest(d, lambda m: m["files"].update({"../step_2/meshc.json": 1})),
                    r"plain file names inside the folder, got '\.\./step_2/meshc\.json'"),
    }
    for name, (damage, message) in cases.items():
        broken = str(tmp_path / name)
        shutil.copytree(folder, broken)
        damage(broken)
        with pytest.raises(ValueError, match=message):
            checkpoint.export(broken, to="torch", out=str(tmp_path / "x.pt"))
    os.makedirs(tmp_path / "never.partial")
    with pytest.raises(ValueError, match="never.partial is a save that did not finish"):
        checkpoint.export(str(tmp_path / "never"), to="torch")


def test_latest_skips_interrupted_saves(matrix, tmp_path):
    folder, _ = matrix
    shutil.copytree(folder, tmp_path / "step_2")
    shutil.copytree(folder, tmp_path / "step_4.partial")  # complete-looking, but never renamed into place
    os.makedirs(tmp_path / "step_9")  # no manifest
    assert checkpoint.latest(str(tmp_path)) == str(tmp_path / "step_2")
    shutil.copytree(folder, tmp_path / "step_2.old")  # the one step_2 replaced: never taken while step_2 exists
    assert checkpoint.latest(str(tmp_path)) == str(tmp_path / "step_2")
    shutil.rmtree(tmp_path / "step_2")  # a save died between its two renames: step_2.old is the whole one
    assert checkpoint.latest(str(tmp_path)) == str(tmp_path / "step_2.old")
    assert checkpoint.latest(str(tmp_path / "nothing")) is None


# ---------------------------------------------------------------------------------------- resumption
N = 3  # steps before and after the save


def _resume_rank(folder: str, resume: bool) -> dict:
    """2N steps with a save after N; or, resuming, load and run the last N. Dropout is on, so the RNG
    states must come back too; ZeRO-1 so that compute copies are rebuilt from the checkpoint."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=zoo.VOCAB, n_positions=zoo.SEQ,
                                       resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1, use_cache=False,
                                       bos_token_id=0, eos_token_id=0))
    data = zoo.batches(2 * N, 8)
    mesh = meshc.mesh(timeout_s=60, dp=2)
    job = meshc.compile(model, mesh, example_inputs=(mesh.shard_batch(data[0][0]),),
                        plan=meshc.Plan(zero=1, **PLAN))
    opt = job.optimizer(torch.optim.AdamW, lr=LR)
    start = 0
    if resume:
        start, extra = job.load(folder)
        assert extra == {"data_position": start}
    losses = []
    for i in range(start, 2 * N):
        losses.append(_step(mesh, job, opt, data[i]))
        if not resume and i + 1 == N:
            job.save(folder, step=N, extra={"data_position": N})
    return {"losses": losses, "params": _params(job)}


def test_resume_is_bitwise_in_a_new_process_group(tmp_path):
    folder = str(tmp_path / "step_3")
    straight = run_ranks(_resume_rank, 2, folder, False, timeout=120)[0]
    resumed = run_ranks(_resume_rank, 2, folder, True, timeout=120)[0]  # new processes, new process group
    assert resumed["losses"] == straight["losses"][N:]  # bitwise: same plan, same arithmetic, same RNG
    for key, value in straight["params"].items():
        assert torch.equal(resumed["params"][key], value), key


def test_save_never_deletes_what_meshc_did_not_write(tmp_path, single_mesh):
    """A results folder at the save path, or a foreign PATH.old/PATH.partial, is refused and left intact;
    meshc's own checkpoint at the path is replaced, and its .old removed."""
    data = zoo.batches(1, 8)
    job = meshc.compile(zoo.gpt2(1), single_mesh, example_inputs=(data[0][0],), plan=meshc.Plan(**PLAN))
    results = tmp_path / "results"
    results.mkdir()
    (results / "notes.txt").write_text("a user's own file")
    with pytest.raises(ValueError, match=r"results to be absent or a meshc checkpoint, got a folder"):
        job.save(results)
    assert (results / "notes.txt").read_text() == "a user's own file"
    assert not (tmp_path / "results.partial").exists()
    target = tmp_path / "ckpt"
    job.save(target, step=1)
    job.save(target, step=2)  # its own checkpoint: replaced, and the .old it made on the way removed
    assert json.loads((target / "meshc.json").read_text())["step"] == 2
    assert not (tmp_path / "ckpt.old").exists() and not (tmp_path / "ckpt.partial").exists()
    assert "meshc-partial" not in os.listdir(target)
    foreign = tmp_path / "ckpt.old"
    foreign.mkdir()
    (foreign / "keep.txt").write_text("not meshc's")
    with pytest.raises(ValueError, match=r"ckpt\.old to be absent or meshc's own checkpoint folder"):
        job.save(target, step=3)
    assert (foreign / "keep.txt").exists() and json.loads((target / "meshc.json").read_text())["step"] == 2


def _zbv_rank(folder: str) -> dict:
    """Two steps under ZBV at pp=2 (stages 0 and 3 on rank 0: the tied embedding and head there), saved; then a
    1F1B job over the same ranks loads it and takes the third step."""
    data = zoo.batches(3, 8)
    mesh = meshc.mesh(timeout_s=60, pp=2)
    out = {}
    for name, plan in (("zbv", {"schedule": "zbv", "microbatches": 2}), ("1f1b", {"microbatches": 2})):
        job = meshc.compile(zoo.gpt2(1 if name == "1f1b" else 0, layers=4), mesh, example_inputs=(data[0][0],),
                            plan=meshc.Plan(**PLAN, **plan))
        opt = job.optimizer(torch.optim.AdamW, lr=LR)
        if name == "zbv":
            for batch in data[:2]:
                _step(mesh, job, opt, batch)
            job.save(folder, step=2)
        else:
            assert job.load(folder) == (2, {})
        out[name] = {"params": _params(job), "optim": checkpoint.full_optimizer_state(job, opt),
                     "loss": _step(mesh, job, opt, data[2]), "held": sorted(k for k, _ in job.named_parameters())}
    return out


def test_a_zbv_checkpoint_loads_under_another_schedule_bitwise(tmp_path):
    for rank, out in enumerate(run_ranks(_zbv_rank, 2, str(tmp_path / "zbv"), timeout=180)):
        _assert_same_state(out["1f1b"], out["zbv"])
        assert out["1f1b"]["loss"] == out["zbv"]["loss"], rank  # the same state, the same third step
        assert out["zbv"]["held"] != out["1f1b"]["held"], rank  # and the ranks held other parameters under each
