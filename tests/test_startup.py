"""What `import meshc` and `meshc plan` load: the facade's names on first use only, and `meshc plan` none of the
runtime, Dynamo, torch.distributed.pipelining or transformers (issue 20: plan 405B on 16384 GPUs in < 5 s)."""
from __future__ import annotations

import subprocess
import sys

import pytest

HEAVY = ("meshc.job", "meshc.api", "meshc.dynamo_backend", "meshc.runtime", "torch.distributed.pipelining", "torch._dynamo",
         "transformers")


def _loaded(code: str) -> list[str]:
    """The HEAVY modules in sys.modules after running `code` in a fresh interpreter."""
    probe = f"{code}\nimport sys\nprint(' '.join(m for m in {HEAVY!r} if m in sys.modules))"
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip().splitlines()[-1].split() if proc.stdout.strip() else []


def test_import_meshc_loads_the_facade_lazily():
    assert _loaded("import meshc") == []
    assert set(_loaded("import meshc\nmeshc.Job")) >= {"meshc.job"}
    assert "torch.distributed.pipelining" in _loaded("import meshc\nmeshc.pipe_split")


def test_meshc_plan_loads_only_the_planner():
    code = ("import contextlib, io\nimport meshc.__main__ as cli\nwith contextlib.redirect_stdout(io.StringIO()):\n"
            "    assert cli.main(['plan', '--model', 'llama-8b', '--gpus', '64', '--memory', '80GB']) == 0")
    assert _loaded(code) == []


def test_the_facade_names_resolve():
    import meshc
    import meshc.dynamo_backend  # what the torch.compile entry point meshc.dynamo_backend:default_backend imports

    # the submodule has its own name, so importing it leaves meshc.backend the function
    assert callable(meshc.backend) and meshc.backend is meshc.dynamo_backend.backend
    for name in meshc.__all__:
        assert getattr(meshc, name) is not None
    from meshc import Job, compile, pipe_split  # noqa: F401

    assert set(meshc.__all__) <= set(dir(meshc))
    with pytest.raises(AttributeError):
        meshc.no_such_name  # noqa: B018


def test_builtin_shapes_match_their_transformers_configs():
    """models.shape reads a built-in config's fields without transformers: the same shape as through it."""
    pytest.importorskip("transformers")
    from meshc import models
    from meshc.compiler.cost.formulas import ModelShape

    for name in models.HF_CONFIGS:
        assert models.shape(name) == ModelShape.from_hf_config(models.hf_config(name), seq=models.seq_len(name),
                                                               name=name)
        assert models.shape(name, seq=1024) == ModelShape.from_hf_config(models.hf_config(name), seq=1024, name=name)
