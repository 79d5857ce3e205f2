#!/usr/bin/env python3
"""Writes a DeepSeek-V3-shaped mixture-of-experts checkpoint at narrow width, as a
DPO trainer saves it: DeepSeek-V3's tensor count (61 layers, the first 3 dense,
256 routed experts and one shared expert in each of the other 58, so 58 x 256 x 3
= 44,544 routed-expert tensors in the model's files) with a hidden size of 64, so
that what grows with the number of tensors (headers, index, plan, the mapping of
packed experts) can be measured without DeepSeek-V3's 1.3 TB.

  python3 bench/gen_moe_wide.py --out /data/bench/moe-deepseek-v3 [--expected]

Writes
  OUT/policy.pt  torch.save({'step_idx', 'state', 'metrics'}) of model.state_dict()
                 in float32 (--dtype bfloat16 for a bf16 trainer): transformers'
                 in-memory layout, each MoE layer's routed experts packed into
                 mlp.experts.gate_up_proj [256, 2I, H] and mlp.experts.down_proj
                 [256, H, I]
  OUT/base/      save_pretrained of the model in bfloat16 (by way of from_pretrained,
                 so that the router weights the class keeps in float32 stay float32):
                 the per-expert names of the model's files (mlp.experts.J.gate_proj.weight,
                 ...), which `unshard merge --base` writes the packed tensors as
  OUT/expected/  (--expected) transformers' own merge: from_pretrained(base,
                 dtype=bfloat16) -> load_state_dict(state) -> save_pretrained
  OUT/meta.json  the shape, tensor counts and sizes, read by run.py

The model is transformers' DeepseekV3ForCausalLM (its own layout, its own save),
with seeded random weights; --layers, --experts, --dense, --hidden and
--moe-intermediate change the shape. Needs torch and transformers 5.
"""

import argparse
import json
import os
import tempfile
import time
import warnings


def du(path):
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def file_tensors(d):
    """The number of tensors in a save_pretrained directory (headers only)."""
    from safetensors import safe_open

    n = 0
    for f in sorted(os.listdir(d)):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(d, f), "pt") as st:
                n += len(list(st.keys()))
    return n


def config(args):
    from transformers import DeepseekV3Config

    h = args.hidden
    return DeepseekV3Config(
        hidden_size=h, intermediate_size=4 * h, moe_intermediate_size=args.moe_intermediate,
        num_hidden_layers=args.layers, first_k_dense_replace=args.dense,
        n_routed_experts=args.experts, n_shared_experts=1, num_experts_per_tok=8,
        n_group=8, topk_group=4, num_attention_heads=2, num_key_value_heads=2,
        q_lora_rank=h // 2, kv_lora_rank=h // 2, qk_nope_head_dim=16, qk_rope_head_dim=16,
        v_head_dim=16, vocab_size=args.vocab, max_position_embeddings=256,
        tie_word_embeddings=False, bos_token_id=0, eos_token_id=1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=61)
    ap.add_argument("--dense", type=int, default=3, help="leading dense layers (first_k_dense_replace)")
    ap.add_argument("--experts", type=int, default=256, help="routed experts per MoE layer")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--moe-intermediate", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                    help="dtype of policy.pt's tensors (what the trainer held)")
    ap.add_argument("--expected", action="store_true",
                    help="also write OUT/expected: transformers' own merge, to compare bytes with")
    args = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    warnings.filterwarnings("ignore")
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    os.environ.setdefault("TQDM_DISABLE", "1")
    t0 = time.time()
    os.makedirs(args.out, exist_ok=True)
    base = os.path.join(args.out, "base")

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config(args)).float()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if not t.is_floating_point():
                continue
            if name.endswith("norm.weight"):
                t.copy_(1.0 + 0.1 * torch.randn(t.shape, generator=g))
            else:
                t.copy_(0.05 * torch.randn(t.shape, generator=g))
    # The base: saved in float32, then loaded in bfloat16 and saved again, as
    # transformers would ship it.
    with tempfile.TemporaryDirectory(dir=args.out) as tmp:
        model.save_pretrained(tmp)
        AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.bfloat16).save_pretrained(base)

    # The trained checkpoint: the same weights plus seeded noise, in memory's layout.
    gn = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for t in model.state_dict().values():
            if t.is_floating_point():
                t.add_(0.01 * torch.randn(t.shape, generator=gn))
    state = model.state_dict()
    if args.dtype == "bfloat16":
        state = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in state.items()}
    packed = sum(1 for k in state if ".experts.gate_up_proj" in k or ".experts.down_proj" in k)
    torch.save({"step_idx": 10, "state": state, "metrics": {"loss": 0.25}},
               os.path.join(args.out, "policy.pt"))

    if args.expected:
        exp = AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16)
        exp.load_state_dict(state, strict=True)
        exp.save_pretrained(os.path.join(args.out, "expected"))
        del exp

    moe_layers = args.layers - args.dense
    meta = {
        "model": "DeepSeek-V3-shaped MoE (transformers' DeepseekV3ForCausalLM), narrow, random weights",
        "kind": "moe",
        "layers": args.layers,
        "dense_layers": args.dense,
        "experts": args.experts,
        "hidden": args.hidden,
        "moe_intermediate": args.moe_intermediate,
        "parameters": sum(t.numel() for t in model.parameters()),
        "policy_tensors": len(state),
        "packed_tensors": packed,
        "expert_tensors": moe_layers * args.experts * 3,
        "tensors": file_tensors(base),
        "policy_dtype": args.dtype,
        "input_bytes": {"base": du(base), "policy": du(os.path.join(args.out, "policy.pt"))},
        "torch": torch.__version__,
    }
    with open(os.path.join(args.out, "meta.json"), "w") as f:
        json.dump(meta, f, indent=2)
    print("%d tensors in policy.pt (%d packed), %d in base/ (%d routed-expert), policy %.0f MB, "
          "base %.0f MB, %.0f s" % (len(state), packed, meta["tensors"], meta["expert_tensors"],
                                    meta["input_bytes"]["policy"] / 1e6,
                                    meta["input_bytes"]["base"] / 1e6, time.time() - t0))


if __name__ == "__main__":
    main()
