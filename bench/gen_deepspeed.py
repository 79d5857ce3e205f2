#!/usr/bin/env python
"""Writes TinyLlama-1.1B-shaped DeepSpeed ZeRO-2 and ZeRO-3 checkpoints (4 ranks, or
--ranks N) with random weights, without training.

  base/    the Hugging Face base model in bfloat16 (gen.py's write_base)
  zero2/   `latest` + global_step1000/: mp_rank_00_model_states.pt (bf16 module)
           and bf16_zero_pp_rank_R_mp_rank_00_optim_states.pt (fp32 partitions of
           two parameter groups, decay / no decay, + Adam exp_avg, exp_avg_sq)
  zero3/   the same weights in ZeRO-3's layout: zero_pp_rank_R_mp_rank_00_model_states.pt
           ([0]-shaped placeholders) and the optim files (fp32_flat_groups + moments)
  meta.json

--ranks N --hidden H (with --intermediate, --vocab, --heads) writes the same
structure over N ranks with a narrow model, to measure what grows with the rank
count (1,024-16,384 ranks in frontier runs) without terabytes: e.g. --ranks 4096
--hidden 64 --layers 22. With many ranks most partitions are tiny, some are
padding only, and the last rank's ZeRO-2 partition can be empty; the rules below
hold for any N (bench/ds_real_check.py compares the files with what DeepSpeed
itself writes at 8 ranks on CPU).

Only the layout matters for the benchmark, so the files are built directly in
the structure DeepSpeed 0.19.8 writes (the dict keys, the ZeroStageEnum and
LossScaler objects, torch.Size shapes; see fixtures/deepspeed/, written by
DeepSpeed itself): each group flattened in order, padded to a multiple of twice
the world size and cut into equal partitions, the last rank's saved without its
padding (ZeRO-2: every rank saves its partition without the part that is padding,
so with many ranks the last few can be empty); each parameter cut into
ceil(n/N)-element shares, the shares past its end zeros (ZeRO-3).
DeepSpeed's zero_to_fp32 reads them (checked at the end on the smallest tensor
set when --check is given).

Needs torch, transformers and deepspeed. Disk: about 3.5 x the fp32 model per
layout (masters, two moments, the bf16 module): 15 GB each for 22 layers.

  /work/venv/bin/python bench/gen_deepspeed.py --out /work/bench-data/zero-22l
  /work/venv/bin/python bench/gen_deepspeed.py --out /tmp/zero-2l --layers 2 --check
  /work/venv/bin/python bench/gen_deepspeed.py --out /work/bench-data/ds-2048 \
      --ranks 2048 --hidden 64 --intermediate 172 --heads 2 --kv-heads 1
"""

import argparse
import json
import math
import os
import sys
import time
from collections import OrderedDict

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gen  # noqa: E402

WORLD = 4
TAG = "global_step1000"


def groups_of(shapes):
    """Trainer's two groups: weight decay for matrices, none for norms."""
    decay = [(n, s) for n, s in shapes if not n.endswith("norm.weight")]
    no_decay = [(n, s) for n, s in shapes if n.endswith("norm.weight")]
    return [decay, no_decay]


def ds_objects():
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    return ZeroStageEnum, LossScaler(1.0)


def param_groups_meta(groups, offset=0):
    out = []
    for i, g in enumerate(groups):
        out.append({"weight_decay": 0.1 if i == 0 else 0.0, "lr": 1e-5, "betas": (0.9, 0.999),
                    "eps": 1e-8, "amsgrad": False, "params": [offset + i]})
    return out


def moments(parts):
    return {"state": {i: {"step": torch.tensor(1000.0), "exp_avg": torch.zeros_like(p),
                          "exp_avg_sq": torch.zeros_like(p)} for i, p in enumerate(parts)}}


def flat_slice(tensors, start, end):
    """Elements [start, end) of the tensors flattened and concatenated (zeros past
    the end), without building the whole concatenation."""
    pieces, at = [], 0
    for t in tensors:
        n = t.numel()
        lo, hi = max(start, at), min(end, at + n)
        if lo < hi:
            pieces.append(t.reshape(-1)[lo - at:hi - at])
        at += n
    have = sum(p.numel() for p in pieces)
    if have < end - start:
        pieces.append(torch.zeros(end - start - have, dtype=torch.float32))
    if not pieces:
        return torch.zeros(0, dtype=torch.float32)
    return torch.cat(pieces)


def zero2_partition(n, world, r):
    """ZeRO-1/2's partition of a group of n elements for rank r: (start, length
    saved, padding recorded). The group is padded to a multiple of 2 x world
    (stage_1_and_2's nccl_start_alignment_factor) and cut into world equal
    partitions; each rank records how much of its partition is that padding
    (group_paddings) and is saved without it. With many ranks and a small group
    (the norms), several ranks before the last hold padding only and save empty
    partitions (what DeepSpeed 0.19.8 writes at 8 ranks: bench/ds_real_check.py)."""
    align = 2 * world
    part = align * math.ceil(n / align) // world
    length = max(0, min(part, n - r * part))
    return r * part, length, part - length


def slice_mappings(groups, world, r):
    """param_slice_mappings: per group, {name: fragment_address(numel, start)} of
    every parameter that has elements in rank r's partition, start counted from the
    partition's first element."""
    from deepspeed.utils.tensor_fragment import fragment_address

    out = []
    for g in groups:
        n = sum(math.prod(s) for _, s in g)
        lo, length, _ = zero2_partition(n, world, r)
        hi, at, m = lo + length, 0, OrderedDict()
        for name, s in g:
            a, b = max(lo, at), min(hi, at + math.prod(s))
            if a < b:
                m[name] = fragment_address(numel=b - a, start=a - lo)
            at += math.prod(s)
        out.append(m)
    return out


def model_states(module, groups, config, world):
    return {
        "module": module, "buffer_names": [], "optimizer": None,
        "param_shapes": [OrderedDict((n, torch.Size(s)) for n, s in g) for g in groups],
        "frozen_param_shapes": None, "shared_params": {}, "frozen_param_fragments": None,
        "lr_scheduler": None, "data_sampler": None, "random_ltd": None,
        "sparse_tensor_module_names": set(), "skipped_steps": 0, "global_steps": 1000,
        "global_samples": 4000, "dp_world_size": world, "mp_world_size": 1,
        "ds_config": config, "ds_version": "0.19.8",
    }


def progress(what, r, world, started):
    if world >= 256 and (r + 1) % (world // 8) == 0:
        print("    %s: %d/%d ranks, %.0f s" % (what, r + 1, world, time.time() - started),
              flush=True)


def write_zero2(out, state, shapes, groups, world=WORLD, tag=TAG):
    ZeroStageEnum, scaler = ds_objects()
    config = {"zero_optimization": {"stage": 2}, "bf16": {"enabled": True}}
    tag_dir = os.path.join(out, tag)
    os.makedirs(tag_dir)
    module = OrderedDict((n, state[n].to(torch.bfloat16)) for n, _ in shapes)
    torch.save(model_states(module, groups, config, world),
               os.path.join(tag_dir, "mp_rank_00_model_states.pt"))
    del module
    sizes = [sum(math.prod(s) for _, s in g) for g in groups]
    started = time.time()
    for r in range(world):
        parts, paddings = [], []
        for g, n in zip(groups, sizes):
            lo, length, padding = zero2_partition(n, world, r)
            parts.append(flat_slice([state[k] for k, _ in g], lo, lo + length).clone())
            paddings.append(padding)
        osd = {
            "loss_scaler": scaler, "dynamic_loss_scale": False, "overflow": False, "clip_grad": 1.0,
            "base_optimizer_state": dict(moments(parts), param_groups=param_groups_meta(groups)),
            "single_partition_of_fp32_groups": parts, "zero_stage": ZeroStageEnum.gradients,
            "group_paddings": paddings, "param_alignment_paddings": [[0] * len(g) for g in groups],
            "param_slice_mappings": slice_mappings(groups, world, r),
            "partition_count": [world] * len(groups), "ds_version": "0.19.8",
        }
        torch.save({"optimizer_state_dict": osd, "ds_config": config, "ds_version": "0.19.8"},
                   os.path.join(tag_dir, "bf16_zero_pp_rank_%d_mp_rank_00_optim_states.pt" % r))
        del parts, osd
        progress("zero2", r, world, started)
    with open(os.path.join(out, "latest"), "w") as f:
        f.write(tag)


def zero3_flats(state, groups, world, r):
    """Rank r's fp32_flat_groups: per group, its ceil(n/world)-element share of every
    parameter (zeros past the parameter's end), concatenated in order."""
    flats = []
    for g in groups:
        shares = []
        for name, s in g:
            share = math.ceil(math.prod(s) / world)
            shares.append(flat_slice([state[name]], r * share, (r + 1) * share))
        flats.append(torch.cat(shares) if shares else torch.zeros(0, dtype=torch.float32))
    return flats


def write_zero3(out, state, shapes, groups, world=WORLD, tag=TAG):
    ZeroStageEnum, scaler = ds_objects()
    config = {"zero_optimization": {"stage": 3}, "bf16": {"enabled": True}}
    tag_dir = os.path.join(out, tag)
    os.makedirs(tag_dir)
    started = time.time()
    for r in range(world):
        module = OrderedDict((n, torch.empty(0, dtype=torch.bfloat16)) for n, _ in shapes)
        torch.save(model_states(module, groups, config, world),
                   os.path.join(tag_dir, "zero_pp_rank_%d_mp_rank_00_model_states.pt" % r))
        flats = zero3_flats(state, groups, world, r)
        osd = {
            "zero_stage": ZeroStageEnum.weights, "loss_scaler": scaler, "dynamic_loss_scale": False,
            "overflow": False, "partition_count": world,
            "optimizer_state_dict": dict(moments(flats), param_groups=param_groups_meta(groups)),
            "fp32_flat_groups": flats,
        }
        torch.save({"optimizer_state_dict": osd, "ds_config": config, "ds_version": "0.19.8"},
                   os.path.join(tag_dir, "bf16_zero_pp_rank_%d_mp_rank_00_optim_states.pt" % r))
        del flats, osd
        progress("zero3", r, world, started)
    with open(os.path.join(out, "latest"), "w") as f:
        f.write(tag)


def check(out, state, kinds):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    for kind in kinds:
        z = get_fp32_state_dict_from_zero_checkpoint(os.path.join(out, kind))
        assert set(z) == set(state), kind
        for k, v in state.items():
            assert torch.equal(z[k], v), (kind, k)
        print("  zero_to_fp32 reads %s/ and gives the weights back" % kind)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="directory to create (outside the repository)")
    ap.add_argument("--layers", type=int, default=22, help="decoder layers (TinyLlama has 22)")
    ap.add_argument("--ranks", type=int, default=WORLD, help="data-parallel world size")
    ap.add_argument("--hidden", type=int, help="hidden size (TinyLlama: 2048)")
    ap.add_argument("--intermediate", type=int, help="MLP size (TinyLlama: 5632)")
    ap.add_argument("--vocab", type=int, help="vocabulary (TinyLlama: 32000)")
    ap.add_argument("--heads", type=int, help="attention heads (32)")
    ap.add_argument("--kv-heads", type=int, help="key/value heads (4)")
    ap.add_argument("--kinds", default="zero2,zero3")
    ap.add_argument("--check", action="store_true", help="read both back with zero_to_fp32")
    args = ap.parse_args()
    gen.quiet()
    out = os.path.abspath(args.out)
    if os.path.exists(out):
        sys.exit("%s exists; remove it first" % out)
    if args.ranks < 1:
        sys.exit("--ranks must be at least 1")
    os.makedirs(out)
    started = time.time()
    sizes = {k: v for k, v in (("hidden_size", args.hidden), ("intermediate_size", args.intermediate),
                               ("vocab_size", args.vocab), ("num_attention_heads", args.heads),
                               ("num_key_value_heads", args.kv_heads)) if v is not None}
    from transformers import LlamaConfig

    cfg = LlamaConfig(**dict(gen.TINYLLAMA, num_hidden_layers=args.layers, **sizes))
    cfg.dtype = torch.bfloat16
    shapes = gen.tensor_shapes(cfg)
    params = sum(math.prod(s) for _, s in shapes)
    print("model: %d layers, %.3fB parameters, %d tensors, %d ranks" % (
        args.layers, params / 1e9, len(shapes), args.ranks))
    gen.write_base(os.path.join(out, "base"), cfg, shapes)
    state = gen.random_state(shapes, seed=1)
    groups = groups_of(shapes)
    kinds = args.kinds.split(",")
    if "zero2" in kinds:
        write_zero2(os.path.join(out, "zero2"), state, shapes, groups, args.ranks)
        print("  zero2/ written, %.0f s" % (time.time() - started))
    if "zero3" in kinds:
        write_zero3(os.path.join(out, "zero3"), state, shapes, groups, args.ranks)
        print("  zero3/ written, %.0f s" % (time.time() - started))
    if args.check:
        check(out, state, [k for k in ("zero2", "zero3") if k in kinds])
    inputs = {k: gen.du(os.path.join(out, k)) for k in ["base"] + kinds}
    meta = {"model": "TinyLlama-1.1B-shaped Llama, random weights, DeepSpeed layouts",
            "layers": args.layers, "parameters": params,
            "config": dict(gen.TINYLLAMA, num_hidden_layers=args.layers, **sizes),
            "input_bytes": inputs, "torch": torch.__version__}
    if args.ranks != WORLD or sizes:
        # Read by bench/run.py and bench/tables.py to label the rows ("ranks" is
        # gen_wide.py's DCP key, so the world size is called "world" here).
        meta.update(kind="deepspeed", world=args.ranks, hidden=cfg.hidden_size,
                    tensors=len(shapes))
    with open(os.path.join(out, "meta.json"), "w") as f:
        json.dump(meta, f, indent=2)
    print("done in %.0f s: %s" % (time.time() - started,
                                 ", ".join("%s %.2f GB" % (k, v / 1e9) for k, v in inputs.items())))


if __name__ == "__main__":
    main()
