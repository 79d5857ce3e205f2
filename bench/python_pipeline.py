#!/usr/bin/env python
"""The Python pipeline unshard replaces, as users run it today.

  pt  CHECKPOINT BASE OUT   from_pretrained(BASE) + load_state_dict(torch.load(CHECKPOINT)['state'])
                            + save_pretrained(OUT)
  dcp DCP_DIR BASE OUT      dcp_to_torch_save(DCP_DIR, tmp.pt), then the same with
                            torch.load(tmp.pt) (a flat state dict)

The model is loaded in the base config's dtype (bfloat16 here), so the output is
what `unshard merge CHECKPOINT --base BASE` writes. Timed by run.py as a whole
process, imports included.
"""

import os
import sys
import warnings


def main():
    kind, ckpt, base, out = sys.argv[1:5]
    warnings.filterwarnings("ignore")
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()

    model = AutoModelForCausalLM.from_pretrained(base, dtype="auto")
    tmp = None
    if kind == "pt":
        state = torch.load(ckpt, weights_only=True)["state"]
    elif kind == "dcp":
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        tmp = out + ".full.pt"
        dcp_to_torch_save(ckpt, tmp)
        state = torch.load(tmp, weights_only=True)
    else:
        sys.exit("unknown kind %r" % kind)
    model.load_state_dict(state, strict=True)
    del state
    model.save_pretrained(out)
    if tmp:
        os.remove(tmp)


if __name__ == "__main__":
    main()
