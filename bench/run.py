#!/usr/bin/env python3
"""Measures unshard against cp and the Python pipeline, side by side in one run.

For every data directory written by gen.py (or gen_wide.py: one DCP directory of
many ranks, or with --kind ranks verl's per-rank files, to measure what grows with
the rank count; or gen_moe_wide.py: a policy.pt of a narrow DeepSeek-V3-shaped MoE
model in transformers' packed layout, onto a base of per-expert tensors, to measure
what grows with the tensor count) and every input kind in it
(policy.pt, the 4-rank DCP directory, the 4 verl rank files), runs back to back:

  read     read_floor.py: every input byte read once, 4 threads of 16 MiB reads
           (direct I/O when cold), nothing written: what reading alone costs
  cp       cp -r of the input: the yardstick for reading and writing those bytes
  unshard  unshard merge INPUT --base base --dtype bfloat16 (writes half the bytes cp does)
  inspect  unshard inspect INPUT --json: opening the checkpoint alone (only when
           asked for with --rows, beside the unshard rows)
  python   the Python pipeline (python_pipeline.py), where torch is installed:
           policy.pt and DCP only (per-rank files have no torch-only converter);
           for the DeepSpeed folders of gen_deepspeed.py, DeepSpeed's own
           zero_to_fp32.py --safe_serialization instead; for gen_titan.py's
           HF-sharded rank files, torch's consolidate_safetensors_files
           (torch_consolidate.py) at 1, 2 and 4 threads, and for its torchtitan
           checkpoint, torchtitan's own export to HF safetensors in bfloat16
           (titan_convert.py)

Each row runs --repeat times (rows interleaved, so noise hits them alike) and the
median is reported: wall time of the whole process, its ratio to cp's wall time
in the same run, and peak RSS (the kernel's ru_maxrss of the process, which counts
touched pages of mapped files; taken by GNU time, /usr/bin/time, so that it is the
command's own: without it, a note says that small processes read as large as this
script, and the JSON's `peak_rss` says how it was taken). `+sync` is the wall time plus the `sync` that
follows it: unshard fsyncs its output before it returns, cp and the Python
pipeline leave dirty pages for the kernel to write later.

With --cache cold (the default when run as root) the page cache is dropped before
every run, so inputs come from the disk; --cache warm reads the inputs first.

Needs only Python 3; torch only for the Python rows (use --python to name an
interpreter that has torch and transformers). Example:

  cargo build --release
  python3 bench/run.py --unshard target/release/unshard --python /work/venv/bin/python \\
      --data /work/bench-data/tinyllama-22l --data /work/bench-data/tinyllama-11l
"""

import argparse
import datetime
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

KINDS = (
    # kind, path inside the data dir, label, python pipeline mode
    ("policy", "policy.pt", "policy.pt (fp32)", "pt"),
    ("dcp", "dcp", "DCP, 4 ranks", "dcp"),
    ("ranks", "ranks", "verl ranks, 4 files", None),
    # gen_deepspeed.py: the Python row is DeepSpeed's own zero_to_fp32.py.
    ("zero2", "zero2", "DeepSpeed ZeRO-2, 4 ranks", "zero"),
    ("zero3", "zero3", "DeepSpeed ZeRO-3, 4 ranks", "zero"),
    # gen_titan.py: HuggingFaceStorageWriter(save_distributed=True) rank files; the
    # rows beside unshard are torch's consolidate_safetensors_files at 1, 2, 4 threads.
    ("hf_sharded", "hf_sharded", "HF-sharded safetensors, 4 ranks", "torch_consolidate"),
    # gen_titan.py: torchtitan's DCP checkpoint (float32) of the same weights; the row
    # beside unshard is torchtitan's own export to HF safetensors (titan_convert.py).
    ("titan", os.path.join("titan", "checkpoint", "step-1000"), "torchtitan DCP, 4 ranks",
     "titan_convert"),
)


def can_drop_caches():
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def drop_caches():
    subprocess.run(["sync"], check=True)
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def read_all(path):
    """Pulls a file or directory into the page cache."""
    paths = [path] if os.path.isfile(path) else [
        os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs]
    for p in paths:
        with open(p, "rb") as f:
            while f.read(16 << 20):
                pass


def du(path):
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


# Peak RSS. ru_maxrss of a process keeps the peak of the image that exec replaced,
# and a child forked from this script starts as a copy of it: read from wait4 here,
# a 2 MB `cp` would show this script's RSS at the fork (12-30 MB, more with boto3 or
# torch loaded). GNU time is a small process that forks the command itself, so the
# peak it reports (%M) is the command's own (floored at GNU time's 1-2 MB).
GNU_TIME = "/usr/bin/time"
_launcher = []


def launcher():
    """GNU time's path, or None when it is absent or is not GNU time (then peak RSS
    comes from wait4 and is floored at this script's RSS; a note says so, once)."""
    if not _launcher:
        ok = False
        if os.access(GNU_TIME, os.X_OK):
            r = subprocess.run([GNU_TIME, "-f", "%M", "-o", os.devnull, "true"],
                               capture_output=True)
            ok = r.returncode == 0
        _launcher.append(GNU_TIME if ok else None)
        if not ok:
            print("note: no GNU time at %s (apt-get install time): peak RSS is wait4's "
                  "ru_maxrss, which is at least this script's own RSS at the fork (%.0f MB "
                  "now), so small processes read high" % (GNU_TIME, self_rss() / 1e6),
                  file=sys.stderr, flush=True)
    return _launcher[0]


def self_rss():
    with open("/proc/self/status") as f:
        return next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("VmRSS:"))


def rss_method():
    """How peak RSS is taken, for the JSON a benchmark writes."""
    if launcher():
        return "GNU time's %M: the command's own peak RSS"
    return ("wait4's ru_maxrss (no GNU time): floored at the launching Python's RSS "
            "at the fork, about %.0f MB" % (self_rss() / 1e6))


def spawn(cmd, env=None, preexec_fn=None):
    """Starts cmd (stdout to /dev/null, stderr to a pipe), under GNU time where it
    is; returns (Popen, the file GNU time writes the command's peak RSS to, or None).
    Reap it with reaped()."""
    out = None
    if launcher():
        fd, out = tempfile.mkstemp(prefix="unshard-bench-rusage-")
        os.close(fd)
        cmd = [GNU_TIME, "-f", "%M", "-o", out] + list(cmd)
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                         preexec_fn=preexec_fn)
    return p, out


def reaped(p, out):
    """Reads p's stderr to the end and waits for it; returns (exit code, peak RSS
    bytes, CPU seconds, stderr bytes). CPU is user plus system time from wait4: the
    command's and its children's, plus GNU time's own (about a millisecond)."""
    err = p.stderr.read()
    _, status, ru = os.wait4(p.pid, 0)
    p.returncode = code = os.waitstatus_to_exitcode(status)
    rss, cpu = ru.ru_maxrss * 1024, ru.ru_utime + ru.ru_stime
    if out:
        with open(out) as f:
            text = f.read()
        os.unlink(out)
        # A failed command's status comes first ("Command exited with non-zero
        # status N"); %M is the last line.
        last = text.split()[-1:] if text.strip() else []
        if last and last[0].isdigit():
            rss = int(last[0]) * 1024
        elif code == 0:
            raise RuntimeError("GNU time wrote no peak RSS for %s: %r" % (p.args, text))
    return code, rss, cpu, err


def measure(cmd, nofile=None):
    """Runs cmd (with the limit on open files set to nofile, soft and hard, if given);
    returns (wall seconds, peak RSS bytes, seconds of the sync after, stderr, CPU
    seconds: user plus system). Peak RSS is the command's own under GNU time (see
    launcher())."""
    def limit():
        if nofile:
            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))
    t0 = time.perf_counter()
    p, out = spawn(cmd, preexec_fn=limit)
    code, rss, cpu, err = reaped(p, out)
    wall = time.perf_counter() - t0
    t1 = time.perf_counter()
    subprocess.run(["sync"], check=True)
    flush = time.perf_counter() - t1
    if code != 0:
        raise RuntimeError("%s failed (exit %d): %s" % (" ".join(cmd), code,
                                                       err.decode(errors="replace")[-2000:]))
    return wall, rss, flush, err, cpu


def has_torch(python):
    try:
        r = subprocess.run([python, "-c", "import torch, transformers"], capture_output=True)
        return r.returncode == 0
    except OSError:
        return False


def unshard_reads(unshard, path):
    """None when unshard can read the input, else the reason it gives."""
    r = subprocess.run([unshard, "inspect", path, "--json"], capture_output=True, text=True)
    if r.returncode == 0:
        return None
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    return lines[0] if lines else "exit %d" % r.returncode


def fmt_bytes(n):
    if n >= 1e9:
        return "%.2f GB" % (n / 1e9)
    return "%.0f MB" % (n / 1e6)


def model_fields(meta):
    """What bench/tables.py needs to name the model of a row (meta.json's shape fields)."""
    return {k: meta[k] for k in ("layers", "parameters", "ranks", "chunks", "optim", "kind",
                                 "experts", "world", "hidden", "tensors", "files", "dtype") if k in meta}


def run(args):
    unshard = os.path.abspath(args.unshard)
    here = os.path.dirname(os.path.abspath(__file__))
    pipeline = os.path.join(here, "python_pipeline.py")
    python_ok = "python" in args.rows and has_torch(args.python)
    if "python" in args.rows and not python_ok:
        print("note: %s cannot import torch and transformers: Python rows skipped" % args.python)
    cache = args.cache
    if cache == "auto":
        cache = "cold" if can_drop_caches() else "warm"
    elif cache == "cold" and not can_drop_caches():
        sys.exit("--cache cold needs write access to /proc/sys/vm/drop_caches (root)")
    work = os.path.abspath(args.work)
    os.makedirs(work, exist_ok=True)

    results = []
    for data in args.data:
        data = os.path.abspath(data)
        with open(os.path.join(data, "meta.json")) as f:
            meta = json.load(f)
        base = os.path.join(data, "base")
        kinds = KINDS
        if meta.get("kind") == "ranks":
            # gen_wide.py --kind ranks: verl's per-rank files of DTensors, tiny weights.
            kinds = (("ranks", "ranks", "verl ranks, %d files, %d shards" % (
                meta["ranks"], meta["chunks"]), None),)
        elif meta.get("kind") == "deepspeed":
            # gen_deepspeed.py --ranks N: ZeRO-2 and ZeRO-3 folders over N ranks.
            kinds = tuple((k, k, "DeepSpeed ZeRO-%s, %d ranks" % (k[-1], meta["world"]), "zero")
                          for k in ("zero2", "zero3"))
        elif meta.get("kind") == "hf_sharded":
            # gen_titan.py: the rank files of torch's HF storage writer, and the
            # torchtitan checkpoint the same weights came from.
            kinds = (("hf_sharded", "hf_sharded", "HF-sharded safetensors, %d ranks, %d files"
                      % (meta["ranks"], meta["files"]), "torch_consolidate"),
                     ("titan", os.path.join("titan", "checkpoint", "step-1000"),
                      "torchtitan DCP, %d ranks" % meta["ranks"], "titan_convert"))
        elif "ranks" in meta:
            # Written by gen_wide.py: one DCP directory of many ranks, tiny weights.
            kinds = (("dcp", "dcp", "DCP, %d ranks, %d chunks" % (meta["ranks"], meta["chunks"]),
                      None),)
        for kind, rel, label, mode in kinds:
            if kind not in args.kinds:
                continue
            # gen_titan.py's meta.json gives the dtype of the HF-sharded save; its
            # torchtitan checkpoint is float32 (export_dtype="float32", as trained).
            kmeta = dict(meta, dtype="float32") if kind == "titan" else meta
            src = os.path.join(data, rel)
            if not os.path.exists(src):
                continue
            size = du(src)
            rows = []
            skipped = None
            if "read" in args.rows:
                rows.append(("read", lambda out, src=src: [
                    sys.executable, os.path.join(here, "read_floor.py"), src]
                    + (["--buffered"] if cache == "warm" else [])))
            if "cp" in args.rows:
                rows.append(("cp", lambda out, src=src: ["cp", "-r", src, out]))
            if "unshard" in args.rows:
                why = unshard_reads(unshard, src)
                if why is None:
                    rows.append(("unshard", lambda out, src=src: [
                        unshard, "merge", src, "--base", base, "--output", out,
                        "--dtype", "bfloat16", "--quiet", "--force"]))
                    for name, other in args.compare:
                        rows.append(("unshard " + name, lambda out, src=src, other=other: [
                            other, "merge", src, "--base", base, "--output", out,
                            "--dtype", "bfloat16", "--quiet", "--force"]))
                    if "inspect" in args.rows:
                        # Opening the checkpoint alone: what describing it costs.
                        for name, exe in [("", unshard)] + list(args.compare):
                            rows.append((("inspect " + name).strip(), lambda out, exe=exe, src=src: [
                                exe, "inspect", src, "--json"]))
                else:
                    skipped = "not supported yet (%s)" % why
            if mode == "torch_consolidate" and has_torch(args.python):
                mapping = os.path.join(data, "hf_sharded_mapping.json")
                for n in (1, 2, 4):
                    rows.append(("torch t%d" % n, lambda out, src=src, n=n: [
                        args.python, os.path.join(here, "torch_consolidate.py"), src, out,
                        mapping, str(n)]))
            elif mode == "titan_convert" and has_torch(args.python):
                # torchtitan's convert_to_hf path, cast to bf16 like the unshard row.
                rows.append(("torchtitan", lambda out, src=src: [
                    args.python, os.path.join(here, "titan_convert.py"), src, out,
                    os.path.join(base, "config.json"), "--export-dtype", "bfloat16"]))
            elif python_ok and mode == "zero":
                # What DeepSpeed users run: float32 safetensors, no config.
                rows.append(("zero_to_fp32", lambda out, src=src: [
                    args.python, "-m", "deepspeed.utils.zero_to_fp32", src, out,
                    "--safe_serialization"]))
            elif python_ok and mode:
                rows.append(("python", lambda out, src=src, mode=mode: [
                    args.python, pipeline, mode, src, base, out]))
            runs = {tool: [] for tool, _ in rows}
            failed = {}
            for rep in range(args.repeat):
                # The rows take turns at going first: a row right after `cp -r`
                # (gigabytes written and deleted) or after another build's run
                # otherwise always pays for what the one before it left behind.
                turn = rep % len(rows) if rows else 0
                for tool, make_cmd in rows[turn:] + rows[:turn]:
                    if tool in failed:
                        continue
                    out = os.path.join(work, "%s-%s" % (kind, tool))
                    shutil.rmtree(out, ignore_errors=True)
                    if cache == "cold":
                        drop_caches()
                    else:
                        read_all(src)
                        if tool not in ("cp", "read"):
                            read_all(base)
                        subprocess.run(["sync"], check=True)
                    nofile = args.nofile if tool.startswith(("unshard", "inspect")) else None
                    load = os.getloadavg()[0]
                    try:
                        wall, rss, flush, _, cpu = measure(make_cmd(out), nofile)
                    except RuntimeError as e:
                        # Kept as a result (a build that cannot read the input, or
                        # not within the limit on open files), not an abort.
                        failed[tool] = str(e).strip().splitlines()[-1][-300:]
                        print("  %s %-24s %-8s failed: %s" % (
                            os.path.basename(data), label, tool, failed[tool]), flush=True)
                        shutil.rmtree(out, ignore_errors=True)
                        continue
                    runs[tool].append((wall, rss, flush, load, cpu))
                    print("  %s %-24s %-8s run %d: %6.2f s (+sync %5.2f s), %5.2f CPU s, peak RSS %s"
                          % (os.path.basename(data), label, tool, rep + 1, wall, flush, cpu,
                             fmt_bytes(rss)), flush=True)
                    shutil.rmtree(out, ignore_errors=True)
            for tool, rs in runs.items():
                if not rs:
                    results.append(dict(data=data, meta=kmeta, kind=kind, label=label,
                                        input_bytes=size, tool=tool,
                                        skipped="failed: %s" % failed.get(tool, "?")))
                    continue
                results.append(dict(
                    data=data, meta=kmeta, model=model_fields(kmeta), kind=kind, label=label,
                    input_bytes=size, tool=tool,
                    wall=statistics.median(r[0] for r in rs),
                    wall_sync=statistics.median(r[0] + r[2] for r in rs),
                    rss=statistics.median(r[1] for r in rs),
                    walls=[r[0] for r in rs],
                    # The 1-minute load average as each run started: how busy the
                    # machine was besides this benchmark (about 1 while it runs alone).
                    load_1min=[round(r[3], 2) for r in rs],
                    # CPU seconds (user + system) of each run: what the work cost,
                    # apart from the share of a busy machine it was given.
                    cpu=[round(r[4], 3) for r in rs]))
                if skipped and tool == "cp":
                    results.append(dict(data=data, meta=kmeta, model=model_fields(kmeta), kind=kind,
                                        label=label, input_bytes=size, tool="unshard",
                                        skipped=skipped))
                    skipped = None
            if skipped:
                results.append(dict(data=data, meta=kmeta, model=model_fields(kmeta), kind=kind,
                                    label=label, input_bytes=size, tool="unshard",
                                    skipped=skipped))
    return results, cache


TOOL_NAMES = {"read": "read only (read_floor.py)", "cp": "cp -r", "unshard": "unshard merge (to bf16)", "python": "Python pipeline",
              "inspect": "unshard inspect",
              "zero_to_fp32": "zero_to_fp32.py --safe_serialization (fp32)",
              "torch t1": "torch consolidate_safetensors_files, 1 thread",
              "torch t2": "torch consolidate_safetensors_files, 2 threads",
              "torch t4": "torch consolidate_safetensors_files, 4 threads",
              "torchtitan": "torchtitan convert_to_hf path (to bf16)"}


def table(results):
    """A Markdown table; ratios are to cp and to the read-only row of the same input in
    the same run."""
    lines = ["| model | input | size | command | wall s | x cp | x read | wall+sync s | peak RSS |",
             "|---|---|---:|---|---:|---:|---:|---:|---:|"]
    for r in results:
        meta = r["meta"]
        if meta.get("kind") == "deepspeed":
            model = "narrow (%d layers, hidden %d)" % (meta["layers"], meta["hidden"])
        elif meta.get("kind") == "moe":
            model = "narrow MoE (%d layers, %d experts, hidden %d)" % (
                meta["layers"], meta["experts"], meta["hidden"])
        elif meta.get("kind") == "hf_sharded":
            model = "%.2fB (%d layers, %s)" % (meta["parameters"] / 1e9, meta["layers"],
                                              meta["dtype"])
        elif "ranks" in meta:
            model = "wide (%d layers%s)" % (meta["layers"], ", + Adam state" if meta["optim"] else "")
        else:
            model = "%.2fB (%d layers)" % (meta["parameters"] / 1e9, meta["layers"])
        head = "| %s | %s | %s | %s |" % (model, r["label"], fmt_bytes(r["input_bytes"]),
                                          TOOL_NAMES[r["tool"]])
        if "skipped" in r:
            lines.append(head + " %s | | | | |" % r["skipped"])
            continue

        def ratio(tool):
            y = next((c for c in results if c["data"] == r["data"] and c["kind"] == r["kind"]
                      and c["tool"] == tool and "wall" in c), None)
            return "%.2f" % (r["wall"] / y["wall"]) if y else ""
        lines.append(head + " %.2f | %s | %s | %.2f | %s |" % (
            r["wall"], ratio("cp"), ratio("read"), r["wall_sync"], fmt_bytes(r["rss"])))
    return "\n".join(lines)


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


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", action="append", required=True,
                    help="a directory written by gen.py (repeatable)")
    ap.add_argument("--unshard", default="target/release/unshard")
    ap.add_argument("--python", default=sys.executable,
                    help="interpreter with torch and transformers for the Python rows")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--cache", choices=("auto", "cold", "warm"), default="auto")
    ap.add_argument("--rows", default="read,cp,unshard,python")
    ap.add_argument("--kinds", default="policy,dcp,ranks,zero2,zero3")
    ap.add_argument("--work", default="/tmp/unshard-bench",
                    help="where outputs go (removed after each run); put it on the inputs' disk")
    ap.add_argument("--json", help="also write the results here (bench/tables.py renders "
                    "README.md's tables from bench/results/*.json)")
    ap.add_argument("--nofile", type=int,
                    help="run the unshard rows with this hard limit on open files (ulimit -n)")
    ap.add_argument("--note", help="how the machine was shared etc., kept in the JSON")
    ap.add_argument("--compare", action="append", default=[], metavar="NAME=PATH",
                    help="another unshard build to run beside the first (repeatable)")
    ap.add_argument("--name", default=TOOL_NAMES["unshard"],
                    help="what to call the unshard rows (to compare two builds)")
    args = ap.parse_args()
    TOOL_NAMES["unshard"] = args.name
    args.compare = [tuple(c.split("=", 1)) for c in args.compare]
    for name, path in args.compare:
        TOOL_NAMES["unshard " + name] = "unshard merge (%s)" % name
        TOOL_NAMES["inspect " + name] = "unshard inspect (%s)" % name
    args.compare = [(n, os.path.abspath(p)) for n, p in args.compare]
    args.rows = args.rows.split(",")
    args.kinds = args.kinds.split(",")

    results, cache = run(args)
    print()
    print("%s; %s page cache; median of %d runs; %s" % (
        machine(), cache, args.repeat, datetime.date.today().isoformat()))
    print(table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(machine=machine(), cache=cache, repeat=args.repeat,
                           date=datetime.date.today().isoformat(),
                           **({"note": args.note} if args.note else {}),
                           load_1min_at_end=round(os.getloadavg()[0], 2),
                           nofile=args.nofile, peak_rss=rss_method(),
                           results=[{k: v for k, v in r.items() if k != "meta"} for r in results]),
                      f, indent=2)


if __name__ == "__main__":
    main()
