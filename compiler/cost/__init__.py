"""The cost model (closed-form formulas and the compiled graphs' estimate), hardware profiles, the planner."""
