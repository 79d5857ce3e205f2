#!/usr/bin/env python
"""torchtitan's own export of a DCP checkpoint to Hugging Face safetensors, the path of
its scripts/checkpoint_conversion/convert_to_hf.py, as bench/run.py's `torchtitan`
rows run it:

  python bench/titan_convert.py INPUT_DIR OUTPUT_DIR CONFIG.json
        [--export-dtype float32|bfloat16|float16] [--hf-assets-path DIR]

INPUT_DIR is a torchtitan checkpoint step (e.g. checkpoint/step-1000 of gen_titan.py),
CONFIG.json the transformers config.json of the model's shape (gen_titan.py's
base/config.json): torchtitan's script takes a registered flavor instead, and the
TinyLlama-1.1B shape is none of them, so the model's config is built from it the way
gen_titan.py built the model that saved the checkpoint.

The steps are torchtitan's and torch's own calls, in the script's order: the model is
built on the CPU (every parameter allocated and initialised), its state dict (through
torchtitan's ModelWrapper) is filled by dcp.load from INPUT_DIR, the llama3 model's
state-dict adapter maps it to transformers' names (to_hf), the tensors are cast to
--export-dtype (torchtitan's default: float32, as trained), and dcp.save writes them
with HuggingFaceStorageWriter(save_distributed=True, enable_consolidation=True,
5 consolidation threads): rank files in OUTPUT_DIR/sharded, then one consolidated
model-00001-of-00001.safetensors (or the files of --hf-assets-path's
model.safetensors.index.json). Only safetensors are written, no config.json.
"""

import argparse
import json
import os
import sys
import warnings

import torch


def model_config(path):
    """torchtitan's Llama3Model.Config of the shape in a transformers config.json."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from gen_titan import TINYLLAMA, titan_config

    with open(path) as f:
        hf = json.load(f)
    h = {k: hf[k] for k in TINYLLAMA if k in hf}
    rope = hf.get("rope_parameters") or {}
    h["rope_theta"] = rope.get("rope_theta", hf.get("rope_theta", TINYLLAMA["rope_theta"]))
    return titan_config(h)


@torch.inference_mode()
def convert(src, out, config, export_dtype, hf_assets_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torchtitan.components.checkpoint import ModelWrapper
    from torchtitan.config import TORCH_DTYPE_MAP
    from torchtitan.models.llama3 import Llama3StateDictAdapter  # llama3's model_registry's

    cfg = model_config(config)
    with torch.device("cpu"):
        model = cfg.build()
    model = ModelWrapper(model)
    adapter = Llama3StateDictAdapter(cfg, hf_assets_path)

    state_dict = model._get_state_dict()
    dcp.load(state_dict, checkpoint_id=src)
    hf_state_dict = adapter.to_hf(state_dict)

    writer = HuggingFaceStorageWriter(
        path=out, save_distributed=True,
        fqn_to_index_mapping=adapter.fqn_to_index_mapping,
        enable_consolidation=True, thread_count_consolidation=5)
    dtype = TORCH_DTYPE_MAP[export_dtype]
    if dtype != torch.float32:
        hf_state_dict = {k: v.to(dtype) for k, v in hf_state_dict.items()}
    dcp.save(hf_state_dict, storage_writer=writer)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("input_dir")
    ap.add_argument("output_dir")
    ap.add_argument("config")
    ap.add_argument("--export-dtype", default="float32",
                    choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--hf-assets-path")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    convert(args.input_dir, args.output_dir, args.config, args.export_dtype,
            args.hf_assets_path)


if __name__ == "__main__":
    main()
