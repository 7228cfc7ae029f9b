"""The automatic planner: plans enumerated, kept if they fit, ranked by the cost model's step time (search.py on the formulas, compiled.py on a simulated rank's graphs)."""
