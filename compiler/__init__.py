"""meshc.compiler: tracing, the Program, the pass driver, verify, explain and show."""
