#!/usr/bin/env python
"""Fusing a LoRA adapter against a plain merge of the same base, interleaved, and
(once) against peft's merge_and_unload + save_pretrained.

  /work/venv/bin/python bench/gen_lora.py DATA          # DATA/base, DATA/adapter
  python bench/lora.py --data DATA [--repeat 3] [--peft] [--json OUT.json]

Rows, each run `--repeat` times in turn (plain, lora, plain, lora, ...) so that a
noisy machine slows both alike; the inputs are read once first (page cache warm):
- plain: `unshard merge DATA/base -o OUT` (the base's weights copied into a new
  model directory: what a merge without an adapter costs);
- lora: `unshard merge DATA/adapter --base DATA/base -o OUT`;
- peft (with --peft, once): bench/peft_merge.py, in the same Python.
Reports medians of wall time (the sync after each run counted apart) and peak RSS.
"""

import argparse
import json
import os
import shutil
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from run import machine, measure, read_all, rss_method  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", required=True)
    ap.add_argument("--unshard", default="target/release/unshard")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--work", default="/tmp/unshard-lora-bench")
    ap.add_argument("--peft", action="store_true")
    ap.add_argument("--peft-out", help="where peft writes (default: under --work)")
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--json")
    ap.add_argument("--note", default="")
    a = ap.parse_args()
    base, adapter = os.path.join(a.data, "base"), os.path.join(a.data, "adapter")
    os.makedirs(a.work, exist_ok=True)
    out = os.path.join(a.work, "out")
    read_all(base)
    read_all(adapter)
    cmds = {
        "plain": [a.unshard, "merge", base, "-o", out, "--quiet"],
        "lora": [a.unshard, "merge", adapter, "--base", base, "-o", out, "--quiet"],
    }
    runs = {k: [] for k in cmds}
    for i in range(a.repeat):
        for k, cmd in cmds.items():
            shutil.rmtree(out, ignore_errors=True)
            wall, rss, flush, _, cpu = measure(cmd)
            runs[k].append({"wall_s": round(wall, 3), "sync_s": round(flush, 3), "peak_rss": rss,
                            "cpu_s": round(cpu, 3)})
            print("%s run %d: %.2f s (+%.2f s sync), %.1f CPU s, %.0f MB" % (
                k, i + 1, wall, flush, cpu, rss / 1e6), flush=True)
    shutil.rmtree(out, ignore_errors=True)
    if a.peft:
        peft_out = a.peft_out or out
        cmd = [a.python, os.path.join(os.path.dirname(__file__), "peft_merge.py"), base, adapter,
               peft_out]
        wall, rss, flush, _, cpu = measure(cmd)
        runs["peft"] = [{"wall_s": round(wall, 3), "sync_s": round(flush, 3), "peak_rss": rss,
                         "cpu_s": round(cpu, 3), "output": peft_out}]
        print("peft: %.2f s (+%.2f s sync), %.0f MB" % (wall, flush, rss / 1e6), flush=True)
        shutil.rmtree(peft_out, ignore_errors=True)
    med = {k: {"wall_s": statistics.median(r["wall_s"] for r in v),
               "peak_rss": statistics.median(r["peak_rss"] for r in v),
               "cpu_s": statistics.median(r["cpu_s"] for r in v)} for k, v in runs.items()}
    ratio = med["lora"]["wall_s"] / med["plain"]["wall_s"]
    print("median: plain %.2f s %.0f MB; lora %.2f s %.0f MB; lora/plain %.2fx" % (
        med["plain"]["wall_s"], med["plain"]["peak_rss"] / 1e6, med["lora"]["wall_s"],
        med["lora"]["peak_rss"] / 1e6, ratio))
    if "peft" in med:
        print("peft/lora memory: %.1fx" % (med["peft"]["peak_rss"] / med["lora"]["peak_rss"]))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({
                "what": "LoRA fuse (TinyLlama-1.1B-shaped bf16 base, r=16 on all linear layers, "
                        "bench/gen_lora.py) vs a plain merge of the same base, interleaved; "
                        "page cache warm",
                "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                "machine": machine(),
                "load_average_at_end": os.getloadavg(),
                "peak_rss": rss_method(),
                "note": a.note,
                "commands": cmds,
                "runs": runs,
                "median": med,
                "lora_over_plain": round(ratio, 3),
            }, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()
