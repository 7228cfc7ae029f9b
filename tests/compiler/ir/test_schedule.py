"""Pipeline schedules as data: generators, the proof (coverage, order, matching, deadlock), the simulator's
bubble against the textbook formulas, in-flight memory, and the grid.

Cost settings (relative units): GPipe and 1F1B use F=1, B=2, giving bubble (p-1)/m; interleaved uses
F=1/v, B=2/v per virtual stage (a rank's work is unchanged), giving (p-1)/(v*m); ZB-H1 uses
F=I=W=1 against 1F1B with F=1, B=I+W=2, the setting of Qi et al. 2023 where ZB-H1's bubble is
(p-1)(F+I-W) against 1F1B's (p-1)(F+I+W): a third. ZBV uses F=I=W=1/2 per stage (two stages per rank,
a rank's work unchanged), where its bubble is half of ZB-H1's, (p-1)/(6m), once m >= 2p-1.
"""
from __future__ import annotations

import pytest

from meshc.compiler.ir.named_schedule import schedule
from meshc.compiler.ir.schedule import (
    P2P, Action, Schedule, ScheduleError, actions, dualpipev, gpipe, interleaved_1f1b, one_f_one_b, zb_h1, zbv,
)
from meshc.compiler.ir.schedule_sim import DEFAULT_COST, check, grid, simulate

PS = range(2, 9)
UNIFORM = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}


def scaled(v: int) -> dict[str, float]:
    return {k: c / v for k, c in UNIFORM.items()}


def close(got: float, want: float, rel: float = 0.02) -> bool:
    return abs(got - want) <= rel * want


# ------------------------------------------------------------------------------------ actions
def test_action_prints_and_parses():
    assert str(Action(2, "F", 0)) == "2F0"
    assert [str(a) for a in (Action(1, "B", 3), Action(0, "W", 2), Action(3, "I", 1))] == ["1B3", "0W2", "3I1"]
    assert Action.parse("12B3") == Action(12, "B", 3)
    assert str(P2P(op="send", kind="F", stage=0, microbatch=3, peer=1)) == "0SEND_F3"
    with pytest.raises(ValueError, match=r"Action.kind: expected one of F, B, I, W, got 'X'"):
        Action(0, "X", 0)
    with pytest.raises(ValueError, match=r"Action.stage: expected an int >= 0, got -1"):
        Action(-1, "F", 0)


def test_program_derives_messages():
    s = one_f_one_b(2, 2)
    assert [str(op) for op in s.program(0)] == ["0F0", "0SEND_F0", "0F1", "0SEND_F1",
                                                "0RECV_B0", "0B0", "0RECV_B1", "0B1"]
    assert [str(op) for op in s.program(1)] == ["1RECV_F0", "1F0", "1B0", "1SEND_B0",
                                                "1RECV_F1", "1F1", "1B1", "1SEND_B1"]
    assert all(op.peer == 0 for op in s.program(1) if isinstance(op, P2P))
    inter = interleaved_1f1b(2, 2, 2)
    assert inter.num_stages == 4 and inter.stage_to_rank == (0, 1, 0, 1) and inter.stages_of(1) == (1, 3)


# ----------------------------------------------------------------------------- bubble formulas
@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p", PS)
def test_gpipe_and_1f1b_bubble(name, p):
    for m in range(p, 4 * p + 1):
        result = simulate(schedule(name, p, m), UNIFORM)
        assert close(result.bubble, (p - 1) / m), (name, p, m, result.bubble)


@pytest.mark.parametrize("p", PS)
def test_interleaved_bubble(p, v=2):
    for m in range(p, 4 * p + 1):
        if m % p:
            with pytest.raises(ValueError, match=rf"multiple of pp: expected a multiple of {p}, got {m}"):
                schedule("interleaved", p, m, v)
            continue
        result = simulate(schedule("interleaved", p, m, v), scaled(v))
        assert close(result.bubble, (p - 1) / (v * m)), (p, m, result.bubble)


@pytest.mark.parametrize("p", PS)
def test_zb_h1_bubble_is_a_third_of_1f1b(p):
    for m in range(p, 4 * p + 1):
        zb = simulate(schedule("zb-h1", p, m), UNIFORM)
        base = simulate(schedule("1f1b", p, m), UNIFORM)
        assert zb.bubble <= base.bubble / 3 * 1.02, (p, m, zb.bubble, base.bubble)
        assert max(zb.peak_in_flight) <= max(base.peak_in_flight) == p  # 1F1B's peak memory


@pytest.mark.parametrize("p", PS)
def test_zbv_bubble_is_half_of_zb_h1(p):
    for m in range(1, 4 * p + 1):
        v = simulate(schedule("zbv", p, m), scaled(2))
        h1 = simulate(schedule("zb-h1", p, m), UNIFORM)
        assert v.bubble <= h1.bubble * 1.0001, (p, m, v.bubble, h1.bubble)  # never worse than ZB-H1
        if m >= 2 * p - 1:  # the V is full: the ramp at both ends is all that is left
            assert close(v.bubble, (p - 1) / (6 * m)), (p, m, v.bubble)
            # 2p stage-sets of half a rank's layers on every rank: 1F1B's peak of p whole micro-batches
            assert v.peak_in_flight == (2 * p,) * p


def test_zbv_places_stages_in_a_v_and_hands_over_locally_at_the_bottom():
    s = zbv(3, 5)
    assert s.placement == "v" and s.virtual == 2 and s.stage_to_rank == (0, 1, 2, 2, 1, 0)
    assert s.stages_of(0) == (0, 5) and s.stages_of(2) == (2, 3)
    bottom = [op for op in s.program(2) if isinstance(op, P2P) and {op.stage, op.peer_stage} == {2, 3}]
    assert bottom == []  # stage 2 -> 3 and its gradient back never leave rank 2
    sends = [op for op in s.program(0) if isinstance(op, P2P) and op.op == "send"]
    assert {(op.stage, op.kind, op.peer) for op in sends} == {(0, "F", 1), (5, "B", 1)}
    assert schedule("ZB-V", 3, 5) == s and str(s).startswith("zbv: pp=3 microbatches=5 virtual=2 placement=v")
    with pytest.raises(ValueError, match=r"zbv runs 2 stages per rank: expected virtual=2, got 3"):
        schedule("zbv", 3, 5, virtual=3)
    with pytest.raises(ValueError, match=r"placement: expected 0F0 on rank 0 \(stage 0 lives there\), got it on rank 1"):
        Schedule(name="bad", pp=2, microbatches=1, virtual=2, placement="v", actions=[[], [Action(0, "F", 0)]])
    with pytest.raises(ValueError, match=r"Schedule.placement: expected one of loop, v, got 'w'"):
        Schedule(name="bad", pp=1, microbatches=1, placement="w", actions=[[]])


@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_zbv_order_equals_torch_schedule_zbv(p):
    """The same compute order as torch.distributed.pipelining's ScheduleZBVZeroBubble (which pads rank r's order
    with r empty slots and blanks the actions of micro-batches it added to fill the V)."""
    from types import SimpleNamespace

    from torch.distributed.pipelining.schedules import ScheduleZBVZeroBubble

    for m in (1, p, 2 * p - 1, 2 * p + 3):
        state = SimpleNamespace(pp_group_size=p, _n_microbatches=m, num_stages=2 * p)
        for r in range(p):
            theirs = [str(a) for a in ScheduleZBVZeroBubble._calculate_single_rank_operations(state, r) if a]
            assert theirs == [str(a) for a in zbv(p, m).actions[r]], (p, m, r)


@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_dualpipev_order_equals_torch_schedule_dualpipev(p):
    """torch.distributed.pipelining's ScheduleDualPipeV, each overlapped forward+backward pair written as its
    forward and then its full backward: the same order, action by action."""
    from types import SimpleNamespace

    from torch.distributed.pipelining.schedules import ScheduleDualPipeV

    def flat(action) -> list[str]:
        pair = getattr(action, "sub_actions", None)
        return [x for a in pair for x in flat(a)] if pair else [str(action)]
    for m in (2 * p, 2 * p + 1, 3 * p + 2):
        state = SimpleNamespace(pp_group_size=p, _n_microbatches=m)
        for r in range(p):
            theirs = [x for a in ScheduleDualPipeV._calculate_single_rank_operations(state, r) if a for x in flat(a)]
            assert theirs == [str(a) for a in dualpipev(p, m).actions[r]], (p, m, r)


@pytest.mark.parametrize("p", PS)
def test_dualpipev_keeps_zbv_bubble_with_most_backwards_whole(p):
    """Its steady state runs full backwards (the F&B pairs), so only the ends split: zbv's bubble with F = B/2 =
    I = W, one stage-set more at its peak; fewer than 2p micro-batches are refused, naming the rule."""
    for m in range(2 * p, 4 * p + 1):
        s = schedule("dualpipev", p, m)
        assert s.placement == "v" and s.stage_to_rank == zbv(p, m).stage_to_rank
        assert close(simulate(s, scaled(2)).bubble, (p - 1) / (6 * m)), (p, m)
        assert simulate(s, scaled(2)).peak_in_flight == (2 * p + 1,) * p
        kinds = [a.kind for row in s.actions for a in row]
        assert kinds.count("B") > kinds.count("I") or p == 1
    with pytest.raises(ValueError, match=rf"dualpipev needs at least as many micro-batches as stages: expected "
                                         rf"microbatches >= {2 * p} \(2 x pp\), got {2 * p - 1}"):
        schedule("dualpipev", p, 2 * p - 1)


def test_sizes_an_algorithm_does_not_allow_raise():
    for name in ("gpipe", "1f1b", "zb-h1"):
        with pytest.raises(ValueError, match=rf"{name} runs one stage per rank: expected virtual=1, got 2"):
            schedule(name, 4, 8, virtual=2)
    with pytest.raises(ValueError, match=r"expected virtual >= 2, got 1"):
        schedule("interleaved", 4, 8)
    with pytest.raises(ValueError, match=r"unknown schedule: expected one of gpipe, 1f1b, interleaved, zb-h1, zbv, dualpipev"):
        schedule("pipedream", 4, 8)
    with pytest.raises(ValueError, match=r"microbatches: expected an int >= 1, got 0"):
        schedule("1f1b", 4, 0)
    assert schedule("interleaved_1f1b", 2, 4, 2).name == "interleaved"
    assert schedule("ZBH1", 2, 4).name == "zb-h1"


def test_one_rank_and_fewer_microbatches_than_ranks():
    for name in ("gpipe", "1f1b", "zb-h1", "zbv"):
        assert simulate(schedule(name, 1, 3), UNIFORM).bubble == 0.0
        check(schedule(name, 4, 2))
    one = schedule("interleaved", 1, 3, 2)  # both stages on rank 0: hand-overs are local, no messages
    assert one.programs() == one.actions and simulate(one, scaled(2)).bubble == 0.0


# ------------------------------------------------------------------------------ memory, comm
def test_peak_in_flight():
    for p in (2, 4, 8):
        for m in (p, 3 * p):
            assert simulate(gpipe(p, m)).peak_in_flight[0] == m
            peaks = simulate(one_f_one_b(p, m)).peak_in_flight
            assert peaks[0] <= p and peaks == tuple(p - r for r in range(p))


def test_comm_latency_lengthens_the_critical_path():
    p, m, c = 4, 8, 0.5
    result = simulate(gpipe(p, m), UNIFORM, comm=c)
    assert result.makespan == (m + p - 1) * 3 + 2 * (p - 1) * c  # each hop pays c, there and back
    assert simulate(zb_h1(p, m), UNIFORM, comm=c).makespan < simulate(one_f_one_b(p, m), UNIFORM, comm=c).makespan


def test_shared_processors_stretch_what_runs_together():
    """capacity: k ranks computing at once each run at min(1, capacity / k) of their speed. With a processor per
    rank (capacity >= p) nothing changes; with one for all, the step is the total work (nothing runs
    together faster than alone); in between, GPipe's p=2 m=1 (one stage at a time) loses nothing, and 1F1B at
    p=4 m=4 on 2 processors takes longer than on 4 but no less than its work over 2."""
    for sched in (gpipe(2, 1), one_f_one_b(4, 4), zb_h1(4, 4), one_f_one_b(2, 8)):
        alone = simulate(sched, UNIFORM)
        assert simulate(sched, UNIFORM, capacity=sched.pp).makespan == alone.makespan
        one = simulate(sched, UNIFORM, capacity=1)
        assert one.busy == alone.busy and one.makespan == pytest.approx(sum(alone.busy))
        assert simulate(sched, UNIFORM, capacity=0.5).makespan == pytest.approx(2 * sum(alone.busy))
    assert simulate(gpipe(2, 1), UNIFORM, capacity=1).makespan == 6.0
    two = simulate(one_f_one_b(4, 4), UNIFORM, capacity=2)
    assert 48 / 2 <= two.makespan and two.makespan > simulate(one_f_one_b(4, 4), UNIFORM).makespan == 21.0
    # spans are wall time: a span stretched by sharing is longer than its work
    assert max(s.end - s.start for row in two.timeline for s in row) > UNIFORM["B"]
    with pytest.raises(ValueError, match="capacity"):
        simulate(gpipe(2, 1), capacity=0)


# -------------------------------------------------------------------------------- the proof
def hand_made(*rows: str, pp: int = 2, m: int = 2) -> Schedule:
    return Schedule(name="hand", pp=pp, microbatches=m, actions=[actions(r) for r in rows])


def test_deadlock_names_the_stuck_ranks():
    # rank 0 waits for 1B0's gradient before sending 0F1; rank 1 waits for 0F1 before running 1B0
    bad = hand_made("0F0 0B0 0F1 0B1", "1F0 1F1 1B0 1B1")
    with pytest.raises(ScheduleError, match=r"deadlock: expected every rank to finish, got ranks \[0, 1\] stuck "
                                            r"\(rank 0 waits on 0RECV_B0 from rank 1, rank 1 waits on 1RECV_F1"):
        check(bad)


def test_messages_of_a_kind_are_awaited_in_the_order_they_are_sent():
    """NCCL pairs a rank pair's messages in order, whatever their tags: rank 1 awaiting micro-batch 1's activations
    before micro-batch 0's is refused (gloo would pair them by tag, a GPU run would swap them)."""
    with pytest.raises(ScheduleError, match=r"fifo: expected rank 1 to await F messages from rank 0 in the order they "
                                            r"are sent, got 0SEND_F0 sent when 1RECV_F1 is awaited"):
        check(hand_made("0F0 0B0 0F1 0B1", "1F1 1B1 1F0 1B0"))
    for name in ("zbv", "dualpipev"):  # activations and gradients interleave apart, each kind in order
        for p in range(2, 7):
            check(schedule(name, p, 2 * p + 3))


def test_unmatched_send_and_receive():
    s = one_f_one_b(2, 2)
    extra_send = P2P(op="send", kind="B", stage=1, microbatch=1, peer=0)
    with pytest.raises(ScheduleError, match=r"matching: expected one 1SEND_B1 on rank 1 and one 0RECV_B1 on rank 0, "
                                            r"got 2 and 1 \(unmatched send\)"):
        check(s, [s.program(0), s.program(1) + (extra_send,)])
    with pytest.raises(ScheduleError, match=r"expected one 1SEND_B1 on rank 1 and one 0RECV_B1 on rank 0, "
                                            r"got 1 and 0 \(unmatched send\)"):
        check(s, [[op for op in s.program(0) if str(op) != "0RECV_B1"], s.program(1)])
    with pytest.raises(ScheduleError, match=r"expected one 0SEND_F1 on rank 0 and one 1RECV_F1 on rank 1, "
                                            r"got 0 and 1 \(unmatched receive\)"):
        check(s, [[op for op in s.program(0) if str(op) != "0SEND_F1"], s.program(1)])
    wrong_peer = P2P(op="send", kind="F", stage=0, microbatch=0, peer=0)
    with pytest.raises(ScheduleError, match=r"placement: expected 0SEND_F0@0 to join stage 0"):
        check(s, [(wrong_peer,) + s.program(0), s.program(1)])
    # a receive placed after the action that needs it: the action would run on stale data
    late = [op for op in s.program(1) if str(op) != "1RECV_F1"]
    late.append(P2P(op="recv", kind="F", stage=1, microbatch=1, peer=0))
    with pytest.raises(ScheduleError, match=r"order: expected 1RECV_F1 \(the output of 0F1 on rank 0\) before 1F1"):
        check(s, [s.program(0), late])


def test_order_and_coverage_errors():
    with pytest.raises(ScheduleError, match=r"order: expected 0F1 before 0B1 on rank 0, got 0B1 first"):
        check(hand_made("0F0 0B1 0F1 0B0", "1F0 1F1 1B1 1B0"))
    with pytest.raises(ScheduleError, match=r"coverage: expected 1F1 once, got it twice"):
        check(hand_made("0F0 0F1 0B0 0B1", "1F0 1F1 1F1 1B0 1B1"))
    with pytest.raises(ScheduleError, match=r"coverage: expected one F for stage 1, micro-batch 1 \(1F1\), got none"):
        check(hand_made("0F0 0F1 0B0 0B1", "1F0 1B0"))
    with pytest.raises(ScheduleError, match=r"coverage: expected B or I\+W for stage 0, micro-batch 1, got I"):
        check(hand_made("0F0 0F1 0B0 0I1", "1F0 1F1 1B0 1B1"))
    with pytest.raises(ScheduleError, match=r"order: expected 0I0 before 0W0 on rank 0"):
        check(hand_made("0F0 0W0 0I0", "1F0 1B0", m=1))
    with pytest.raises(ScheduleError, match=r"placement: expected 1F0 on rank 1 .*, got it on rank 0"):
        hand_made("0F0 1F0", "")


# ------------------------------------------------------------------------------------- grid
def test_grid_1f1b_p2_m4():
    expected = '''\
step  rank 0  rank 1
   0  0F0     .
   1  0F1     1F0
   2  .       1B0
   3  .       "
   4  0B0     1F1
   5  "       1B1
   6  0F2     "
   7  0B1     1F2
   8  "       1B2
   9  0F3     "
  10  0B2     1F3
  11  "       1B3
  12  .       "
  13  0B3     .
  14  "       .'''
    assert grid(schedule("1f1b", 2, 4)) == expected
    assert DEFAULT_COST == UNIFORM


def test_grid_marks_fractional_steps():
    text = grid(simulate(interleaved_1f1b(2, 2, 2), scaled(2)))
    assert text.splitlines()[0].endswith("(1 step = 0.5)")
    assert text.splitlines()[1].split() == ["0", "0F0", "."]
