#!/usr/bin/env python3
"""Renders README.md's performance tables from the benchmark output in bench/results/.

Every figure in a performance table of README.md comes from a JSON file that
bench/run.py wrote (`--json`) and that is committed under bench/results/, with
the machine, the date, the page-cache state and the number of runs inside it.
A table lives between two marker comments that say where its figures come from:

    <!-- bench: file=2026-12-01-tinyllama.json kinds=policy cols=model,input,size,command,wall,xcp,rss -->
    (generated: leave it to this script)
    <!-- /bench -->

  python3 bench/tables.py            rewrites every table of README.md from its JSON
  python3 bench/tables.py --check    fails (exit 1, with a diff) when README.md is not
                                     what the JSON says; .ci/run runs this

Needs only Python 3 (no torch). Below each table a line names the JSON file, the
machine, the date and how the figures were taken.

Marker options (space-separated KEY=VALUE; quote a value holding spaces):

  file=A.json[,B.json]  the results (paths relative to bench/results/); rows keep
                        the files' order
  kinds=policy,dcp      only these input kinds (run.py's KINDS: policy, dcp, ranks,
                        zero2, zero3); default all
  tools=read,cp,unshard only these rows (run.py's tool names: read, cp, unshard,
                        "unshard NAME" for --compare NAME=..., python, zero_to_fp32)
  data=NAME[,NAME]      only the data directories with these base names
  layout=rows|pivot     rows (default): one table row per result (per tool);
                        pivot: one table row per input, tools as columns
  cols=C1,C2,...        the columns, in order; a column is NAME or NAME=Header
                        (a header with spaces needs the whole cols value quoted;
                        a comma in a header is written \\,)

Columns (layout=rows):
  model    "1.10B (22 layers)" from the row's model fields (run.py writes them)
  input    the input's label (run.py's)
  size     the input's size
  cache    the page cache of the run (cold or warm: the JSON's `cache`)
  command  what ran (read only, `cp -r`, `unshard merge`, ...)
  wall     median wall time, seconds
  sync     median wall time plus the `sync` after it, seconds
  xcp      wall time over `cp -r`'s, same input, same run
  xread    wall time over the read-only row's, same input, same run
  xsync    wall time plus the `sync` after it over `cp -r`'s, same input, same run
           (the fair ratio for unshard, which fsyncs before it returns)
  load     the 1-minute load average as the runs started, lowest-highest
  rss      median peak RSS
  cpu      median CPU time (user + system), seconds
  runs     every run's wall time
  field:K  the row's own field K (or its model's), printed as it is

Columns (layout=pivot), one row per input: model, input, size, cache, field:K as
above, and METRIC:TOOL with METRIC one of wall, sync, xcp, xread, xsync, load, rss, cpu, runs, e.g.
`wall:cp`, `rss:unshard`; `rss:unshard+unshard old` prints "47 / 44 MB"; and
`ratio:A/B`, the wall time of tool A over tool B's, e.g. `ratio:unshard/unshard old`.

To add a table for new results: commit the JSON from `bench/run.py --json
bench/results/DATE-WHAT.json` (`--note` says how the machine was shared), put an
empty marker pair where the table goes, and run `python3 bench/tables.py`. A new
kind of column goes into COLUMNS (layout=rows) or METRICS (pivot) below.
"""

import argparse
import difflib
import json
import os
import re
import shlex
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
README = os.path.join(os.path.dirname(HERE), "README.md")

MARKER = re.compile(r"<!-- bench:(?P<opts>.*?)-->\n(?P<body>.*?)<!-- /bench -->", re.S)

COMMANDS = {
    "read": "read only",
    "cp": "`cp -r`",
    "unshard": "`unshard merge` (to bf16)",
    "python": "Python pipeline",
    "zero_to_fp32": "`zero_to_fp32.py --safe_serialization`",
}


class Bad(Exception):
    """A marker or a results file this script cannot use; the message says which."""


def command(tool):
    if tool in COMMANDS:
        return COMMANDS[tool]
    if tool.startswith("unshard "):
        return "`unshard merge` (%s)" % tool[len("unshard "):]
    return tool


def fmt_bytes(n):
    if n >= 1e9:
        return "%.2f GB" % (n / 1e9)
    return "%.0f MB" % (n / 1e6)


def model(r):
    m = r.get("model") or {}
    if "ranks" in m:
        return "wide (%d layers over %d ranks%s)" % (
            m["layers"], m["ranks"], ", + Adam state" if m.get("optim") else "")
    if "parameters" in m and "layers" in m:
        return "%.2fB (%d layer%s)" % (m["parameters"] / 1e9, m["layers"],
                                       "" if m["layers"] == 1 else "s")
    return os.path.basename(r["data"])


def field(r, key):
    v = r.get(key, (r.get("model") or {}).get(key))
    if v is None:
        raise Bad("row %s/%s has no field %r" % (r["kind"], r["tool"], key))
    return str(v)


def peer(rows, r, tool):
    """The row of `tool` for the same input in the same run, or None."""
    return next((c for c in rows if c["_file"] == r["_file"] and c["data"] == r["data"]
                 and c["kind"] == r["kind"] and c["tool"] == tool and "wall" in c), None)


def ratio(rows, r, tool):
    p = peer(rows, r, tool)
    return "%.2f" % (r["wall"] / p["wall"]) if p else ""


def ratio_sync(rows, r, tool):
    p = peer(rows, r, tool)
    return "%.2f" % (r["wall_sync"] / p["wall_sync"]) if p else ""


def load_range(r):
    if "load_1min" not in r:
        raise Bad("row %s/%s has no load averages" % (r["kind"], r["tool"]))
    lo, hi = min(r["load_1min"]), max(r["load_1min"])
    return "%.1f" % lo if lo == hi else "%.1f-%.1f" % (lo, hi)


def cpu(r):
    if "cpu" not in r:
        raise Bad("row %s/%s has no CPU times (run.py writes them since 2026-12-01)"
                  % (r["kind"], r["tool"]))
    c = sorted(r["cpu"])
    mid = len(c) // 2
    return "%.2f" % (c[mid] if len(c) % 2 else (c[mid - 1] + c[mid]) / 2)


METRICS = {
    "wall": lambda rows, r: "%.2f" % r["wall"],
    "sync": lambda rows, r: "%.2f" % r["wall_sync"],
    "xcp": lambda rows, r: ratio(rows, r, "cp"),
    "xread": lambda rows, r: ratio(rows, r, "read"),
    "xsync": lambda rows, r: ratio_sync(rows, r, "cp"),
    "load": lambda rows, r: load_range(r),
    "rss": lambda rows, r: fmt_bytes(r["rss"]),
    "runs": lambda rows, r: ", ".join("%.2f" % w for w in r["walls"]),
    "cpu": lambda rows, r: cpu(r),
}

COLUMNS = dict(METRICS, **{
    "model": lambda rows, r: model(r),
    "input": lambda rows, r: r["label"],
    "size": lambda rows, r: fmt_bytes(r["input_bytes"]),
    "cache": lambda rows, r: r["_cache"],
    "command": lambda rows, r: command(r["tool"]),
})

HEADERS = {
    "model": "model", "input": "input", "size": "size", "cache": "cache", "command": "command",
    "wall": "wall s", "sync": "wall+sync s", "xcp": "x cp", "xread": "x read",
    "xsync": "x cp, +sync", "load": "load avg",
    "rss": "peak RSS", "runs": "runs, s", "cpu": "CPU s",
}
UNITS = {"wall": " s", "sync": " s", "cpu": " s"}
TEXT_COLUMNS = {"model", "input", "cache", "command"}


def load(names):
    rows, heads = [], []
    for name in names:
        path = os.path.join(RESULTS, name)
        try:
            with open(path) as f:
                doc = json.load(f)
        except (OSError, ValueError) as e:
            raise Bad("cannot read %s: %s" % (path, e))
        for key in ("machine", "date", "cache", "repeat", "results"):
            if key not in doc:
                raise Bad("%s has no %r: write it with bench/run.py --json" % (path, key))
        heads.append((name, doc))
        for r in doc["results"]:
            rows.append(dict(r, _file=name, _cache=doc["cache"]))
    return rows, heads


def parse_cols(spec):
    cols = []
    for c in re.split(r"(?<!\\),", spec):
        name, _, head = c.strip().partition("=")
        cols.append((name, head.replace("\\,", ",") or None))
    return cols


def source_line(heads):
    parts = []
    for name, doc in heads:
        how = "%s page cache, median of %d run%s" % (
            doc["cache"], doc["repeat"], "" if doc["repeat"] == 1 else "s")
        note = doc.get("note")
        parts.append("`bench/results/%s`: %s; %s; %s%s" % (
            name, doc["machine"], doc["date"], how, "; " + note if note else ""))
    return "<sub>Generated by `bench/tables.py` from " + "; ".join(parts) + ".</sub>"


def render(opts):
    try:
        args = dict(a.split("=", 1) for a in shlex.split(opts))
    except ValueError as e:
        raise Bad("marker %r: %s (options are KEY=VALUE)" % (opts.strip(), e))
    unknown = set(args) - {"file", "kinds", "tools", "data", "layout", "cols"}
    if unknown or "file" not in args or "cols" not in args:
        raise Bad("marker %r: needs file= and cols=; unknown options %s"
                  % (opts.strip(), sorted(unknown)))
    rows, heads = load(args["file"].split(","))
    keep = rows
    if "kinds" in args:
        keep = [r for r in keep if r["kind"] in args["kinds"].split(",")]
    if "data" in args:
        keep = [r for r in keep if os.path.basename(r["data"]) in args["data"].split(",")]
    cols = parse_cols(args["cols"])
    layout = args.get("layout", "rows")
    if layout == "rows":
        if "tools" in args:
            keep = [r for r in keep if r["tool"] in args["tools"].split(",")]
        table = rows_table(rows, keep, cols)
    elif layout == "pivot":
        table = pivot_table(rows, keep, cols)
    else:
        raise Bad("marker %r: layout is rows or pivot" % opts.strip())
    if not keep:
        raise Bad("marker %r: no results match" % opts.strip())
    return table + "\n\n" + source_line(heads) + "\n"


def markdown(header, align, lines):
    out = ["| " + " | ".join(header) + " |",
           "|" + "|".join("---" if a == "l" else "---:" for a in align) + "|"]
    out += ["| " + " | ".join(cells) + " |" for cells in lines]
    return "\n".join(out)


def rows_table(rows, keep, cols):
    for name, _ in cols:
        if name not in COLUMNS and not name.startswith("field:"):
            raise Bad("unknown column %r (one of %s, field:K)" % (name, ", ".join(COLUMNS)))
    header = [h or HEADERS.get(n, n.split(":", 1)[-1]) for n, h in cols]
    align = ["l" if n in TEXT_COLUMNS or n.startswith("field:") else "r" for n, _ in cols]
    lines = []
    for r in keep:
        cells = []
        for name, _ in cols:
            if name.startswith("field:"):
                cells.append(field(r, name[6:]))
            elif "skipped" in r and name in METRICS:
                cells.append(r["skipped"] if name == "wall" else "")
            else:
                cells.append(COLUMNS[name](rows, r))
        lines.append(cells)
    return markdown(header, align, lines)


def pivot_table(rows, keep, cols):
    inputs = []
    for r in keep:
        key = (r["_file"], r["data"], r["kind"])
        if key not in [k for k, _ in inputs]:
            inputs.append((key, r))
    header, align = [], []
    for name, head in cols:
        metric, _, tools = name.partition(":")
        if metric in ("model", "input", "size", "cache") and not tools:
            header.append(head or HEADERS[metric])
            align.append("r" if metric == "size" else "l")
        elif metric == "field":
            header.append(head or tools)
            align.append("l")
        elif metric in METRICS and tools:
            header.append(head or "%s, %s" % (HEADERS[metric], command(tools)))
            align.append("r")
        elif metric == "ratio" and len(tools.split("/")) == 2:
            a, b = tools.split("/")
            header.append(head or "%s / %s" % (command(a), command(b)))
            align.append("r")
        else:
            raise Bad("unknown pivot column %r (model, input, size, cache, field:K, ratio:A/B, "
                      "METRIC:TOOL with METRIC one of %s)" % (name, ", ".join(METRICS)))
    lines = []
    for (fname, data, kind), first in inputs:
        cells = []
        for name, _ in cols:
            metric, _, tools = name.partition(":")
            if metric == "field":
                cells.append(field(first, tools))
            elif not tools:
                cells.append(COLUMNS[metric](rows, first))
            elif metric == "ratio":
                a, b = (peer(rows, first, t) for t in tools.split("/"))
                if a is None or b is None:
                    raise Bad("%s: no %r row for %s" % (fname, tools, first["label"]))
                cells.append("%.2f" % (a["wall"] / b["wall"]))
            else:
                vals = []
                for tool in tools.split("+"):
                    r = peer(rows, first, tool)
                    if r is None:
                        raise Bad("%s: no %r row for %s" % (fname, tool, first["label"]))
                    vals.append(METRICS[metric](rows, r))
                if metric == "rss" and len(vals) > 1:
                    unit = vals[0].split()[-1]
                    if all(v.endswith(" " + unit) for v in vals):
                        vals = [v.split()[0] for v in vals[:-1]] + [vals[-1]]
                cells.append(" / ".join(vals) + UNITS.get(metric, ""))
        lines.append(cells)
    return markdown(header, align, lines)


def rendered(text):
    def one(m):
        return "<!-- bench:%s-->\n%s<!-- /bench -->" % (m.group("opts"), render(m.group("opts")))
    return MARKER.sub(one, text)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true",
                    help="fail when README.md differs from what the results say")
    ap.add_argument("--readme", default=README)
    args = ap.parse_args()
    with open(args.readme) as f:
        text = f.read()
    try:
        new = rendered(text)
    except Bad as e:
        sys.exit("bench/tables.py: %s" % e)
    n = len(MARKER.findall(text))
    if args.check:
        if new != text:
            sys.stdout.writelines(difflib.unified_diff(
                text.splitlines(True), new.splitlines(True), "README.md", "from bench/results"))
            sys.exit("bench/tables.py: README.md's performance tables differ from "
                     "bench/results/ (run python3 bench/tables.py)")
        print("bench/tables.py: %d table(s) match bench/results/" % n)
        return
    if new != text:
        with open(args.readme, "w") as f:
            f.write(new)
    print("bench/tables.py: %d table(s) written" % n)


if __name__ == "__main__":
    main()
