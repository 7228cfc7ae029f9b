"""Offload (Plan.offload): bitwise the plan without it, states held off the process's memory, I/O errors named
on every rank, checkpoints the same with and without it."""
from __future__ import annotations

import os
import shutil

import pytest
import torch

import meshc
from meshc.runtime.zero import offload as offload_mod
from meshc.runtime.zero.offload import StateOffload, offloaded_class, probe_states
from meshc.runtime.zero.offload_store import FileStore, OffloadError
from tests import zoo
from tests.harness import run_ranks

STEPS = 5
POOL_MB = 0.25  # small enough that every model here streams in several buckets (asserted)


def _train(job, opt, x, y, steps: int) -> list[float]:
    losses = []
    for _ in range(steps):
        losses.append(job.step(x, y, zoo.lm_loss).item())
        opt.step()
        opt.zero_grad()
    return losses


def _job(mesh, x, stage: int, offload_dir: str | None, params: bool = False, model: str = "llama"):
    pool = POOL_MB / mesh.size("tp")  # tp halves every shard: so does the pool, to keep several buckets
    extra = dict(offload="nvme", offload_dir=offload_dir, offload_buffer_mb=pool, offload_params=params) \
        if offload_dir else {}
    job = meshc.compile(zoo.build(model), mesh, example_inputs=(x,),
                        plan=meshc.Plan(zero=stage, trace="non-strict", **extra))
    return job, job.optimizer(torch.optim.AdamW, lr=1e-2, weight_decay=0.1)


def _parity_rank(sizes: dict, cases: list, folder: str) -> dict:
    mesh = meshc.mesh(**sizes, timeout_s=60)
    x, y = (mesh.shard_batch(t) for t in zoo.batches(1, 8)[0])
    out = {}
    for stage, params in cases:
        runs = {}
        for where in (None, folder):
            job, opt = _job(mesh, x, stage, where, params)
            losses = _train(job, opt, x, y, STEPS)
            state = {f"{job.pp_owner(f)}:{f}/{k}": v.clone() for p, st in opt.state.items()
                     for f in [dict((id(q), n) for n, q in job.named_parameters())[id(p)]]
                     for k, v in st.items() if isinstance(v, torch.Tensor)}
            runs[where] = (losses, {f: p.detach().clone() for f, p in job.named_parameters()}, state,
                           job.held_bytes(), offload_mod.of(opt))
        (l0, p0, s0, _, _), (l1, p1, s1, held, off) = runs[None], runs[folder]
        full = {f: spec.shape for f, spec in job.program.params.items()}
        out[(stage, params)] = {
            "losses": l0 == l1, "params": all(torch.equal(p0[f], p1[f]) for f in p0) and p0.keys() == p1.keys(),
            "states": s0.keys() == s1.keys() and all(torch.equal(s0[k], s1[k]) for k in s0),
            "held": held, "buckets": off.stats.buckets, "pool": off.stats.pool_bytes,
            "local": {f: p.numel() for f, p in p1.items()}, "full": {f: torch.Size(s).numel() for f, s in full.items()},
            "files": sorted(os.listdir(folder))}
    return out


@pytest.mark.parametrize("sizes", [{"dp": 2}, {"dp": 2, "tp": 2}], ids=["dp2", "dp2xtp2"])
def test_nvme_offload_is_bitwise_the_plan_without_it(sizes, tmp_path):
    """ZeRO-1/2/3 with the AdamW states in the file (and, for stage 3, the parameter shards too), against the same
    plan without offload, same weights: 5 steps, losses, parameters and optimizer states bitwise equal (offload
    moves bytes, the arithmetic is the same element-wise update on the same values)."""
    world = 2 * sizes.get("tp", 1)
    cases = [(1, False), (2, False), (3, False), (3, True)]
    results = run_ranks(_parity_rank, world, sizes, cases, str(tmp_path), timeout=300)
    n, tp = sizes["dp"], sizes.get("tp", 1)
    for rank, out in enumerate(results):
        for case, r in out.items():
            assert r["losses"] and r["params"] and r["states"], (rank, case)
            assert r["buckets"] > 1, (rank, case)  # streamed in several buckets through the pool
            assert r["pool"] <= POOL_MB / sizes.get("tp", 1) * 2**20, (rank, case)
            local, full = sum(r["local"].values()), sum(r["full"].values())
            assert local * n <= full * 1.01, (rank, case)  # masters sharded over dp (1% for the padding)
            if tp > 1:
                assert local * n < 0.75 * full, (rank, case)  # and tp shards most of the weights too
            held = r["held"]
            assert held["optimizer"] == 0, (rank, case, held)  # nothing of the states resident between steps
            # every local element's AdamW states (2 x fp32) are in the store, and with offload_params the shard too
            assert held["offloaded"] == (12 if case[1] else 8) * sum(r["local"].values()), (rank, case, held)
            if case[1]:
                assert held["params"] == 0, (rank, case, held)
    assert not any(results[0][c]["files"] for c in cases)  # the scratch files are unlinked while open: none visible
    assert os.listdir(tmp_path) == []


def test_offloaded_optimizers_keep_their_arithmetic(tmp_path):
    """Element-wise optimizers other than AdamW (Adam with amsgrad: three states; SGD with momentum: one) and a
    closure, one process, a pool of 300 bytes (so that parameters are cut into pieces of a few elements): bitwise
    the plain optimizer over 5 steps, in a file and in host memory."""
    for cls, kwargs in [(torch.optim.Adam, {"lr": 1e-2, "amsgrad": True}), (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})]:
        for kind in ("nvme", "cpu"):
            torch.manual_seed(0)
            base = [torch.nn.Parameter(torch.randn(s)) for s in [(7, 5), (40,), (3, 3, 3), (11,)]]
            mine = [torch.nn.Parameter(p.detach().clone()) for p in base]
            plain = cls(base, **kwargs)
            states = probe_states(cls, kwargs)
            opt = offloaded_class(cls)(mine, **kwargs)
            opt._meshc_offload = off = StateOffload(opt, states, {id(p): f"p{i}" for i, p in enumerate(mine)},
                                                    kind=kind, folder=tmp_path, pool_mb=3 * 100 / 2**20)
            assert type(opt).__name__ == cls.__name__ and off.stats.store_bytes > 0
            pieces = [piece.param for bucket in off.buckets for piece in bucket.pieces]
            assert max(sum(q is p for q in pieces) for p in mine) >= 3  # a parameter is cut over several buckets
            for step in range(STEPS):
                for a, b in zip(base, mine):
                    a.grad = torch.sin(a.detach() * (step + 1))
                    b.grad = a.grad.clone()
                plain.step()
                loss = opt.step(lambda: torch.tensor(float(step)))
                assert loss.item() == step  # the closure ran once, its value returned
            assert off.stats.buckets > 1
            assert all(torch.equal(a, b) for a, b in zip(base, mine)), (cls, kind)
            for a, b in zip(base, mine):
                assert all(torch.equal(plain.state[a][k], opt.state[b][k]) for k in plain.state[a]), (cls, kind)
            off.close()


def test_offload_dir_errors_come_before_the_first_step(tmp_path):
    mesh = meshc.mesh()
    x, _ = zoo.batches(1, 2)[0]
    missing = tmp_path / "absent"
    with pytest.raises(OffloadError, match="expected an existing folder.*absent.*missing"):
        _job(mesh, x, 1, str(missing))
    with pytest.raises(OffloadError, match="expected a folder this process can write"):
        _job(mesh, x, 1, "/proc/1")  # root can write almost anywhere; not into /proc
    free = shutil.disk_usage(tmp_path).free
    with pytest.raises(OffloadError, match=r"offload file .*optimizer_states\.bin: expected room for .* the disk is full"):
        FileStore(tmp_path, 0, free + 2**40, "optimizer_states")
    assert os.listdir(tmp_path) == []  # nothing left behind by the failed store
    with pytest.raises(meshc.MeshcError, match="offload_dir: expected a folder for offload='nvme'"):
        meshc.Plan(zero=1, offload="nvme")
    with pytest.raises(meshc.MeshcError, match="Plan.offload: expected zero >= 1"):
        meshc.Plan(offload="cpu")
    with pytest.raises(meshc.MeshcError, match="offload_params: expected zero=3"):
        meshc.Plan(zero=2, offload="nvme", offload_dir=str(tmp_path), offload_params=True)
    with pytest.raises(meshc.MeshcError, match="offload_buffer_mb: expected room for one element's offloaded bytes"):
        job = meshc.compile(zoo.build("llama"), mesh, example_inputs=(x,),
                            plan=meshc.Plan(zero=1, offload="nvme", offload_dir=str(tmp_path), offload_buffer_mb=1e-5))
        job.optimizer(torch.optim.AdamW)


def _fault_rank(folder: str, which: str) -> str:
    mesh = meshc.mesh(dp=2, timeout_s=5)
    x, y = (mesh.shard_batch(t) for t in zoo.batches(1, 8)[0])
    job, opt = _job(mesh, x, 2, folder)
    _train(job, opt, x, y, 2)
    if mesh.rank == 1:  # the disk fails under rank 1 only (this process's os module; the store calls it per I/O)
        def broken(fd, buffers, offset):
            raise OSError(5, "Input/output error")
        setattr(os, {"read": "preadv", "write": "pwritev"}[which], broken)
    try:
        _train(job, opt, x, y, 2)
    except meshc.MeshcError as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


@pytest.mark.parametrize("which", ["read", "write"])
def test_an_io_error_is_named_on_every_rank(which, tmp_path):
    """A failing read or write of the offload file on one rank: that rank raises an OffloadError naming the file;
    the other, waiting for it in the next collective, raises within the mesh timeout naming rank 1 and the file."""
    out = run_ranks(_fault_rank, 2, str(tmp_path), which, timeout=90)
    assert out[1].startswith("OffloadError") and "optimizer_states.bin" in out[1] and f"{which} of" in out[1], out[1]
    assert out[0].startswith("RankFailure") and "rank 1 failed" in out[0] and "optimizer_states.bin" in out[0], out[0]


def _checkpoint_rank(folder: str, ckpt: str, save_with: bool) -> dict:
    from meshc.runtime.checkpoint.save_load import full_optimizer_state

    mesh = meshc.mesh(dp=2, timeout_s=60)
    x, y = (mesh.shard_batch(t) for t in zoo.batches(1, 8)[0])
    a, opt_a = _job(mesh, x, 3, folder if save_with else None)
    _train(a, opt_a, x, y, 2)
    a.save(ckpt, step=2)
    b, opt_b = _job(mesh, x, 3, None if save_with else folder)
    b.load(ckpt)
    same_params = all(torch.equal(p, dict(b.named_parameters())[f]) for f, p in a.named_parameters())
    ids = {id(p): f for f, p in b.named_parameters()}
    loaded = {ids[id(p)]: {k: v.clone() for k, v in st.items()} for p, st in opt_b.state.items()}
    ids_a = {id(p): f for f, p in a.named_parameters()}
    same_states = all(torch.equal(v, loaded[ids_a[id(p)]][k]) for p, st in opt_a.state.items() for k, v in st.items())
    resident = b.held_bytes()["optimizer"]
    # resharded: into ZeRO-1 (whole tp-local compute copies, flat masters of other extents) with the other
    # offload setting; compared whole, gathered from every rank's shards
    c, opt_c = _job(mesh, x, 1, None if save_with else folder)
    c.load(ckpt)
    whole_a, whole_c = full_optimizer_state(a, opt_a), full_optimizer_state(c, opt_c)
    resharded = whole_a.keys() == whole_c.keys() and all(
        torch.equal(v, whole_c[f][k]) if isinstance(v, torch.Tensor) else v == whole_c[f][k]
        for f, st in whole_a.items() for k, v in st.items())
    resharded = resharded and all(torch.equal(v, c.state_dict()[k]) for k, v in a.state_dict().items())
    return {"params": same_params, "states": same_states, "next": _train(a, opt_a, x, y, 2) == _train(b, opt_b, x, y, 2),
            "resident": resident, "resharded": resharded}


@pytest.mark.parametrize("save_with", [True, False], ids=["offload->none", "none->offload"])
def test_checkpoints_are_the_same_with_and_without_offload(save_with, tmp_path):
    """A ZeRO-3 checkpoint saved with the states offloaded loads into the plan without offload (and back),
    bitwise: parameters, every optimizer state, and the next two steps' losses; and resharded into ZeRO-1 with
    the other offload setting, the whole parameters and states are bitwise the saved ones. Loaded into an
    offloading job, the states go into its file (none resident)."""
    (tmp_path / "off").mkdir()
    out = run_ranks(_checkpoint_rank, 2, str(tmp_path / "off"), str(tmp_path / "ckpt"), save_with, timeout=180)
    for r in out:
        assert r["params"] and r["states"] and r["next"] and r["resharded"], r
        if not save_with:
            assert r["resident"] == 0, r


def _sgd_rank(folder: str, cases: list) -> dict:
    """SGD under ZeRO-3 + offload="nvme", each rank's folder named by a function of its rank, against the same plan
    without offload."""
    import warnings

    mesh = meshc.mesh(dp=2, timeout_s=60)
    x, y = (mesh.shard_batch(t) for t in zoo.batches(1, 8)[0])
    out = {}
    for momentum, params in cases:
        runs = {}
        for where in (None, lambda rank: os.path.join(folder, f"disk{rank}")):
            extra = dict(offload="nvme", offload_dir=where, offload_buffer_mb=POOL_MB, offload_params=params) \
                if where else {}
            job = meshc.compile(zoo.build("llama"), mesh, example_inputs=(x,),
                                plan=meshc.Plan(zero=3, trace="non-strict", **extra))
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                opt = job.optimizer(torch.optim.SGD, lr=0.1, momentum=momentum)
            losses = _train(job, opt, x, y, STEPS)
            runs[where is None] = (losses, {f: p.detach().clone() for f, p in job.named_parameters()},
                                   job.held_bytes(), [str(w.message) for w in caught], job.offload_dir())
        (l0, p0, _, _, _), (l1, p1, held, said, where) = runs[True], runs[False]
        out[(momentum, params)] = {"same": l0 == l1 and all(torch.equal(p0[f], p1[f]) for f in p0), "dir": where,
                                   "held": held, "local": sum(p.numel() for p in p1.values()), "said": said}
    return out


def test_sgd_offloads_what_it_has_on_each_ranks_own_disk(tmp_path):
    """SGD without momentum keeps no states: nothing to offload, it steps in memory and job.optimizer says so; with
    offload_params the parameter shards are still offloaded; with momentum its buffer is. Each rank's folder comes
    from a function of its rank (a rank's disk is its own: the pre-flight does not compare them). Bitwise the plan
    without offload over 5 steps (the same element-wise update on the same values)."""
    for rank in (0, 1):
        os.mkdir(tmp_path / f"disk{rank}")
    cases = [(0.0, False), (0.0, True), (0.9, False)]
    results = run_ranks(_sgd_rank, 2, str(tmp_path), cases, timeout=300)
    for rank, out in enumerate(results):
        for case, r in out.items():
            assert r["same"], (rank, case)
            assert r["dir"] == str(tmp_path / f"disk{rank}"), (rank, r["dir"])
            offloaded = r["held"]["offloaded"]
            if case == (0.0, False):
                assert offloaded == 0 and any("nothing is offloaded" in s for s in r["said"]), (rank, r)
            else:  # fp32: the parameter shard (offload_params) or the momentum buffer, 4 bytes per local element
                assert offloaded == 4 * r["local"] and not r["said"], (rank, case, r["held"])
                assert r["held"]["optimizer"] == 0, (rank, case, r["held"])
    assert sorted(os.listdir(tmp_path)) == ["disk0", "disk1"]  # the scratch files are gone with their jobs


def _mapped_rss(mapping: torch.Tensor) -> int:
    """Bytes of `mapping`'s pages this process holds resident (its VMA's Rss in /proc/self/smaps)."""
    address, inside = mapping.data_ptr(), False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(v, 16) for v in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "Rss:":
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no mapping holds address {address:#x}")


def _pages_rank(folder: str) -> dict:
    from meshc import models
    from meshc.runtime.ops import pages

    mesh = meshc.mesh(dp=2, timeout_s=120)
    x, y = (mesh.shard_batch(t) for t in zoo.batches(1, 8)[0])
    out, keep = {}, pages.drop
    for name, inductor, offload, dropping in [("fx", False, True, True), ("compiled", True, True, True),
                                              ("compiled, no offload", True, False, True),
                                              ("compiled, pages kept", True, True, False)]:
        extra = dict(offload="nvme", offload_dir=folder, offload_buffer_mb=POOL_MB, offload_params=True) \
            if offload else {}
        torch.manual_seed(0)  # width 256: each bucket's shards span many pages (see the test's docstring)
        model = models.build("gpt-tiny", vocab_size=zoo.VOCAB, seq_len=zoo.SEQ, layers=2, dim=256)
        job = meshc.compile(model, mesh, example_inputs=(x,),
                            plan=meshc.Plan(zero=3, inductor=inductor, trace="non-strict", **extra))
        opt = job.optimizer(torch.optim.AdamW, lr=1e-3)
        dropped = []  # per call of the drop: bytes of the tensors it was handed that lie in the offload's file

        def spy(tensors, dropping=dropping):
            tensors = list(tensors)
            off = offload_mod.of(opt)
            dropped.append(sum(t.numel() * t.element_size() for t in tensors if off.is_offloaded(t)))
            if dropping:
                keep(tensors)
        pages.drop = spy
        try:
            losses, rss, drops = [], [], []
            for _ in range(STEPS):
                dropped.clear()
                losses.append(job.step(x, y, zoo.lm_loss).item())
                drops.append(sum(dropped))  # this step's forward and backward (not the optimizer's release)
                off = offload_mod.of(opt)
                rss.append(_mapped_rss(off._map) if off is not None else 0)  # after forward and backward
                opt.step()
                opt.zero_grad()
        finally:
            pages.drop = keep
        shards = sum(p.numel() * p.element_size() for p in job.parameters())
        out[name] = {"losses": losses, "params": {f: p.detach().clone() for f, p in job.named_parameters()},
                     "rss": rss, "shards": shards, "dropped": drops,
                     "reads": [(kind, "pack_dropping" in code) for kind, code in job.inductor.stats.code]}
    return out


def test_compiled_offload_drops_the_shards_pages_as_fx_code_does(tmp_path):
    """ZeRO-3 with offload_params compiled by Inductor: the gathers' reads of the offloaded shards drop their pages
    (meshc_offload::pack_dropping, an op of the graph, forward and the backward's recomputed gathers), so after forward
    and backward the process holds few of the file's pages, as the FX program does; with the drop switched off the
    same compiled step holds the shards' pages (the measure can fail). Compiled, offload is bitwise the compiled plan
    without it over 5 steps (the pack is a copy, the rest of the graph the same).

    "Few", not none: a read fault on a file mapping also maps the pages around it that the page cache holds (the
    kernel's fault-around, 64 KiB windows), the states' places beside each shard among them, so windows at the
    shards' edges stay mapped after the drops (measured: 0.22 of the shards' bytes, against 1.23 kept). So the
    drop is checked twice: the op handed it every shard in the file in forward and again in backward (a spy on the
    drop), and the pages the process holds after the step are fewer than with the drop off by most of the shards.
    The model is wide (width 256: 3.2 MB of shards a rank) so that the windows are a small part of it. That the op
    really unmaps what it is handed, and leaves memory outside the file alone, is test_pack_dropping_unmaps_only_the_
    files_pages."""
    out = run_ranks(_pages_rank, 2, str(tmp_path), timeout=400)
    for rank, r in enumerate(out):
        fx, compiled, plain, kept = (r[k] for k in ("fx", "compiled", "compiled, no offload", "compiled, pages kept"))
        # Inductor compiled a forward and a backward graph, each calling the op (the backward's recomputed gathers)
        assert {kind for kind, _ in compiled["reads"]} == {"forward", "backward"}, (rank, compiled["reads"])
        assert all(reads for _, reads in compiled["reads"]), (rank, compiled["reads"])
        assert plain["reads"] and not any(reads for _, reads in plain["reads"]), (rank, plain["reads"])
        assert compiled["losses"] == plain["losses"], (rank, compiled["losses"], plain["losses"])
        assert all(torch.equal(compiled["params"][f], p) for f, p in plain["params"].items()), rank
        assert compiled["losses"] == kept["losses"], rank
        # the losses FX and compiled agree to fp32 rounding of sums taken in other orders (tests/models/parity.py)
        assert max(abs(a - b) for a, b in zip(fx["losses"], compiled["losses"])) < 2e-5, (fx["losses"], compiled)
        assert min(kept["rss"][1:]) >= 0.9 * kept["shards"], (rank, kept["rss"], kept["shards"])
        for case in (fx, compiled):
            # forward's gathers read every shard but the kept bucket's once, backward's again: all handed to the drop
            assert min(case["dropped"]) >= 1.5 * case["shards"], (rank, case["dropped"], case["shards"])
            assert max(case["rss"]) <= min(kept["rss"][1:]) - 0.6 * case["shards"], (rank, case["rss"], kept["rss"])


def _present(t: torch.Tensor) -> int:
    """Pages of `t` mapped in this process (the present bit of /proc/self/pagemap)."""
    page = 4096
    first, last = t.data_ptr() // page, (t.data_ptr() + t.numel() * t.element_size() - 1) // page
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(first * 8)
        words = f.read((last - first + 1) * 8)
    return sum(int.from_bytes(words[i:i + 8], "little") >> 63 for i in range(0, len(words), 8))


def test_pack_dropping_unmaps_only_the_files_pages(tmp_path):
    """meshc_offload::pack_dropping returns the shards packed (a copy) and unmaps the pages of those in a registered
    file mapping; a tensor in anonymous memory is only read (MADV_DONTNEED there would zero it), and so is one in a
    mapping no longer registered."""
    from meshc.runtime.ops import pages

    store = FileStore(tmp_path, 0, 64 * 4096, "optimizer_states")
    mapping = store.mapping()
    try:
        a, b = mapping[: 16 * 4096].view(torch.float32), mapping[16 * 4096:].view(torch.float32)
        a.copy_(torch.arange(a.numel(), dtype=torch.float32))
        b.fill_(2.0)
        anonymous = torch.arange(40000, dtype=torch.float32)
        pages.register(mapping)
        assert _present(a) == 16 and _present(b) == 48
        out = pages.pack_dropping([a, anonymous], torch.float32)
        assert torch.equal(out, torch.cat([torch.arange(a.numel(), dtype=torch.float32), anonymous]))
        assert _present(a) == 0 and _present(b) == 48  # only the shard handed to it, not its neighbour
        assert torch.equal(anonymous, torch.arange(40000, dtype=torch.float32))  # untouched
        assert torch.equal(a, torch.arange(a.numel(), dtype=torch.float32))  # read back from the file
        pages.unregister(mapping)
        pages.pack_dropping([b], torch.float32)
        assert _present(b) == 48  # no longer registered: read, not dropped
    finally:
        pages.unregister(mapping)
        store.close()
