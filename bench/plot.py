#!/usr/bin/env python3
"""Plots peak RSS and wall time against the number of DCP chunks, from the JSON that
bench/run.py --json writes for checkpoints of gen_wide.py (one line per command:
this build, the builds given to --compare, cp -r).

  python3 bench/plot.py bench/results/wide-cold.json --out bench/results/wide-scaling.png

Needs matplotlib; without it, says so and exits cleanly (status 0).
"""

import argparse
import json
import sys


def series(results, by_cache):
    """{command: [(chunks, wall s, peak RSS MB)]}, sorted by chunks; with by_cache,
    one line per command and cache (`unshard, cold`)."""
    out = {}
    for r in results:
        # run.py keeps the generator's fields in `model`; files before it in `meta`.
        meta = r.get("model") or r.get("meta") or {}
        if "chunks" not in meta or "wall" not in r:
            continue
        name = "%s, %s" % (r["tool"], r["_cache"]) if by_cache else r["tool"]
        out.setdefault(name, []).append((meta["chunks"], r["wall"], r["rss"] / 1e6))
    return {k: sorted(v) for k, v in out.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("json", nargs="+", help="results of bench/run.py --json")
    ap.add_argument("--out", required=True, help="the PNG to write")
    args = ap.parse_args()
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot written")
        return 0
    results, title = [], []
    for path in args.json:
        with open(path) as f:
            doc = json.load(f)
        results += [dict(r, _cache=doc["cache"]) for r in doc["results"]]
        title.append("%s cache, median of %d, %s" % (doc["cache"], doc["repeat"], doc["date"]))
    data = series(results, len({r["_cache"] for r in results}) > 1)
    if not data:
        print("no gen_wide.py results in %s: no plot written" % ", ".join(args.json))
        return 0
    fig, (rss, wall) = plt.subplots(1, 2, figsize=(10, 4))
    colors = {}
    for i, (tool, points) in enumerate(sorted(data.items())):
        x = [p[0] for p in points]
        command = tool.split(", ")[0]
        color = colors.setdefault(command, "grey" if command == "cp" else "C%d" % len(colors))
        style = "--" if tool.endswith(", warm") else "-"
        wall.plot(x, [p[1] for p in points], marker="o", label=tool, color=color,
                  linestyle=style)
        if command != "cp" and not tool.endswith(", warm"):
            rss.plot(x, [p[2] for p in points], marker="o", label=command, color=color)
    rss.axhline(200, color="grey", linestyle=":", linewidth=1)
    for ax, label in ((rss, "peak RSS (MB)"), (wall, "wall time (s)")):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("DCP chunks (gen_wide.py, 512 ranks)")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("unshard merge of DCP checkpoints by chunk count (%s)" % "; ".join(sorted(set(title))),
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(args.out, dpi=80)
    print("wrote %s" % args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
