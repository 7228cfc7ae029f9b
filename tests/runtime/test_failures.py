"""Failures never hang: `kill -9` of one rank in forward, backward, the optimizer step and a save makes every
other rank fail within the configured timeout, naming the dead rank and the op it waited in; a stalled rank is
named at the timeout; a rank-divergent plan is refused before the first step; an elastic run under torchrun
restarts from its last checkpoint and ends where an uninterrupted run ends."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import meshc
from meshc.compiler.ir import torch_compat as compat
from meshc.runtime.checkpoint import save_load as checkpoint
from meshc.runtime.checkpoint import format as checkpoint_format
from meshc.runtime.monitor.failures import first_mismatch
from tests import zoo
from tests.harness import RankFailure, run_ranks
from tests.runtime import elastic_train

TIMEOUT_S = 10  # the mesh timeout the tests configure: every survivor must be gone well within it
PLAN = dict(trace="non-strict")
PHASES = {  # phase -> (mesh sizes, plan): a plan with collectives in that phase
    "forward": ({"tp": 2}, {}),
    "backward": ({"tp": 2}, {}),
    "optimizer": ({"dp": 2}, {"zero": 1}),  # ZeRO-1: reduce-scatter before the update, all-gather after
    "save": ({"dp": 2}, {}),
}


def _die(marks: str, stall_s: float = 0.0) -> None:
    with open(os.path.join(marks, "victim"), "w") as f:
        f.write(repr(time.time()))
    time.sleep(stall_s)  # alive but never joining the collective, until the survivor has given up
    os.kill(os.getpid(), signal.SIGKILL)


def _arm(phase: str, marks: str, job, opt, state: dict):
    """Make this rank kill itself at the first collective of `phase` once state["armed"] is set; returns the
    loss function to use (backward is armed by the loss's own backward)."""
    if phase in ("forward", "backward", "stall"):
        original = compat.all_reduce_sum

        def all_reduce_sum(t, group_name):
            if state["armed"] and (phase != "backward" or state["in_backward"]):
                _die(marks, stall_s=state["timeout_s"] + 2.5 if phase == "stall" else 0.0)
            return original(t, group_name)
        compat.all_reduce_sum = all_reduce_sum
    elif phase == "optimizer":
        opt.register_step_pre_hook(lambda *_: _die(marks) if state["armed"] else None)  # after the job's reduce-scatter
    elif phase == "save":
        original_resolve = checkpoint_format.PieceSavePlanner.resolve_data

        def resolve_data(self, item):  # dies while writing its shards
            if state["armed"]:
                _die(marks)
            return original_resolve(self, item)
        checkpoint_format.PieceSavePlanner.resolve_data = resolve_data

    class _Mark(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, g):
            state["in_backward"] = True
            return g
    return lambda out, y: _Mark.apply(zoo.lm_loss(out, y))


def _victim_rank(phase: str, marks: str, folder: str, timeout_s: float) -> None:
    sizes, plan = PHASES.get(phase, ({"tp": 2}, {}))
    mesh = meshc.mesh(timeout_s=timeout_s, **sizes)
    with open(os.path.join(marks, f"pid{mesh.rank}"), "w") as f:
        f.write(str(os.getpid()))
    data = zoo.batches(2, 8)
    job = meshc.compile(zoo.gpt2(), mesh, example_inputs=(mesh.shard_batch(data[0][0]),),
                        plan=meshc.Plan(**PLAN, **plan))
    opt = job.optimizer(torch.optim.AdamW, lr=1e-3)
    state = {"armed": False, "in_backward": False, "timeout_s": timeout_s}
    loss_fn = _arm(phase, marks, job, opt, state)
    for i, (x, y) in enumerate(data):
        state["armed"], state["in_backward"] = mesh.rank == 1 and i == 1, False
        try:
            job.step(mesh.shard_batch(x), mesh.shard_batch(y), loss_fn)
            opt.step()
            opt.zero_grad()
            if phase == "save":  # step 1: the previous checkpoint; step 2: killed midway
                job.save(folder, step=i + 1)
        except Exception:
            with open(os.path.join(marks, f"failed{mesh.rank}"), "w") as f:
                f.write(repr(time.time()))
            raise


def _survivor_report(phase: str, tmp_path, timeout_s: float = TIMEOUT_S, grace: float = 20.0) -> tuple[str, float]:
    marks, folder = str(tmp_path), str(tmp_path / "ckpt")
    with pytest.raises(RankFailure) as info:
        run_ranks(_victim_rank, 2, phase, marks, folder, timeout_s, timeout=120, grace=grace)
    text = str(info.value)
    survivor = text.split("--- rank 0 ---", 1)[1].split("--- rank 1 ---", 1)[0]
    killed = float(open(tmp_path / "victim").read())
    failed = float(open(tmp_path / "failed0").read())
    for rank in (0, 1):  # no process left behind
        pid = int(open(tmp_path / f"pid{rank}").read())
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    return survivor, failed - killed


@pytest.mark.parametrize("phase,op", [
    ("forward", r"job.step #2 \(forward\) while waiting in all_reduce_sum over tp \(ranks 0,1\)"),
    ("backward", r"job.step #2 \(backward\) while waiting in all_reduce_sum over tp \(ranks 0,1\)"),
    ("optimizer", r"optimizer.step #2 while waiting in all_gather over dp \(ranks 0,1\)"),
    ("save", r"job.save #2 while waiting in torch.distributed\.\w+ \(ranks 0,1\)"),
])
def test_kill_9_is_named_by_every_survivor_within_the_timeout(tmp_path, phase, op):
    import re

    survivor, seconds = _survivor_report(phase, tmp_path)
    assert "RankFailure" in survivor and re.search(op, survivor), survivor
    assert "rank 1 is dead" in survivor, survivor
    # a death ends the wait: the survivor does not sit out the timeout (how soon it raises, ~0.05 s to see the
    # death and 1 s of watching the heartbeats, is benchmarks/failure_latency.py's to measure)
    assert 0 < seconds < TIMEOUT_S, seconds
    if phase == "save":  # the save that died left the previous checkpoint whole
        manifest = checkpoint_format.check_folder(str(tmp_path / "ckpt"))
        assert manifest["step"] == 1
        assert os.path.isdir(tmp_path / "ckpt.partial")
        torch.load(checkpoint.export(str(tmp_path / "ckpt"), to="torch"), weights_only=True)


def test_a_stalled_rank_is_named_at_the_timeout(tmp_path):
    """A rank alive but never joining is named once the survivor gives up, and not before the timeout it is to
    wait for (a stall is no death: nothing ends the wait early). How soon after the timeout it raises (gloo's
    timeout, then 1 s of watching the heartbeats) is measured by benchmarks/failure_latency.py."""
    survivor, seconds = _survivor_report("stall", tmp_path, timeout_s=4)
    assert "rank 1 is alive but never joined the op (stalled in job.step #2)" in survivor, survivor
    assert seconds >= 4, seconds


# ---------------------------------------------------------------------------------------- pre-flight
def _divergent_rank() -> str:
    mesh = meshc.mesh(timeout_s=30, dp=2)
    x, y = (mesh.shard_batch(t) for t in zoo.batches(1, 8)[0])
    plan = meshc.Plan(microbatches=2 if mesh.rank == 0 else 4, **PLAN)  # one rank given another count
    job = meshc.compile(zoo.gpt2(), mesh, example_inputs=(x,), plan=plan)
    try:
        job.step(x, y, zoo.lm_loss)
    except ValueError as e:
        return str(e)
    return "started"


def test_preflight_refuses_a_rank_divergent_plan():
    for message in run_ranks(_divergent_rank, 2, timeout=60):
        assert "pre-flight: ranks disagree on Plan.microbatches" in message
        assert "got 2 on rank 0 and 4 on rank 1" in message


def test_preflight_names_the_first_collective_that_differs():
    """Same plan, different collective sequences (a rank whose model or compile went another way): the first
    differing collective is named with both values, and a rank with one collective more is caught too."""
    base = {"world": 2, "mesh": {"dp": 2}, "plan": {"zero": "1"}, "params": ["w (4,) torch.float32 dp=F"],
            "messages": []}
    ops = ["all_reduce over dp, 4 B, backward, x1", "all_gather over dp, 16 B, optimizer, x1"]
    same = dict(base, collectives=ops)
    other = dict(base, collectives=[ops[0], "all_gather over dp, 32 B, optimizer, x1"])
    assert first_mismatch([same, dict(same)]) is None
    message = first_mismatch([same, other])
    assert message.startswith("pre-flight: ranks disagree on collectives #1"), message
    assert f"got {ops[1]} on rank 0 and all_gather over dp, 32 B, optimizer, x1 on rank 1" in message
    longer = dict(base, collectives=[*ops, "reduce_scatter over dp, 16 B, backward, x1"])
    assert "collectives #2: expected the same on every rank, got nothing on rank 0 and reduce_scatter" in \
        first_mismatch([same, longer])


def test_preflight_pairs_every_pipeline_send_with_its_receive():
    """In order per kind: NCCL pairs a rank pair's messages in order (activations and gradients on groups of their
    own), so a rank awaiting another order of activations is refused; activations and gradients interleaved
    differently on the two ends (a V schedule) are not."""
    base = {"world": 2, "mesh": {"pp": 2}, "plan": {}, "params": [], "collectives": []}
    first, second = "F micro-batch 0 from stage 0", "F micro-batch 1 from stage 0"
    sender = dict(base, messages=[("send", 1, first), ("send", 1, second)])
    receiver = dict(base, messages=[("recv", 0, second), ("recv", 0, first)])  # one rank expects another order
    message = first_mismatch([sender, receiver])
    assert "pipeline activation message #0 from rank 0 to rank 1" in message
    assert f"got {first} sent by rank 0 and {second} awaited by rank 1" in message
    matched = dict(base, messages=[("recv", 0, what) for _, _, what in sender["messages"]])
    assert first_mismatch([sender, matched]) is None
    grad = "B micro-batch 0 from stage 3"
    mixed = dict(base, messages=[("send", 1, first), ("send", 1, grad), ("send", 1, second)])
    other_mix = dict(base, messages=[("recv", 0, first), ("recv", 0, second), ("recv", 0, grad)])
    assert first_mismatch([mixed, other_mix]) is None
    missing = dict(base, messages=[("recv", 0, first), ("recv", 0, second)])
    assert "pipeline gradient message #0 from rank 0 to rank 1: expected the same on both ends, got " \
           f"{grad} sent by rank 0 and nothing awaited by rank 1" in first_mismatch([mixed, missing])


# ---------------------------------------------------------------------------------------- elastic restart
def test_torchrun_restart_resumes_from_the_last_checkpoint(tmp_path):
    """Rank 1 is killed at step 5 of 6 (once: a marker file); torchrun --max-restarts 1 restarts both ranks,
    which resume from the checkpoint of step 4 and end with the parameters of an uninterrupted run."""
    killed = tmp_path / "killed"
    args = ["--ckpt", str(tmp_path / "ckpt"), "--steps", "6", "--every", "2", "--kill-at", "5",
            "--marker", str(killed), "--out", str(tmp_path / "final.pt")]
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "--max-restarts", "1", elastic_train.__file__, *args],
                          capture_output=True, text=True, timeout=180,
                          env={**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert killed.exists()  # it really died once
    log = json.loads((tmp_path / "final.pt.json").read_text())
    assert log["resumed_from"] == 4, log
    final = torch.load(tmp_path / "final.pt", weights_only=True)
    straight, resumed = run_ranks(elastic_train.train, 2, str(tmp_path / "straight"), 6, 2, timeout=120)[0]
    assert resumed is None
    assert final.keys() == straight.keys()
    for key, value in straight.items():
        assert torch.equal(final[key], value), key  # bitwise: the same plan resumes exactly


_BEATING_AT_EXIT = """
import time
import torch.distributed as dist
from meshc.runtime.monitor import failures
failures.INTERVAL = 0  # beat without pause: the thread is almost always inside TCPStore.set
store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
failures._MONITORS[0] = (None, failures._Monitor(store, 0, 1))
time.sleep(0.3)
"""  # and exit without mesh.close(): the heartbeat must be joined before finalization


def test_process_with_a_heartbeat_exits_cleanly():
    """A daemon thread inside a C++ store call at interpreter exit aborts the process (std::terminate, measured
    20 of 20 times without the atexit join); the heartbeat is joined at exit, so each run ends with 0."""
    for _ in range(3):
        proc = subprocess.run([sys.executable, "-c", _BEATING_AT_EXIT], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, f"exit {proc.returncode}: {proc.stderr[-500:]}"


_LAST_COLLECTIVE_THEN_EXIT = """
import torch.distributed as dist
dist.init_process_group("gloo")
import meshc.runtime.monitor.failures  # noqa: F401 - its exit handler
for i in range(20):
    dist.all_gather_object([None] * dist.get_world_size(), {"i": i})
"""  # gloo destroys the last all-gather's work on its own thread, after wait() returned: at exit, that needs the GIL


def test_ranks_that_exit_right_after_a_collective_end_cleanly(tmp_path):
    """Plain torch loses a rank to std::terminate in 8 of 15 such 4-rank runs (measured); with meshc's exit
    handler 0 of 15. Three runs here: a regression fails this test with probability ~0.9."""
    script = tmp_path / "last_collective.py"
    script.write_text(_LAST_COLLECTIVE_THEN_EXIT)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    for _ in range(3):
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
                               str(script)], capture_output=True, text=True, timeout=120, env=env)
        assert proc.returncode == 0, f"exit {proc.returncode}: {proc.stderr[-800:]}"
