"""`job.report(path)` on a real 2-rank run (gloo, pp=2, 2 micro-batches): each rank writes its page after a
step, with the bytes it measured beside the prediction, and both pages open in headless Chromium with no
console error, every parameter, every collective of that rank's explain() and one bar per schedule action.
(~10 s: two processes, one compile and one step of the tiny GPT each.)
"""
from __future__ import annotations

import pytest
import torch

import meshc
from meshc import models
from tests import cdp
from tests.harness import run_ranks


def _report_rank(folder: str) -> dict:
    mesh = meshc.mesh(pp=2, timeout_s=60)
    torch.manual_seed(0)
    model = models.build("gpt-tiny")
    x = torch.randint(0, 128, (4, 64))
    job = meshc.compile(model, mesh, example_inputs=(x,), plan=meshc.Plan(microbatches=2))
    job.step(x, x, models.lm_loss)
    path = job.report(f"{folder}/rank{mesh.rank}.html")
    layout = job.compiled.pipeline
    out = {"path": path, "params": list(job.compiled.program.params), "collectives": len(job.explain().collectives),
           "actions": sum(len(row) for row in layout.simulated.timeline)}
    mesh.close()
    return out


@pytest.mark.skipif(cdp.chromium() is None, reason="Debian's chromium is not installed: `make browser` installs "
                    "it (apt-get install chromium), as `make test` does")
def test_job_report_two_ranks(tmp_path):
    results = run_ranks(_report_rank, 2, str(tmp_path), timeout=120)
    with cdp.Browser() as browser:
        for rank, r in enumerate(results):
            page = browser.open(f"file://{r['path']}")
            count = lambda sel: page.eval(f"document.querySelectorAll({sel!r}).length")
            assert page.eval("document.body.getAttribute('data-ready')") == "1"
            assert page.eval("[...document.querySelectorAll('tr.param')].map(r => r.dataset.fqn)") == r["params"]
            assert count("tr.collective") == r["collectives"] > 0
            assert count(".tl-bar") == r["actions"] == 8
            assert count(".bar-row.mem-measured") == 1  # what this rank held after its step
            assert page.eval("document.querySelector('.rank.me').dataset.rank") == str(rank)
            page.eval("1")
            assert page.errors == []
