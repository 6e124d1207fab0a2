"""The index page of a run: every notebook, its status and its findings."""
from __future__ import annotations

import html
import json
import math
from pathlib import Path
from typing import Any

from .machine import summary_line


def _fmt(value: Any) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "–"
    if isinstance(value, float):
        return f"{value:,.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    return str(value)


def load_findings(results_dir: Path) -> dict[str, dict]:
    """{notebook: results JSON} for every results file in `results_dir`."""
    out = {}
    for path in sorted(Path(results_dir).glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except ValueError:
            data = None
        out[path.stem] = (data if isinstance(data, dict) else
                          {"notebook": path.stem, "findings": [], "error": "unreadable JSON"})
    return out


FINDING_COLUMNS = ("technique", "metric", "baseline", "treated", "change_pct",
                   "article_claim", "mechanism")


def findings_rows(results: dict[str, dict]) -> list[dict]:
    rows = []
    for notebook, data in results.items():
        for f in data.get("findings", []):
            rows.append({"notebook": notebook, **{c: f.get(c) for c in FINDING_COLUMNS}})
    return rows


def _checklist_section(data: dict | None) -> list[str]:
    """The article's checklist, the combined-configuration summary figure and
    the cross-check against `vllm bench serve`, from 12_checklist's results."""
    if not data or not data.get("checklist"):
        return []
    md = ["", "## The article's checklist, measured", "",
          "| technique | metric | claimed | measured (%) | 95% CI of measured (%) | verdict | notebook | reason |",
          "|---|---|---|---|---|---|---|---|"]
    for r in data["checklist"]:
        ci = r.get("measured_ci95")
        ci_text = f"{ci[0]:.0f} … {ci[1]:.0f}" if ci and None not in ci else "–"
        md.append(f"| {r['technique']} | {r['metric']} | {r['claimed']} | {_fmt(r.get('measured'))} "
                  f"| {ci_text} | {r['verdict']} | {r.get('notebook', '')} | {r.get('reason', '')} |")
    md += ["", "![summary](results/checklist_summary.png)"]
    xc = data.get("crosscheck")
    if xc:
        md += ["", "## Cross-check: lab_utils vs `vllm bench serve` (same server, same requests)", "",
               "| metric | stat | vllm bench serve (ms) | lab_utils (ms) | diff (%) |",
               "|---|---|---|---|---|"]
        for r in xc["rows"]:
            md.append(f"| {r['metric']} | {r['stat']} | {r['vllm_bench_ms']:.2f} | "
                      f"{r['lab_utils_ms']:.2f} | {r['diff_pct']:+.1f} |")
    return md


def _machine_section(results: dict[str, dict]) -> list[str]:
    """Which machine ran the notebooks (the first results file that says) and the
    thread binding vLLM applied to the first engine whose log showed one."""
    md = []
    machine = next((d["environment"]["machine"] for d in results.values()
                    if isinstance(d.get("environment"), dict)
                    and d["environment"].get("machine")), None)
    if machine:
        md += ["", f"machine: {summary_line(machine)}"]
    binding = next((e["binding"] for d in results.values() for e in d.get("engines", [])
                    if isinstance(e, dict) and e.get("binding")), None)
    if binding:
        parts = [f"bind {binding['bind']}"] if "bind" in binding else []
        parts += [f"{name} {binding[key]}" for key, name in (
            ("core_ids", "core ids"), ("reserved_cpus", "reserved"),
            ("torch_threads", "torch threads")) if key in binding]
        if binding.get("executor") == "uni":
            parts.append("worker inside the engine core")
        md += ["", "engine binding: " + ", ".join(parts)]
    return md


def engine_command(command: str) -> str:
    """An engine's command line without its port (a new one every start): the
    engine's configuration (`lab_utils.engine_share.config_key`)."""
    from .engine_share import config_key
    return config_key(command)


def engine_budget(results: dict[str, dict], status: dict) -> dict[str, Any]:
    """How much of the run went into engine starts: starts recorded in the
    results, distinct configurations (command line without its port), their
    start-up seconds against the notebooks' seconds; engines the run's broker
    lent a notebook already running (`lent`, no start of their own); and what
    reusing an identical engine across notebooks would still save (every start
    of a configuration after its first in another notebook).

    Starts that overlapped (engines started side by side, `started_at` and
    `startup_s` of each) count once: `startup_s` is the time the run spent
    with at least one engine starting, `own_s` the sum of each start's own
    time, `side_by_side` how many starts overlapped another."""
    starts, lent = [], 0
    for notebook, data in results.items():
        for e in data.get("engines", []):
            if (e.get("shared") or {}).get("reused_from"):
                lent += 1
            elif e.get("startup_s") is not None:
                config = engine_command(e.get("command", ""))
                starts.append((notebook, config, float(e["startup_s"]), e.get("started_at")))
    first_in: dict[str, str] = {}
    saved_n, saved_s = 0, 0.0
    for notebook, config, secs, _ in starts:
        if config not in first_in:
            first_in[config] = notebook
        elif first_in[config] != notebook:
            saved_n, saved_s = saved_n + 1, saved_s + secs
    run_s = sum(nb.get("seconds") or 0.0 for nb in status.get("notebooks", []))
    own_s = sum(s for _, _, s, _ in starts)
    timed = sorted((float(at), float(at) + s) for _, _, s, at in starts if at is not None)
    start_s = own_s - sum(s for _, _, s, at in starts if at is not None)  # untimed: apart
    side, end = 0, -math.inf
    for i, (a, b) in enumerate(timed):
        overlaps = a < end or (i + 1 < len(timed) and timed[i + 1][0] < b)
        side += overlaps
        start_s += max(0.0, b - max(a, end))
        end = max(end, b)
    return {"starts": len(starts), "configurations": len(first_in), "startup_s": start_s,
            "own_s": own_s, "side_by_side": side,
            "notebooks_s": run_s, "share": start_s / run_s if run_s else math.nan,
            "lent": lent, "reusable_starts": saved_n, "reusable_s": saved_s}


def _budget_line(results: dict[str, dict], status: dict) -> list[str]:
    b = engine_budget(results, status)
    if not b["starts"]:
        return []
    lent = (f"; {b['lent']} more engines lent already running by the run's broker "
            "(lab_utils.engine_share)" if b["lent"] else "")
    side = (f" ({b['side_by_side']} of them started side by side: their own times sum to "
            f"{b['own_s']:,.0f} s)" if b["side_by_side"] else "")
    return ["", f"engine starts: {b['starts']} ({b['configurations']} distinct configurations), "
                f"{b['startup_s']:,.0f} s of the notebooks' {b['notebooks_s']:,.0f} s "
                f"({b['share']:.0%}){side}{lent}; configurations started again in a later "
                f"notebook (a new process on purpose, or not shared): {b['reusable_starts']} "
                f"starts, {b['reusable_s']:,.0f} s"]


def _load_section(results: dict[str, dict]) -> list[str]:
    """The load each load-dependent notebook placed from the engine capacity it
    measured first (`lab_utils.capacity`), so a reader sees how hard each
    engine was pushed on this machine."""
    rows = []
    for notebook, data in results.items():
        for key, cap in (data.get("capacity") or {}).items():
            rows.append(f"| {notebook} | {key.split(' | ', 1)[-1]} | {_fmt(cap.get('sync_rate'))} "
                        f"| {_fmt(cap.get('max_rate'))} ({cap.get('concurrency')} in flight) |")
        load = data.get("load") or {}
        if load.get("described"):
            rows.append(f"| {notebook} | load placed from it | {load['described']} | |")
    if not rows:
        return []
    return ["", "## Load, placed from measured capacity", "",
            "| notebook | workload | one at a time (req/s) | saturated (req/s) |",
            "|---|---|---|---|", *rows]


def _arms_section(results: dict[str, dict]) -> list[str]:
    """The remote server the run measured (what it told of itself), and every
    arm that did not run as declared: skipped (why) or emulated (how)."""
    md: list[str] = []
    server = next((d["server"] for d in results.values() if d.get("server")), None)
    if server:
        from .remote import ServerInfo
        md += ["", "## Remote server", "", ServerInfo(**server).describe()]
    rows = []
    for name, data in results.items():
        for arm, why in (data.get("skipped_arms") or {}).items():
            rows.append(f"| {name} | {arm} | skipped | {why.replace('|', '/')} |")
        for arm, how in (data.get("remote_arms") or {}).items():
            if how.get("emulated"):
                rows.append(f"| {name} | {arm} | emulated | {how['emulated']} |")
    if rows:
        md += ["", "## Arms not run as declared", "", "| notebook | arm | how | why |",
               "|---|---|---|---|", *rows]
    return md


def build_index(run_dir: str | Path) -> tuple[Path, Path]:
    """Write `index.md` and `index.html` for a run folder made by runall."""
    run_dir = Path(run_dir)
    status = json.loads((run_dir / "status.json").read_text())
    results = load_findings(run_dir / "results")
    md = [f"# vLLM Latency Lab run {run_dir.name}", "",
          f"profile: `{status.get('profile')}` · started {status.get('started')} · "
          f"finished {status.get('finished') or '(unfinished)'}",
          *_machine_section(results), *_budget_line(results, status), "",
          "| notebook | status | time (s) | findings | executed notebook |",
          "|---|---|---|---|---|"]
    for nb in status["notebooks"]:
        n_find = len(results.get(nb["name"], {}).get("findings", []))
        md.append(f"| {nb['name']} | {nb['status']} | {_fmt(nb.get('seconds'))} | {n_find} | "
                  f"[{nb['name']}.ipynb](notebooks/{nb['name']}.ipynb) |")
    errors = [nb for nb in status["notebooks"] if nb.get("error")]
    if errors:
        md += ["", "## Failures", ""]
        for nb in errors:
            md += [f"### {nb['name']}", "", "```", nb["error"].strip()[-3000:], "```", ""]
    md += _checklist_section(results.get("12_checklist"))
    md += _arms_section(results)
    md += _load_section(results)
    md += ["", "## Findings", "",
           "| notebook | " + " | ".join(FINDING_COLUMNS) + " |",
           "|---" * (len(FINDING_COLUMNS) + 1) + "|"]
    for row in findings_rows(results):
        md.append("| " + " | ".join(_fmt(row[c]).replace("|", "/")
                                    for c in ("notebook",) + FINDING_COLUMNS) + " |")
    md_path = run_dir / "index.md"
    md_path.write_text("\n".join(md) + "\n")
    html_path = run_dir / "index.html"
    html_path.write_text(_markdown_table_html("\n".join(md), run_dir.name))
    return md_path, html_path


def _markdown_table_html(md: str, title: str) -> str:
    """Tiny Markdown-to-HTML for the index (headings, tables, code, links)."""
    import re
    out, in_table, in_code = [], False, False
    for line in md.splitlines():
        if line.startswith("```"):
            out.append("</pre>" if in_code else "<pre>")
            in_code = not in_code
            continue
        if in_code:
            out.append(html.escape(line))
            continue
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            if all(set(c) <= {"-"} for c in cells):
                continue
            if not in_table:
                out.append("<table>")
                in_table, tag = True, "th"
            else:
                tag = "td"
            cells = [re.sub(r"\[(.+?)\]\((.+?)\)", r'<a href="\2">\1</a>', html.escape(c))
                     for c in cells]
            out.append("<tr>" + "".join(f"<{tag}>{c}</{tag}>" for c in cells) + "</tr>")
            continue
        if in_table:
            out.append("</table>")
            in_table = False
        if line.startswith("#"):
            level = len(line) - len(line.lstrip("#"))
            out.append(f"<h{level}>{html.escape(line.lstrip('# '))}</h{level}>")
        elif line.startswith("!["):
            src = re.search(r"\((.+?)\)", line).group(1)
            out.append(f'<p><img src="{html.escape(src)}" style="max-width:100%"></p>')
        elif line.strip():
            out.append(f"<p>{html.escape(line).replace('`', '')}</p>")
    if in_table:
        out.append("</table>")
    style = ("body{font-family:sans-serif;max-width:1200px;margin:2em auto}"
             "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:4px 8px}"
             "pre{background:#f6f6f6;padding:8px;overflow:auto}")
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}"
            f"</title><style>{style}</style></head><body>{''.join(out)}</body></html>")
