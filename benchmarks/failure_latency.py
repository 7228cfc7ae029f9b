"""How soon a surviving rank raises after its peer dies or stalls, on 2 CPU ranks over gloo.

    python benchmarks/failure_latency.py [--timeout 4] [--phases forward,stall]

Moved here from tests/runtime/test_failures.py (DESIGN.md §6: speed targets live in benchmarks/, never in
timed tests; the tests keep that a failure is named, that a death ends the wait before the timeout, and
that a stall is not given up on before it). The same runs as the tests' (their _victim_rank): rank 1 kills
itself (`kill -9`) at the first collective of a phase of step 2, or stalls there (alive, never joining,
until the survivor has given up); rank 0 records when it raised.

The targets: after a kill -9, the survivor raises within 2.5 s (the peer's death is seen in ~0.05 s, then
the heartbeats are watched for 1 s), far below the mesh timeout; after a stall, at the timeout and within
timeout + 2.5 s (gloo raises at the timeout, then 1 s of heartbeats). On a machine whose cores other jobs
share, both come later. Prints one row per phase and the verdict.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import table  # noqa: E402

SLACK = 2.5  # seconds after the death (kill -9) or after the timeout (stall)


def _seconds(phase: str, timeout_s: float) -> float:
    """Seconds from rank 1's death or stall to rank 0's failure."""
    from tests.harness import RankFailure, run_ranks
    from tests.runtime.test_failures import _victim_rank

    with tempfile.TemporaryDirectory() as marks:
        try:
            run_ranks(_victim_rank, 2, phase, marks, os.path.join(marks, "ckpt"), timeout_s, timeout=120, grace=20.0)
        except RankFailure:
            pass
        else:
            raise SystemExit(f"{phase}: expected the survivor to fail, every rank finished")
        killed = float(open(os.path.join(marks, "victim")).read())
        failed = float(open(os.path.join(marks, "failed0")).read())
    return failed - killed


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--timeout", type=float, default=4.0, help="the mesh timeout (seconds)")
    p.add_argument("--phases", default="forward,backward,optimizer,save,stall")
    args = p.parse_args()
    rows = []
    for phase in args.phases.split(","):
        seconds = _seconds(phase, args.timeout)
        target = args.timeout + SLACK if phase == "stall" else SLACK
        low = args.timeout if phase == "stall" else 0.0
        rows.append({"phase": phase, "seconds to raise": seconds, "target (s)": f"{low:g} - {target:g}",
                     "within": "yes" if low <= seconds < target else "NO"})
    print(table(rows, ["phase", "seconds to raise", "target (s)", "within"]))
    print(f"\nmesh timeout {args.timeout:g} s, load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")


if __name__ == "__main__":
    main()
