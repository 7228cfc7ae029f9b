"""Schedules by name, each proven valid and deadlock-free by the simulator before it is returned.

    schedule("1f1b", pp=2, microbatches=8) -> Schedule
"""
from __future__ import annotations

from .errors import MeshcValueError
from .schedule import NAMES, ALIASES, Schedule, check_sizes, gpipe, interleaved_1f1b, one_f_one_b, zb_h1
from .schedule_sim import check


def schedule(name: str, pp: int, microbatches: int, virtual: int = 1) -> Schedule:
    """The named schedule, proven valid and deadlock-free by `schedule_sim.check` before it is returned.

    name: "gpipe", "1f1b", "interleaved" (alias "interleaved_1f1b"; needs virtual >= 2 and microbatches
    a multiple of pp) or "zb-h1" (alias "zbh1"). Other sizes raise ValueError naming the rule.
    """
    out = unchecked(name, pp, microbatches, virtual)
    check(out)
    return out


def unchecked(name: str, pp: int, microbatches: int, virtual: int = 1) -> Schedule:
    """`schedule` without the proof, for a caller that runs `schedule_sim.simulate` on it next (which proves
    it on the way, raising as `check` does): the cost model's schedule terms, proved and timed in one run."""
    canonical = ALIASES.get(str(name).lower())
    if canonical is None:
        raise MeshcValueError(f"unknown schedule: expected one of {', '.join(NAMES)}, got {name!r}")
    if canonical == "interleaved":
        return interleaved_1f1b(pp, microbatches, virtual)
    check_sizes(canonical, pp, microbatches, virtual)
    return {"gpipe": gpipe, "1f1b": one_f_one_b, "zb-h1": zb_h1}[canonical](pp, microbatches)
