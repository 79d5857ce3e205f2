#!/usr/bin/env python3
"""Writes a DCP directory as a job of many ranks would, with tiny weights: the layout
of a big model saved by FSDP2 over RANKS ranks (every tensor Shard(0) over all ranks,
one `__R_0.distcp` file per rank, one `torch.save` archive per chunk, a `.metadata`
pickle of torch's own dataclasses), so that what grows with the rank count (the
metadata, the number of files and chunks) can be measured without terabytes of data.

  python3 bench/gen_wide.py --out /data/bench/wide-512 --ranks 512 --layers 32 [--optim]

Writes OUT/dcp (the checkpoint) and OUT/base (config.json for `unshard merge --base`).
--optim adds Adam's exp_avg and exp_avg_sq for every parameter to the same
checkpoint, as torchtitan saves them. --metadata-only writes the `.metadata` of
Llama-3-405B's real shapes (hidden 16384, 126 layers unless --layers says otherwise,
fp32) and rank files of the right length that hold no archives: for the metadata
alone (`unshard inspect` parses it, then reports the first chunk that is not an
archive; since the archive scan looks at both ends of every chunk before that
report, and the files are sparse, it takes tens of seconds, so time the parse in
a profile rather than by `inspect`'s wall). --kind ranks writes verl's layout instead: OUT/ranks/model_world_size_N_rank_R.pt,
one `torch.save` of the model's state dict per rank whose every value is a DTensor
(`Shard(0)` over a 1-D mesh of all ranks, local shards split by the `torch.chunk` rule
as FSDP2 saves them, empty ones included), made by torch itself in one process over a
fake process group re-created for each rank. --experts E adds a mixture-of-experts
block of E experts (three weights each, named as Qwen-MoE names them) to every layer:
many tensors per file, for `unshard inspect` (OUT/base/config.json stays a Llama's,
so a merge refuses those names).
Needs torch.
"""

import argparse
import io
import json
import os
import pickle
import time

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)


def llama_shapes(layers, hidden, inter, vocab, kv, experts=0):
    shapes = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(layers):
        p = "model.layers.%d." % i
        shapes[p + "self_attn.q_proj.weight"] = (hidden, hidden)
        shapes[p + "self_attn.k_proj.weight"] = (kv, hidden)
        shapes[p + "self_attn.v_proj.weight"] = (kv, hidden)
        shapes[p + "self_attn.o_proj.weight"] = (hidden, hidden)
        shapes[p + "mlp.gate_proj.weight"] = (inter, hidden)
        shapes[p + "mlp.up_proj.weight"] = (inter, hidden)
        shapes[p + "mlp.down_proj.weight"] = (hidden, inter)
        shapes[p + "input_layernorm.weight"] = (hidden,)
        shapes[p + "post_attention_layernorm.weight"] = (hidden,)
        if experts:
            shapes[p + "mlp.gate.weight"] = (experts, hidden)
        for e in range(experts):
            q = p + "mlp.experts.%d." % e
            shapes[q + "gate_proj.weight"] = (inter, hidden)
            shapes[q + "up_proj.weight"] = (inter, hidden)
            shapes[q + "down_proj.weight"] = (hidden, inter)
    shapes["model.norm.weight"] = (hidden,)
    shapes["lm_head.weight"] = (vocab, hidden)
    return shapes


def checkpoint_entries(shapes, optim):
    """(fqn in the checkpoint, planner path, shape) of every entry: the model's, then,
    with optim, Adam's two moments per parameter."""
    entries = []
    for name, shape in shapes.items():
        entries.append(("model." + name, ("model", name), shape))
        if optim:
            for k in ("exp_avg", "exp_avg_sq"):
                entries.append(("optim.state.%s.%s" % (name, k), ("optim", "state", name, k),
                                shape))
    return entries


def metadata_only(args):
    r = args.ranks
    shapes = llama_shapes(args.layers, 16384, 53248, 128256, 1024)
    entries = checkpoint_entries(shapes, args.optim)
    sdm, storage, planner = {}, {}, {}
    sizes = [0] * r
    for fqn, path, shape in entries:
        rows = -(-shape[0] // r)
        chunks = []
        for rank in range(r):
            a, b = min(rank * rows, shape[0]), min((rank + 1) * rows, shape[0])
            if b <= a:
                continue
            part = torch.Size([b - a] + list(shape[1:]))
            off = torch.Size([a] + [0] * (len(shape) - 1))
            chunks.append(ChunkStorageMetadata(offsets=off, sizes=part))
            nbytes = part.numel() * 4
            storage[MetadataIndex(fqn, off)] = _StorageInfo(
                "__%d_0.distcp" % rank, sizes[rank], nbytes)
            sizes[rank] += nbytes
        sdm[fqn] = TensorStorageMetadata(
            properties=TensorProperties(dtype=torch.float32), size=torch.Size(shape),
            chunks=chunks)
        planner[fqn] = path
    dcp = os.path.join(args.out, "dcp")
    os.makedirs(dcp, exist_ok=True)
    md = Metadata(state_dict_metadata=sdm, planner_data=planner, storage_data=storage)
    with open(os.path.join(dcp, ".metadata"), "wb") as f:
        pickle.dump(md, f)
    for rank in range(r):
        with open(os.path.join(dcp, "__%d_0.distcp" % rank), "wb") as f:
            f.truncate(sizes[rank])  # sparse: no disk space, no archives
    md_bytes = os.path.getsize(os.path.join(dcp, ".metadata"))
    print("%d entries, %d chunks, .metadata %.1f MB (metadata only)" % (
        len(entries), len(storage), md_bytes / 1e6))


def write_base(out, layers, hidden, inter, vocab, h):
    base = os.path.join(out, "base")
    os.makedirs(base, exist_ok=True)
    config = dict(
        architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=hidden,
        intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=h // 64 or 1,
        num_key_value_heads=h // 64 or 1, vocab_size=vocab, tie_word_embeddings=False,
        torch_dtype="bfloat16", max_position_embeddings=2048, rms_norm_eps=1e-5)
    with open(os.path.join(base, "config.json"), "w") as f:
        json.dump(config, f, indent=2)


def rank_files(args):
    """verl's per-rank files: torch.save(model.state_dict()) on every rank of FSDP2."""
    import warnings

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    warnings.filterwarnings("ignore")
    r = args.ranks
    h = args.hidden or 64
    hidden, inter, vocab, kv = h, 2 * h, 2 * r, h
    shapes = llama_shapes(args.layers, hidden, inter, vocab, kv, args.experts)
    out = os.path.join(args.out, "ranks")
    os.makedirs(out, exist_ok=True)
    t0 = time.time()
    gen = torch.Generator().manual_seed(0)
    # Each tensor's full value once; each rank's shard is a view of it.
    fulls = {n: torch.randn(s, generator=gen).to(torch.bfloat16) for n, s in shapes.items()}
    total, shards = 0, 0
    for rank in range(r):
        dist.init_process_group("fake", rank=rank, world_size=r, store=FakeStore())
        mesh = init_device_mesh("cpu", (r,))
        sd = {}
        for name, full in fulls.items():
            rows = -(-full.shape[0] // r)
            a, b = min(rank * rows, full.shape[0]), min((rank + 1) * rows, full.shape[0])
            local = full[a:b].clone()
            sd[name] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False,
                                          shape=full.shape, stride=full.stride())
            shards += b > a
        path = os.path.join(out, "model_world_size_%d_rank_%d.pt" % (r, rank))
        torch.save(sd, path)
        total += os.path.getsize(path)
        dist.destroy_process_group()
    write_base(args.out, args.layers, hidden, inter, vocab, h)
    print("%d tensors, %d DTensors in %d files (%d non-empty shards), data %.1f MB, %.0f s" % (
        len(shapes), len(shapes) * r, r, shards, total / 1e6, time.time() - t0))
    with open(os.path.join(args.out, "meta.json"), "w") as f:
        json.dump(dict(ranks=r, layers=args.layers, optim=False, hidden=h, entries=len(shapes),
                       experts=args.experts, kind="ranks", dtensors=len(shapes) * r,
                       chunks=shards), f)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--ranks", type=int, default=512)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--optim", action="store_true")
    ap.add_argument("--metadata-only", action="store_true")
    ap.add_argument("--kind", choices=("dcp", "ranks"), default="dcp",
                    help="dcp (default), or ranks: verl's per-rank torch.save files of DTensors "
                    "(hidden size 64 unless --hidden says otherwise)")
    ap.add_argument("--experts", type=int, default=0,
                    help="experts per layer (three weights each), --kind ranks only")
    ap.add_argument("--hidden", type=int,
                    help="hidden size (default: the rank count); with a hidden size below the "
                    "rank count, the vocabulary is twice the rank count, so that the embedding "
                    "and lm_head span every rank while the other tensors leave some ranks empty "
                    "(as FSDP2 does): a checkpoint of many ranks and little data")
    args = ap.parse_args()
    if args.metadata_only:
        return metadata_only(args)
    if args.kind == "ranks":
        return rank_files(args)
    r = args.ranks
    # By default every dimension that is sharded is a multiple of the rank count: no
    # rank is empty. With --hidden, rows are split as torch.chunk does (ceil-divided;
    # the last ranks get none).
    h = args.hidden or r
    hidden, inter, vocab, kv = h, 2 * h, 2 * r, h
    shapes = llama_shapes(args.layers, hidden, inter, vocab, kv)
    entries = checkpoint_entries(shapes, args.optim)

    dcp = os.path.join(args.out, "dcp")
    os.makedirs(dcp, exist_ok=True)
    t0 = time.time()
    files = [open(os.path.join(dcp, "__%d_0.distcp" % i), "wb") for i in range(r)]
    sizes = [0] * r
    gen = torch.Generator().manual_seed(0)
    sdm, storage, planner = {}, {}, {}
    for fqn, path, shape in entries:
        full = torch.randn(shape, generator=gen).to(torch.bfloat16)
        if args.hidden:
            rows = -(-shape[0] // r)
        else:
            rows = shape[0] // r if len(shape) > 1 or shape[0] % r == 0 else None
        chunks = []
        for rank in range(r):
            if rows is None:
                # Too short to shard over every rank: rank 0 holds it whole.
                if rank:
                    continue
                part, offsets = full, [0] * len(shape)
            else:
                if rank * rows >= shape[0]:
                    continue
                part = full[rank * rows:(rank + 1) * rows]
                offsets = [rank * rows] + [0] * (len(shape) - 1)
            buf = io.BytesIO()
            torch.save(part.clone(), buf)
            data = buf.getvalue()
            files[rank].write(data)
            off = torch.Size(offsets)
            chunks.append(ChunkStorageMetadata(offsets=off, sizes=part.shape))
            storage[MetadataIndex(fqn, off)] = _StorageInfo(
                "__%d_0.distcp" % rank, sizes[rank], len(data))
            sizes[rank] += len(data)
        sdm[fqn] = TensorStorageMetadata(
            properties=TensorProperties(dtype=torch.bfloat16), size=torch.Size(shape),
            chunks=chunks)
        planner[fqn] = path
    for f in files:
        f.close()
    md = Metadata(state_dict_metadata=sdm, planner_data=planner, storage_data=storage)
    with open(os.path.join(dcp, ".metadata"), "wb") as f:
        pickle.dump(md, f)

    write_base(args.out, args.layers, hidden, inter, vocab, h)
    md_bytes = os.path.getsize(os.path.join(dcp, ".metadata"))
    print("%d entries, %d chunks in %d files, .metadata %.1f MB, data %.1f MB, %.0f s" % (
        len(entries), len(storage), r, md_bytes / 1e6, sum(sizes) / 1e6, time.time() - t0))
    with open(os.path.join(args.out, "meta.json"), "w") as f:
        json.dump(dict(ranks=r, layers=args.layers, optim=args.optim, hidden=h, entries=len(entries),
                       chunks=len(storage), metadata_bytes=md_bytes), f)


if __name__ == "__main__":
    main()
