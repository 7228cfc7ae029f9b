"""`meshc plan --html plans.html`: the planner's candidates as one self-contained page (the report's CSS).

One row per plan the planner scored (compiler/planner/search.py's PlanResult): those that fit, by rank, the chosen one
(rank 1) marked, each with why it ranks where it does; then those that did not fit, leanest first, with the
memory they need against what a rank has; then those that did not compile, with the error. Columns: mesh,
plan options, predicted memory per rank (the fullest), predicted step time, rank or verdict, why. Under the
table: the meshes the model refuses (tp not dividing the heads, more pp ranks than layers, a batch dp does not
divide) and how many plans were set aside unscored because their memory formulas alone exceed the budget.
At most `max_rows` rows (the rest counted); a filter box hides rows by text.
"""
from __future__ import annotations

import html
from pathlib import Path

from meshc.compiler.report import assets as report_assets
from meshc.compiler.ir.errors import MeshcValueError
from meshc.compiler.ir.show import human_bytes

MAX_ROWS = 2000  # ~250 bytes a row: ~0.5 MB at most
e = html.escape

FILTER_JS = r"""
document.addEventListener("DOMContentLoaded", function () {
  var box = document.getElementById("plan-filter");
  box.addEventListener("input", function () {
    var q = box.value.trim().toLowerCase();
    document.querySelectorAll("#plans tr.plan").forEach(function (row) {
      row.classList.toggle("hidden", q !== "" && row.textContent.toLowerCase().indexOf(q) < 0);
    });
  });
  document.body.setAttribute("data-ready", "1");
});
"""
CSS = "tr.plan.chosen td { background: #e3f2d9; font-weight: 600; } tr.plan.rejected td { color: #888; }"


def write_plans(path, result, *, title: str) -> Path:
    """Write `plans_html(result, title=...)` to `path` (a .html file); returns the path."""
    path = Path(path)
    if path.suffix.lower() not in (".html", ".htm"):
        raise MeshcValueError(f"plan --html: expected a path ending in .html, got {str(path)!r}; name it plans.html")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(plans_html(result, title=title))
    return path


def plan_rows(result) -> list[tuple[str, object, str, str]]:
    """(kind, candidate, verdict, why) of every scored plan, in the page's order; kind: chosen, fits, rejected,
    failed. Memory and step time come with the candidate's estimate (None for a plan that did not compile)."""
    rows = [("chosen" if r.rank == 1 else "fits", r, f"rank {r.rank}", r.reason) for r in result.ranked]
    rows += [("rejected", r, "does not fit", f"needs {human_bytes(r.estimate.total_memory)} per rank, more than "
              f"{human_bytes(result.memory)}") for r in sorted(result.rejected_plans,
                                                              key=lambda r: r.estimate.total_memory)]
    rows += [("failed", c, "does not compile", why) for c, why in result.failed]
    return rows


def plans_html(result, *, title: str, max_rows: int = MAX_ROWS) -> str:
    rows = plan_rows(result)
    body = []
    for kind, item, verdict, why in rows[:max_rows]:
        c = getattr(item, "candidate", item)
        est = getattr(item, "estimate", None)
        memory = human_bytes(est.total_memory) if est else ""
        step = f"{est.step_time * 1e3:.2f} ms" if est else ""
        options = c.describe()[len(c.describe_mesh()) + 1:]
        cls = "plan chosen" if kind == "chosen" else "plan" if kind == "fits" else "plan rejected"
        body.append(f'<tr class="{cls}" data-kind="{kind}"><td class="mono">{e(c.describe_mesh())}</td>'
                    f'<td class="mono">{e(options)}</td><td class="num">{memory}</td><td class="num">{step}</td>'
                    f"<td>{e(verdict)}</td><td>{e(why)}</td></tr>")
    head = ("<tr><th>mesh</th><th>plan</th><th class=\"num\">memory / rank</th><th class=\"num\">step</th>"
            "<th>rank</th><th>why</th></tr>")
    more = f"<p>{len(rows) - max_rows} more rows not listed (at most {max_rows}).</p>" if len(rows) > max_rows else ""
    unscored = result.rejected - len(result.rejected_plans)
    notes = [f"{len(result.ranked)} plans fit in {human_bytes(result.memory)} per rank on {e(result.hardware.name)}, "
             f"{len(result.rejected_plans)} scored did not, {len(result.failed)} did not compile"
             + (f"; {unscored} more were set aside unscored: their memory formulas alone exceed the budget"
                if unscored else "") + "."]
    refused = "".join(f"<tr class=\"excluded\"><td class=\"mono\">dp={m[0]} tp={m[1]} pp={m[2]}</td><td>{e(why)}</td>"
                      f"</tr>" for m, why in result.excluded)
    excluded = (f'<h2>Meshes the model refuses</h2>\n<table id="excluded"><tr><th>mesh</th><th>why</th></tr>{refused}'
                "</table>\n") if refused else ""
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{e(title)}</title>\n'
            f"<style>{report_assets.CSS}\n{CSS}</style></head>\n<body>\n<h1>{e(title)}</h1>\n"
            f"<p>{' '.join(notes)}</p>\n<p>Every plan scored, the chosen one (rank 1) highlighted; memory is the "
            "predicted bytes of the fullest rank, step the predicted step time. "
            '<input type="search" id="plan-filter" placeholder="filter, e.g. pp=2 or zero=3"></p>\n'
            f'<section id="plans"><table id="plans-table">{head}{"".join(body)}</table>{more}</section>\n'
            f"{excluded}<script>{FILTER_JS}</script>\n</body></html>\n")
