"""Async saves (runtime/checkpoint/async_save.py) on 2 gloo ranks: what is saved is the state at the call, though
training steps run before the write completes; a second save (async or not) waits for the first; mesh.close()
waits for a pending save; a rank killed during an async save leaves the previous checkpoint loadable and the new
path absent. The background writes are held at a gate (an Event) so that the order of events is forced, not timed."""
from __future__ import annotations

import os
import threading

import pytest
import torch

import meshc
from meshc.runtime.checkpoint import format as checkpoint_format
from meshc.runtime.checkpoint import save_load as checkpoint
from tests import zoo
from tests.harness import RankFailure, run_ranks

PLAN = dict(trace="non-strict")
LR = 1e-3


def _job(sizes: dict, plan: dict, seed: int = 0):
    data = zoo.batches(4, 8)
    mesh = meshc.mesh(timeout_s=30, **sizes)
    job = meshc.compile(zoo.gpt2(seed), mesh, example_inputs=(mesh.shard_batch(data[0][0]),),
                        plan=meshc.Plan(**PLAN, **plan))
    return mesh, job, job.optimizer(torch.optim.AdamW, lr=LR), data


def _step(mesh, job, opt, batch) -> None:
    job.step(mesh.shard_batch(batch[0]), mesh.shard_batch(batch[1]), zoo.lm_loss)
    opt.step()
    opt.zero_grad()


def _state(job, opt) -> dict:
    return {"params": {k: v.clone() for k, v in job.state_dict().items()},
            "optim": checkpoint.full_optimizer_state(job, opt)}


def _gate_writes(events: list, gates: dict) -> None:
    """Record each folder's write and publish in `events`; a folder's write waits for its gate, if it has one."""
    original_write, original_publish = checkpoint_format.JsonWriter.write_data, checkpoint._publish

    def write_data(self, plan, planner):
        name = os.path.basename(self.path).removesuffix(".partial")
        events.append(("write", name))
        if name in gates:
            assert gates[name].wait(60), name
        return original_write(self, plan, planner)

    def publish(work, gathered):
        original_publish(work, gathered)
        events.append(("published", os.path.basename(work.path)))
    checkpoint_format.JsonWriter.write_data = write_data
    checkpoint._publish = publish


def _async_rank(root: str) -> dict:
    """ZeRO-3 at dp=2 (flat shards: the staged pieces are copies of views into them)."""
    mesh, job, opt, data = _job({"dp": 2}, {"zero": 3})
    events, gates = [], {"a": threading.Event(), "b1": threading.Event(), "c": threading.Event()}
    _gate_writes(events, gates)
    out = {}
    # A: two steps run between the call and the write; what is saved is the state at the call
    _step(mesh, job, opt, data[0])
    out["saved"] = _state(job, opt)
    handle = job.save(os.path.join(root, "a"), step=1, extra={"data_position": 1}, async_=True)
    out["returned_before_write"] = not handle.done()
    for batch in data[1:3]:
        _step(mesh, job, opt, batch)
    out["still_writing_after_steps"] = not handle.done()
    gates["a"].set()
    out["path"] = handle.wait()
    out["blocked_s"], out["staged_bytes"], out["write_s"] = handle.blocked_s, handle.staged_bytes, handle.write_s
    out["after"] = _state(job, opt)
    mesh2, job2, opt2, _ = _job({"dp": 2}, {}, seed=1)  # another plan, other weights
    out["load"] = job2.load(os.path.join(root, "a"))
    out["loaded"] = _state(job2, opt2)
    # B: an async save, a second async save, then a synchronous one: each waits for the one before
    events.clear()
    threading.Timer(1.0, gates["b1"].set).start()
    first = job.save(os.path.join(root, "b1"), step=2, async_=True)
    second = job.save(os.path.join(root, "b2"), step=3, async_=True)  # waits here for b1 (its gate opens in 1 s)
    out["first_done_when_second_returned"] = first.done()
    out["second_waited_s"] = second.waited_s
    job.save(os.path.join(root, "b3"), step=4)
    out["order"] = list(events)
    # C: mesh.close() with a save in flight waits for it
    threading.Timer(0.5, gates["c"].set).start()
    pending = job.save(os.path.join(root, "c"), step=5, async_=True)
    mesh.close()
    out["closed_after_write"] = pending.done() and pending._error is None
    return out


@pytest.fixture(scope="module")
def async_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("async")
    return str(root), run_ranks(_async_rank, 2, str(root), timeout=150)


def test_async_save_writes_the_state_at_the_call_bitwise(async_run):
    from tests.runtime.test_checkpoint import _assert_same_state

    root, outs = async_run
    for rank, out in enumerate(outs):
        assert out["returned_before_write"] and out["still_writing_after_steps"], rank  # the steps ran meanwhile
        assert out["path"] == os.path.join(root, "a")
        assert out["load"] == (1, {"data_position": 1})
        _assert_same_state(out["loaded"], out["saved"])  # parameters and AdamW states, bitwise
        changed = [k for k, v in out["saved"]["params"].items() if not torch.equal(v, out["after"]["params"][k])]
        assert changed, "the steps between the call and the write changed nothing: the test would prove nothing"
        assert out["staged_bytes"] > 0 and out["blocked_s"] > 0 and out["write_s"] > 0


def test_a_second_save_waits_for_the_first(async_run):
    _, outs = async_run
    for rank, out in enumerate(outs):
        assert out["first_done_when_second_returned"], rank
        assert out["second_waited_s"] >= 0.5, out["second_waited_s"]  # held while b1's gate was shut
        if rank == 0:  # the publisher: each folder published before the next one's write begins
            assert out["order"] == [("write", "b1"), ("published", "b1"), ("write", "b2"), ("published", "b2"),
                                    ("write", "b3"), ("published", "b3")], out["order"]
        else:
            assert out["order"] == [("write", "b1"), ("write", "b2"), ("write", "b3")], out["order"]


def test_mesh_close_waits_for_a_pending_save(async_run):
    root, outs = async_run
    assert all(out["closed_after_write"] for out in outs)
    assert checkpoint_format.check_folder(os.path.join(root, "c"))["step"] == 5


# ---------------------------------------------------------------------------------------- a rank killed
def _killed_rank(root: str) -> None:
    """A synchronous save of step 1; then an async save of step 2 during whose write rank 1 dies (os._exit from
    the writing thread, after its first tensor record); rank 0 waits for it."""
    mesh, job, opt, data = _job({"dp": 2}, {"zero": 1})
    _step(mesh, job, opt, data[0])
    job.save(os.path.join(root, "step_1"), step=1)
    saved = _state(job, opt)
    if mesh.rank == 0:
        torch.save(saved, os.path.join(root, "expected.pt"))
    _step(mesh, job, opt, data[1])
    if mesh.rank == 1:
        original, calls = checkpoint_format.PieceSavePlanner.resolve_data, []

        def resolve_data(self, item):
            calls.append(item)
            if len(calls) == 2:
                os._exit(1)
            return original(self, item)
        checkpoint_format.PieceSavePlanner.resolve_data = resolve_data
    handle = job.save(os.path.join(root, "step_2"), step=2, async_=True)
    handle.wait()


def test_a_rank_killed_during_an_async_save_leaves_the_previous_checkpoint(tmp_path, single_mesh):
    from tests.runtime.test_checkpoint import _assert_same_state

    root = str(tmp_path)
    with pytest.raises(RankFailure) as info:
        run_ranks(_killed_rank, 2, root, timeout=120, grace=30)
    survivor = str(info.value).split("--- rank 0 ---", 1)[1].split("--- rank 1 ---", 1)[0]
    assert "job.save(async_=True) to " + os.path.join(root, "step_2") in survivor, survivor
    assert "rank 1 is dead" in survivor, survivor
    assert not os.path.exists(os.path.join(root, "step_2"))
    assert not os.path.exists(os.path.join(root, "step_2.partial", "meshc.json"))  # begun, never published
    assert checkpoint.latest(root) == os.path.join(root, "step_1")
    data = zoo.batches(1, 8)
    job = meshc.compile(zoo.gpt2(1), single_mesh, example_inputs=(data[0][0],), plan=meshc.Plan(**PLAN))
    opt = job.optimizer(torch.optim.AdamW, lr=LR)
    assert job.load(os.path.join(root, "step_1")) == (1, {})
    _assert_same_state(_state(job, opt), torch.load(os.path.join(root, "expected.pt"), weights_only=False))
