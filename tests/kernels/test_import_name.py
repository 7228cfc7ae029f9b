"""The repository root's kernels/ folder is meshc.kernels; under its bare name (the root on sys.path, as in this
test run) it hands over to the `kernels` distribution that transformers imports (issue 44, item 5)."""
from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_bare_name_is_the_distribution_where_the_root_is_on_sys_path():
    assert any(os.path.abspath(p or os.curdir) == ROOT for p in sys.path)  # else this test proves nothing
    import kernels
    import transformers.integrations.hub_kernels  # noqa: F401  (transformers >= 5.25: `from kernels import ...`)

    import meshc.kernels

    assert os.path.dirname(os.path.abspath(kernels.__file__)) != os.path.join(ROOT, "kernels")
    assert meshc.kernels.__file__ == os.path.join(ROOT, "kernels", "__init__.py")
    assert hasattr(meshc.kernels, "bias_act") and not hasattr(kernels, "bias_act")


def test_without_the_distribution_the_bare_name_is_not_found():
    # -S: no site-packages, so no `kernels` distribution; the root first on sys.path, as `python` started there
    probe = ("import sys\ntry:\n    import kernels\nexcept ModuleNotFoundError as e:\n"
             "    print(e.name, 'kernels' in sys.modules, 'is meshc.kernels' in str(e))\n")
    proc = subprocess.run([sys.executable, "-S", "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.stdout.split() == ["kernels", "False", "True"], proc.stderr[-2000:]
