"""`meshc plan --html` (compiler/report/plans.py): one row per plan the planner scored, the chosen one marked,
each rejected plan with why; the meshes the model refuses listed with theirs. Formula path only (~0.2 s)."""
from __future__ import annotations

import argparse
from html.parser import HTMLParser

import pytest
import torch

import meshc
from meshc import models, plan_cli
from meshc.compiler.cost.hardware import load
from meshc.compiler.ir.errors import MeshcValueError
from meshc.compiler.planner.search import Search, plan_model
from meshc.compiler.planner.compiled import _score_pruned
from meshc.compiler.report.plans import plans_html, write_plans


class _Rows(HTMLParser):
    """The cells' text of every <tr> with its attributes."""

    def __init__(self):
        super().__init__()
        self.rows: list[tuple[dict, list[str]]] = []
        self.in_cell = False

    def handle_starttag(self, tag, attrs):
        if tag == "tr":
            self.rows.append((dict(attrs), []))
        elif tag == "td":
            self.rows[-1][1].append("")
            self.in_cell = True

    def handle_endtag(self, tag):
        self.in_cell = self.in_cell and tag != "td"

    def handle_data(self, data):
        if self.in_cell:
            self.rows[-1][1][-1] += data


def _rows(text: str, cls: str) -> list[tuple[dict, list[str]]]:
    parser = _Rows()
    parser.feed(text)
    return [(a, cells) for a, cells in parser.rows if cls in (a.get("class") or "").split()]


def test_plan_cli_html(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    plan_cli.add_plan_arguments(parser)
    path = tmp_path / "plans.html"
    args = parser.parse_args(["--model", "gpt-tiny", "--gpus", "8", "--memory", "2MB", "--html", str(path)])
    assert plan_cli.run_plan(args) == 0
    assert f"plans: {path}" in capsys.readouterr().out
    # the same search as the command's (bf16 with fp32 masters on an h100 profile)
    result = plan_model(models.shape("gpt-tiny"), 8, 8, load("h100"), 2e6, Search(param_dtype=torch.bfloat16))
    text = path.read_text()
    rows = _rows(text, "plan")
    assert len(rows) == len(result.ranked) + len(result.rejected_plans) + len(result.failed)
    assert len(result.ranked) > 100 and result.rejected_plans  # both kinds are in the table
    chosen = [cells for a, cells in rows if "chosen" in a["class"].split()]
    best = result.best.candidate
    options = best.describe()[len(best.describe_mesh()) + 1:]
    assert chosen == [rows[0][1]] and chosen[0][:2] == [best.describe_mesh(), options]
    assert chosen[0][4] == "rank 1" and chosen[0][5].startswith("fastest of")
    assert [cells[4] for a, cells in rows if a["data-kind"] == "fits"] == [f"rank {r}" for r in
                                                                         range(2, len(result.ranked) + 1)]
    rejected = [cells for a, cells in rows if a["data-kind"] == "rejected"]
    assert len(rejected) == len(result.rejected_plans) and all(c[4] == "does not fit" and "more than 1.9 MiB" in c[5]
                                                               for c in rejected)
    refused = _rows(text, "excluded")
    assert [c for _, c in refused if c[0] == "dp=1 tp=8 pp=1"] == [["dp=1 tp=8 pp=1", "tp=8 does not divide the 4 heads"]]
    assert len(refused) == len(result.excluded) == 4 and "http" not in text


def test_plans_page_bounds_and_failures(tmp_path):
    """Rows past max_rows are counted, not listed; a plan that does not compile is a row with its error."""
    result = plan_model(models.shape("gpt-tiny"), 4, 4, load("h100"), 3e6, Search())
    text = plans_html(result, title="t", max_rows=10)
    assert len(_rows(text, "plan")) == 10 and f"{len(result.ranked) + len(result.rejected_plans) - 10} more rows" in text
    failed: list = []

    def score(plan):
        raise MeshcValueError("tp: expected 4 heads divisible by 3, got 4")
    assert _score_pruned([meshc.Plan(trace="non-strict")], score, 1e9, 1, failed) == []
    assert failed and failed[0][1].startswith("MeshcValueError: tp: expected")
    with pytest.raises(MeshcValueError, match="plan --html: expected a path ending in .html"):
        write_plans(tmp_path / "plans.txt", result, title="t")
