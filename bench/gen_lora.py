#!/usr/bin/env python
"""A TinyLlama-1.1B-shaped bfloat16 base and an r=16 LoRA adapter on every linear
layer (peft `target_modules="all-linear"`, lora_B randomised), for measuring
`unshard merge ADAPTER --base BASE` against peft's merge (bench/peft_merge.py).

  /work/venv/bin/python bench/gen_lora.py OUT        # OUT/base (2.2 GB), OUT/adapter (49 MB)

Then, for example:

  /usr/bin/time -v unshard merge OUT/adapter --base OUT/base --output fused --quiet
  /usr/bin/time -v python bench/peft_merge.py OUT/base OUT/adapter fused-peft

Needs torch, transformers and peft. Nothing is downloaded.
"""

import os
import sys
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gen as benchgen  # noqa: E402


def main(out):
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging

    warnings.filterwarnings("ignore")
    logging.set_verbosity_error()
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**benchgen.TINYLLAMA))
    model = model.to_empty(device="cpu").to(torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.copy_((0.02 * torch.randn(p.shape, generator=g)).to(p.dtype))
    model.save_pretrained(os.path.join(out, "base"))
    pm = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_B" in name:
                p.copy_(0.01 * torch.randn(p.shape, generator=g))
    pm.save_pretrained(os.path.join(out, "adapter"))


if __name__ == "__main__":
    main(sys.argv[1])
