#!/usr/bin/env python3
"""Renders the performance tables of README.md and docs/*.md from the benchmark output
in bench/results/.

Every figure in a performance table comes from a JSON file that bench/run.py,
bench/lora.py or bench/remote.py wrote (`--json`) and that is committed under
bench/results/, with the machine, the date and how the runs were taken inside it.
README.md holds one summary table; docs/benchmarks.md holds the others (docs/remote.md
may hold its own). A table lives between two marker comments that say where its
figures come from:

    <!-- bench: file=2026-12-01-tinyllama.json kinds=policy cols=model,input,size,command,wall,xcp,rss -->
    (generated: leave it to this script)
    <!-- /bench -->

  python3 bench/tables.py            rewrites every table of README.md and docs/*.md
                                     from its JSON
  python3 bench/tables.py --check    fails (exit 1, with a diff) when a document is not
                                     what the JSON says, or when README.md or
                                     docs/benchmarks.md has no table; .ci/run runs this

Needs only Python 3 (no torch). Below each table a line names the JSON file, the
machine (processor, cores, memory), the date, how the figures were taken, and how
busy the machine was (the load averages the file recorded, or those its note gives).
The rest of a file's note stays in the file: the text around a table says what the
rows are.

Marker options (space-separated KEY=VALUE; quote a value holding spaces):

  file=A.json[,B.json]  the results (paths relative to bench/results/); rows keep
                        the files' order
  kinds=policy,dcp      only these input kinds (run.py's KINDS: policy, dcp, ranks,
                        zero2, zero3); default all
  tools=read,cp,unshard only these rows (run.py's tool names: read, cp, unshard,
                        "unshard NAME" for --compare NAME=..., inspect, "inspect
                        NAME", python, zero_to_fp32)
  data=NAME[,NAME]      only the data directories with these base names
  layout=rows|pivot|lora|remote
                        rows (default): one table row per result (per tool);
                        pivot: one table row per input, tools as columns;
                        lora, remote: bench/lora.py's and bench/remote.py's JSON
                        (below)
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
above, bytes:K (the field K as a size, to 0.1 MB below 10 MB), and METRIC:TOOL with METRIC one of wall,
sync, xcp, xread, xsync, load, rss, cpu, runs (a tool with no result for the input says
"failed" or "skipped" as run.py kept it, or "–" when its file has no such row), e.g.
`wall:cp`, `rss:unshard`; `rss:unshard+unshard old` prints "47 / 44 MB"; and
`ratio:A/B`, the wall time of tool A over tool B's, e.g. `ratio:unshard/unshard old`.

layout=lora (bench/lora.py's JSON; options file, tools=plain,lora,peft, cols): one
row per command of each file, from the file's medians. Columns: date (of the run),
output (where it wrote), command, runs (how many), wall, cpu ("not recorded" in
files from before CPU times), rss, xplain (wall time over the plain merge's, same
file), peftmem (peft's peak RSS over the row's, same file; blank on peft's row),
load (the load averages at the end).

layout=remote (bench/remote.py's JSON; options file, match=REGEX, cols): one row
per row of each file whose name REGEX finds. Columns: row (its name), wall, runs,
gets (GET requests the server logged, median), rss (the largest peak over the
runs, of the largest part), rss_med (the median peak over the runs; files from
before it was kept have none), rss_sum (the parts' peaks summed), cpu (CPU seconds of
all the parts, median), parts (processes), xrow:PREFIX (wall time over the wall
time of the one row of the same file whose name starts with PREFIX).

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
BENCHMARKS = os.path.join(os.path.dirname(HERE), "docs", "benchmarks.md")
# Documents that must hold at least one table (a table deleted by mistake fails --check).
REQUIRED = (README, BENCHMARKS)

MARKER = re.compile(r"<!-- bench:(?P<opts>.*?)-->\n(?P<body>.*?)<!-- /bench -->", re.S)

COMMANDS = {
    "read": "read only",
    "cp": "`cp -r`",
    "unshard": "`unshard merge` (to bf16)",
    "python": "Python pipeline",
    "inspect": "`unshard inspect`",
    "zero_to_fp32": "`zero_to_fp32.py --safe_serialization`",
    "torch t1": "torch `consolidate_safetensors_files`, 1 thread",
    "torch t2": "torch `consolidate_safetensors_files`, 2 threads",
    "torch t4": "torch `consolidate_safetensors_files`, 4 threads",
    "torchtitan": "torchtitan `convert_to_hf` path (to bf16)",
}


class Bad(Exception):
    """A marker or a results file this script cannot use; the message says which."""


def command(tool):
    if tool in COMMANDS:
        return COMMANDS[tool]
    if tool.startswith("unshard "):
        return "`unshard merge` (%s)" % tool[len("unshard "):]
    if tool.startswith("inspect "):
        return "`unshard inspect` (%s)" % tool[len("inspect "):]
    return tool


def fmt_bytes(n):
    if n >= 1e9:
        return "%.2f GB" % (n / 1e9)
    return "%.0f MB" % (n / 1e6)


def shape(r):
    """The row's model fields (run.py's `model`; files before it kept the whole `meta`)."""
    return r.get("model") or r.get("meta") or {}


def model(r):
    m = shape(r)
    if m.get("kind") == "ranks":
        return "verl rank files (%d layers%s over %d ranks)" % (
            m["layers"], ", %d experts each," % m["experts"] if m.get("experts") else "",
            m["ranks"])
    if m.get("kind") == "deepspeed":
        return "narrow Llama (%d layers, hidden %d)" % (m["layers"], m["hidden"])
    if m.get("kind") == "hf_sharded":
        return "%.2fB (%d layers, %s)" % (m["parameters"] / 1e9, m["layers"], m["dtype"])
    if m.get("kind") == "moe":
        return "narrow MoE (%d layers, %d experts, hidden %d)" % (
            m["layers"], m["experts"], m["hidden"])
    if "ranks" in m:
        return "wide (%d layers over %d ranks%s)" % (
            m["layers"], m["ranks"], ", + Adam state" if m.get("optim") else "")
    if "parameters" in m and "layers" in m:
        return "%.2fB (%d layer%s)" % (m["parameters"] / 1e9, m["layers"],
                                       "" if m["layers"] == 1 else "s")
    return os.path.basename(r["data"])


def field(r, key):
    v = r.get(key, shape(r).get(key))
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
        doc = load_doc(name, ("machine", "date", "cache", "repeat", "results"), "bench/run.py")
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


def machine(doc):
    """The machine as the caption names it: processor, cores and memory (the JSON
    also records the kernel it ran)."""
    return re.sub(r",\s*Linux .*$", "", doc["machine"])


def loads(doc):
    """Every 1-minute load average the file recorded as its runs started."""
    rows = doc.get("results") or []
    return [x for r in rows if isinstance(r, dict) for x in r.get("load_1min", [])]


def conditions(doc):
    """How busy the machine was: the load averages recorded, else what the file's
    note says of them (only the figures and whether the machine was shared: the
    note's other words stay in the JSON)."""
    note = doc.get("note") or ""
    shared = "shared" in note or "other builds" in note
    quiet = re.search(r"quiet machine|nothing else (ran|running|building)", note, re.I)
    who = "a quiet machine" if quiet else "a shared machine" if shared else ""
    ls = loads(doc)
    if ls:
        lo, hi = min(ls), max(ls)
        load = "%.1f" % lo if "%.1f" % lo == "%.1f" % hi else "%.1f-%.1f" % (lo, hi)
    else:
        m = re.search(r"load average (~?[0-9.]+(?:-[0-9.]+)?)", note)
        load = m.group(1) if m else ""
    if load:
        return "%s%sload average %s" % (who, " (" if who else "", load) + (")" if who else "")
    return who


def caption(parts):
    return "<sub>Generated by `bench/tables.py` from " + "; ".join(parts) + ".</sub>"


def source_line(heads):
    parts = []
    for name, doc in heads:
        how = "%s page cache, median of %d run%s" % (
            doc["cache"], doc["repeat"], "" if doc["repeat"] == 1 else "s")
        busy = conditions(doc)
        parts.append("`bench/results/%s`: %s; %s; %s%s" % (
            name, machine(doc), doc["date"], how, "; " + busy if busy else ""))
    return caption(parts)


def render(opts):
    try:
        args = dict(a.split("=", 1) for a in shlex.split(opts))
    except ValueError as e:
        raise Bad("marker %r: %s (options are KEY=VALUE)" % (opts.strip(), e))
    layout = args.get("layout", "rows")
    allowed = OPTIONS.get(layout, OPTIONS["rows"])
    unknown = set(args) - allowed
    if unknown or "file" not in args or "cols" not in args:
        raise Bad("marker %r: needs file= and cols=; unknown options %s"
                  % (opts.strip(), sorted(unknown)))
    if layout == "lora":
        return render_lora(args, opts)
    if layout == "remote":
        return render_remote(args, opts)
    rows, heads = load(args["file"].split(","))
    keep = rows
    if "kinds" in args:
        keep = [r for r in keep if r["kind"] in args["kinds"].split(",")]
    if "data" in args:
        keep = [r for r in keep if os.path.basename(r["data"]) in args["data"].split(",")]
    cols = parse_cols(args["cols"])
    if layout == "rows":
        if "tools" in args:
            keep = [r for r in keep if r["tool"] in args["tools"].split(",")]
        table = rows_table(rows, keep, cols)
    elif layout == "pivot":
        table = pivot_table(rows, keep, cols)
    else:
        raise Bad("marker %r: layout is rows, pivot, lora or remote" % opts.strip())
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
        elif metric == "bytes" and tools:
            header.append(head or tools)
            align.append("r")
        elif metric in METRICS and tools:
            header.append(head or "%s, %s" % (HEADERS[metric], command(tools)))
            align.append("r")
        elif metric == "ratio" and len(tools.split("/")) == 2:
            a, b = tools.split("/")
            header.append(head or "%s / %s" % (command(a), command(b)))
            align.append("r")
        else:
            raise Bad("unknown pivot column %r (model, input, size, cache, field:K, bytes:K, ratio:A/B, "
                      "METRIC:TOOL with METRIC one of %s)" % (name, ", ".join(METRICS)))
    def missing(first, tool):
        """What a cell says for a tool with no result for this input: "failed" or
        "skipped" (the row run.py kept instead), else "–" (a file without that row);
        a tool that no file of the marker has is a mistake in the marker."""
        if not any(c["tool"] == tool for c in rows):
            raise Bad("no file of the marker has a %r row" % tool)
        why = next((c["skipped"] for c in rows if c["_file"] == first["_file"]
                    and c["data"] == first["data"] and c["kind"] == first["kind"]
                    and c["tool"] == tool and "skipped" in c), None)
        if why is None:
            return "–"
        return "failed" if why.startswith("failed") else "skipped"

    lines = []
    for (fname, data, kind), first in inputs:
        cells = []
        for name, _ in cols:
            metric, _, tools = name.partition(":")
            if metric == "field":
                cells.append(field(first, tools))
            elif metric == "bytes":
                n = int(field(first, tools))
                cells.append("%.1f MB" % (n / 1e6) if n < 10e6 else fmt_bytes(n))
            elif not tools:
                cells.append(COLUMNS[metric](rows, first))
            elif metric == "ratio":
                pair = tools.split("/")
                a, b = (peer(rows, first, t) for t in pair)
                if a is None or b is None:
                    cells.append(missing(first, pair[0] if a is None else pair[1]))
                    continue
                cells.append("%.2f" % (a["wall"] / b["wall"]))
            else:
                vals = []
                for tool in tools.split("+"):
                    r = peer(rows, first, tool)
                    vals.append(missing(first, tool) if r is None else METRICS[metric](rows, r))
                if metric == "rss" and len(vals) > 1:
                    unit = vals[0].split()[-1]
                    if all(v.endswith(" " + unit) for v in vals):
                        vals = [v.split()[0] for v in vals[:-1]] + [vals[-1]]
                unit = UNITS.get(metric, "") if any(v[:1].isdigit() for v in vals) else ""
                cells.append(" / ".join(vals) + unit)
        lines.append(cells)
    return markdown(header, align, lines)


OPTIONS = {
    "rows": {"file", "kinds", "tools", "data", "layout", "cols"},
    "pivot": {"file", "kinds", "tools", "data", "layout", "cols"},
    "lora": {"file", "tools", "layout", "cols"},
    "remote": {"file", "match", "layout", "cols"},
}


def load_doc(name, keys, writer):
    path = os.path.join(RESULTS, name)
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, ValueError) as e:
        raise Bad("cannot read %s: %s" % (path, e))
    for key in keys:
        if key not in doc:
            raise Bad("%s has no %r: write it with %s --json" % (path, key, writer))
    return doc


def median(xs):
    xs = sorted(xs)
    mid = len(xs) // 2
    return xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2


def other_line(heads, how):
    """The line under a lora or remote table: each file, its machine, date, how the
    figures were taken (how(doc)) and how busy the machine was."""
    parts = []
    for name, doc in heads:
        busy = conditions(doc)
        parts.append("`bench/results/%s`: %s; %s; %s%s" % (
            name, machine(doc), doc["date"], how(doc), "; " + busy if busy else ""))
    return caption(parts)


def check_cols(cols, known, layout):
    for name, _ in cols:
        base = name.split(":", 1)[0] + (":" if ":" in name else "")
        if name not in known and base not in known:
            raise Bad("unknown %s column %r (one of %s)" % (layout, name, ", ".join(sorted(known))))


# layout=lora: bench/lora.py's JSON. One row per command (plain merge of the base,
# the fuse, peft once), from the file's medians.
LORA_COMMANDS = {
    "plain": "plain merge of the base (`unshard merge BASE`)",
    "lora": "fuse the adapter (`unshard merge ADAPTER --base BASE`)",
    "peft": "peft `merge_and_unload` + `save_pretrained`",
}
LORA_HEADERS = {
    "date": "run", "output": "output to", "command": "command", "runs": "runs",
    "wall": "wall s", "cpu": "CPU s", "rss": "peak RSS", "xplain": "wall / plain merge's",
    "peftmem": "peft's peak RSS / this", "load": "load average at end (1, 5, 15 min)",
}


def lora_output(doc, tool):
    if tool == "peft":
        return "`%s`" % doc["runs"]["peft"][0].get("output", "?")
    cmd = doc["commands"][tool]
    for flag in ("-o", "--output"):
        if flag in cmd:
            return "`%s`" % cmd[cmd.index(flag) + 1]
    return "?"


def lora_cell(name, doc, tool):
    med = doc["median"]
    m = med[tool]
    if name == "date":
        return doc["date"]
    if name == "output":
        return lora_output(doc, tool)
    if name == "command":
        return LORA_COMMANDS[tool]
    if name == "runs":
        return str(len(doc["runs"][tool]))
    if name == "wall":
        return "%.2f" % m["wall_s"]
    if name == "cpu":
        # Files before 2026-12-01 23:00 have no CPU times.
        return "%.2f" % m["cpu_s"] if "cpu_s" in m else "not recorded"
    if name == "rss":
        return fmt_bytes(m["peak_rss"])
    if name == "xplain":
        return "%.2fx" % (m["wall_s"] / med["plain"]["wall_s"])
    if name == "peftmem":
        if tool == "peft" or "peft" not in med:
            return ""
        return "%.1fx" % (med["peft"]["peak_rss"] / m["peak_rss"])
    if name == "load":
        return " / ".join("%.1f" % x for x in doc["load_average_at_end"])
    raise Bad("unknown lora column %r" % name)


def render_lora(args, opts):
    cols = parse_cols(args["cols"])
    check_cols(cols, LORA_HEADERS, "lora")
    tools = args.get("tools", "plain,lora,peft").split(",")
    heads, lines = [], []
    for name in args["file"].split(","):
        doc = load_doc(name, ("machine", "date", "commands", "runs", "median",
                              "load_average_at_end"), "bench/lora.py")
        for t in ("plain", "lora"):
            if t not in doc["median"]:
                raise Bad("%s has no %r row" % (name, t))
        heads.append((name, doc))
        for tool in tools:
            if tool not in LORA_COMMANDS:
                raise Bad("marker %r: tools are plain, lora, peft" % opts.strip())
            if tool in doc["median"]:
                lines.append([lora_cell(n, doc, tool) for n, _ in cols])
    if not lines:
        raise Bad("marker %r: no results match" % opts.strip())
    header = [h or LORA_HEADERS[n] for n, h in cols]
    align = ["l" if n in ("date", "output", "command") else "r" for n, _ in cols]

    def how(doc):
        n = {t: len(r) for t, r in doc["runs"].items()}
        each = ("%d runs each" % n["plain"] if n["plain"] == n["lora"]
                else "%d and %d runs" % (n["plain"], n["lora"]))
        peft = ""
        if "peft" in n:
            peft = "; peft once" if n["peft"] == 1 else "; peft %d runs" % n["peft"]
        return "page cache warm; plain merge and fuse interleaved, medians of %s%s" % (each, peft)
    return markdown(header, align, lines) + "\n\n" + other_line(heads, how) + "\n"


# layout=remote: bench/remote.py's JSON. One row per row of the file (match=REGEX
# keeps the rows whose name it finds).
REMOTE_HEADERS = {
    "row": "what ran", "wall": "wall s", "runs": "runs, s", "gets": "GETs",
    "rss": "peak RSS", "rss_med": "peak RSS, median", "rss_sum": "peak RSS, sum over the parts", "cpu": "CPU s",
    "parts": "processes", "xrow:": "x %s",
}


def remote_peer(doc, prefix, name):
    hits = [r for r in doc["results"] if r["row"].startswith(prefix)]
    if len(hits) != 1:
        raise Bad("%s: %d rows start with %r (column xrow:PREFIX needs one)"
                  % (name, len(hits), prefix))
    return hits[0]


def remote_cell(col, r, doc, name):
    if col == "row":
        return r["row"]
    if col == "wall":
        return "%.2f" % r["wall"]
    if col == "runs":
        return ", ".join("%.2f" % w for w in r["walls"])
    if col == "gets":
        return "%.0f" % r["gets"] if r.get("gets") is not None else ""
    if col == "rss":
        # remote.py keeps the largest peak over the runs (of the largest part).
        return fmt_bytes(r["rss"]) if r.get("rss") else ""
    if col == "rss_med":
        if "rss_median" not in r:
            raise Bad("%s: row %r has no rss_median (bench/remote.py before it kept one)"
                      % (name, r["row"]))
        return fmt_bytes(r["rss_median"]) if r["rss_median"] else ""
    if col == "rss_sum":
        return fmt_bytes(r["rss_sum"]) if "rss_sum" in r else ""
    if col == "cpu":
        return "%.2f" % median(r["cpu"]) if "cpu" in r else ""
    if col == "parts":
        return str(r.get("parts", 1))
    if col.startswith("xrow:"):
        return "%.2f" % (r["wall"] / remote_peer(doc, col[5:], name)["wall"])
    raise Bad("unknown remote column %r" % col)


def render_remote(args, opts):
    cols = parse_cols(args["cols"])
    check_cols(cols, REMOTE_HEADERS, "remote")
    match = re.compile(args.get("match", ""))
    heads, lines = [], []
    for name in args["file"].split(","):
        doc = load_doc(name, ("machine", "date", "repeat", "results"), "bench/remote.py")
        heads.append((name, doc))
        for r in doc["results"]:
            if match.search(r["row"]):
                lines.append([remote_cell(c, r, doc, name) for c, _ in cols])
    if not lines:
        raise Bad("marker %r: no results match" % opts.strip())
    header = [h or (REMOTE_HEADERS["xrow:"] % n[5:] if n.startswith("xrow:")
                    else REMOTE_HEADERS[n]) for n, h in cols]
    align = ["l" if n == "row" else "r" for n, _ in cols]

    def how(doc):
        how = "median of %d interleaved runs; peak RSS the largest over the runs" % doc["repeat"]
        if any(n == "rss_med" for n, _ in cols):
            how += " (and their median)"
        if "cache" in doc:
            how = "%s page cache; %s" % (doc["cache"], how)
        if "server" in doc:
            how += "; %s" % doc["server"]
        return how
    return markdown(header, align, lines) + "\n\n" + other_line(heads, how) + "\n"


def rendered(text):
    def one(m):
        return "<!-- bench:%s-->\n%s<!-- /bench -->" % (m.group("opts"), render(m.group("opts")))
    return MARKER.sub(one, text)


def documents():
    """README.md and docs/*.md: every file whose tables this script keeps."""
    root = os.path.dirname(HERE)
    docs = os.path.join(root, "docs")
    names = sorted(f for f in os.listdir(docs) if f.endswith(".md")) if os.path.isdir(docs) else []
    return [README] + [os.path.join(docs, f) for f in names]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true",
                    help="fail when a document differs from what the results say")
    ap.add_argument("--readme", action="append", metavar="FILE",
                    help="the document(s) to render (default README.md and docs/*.md)")
    args = ap.parse_args()
    root = os.path.dirname(HERE)
    differ, n = [], 0
    if not args.readme:
        for path in REQUIRED:
            if not os.path.exists(path):
                sys.exit("bench/tables.py: %s is missing" % os.path.relpath(path, root))
    for path in args.readme or documents():
        with open(path) as f:
            text = f.read()
        try:
            new = rendered(text)
        except Bad as e:
            sys.exit("bench/tables.py: %s: %s" % (os.path.relpath(path, root), e))
        found = len(MARKER.findall(text))
        if path in REQUIRED and not found:
            sys.exit("bench/tables.py: %s has no table (a <!-- bench: ... --> marker pair)"
                     % os.path.relpath(path, root))
        n += found
        if new == text:
            continue
        name = os.path.relpath(path, root)
        differ.append(name)
        if args.check:
            sys.stdout.writelines(difflib.unified_diff(
                text.splitlines(True), new.splitlines(True), name, "from bench/results"))
        else:
            with open(path, "w") as f:
                f.write(new)
    if args.check:
        if differ:
            sys.exit("bench/tables.py: the performance tables of %s differ from "
                     "bench/results/ (run python3 bench/tables.py)" % ", ".join(differ))
        print("bench/tables.py: %d table(s) match bench/results/" % n)
        return
    print("bench/tables.py: %d table(s), %d rewritten" % (n, len(differ)))


if __name__ == "__main__":
    main()
