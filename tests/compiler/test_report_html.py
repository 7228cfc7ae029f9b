"""The HTML plan report (compiler/report/html.py): its content, and the page in a real headless Chromium.

The page is checked twice: parsed as HTML here (every parameter row, every collective of explain()'s census,
one timeline bar per schedule action, nothing fetched from the network), then opened in Debian's Chromium
through the DevTools protocol (tests/cdp.py): no console errors, the same counts in the live DOM, a click on a
module expands it, the filter hides rows, a collective's link opens its node, and a screenshot is written
(MESHC_REPORT_PNG=docs/report.png refreshes the README's). The demo GPT (2 layers) under dp=2 × tp=2 × pp=2,
compiled for rank 0 on a MeshSpec as `meshc explain` does: no process group, fake tensors (~4 s). The graph
section's groups (compiler/report/groups.py) are parsed from its markup on a 4-layer GPT-2 on one stage: identical
blocks folded into "blocks.0–3, 4 identical", a block that differs apart, collectives under their module, the
step's nodes in one group.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shutil
from html.parser import HTMLParser

import pytest

import meshc
from meshc.compiler.report.explain import explain
from meshc.compiler.ir.errors import MeshcValueError
from meshc.compiler.ir.program import BUCKET, COMM
from meshc.compiler.ir.schedule import Action
from meshc.compiler.report import graph as report_graph
from meshc.compiler.report import groups as report_groups
from meshc.compiler.compile import passes_for_rank
from meshc.compiler.pipeline.rank_plan import PipelinePlan
from meshc.compiler.report.html import html_report, source_line, write_report
from meshc import explain_cli
from meshc.explain_cli import simulate
from tests import cdp


@pytest.fixture(scope="module")
def sim():
    # the cut pinned before the final norm: stage 0 holds both blocks (folded in the graph section), stage 1 the
    # head, whatever the automatic split's balance (by time, it puts one block on each stage of this 2-layer model)
    plan = meshc.Plan(trace="non-strict", microbatches=2, split_points=["ln_f"])
    return simulate("gpt2-small", {"dp": 2, "tp": 2, "pp": 2}, plan=plan, layers=2, seq=64)


@pytest.fixture(scope="module")
def page_file(sim, tmp_path_factory):
    return write_report(tmp_path_factory.mktemp("report") / "plan.html", sim.rank_program, sim.report)


class _Tags(HTMLParser):
    def __init__(self):
        super().__init__()
        self.tags: list[tuple[str, dict]] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))


def _tags(text: str) -> list[tuple[str, dict]]:
    parser = _Tags()
    parser.feed(text)
    return parser.tags


def _classed(tags, tag: str, cls: str) -> list[dict]:
    return [a for t, a in tags if t == tag and cls in (a.get("class") or "").split()]


def _actions(schedule) -> int:
    return sum(isinstance(op, Action) for prog in schedule.programs() for op in prog)


def test_report_content(sim, page_file):
    text = page_file.read_text()
    tags = _tags(text)
    program, pipeline = sim.rank_program.program, sim.rank_program.pipeline
    census = explain(program, (), pipeline).collectives
    rows = _classed(tags, "tr", "param")
    assert [r["data-fqn"] for r in rows] == list(program.params)
    assert len(_classed(tags, "tr", "collective")) == len(census) == len(sim.report.collectives) > 0
    bars = _classed(tags, "div", "tl-bar")
    assert len(bars) == _actions(pipeline.schedule) == 8  # 2 stages × 2 micro-batches × (F, B)
    assert sorted(b["data-action"] for b in bars) == sorted(str(s.action) for row in pipeline.simulated.timeline
                                                            for s in row)
    cells = _classed(tags, "div", "rank")
    assert len(cells) == 8 and [c["data-rank"] for c in cells if "me" in c["class"].split()] == ["0"]
    # self-contained: no element loads anything, no URL outside the page
    assert not [a for t, a in tags if a.get("src") or (t == "link")]
    assert not re.search(r"https?://", text)
    # every graph collective names the model line that made it necessary
    graph_comms = [a for a in _classed(tags, "div", "comm") if a["id"].startswith("n-s0-r0-")]
    assert len(graph_comms) == sum(1 for s in pipeline.local.values() for n in s.gm.graph.nodes
                                   if n.meta.get("meshc.comm"))
    for stage in pipeline.local.values():
        for node in stage.gm.graph.nodes:
            if node.meta.get("meshc.comm"):
                assert re.match(r"models\.py:\d+ in \w+: ", source_line(node, stage.gm)), node.format_node()


def test_report_rank_picker(sim, page_file):
    """One graph section per distinct (stage, graph): tp and dp peers share theirs, every rank is in one."""
    tags = _tags(page_file.read_text())
    options = [a["value"] for t, a in tags if t == "option" and a.get("value", "").startswith("s")]
    sections = _classed(tags, "details", "graph")
    assert options == [s["data-stage"] for s in sections] == ["s0-r0", "s1-r4"]
    assert [s["data-ranks"] for s in sections] == ["0,1,2,3", "4,5,6,7"]
    assert ["hidden" in s["class"].split() for s in sections] == [False, True]  # this rank's stage shown first
    # the dp peer the page does not compile runs the same graph up to group names
    names = report_graph._group_names(sim.rank_program.program.mesh)
    peer = passes_for_rank(sim.rank_program.traced, 2)
    own = report_graph._normalized(sim.rank_program.pipeline.local[0].gm, names)
    assert report_graph._normalized(PipelinePlan(peer, sim.rank_program.pipeline.plan).local[0].gm, names) == own
    # limit=1: this rank's stage alone, and the page says how many ranks it leaves out
    one = report_graph.graphs(sim.rank_program, limit=1)
    assert one.count('<option value=') == 1 and "6 ranks are not drawn" in one


def test_explain_cli_html(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    explain_cli.add_arguments(parser)
    path = tmp_path / "out" / "plan.html"
    args = parser.parse_args(["--model", "gpt-tiny", "--mesh", "tp=2,pp=2", "--microbatches", "2", "--html", str(path)])
    assert explain_cli.run(args) == 0
    assert f"report: {path}" in capsys.readouterr().out
    assert len(_classed(_tags(path.read_text()), "div", "tl-bar")) == 8


def test_report_without_pipeline_and_bad_path(tmp_path):
    sim = simulate("gpt-tiny", {"dp": 2, "tp": 2}, plan=meshc.Plan(trace="non-strict"))
    text = html_report(sim.rank_program, sim.report)
    assert "No pipeline" in text and 'class="tl-bar' not in text
    assert len(_classed(_tags(text), "tr", "collective")) == len(sim.report.collectives)
    with pytest.raises(MeshcValueError, match="report: expected a path ending in .html"):
        write_report(tmp_path / "plan.txt", sim.rank_program, sim.report)


# ------------------------------------------------------------------------------------------ graph groups
@pytest.fixture(scope="module")
def one_stage():
    """gpt2-small with 4 layers on dp=2 × tp=2: one stage holds every block (~0.3 s)."""
    return simulate("gpt2-small", {"dp": 2, "tp": 2}, plan=meshc.Plan(trace="non-strict"), layers=4, seq=64)


class _Dom(HTMLParser):
    """The markup as a tree of {tag, attrs, children, text, parent}."""

    def __init__(self, text: str):
        super().__init__()
        self.root = self.at = {"tag": "", "attrs": {}, "children": [], "text": "", "parent": None}
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        el = {"tag": tag, "attrs": dict(attrs), "children": [], "text": "", "parent": self.at}
        self.at["children"].append(el)
        if tag not in ("br", "input", "meta"):
            self.at = el

    def handle_endtag(self, tag):
        if tag not in ("br", "input", "meta"):
            self.at = self.at["parent"]

    def handle_data(self, data):
        self.at["text"] += data


def _all(el):
    for child in el["children"]:
        yield child
        yield from _all(child)


def _has(el, tag: str, cls: str) -> bool:
    return el["tag"] == tag and cls in el["attrs"].get("class", "").split()


def _graph_sections(text: str) -> dict:
    return {el["attrs"]["data-stage"]: el for el in _all(_Dom(text).root) if _has(el, "details", "graph")}


def _rows(section) -> list:
    """The top-level rows of a graph section: its groups and loose nodes."""
    return next(c for c in section["children"] if _has(c, "div", "tree-root"))["children"]


def _label(el) -> str:
    """A group's summary (its name, without the node count) or a node's name."""
    if el["tag"] == "div":
        return el["attrs"]["data-node"]
    return next(c for c in el["children"] if c["tag"] == "summary")["text"]


def _module_of(el) -> str | None:
    """The module group a node sits in: its nearest enclosing group (None: at the top level)."""
    p = el["parent"]
    while p is not None and not _has(p, "details", "tree"):
        p = p["parent"]
    return None if p is None or _has(p, "details", "graph") else p["attrs"]["data-module"]


def test_graph_groups_fold_identical_blocks(one_stage):
    """Four identical blocks fold into one top-level entry holding each of them; every node sits once under its
    own module path; collectives under the module that needs them; the step's nodes in one group, last."""
    gm = one_stage.rank_program.program.gm
    (section,) = _graph_sections(report_graph.graphs(one_stage.rank_program)).values()
    rows = _rows(section)
    assert [_label(r) for r in rows] == ["(inputs)", "tok", "arange", "pos", "add", "blocks.0–3, 4 identical",
                                         "ln_f", "head", "(step)"]
    fold = rows[5]
    assert _has(fold, "details", "fold") and fold["attrs"]["data-count"] == "4"
    members = [c for c in fold["children"] if c["tag"] == "details"]
    assert [m["attrs"]["data-module"] for m in members] == [f"blocks.{i}" for i in range(4)]
    assert ["open" in m["attrs"] for m in members] == [True, False, False, False]
    modules = [el["attrs"]["data-module"] for el in _all(section) if _has(el, "details", "tree")]
    assert {"blocks.0.attn.qkv", "blocks.2.attn", "blocks.3.mlp.up"} <= set(modules)
    assert len(modules) == len(set(modules))  # one group per module path
    nodes = {el["attrs"]["data-node"]: el for el in _all(section) if _has(el, "div", "node")}
    assert len(nodes) == len(gm.graph.nodes) and set(nodes) == {n.name for n in gm.graph.nodes}
    comms = 0
    for n in gm.graph.nodes:
        where, own = _module_of(nodes[n.name]), report_groups.own_path(n)
        if own is not None:
            assert where == (own or None), n.name  # "": the model's own forward code, at the top level
        if n.meta.get(COMM):
            comms += 1
            assert where == ("(step)" if BUCKET in n.meta else own) and where not in (None, "(inputs)"), n.name
    assert comms == sum(_has(el, "div", "comm") for el in nodes.values()) > 8
    step = [el for el in _all(section) if _has(el, "details", "tree") and el["attrs"]["data-module"] == "(step)"]
    assert step == [rows[-1]]
    inside = {el["attrs"]["data-node"] for el in _all(step[0]) if _has(el, "div", "node")}
    buckets = {n.name for n in gm.graph.nodes if BUCKET in n.meta or n.op == "output"}
    assert len(buckets) > 2 and buckets <= inside
    assert all(report_groups.own_path(n) is None for n in gm.graph.nodes if n.name in inside)


def test_graph_groups_keep_a_different_block_apart(one_stage):
    """A block whose collective differs (here blocks.2's all-reduce, made twice per step) is not folded."""
    gm = one_stage.rank_program.program.gm
    node = next(n for n in gm.graph.nodes if report_groups.own_path(n) == "blocks.2.attn.proj" and n.meta.get(COMM))
    saved = node.meta[COMM]
    node.meta[COMM] = [dataclasses.replace(r, count=2) for r in saved]
    try:
        labels = [_label(r) for r in _rows(next(iter(_graph_sections(report_graph.graphs(one_stage.rank_program))
                                                     .values())))]
    finally:
        node.meta[COMM] = saved
    assert labels[5:8] == ["blocks.0–1, 2 identical", "blocks.2", "blocks.3"]


def test_graph_groups_place_a_node_without_module_by_its_neighbour(one_stage):
    """A pass-inserted node with no module path joins its nearest producer's or consumer's module; the
    gradient-sync buckets and their getitems go to (step)."""
    gm = one_stage.rank_program.program.gm
    node = next(n for n in gm.graph.nodes if report_groups.own_path(n) == "blocks.1.mlp.down" and n.meta.get(COMM))
    stack = node.meta.pop("nn_module_stack")
    try:
        paths = report_groups.node_paths(gm.graph.nodes)
    finally:
        node.meta["nn_module_stack"] = stack
    assert paths[node] == "blocks.1.mlp.down"  # its producer, the row-parallel matmul
    syncs = [n for n in gm.graph.nodes if BUCKET in n.meta]
    assert syncs and all(paths[n] == paths[u] == "(step)" for n in syncs for u in n.users)


def test_graph_groups_pipeline_stages(sim):
    """With pp: stage 0 holds both blocks of the 2-layer model, folded; stage 1 none, and one (step) group."""
    sections = _graph_sections(report_graph.graphs(sim.rank_program))
    first, second = ([_label(r) for r in _rows(sections[k])] for k in ("s0-r0", "s1-r4"))
    assert first == ["(inputs)", "tok", "arange", "pos", "add", "blocks.0–1, 2 identical", "(step)"]
    assert second[0] == "(inputs)" and second[-1] == "(step)" and second.count("(step)") == 1
    assert not [label for label in second if label.startswith("blocks")]


# ------------------------------------------------------------------------------------------ the browser
# Without Chromium these skip, saying why; under CI they fail instead (tests/cdp.py: require_chromium).
def test_report_in_chromium(sim, page_file, tmp_path):
    cdp.require_chromium()
    program, pipeline = sim.rank_program.program, sim.rank_program.pipeline
    with cdp.Browser(width=1280, height=900) as browser:
        page = browser.open(page_file.as_uri())
        assert page.eval("document.body.getAttribute('data-ready')") == "1"  # the script ran to its end
        count = lambda sel: page.eval(f"document.querySelectorAll({sel!r}).length")
        assert count("#params tr.param") == len(program.params)
        assert count("#collectives tr.collective") == len(explain(program, (), pipeline).collectives)
        assert count(".timeline .tl-bar") == _actions(pipeline.schedule)
        shown = "#graph details.graph:not(.hidden)"
        assert count(f"{shown} .node") == sum(len(s.gm.graph.nodes) for s in pipeline.local.values())
        # the picker shows another rank's stage: stage 1 as rank 4 runs it, compiled here for that rank
        other = PipelinePlan(passes_for_rank(sim.rank_program.traced, 4), pipeline.plan).local[1].gm
        page.eval("(() => { const p = document.getElementById('graph-pick'); p.value = 's1-r4';"
                  " p.dispatchEvent(new Event('change')); })()")
        assert page.eval(f"[...document.querySelectorAll({shown!r})].map(d => d.dataset.stage)") == ["s1-r4"]
        assert count(f"{shown} .node") == len(other.graph.nodes) != len(pipeline.local[0].gm.graph.nodes)
        assert page.eval(f"document.querySelector('{shown} > summary').offsetHeight") > 0
        page.eval("(() => { const p = document.getElementById('graph-pick'); p.value = 's0-r0';"
                  " p.dispatchEvent(new Event('change')); })()")
        # a click on the folded blocks expands them, the first open; a click on one of its modules shows its nodes
        fold = "#graph details.fold[data-module='blocks.0–1']"
        assert page.eval(f"document.querySelector({fold!r}).open") is False
        page.click(fold + " > summary")
        assert page.eval(f"document.querySelector({fold!r}).open") is True
        assert page.eval(f"document.querySelector({fold!r} + ' > details[data-module=\"blocks.1\"]').offsetHeight") > 0
        module = f"{fold} details.tree[data-module='blocks.0.mlp']"
        assert page.eval(f"document.querySelector({module!r}).open") is False
        page.click(module + " > summary")
        assert page.eval(f"document.querySelector({module!r}).querySelector(':scope > .node').offsetHeight") > 0
        # the filter keeps the matching parameters only
        page.eval("(() => { const f = document.getElementById('param-filter'); f.value = 'mlp.up';"
                  " f.dispatchEvent(new Event('input')); })()")
        shown = page.eval("[...document.querySelectorAll('#params tr.param:not(.hidden)')]"
                          ".map(r => r.dataset.fqn)")
        assert shown == [f for f in program.params if "mlp.up" in f]
        page.eval("(() => { const f = document.getElementById('param-filter'); f.value = '';"
                  " f.dispatchEvent(new Event('input')); })()")
        # a collective's link opens the module its node sits in (switching the picker back to this rank's stage)
        page.eval("(() => { const p = document.getElementById('graph-pick'); p.value = 's1-r4';"
                  " p.dispatchEvent(new Event('change')); })()")
        page.click("#collectives a.to-node")
        target = page.eval("document.querySelector('#collectives a.to-node').getAttribute('href').slice(1)")
        assert page.eval(f"document.getElementById({target!r}).offsetHeight") > 0
        assert page.eval("document.getElementById('graph-pick').value") == "s0-r0"
        # the screenshot (every section): trees folded but one attention block's parameters and one mlp's nodes
        page.eval("const keep = {params: ['blocks', 'blocks.0', 'blocks.0.attn', 'blocks.0.attn.proj'],"
                  " graph: ['blocks.0–1', 'blocks.0', 'blocks.0.mlp']};"
                  "document.querySelectorAll('details.tree').forEach(d => { d.open = d.matches('.graph') || "
                  "keep[d.closest('section').id].includes(d.dataset.module); });"
                  "document.getElementById('hover').style.display = 'none'; window.scrollTo(0, 0)")
        shot = tmp_path / "report.png"
        page.screenshot(shot, full_height=page.eval("document.documentElement.scrollHeight"), scale=0.62)
        page.eval("1")  # flush the events the page sent before this reply
        assert page.errors == []
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and 10_000 < len(data) < 400_000
    if os.environ.get("MESHC_REPORT_PNG"):
        shutil.copyfile(shot, os.environ["MESHC_REPORT_PNG"])


def test_console_errors_are_seen(tmp_path):
    """The check above is not vacuous: a page that throws is reported."""
    cdp.require_chromium()
    bad = tmp_path / "bad.html"
    bad.write_text("<!DOCTYPE html><html><body><script>console.error('boom'); null.x;</script></body></html>")
    with cdp.Browser() as browser:
        page = browser.open(bad.as_uri())
        page.eval("1")
        errors = page.errors
    assert any("boom" in e for e in errors) and any("TypeError" in e for e in errors), errors


@pytest.mark.parametrize("ci", ["true", "", "false"])
def test_a_missing_chromium_skips_outside_ci_and_fails_under_it(monkeypatch, ci):
    """`make test` under CI must not pass with the browser tests skipped (issue 46): without Chromium on PATH,
    require_chromium skips with its reason outside CI and fails, saying to install it, under CI=true."""
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.setenv("CI", ci)
    assert cdp.chromium() is None
    outcome = pytest.fail.Exception if ci == "true" else pytest.skip.Exception
    with pytest.raises(outcome, match="chromium is not installed") as raised:
        cdp.require_chromium()
    assert ("under CI" in str(raised.value)) == (ci == "true")
