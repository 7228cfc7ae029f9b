"""meshc.passes: one compiler pass per file, each a pure `<name>_pass(program) -> program`."""
