#!/usr/bin/env python
"""torch's own consolidation of HuggingFaceStorageWriter(save_distributed=True) rank
files (torch.distributed.checkpoint._consolidate_hf_safetensors), as bench/run.py's
`torch tN` rows run it:

  python bench/torch_consolidate.py INPUT_DIR OUTPUT_DIR MAPPING.json THREADS

MAPPING.json is the fqn_to_index_mapping the save used (gen_titan.py writes it as
hf_sharded_mapping.json beside hf_sharded/); torch needs it to name its output files.
"""

import json
import os
import sys

from torch.distributed.checkpoint._consolidate_hf_safetensors import (
    consolidate_safetensors_files,
)


def main():
    src, out, mapping, threads = sys.argv[1:5]
    with open(mapping) as f:
        mapping = json.load(f)
    os.makedirs(out, exist_ok=True)  # torch does not create it
    consolidate_safetensors_files(input_dir=src, output_dir=out,
                                  fqn_to_index_mapping=mapping, num_threads=int(threads))


if __name__ == "__main__":
    main()
