"""The CSS and JavaScript that `report.html` inlines into every report: no network, no CDN, no build step.

Plain DOM code, no library: the page is server-side HTML (every row, node and bar is in the markup, so a
DOM dump or a test sees them without running scripts); the script adds only behaviour: the parameter
filter, colouring the mesh by an axis, the picker that shows one rank's stage graph at a time, the hover
panel of graph nodes, and links from a collective to its node.
"""
from __future__ import annotations

CSS = """
:root { --f:#4e79a7; --b:#f28e2b; --i:#e15759; --w:#76b7b2; --comm:#d62728; --muted:#777; }
body { font: 13px/1.4 system-ui, sans-serif; margin: 0 1.5em 3em; color: #222; }
h1 { font-size: 1.4em; margin: .8em 0 .2em; } h2 { font-size: 1.15em; margin: 1.6em 0 .4em;
  border-bottom: 1px solid #ddd; }
nav a { margin-right: 1em; } code, .mono { font-family: ui-monospace, Menlo, monospace; font-size: 12px; }
.muted { color: var(--muted); }
table { border-collapse: collapse; } td, th { padding: 2px 8px; text-align: left; vertical-align: top; }
th { background: #f3f3f3; } tr:nth-child(even) td { background: #fafafa; }
td.num, th.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
.mesh { display: flex; gap: 18px; flex-wrap: wrap; align-items: flex-start; }
.pp-block { border: 1px solid #ccc; padding: 6px; border-radius: 4px; }
.pp-grid { display: grid; gap: 3px; }
.rank { width: 46px; height: 34px; display: flex; align-items: center; justify-content: center;
  border-radius: 3px; font-size: 11px; color: #fff; cursor: default; }
.rank.me { outline: 3px solid #000; outline-offset: 1px; font-weight: bold; }
details.tree { margin-left: 14px; } details.tree > summary { cursor: pointer; }
details.tree > summary .meta { color: var(--muted); margin-left: .6em; }
.tree-root > details.tree { margin-left: 0; }
.node { padding: 0 4px; margin-left: 14px; white-space: nowrap; }
.node:hover { background: #eef; }
.node.comm { color: var(--comm); font-weight: 600; }
.node.comm .src { color: #555; font-weight: normal; margin-left: 1em; }
.node.flash { background: #ffe08a; }
summary.has-comm::after { content: " ⇄"; color: var(--comm); }
#hover { position: fixed; right: 12px; bottom: 12px; max-width: 46em; background: #fffef4;
  border: 1px solid #cb9; padding: 6px 10px; display: none; white-space: pre-wrap; z-index: 5; }
.bars .bar-row { display: flex; align-items: center; margin: 2px 0; }
.bars .label { width: 14em; } .bars .track { display: flex; height: 16px; background: #f0f0f0; flex: 1;
  max-width: 900px; }
.bars .seg { height: 100%; } .legend span { display: inline-block; margin-right: 1em; }
.legend i { display: inline-block; width: 10px; height: 10px; margin-right: 4px; }
.timeline { position: relative; max-width: 1100px; }
.tl-row { position: relative; height: 22px; margin: 3px 0 3px 7em; background: #f6f6f6; }
.tl-row .tl-label { position: absolute; left: -7em; width: 6.6em; top: 3px; font-size: 11px; }
.tl-bar { position: absolute; top: 1px; bottom: 1px; color: #fff; font-size: 10px; overflow: hidden;
  text-align: center; border-right: 1px solid #fff; box-sizing: border-box; }
.tl-bar.F { background: var(--f); } .tl-bar.B { background: var(--b); } .tl-bar.I { background: var(--i); }
.tl-bar.W { background: var(--w); } .tl-bar.p2p { background: #999; } .tl-bar.collective { background: var(--comm); }
input[type=search] { width: 24em; padding: 3px; }
tr.hidden, .hidden { display: none; }
"""

JS = r"""
(function () {
  "use strict";
  var PALETTE = ["#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#b07aa1", "#76b7b2", "#edc948", "#9c755f",
                 "#ff9da7", "#bab0ac"];

  function colourMesh(axis) {
    document.querySelectorAll(".rank").forEach(function (el) {
      var c = parseInt(el.getAttribute("data-" + axis), 10) || 0;
      el.style.background = PALETTE[c % PALETTE.length];
    });
  }

  function filterParams(text) {
    var q = text.trim().toLowerCase();
    document.querySelectorAll("#params tr.param").forEach(function (row) {
      var hit = !q || row.getAttribute("data-fqn").toLowerCase().indexOf(q) >= 0;
      row.classList.toggle("hidden", !hit);
    });
    document.querySelectorAll("#params details.tree").forEach(function (d) {
      var shown = d.querySelectorAll("tr.param:not(.hidden)").length;
      d.classList.toggle("hidden", shown === 0);
      if (q) { d.open = shown > 0; }
    });
  }

  function showHover(el) {
    var box = document.getElementById("hover");
    box.textContent = el.getAttribute("data-info") || "";
    box.style.display = box.textContent ? "block" : "none";
  }

  function pickGraph(key) {
    document.querySelectorAll("#graph details.graph").forEach(function (d) {
      d.classList.toggle("hidden", d.getAttribute("data-stage") !== key);
    });
    var pick = document.getElementById("graph-pick");
    if (pick && pick.value !== key) { pick.value = key; }
  }

  function reveal(id) {
    var el = document.getElementById(id);
    if (!el) { return; }
    var graph = el.closest("details.graph");
    if (graph) { pickGraph(graph.getAttribute("data-stage")); }
    for (var p = el.parentElement; p; p = p.parentElement) {
      if (p.tagName === "DETAILS") { p.open = true; }
    }
    el.scrollIntoView({block: "center"});
    el.classList.add("flash");
    setTimeout(function () { el.classList.remove("flash"); }, 1500);
  }

  document.addEventListener("DOMContentLoaded", function () {
    var select = document.getElementById("mesh-colour");
    if (select) {
      select.addEventListener("change", function () { colourMesh(select.value); });
      colourMesh(select.value);
    }
    var pick = document.getElementById("graph-pick");
    if (pick) { pick.addEventListener("change", function () { pickGraph(pick.value); }); }
    var filter = document.getElementById("param-filter");
    if (filter) { filter.addEventListener("input", function () { filterParams(filter.value); }); }
    document.querySelectorAll(".node").forEach(function (el) {
      el.addEventListener("mouseenter", function () { showHover(el); });
    });
    document.querySelectorAll("a.to-node").forEach(function (a) {
      a.addEventListener("click", function (ev) { ev.preventDefault(); reveal(a.getAttribute("href").slice(1)); });
    });
    document.body.setAttribute("data-ready", "1");
  });
})();
"""
