#!/usr/bin/env python
"""Object storage and --part benchmarks (docs/remote.md).

1. Merge from a local S3 server (moto_server, started here on a loopback port) and
   compare with a plain ranged download of the same bytes from the same server by
   boto3 with its default concurrency (TransferConfig(): 10 threads, 8 MiB parts).
   Rows are interleaved, each repeated; medians are reported. Peak RSS of each row
   (ru_maxrss of the child) and the GET requests the server logged are reported.
   The commands run under GNU time where it is installed (run.py's spawn(), shared
   with run.py's measure()): a child forked from this script would count this
   script's pages (about 50 MB with boto3 loaded) in its peak.
   Two more rows tell the server's cost apart from the client's: boto3 making
   unshard's requests (one GET per 16 MiB span, 32 in flight), and 20 ranged GETs
   of 4 KiB one after another (the cost of a request on this server, whatever its
   size); --skip-diagnostics leaves them out.
   Several builds compare side by side in one run: give --unshard once per build,
   as LABEL=PATH, and --env LABEL:NAME=VALUE for a variable set for one of them
   only (the same binary may appear under two labels with different variables).
   Each gets its own rows ("unshard merge from S3 (LABEL)"), interleaved with the
   others, in an order that rotates from round to round.
2. `--part I/N` over N local processes run at once against one process, same
   output (on the inputs' disk), rows interleaved: the wall time from the first
   start to the last exit, each part's own wall time and peak RSS (the largest
   part's and the sum over the parts). Two rows tell the fixed costs apart: a part
   that owns no shard (part 63 of 64, run alone: open and plan only), and the same
   part run after parts 0-62 finished, so that it finds every done-marker and
   commits (open, plan and commit). With --warm the inputs are read into the page
   cache before every row.

Input: a directory written by bench/gen.py (uses base/ and policy.pt, or --input):

  /work/venv/bin/python bench/gen.py --out /tmp/bench-4l --layers 4 --kinds policy
  /work/venv/bin/python bench/remote.py --data /tmp/bench-4l --unshard target/release/unshard \\
      --json bench/results/remote.json
  python3 bench/remote.py --data /tmp/bench-4l --skip-diagnostics --repeat 3 \\
      --unshard old=/tmp/unshard-old --unshard new=target/release/unshard \\
      --unshard "new 128 MiB=target/release/unshard" \\
      --env "new 128 MiB:UNSHARD_REMOTE_AHEAD_MIB=128" --json bench/results/compare.json
  python3 bench/remote.py --data /data/bench/tinyllama-22l --skip-s3 --parts 1,2,4 --warm \\
      --json bench/results/parts.json --note "how the machine was shared"

With --skip-s3 only the --part rows run (moto_server is still started); they use
the first --unshard.

Needs boto3 and moto[server] (pip install 'moto[server]').
"""

import argparse
import datetime
import glob
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

from run import du, machine, reaped, read_all, rss_method, spawn


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def concurrent(cmds):
    """Starts every command at once; returns (wall seconds from the first start to the
    last exit, [(own wall seconds, peak RSS bytes, CPU seconds) per command])."""
    t = time.perf_counter()
    procs = [spawn(c) for c in cmds]
    each = [None] * len(procs)

    def reap(i):
        code, rss, cpu, err = reaped(*procs[i])
        each[i] = (time.perf_counter() - t, rss, code, cpu, err)

    threads = [threading.Thread(target=reap, args=(i,)) for i in range(len(procs))]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    wall = time.perf_counter() - t
    for c, (_, _, code, _, err) in zip(cmds, each):
        if code != 0:
            sys.exit(f"failed: {' '.join(c)}\n{err.decode(errors='replace')}")
    return wall, [(w, rss, cpu) for w, rss, _, cpu, _ in each]


def timed(cmd, env=None):
    """Runs cmd; returns (wall seconds, peak RSS bytes of the command)."""
    t = time.perf_counter()
    code, rss, _, err = reaped(*spawn(cmd, env))
    wall = time.perf_counter() - t
    if code != 0:
        sys.exit(f"failed: {' '.join(cmd)}\n{err.decode(errors='replace')}")
    return wall, rss


class ServerLog:
    """Counts the GET requests moto_server logged (werkzeug writes one line each)."""

    def __init__(self, path):
        self.path = path

    def gets(self):
        with open(self.path, errors="replace") as f:
            return sum(1 for ln in f if '"GET /bench/' in ln)


PATTERN = """
import boto3, sys
from concurrent.futures import ThreadPoolExecutor
endpoint, size, span, inflight = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
s3 = boto3.client("s3", endpoint_url=endpoint)
def get(start):
    end = min(size, start + span) - 1
    return len(s3.get_object(Bucket="bench", Key="policy.pt", Range=f"bytes={start}-{end}")["Body"].read())
with ThreadPoolExecutor(inflight) as ex:
    assert sum(ex.map(get, range(0, size, span))) == size
"""

SMALL_GETS = """
import boto3, sys
s3 = boto3.client("s3", endpoint_url=sys.argv[1])
for i in range(20):
    s3.get_object(Bucket="bench", Key="policy.pt", Range=f"bytes={i * 4096}-{i * 4096 + 4095}")["Body"].read()
"""


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True, help="a bench/gen.py directory")
    ap.add_argument("--unshard", action="append",
                    help="[LABEL=]PATH of a build; repeat to compare builds side by side "
                    "(default target/release/unshard)")
    ap.add_argument("--env", action="append", default=[],
                    help="LABEL:NAME=VALUE, set for that --unshard's commands only")
    ap.add_argument("--skip-diagnostics", action="store_true",
                    help="leave out the rows of boto3 making unshard's requests and of "
                    "20 small GETs")
    ap.add_argument("--parts", default="", help="part counts for the --part rows (e.g. 2,4)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--skip-s3", action="store_true", help="only the --part rows")
    ap.add_argument("--input", default="policy.pt",
                    help="the checkpoint inside --data for the --part rows (policy.pt, dcp, ranks)")
    ap.add_argument("--max-shard-size", default="200MB",
                    help="output shard size for the --part rows (parts are dealt whole shards)")
    ap.add_argument("--warm", action="store_true",
                    help="read the inputs into the page cache before every --part row")
    ap.add_argument("--note", help="how the machine was shared etc., kept in the JSON")
    args = ap.parse_args()
    data = os.path.abspath(args.data)
    builds = []  # (label, absolute path, extra environment)
    for spec in args.unshard or ["target/release/unshard"]:
        label, eq, path = spec.partition("=")
        if not eq:
            label, path = "", spec
        if any(label == b[0] for b in builds):
            sys.exit(f"--unshard {spec}: the label {label!r} is given twice")
        builds.append((label, os.path.abspath(path), {}))
    if len(builds) > 1 and not all(b[0] for b in builds):
        sys.exit("--unshard: with several builds, give each as LABEL=PATH")
    for spec in args.env:
        label, colon, var = spec.partition(":")
        name, eq, value = var.partition("=")
        hit = [b for b in builds if b[0] == label]
        if not (colon and eq and name and hit):
            sys.exit(f"--env {spec}: expected LABEL:NAME=VALUE with LABEL one of the --unshard labels")
        hit[0][2][name] = value
    for _, path, _ in builds:
        if not os.access(path, os.X_OK):
            sys.exit(f"--unshard: {path} is not an executable")
    unshard = builds[0][1]

    def labelled(row, label):
        return f"{row} ({label})" if label else row
    moto = shutil.which("moto_server") or os.path.join(os.path.dirname(sys.executable), "moto_server")
    moto_version = subprocess.run([sys.executable, "-c", "import moto; print(moto.__version__)"],
                                  capture_output=True, text=True).stdout.strip()

    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    logdir = tempfile.mkdtemp()
    log = ServerLog(os.path.join(logdir, "moto.log"))
    server = subprocess.Popen([moto, "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=open(log.path, "w"))
    try:
        for _ in range(100):
            try:
                urllib.request.urlopen(endpoint + "/")
                break
            except Exception:
                time.sleep(0.1)
        env = dict(os.environ, AWS_ENDPOINT_URL=endpoint, AWS_ALLOW_HTTP="true",
                   AWS_ACCESS_KEY_ID="test", AWS_SECRET_ACCESS_KEY="test", AWS_REGION="us-east-1")
        os.environ.update({k: env[k] for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION")})
        import boto3

        policy = os.path.join(data, "policy.pt")
        if not args.skip_s3:
            s3 = boto3.client("s3", endpoint_url=endpoint)
            s3.create_bucket(Bucket="bench")
            s3.upload_file(policy, "bench", "policy.pt")
            for name in os.listdir(os.path.join(data, "base")):
                s3.upload_file(os.path.join(data, "base", name), "bench", f"base/{name}")
        size = os.path.getsize(policy)
        rows = {}

        def record(name, cmd, env=env, extra=None):
            before = log.gets()
            w, rss = timed(cmd, dict(env, **extra) if extra else env)
            r = rows.setdefault(name, {"walls": [], "rss": [], "gets": []})
            r["walls"].append(w)
            r["rss"].append(rss)
            r["gets"].append(log.gets() - before)

        with tempfile.TemporaryDirectory(dir=os.path.dirname(data)) as tmp:
            dl = os.path.join(tmp, "download.pt")
            down_script = (
                "import boto3,sys; from boto3.s3.transfer import TransferConfig;"
                f"boto3.client('s3', endpoint_url='{endpoint}').download_file('bench','policy.pt',sys.argv[1], Config=TransferConfig())"
            )
            for i in range(0 if args.skip_s3 else args.repeat):
                record("boto3 download_file (default TransferConfig: 10 threads, 8 MiB)",
                       [sys.executable, "-c", down_script, dl])
                os.remove(dl)
                out = os.path.join(tmp, f"out{i}")
                # The builds in an order that rotates from round to round.
                order = builds[i % len(builds):] + builds[:i % len(builds)]
                for label, exe, extra in order:
                    record(labelled("unshard merge from S3", label),
                           [exe, "merge", "s3://bench/policy.pt", "--base", "s3://bench/base",
                            "-o", out, "-q"], extra=extra)
                    shutil.rmtree(out)
                if not args.skip_diagnostics:
                    record("boto3 with unshard's requests (16 MiB GETs, 32 in flight)",
                           [sys.executable, "-c", PATTERN, endpoint, str(size), str(16 << 20), "32"])
                    record("boto3, 20 ranged GETs of 4 KiB one after another",
                           [sys.executable, "-c", SMALL_GETS, endpoint])
                for label, exe, extra in order:
                    record(labelled("unshard merge from local disk", label),
                           [exe, "merge", policy, "--base", os.path.join(data, "base"), "-o", out,
                            "-q"], extra=extra)
                    shutil.rmtree(out)
            # --part: N processes at once against one, rows interleaved, and what
            # every part pays besides its share of the bytes: opening the inputs and
            # planning (a part of 64 that gets no shard), and the commit (the same
            # part, run after the other 63 finished, finds every marker and commits).
            src = os.path.join(data, args.input)
            base = os.path.join(data, "base")
            shard = args.max_shard_size

            def part_cmd(out, k, n):
                cmd = [unshard, "merge", src, "--base", base, "-o", out, "-q",
                       "--max-shard-size", shard]
                return cmd + (["--part", f"{k}/{n}"] if n else [])

            def warm():
                if args.warm:
                    read_all(src)
                    read_all(base)
                subprocess.run(["sync"], check=True)

            counts = [int(x) for x in args.parts.split(",") if x]
            for i in range(args.repeat if counts else 0):
                out = os.path.join(tmp, "open-only")
                warm()
                name = f"open and plan only (part 63/64, no shard of its own; {shard} shards)"
                load = os.getloadavg()[0]
                record(name, part_cmd(out, 63, 64))
                rows[name].setdefault("load", []).append(load)
                # Its done-marker stays in the staging directory beside the output:
                # removed, or part 62 below would find every marker and commit.
                for stage in glob.glob(os.path.join(tmp, ".open-only.unshard-parts-*")):
                    shutil.rmtree(stage)
                assert not os.path.exists(out), out
                for k in range(63):
                    timed(part_cmd(out, k, 64))
                assert not os.path.exists(out), "committed before part 63 ran"
                warm()
                name = f"open, plan and commit (part 63/64 after parts 0-62; {shard} shards)"
                load = os.getloadavg()[0]
                record(name, part_cmd(out, 63, 64))
                rows[name].setdefault("load", []).append(load)
                assert os.path.exists(os.path.join(out, "model.safetensors.index.json")), out
                shutil.rmtree(out)
                for n in counts:
                    out = os.path.join(tmp, f"parts{n}-{i}")
                    warm()
                    load = os.getloadavg()[0]
                    if n == 1:
                        name = f"one process, no --part ({shard} shards)"
                        w, each = concurrent([part_cmd(out, 0, None)])
                    else:
                        name = f"--part over {n} local processes at once ({shard} shards)"
                        w, each = concurrent([part_cmd(out, k, n) for k in range(n)])
                    assert os.path.exists(os.path.join(out, "model.safetensors.index.json")), out
                    r = rows.setdefault(name, {"walls": [], "rss": [], "gets": [],
                                               "part_walls": [], "part_rss": [], "load": [],
                                               "cpu": []})
                    r["walls"].append(w)
                    r["rss"].append(max(rss for _, rss, _ in each))
                    r["part_walls"].append([pw for pw, _, _ in each])
                    r["part_rss"].append([rss for _, rss, _ in each])
                    r["cpu"].append(sum(cpu for _, _, cpu in each))
                    r["load"].append(load)
                    shutil.rmtree(out)
        print(f"input: {policy} ({size / 1e9:.2f} GB), moto {moto_version} at {endpoint}; medians of {args.repeat}")
        if args.parts:
            print(f"--part rows: {src} ({du(src) / 1e9:.2f} GB)")
        results = []
        for name, r in rows.items():
            wall = statistics.median(r["walls"])
            rss = max(r["rss"]) if r["rss"] else 0
            rss_median = statistics.median(r["rss"]) if r["rss"] else 0
            gets = statistics.median(r["gets"]) if r["gets"] else None
            mem = f"{rss / 2**20:6.0f} MiB" if rss else "      -"
            g = f"{gets:5.0f} GETs" if gets is not None else ""
            med = f" (median {rss_median / 2**20:4.0f})" if rss else ""
            print(f"{name:66s} {wall:7.2f} s  peak RSS {mem}{med}  {g}")
            res = dict(row=name, wall=wall, walls=r["walls"], rss=rss,
                       rss_median=rss_median, rss_each=r["rss"],
                       gets=gets, gets_each=r["gets"])
            if "part_rss" in r:
                # Peak RSS: the largest part's (rss, max over runs), and the sum of
                # the parts' peaks (what N processes held at most, together).
                res.update(parts=len(r["part_rss"][0]), part_walls=r["part_walls"],
                           part_rss=r["part_rss"],
                           rss_sum=max(sum(x) for x in r["part_rss"]))
                print(f"{'':66s} sum of the parts' peak RSS {res['rss_sum'] / 2**20:6.0f} MiB")
            if "cpu" in r:
                # User plus system CPU seconds of all the parts together, per run: on
                # a shared machine, what the work cost apart from the CPU share it got.
                res["cpu"] = r["cpu"]
                print(f"{'':66s} CPU seconds (user+sys, all parts) {statistics.median(r['cpu']):6.2f}")
            if "load" in r:
                res["load_1min"] = r["load"]
            results.append(res)
        if args.json:
            with open(args.json, "w") as f:
                doc = dict(machine=machine(),
                           note=args.note or "a shared machine (other builds running); "
                           "walls are medians of interleaved runs",
                           date=datetime.date.today().isoformat(),
                           load_1min_at_end=os.getloadavg()[0], peak_rss=rss_method())
                if not args.skip_s3:
                    doc.update(server=f"moto_server {moto_version} on loopback",
                               input=dict(path=policy, bytes=size))
                if len(builds) > 1:
                    doc.update(builds=[dict(label=lb, path=exe, env=extra)
                                       for lb, exe, extra in builds])
                if args.parts:
                    doc.update(parts_input=dict(path=src, bytes=du(src)),
                               max_shard_size=shard, cache="warm" if args.warm else "as left",
                               unshard=unshard)
                json.dump(dict(doc,
                               repeat=args.repeat, results=results), f, indent=2)
                f.write("\n")
    finally:
        server.terminate()
        server.wait()
        shutil.rmtree(logdir, ignore_errors=True)


if __name__ == "__main__":
    main()
