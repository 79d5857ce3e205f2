#!/usr/bin/env python
"""Object storage and --part benchmarks (docs/remote.md).

1. Merge from a local S3 server (moto_server, started here on a loopback port) and
   compare with a plain ranged download of the same bytes from the same server by
   boto3 with its default concurrency (TransferConfig(): 10 threads, 8 MiB parts).
   Rows are interleaved, each repeated; medians are reported. Peak RSS of each row
   (ru_maxrss of the child) and the GET requests the server logged are reported.
   Two more rows tell the server's cost apart from the client's: boto3 making
   unshard's requests (one GET per 16 MiB span, 32 in flight), and 20 ranged GETs
   of 4 KiB one after another (the cost of a request on this server, whatever its
   size).
2. `--part I/N` over N local processes against one process, same output.

Input: a directory written by bench/gen.py (uses policy.pt and base/):

  /work/venv/bin/python bench/gen.py --out /tmp/bench-4l --layers 4 --kinds policy
  /work/venv/bin/python bench/remote.py --data /tmp/bench-4l --unshard target/release/unshard \\
      --json bench/results/remote.json

Needs boto3 and moto[server] (pip install 'moto[server]').
"""

import argparse
import datetime
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def timed(cmd, env=None):
    """Runs cmd; returns (wall seconds, peak RSS bytes of the child)."""
    t = time.perf_counter()
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, ru = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t
    err = p.stderr.read().decode(errors="replace")
    if os.waitstatus_to_exitcode(status) != 0:
        sys.exit(f"failed: {' '.join(cmd)}\n{err}")
    return wall, ru.ru_maxrss * 1024


def machine():
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    with open("/proc/meminfo") as f:
        mem = int(f.readline().split()[1]) * 1024
    return "%s, %d cores, %.0f GB RAM, Linux %s" % (cpu, os.cpu_count(), mem / 2**30,
                                                  platform.release())


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
    ap.add_argument("--unshard", default="target/release/unshard")
    ap.add_argument("--parts", default="", help="part counts for the --part rows (e.g. 2,4)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--skip-s3", action="store_true", help="only the --part rows")
    args = ap.parse_args()
    data = os.path.abspath(args.data)
    unshard = os.path.abspath(args.unshard)
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

        def record(name, cmd, env=env):
            before = log.gets()
            w, rss = timed(cmd, env)
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
                record("unshard merge from S3",
                       [unshard, "merge", "s3://bench/policy.pt", "--base", "s3://bench/base", "-o", out, "-q"])
                shutil.rmtree(out)
                record("boto3 with unshard's requests (16 MiB GETs, 32 in flight)",
                       [sys.executable, "-c", PATTERN, endpoint, str(size), str(16 << 20), "32"])
                record("boto3, 20 ranged GETs of 4 KiB one after another",
                       [sys.executable, "-c", SMALL_GETS, endpoint])
                record("unshard merge from local disk",
                       [unshard, "merge", policy, "--base", os.path.join(data, "base"), "-o", out, "-q"])
                shutil.rmtree(out)
            # --part: N processes at once against one, and what every part pays
            # before its share of the bytes (opening the inputs and planning): a
            # part of 64 that gets no shard.
            for i in range(args.repeat if args.parts else 0):
                out = os.path.join(tmp, "open-only")
                record("open and plan only (part 63/64, no shard of its own)",
                       [unshard, "merge", policy, "--base", os.path.join(data, "base"),
                        "-o", out, "-q", "--max-shard-size", "200MB", "--part", "63/64"])
            for n in [int(x) for x in args.parts.split(",") if x]:
                for i in range(args.repeat):
                    out = os.path.join(tmp, f"parts{n}-{i}")
                    t = time.perf_counter()
                    procs = [subprocess.Popen([unshard, "merge", policy, "--base", os.path.join(data, "base"),
                                               "-o", out, "-q", "--max-shard-size", "200MB",
                                               "--part", f"{k}/{n}"]) for k in range(n)]
                    codes = [p.wait() for p in procs]
                    w = time.perf_counter() - t
                    assert all(c == 0 for c in codes), codes
                    r = rows.setdefault(f"--part over {n} local processes (200MB shards)",
                                        {"walls": [], "rss": [], "gets": []})
                    r["walls"].append(w)
                    shutil.rmtree(out)
                    record("one process (200MB shards)",
                           [unshard, "merge", policy, "--base", os.path.join(data, "base"),
                            "-o", out, "-q", "--max-shard-size", "200MB"])
                    shutil.rmtree(out)
        print(f"input: {policy} ({size / 1e9:.2f} GB), moto {moto_version} at {endpoint}; medians of {args.repeat}")
        results = []
        for name, r in rows.items():
            wall = statistics.median(r["walls"])
            rss = max(r["rss"]) if r["rss"] else 0
            gets = statistics.median(r["gets"]) if r["gets"] else None
            mem = f"{rss / 2**20:6.0f} MiB" if rss else "      -"
            g = f"{gets:5.0f} GETs" if gets is not None else ""
            print(f"{name:66s} {wall:7.2f} s  peak RSS {mem}  {g}")
            results.append(dict(row=name, wall=wall, walls=r["walls"], rss=rss,
                                gets=gets, gets_each=r["gets"]))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(dict(machine=machine(),
                               note="a shared machine (other builds running); walls are medians of interleaved runs",
                               date=datetime.date.today().isoformat(),
                               server=f"moto_server {moto_version} on loopback",
                               input=dict(path=policy, bytes=size),
                               repeat=args.repeat, results=results), f, indent=2)
                f.write("\n")
    finally:
        server.terminate()
        server.wait()
        shutil.rmtree(logdir, ignore_errors=True)


if __name__ == "__main__":
    main()
