#!/usr/bin/env python
"""Writes a TinyLlama-1.1B-shaped benchmark checkpoint with random weights.

One directory holds every input kind the benchmark merges, all with the same
float32 weights, so every row writes the same bytes:

  base/       the Hugging Face base model in bfloat16 (save_pretrained)
  policy.pt   a DPO-style float32 torch.save file: {'step_idx', 'state', 'metrics'}
  dcp/        a torch.distributed.checkpoint directory written by 4 ranks
              (FSDP2 layout: every tensor a DTensor sharded Shard(0) over 4 ranks)
  ranks/      verl's per-rank files model_world_size_4_rank_R.pt of the same
              DTensors, with fsdp_config.json and huggingface/ beside them
  meta.json   model shape and input sizes, read by run.py

The four ranks are real processes joined in a gloo process group on loopback;
each keeps only its quarter of every tensor (taken from policy.pt, mapped), so
generating needs about the model's float32 size in memory, not four times it.
Nothing is downloaded: the model is built from its config.

Needs torch and transformers. Run (about 5 minutes and 16 GB of disk for 22 layers):

  /work/venv/bin/python bench/gen.py --out /work/bench-data/tinyllama-22l
  /work/venv/bin/python bench/gen.py --out /work/bench-data/tinyllama-11l --layers 11
"""

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import warnings

import torch

WORLD = 4

TINYLLAMA = dict(
    hidden_size=2048,
    intermediate_size=5632,
    num_hidden_layers=22,
    num_attention_heads=32,
    num_key_value_heads=4,
    vocab_size=32000,
    max_position_embeddings=2048,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)


def quiet():
    warnings.filterwarnings("ignore")
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()


def make_config(layers):
    from transformers import LlamaConfig

    cfg = LlamaConfig(**dict(TINYLLAMA, num_hidden_layers=layers))
    cfg.dtype = torch.bfloat16
    return cfg


def tensor_shapes(cfg):
    """The persistent tensors of LlamaForCausalLM in its own order."""
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    return [(k, tuple(v.shape)) for k, v in model.state_dict().items()]


def random_state(shapes, seed):
    g = torch.Generator().manual_seed(seed)
    state = {}
    for name, shape in shapes:
        t = torch.empty(shape, dtype=torch.float32)
        if name.endswith("norm.weight"):
            t.uniform_(0.5, 1.5, generator=g)
        else:
            t.normal_(0.0, 0.02, generator=g)
        state[name] = t
    return state


def write_base(out, cfg, shapes):
    """A bf16 base whose weights differ from the checkpoint's (training moved them)."""
    from transformers import GenerationConfig, LlamaForCausalLM

    state = {k: v.to(torch.bfloat16) for k, v in random_state(shapes, seed=7).items()}
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    model.load_state_dict(state, strict=True, assign=True)
    model.save_pretrained(out)
    GenerationConfig(bos_token_id=1, eos_token_id=2).save_pretrained(out)


def rank_worker(rank, policy, dcp_dir, ranks_dir, initfile):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo", init_method="file://" + initfile, rank=rank, world_size=WORLD)
    try:
        mesh = init_device_mesh("cpu", (WORLD,))
        full = torch.load(policy, mmap=True, weights_only=True)["state"]
        sd = {}
        for name, t in full.items():
            local = torch.chunk(t, WORLD, dim=0)[rank].clone()
            sd[name] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False,
                                          shape=t.shape, stride=t.stride())
        del full
        dcp.save(sd, checkpoint_id=dcp_dir)
        torch.save(sd, os.path.join(ranks_dir, "model_world_size_%d_rank_%d.pt" % (WORLD, rank)))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def write_sharded(out, policy):
    import torch.multiprocessing as mp

    dcp_dir = os.path.join(out, "dcp")
    ranks_dir = os.path.join(out, "ranks")
    os.makedirs(ranks_dir)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(rank_worker, args=(policy, dcp_dir, ranks_dir, os.path.join(tmp, "rdv")),
                 nprocs=WORLD, join=True)
    with open(os.path.join(ranks_dir, "fsdp_config.json"), "w") as f:
        json.dump({"FSDP_version": 2, "world_size": WORLD}, f)
    hf = os.path.join(ranks_dir, "huggingface")
    os.makedirs(hf)
    for name in ("config.json", "generation_config.json"):
        shutil.copy(os.path.join(out, "base", name), hf)


def du(path):
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="directory to create (outside the repository)")
    ap.add_argument("--layers", type=int, default=22, help="decoder layers (TinyLlama has 22)")
    ap.add_argument("--kinds", default="policy,dcp,ranks",
                    help="inputs to write besides the base (policy is needed for the others)")
    args = ap.parse_args()
    quiet()
    kinds = set(args.kinds.split(","))
    out = os.path.abspath(args.out)
    if os.path.exists(out):
        sys.exit("%s exists; remove it first" % out)
    os.makedirs(out)
    started = time.time()
    cfg = make_config(args.layers)
    shapes = tensor_shapes(cfg)
    params = sum(torch.Size(s).numel() for _, s in shapes)
    print("model: %d layers, %.3fB parameters, %d tensors" % (args.layers, params / 1e9, len(shapes)))

    write_base(os.path.join(out, "base"), cfg, shapes)
    print("  base/ (bf16) written, %.0f s" % (time.time() - started))

    policy = os.path.join(out, "policy.pt")
    state = random_state(shapes, seed=1)
    torch.save({"step_idx": 1000, "state": state, "metrics": {"loss": 0.25}}, policy)
    del state
    print("  policy.pt (fp32) written, %.0f s" % (time.time() - started))

    if kinds & {"dcp", "ranks"}:
        write_sharded(out, policy)
        print("  dcp/ and ranks/ (%d ranks) written, %.0f s" % (WORLD, time.time() - started))
        for k in ("dcp", "ranks"):
            if k not in kinds:
                shutil.rmtree(os.path.join(out, k))

    inputs = {k: du(os.path.join(out, p)) for k, p in
              (("base", "base"), ("policy", "policy.pt"), ("dcp", "dcp"), ("ranks", "ranks"))
              if os.path.exists(os.path.join(out, p))}
    meta = {"model": "TinyLlama-1.1B-shaped Llama, random weights", "layers": args.layers,
            "parameters": params, "config": dict(TINYLLAMA, num_hidden_layers=args.layers),
            "input_bytes": inputs, "torch": torch.__version__}
    with open(os.path.join(out, "meta.json"), "w") as f:
        json.dump(meta, f, indent=2)
    print("done in %.0f s: %s" % (time.time() - started,
                                 ", ".join("%s %.2f GB" % (k, v / 1e9) for k, v in inputs.items())))


if __name__ == "__main__":
    main()
