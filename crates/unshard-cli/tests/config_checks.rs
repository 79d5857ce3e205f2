//! Exit 0 means "this loads and is the checkpoint": merges onto a config-only base
//! are checked against what the config calls for (fixtures/arch_cases/, made by
//! fixtures/gen_arch_cases.py), `--base` takes a Hub id from the local cache, and
//! each failure says what to pass instead.
#![allow(clippy::unwrap_used)]

mod common;

use std::path::Path;
use std::process::{Command, Output};

use common::{fixtures, model_names, names};

fn run(args: &[&str], env: &[(&str, &Path)]) -> Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_unshard"));
    c.args(args).current_dir(fixtures());
    for k in [
        "HF_HUB_CACHE",
        "HUGGINGFACE_HUB_CACHE",
        "HF_HOME",
        "XDG_CACHE_HOME",
    ] {
        c.env_remove(k);
    }
    for (k, v) in env {
        c.env(k, v);
    }
    c.output().unwrap()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Runs a merge that must fail with exit 1, write nothing, and say each of `says`.
fn fails(ckpt: &str, base: Option<&str>, says: &[&str]) -> String {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    let mut args = vec!["merge", ckpt, "-o", out.to_str().unwrap()];
    if let Some(b) = base {
        args.extend(["--base", b]);
    }
    let o = run(&args, &[]);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(1), "{ckpt}: {err}");
    for s in says {
        assert!(err.contains(s), "{ckpt}: expected {s:?} in:\n{err}");
    }
    assert!(!out.exists(), "{ckpt}: output left behind");
    assert_eq!(names(tmp.path()), Vec::<String>::new());
    err
}

#[test]
fn one_layer_more_than_the_config_is_an_error_naming_the_field() {
    fails(
        "arch_cases/llama_3layers_vocab331.pt",
        Some("models/llama-config-only"),
        &["model.layers.2.* : the config has num_hidden_layers = 2 but the checkpoint has 3 layers", "hint: "],
    );
}

#[test]
fn another_vocabulary_is_an_error_naming_vocab_size() {
    fails(
        "arch_cases/llama_vocab331.pt",
        Some("models/llama-config-only"),
        &[
            "'model.embed_tokens.weight' is [331, 64]",
            "vocab_size = 251, the checkpoint 331",
            "'lm_head.weight'",
        ],
    );
}

#[test]
fn a_llama_checkpoint_does_not_merge_onto_a_qwen2_config() {
    fails(
        "ckpt/llama_policy.pt",
        Some("arch_cases/qwen2-config-only"),
        &[
            "Qwen2ForCausalLM",
            "model.layers.0.self_attn.q_proj.bias",
            "lacks",
        ],
    );
    // And the other way: the biases are named with the flag that rules them out.
    fails(
        "ckpt/qwen2_policy.pt",
        Some("models/llama-config-only"),
        &[
            "not part of this LlamaForCausalLM model",
            "q_proj.bias",
            "attention_bias = false",
        ],
    );
}

#[test]
fn a_model_model_prefix_is_aligned_to_the_layout() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    let o = run(
        &[
            "merge",
            "ckpt/llama_prefix_model_model.pt",
            "--base",
            "models/llama-config-only",
            "-o",
            out.to_str().unwrap(),
        ],
        &[],
    );
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(0), "{err}");
    assert!(
        err.contains("stripped the prefix 'model.' to match the LlamaForCausalLM layout"),
        "{err}"
    );
    // The same tensor names as transformers' own save of this model.
    let header = |p: &Path| -> Vec<String> {
        let b = std::fs::read(p).unwrap();
        let n = u64::from_le_bytes(b[..8].try_into().unwrap()) as usize;
        let h: serde_json::Map<String, serde_json::Value> =
            serde_json::from_slice(&b[8..8 + n]).unwrap();
        let mut k: Vec<String> = h
            .into_iter()
            .map(|(k, _)| k)
            .filter(|k| k != "__metadata__")
            .collect();
        k.sort();
        k
    };
    let want = header(&fixtures().join("expected/llama_policy_into_llama-bf16/model.safetensors"));
    assert_eq!(header(&out.join("model.safetensors")), want);
}

#[test]
fn zero3_placeholders_are_an_error_pointing_at_all_ranks() {
    let file = "arch_cases/zero3/global_step5/zero_pp_rank_0_mp_rank_00_model_states.pt";
    for base in [
        Some("models/llama-config-only"),
        Some("models/llama-bf16"),
        None,
    ] {
        fails(
            file,
            base,
            // The DeepSpeed reader recognises the file before planning sees its
            // [0]-shaped tensors (plan/layout.rs's own test covers other inputs).
            &[
                "[0]-shaped placeholders",
                "'model.embed_tokens.weight'",
                "with every rank's *_optim_states.pt",
            ],
        );
    }
}

#[test]
fn an_unknown_architecture_merges_with_a_warning_that_nothing_was_checked() {
    let tmp = tempfile::tempdir().unwrap();
    let base = tmp.path().join("base");
    std::fs::create_dir(&base).unwrap();
    let mut cfg: serde_json::Value = serde_json::from_slice(
        &std::fs::read(fixtures().join("models/llama-config-only/config.json")).unwrap(),
    )
    .unwrap();
    cfg["architectures"] = serde_json::json!(["MyLlamaVariantForCausalLM"]);
    std::fs::write(base.join("config.json"), cfg.to_string()).unwrap();
    let out = tmp.path().join("out");
    let o = run(
        &[
            "merge",
            "ckpt/llama_policy.pt",
            "--base",
            base.to_str().unwrap(),
            "-o",
            out.to_str().unwrap(),
        ],
        &[],
    );
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(0), "{err}");
    assert!(
        err.contains("nothing could be checked against config.json"),
        "{err}"
    );
    assert!(err.contains("MyLlamaVariantForCausalLM"), "{err}");
    // That base has no tokenizer either, and says so; never "no --base given".
    assert!(err.contains("the output has no tokenizer"), "{err}");
    assert!(!err.contains("no --base given"), "{err}");
}

#[test]
fn a_hub_id_resolves_in_the_local_cache_offline() {
    let cache = fixtures().join("arch_cases/hub_cache");
    for (id, env) in [
        (
            "unshard-fixtures/tiny-llama",
            ("HF_HUB_CACHE", cache.clone()),
        ),
        (
            "unshard-fixtures/tiny-llama@v1",
            ("HF_HUB_CACHE", cache.clone()),
        ),
    ] {
        let tmp = tempfile::tempdir().unwrap();
        let out = tmp.path().join("out");
        let o = run(
            &[
                "merge",
                "ckpt/llama_policy.pt",
                "--base",
                id,
                "-o",
                out.to_str().unwrap(),
            ],
            &[(env.0, &env.1)],
        );
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(0), "{id}: {err}");
        assert!(
            !err.contains("no tokenizer") && !err.contains("warning"),
            "{id}: {err}"
        );
        // The base's files came through the cache's symlinks.
        assert_eq!(
            model_names(&out),
            names(&fixtures().join("expected/llama_policy_into_llama-bf16"))
                .into_iter()
                .filter(|n| n != "model.safetensors.index.json")
                .collect::<Vec<_>>(),
            "{id}"
        );
        assert_eq!(
            std::fs::read(out.join("tokenizer.json")).unwrap(),
            std::fs::read(fixtures().join("models/llama-config-only/tokenizer.json")).unwrap()
        );
    }
    // HF_HOME/hub and XDG_CACHE_HOME/huggingface/hub are the cache too.
    let home = tempfile::tempdir().unwrap();
    std::os::unix::fs::symlink(&cache, home.path().join("hub")).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    let o = run(
        &[
            "merge",
            "ckpt/llama_policy.pt",
            "--base",
            "unshard-fixtures/tiny-llama",
            "-o",
            out.to_str().unwrap(),
        ],
        &[("HF_HOME", home.path())],
    );
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
}

#[test]
fn a_hub_id_not_in_the_cache_says_how_to_fetch_it() {
    let cache = fixtures().join("arch_cases/hub_cache");
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    let o = run(
        &[
            "merge",
            "ckpt/llama_policy.pt",
            "--base",
            "meta-llama/Llama-3.2-1B",
            "-o",
            out.to_str().unwrap(),
        ],
        &[("HF_HUB_CACHE", &cache)],
    );
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("meta-llama/Llama-3.2-1B"), "{err}");
    assert!(err.contains("not in the Hugging Face cache"), "{err}");
    assert!(err.contains("hf download meta-llama/Llama-3.2-1B"), "{err}");
    assert!(
        err.contains("huggingface-cli download meta-llama/Llama-3.2-1B"),
        "{err}"
    );
    // A revision the cache lacks lists the ones it has.
    let o = run(
        &[
            "merge",
            "ckpt/llama_policy.pt",
            "--base",
            "unshard-fixtures/tiny-llama@v2",
            "-o",
            out.to_str().unwrap(),
        ],
        &[("HF_HUB_CACHE", &cache)],
    );
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        err.contains("not at revision 'v2'") && err.contains("main, v1"),
        "{err}"
    );
    assert!(err.contains("--revision v2"), "{err}");
    assert!(!out.exists());
}

#[test]
fn a_local_directory_wins_over_a_hub_id_of_the_same_name() {
    // `models/llama-config-only` has the shape of an id; the directory is used
    // even with a cache that would not have it.
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    let o = run(
        &[
            "merge",
            "ckpt/llama_policy.pt",
            "--base",
            "models/llama-config-only",
            "-o",
            out.to_str().unwrap(),
        ],
        &[("HF_HUB_CACHE", tmp.path())],
    );
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
}

#[test]
fn a_trainer_checkpoint_uses_its_own_config_without_base() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    let o = run(
        &[
            "merge",
            "arch_cases/run/checkpoint-2",
            "-o",
            out.to_str().unwrap(),
        ],
        &[],
    );
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(0), "{err}");
    assert!(!err.contains("no config.json"), "{err}");
    let written = names(&out);
    assert!(written.contains(&"config.json".to_string()), "{written:?}");
    for junk in [
        "trainer_state.json",
        "training_args.bin",
        "optimizer.pt",
        "scheduler.pt",
    ] {
        assert!(
            !written.iter().any(|n| n == junk),
            "{junk} copied: {written:?}"
        );
    }
    let cfg = |p: &Path| -> serde_json::Value {
        serde_json::from_slice(&std::fs::read(p).unwrap()).unwrap()
    };
    let (a, b) = (
        cfg(&out.join("config.json")),
        cfg(&fixtures().join("arch_cases/run/checkpoint-2/config.json")),
    );
    assert_eq!(a["hidden_size"], b["hidden_size"]);
    assert_eq!(a["architectures"], b["architectures"]);
}

/// The checks stop wrong models, not right ones: every fixture checkpoint merges
/// onto the config-only base of its own family, tied heads and wrapper prefixes
/// included, and writes exactly the tensor names transformers writes.
#[test]
fn right_checkpoints_pass_the_check_onto_a_config_only_base() {
    for (ckpt, base) in [
        ("ckpt/llama_policy.pt", "models/llama-config-only"),
        ("ckpt/llama_fsdp_prefixed.pt", "models/llama-config-only"),
        ("sharded/llama_w3_dcp", "models/llama-config-only"),
        ("sharded/accelerate_dcp", "models/llama-config-only"),
        ("ckpt/qwen2_policy.pt", "arch_cases/qwen2-config-only"),
        ("sharded/qwen2_w2_dcp", "arch_cases/qwen2-config-only"),
    ] {
        let tmp = tempfile::tempdir().unwrap();
        let out = tmp.path().join("out");
        let o = run(
            &["merge", ckpt, "--base", base, "-o", out.to_str().unwrap()],
            &[],
        );
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(0), "{ckpt}: {err}");
        assert!(!err.contains("nothing could be checked"), "{ckpt}: {err}");
        let st = std::fs::read(out.join("model.safetensors")).unwrap();
        let n = u64::from_le_bytes(st[..8].try_into().unwrap()) as usize;
        let h: serde_json::Map<String, serde_json::Value> =
            serde_json::from_slice(&st[8..8 + n]).unwrap();
        let family = if base.contains("qwen2") {
            "qwen2-fp16"
        } else {
            "llama-bf16"
        };
        let want = std::fs::read(
            fixtures()
                .join("models")
                .join(family)
                .join("model.safetensors"),
        )
        .unwrap();
        let m = u64::from_le_bytes(want[..8].try_into().unwrap()) as usize;
        let w: serde_json::Map<String, serde_json::Value> =
            serde_json::from_slice(&want[8..8 + m]).unwrap();
        let keys = |x: &serde_json::Map<String, serde_json::Value>| {
            let mut k: Vec<&String> = x.keys().filter(|k| *k != "__metadata__").collect();
            k.sort();
            k.into_iter().cloned().collect::<Vec<String>>()
        };
        assert_eq!(keys(&h), keys(&w), "{ckpt}");
    }
}
