#!/usr/bin/env python
"""A TinyLlama-1.1B-shaped torchtitan checkpoint and HF-sharded safetensors set,
written from --ranks CPU processes (gloo) by torchtitan and torch themselves: the
inputs of bench/run.py's rows that put unshard beside torch's own
consolidate_safetensors_files (on hf_sharded/) and beside torchtitan's own export to
HF safetensors (on the checkpoint step; bench/titan_convert.py). Not committed: the
output is several GB.

  /work/venv/bin/python bench/gen_titan.py OUT [--ranks 4] [--dtype bfloat16]
        [--files 1] [--optimizer] [--small]

OUT/base/                      config.json + generation_config.json (transformers'
                               LlamaConfig of TinyLlama-1.1B's shape; no weights)
OUT/titan/checkpoint/step-1000/  torchtitan's CheckpointManager, last step, model only
                               (float32, as torchtitan trains), every parameter a DTensor
                               Shard(0) over --ranks ranks (fused wqkv -> wq/wk/wv written
                               whole by one rank, as torchtitan does)
OUT/titan/checkpoint/step-500/   with --optimizer: the same plus AdamW state, lr
                               scheduler, train state (3x the size)
OUT/hf_sharded/                torchtitan's to_hf of the same weights cast to --dtype,
                               dcp.save with HuggingFaceStorageWriter(save_distributed=True,
                               fqn_to_index_mapping over --files files):
                               shard-0000R-model-0000K-of-0000N.safetensors
OUT/meta.json                  the model's shape and the save's, for bench/run.py
OUT/hf_reference/              torch's consolidate_safetensors_files of hf_sharded/
                               (with --reference; checked equal to torchtitan's to_hf of
                               step-1000 read back by torch: the values a merge must give)

The model is built on the meta device and materialised per rank (to_empty), so each
process holds only its shards (about 1.1 GB fp32 at 4 ranks). Values: seeded normal
noise per (tensor, rank); norms around 1. --small shrinks the model (hidden 256,
2 layers, vocab 1000) for a quick check of the pipeline. The full size at 4 ranks
on 2 CPU cores: about 2.5 minutes, 4.8 GB peak RSS in the largest process, 4.1 GB
of DCP and 2.1 GB of bf16 shards.
"""

import argparse
import json
import os
import sys
import tempfile
import warnings
import zlib

import torch

TINYLLAMA = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                 num_attention_heads=32, num_key_value_heads=4, vocab_size=32000,
                 max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=10000.0,
                 tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
SMALL = dict(TINYLLAMA, hidden_size=256, intermediate_size=704, num_hidden_layers=2,
             num_attention_heads=8, num_key_value_heads=2, vocab_size=1000)
LAST_STEP, STEP = 1000, 500


def titan_config(h):
    import torchtitan.models.llama3 as m
    from torchtitan.models.common import Embedding, Linear, RMSNorm
    from torchtitan.models.common.rope import ComplexRoPE

    dim, vocab = h["hidden_size"], h["vocab_size"]
    return m.Llama3Model.Config(
        dim=dim, vocab_size=vocab, enable_weight_tying=False,
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim,
                                        param_init=m._EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=dim, eps=h["rms_norm_eps"], param_init=m._NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab,
                              param_init=m._output_linear_init(dim)),
        layers=m._build_llama3_layers(
            fuse_qkv=True, n_layers=h["num_hidden_layers"], dim=dim,
            n_heads=h["num_attention_heads"], n_kv_heads=h["num_key_value_heads"],
            hidden_dim=h["intermediate_size"],
            rope=ComplexRoPE.Config(dim=dim // h["num_attention_heads"],
                                    max_seq_len=h["max_position_embeddings"],
                                    theta=h["rope_theta"]),
            attn_backend="flex"),
    )


def fill_(model, rank):
    """Seeded values in each rank's local shards (no full tensor anywhere)."""
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        for name, p in model.named_parameters():
            local = p.to_local() if isinstance(p, DTensor) else p
            g = torch.Generator()
            g.manual_seed(zlib.crc32(name.encode()) * 64 + rank)
            if name.endswith("norm.weight"):
                local.copy_(1.0 + 0.1 * torch.randn(local.shape, generator=g))
            else:
                local.copy_(0.02 * torch.randn(local.shape, generator=g))


def file_mapping(names, files):
    """fqn -> output file index (1..files): layers spread evenly, embeddings in the
    first file, the final norm and head in the last (as HF's sharded repos do)."""
    if files == 1:
        return dict.fromkeys(names, 1)
    layers = sorted({int(n.split(".")[2]) for n in names if n.startswith("model.layers.")})
    per = -(-len(layers) // files)
    out = {}
    for n in names:
        if n.startswith("model.layers."):
            out[n] = 1 + int(n.split(".")[2]) // per
        elif n == "model.embed_tokens.weight":
            out[n] = 1
        else:
            out[n] = files
    return out


def job(rank, ws, args, initfile):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer
    from torchtitan.components.optimizer.optimizer import ParamGroupConfig
    from torchtitan.distributed.fsdp import apply_fsdp_to_decoder
    from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter

    warnings.filterwarnings("ignore")
    import logging

    logging.getLogger().setLevel(logging.ERROR)
    dist.init_process_group("gloo", init_method="file://" + initfile, rank=rank, world_size=ws)
    try:
        h = SMALL if args.small else TINYLLAMA
        cfg = titan_config(h)
        mesh = init_device_mesh("cpu", (ws,), mesh_dim_names=("fsdp",))
        with torch.device("meta"):
            model = cfg.build()
        apply_fsdp_to_decoder(model, mesh, param_dtype=torch.bfloat16,
                              reduce_dtype=torch.float32, pp_enabled=False)
        model.to_empty(device="cpu")
        for m in model.modules():  # non-persistent buffers (the RoPE cache)
            if hasattr(m, "_precompute_cache"):
                m.cache = m._precompute_cache()
        fill_(model, rank)

        opt = OptimizersContainer.Config(
            param_groups=[ParamGroupConfig(pattern=r".*", optimizer_name="AdamW",
                                           optimizer_kwargs={"lr": 0.0})],
            implementation="for-loop").build(model_parts=[model])
        lrs = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=opt,
                                                                 training_steps=LAST_STEP)
        os.chdir(os.path.join(args.out, "titan"))
        ckpt = CheckpointManager.Config(
            enable=True, folder="checkpoint", interval=STEP, keep_latest_k=0,
            last_save_model_only=True, export_dtype="float32",
        ).build(dataloader=None, model_parts=[model], optimizers=opt, lr_schedulers=lrs,
                states={"train_state": _TrainState()}, sd_adapter=None, base_folder="")
        if args.optimizer:
            ckpt.save(STEP)
        ckpt.save(LAST_STEP, last_step=True)
        ckpt.close()

        adapter = Llama3StateDictAdapter(cfg, None)
        dtype = getattr(torch, args.dtype)
        hf = adapter.to_hf(model.state_dict())
        hf = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in hf.items()}
        mapping = file_mapping(list(hf), args.files)
        writer = HuggingFaceStorageWriter(path=os.path.join(args.out, "hf_sharded"),
                                          fqn_to_index_mapping=mapping, save_distributed=True)
        dcp.save(hf, storage_writer=writer)
        if rank == 0:
            with open(os.path.join(args.out, "hf_sharded_mapping.json"), "w") as f:
                json.dump(mapping, f, indent=1)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def check_reference(args):
    """torch's consolidation equals torchtitan's to_hf of the DCP checkpoint, read
    back by torch (whole model in memory: run it where that fits)."""
    import glob

    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file
    from torch.distributed.checkpoint import FileSystemReader
    from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter

    path = os.path.join(args.out, "titan", "checkpoint", "step-%d" % LAST_STEP)
    md = FileSystemReader(path).read_metadata()
    sd = {k: torch.empty(tuple(v.size), dtype=v.properties.dtype)
          for k, v in md.state_dict_metadata.items()}
    dcp.load(sd, checkpoint_id=path, no_dist=True)
    cfg = titan_config(SMALL if args.small else TINYLLAMA)
    hf = Llama3StateDictAdapter(cfg, None).to_hf(sd)
    got = {}
    for f in glob.glob(os.path.join(args.out, "hf_reference", "*.safetensors")):
        got.update(load_file(f))
    assert set(got) == set(hf), sorted(set(got) ^ set(hf))
    for k, v in hf.items():
        assert torch.equal(got[k], v.to(getattr(torch, args.dtype))), k
    print("hf_reference == to_hf(step-%d), %d tensors" % (LAST_STEP, len(hf)))


class _TrainState:
    def state_dict(self):
        return {"step": LAST_STEP, "ntokens_seen": 0}

    def load_state_dict(self, sd):
        pass


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--files", type=int, default=1)
    ap.add_argument("--optimizer", action="store_true")
    ap.add_argument("--reference", action="store_true")
    ap.add_argument("--small", action="store_true")
    args = ap.parse_args()
    args.out = os.path.abspath(args.out)
    os.makedirs(os.path.join(args.out, "titan"), exist_ok=True)

    import torch.multiprocessing as mp
    from transformers import GenerationConfig, LlamaConfig

    h = dict(SMALL if args.small else TINYLLAMA)
    theta = h.pop("rope_theta")
    cfg = LlamaConfig(**h, rope_parameters={"rope_type": "default", "rope_theta": theta})
    cfg.dtype = args.dtype
    cfg.save_pretrained(os.path.join(args.out, "base"))
    GenerationConfig.from_model_config(cfg).save_pretrained(os.path.join(args.out, "base"))

    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(job, args=(args.ranks, args, os.path.join(tmp, "rendezvous")),
                 nprocs=args.ranks, join=True)
    if args.reference:
        from torch.distributed.checkpoint._consolidate_hf_safetensors import (
            consolidate_safetensors_files,
        )

        with open(os.path.join(args.out, "hf_sharded_mapping.json")) as f:
            mapping = json.load(f)
        ref = os.path.join(args.out, "hf_reference")
        os.makedirs(ref, exist_ok=True)
        consolidate_safetensors_files(os.path.join(args.out, "hf_sharded"), ref, mapping)
        check_reference(args)
    write_meta(args, h)
    print("wrote", args.out)


def write_meta(args, h):
    """meta.json, for bench/run.py: the shape of the model and of the save."""
    d, inter, layers, vocab = (h["hidden_size"], h["intermediate_size"],
                               h["num_hidden_layers"], h["vocab_size"])
    kv = d // h["num_attention_heads"] * h["num_key_value_heads"]
    per_layer = d * d * 2 + d * kv * 2 + 3 * d * inter + 2 * d
    params = 2 * vocab * d + layers * per_layer + d
    with open(os.path.join(args.out, "meta.json"), "w") as f:
        json.dump(dict(model="TinyLlama-1.1B-shaped Llama 3 (torchtitan's to_hf), random weights",
                       kind="hf_sharded", layers=layers, parameters=params, ranks=args.ranks,
                       files=args.files, dtype=args.dtype,
                       torch=torch.__version__), f, indent=2)


if __name__ == "__main__":
    sys.exit(main())
