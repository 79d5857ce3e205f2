#!/usr/bin/env python3
"""Where a merge of a DCP directory spends its wall time, sampled from /proc.

Runs `unshard merge DIR --base BASE` (page cache dropped first with --cache cold;
needs root) and every 20 ms notes which files the process holds open and the
bytes it has read (/proc/PID/io read_bytes: what came from the disk). Phases:
`metadata` (.metadata open), `scan` (more than 8 .distcp files open: the reader's,
not the read-ahead thread's few; no output yet), `write` (the output file open, to
the end, fsync included); `read_99` is when the disk had delivered all but 1% of
the bytes the run read. For a checkpoint of more than 8 rank files.

  python3 bench/phases.py --unshard target/release/unshard --data /work/bench-data/wide \\
      --cache cold --json bench/results/DATE-phases.json
"""

import argparse
import datetime
import json
import os
import shutil
import subprocess
import time

from run import drop_caches, machine


def sample(cmd):
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    marks, samples = {}, []
    while p.poll() is None:
        t = time.perf_counter() - t0
        try:
            names = [os.readlink("/proc/%d/fd/%s" % (p.pid, f))
                     for f in os.listdir("/proc/%d/fd" % p.pid)]
            io = dict(ln.split(": ") for ln in open("/proc/%d/io" % p.pid).read().splitlines())
        except (OSError, ValueError):
            time.sleep(0.02)
            continue
        out = any("unshard-tmp" in n for n in names)
        # The read-ahead thread holds at most 5 rank files open; the reader all of them.
        data = sum(n.endswith(".distcp") for n in names) > 8
        meta = any(n.endswith(".metadata") for n in names)
        phase = "write" if out else "scan" if data else "metadata" if meta else None
        if phase and phase not in marks:
            marks[phase] = round(t, 2)
        samples.append((t, int(io["read_bytes"])))
        time.sleep(0.02)
    wall = time.perf_counter() - t0
    total = samples[-1][1] if samples else 0
    read = next((round(t, 2) for t, r in samples if r >= 0.99 * total), None)
    return dict(wall=round(wall, 2), starts=marks, read_99=read, read_bytes=total)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--unshard", action="append", required=True, metavar="[NAME=]PATH")
    ap.add_argument("--data", required=True, help="a directory written by gen_wide.py")
    ap.add_argument("--cache", choices=("cold", "warm"), default="cold")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--work", default="/tmp/unshard-phases")
    ap.add_argument("--json")
    ap.add_argument("--note")
    args = ap.parse_args()
    runs = []
    for rep in range(args.repeat):
        for spec in args.unshard:
            name, _, path = spec.rpartition("=")
            out = os.path.join(args.work, "out")
            shutil.rmtree(out, ignore_errors=True)
            if args.cache == "cold":
                drop_caches()
            cmd = [path, "merge", os.path.join(args.data, "dcp"), "--base",
                   os.path.join(args.data, "base"), "--output", out, "--dtype", "bfloat16",
                   "--quiet", "--force"]
            load = round(os.getloadavg()[0], 2)
            r = dict(build=name or path, run=rep + 1, load_1min=load, **sample(cmd))
            print(json.dumps(r), flush=True)
            runs.append(r)
            shutil.rmtree(out, ignore_errors=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(machine=machine(), cache=args.cache,
                           date=datetime.date.today().isoformat(),
                           **({"note": args.note} if args.note else {}),
                           data=os.path.abspath(args.data), runs=runs), f, indent=2)


if __name__ == "__main__":
    main()
