"""Programs cut into compiled regions around the ops no traced graph holds (runtime/regions.py), on one rank's
program in one process (fake process group). Training at parity: tests/models/test_inductor_parity.py."""
from __future__ import annotations

import operator

import meshc
from meshc.compiler.driver import run_passes
from meshc.compiler.trace.export import trace
from meshc.runtime import regions
from meshc.runtime.ops import collectives, experts
from meshc.runtime.ops.zero import zero_gather
from tests import zoo


def _program(mesh, model: str, **plan):
    traced, _ = trace(zoo.build(model), (zoo.batches(1, 4)[0][0],), mesh=mesh,
                      plan=meshc.Plan(trace="non-strict", **plan))
    return run_passes(traced).gm


def _leaving(gm, level, eager) -> list[str]:
    """grad_sync nodes some view of which leaves the compiled region computing it."""
    out = []
    for n in gm.graph.nodes:
        if n.target is collectives.grad_sync and n not in eager:
            chain = regions._views_of(n)
            if len({level[c] for c in chain} | {level.get(u, -1) for c in chain for u in c.users if u not in chain}) > 1:
                out.append(n.name)
    return out


def test_expert_routing_runs_between_compiled_regions(fake_mesh):
    gm = _program(fake_mesh(dp=2, ep=2), "mixtral")
    eager, level = regions.assign(gm)
    dispatches = [n for n in gm.graph.nodes if n.target is experts.dispatch]
    assert len(dispatches) == 2  # one expert layer per block
    for n in gm.graph.nodes:  # the expert matmuls, whose rows the routing sizes, run eagerly with it
        if n.op == "call_function" and "grouped_mm" in str(n.target):
            assert n in eager and level[n] % 2 == 1, n.format_node()
    assert all(level[n] % 2 == 0 for n in gm.graph.nodes if n.op == "call_function" and n not in eager)
    assert all(level[u] >= level[n] for n in level for u in n.users if u in level)  # regions run in order
    top = regions.cut(gm)
    assert top.eager == ["dispatch", "combine", "dispatch_1", "combine_1"] and len(top.regions) == 3
    # no expert weight's grad_sync view leaves a compiled region; the control, the levels before that rule, has
    # views leaving (the bug the rule fixed: their gradients skipped grad_sync's all-reduce)
    assert _leaving(gm, level, eager) == []
    plain = regions.eager_nodes(gm)
    assert _leaving(gm, regions.levels(gm, plain), plain)


def test_rings_are_cut_out_and_a_plain_program_is_not(fake_mesh):
    gm = _program(fake_mesh(tp=2), "llama", sequence_parallel=True, collective_matmul=True)
    top = regions.cut(gm)
    # four rings per block: the attention's and the MLP's gather-matmul and matmul-reduce-scatter
    assert [n for n in top.eager if "matmul" in n] == top.eager and len(top.eager) == 8
    ring = regions.cut(_program(fake_mesh(cp=2), "llama", cp_attention="ring"))
    assert len(ring.eager) == 2  # the ring attention of each block
    assert regions.cut(_program(fake_mesh(tp=2), "llama", sequence_parallel=True, collective_matmul=False)) is None
    assert regions.cut(_program(fake_mesh(dp=2), "llama")) is None


def test_a_piece_of_a_tuple_stays_in_the_region_of_the_tuple(fake_mesh):
    gm = _program(fake_mesh(dp=2, ep=2), "mixtral")
    eager, level = regions.assign(gm)
    for n in gm.graph.nodes:
        if n.target is operator.getitem:
            assert level[n] == level[n.args[0]], n.format_node()


def test_zero3_gathers_sit_in_the_region_that_reads_them(fake_mesh):
    """Mixtral at dp=4 x ep=2 under ZeRO-3 (experts sharded over edp): each bucket's gather, its start and the
    pieces of its tuple sit in the region of the bucket's first reader, not all in the first region (where every
    bucket would be gathered before any block computes, each held to its last reader: the levels before tuples
    were followed, measured 2026-12-06: all seven gathers at level 0). The experts' buckets, which only the routed
    matmuls read, run as FX code in that eager stretch with the transposes taken of them (so the step's ZeRO
    context swaps them for handles in the saved tensors)."""
    gm = _program(fake_mesh(dp=4, ep=2), "mixtral", zero=3)
    eager, level = regions.assign(gm)
    gathers = [n for n in gm.graph.nodes if n.target is zero_gather]
    assert len(gathers) == 7  # embedding, 2 x (attention, experts), norm, head
    for g in gathers:
        pieces = list(g.users)
        readers = [r for p in pieces for r in p.users]
        start = g.args[0]
        assert level[start] == level[g] == min(level[r] - (level[r] - level[g]) % 2 for r in readers), g.name
        assert all(level[p] == level[g] for p in pieces), g.name
        is_expert = any("experts" in a.name for a in g.args[1:])
        assert (g in eager) == is_expert and (start in eager) == is_expert, g.name
    assert len({level[g] for g in gathers}) == 5  # regions 0, 2 and 4 and the two eager stretches
    assert regions.eager_gathers(gm, eager) >= {g for g in gathers if g in eager}
    assert regions.gathers_run_eagerly(gm)  # the job and the door open the step's ZeRO context for it
    assert not regions.gathers_run_eagerly(_program(fake_mesh(dp=2), "llama", zero=3))  # no region at all
