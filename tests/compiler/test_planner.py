"""The planner: what it returns always fits, it explains its ranking, the rules good engineers follow fall out
of the cost model's bandwidths, plan="auto" compiles the best plan, and offload is priced by the bytes a real
offloaded step moves. Whether its choice on 2 gloo ranks is the fastest plan measured is a speed target:
benchmarks/cost_speed.py (and benchmarks/planner_bench.py over every plan), DESIGN.md §6."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import meshc
from meshc import models
from meshc.compiler.cost import hardware
from meshc.compiler.cost.compiled import estimate_compiled
from meshc.compiler.cost.offload import with_offload
from meshc.compiler.planner.search import Search, plan_model

H100 = hardware.load("h100")
BF16 = Search(param_dtype=torch.bfloat16, schedules=("1f1b", "zb-h1"), remat=("none", "full"))


def test_never_returns_a_plan_that_does_not_fit():
    memory = 40e9
    result = plan_model(models.shape("llama-8b", seq=4096), 16, 64, H100, memory, BF16)
    assert result.ranked and result.rejected  # some fit, some do not
    assert all(r.estimate.total_memory <= memory for r in result.ranked)
    assert result.best.rank == 1 and result.best.reason.startswith("fastest of")
    times = [r.estimate.step_time for r in result.ranked]
    assert times == sorted(times)
    assert "did not" in result.table()


def test_nothing_fits_is_an_error():
    shape = models.shape("llama-70b", seq=4096)
    result = plan_model(shape, 8, 8, H100, 80e9, dataclasses.replace(BF16, offload=False))
    with pytest.raises(ValueError, match="planner: expected a plan that fits in .* got none"):
        result.best
    with pytest.raises(ValueError, match="planner: expected a plan that fits in .* got none"):
        plan_model(shape, 8, 8, H100, 10e9, BF16).best  # not even with every state offloaded


def test_offload_plans_come_when_nothing_else_fits():
    """Llama-70B on 8 x 80 GB: no plan fits; with the optimizer states in host memory (or on disk) some do. Their
    memory is the plan's without the states, plus the pool; their step pays the transfers the update cannot hide."""
    shape = models.shape("llama-70b", seq=4096)
    plain = plan_model(shape, 8, 8, H100, 80e9, dataclasses.replace(BF16, offload=False))
    result = plan_model(shape, 8, 8, H100, 80e9, BF16)
    assert not plain.ranked and result.ranked
    best = result.best
    assert best.candidate.plan.offload in ("cpu", "nvme") and best.estimate.total_memory <= 80e9
    assert best.estimate.time["offload"] > 0 and any("offload=" in n for n in best.estimate.notes)
    assert "offload=" in result.table()
    kinds = {r.candidate.plan.offload for r in result.ranked}
    assert kinds == {"cpu", "nvme"}  # PCIe beats the disk: cpu first
    assert result.ranked[0].candidate.plan.offload == "cpu"
    nvme = [r for r in result.ranked if r.candidate.plan.offload == "nvme"]
    assert all(r.candidate.plan.offload_dir for r in nvme)  # a plan the user can construct: it names the folder


def test_offload_prices_what_it_moves():
    """with_offload on a plan's estimate: states (and ZeRO-3 shards on nvme) leave the memory, the pool comes
    in, and the exposed I/O is the transfers the update does not hide; the bytes moved are checked against a
    real offloaded step (test_offload_io_is_what_a_step_moves)."""
    from meshc.compiler.cost.formulas import Estimate

    gib = 2**30
    est = Estimate(source="formula", memory={"params": 2 * gib, "grads": 2 * gib, "optimizer": 8 * gib,
                                             "activations": gib, "buffers": 0.0},
                   time={"compute": 1.0, "optimizer": 0.5})
    cpu = hardware.load("cpu-default")
    assert with_offload(meshc.Plan(), est, cpu, "nvme") is None  # zero=0: nothing sharded to offload
    assert with_offload(meshc.Plan(zero=3), est, cpu, "cpu") is None  # host memory is a CPU's own memory
    assert with_offload(meshc.Plan(zero=3), est, dataclasses.replace(cpu, disk_read=0.0), "nvme") is None
    plan, out = with_offload(meshc.Plan(zero=3), est, cpu, "nvme")
    assert plan.offload == "nvme" and plan.offload_params and plan.offload_dir
    assert out.memory["optimizer"] == 0 and out.memory["params"] == 0
    assert out.memory["buffers"] == 64 * 2**20  # the pool: 1/32 of 10 GiB, at most 64 MiB
    # the update (0.5 s) hides as much of the I/O: one more second of it takes one second off, down to 0
    longer = dataclasses.replace(est, time=dict(est.time, optimizer=1.5))
    assert with_offload(meshc.Plan(zero=3), longer, cpu, "nvme")[1].time["offload"] == \
        pytest.approx(out.time["offload"] - 1.0)
    hidden = dataclasses.replace(est, time=dict(est.time, optimizer=1e9))
    assert with_offload(meshc.Plan(zero=3), hidden, cpu, "nvme")[1].time["offload"] == 0.0
    plan, out = with_offload(meshc.Plan(zero=2), est, H100, "cpu")
    assert not plan.offload_params and out.memory["params"] == 2 * gib  # ZeRO-2: only the states move
    states, shards = (_moved(meshc.Plan(zero=z), est, cpu, "nvme") for z in (2, 3))
    assert states[0] < shards[0] and states[1] < shards[1]  # with the shards, more is read and written


def _moved(plan, est, hw, kind: str) -> tuple[float, float]:
    """(bytes read, bytes written) per step by with_offload's pricing: its exposed time on a profile that reads at
    1 B/s and writes for free, and the other way round, with an update that hides nothing."""
    est = dataclasses.replace(est, time=dict(est.time, optimizer=0.0))
    probe = {"read": dict(disk_read=1.0, disk_write=1e30), "written": dict(disk_read=1e30, disk_write=1.0)}
    return tuple(with_offload(plan, est, dataclasses.replace(hw, **speeds), kind)[1].time["offload"]
                 for speeds in probe.values())


def test_offload_io_is_what_a_step_moves(fake_mesh, tmp_path, monkeypatch):
    """The bytes with_offload prices (from the compiled estimate of the plan without offload, as the planner
    scores it) against a real offloaded step of the tiny GPT on dp=2 (torch's fake process group; the I/O is
    real): what the optimizer's streaming step read and wrote (OffloadStats) plus, with the parameter shards in
    the file (ZeRO-3), what ZeRO-3's gathers read of them (every bucket's shards, counted as each gather packs
    them). Written: exact. Read: exact at ZeRO-2; at ZeRO-3 the model reads every shard again in backward, while
    the buckets kept gathered through backward (Plan.zero_keep_last) are not read twice, so it may count up to
    2% more on this 2-layer model (1.2% measured 2026-12-04), never less."""
    from meshc.runtime.ops import pages
    from meshc.runtime.zero import offload as offload_mod

    handed = []  # bytes of the tensors each drop was handed: the shards a gather read (and, at the optimizer's
    drop = pages.drop  # step, the whole mapping: not counted below)

    def counting(tensors):
        tensors = list(tensors)
        handed.append(sum(t.numel() * t.element_size() for t in tensors))
        return drop(tensors)
    monkeypatch.setattr(pages, "drop", counting)
    cpu = hardware.load("cpu-default")
    x = torch.zeros(2, 64, dtype=torch.long)
    for zero, params in ((2, False), (3, True)):
        mesh = fake_mesh(dp=2)
        plan = meshc.Plan(trace="non-strict", zero=zero)
        job = meshc.compile(models.build("gpt-tiny", layers=2), mesh, example_inputs=(x,), plan=plan)
        est = estimate_compiled(job.compiled, cpu)
        assert with_offload(plan, est, cpu, "nvme")[0].offload_params == params
        read, written = _moved(plan, est, cpu, "nvme")
        plan = dataclasses.replace(plan, offload="nvme", offload_dir=str(tmp_path), offload_params=params)
        job = meshc.compile(models.build("gpt-tiny", layers=2), mesh, example_inputs=(x,), plan=plan)
        opt = job.optimizer(torch.optim.AdamW, lr=1e-3)
        for _ in range(2):  # the second step: states exist from the start, as in training
            handed.clear()
            job.step(x, x, models.lm_loss)
            gathered = sum(handed)  # the shards ZeRO-3's gathers read (pack_dropping), forward and backward
            opt.step()
            opt.zero_grad()
        stats = offload_mod.of(opt).stats
        measured = stats.read_bytes + gathered
        assert stats.written_bytes > 0 and bool(gathered) == params, (zero, stats, gathered)
        assert written == stats.written_bytes, (zero, written, stats)
        if zero == 2:
            assert read == measured, (zero, read, measured)
        else:
            assert measured <= read <= 1.02 * measured, (zero, read, measured)


def test_tensor_parallel_stays_inside_a_node():
    """On 8-GPU nodes the best plans keep tp <= 8, and tp = 16 is far slower than tp = 8; give the network
    NVLink's bandwidth and most of that gap closes: the rule comes from the bandwidths, not the planner."""
    shape = models.shape("llama-70b", seq=4096)
    search = dataclasses.replace(BF16, remat=("full",), schedules=("1f1b",))

    def best_by_tp(hw) -> tuple[list, dict[int, float]]:
        ranked = plan_model(shape, 64, 64, hw, 80e9, search).ranked
        best: dict[int, float] = {}
        for r in ranked:
            best.setdefault(r.candidate.tp, r.estimate.step_time)
        return list(ranked), best
    ranked, ib = best_by_tp(H100)
    assert all(r.candidate.tp <= 8 for r in ranked[:10])
    _, flat = best_by_tp(dataclasses.replace(H100, inter=H100.intra))  # one NVLink domain of 64 GPUs
    assert ib[16] / ib[8] > 2 * flat[16] / flat[8], (ib, flat)


def test_pipeline_goes_across_nodes_rather_than_tensor_parallel():
    """16 GPUs on 2 nodes: tp=8 × pp=2 (pipeline messages cross the network) beats tp=16 × pp=1."""
    shape = models.shape("llama-8b", seq=4096)
    search = dataclasses.replace(BF16, meshes=((1, 8, 2), (1, 16, 1)), zero=(1,))
    result = plan_model(shape, 16, 16, H100, 80e9, search)
    assert (result.best.candidate.tp, result.best.candidate.pp) == (8, 2)
    loser = next(r for r in result.ranked if r.candidate.tp == 16)
    assert "tensor-parallel collectives across nodes" in loser.reason


def test_compile_auto_uses_the_best_plan(fake_mesh, monkeypatch, tmp_path):
    profile = tmp_path / "cpu.json"
    hardware.load("cpu-default").save(str(profile))
    monkeypatch.setenv("MESHC_HARDWARE", str(profile))
    mesh = fake_mesh(dp=2)
    tokens = torch.zeros(4, 64, dtype=torch.long)
    job = meshc.compile(models.build("gpt-tiny"), mesh, example_inputs=(tokens,), plan="auto")
    from meshc.compiler.planner.compiled import auto_plan

    plan, result = auto_plan(models.build("gpt-tiny"), mesh, (tokens,), {})
    assert job.plan == plan == result.best.candidate.plan
    assert result.best.estimate.total_memory <= result.memory


@pytest.mark.parametrize("dtype,memory", [(torch.bfloat16, 40e9), (torch.bfloat16, 1e9), (None, 20e9)])
def test_pruning_by_memory_changes_no_result(dtype, memory):
    """plan_model sets aside the plans whose memory alone exceeds the budget before timing them: the best plan,
    the ranked list (estimates, ranks, reasons), the count that did not fit and the leanest of them are those
    of scoring every plan."""
    shape, search = models.shape("llama-8b"), Search(param_dtype=dtype)
    pruned = plan_model(shape, 64, 64, H100, memory, search)
    full = plan_model(shape, 64, 64, H100, memory, search, prune=False)
    assert pruned.ranked == full.ranked and pruned.rejected == full.rejected
    assert pruned.smallest_rejected == full.smallest_rejected and pruned.rejected
    assert pruned.table(10) == full.table(10)
    if full.ranked:  # at 1 GB nothing fits but one plan with its states offloaded
        assert pruned.best == full.best and (len(full.ranked) > 100 or full.best.candidate.plan.offload)


def test_moe_models_get_expert_parallelism():
    """Mixtral-8x7B on 64 H100s: the fastest plans shard the experts (ep > 1; 8 experts allow ep 2, 4, 8 of dp);
    a dense model is never offered ep."""
    result = plan_model(models.shape("mixtral-8x7b"), 64, 64, H100, search=BF16)
    assert result.best.candidate.ep > 1 and 8 % result.best.candidate.ep == 0
    assert "ep=" in result.table(3) and result.best.estimate.time["ep"] > 0
    eps = {r.candidate.ep for r in result.ranked}
    assert eps <= {1, 2, 4, 8} and len(eps) > 1
    dense = plan_model(models.shape("llama-8b", seq=4096), 16, 64, H100, 40e9, BF16)
    assert {r.candidate.ep for r in dense.ranked} == {1}


def test_one_long_sequence_gets_context_parallelism():
    """Llama-8B at 131,072 tokens, a global batch of one sequence on 8 H100s: without cp dp must be 1 (the batch
    divides by dp × m), so the sequence can only be split by tp; with cp every rank holds 1/8 of it and the planner
    picks cp=8. Without remat every plan without cp needs over 100 GB: there only a cp plan fits."""
    shape = models.shape("llama-8b", seq=131072)
    with_cp = plan_model(shape, 8, 1, H100, 80e9, BF16)
    without = plan_model(shape, 8, 1, H100, 80e9, dataclasses.replace(BF16, context=False))
    best = with_cp.best.candidate
    assert (best.dp, best.cp) == (8, 8) and best.plan.cp_attention in ("ring", "all_to_all")
    assert with_cp.best.estimate.step_time < without.best.estimate.step_time
    assert {r.candidate.dp for r in without.ranked} == {1} and "cp=8(" in with_cp.table(1)
    lean = dataclasses.replace(BF16, remat=("none", "selective"), schedules=("1f1b",), offload=False)
    assert not plan_model(shape, 8, 1, H100, 90e9, dataclasses.replace(lean, context=False)).ranked
    assert plan_model(shape, 8, 1, H100, 90e9, lean).best.candidate.cp == 8


def test_hybrid_sharding_is_offered_across_nodes_and_wins_over_sharding_everything():
    """Llama-8B on 64 H100s (8 nodes of 8): ZeRO-3 over all 64 ranks gathers every parameter over InfiniBand twice
    per step; hybrid sharding (replicas=8) gathers within the node and all-reduces 1/8 of the gradients across
    nodes: the planner offers it (one replica group per node) and ranks it first; on one node it is not offered."""
    shape = models.shape("llama-8b", seq=4096)
    lean = dataclasses.replace(BF16, remat=("none",), schedules=("1f1b",), sequence_parallel=(False,),
                               vocab_parallel=(False,), context=False, offload=False)
    result = plan_model(shape, 64, 64, H100, 80e9, lean)
    best = result.best
    assert best.candidate.plan.replicas == best.candidate.dp * best.candidate.tp // H100.ranks_per_node > 1
    flat = plan_model(shape, 64, 64, H100, 80e9, dataclasses.replace(lean, hybrid=False))
    assert {r.candidate.plan.replicas for r in flat.ranked} == {1}
    assert best.estimate.step_time < flat.best.estimate.step_time
    assert f"replicas={best.candidate.plan.replicas}" in result.table(1)
    assert {r.candidate.plan.replicas for r in plan_model(shape, 8, 8, H100, 80e9, lean).ranked} == {1}


def test_context_parallelism_only_where_it_can_run():
    """cp is offered only with 2·cp dividing the sequence (8,008 tokens: cp 1, 2 or 4 of 16 ranks), only as the
    smallest cp that lets dp/cp × m divide the batch, and never to a model with experts (ep and cp together are
    refused)."""
    shape = models.shape("llama-8b", seq=8008)
    result = plan_model(shape, 16, 2, H100, 80e9, BF16)
    cps = {r.candidate.cp for r in result.ranked}
    assert cps == {1, 2, 4} and all(shape.seq % (2 * r.candidate.cp) == 0 for r in result.ranked)
    for r in result.ranked:
        c = r.candidate
        assert 2 % (c.dp // c.cp * c.plan.microbatches) == 0
        assert c.cp == 1 or 2 % (c.dp // (c.cp // 2) * c.plan.microbatches), c.describe()  # half the cp would not do
    moe = plan_model(models.shape("mixtral-8x7b", seq=4096), 64, 8, H100, search=BF16)
    assert {r.candidate.cp for r in moe.ranked} == {1} and moe.ranked


class _SoftmaxBlock(torch.nn.Module):
    """A block no tensor-parallel plan can split (a softmax over the features follows its one linear)."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(64, 64)

    def forward(self, x):
        return x + torch.softmax(self.proj(x), dim=-1)


class _MlpBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(64, 256), torch.nn.Linear(256, 64)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


@pytest.mark.parametrize("block, tp_share", [(_SoftmaxBlock, 1.0), (_MlpBlock, 0.5)])
def test_compiled_scoring_sees_what_tensor_parallelism_really_shards(block, tp_share):
    """The compiled path prices tp from the sharded graph, not from a formula that assumes every block splits:
    a model whose blocks stay whole on tp gets no memory or FLOPs back from tp=2; an MLP gets half."""
    from meshc.compiler.planner.compiled import _traced, estimate_plan
    from meshc.compiler.ir.mesh_spec import MeshSpec

    torch.manual_seed(0)
    model = torch.nn.Sequential(*(block() for _ in range(2)))
    x, plan, cpu = torch.randn(4, 8, 64), meshc.Plan(trace="non-strict", check_trace=False), hardware.load("cpu")
    est = {tp: estimate_plan(_traced(model, MeshSpec({"tp": tp}), 0, (x,), {}, plan, {}), plan, cpu) for tp in (1, 2)}
    assert est[2].memory["params"] == pytest.approx(tp_share * est[1].memory["params"], rel=0.02)
    assert est[2].flops == pytest.approx(tp_share * est[1].flops, rel=0.05)
    held = 1.0 if tp_share == 1.0 else 0.0  # the estimate says what it priced: the share of the blocks sharded
    assert f"tp coverage {1 - held:.2f} of the blocks' weight bytes (priced as compiled)" in est[2].notes


def test_one_microbatch_schedules_are_enumerated_once():
    """With one micro-batch, GPipe's and 1F1B's actions are the same (each rank's F, then its B): the search
    offers that plan once (as 1F1B), so neither the ranking nor a measured suite holds a duplicate; with more
    micro-batches both stay, and zero-bubble (a split backward) stays at m = 1."""
    from meshc.compiler.planner.search import Search, plans_for

    search = Search(zero=(0,), remat=("none",), schedules=("1f1b", "gpipe", "zb-h1"), microbatches=(1, 2))
    plans = list(plans_for((1, 1, 2), 8, search))
    by_m = {m: sorted(p.schedule for p in plans if p.microbatches == m) for m in (1, 2)}
    assert by_m == {1: ["1f1b", "zb-h1"], 2: ["1f1b", "gpipe", "zb-h1"]}


def test_zbv_is_enumerated_where_each_rank_gets_two_stages():
    """ZBV runs 2·pp stages: offered (with virtual=2, at every micro-batch count) only to a model with at least
    2·pp layers, and never with selective recompute (its I and W halves run backward twice); DualPipeV likewise,
    from 2·pp micro-batches."""
    from meshc.compiler.planner.search import Search, plans_for

    search = Search(zero=(0,), remat=("none", "selective"), schedules=("zbv",), microbatches=(1, 3))
    plans = list(plans_for((1, 1, 2), 6, search, layers=4))
    assert sorted((p.microbatches, p.virtual, p.remat) for p in plans) == [(1, 2, "none"), (3, 2, "none")]
    assert not list(plans_for((1, 1, 2), 6, search, layers=3))
    assert {"zbv", "dualpipev"} <= set(Search().schedules)
    dual = dataclasses.replace(search, schedules=("dualpipev",), microbatches=(2, 4))  # needs m >= 2 pp
    assert [(p.schedule, p.microbatches) for p in plans_for((1, 1, 2), 8, dual, layers=4)] == [("dualpipev", 4)]
