"""Schedules by name, each proven valid and deadlock-free by the simulator before it is returned.

    schedule("1f1b", pp=2, microbatches=8) -> Schedule
"""
from __future__ import annotations

from meshc.compiler.ir.errors import MeshcValueError
from meshc.compiler.ir.schedule import (NAMES, ALIASES, VIRTUAL, Schedule, check_sizes, dualpipev, gpipe, interleaved_1f1b,
                       one_f_one_b, zb_h1, zbv)
from meshc.compiler.ir.schedule_sim import check


def schedule(name: str, pp: int, microbatches: int, virtual: int | None = None) -> Schedule:
    """The named schedule, proven valid and deadlock-free by `schedule_sim.check` before it is returned.

    name: "gpipe", "1f1b", "interleaved" (alias "interleaved_1f1b"; needs virtual >= 2 and microbatches
    a multiple of pp), "zb-h1" (alias "zbh1"), "zbv" (alias "zb-v"; virtual=2, placed in a V) or "dualpipev" (the
    same V; microbatches >= 2 pp). Other sizes raise ValueError naming the rule. virtual None: the schedule's
    own (2 for zbv and dualpipev, else 1).
    """
    out = unchecked(name, pp, microbatches, virtual)
    check(out)
    return out


def unchecked(name: str, pp: int, microbatches: int, virtual: int | None = None) -> Schedule:
    """`schedule` without the proof, for a caller that runs `schedule_sim.simulate` on it next (which proves
    it on the way, raising as `check` does): the cost model's schedule terms, proved and timed in one run."""
    canonical = ALIASES.get(str(name).lower())
    if canonical is None:
        raise MeshcValueError(f"unknown schedule: expected one of {', '.join(NAMES)}, got {name!r}")
    if virtual is None:  # the schedule's own: interleaved has no default
        virtual = VIRTUAL.get(canonical, 1)
    if canonical == "interleaved":
        return interleaved_1f1b(pp, microbatches, virtual)
    check_sizes(canonical, pp, microbatches, virtual, allowed_virtual=VIRTUAL.get(canonical, 1))
    return {"gpipe": gpipe, "1f1b": one_f_one_b, "zb-h1": zb_h1, "zbv": zbv,
            "dualpipev": dualpipev}[canonical](pp, microbatches)
