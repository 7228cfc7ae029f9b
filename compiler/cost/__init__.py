"""The cost model (closed-form formulas and the compiled graphs' estimate) and hardware profiles."""
