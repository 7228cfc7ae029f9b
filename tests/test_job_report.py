"""`job.report(path)` on a real 2-rank run (gloo, pp=2, 2 micro-batches): each rank writes its page after a
step, with the bytes it measured beside the prediction. Both pages are checked twice from the one run: parsed
as HTML here (its sections in order, every parameter, every collective of that rank's explain(), one bar per
schedule action, this rank outlined, and the measured row carrying the bytes the rank measured), then opened
in headless Chromium with no console error and the same counts in the live DOM (skipped without Chromium,
except under CI: tests/cdp.py). (~10 s: two processes, one compile and one step of the tiny GPT each.)
"""
from __future__ import annotations

from html.parser import HTMLParser

import pytest
import torch

import meshc
from meshc import models
from meshc.compiler.report.html import MEMORY_PARTS
from meshc.compiler.ir.show import human_bytes
from tests import cdp
from tests.harness import run_ranks

SECTIONS = ["mesh", "params", "graph", "collectives", "memory", "schedule"]


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
           "actions": sum(len(row) for row in layout.simulated.timeline), "measured": job.held_bytes(),
           "local_bytes": sum(p.numel() * p.element_size() for _, p in job.named_parameters())}
    mesh.close()
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_ranks(_report_rank, 2, str(tmp_path_factory.mktemp("job_report")), timeout=120)


class _Page(HTMLParser):
    """The start tags in order (tag, attributes); for each element, its text and where its descendants end."""

    def __init__(self):
        super().__init__()
        self.tags: list[tuple[str, dict]] = []
        self.open: list[int] = []  # indices of the open elements
        self.inner: dict[int, str] = {}  # element index -> all text inside it
        self.end: dict[int, int] = {}  # element index -> index past its last descendant

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))
        if tag not in ("meta", "br", "input", "link", "img"):
            self.open.append(len(self.tags) - 1)

    def handle_endtag(self, tag):
        while self.open:
            i = self.open.pop()
            self.end[i] = len(self.tags)
            if self.tags[i][0] == tag:
                break

    def handle_data(self, data):
        for i in self.open:
            self.inner[i] = self.inner.get(i, "") + data


def _classed(page: _Page, cls: str, tag: str | None = None) -> list[int]:
    return [i for i, (t, a) in enumerate(page.tags)
            if (tag is None or t == tag) and cls in (a.get("class") or "").split()]


def test_job_report_html_carries_what_the_rank_measured(ranks):
    """Without a browser: the page's markup, checked against what each rank computed and measured."""
    for rank, r in enumerate(ranks):
        page = _Page()
        with open(r["path"]) as f:
            page.feed(f.read())
        assert [a["id"] for t, a in page.tags if t == "section"] == SECTIONS
        assert [page.tags[i][1]["data-fqn"] for i in _classed(page, "param", "tr")] == r["params"]
        assert len(_classed(page, "collective", "tr")) == r["collectives"] > 0
        assert len(_classed(page, "tl-bar")) == r["actions"] == 8
        me = _classed(page, "me")
        assert [page.tags[i][1]["data-rank"] for i in me] == [str(rank)]
        # the measured row: its label, each part's bytes as the rank measured them, and their sum
        measured = r["measured"]
        assert measured["params"] == r["local_bytes"] > 0  # the weights this pp rank's stages hold
        assert measured["grads"] == measured["params"]  # held after the step, until zero_grad
        rows = _classed(page, "mem-measured")
        assert len(rows) == 1, "no measured memory row (job.report after a step draws one)"
        row = rows[0]
        assert f"rank {rank} measured" in page.inner[row], page.inner[row]
        titles = [page.tags[i][1]["title"] for i in range(row + 1, page.end[row])
                  if "seg" in page.tags[i][1].get("class", "").split()]
        assert titles == [f"{k}: {human_bytes(measured.get(k, 0))}" for k in MEMORY_PARTS], titles
        assert page.inner[row].strip().endswith(human_bytes(sum(measured.get(k, 0) for k in MEMORY_PARTS)))


def test_job_report_in_chromium(ranks):
    cdp.require_chromium()
    with cdp.Browser() as browser:
        for rank, r in enumerate(ranks):
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
