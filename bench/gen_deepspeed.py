#!/usr/bin/env python
"""Writes TinyLlama-1.1B-shaped DeepSpeed ZeRO-2 and ZeRO-3 checkpoints (4 ranks)
with random weights, without training.

  base/    the Hugging Face base model in bfloat16 (gen.py's write_base)
  zero2/   `latest` + global_step1000/: mp_rank_00_model_states.pt (bf16 module)
           and bf16_zero_pp_rank_R_mp_rank_00_optim_states.pt (fp32 partitions of
           two parameter groups, decay / no decay, + Adam exp_avg, exp_avg_sq)
  zero3/   the same weights in ZeRO-3's layout: zero_pp_rank_R_mp_rank_00_model_states.pt
           ([0]-shaped placeholders) and the optim files (fp32_flat_groups + moments)
  meta.json

Only the layout matters for the benchmark, so the files are built directly in
the structure DeepSpeed 0.19.8 writes (the dict keys, the ZeroStageEnum and
LossScaler objects, torch.Size shapes; see fixtures/deepspeed/, written by
DeepSpeed itself): each group flattened in order, padded to a multiple of twice
the world size and cut into equal partitions, the last rank's saved without its
padding (ZeRO-2); each parameter cut into ceil(n/4)-element shares (ZeRO-3).
DeepSpeed's zero_to_fp32 reads them (checked at the end on the smallest tensor
set when --check is given).

Needs torch, transformers and deepspeed. Disk: about 3.5 x the fp32 model per
layout (masters, two moments, the bf16 module): 15 GB each for 22 layers.

  /work/venv/bin/python bench/gen_deepspeed.py --out /work/bench-data/zero-22l
  /work/venv/bin/python bench/gen_deepspeed.py --out /tmp/zero-2l --layers 2 --check
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
    return torch.cat(pieces)


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


def write_zero2(out, state, shapes, groups):
    ZeroStageEnum, scaler = ds_objects()
    config = {"zero_optimization": {"stage": 2}, "bf16": {"enabled": True}}
    tag = os.path.join(out, TAG)
    os.makedirs(tag)
    module = OrderedDict((n, state[n].to(torch.bfloat16)) for n, _ in shapes)
    torch.save(model_states(module, groups, config, WORLD), os.path.join(tag, "mp_rank_00_model_states.pt"))
    del module
    align = 2 * WORLD
    sizes = [sum(math.prod(s) for _, s in g) for g in groups]
    padded = [align * math.ceil(n / align) for n in sizes]
    for r in range(WORLD):
        parts, paddings = [], []
        for g, n, p in zip(groups, sizes, padded):
            part = p // WORLD
            lo, hi = r * part, min((r + 1) * part, n)  # the last rank without padding
            parts.append(flat_slice([state[k] for k, _ in g], lo, hi).clone())
            paddings.append(p - n if r == WORLD - 1 else 0)
        osd = {
            "loss_scaler": scaler, "dynamic_loss_scale": False, "overflow": False, "clip_grad": 1.0,
            "base_optimizer_state": dict(moments(parts), param_groups=param_groups_meta(groups)),
            "single_partition_of_fp32_groups": parts, "zero_stage": ZeroStageEnum.gradients,
            "group_paddings": paddings, "param_alignment_paddings": [[0] * len(g) for g in groups],
            "partition_count": [WORLD] * len(groups), "ds_version": "0.19.8",
        }
        torch.save({"optimizer_state_dict": osd, "ds_config": config, "ds_version": "0.19.8"},
                   os.path.join(tag, "bf16_zero_pp_rank_%d_mp_rank_00_optim_states.pt" % r))
        del parts, osd
    with open(os.path.join(out, "latest"), "w") as f:
        f.write(TAG)


def write_zero3(out, state, shapes, groups):
    ZeroStageEnum, scaler = ds_objects()
    config = {"zero_optimization": {"stage": 3}, "bf16": {"enabled": True}}
    tag = os.path.join(out, TAG)
    os.makedirs(tag)
    for r in range(WORLD):
        module = OrderedDict((n, torch.empty(0, dtype=torch.bfloat16)) for n, _ in shapes)
        torch.save(model_states(module, groups, config, WORLD),
                   os.path.join(tag, "zero_pp_rank_%d_mp_rank_00_model_states.pt" % r))
        flats = []
        for g in groups:
            shares = []
            for name, s in g:
                n = math.prod(s)
                share = math.ceil(n / WORLD)
                shares.append(flat_slice([state[name]], r * share, (r + 1) * share))
            flats.append(torch.cat(shares))
        osd = {
            "zero_stage": ZeroStageEnum.weights, "loss_scaler": scaler, "dynamic_loss_scale": False,
            "overflow": False, "partition_count": WORLD,
            "optimizer_state_dict": dict(moments(flats), param_groups=param_groups_meta(groups)),
            "fp32_flat_groups": flats,
        }
        torch.save({"optimizer_state_dict": osd, "ds_config": config, "ds_version": "0.19.8"},
                   os.path.join(tag, "bf16_zero_pp_rank_%d_mp_rank_00_optim_states.pt" % r))
        del flats, osd
    with open(os.path.join(out, "latest"), "w") as f:
        f.write(TAG)


def check(out, state):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    for kind in ("zero2", "zero3"):
        z = get_fp32_state_dict_from_zero_checkpoint(os.path.join(out, kind))
        assert set(z) == set(state), kind
        for k, v in state.items():
            assert torch.equal(z[k], v), (kind, k)
        print("  zero_to_fp32 reads %s/ and gives the weights back" % kind)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="directory to create (outside the repository)")
    ap.add_argument("--layers", type=int, default=22, help="decoder layers (TinyLlama has 22)")
    ap.add_argument("--kinds", default="zero2,zero3")
    ap.add_argument("--check", action="store_true", help="read both back with zero_to_fp32")
    args = ap.parse_args()
    gen.quiet()
    out = os.path.abspath(args.out)
    if os.path.exists(out):
        sys.exit("%s exists; remove it first" % out)
    os.makedirs(out)
    started = time.time()
    cfg = gen.make_config(args.layers)
    shapes = gen.tensor_shapes(cfg)
    params = sum(math.prod(s) for _, s in shapes)
    print("model: %d layers, %.3fB parameters, %d tensors" % (args.layers, params / 1e9, len(shapes)))
    gen.write_base(os.path.join(out, "base"), cfg, shapes)
    state = gen.random_state(shapes, seed=1)
    groups = groups_of(shapes)
    kinds = args.kinds.split(",")
    if "zero2" in kinds:
        write_zero2(os.path.join(out, "zero2"), state, shapes, groups)
        print("  zero2/ written, %.0f s" % (time.time() - started))
    if "zero3" in kinds:
        write_zero3(os.path.join(out, "zero3"), state, shapes, groups)
        print("  zero3/ written, %.0f s" % (time.time() - started))
    if args.check:
        check(out, state)
    inputs = {k: gen.du(os.path.join(out, k)) for k in ["base"] + kinds}
    meta = {"model": "TinyLlama-1.1B-shaped Llama, random weights, DeepSpeed layouts",
            "layers": args.layers, "parameters": params,
            "config": dict(gen.TINYLLAMA, num_hidden_layers=args.layers),
            "input_bytes": inputs, "torch": torch.__version__}
    with open(os.path.join(out, "meta.json"), "w") as f:
        json.dump(meta, f, indent=2)
    print("done in %.0f s: %s" % (time.time() - started,
                                 ", ".join("%s %.2f GB" % (k, v / 1e9) for k, v in inputs.items())))


if __name__ == "__main__":
    main()
