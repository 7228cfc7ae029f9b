"""The cost model: formulas against the papers, the compiled path against the formulas, and both against
measurements on gloo (bytes exact, model state within 5%) and a real step's ATen calls; step time against
measurement is a benchmark (benchmarks/cost_speed.py)."""
from __future__ import annotations

import dataclasses
import functools

import pytest
import sympy
import torch

import meshc
from meshc import models
from meshc.compiler.cost import formulas as cost
from meshc.compiler.cost import hardware
from meshc.compiler.cost.formulas import FP32, MIXED, formula_estimate, model_state_bytes
from meshc.compiler.cost.compiled import comm_bytes, estimate_compiled, graph_cost, node_flops
from meshc.compiler.planner.compiled import plan_compiled
from tests.compiler import cost_runs


def test_zero_paper_table():
    """ZeRO §5 (Rajbhandari et al. 2020), Figure 1: 7.5B parameters on 64 GPUs, 2 + 2 + 12 bytes."""
    psi, gb = 7.5e9, 1e9
    want = {0: 120.0, 1: 31.4, 2: 16.6, 3: 1.9}
    for zero, total in want.items():
        got = sum(model_state_bytes(psi, 64, zero, MIXED).values()) / gb
        assert abs(got - total) < 0.05, (zero, got)


def test_model_state_formula_is_symbolic():
    psi, n = sympy.symbols("Psi N", positive=True)
    forms = {0: 16 * psi, 1: 4 * psi + 12 * psi / n, 2: 2 * psi + 14 * psi / n, 3: 16 * psi / n}
    for zero, form in forms.items():
        zs = [int(zero == i) for i in (1, 2, 3)]
        expr = sum(cost._states(psi, *zs, n, 2, 2, 12).values())
        assert sympy.simplify(expr - form) == 0


def test_published_parameter_counts():
    for name, billions in {"gpt2-small": 0.1245, "gpt2-xl": 1.558, "llama-8b": 8.03, "llama-70b": 70.55,
                           "llama-405b": 405.85, "mixtral": 46.70}.items():
        assert abs(models.shape(name).params() / 1e9 - billions) / billions < 0.003, name


def test_bubble_and_in_flight_forms_match_the_simulator():
    for name, virtual in (("gpipe", 1), ("1f1b", 1), ("zb-h1", 1), ("interleaved", 2), ("zbv", 2), ("dualpipev", 2)):
        for pp in (2, 3, 4, 8):
            for m in range(1, 3 * pp + 1) if name in ("zb-h1", "zbv") else (pp, 2 * pp):  # the forms' every branch
                if name == "dualpipev":
                    m *= 2  # it needs m >= 2p
                got = cost.schedule_terms(name, pp, m, virtual)
                assert got == pytest.approx(cost._simulated_terms(name, pp, m, virtual), rel=1e-9), (name, pp, m)


def test_collective_alpha_beta():
    link = hardware.Link(bandwidth=1e9, latency=1e-5, kinds={"all_gather": (5e8, 2e-5)})
    assert link.time("all_reduce", 4, 4e6) == pytest.approx(2 * 2 * 1e-5 + 2 * 3 / 4 * 4e6 / 1e9)
    assert link.time("all_gather", 4, 1e6) == pytest.approx(2 * 2e-5 + 3e6 / 5e8)
    assert link.time("all_reduce", 1, 4e6) == 0.0
    h100 = hardware.load("h100")
    assert h100.link(1, 8) is h100.intra and h100.link(1, 16) is h100.inter and h100.link(8, 2) is h100.inter


def test_calibration_fit():
    """meshc calibrate's α-β fit recovers a link from exact samples, and a latency-bound link (noise hides the
    bandwidth) still gets a finite bandwidth, not the fit's 1/0."""
    link = hardware.Link(bandwidth=5e8, latency=2e-4)
    exact = [(hardware.latency_steps("all_reduce", 2), hardware.wire_bytes("all_reduce", 2, p),
              link.time("all_reduce", 2, p)) for p in (4e3, 6.5e4, 5e5, 2e6)]
    alpha, bw = hardware.fit_alpha_beta(exact)
    assert alpha == pytest.approx(2e-4, rel=1e-6) and bw == pytest.approx(5e8, rel=1e-6)
    alpha, bw = hardware.fit_alpha_beta([(1, 4e3, 3e-3), (1, 6.5e4, 3.1e-3), (1, 5e5, 2.9e-3), (1, 2e6, 3.0e-3)])
    assert alpha == pytest.approx(3e-3, rel=0.05) and 1e8 < bw < 1e11


def test_hardware_profiles_are_data(tmp_path):
    path = tmp_path / "p.json"
    hardware.load("a100").save(str(path))
    assert hardware.load(str(path)) == hardware.load("a100")
    with pytest.raises(ValueError, match="unknown profile 'tpu'"):
        hardware.load("tpu")
    with pytest.raises(ValueError, match="Hardware.flops: expected a positive number"):
        hardware.Hardware.from_dict({**hardware.load("h100").to_dict(), "flops": 0})


def test_node_flops_equal_flop_counter(fake_mesh):
    """The shape-only count equals FlopCounterMode's on every matmul of a traced GPT (fake tensors)."""
    from torch.utils.flop_counter import FlopCounterMode

    mesh = fake_mesh(dp=1)
    model = models.build("gpt-tiny")
    job = meshc.compile(model, mesh, example_inputs=(torch.zeros(2, 64, dtype=torch.long),),
                        plan=meshc.Plan(trace="non-strict"))
    checked = 0
    for node in job.program.gm.graph.nodes:
        if node.op != "call_function" or getattr(node.target, "__name__", "") not in ("linear.default", "mm.default",
                                                                                        "addmm.default"):
            continue
        args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta["val"])
        counter = FlopCounterMode(display=False)
        with counter:
            node.target(*args, **kwargs)
        assert node_flops(node) == counter.get_total_flops(), node.format_node()
        checked += 1
    assert checked >= 8


def test_megatron_tensor_parallel_volume(fake_mesh):
    """Compiled graph and formula agree with Megatron: 4 all-reduces of b·s·h per layer per step."""
    mesh = fake_mesh(tp=2)
    shape = models.shape("gpt-tiny")
    b = 4
    job = meshc.compile(models.build("gpt-tiny"), mesh, example_inputs=(torch.zeros(b, 64, dtype=torch.long),),
                        plan=meshc.Plan(trace="non-strict"))
    megatron = 4 * shape.layers * b * shape.seq * shape.hidden * 4  # fp32 payload bytes
    assert comm_bytes(job.program)[("all_reduce", "tp")] == megatron
    est = formula_estimate(shape, {"tp": 2}, job.plan, b, hardware.load("h100"))
    assert est.comm_bytes["tp"] == megatron


@pytest.mark.parametrize("zero,replicas", [(0, 1), (1, 1), (2, 1), (3, 1), (1, 2), (3, 2), (2, 4)])
def test_compiled_and_formula_model_state_agree(fake_mesh, zero, replicas):
    """Also under hybrid sharding (replicas > 1): ZeRO's states divided by dp/replicas, not dp."""
    mesh = fake_mesh(dp=4)
    shape = models.shape("gpt-tiny")
    plan = meshc.Plan(trace="non-strict", zero=zero, replicas=replicas)
    job = meshc.compile(models.build("gpt-tiny"), mesh, example_inputs=(torch.zeros(2, 64, dtype=torch.long),),
                        plan=plan)
    compiled = estimate_compiled(job.compiled, "h100")
    formula = formula_estimate(shape, mesh.sizes, plan, 8, hardware.load("h100"))
    assert compiled.model_state == pytest.approx(formula.model_state, rel=0.02)
    if replicas > 1:  # the states of plain ZeRO over dp/replicas ranks, plus the all-reduce across the groups
        psi = shape.params()
        assert formula.model_state == pytest.approx(sum(model_state_bytes(psi, 4 // replicas, zero, FP32).values()),
                                                    rel=0.02)
        plain = formula_estimate(shape, {"dp": 4 // replicas}, dataclasses.replace(plan, replicas=1), 8 // replicas,
                                 hardware.load("h100"))
        assert formula.comm_bytes["dp"] > plain.comm_bytes["dp"]
        assert job.compiled.program.mesh.size("dps") == 4 // replicas


TINY = {"llama": {"model_type": "llama", "num_key_value_heads": 2},
        "mixtral": {"model_type": "mixtral", "num_key_value_heads": 2, "num_local_experts": 4,
                    "num_experts_per_tok": 2, "router_aux_loss_coef": 0.0}}


@pytest.mark.parametrize("kind", list(TINY))
def test_compiled_and_formula_agree_on_transformers_models(kind, tmp_path):
    """A small Llama (GQA) and Mixtral from config files on tp=2 × pp=2: the first pp rank's compiled
    parameters are its embedding plus a whole number of layers of the formulas' tp-local size (which know
    that meshc splits every expert over tp, as the attention). The split balances FLOPs, so the stage's layer
    count is read, not assumed."""
    import json

    from meshc.explain_cli import simulate

    config = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
              "num_attention_heads": 4, "max_position_embeddings": 32, "tie_word_embeddings": False, **TINY[kind]}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    plan = meshc.Plan(trace="non-strict", microbatches=2)
    sim = simulate(str(path), {"tp": 2, "pp": 2}, plan=plan, batch=4, hardware="h100")
    first = estimate_compiled(sim.rank_program, "h100", own_rank=True)  # rank 0: the first pp rank
    shape = models.shape(str(path))
    layer = cost._layer_params(shape.flags()).subs({**shape.values(), cost.t: 2, cost.c_kv: 2, cost.e: 1})
    stage_layers = (first.memory["params"] / 4 - shape.vocab * shape.hidden) / float(layer)
    assert stage_layers == pytest.approx(round(stage_layers), abs=0.05) and round(stage_layers) >= 1, stage_layers
    if kind == "mixtral":  # the experts, split over tp like the attention, are most of a layer
        experts = 4 * 3 * 64 * 128 / 2
        assert float(layer) > experts > float(layer) / 2


def test_expert_parallel_memory_and_all_to_all_agree(tmp_path):
    """A small Mixtral on dp=4 with ep=2 under ZeRO-3: the compiled rank holds half the experts of every layer,
    ZeRO-sharded over the 2 ranks holding the same ones, as the formulas say (X/e per layer over N/e), and both
    count the same all-to-all bytes per step (4 exchanges of s·b·K·h per layer: dispatch and combine, forward and
    backward)."""
    import json

    from meshc.explain_cli import simulate

    config = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "max_position_embeddings": 32, "tie_word_embeddings": False,
              **TINY["mixtral"]}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    shape = models.shape(str(path))
    for ep in (1, 2):
        plan = meshc.Plan(trace="non-strict", zero=3)
        sim = simulate(str(path), {"dp": 4, "ep": ep}, plan=plan, batch=8, hardware="h100")
        compiled = estimate_compiled(sim.rank_program, "h100")
        formula = formula_estimate(shape, {"dp": 4, "ep": ep}, plan, 8, hardware.load("h100"))
        # layers × E × 3 × h × f, fp32: over ep, then ZeRO over the 4/ep ranks holding the same experts
        experts = 2 * 4 * 3 * 64 * 128 * 4 // ep // (4 // ep)
        held = sum(s.local_bytes(sim.rank_program.program.mesh.sizes)
                   for f, s in sim.rank_program.program.params.items() if ".experts." in f)
        assert held == experts
        assert compiled.memory["params"] == pytest.approx(formula.memory["params"], rel=0.02)
        assert compiled.model_state == pytest.approx(formula.model_state, rel=0.02)
        a2a = 2 * 4 * (8 // 4) * shape.seq * 2 * 64 * 4  # layers × 4 × s·b·K·h × 4 bytes
        assert compiled.comm_bytes.get("ep", 0.0) == (a2a if ep > 1 else 0.0)
        assert formula.comm_bytes.get("ep", 0.0) == pytest.approx(a2a if ep > 1 else 0.0)


def test_compiled_activations_follow_remat(fake_mesh):
    """Saved activations per block: full recompute keeps only the block input (Korthikanti's 2sbh in fp32
    is 4sbh bytes), selective keeps less than none."""
    saved = {}
    for remat in ("none", "selective", "full"):
        mesh = fake_mesh(dp=1)
        job = meshc.compile(models.build("gpt-tiny"), mesh, example_inputs=(torch.zeros(2, 64, dtype=torch.long),),
                            plan=meshc.Plan(trace="non-strict", remat=remat))
        saved[remat] = graph_cost(job.program.gm).saved
    shape = models.shape("gpt-tiny")
    sbh = 2 * 64 * shape.hidden
    assert saved["full"] < saved["selective"] < saved["none"]
    assert saved["none"] - saved["full"] > shape.layers * 20 * sbh  # Korthikanti: 34sbh (16-bit) minus kept parts


# ------------------------------------------------------------------------------------------ on gloo
CASES = cost_runs.CASES


@functools.lru_cache(maxsize=None)
def _counted():
    """Each case's plan among the planner's candidates for the test model on 2 ranks, run for a step and counted
    (nothing timed): {case: [rank 0's counts, rank 1's]}."""
    x, _ = cost_runs.batch()
    result = plan_compiled(cost_runs.model, lambda dp: (x[: x.shape[0] // dp],), 2, hardware.load("cpu-default"),
                           search=cost_runs.SEARCH)
    candidates = cost_runs.candidates_of(result)
    chosen = tuple(candidates[cost_runs.index_of(candidates, **want)] for want in CASES.values())
    runs = cost_runs.count(chosen)
    return {case: [r[i] for r in runs] for i, case in enumerate(CASES)}


@pytest.mark.parametrize("case", list(CASES))
def test_bytes_and_model_state_match_measurement(case):
    """Per rank, the bytes CommCensus counts in a real step equal the compiled path's (kind, axis) totals, and
    the model state held after backward is the estimate's within 5%. (Whether the predicted step time comes
    close to a measured one is a speed target: benchmarks/cost_speed.py, DESIGN.md §6.)"""
    for rank, run in enumerate(_counted()[case]):
        census = {key: nbytes for key, (_, nbytes) in run["census"].items()}
        predicted = {key: nbytes for key, nbytes in run["bytes"].items() if key[0] != "send"}  # p2p: not census'
        assert census == predicted and census, (rank, census, predicted)
        est = run["estimate"]
        for part in ("params", "grads", "optimizer"):
            assert abs(est.memory[part] - run["held"][part]) <= 0.05 * run["held"][part], (rank, part)


def test_shared_cores_shorten_pipelines_only():
    """4 ranks of a node on 2 cores (Hardware.cores): the profile's compute figures were measured with every rank
    busy, so data parallelism (every rank always busy) is predicted as before, while a pipeline's rank runs
    alone in another's bubble: pp=2 x dp=2 with one micro-batch runs its stages one after the other, which on
    enough cores is a bubble as long as the compute, and on 2 cores is none (each stage's 2 ranks then have a
    core each while the other stage's wait: schedule_sim's processor sharing)."""
    import dataclasses

    from meshc.explain_cli import simulate

    base = dataclasses.replace(hardware.load("cpu-default"), ranks_per_node=4)
    with pytest.raises(ValueError, match="Hardware.cores"):
        dataclasses.replace(base, cores=-1)

    def estimates(sizes, m):
        sim = simulate("gpt-tiny", sizes, plan=meshc.Plan(trace="non-strict", microbatches=m), hardware=base)
        return [estimate_compiled(sim.rank_program, dataclasses.replace(base, cores=c)) for c in (0, 4, 2)]
    unshared, enough, shared = estimates({"dp": 4}, 1)
    assert unshared.time == enough.time == shared.time
    unshared, enough, shared = estimates({"dp": 2, "pp": 2}, 1)
    assert unshared.time == enough.time
    assert unshared.time["bubble"] > 0.9 * unshared.time["compute"]  # forward and backward of 2 stages in turn
    # the simulated send latency between the stages stays: the bubble is that latency, not compute
    assert shared.time["bubble"] < 0.01 * unshared.time["compute"]
    assert shared.step_time == pytest.approx(unshared.step_time - unshared.time["bubble"] + shared.time["bubble"])
    # pp=4 with 2 micro-batches: ranks computing together share the 2 cores, so some bubble stays
    unshared, _, shared = estimates({"pp": 4}, 2)
    assert unshared.time["bubble"] > shared.time["bubble"] > 0


def test_zero_bubble_split_overhead_is_priced():
    """Hardware.split_overhead (what meshc calibrate measures zero-bubble's backward split to add per op with a
    weight on a received gradient's path: one more autograd call in W) is paid by each W of a stage that
    receives gradients; a first stage has nothing to send back, so its I is empty and its W all of B."""
    import dataclasses

    from meshc.calibrate import split_overhead
    from meshc.compiler.cost.compiled import stage_times
    from meshc.explain_cli import simulate

    assert split_overhead(2, layers=2, width=32) >= 0.0  # the measurement runs the real split
    base = hardware.load("cpu-default")
    plan = meshc.Plan(trace="non-strict", microbatches=4, schedule="zb-h1")
    sim = simulate("gpt-tiny", {"pp": 2}, rank=1, plan=plan, hardware=base, layers=2)
    stages = sim.rank_program.pipeline.all_stages
    costs = [graph_cost(st.gm) for st in stages]
    assert [c.receives_grad for c in costs] == [False, True] and costs[0].weight_ops == 0
    # the last stage: a block (its 2 norms, qkv and output projections, 2 MLP linears), the final norm, the head
    assert {fqn.split(".")[1] for fqn in stages[1].params if fqn.startswith("blocks.")} == {"1"}
    assert costs[1].weight_ops == 8
    slow = dataclasses.replace(base, split_overhead=1e-3)
    assert stage_times(costs[1], {"pp": 2}, slow).split == pytest.approx(8e-3)
    assert stage_times(costs[0], {"pp": 2}, slow).first
    free, paid = (estimate_compiled(sim.rank_program, hw, own_rank=True) for hw in (base, slow))
    assert paid.time["overhead"] - free.time["overhead"] == pytest.approx(4 * 8e-3)  # m Ws of the last stage
    plan = meshc.Plan(trace="non-strict", microbatches=4, schedule="1f1b")
    sim = simulate("gpt-tiny", {"pp": 2}, rank=1, plan=plan, hardware=base, layers=2)
    assert estimate_compiled(sim.rank_program, slow).time == estimate_compiled(sim.rank_program, base).time


def test_action_overhead_is_paid_on_the_critical_path():
    """Hardware.action_overhead (meshc calibrate: a pipeline over the whole world, 1 against 8 micro-batches) is
    part of each simulated action: the busiest rank pays it for each of its actions (1F1B, pp=2, m=4: 8), and
    the step grows by it once per action on the critical path (between the rank's 8 and 2(m + p - 1) = 10).
    Without a pipeline there is no action to pay for."""
    import dataclasses

    from meshc.explain_cli import simulate

    base = hardware.load("cpu-default")
    slow = dataclasses.replace(base, action_overhead=1e-3)
    plan = meshc.Plan(trace="non-strict", microbatches=4, schedule="1f1b")
    sim = simulate("gpt-tiny", {"pp": 2}, plan=plan, hardware=base, layers=2)
    free, paid = (estimate_compiled(sim.rank_program, hw) for hw in (base, slow))
    assert paid.time["overhead"] - free.time["overhead"] == pytest.approx(8e-3)
    assert 8e-3 - 1e-9 <= paid.step_time - free.step_time <= 10e-3 + 1e-9
    sim = simulate("gpt-tiny", {"dp": 2}, plan=meshc.Plan(trace="non-strict"), hardware=base, layers=2)
    assert estimate_compiled(sim.rank_program, slow).time == estimate_compiled(sim.rank_program, base).time


def test_optimizer_pays_per_parameter_tensor():
    """Hardware.adam_tensor_overhead (meshc calibrate: AdamW on many small tensors against a few large ones of
    the same elements) is paid once per trainable tensor of the busiest rank: a dp rank steps all of the model's
    tensors, a pp=2 rank only those of its stages (fewer), so per-tensor cost favours the pipeline."""
    import dataclasses

    from meshc.calibrate import _adam_costs
    from meshc.explain_cli import simulate

    rate, per_tensor = _adam_costs(quick=True, elements=2**14, few=2, many=32)  # the measurement runs
    assert rate > 0 and per_tensor >= 0
    base = dataclasses.replace(hardware.load("cpu-default"), adam_rate=1e30)  # elements free: tensors alone count
    slow = dataclasses.replace(base, adam_tensor_overhead=1e-3)
    extra = {}
    for sizes in ({"dp": 2}, {"pp": 2}):
        plan = meshc.Plan(trace="non-strict", microbatches=2 if "pp" in sizes else 1)
        sim = simulate("gpt-tiny", sizes, plan=plan, hardware=base, layers=2)
        free, paid = (estimate_compiled(sim.rank_program, hw) for hw in (base, slow))
        extra[tuple(sizes)] = paid.time["optimizer"] - free.time["optimizer"]
    tensors = sum(1 for spec in sim.rank_program.program.params.values() if spec.requires_grad)  # the whole model
    assert extra[("dp",)] == pytest.approx(tensors * 1e-3)
    stages = sim.rank_program.pipeline.all_stages
    busiest = max(sum(1 for f in st.params if sim.rank_program.program.params[f].requires_grad) for st in stages)
    assert extra[("pp",)] == pytest.approx(busiest * 1e-3) and busiest < tensors


def test_calibration_times_a_step_by_its_slowest_rank():
    """meshc calibrate's measured steps (compute scale, step and action overheads) end when their last rank ends,
    as the planner's step time does (benchmarks/planner_suite.py's clock): a step in which rank 1 alone works
    50 ms lasts at least 50 ms on every rank, rank 0's own clock (a call of nothing) notwithstanding. Only lower bounds
    hold on a shared machine: how little a barrier and a gather add is printed by benchmarks/cost_speed.py."""
    from tests.harness import run_ranks

    pause = 0.05
    out = run_ranks(cost_runs.late_rank_steps, 2, 1, pause, timeout=120)
    assert out[1]["own"] >= pause, out  # rank 1's own clock sees its sleep; rank 0's step is a call of nothing
    for rank in out:  # sleep(0.05) lasts at least 50 ms, so a step that waits for it does too, on either rank
        assert rank["step"] >= pause, out


def test_compute_scale_is_the_median_of_its_timings(fake_mesh):
    """meshc calibrate times its compute-scale step at several points of the calibration (calibrate.ScaleProbe)
    and prices from their median: one timing taken while the shared machine was slow (10× here) moves nothing,
    where a scale from that timing alone would be several times larger."""
    from meshc import calibrate
    from meshc.compiler.cost.hardware import load

    hw = load("cpu-default")
    probe = calibrate.ScaleProbe(fake_mesh(dp=2), quick=True)

    def scale(times):
        probe.times = times
        return probe.scale(hw)
    typical = 0.05
    assert 0.5 < scale([typical]) < 4.0  # inside the clamp: the figures below are computed, not bounds
    assert scale([typical, 10 * typical, typical]) == scale([typical])
    assert scale([10 * typical]) > 3 * scale([typical])


def _step_copy_calls(mesh, plan) -> int:
    """The ATen calls a real ZeRO-1/2 optimizer step of the tiny GPT (2 layers) makes around its collectives on
    `mesh` (torch's fake process group: the collectives return garbage, the copies around them run as on gloo):
    every call inside the step's reduce-scatter and all-gather hooks (runtime/zero/param_store.py) but the
    collectives and their waits, seen by a dispatch mode."""
    from meshc.compiler.ir import torch_compat as compat

    class Calls(compat.dispatch_mode_base()):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Calls.n += func.namespace != "_c10d_functional"
            return func(*args, **(kwargs or {}))

    x = torch.zeros(2, 64, dtype=torch.long)
    job = meshc.compile(models.build("gpt-tiny", layers=2), mesh, example_inputs=(x,), plan=plan)
    opt = job.optimizer(torch.optim.AdamW, lr=1e-3)
    store = job._store
    for name in ("reduce_pending", "gather_updated"):  # the hooks call them through the store, looked up per call
        def counted(run=getattr(store, name)):
            with Calls():
                run()
        setattr(store, name, counted)
    job.step(x, x, models.lm_loss)
    opt.step()
    return Calls.n


def test_zero_bucket_copies_are_priced(fake_mesh):
    """The copies around ZeRO's collectives (runtime/ops/zero.py's pack and unpack; ZeRO-1/2's step copies the
    gathered slices into the compute copies too) cost ATen calls and bytes: measured on the planner suite's
    Mixtral at dp=2 (2 ranks, 2026-12-03), ZeRO-1's step spent 10 ms in them around 24 ms of collectives, which
    the model had left out. Each record of a ZeRO bucket carries its tensors; the estimate pays their calls at a
    third of op_overhead (a forward op with its backward's is about three calls): one more second per call
    moves the step by the calls the model counts for the step's records, and ZeRO-0 and ZeRO-3 (no step
    collective) not at all. Those calls are set against the ATen calls of a real step (_step_copy_calls)."""
    import dataclasses

    from meshc.compiler.cost.compiled import copy_time
    from meshc.compiler.report.explain import explain
    from meshc.compiler.ir.program import CommRecord
    from meshc.explain_cli import simulate

    base = hardware.load("cpu-default")
    slow = dataclasses.replace(base, op_overhead=base.op_overhead + 3.0)  # +1 s per call
    calls = {}
    for zero, dtype in ((0, None), (1, None), (2, None), (3, None), (1, torch.bfloat16)):
        plan = meshc.Plan(trace="non-strict", zero=zero, param_dtype=dtype)
        sim = simulate("gpt-tiny", {"dp": 2}, plan=plan, hardware=base, layers=2)
        program = sim.rank_program.program
        k = sum(1 for spec in program.params.values() if spec.requires_grad)
        assert [r.tensors for r in program.step_comms] == {0: [], 1: [k, k], 2: [k], 3: []}[zero]
        free, paid = (estimate_compiled(sim.rank_program, hw) for hw in (base, slow))
        calls[zero, dtype] = (paid.time["step"] - free.time["step"]) / base.compute_scale
        buckets = [r for n in program.gm.graph.nodes for r in n.meta.get("meshc.comm", ()) if r.tensors]
        assert sum(r.tensors for r in buckets if r.kind == "reduce_scatter") == (k if zero in (2, 3) else 0)
    assert calls[0, None] == calls[3, None] == 0
    # a real step's calls: ZeRO-1 reduce-scatters and gathers, ZeRO-2 only gathers (its reduce is in backward).
    # The model counts a cast per tensor each way, which bf16 compute copies make and fp32 ones skip (measured
    # 2026-12-04: the fp32 ZeRO-1 step makes 286 calls for the model's 367, 1.28x; bf16 342, 1.07x): the model
    # may count up to 35% more than a real step, and 5% fewer
    for zero, dtype in ((1, None), (2, None), (1, torch.bfloat16)):
        real = _step_copy_calls(fake_mesh(dp=2), meshc.Plan(trace="non-strict", zero=zero, param_dtype=dtype))
        assert 0.95 * real <= calls[zero, dtype] <= 1.35 * real, (zero, dtype, calls[zero, dtype], real)
    assert calls[2, None] < calls[1, None]  # no reduce-scatter at ZeRO-2's step
    # a pp rank's step reduces and gathers its own stages' parameters only (runtime/zero/param_store.py's keep)
    plan = meshc.Plan(trace="non-strict", zero=1, microbatches=2)
    sim = simulate("gpt-tiny", {"dp": 2, "pp": 2}, plan=plan, hardware=base, layers=2)
    program, stages = sim.rank_program.program, sim.rank_program.pipeline.all_stages
    held = [sum(1 for st in stages if st.index % 2 == r for f in st.params if program.params[f].requires_grad)
            for r in range(2)]
    mine = program.step_records(sim.rank_program.pipeline.params)
    assert max(held) < k and [r.tensors for r in mine] == [held[sim.rank_program.pipeline.coord]] * 2
    assert all(0 < r.bytes < w.bytes for r, w in zip(mine, program.step_comms))
    # and explain() lists the step's collectives with the bytes this rank sends, not the whole model's
    report = explain(program, pipeline=sim.rank_program.pipeline)
    listed = [c.bytes for c in report.collectives if c.phase == "step" and c.why.startswith("ZeRO")]
    assert listed == [r.bytes for r in mine]
    free, paid = (estimate_compiled(sim.rank_program, hw) for hw in (base, slow))
    # the busiest pp rank's records priced alone (copy_time) are what the step pays: not the whole model's
    sizes = program.mesh.sizes
    busiest = max((program.step_records(
        {f for st in stages if st.index % 2 == r for f in st.params}) for r in range(2)),
        key=lambda records: sum(rec.tensors for rec in records))
    own = sum(copy_time(r, sizes, slow) - copy_time(r, sizes, base) for r in busiest) / base.compute_scale
    assert (paid.time["step"] - free.time["step"]) / base.compute_scale == pytest.approx(own)
    assert own < calls[1, None]
    # bytes: each copy reads and writes; fused kernels (one per direction) make fewer calls than the unfused copies
    gather = CommRecord("all_gather", "dp", 2**20, "forward", "a bucket", tensors=10)
    cheap = dataclasses.replace(base, op_overhead=0.0)
    assert copy_time(gather, {"dp": 4}, cheap) == pytest.approx((2 + 16) * 2**20 / base.mem_bandwidth * base.compute_scale)
    assert copy_time(gather, {"dp": 4}, base, fused=True) < copy_time(gather, {"dp": 4}, base)
    assert copy_time(dataclasses.replace(gather, tensors=0), {"dp": 4}, base) == 0.0


def test_zbv_prices_its_v_placement():
    """ZBV at pp=2 (four stages of one block each, placed 0 1 | 1 0): pp rank 1 hands stage 1's output to stage 2
    on itself, so neither its activations nor their gradient are a message (priced or counted); pp rank 0 holds the
    embedding and the tied head both, so nothing is summed over pp; the formulas (w) put the head on rank 0 too."""
    from meshc.explain_cli import simulate

    plan = meshc.Plan(trace="non-strict", microbatches=4, schedule="zbv")
    assert plan.virtual == 2
    sims = [simulate("gpt-tiny", {"pp": 2}, rank=r, plan=plan, hardware="cpu-default", layers=4) for r in (0, 1)]
    pipes = [s.rank_program.pipeline for s in sims]
    assert [sorted(p.local) for p in pipes] == [[0, 3], [1, 2]] and not pipes[0].tied
    one, two = (pipes[1].all_stages[i] for i in (1, 2))
    assert one.sent_bytes > 0 and two.grad_bytes > 0  # the boundary is there, handed over on the rank
    assert pipes[1].messages(one) == (0, one.grad_bytes) and pipes[1].messages(two) == (two.sent_bytes, 0)
    for pipe in pipes:
        program = pipe.schedule.program(pipe.coord)
        sends = sum(1 for op in program if getattr(op, "op", None) == "send")
        assert sends == 2 * 4  # m activations down, m gradients back up, per rank
        assert comm_bytes(pipe.program, pipe)[("send", "pp")] == 4 * sum(sum(pipe.messages(s)) for s in pipe.local.values())
    assert "stage 2 (pp rank 1)" in str(sims[1].report) and "stage 3 (pp rank 0)" in str(sims[1].report)
    head = [fqn for fqn in pipes[0].params if not fqn.startswith("blocks.")]
    assert head and not [fqn for fqn in pipes[1].params if not fqn.startswith("blocks.")], head
    # formulas: the head's bytes move from the last pp rank to the first; the tied gradients' all-reduce goes
    shape = models.shape("gpt2-small")
    hw = hardware.load("cpu-default")
    h1, v = (formula_estimate(shape, {"pp": 2}, meshc.Plan(microbatches=4, schedule=s), 8, hw) for s in ("zb-h1", "zbv"))
    assert v.time["bubble"] < h1.time["bubble"]
    # the V sends twice the messages; GPT-2 ties its head, so the tied-gradient all-reduce over pp is gone
    summed = hw.intra.time("all_reduce", 2, shape.vocab * shape.hidden * 4)
    assert v.time["pp"] == pytest.approx(2 * (h1.time["pp"] - summed))
    h1_values = cost.formula_values(shape, (1, 1, 2, 1, 1), cost.plan_choice(meshc.Plan(microbatches=4,
                                                                                        schedule="zb-h1")), 8, hw, cost.FP32)
    v_values = cost.formula_values(shape, (1, 1, 2, 1, 1), cost.plan_choice(meshc.Plan(microbatches=4, schedule="zbv")),
                                   8, hw, cost.FP32)
    out = {key: (a, b) for key, a, b in zip(cost.OUT_KEYS, cost.compiled_formulas(hw, shape.flags())(*h1_values),
                                            cost.compiled_formulas(hw, shape.flags())(*v_values))}
    assert out["params_first"][1] > out["params_first"][0]  # the final norm joins rank 0
    assert out["params_last"][1] < out["params_last"][0]  # the last rank holds blocks only (no norm, no head copy)
    head = shape.vocab * shape.hidden * 4  # fp32 bytes of the tied head's copy on the last rank under ZB-H1
    assert out["params_last"][0] - out["params_last"][1] >= head
    logits = (out["activations_last"][0] - out["activations_first"][0]) / 2  # ZB-H1's last rank: I_l = 2 micro-batches'
    assert logits > 0 and out["activations_first"][1] - out["activations_last"][1] == pytest.approx(logits, rel=0.05)
