#!/usr/bin/env python
"""Writes bench/gen.py's `policy.pt` and `base/` without torch or transformers.

The same TinyLlama-shaped model (4 layers by default: 1.23 GB of float32), the same
tensor names and order, and the same file kinds:

  policy.pt   a DPO-style float32 torch.save zip: {'step_idx', 'state', 'metrics'},
              one storage per tensor, pickle protocol 2 (as torch.save writes it)
  base/       config.json, generation_config.json and model.safetensors in bfloat16

The values are random (numpy), not gen.py's (torch's generator). What differs from
torch.save's own archive: entries are not padded to 64-byte boundaries and the zip
is written by Python's zipfile (both are read as torch.save's are). For the remote
benchmark when torch cannot be installed:

  python3 bench/gen_policy.py --out /tmp/bench-4l --layers 4
  python3 bench/remote.py --data /tmp/bench-4l --unshard target/release/unshard --json out.json

Needs numpy.
"""

import argparse
import collections
import json
import os
import pickle
import struct
import sys
import types
import zipfile

import numpy as np

HIDDEN, INTER, HEADS, KV, VOCAB = 2048, 5632, 32, 4, 32000


def shapes(layers):
    head = HIDDEN // HEADS
    out = [("model.embed_tokens.weight", (VOCAB, HIDDEN))]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [
            (p + "self_attn.q_proj.weight", (HIDDEN, HIDDEN)),
            (p + "self_attn.k_proj.weight", (KV * head, HIDDEN)),
            (p + "self_attn.v_proj.weight", (KV * head, HIDDEN)),
            (p + "self_attn.o_proj.weight", (HIDDEN, HIDDEN)),
            (p + "mlp.gate_proj.weight", (INTER, HIDDEN)),
            (p + "mlp.up_proj.weight", (INTER, HIDDEN)),
            (p + "mlp.down_proj.weight", (HIDDEN, INTER)),
            (p + "input_layernorm.weight", (HIDDEN,)),
            (p + "post_attention_layernorm.weight", (HIDDEN,)),
        ]
    return out + [("model.norm.weight", (HIDDEN,)), ("lm_head.weight", (VOCAB, HIDDEN))]


def values(rng, name, shape):
    n = int(np.prod(shape))
    if name.endswith("norm.weight"):
        return rng.uniform(0.5, 1.5, n).astype(np.float32)
    return (rng.standard_normal(n, dtype=np.float32) * np.float32(0.02)).astype(np.float32)


# torch's globals, as modules of their own so that pickle writes them by name.
torch = types.ModuleType("torch")
torch_utils = types.ModuleType("torch._utils")


class FloatStorage:
    pass


def _rebuild_tensor_v2(*args):
    raise NotImplementedError


FloatStorage.__module__ = "torch"
_rebuild_tensor_v2.__module__ = "torch._utils"
torch.FloatStorage = FloatStorage
torch._utils = torch_utils
torch_utils._rebuild_tensor_v2 = _rebuild_tensor_v2
sys.modules["torch"], sys.modules["torch._utils"] = torch, torch_utils


class Storage:
    def __init__(self, key, numel):
        self.key, self.numel = key, numel


class Tensor:
    def __init__(self, storage, shape):
        self.storage, self.shape = storage, shape

    def __reduce__(self):
        stride = tuple(int(np.prod(self.shape[i + 1:])) for i in range(len(self.shape)))
        return (_rebuild_tensor_v2,
                (self.storage, 0, tuple(self.shape), stride, False, collections.OrderedDict()))


class Pickler(pickle.Pickler):
    def persistent_id(self, obj):
        if isinstance(obj, Storage):
            return ("storage", FloatStorage, obj.key, "cpu", obj.numel)
        return None


def write_policy(path, layers, rng):
    import io

    tensors = shapes(layers)
    state = collections.OrderedDict()
    for i, (name, shape) in enumerate(tensors):
        state[name] = Tensor(Storage(str(i), int(np.prod(shape))), shape)
    buf = io.BytesIO()
    Pickler(buf, protocol=2).dump({"step_idx": 1000, "state": state, "metrics": {"loss": 0.25}})
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        z.writestr("policy/data.pkl", buf.getvalue())
        z.writestr("policy/.format_version", "1")
        z.writestr("policy/byteorder", "little")
        for i, (name, shape) in enumerate(tensors):
            with z.open(f"policy/data/{i}", "w", force_zip64=True) as f:
                f.write(values(rng, name, shape).tobytes())
        z.writestr("policy/version", "3\n")


def write_base(out, layers, rng):
    os.makedirs(out, exist_ok=True)
    tensors = shapes(layers)
    header, offset = {}, 0
    for name, shape in tensors:
        n = int(np.prod(shape)) * 2
        header[name] = dict(dtype="BF16", shape=list(shape), data_offsets=[offset, offset + n])
        offset += n
    header["__metadata__"] = {"format": "pt"}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(os.path.join(out, "model.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for name, shape in tensors:
            v = values(rng, name, shape).view(np.uint32)
            f.write(((v + 0x7FFF + ((v >> 16) & 1)) >> 16).astype(np.uint16).tobytes())
    config = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=HIDDEN,
                  intermediate_size=INTER, num_hidden_layers=layers, num_attention_heads=HEADS,
                  num_key_value_heads=KV, vocab_size=VOCAB, max_position_embeddings=2048,
                  rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                  hidden_act="silu", rope_theta=10000.0, torch_dtype="bfloat16")
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    with open(os.path.join(out, "generation_config.json"), "w") as f:
        json.dump(dict(bos_token_id=1, eos_token_id=2), f, indent=2)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=4)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    write_base(os.path.join(args.out, "base"), args.layers, np.random.default_rng(7))
    write_policy(os.path.join(args.out, "policy.pt"), args.layers, np.random.default_rng(1))
    print(f"{args.out}: policy.pt {os.path.getsize(os.path.join(args.out, 'policy.pt')) / 1e9:.2f} GB")


if __name__ == "__main__":
    main()
