#!/usr/bin/env python
"""What users run today to fuse an adapter: load the base in its dtype, peft's
`PeftModel.from_pretrained(...).merge_and_unload()`, `save_pretrained`.

  python bench/peft_merge.py BASE ADAPTER OUT
"""

import sys
import time
import warnings

import torch


def main(base, adapter, out):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    warnings.filterwarnings("ignore")
    logging.set_verbosity_error()
    t = time.time()
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16)
    model = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    model.save_pretrained(out)
    print("peft merge_and_unload + save_pretrained: %.2f s" % (time.time() - t))


if __name__ == "__main__":
    main(*sys.argv[1:4])
