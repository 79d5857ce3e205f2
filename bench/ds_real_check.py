#!/usr/bin/env python
"""Checks bench/gen_deepspeed.py against DeepSpeed itself at a rank count where the
partitioning rules matter: DeepSpeed trains a tiny Llama for one step on CPU (gloo,
--ranks processes), saves ZeRO-2 and ZeRO-3 checkpoints, and gen_deepspeed.py writes
the same fp32 masters (read back with zero_to_fp32) in its own files; every
optimizer-state file is then compared key by key (the partitions' lengths and
values, but for ZeRO-3's padding, which DeepSpeed leaves uninitialised;
group_paddings, param_slice_mappings, partition_count, zero_stage) and the model
states' param_shapes. --reuse compares a DeepSpeed run already in OUT/real (kept
when the files differ). With hidden size 12 the no-decay group (the norms) is 36
elements, which 8 ranks pad to 48 (partitions of 6): ranks 6 and 7 hold padding
only and are saved empty, as a small group is over thousands of ranks.

  /work/venv/bin/python bench/ds_real_check.py --out /tmp/ds-real [--ranks 8]

Exit status 0 when the files agree; the differences are printed otherwise.
Needs torch, transformers and deepspeed (CPU is enough).
"""

import argparse
import os
import shutil
import sys
import warnings

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

TAG = "global_step1"
CONFIG = dict(hidden_size=12, intermediate_size=43, num_attention_heads=2, num_key_value_heads=1,
              num_hidden_layers=1, vocab_size=251, max_position_embeddings=64,
              tie_word_embeddings=False)


def model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**CONFIG)).float()


def worker(rank, ws, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(ws), LOCAL_WORLD_SIZE=str(ws))
    warnings.filterwarnings("ignore")
    import deepspeed
    import deepspeed.comm.torch as dct

    dct.build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="gloo")
    for stage in (2, 3):
        m = model()
        named = list(m.named_parameters())
        groups = [{"params": [p for n, p in named if not n.endswith("norm.weight")],
                   "weight_decay": 0.1},
                  {"params": [p for n, p in named if n.endswith("norm.weight")],
                   "weight_decay": 0.0}]
        opt = torch.optim.AdamW(groups, lr=1e-2)
        zero = {"stage": stage}
        if stage == 3:
            zero.update(stage3_param_persistence_threshold=0,
                        stage3_gather_16bit_weights_on_model_save=False)
        cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
               "zero_optimization": zero, "zero_allow_untested_optimizer": True,
               "steps_per_print": 1000, "bf16": {"enabled": True}}
        engine, _, _, _ = deepspeed.initialize(model=m, optimizer=opt, config=cfg)
        g = torch.Generator().manual_seed(77 + rank)
        ids = torch.randint(4, 251, (1, 12), generator=g)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        engine.save_checkpoint(os.path.join(out, "real", "zero%d" % stage), tag=TAG)
        del engine, opt, m


def tensors_differ(a, b):
    if not (torch.is_tensor(a) and torch.is_tensor(b)):
        return "not both tensors"
    if a.dtype != b.dtype or a.shape != b.shape:
        return "dtype/shape %s%s vs %s%s" % (a.dtype, tuple(a.shape), b.dtype, tuple(b.shape))
    if not torch.equal(a, b):
        return "values differ"
    return None


def zero3_real(groups, world, r):
    """Per group, a mask of rank r's elements that belong to a parameter (the rest
    pads the last shares: DeepSpeed leaves whatever was in memory there)."""
    masks = []
    for g in groups:
        bits = []
        for _, s in g:
            n = int(torch.Size(s).numel())
            share = -(-n // world)
            bits += [r * share + i < n for i in range(share)]
        masks.append(torch.tensor(bits, dtype=torch.bool))
    return masks


def compare(real_dir, gen_dir, problems, groups, world):
    real_files = sorted(os.listdir(real_dir))
    gen_files = sorted(os.listdir(gen_dir))
    if real_files != gen_files:
        problems.append("%s: files %s vs %s" % (gen_dir, real_files, gen_files))
    for name in real_files:
        if name not in gen_files:
            continue
        a = torch.load(os.path.join(real_dir, name), weights_only=False)
        b = torch.load(os.path.join(gen_dir, name), weights_only=False)
        where = "%s/%s" % (os.path.basename(os.path.dirname(gen_dir)), name)
        if "model_states" in name:
            ps_a = [[(k, tuple(v)) for k, v in g.items()] for g in a["param_shapes"]]
            ps_b = [[(k, tuple(v)) for k, v in g.items()] for g in b["param_shapes"]]
            if ps_a != ps_b:
                problems.append("%s: param_shapes %s vs %s" % (where, ps_a, ps_b))
            if a.get("dp_world_size") != b.get("dp_world_size"):
                problems.append("%s: dp_world_size" % where)
            continue
        oa, ob = a["optimizer_state_dict"], b["optimizer_state_dict"]
        if set(oa) != set(ob):
            problems.append("%s: optimizer_state_dict keys %s vs %s" % (
                where, sorted(set(oa) ^ set(ob)), ""))
        for key in ("single_partition_of_fp32_groups", "fp32_flat_groups"):
            if key not in oa:
                continue
            pa, pb = oa[key], ob.get(key, [])
            if len(pa) != len(pb):
                problems.append("%s: %s has %d groups vs %d" % (where, key, len(pa), len(pb)))
            if key == "fp32_flat_groups":
                rank = int(name.split("_rank_")[1].split("_")[0])
                masks = zero3_real(groups, world, rank)
                pa = [x[m] if x.shape == m.shape else x for x, m in zip(pa, masks)]
                pb = [x[m] if x.shape == m.shape else x for x, m in zip(pb, masks)]
            for i, (x, y) in enumerate(zip(pa, pb)):
                d = tensors_differ(x, y)
                if d:
                    problems.append("%s: %s[%d]: %s" % (where, key, i, d))
        if "param_slice_mappings" in oa:
            sa = [[(k, v.numel, v.start) for k, v in g.items()] for g in oa["param_slice_mappings"]]
            sb = [[(k, v.numel, v.start) for k, v in g.items()]
                  for g in ob.get("param_slice_mappings", [])]
            if sa != sb:
                problems.append("%s: param_slice_mappings %s vs %s" % (where, sa, sb))
        for key in ("group_paddings", "partition_count", "param_alignment_paddings"):
            if key in oa and oa[key] != ob.get(key):
                problems.append("%s: %s %r vs %r" % (where, key, oa[key], ob.get(key)))
        if int(oa["zero_stage"]) != int(ob["zero_stage"]):
            problems.append("%s: zero_stage" % where)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--port", type=int, default=29781)
    ap.add_argument("--reuse", action="store_true", help="compare against OUT/real as it is")
    args = ap.parse_args()
    out = os.path.abspath(args.out)
    if args.reuse:
        shutil.rmtree(os.path.join(out, "gen"), ignore_errors=True)
    elif os.path.exists(out):
        sys.exit("%s exists; remove it first" % out)
    else:
        os.makedirs(out)
    # DeepSpeed looks for ninja (in the venv) on PATH when it starts.
    os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
    import torch.multiprocessing as mp
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    import gen_deepspeed as gd

    if not args.reuse:
        mp.spawn(worker, args=(args.ranks, args.port, out), nprocs=args.ranks, join=True)
    problems = []
    for stage in (2, 3):
        kind = "zero%d" % stage
        real = os.path.join(out, "real", kind)
        state = get_fp32_state_dict_from_zero_checkpoint(real)
        ms = "mp_rank_00_model_states.pt" if stage == 2 else "zero_pp_rank_0_mp_rank_00_model_states.pt"
        saved = torch.load(os.path.join(real, TAG, ms), weights_only=False)
        groups = [[(k, tuple(v)) for k, v in g.items()] for g in saved["param_shapes"]]
        shapes = [x for g in groups for x in g]
        write = gd.write_zero2 if stage == 2 else gd.write_zero3
        write(os.path.join(out, "gen", kind), state, shapes, groups, args.ranks, TAG)
        compare(os.path.join(real, TAG), os.path.join(out, "gen", kind, TAG), problems, groups,
                args.ranks)
        print("%s: %d rank files compared, group sizes %s" % (
            kind, args.ranks, [sum(int(torch.Size(s).numel()) for _, s in g) for g in groups]))
    for p in problems:
        print("DIFFERENT:", p)
    if not problems:
        print("gen_deepspeed.py writes what DeepSpeed %s writes at %d ranks" % (
            __import__("deepspeed").__version__, args.ranks))
        shutil.rmtree(out)
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
