#!/usr/bin/env python
"""Object storage and --part benchmarks (docs/remote.md).

1. Merge from a local S3 server (moto_server, started here on a loopback port) and
   compare with a plain ranged download of the same bytes from the same server by
   boto3 with its default concurrency (TransferConfig(): 10 threads, 8 MiB parts).
   Peak RSS of both is reported (ru_maxrss of the child).
2. `--part I/N` over N local processes against one process, same output.

Input: a directory written by bench/gen.py (uses policy.pt and base/):

  /work/venv/bin/python bench/gen.py --out /tmp/bench-4l --layers 4 --kinds policy
  /work/venv/bin/python bench/remote.py --data /tmp/bench-4l --unshard target/release/unshard

Needs boto3 and moto[server] (pip install 'moto[server]').
"""

import argparse
import json
import os
import shutil
import socket
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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True, help="a bench/gen.py directory")
    ap.add_argument("--unshard", default="target/release/unshard")
    ap.add_argument("--parts", default="2,4", help="part counts for the --part rows")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    data = os.path.abspath(args.data)
    unshard = os.path.abspath(args.unshard)
    moto = shutil.which("moto_server") or os.path.join(os.path.dirname(sys.executable), "moto_server")

    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([moto, "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
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
        from boto3.s3.transfer import TransferConfig

        s3 = boto3.client("s3", endpoint_url=endpoint)
        s3.create_bucket(Bucket="bench")
        policy = os.path.join(data, "policy.pt")
        s3.upload_file(policy, "bench", "policy.pt")
        for name in os.listdir(os.path.join(data, "base")):
            s3.upload_file(os.path.join(data, "base", name), "bench", f"base/{name}")
        size = os.path.getsize(policy)
        rows = []
        with tempfile.TemporaryDirectory(dir=os.path.dirname(data)) as tmp:
            dl = os.path.join(tmp, "download.pt")
            down_script = (
                "import boto3,sys; from boto3.s3.transfer import TransferConfig;"
                f"boto3.client('s3', endpoint_url='{endpoint}').download_file('bench','policy.pt',sys.argv[1], Config=TransferConfig())"
            )
            for i in range(args.repeat):
                w, rss = timed([sys.executable, "-c", down_script, dl], env)
                rows.append(("boto3 download (default TransferConfig)", w, rss))
                os.remove(dl)
                out = os.path.join(tmp, f"out{i}")
                w, rss = timed([unshard, "merge", "s3://bench/policy.pt", "--base", "s3://bench/base",
                                "-o", out, "-q"], env)
                rows.append(("unshard merge from S3", w, rss))
                shutil.rmtree(out)
                w, rss = timed([unshard, "merge", policy, "--base", os.path.join(data, "base"),
                                "-o", out, "-q"], env)
                rows.append(("unshard merge from local disk", w, rss))
                shutil.rmtree(out)
            # --part: N processes at once against one.
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
                    rows.append((f"--part over {n} local processes (200MB shards)", w, 0))
                    shutil.rmtree(out)
                    w, _ = timed([unshard, "merge", policy, "--base", os.path.join(data, "base"),
                                  "-o", out, "-q", "--max-shard-size", "200MB"], env)
                    rows.append(("one process (200MB shards)", w, 0))
                    shutil.rmtree(out)
        print(f"input: {policy} ({size / 1e9:.2f} GB), server {endpoint}")
        best = {}
        for name, w, rss in rows:
            b = best.get(name)
            if b is None or w < b[0]:
                best[name] = (w, rss)
        for name, (w, rss) in best.items():
            mem = f"{rss / 2**20:7.0f} MiB" if rss else "       -"
            print(f"{name:52s} {w:7.2f} s  {size / w / 1e6:8.0f} MB/s  peak RSS {mem}")
        print(json.dumps({k: {"seconds": v[0], "rss": v[1]} for k, v in best.items()}))
    finally:
        server.terminate()
        server.wait()


if __name__ == "__main__":
    main()
