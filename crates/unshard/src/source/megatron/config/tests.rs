#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

use super::*;
use crate::source::megatron::args;

fn json(path: &Path) -> Value {
    serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap()
}

/// `(case, checkpoint dir, base dir)` of every fixture case.
fn cases() -> Vec<(String, PathBuf, PathBuf)> {
    let root = crate::fixtures().join("megatron");
    let cases = json(&root.join("cases.json"));
    cases["cases"]
        .as_object()
        .unwrap()
        .iter()
        .map(|(name, c)| {
            let dir = root.join(c["checkpoint_dir"].as_str().unwrap());
            // The iteration folder a save folder names, as the reader opens it.
            let dir = crate::source::megatron::iteration_dir(&dir)
                .unwrap()
                .map_or(dir, |(d, _)| d);
            let base = root.join(c["base"].as_str().unwrap());
            (name.clone(), dir, base)
        })
        .collect()
}

fn derived(dir: &Path) -> DerivedConfig {
    let a = args::read(dir)
        .unwrap()
        .unwrap_or_else(|| panic!("no training arguments in {}", dir.display()));
    hf_config(&a).unwrap()
}

/// Fields of transformers' config.json the training arguments cannot give.
const NOT_IN_ARGS: &[&str] = &[
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "transformers_version",
];

/// Compares a derived config with the config.json transformers wrote, field by
/// field: every field of transformers' is there with its value, and nothing else,
/// but for the token ids (null) and a padded `vocab_size`.
fn assert_matches(
    case: &str,
    got: &Map<String, Value>,
    want: &Map<String, Value>,
    padded: Option<u64>,
) {
    for (k, v) in want {
        if NOT_IN_ARGS.contains(&k.as_str()) {
            continue;
        }
        if let (Some(p), "vocab_size") = (padded, k.as_str()) {
            assert_eq!(got[k], p, "{case}");
            continue;
        }
        assert_eq!(got.get(k), Some(v), "{case}: field {k}");
    }
    for (k, v) in got {
        if ["bos_token_id", "eos_token_id", "pad_token_id"].contains(&k.as_str()) {
            assert_eq!(v, &Value::Null, "{case}: {k}");
            continue;
        }
        assert!(
            want.contains_key(k),
            "{case}: field {k} is not in transformers' config"
        );
    }
}

fn object(v: Value) -> Map<String, Value> {
    serde_json::from_value(v).unwrap()
}

/// The config derived from each checkpoint fixture's arguments against the
/// config.json transformers wrote for the model the checkpoint was made from.
#[test]
fn derived_configs_match_the_ones_transformers_wrote() {
    for (case, dir, base) in cases() {
        let got = derived(&dir).config;
        let want = object(json(&base.join("config.json")));
        // The tokenizer's 251 tokens, padded to 256 by Megatron: the arguments
        // know only the padded size.
        let padded = (case == "llama_tp2_padded_vocab").then(|| {
            assert_eq!(want["vocab_size"], 251);
            256
        });
        assert_matches(&case, &got, &want, padded);
    }
}

/// The same for the arguments-only fixtures (`fixtures/gen_megatron_args.py`): a
/// dense Qwen3, and a float32 Llama without grouped-query attention whose
/// arguments use newer Megatron-LM's names; and arguments refused by the name the
/// generator gives (`refuses`: a Llama 3.1-style rope scaling); and a Namespace
/// holding an `os.system` call, read as data and reported (`unsafe`).
#[test]
fn derived_configs_of_arguments_alone_match_transformers() {
    let root = crate::fixtures().join("megatron/args");
    let (mut derived_seen, mut refused_seen) = (0, 0);
    for e in std::fs::read_dir(&root).unwrap() {
        let dir = e.unwrap().path();
        let case = dir.file_name().unwrap().to_string_lossy().into_owned();
        if let Ok(name) = std::fs::read_to_string(dir.join("refuses")) {
            let a = args::read(&dir).unwrap().unwrap();
            let e = hf_config(&a).unwrap_err();
            assert!(
                e.to_string().contains(&format!("{} = True", name.trim())),
                "{case}: {e}"
            );
            assert!(e.hint().unwrap_or_default().contains("--base"), "{case}");
            refused_seen += 1;
            continue;
        }
        let a = args::read(&dir).unwrap().unwrap();
        let calls: Vec<&str> = a.unsafe_calls.iter().map(|c| c.callable.as_str()).collect();
        match std::fs::read_to_string(dir.join("unsafe")) {
            Ok(callable) => assert_eq!(calls, [callable.trim()], "{case}"),
            Err(_) => assert!(calls.is_empty(), "{case}: {calls:?}"),
        }
        let got = hf_config(&a).unwrap().config;
        let want = object(json(&dir.join("config.json")));
        assert_matches(&case, &got, &want, None);
        derived_seen += 1;
    }
    assert_eq!((derived_seen, refused_seen), (3, 1));
}

#[test]
fn the_warnings_say_what_was_derived_and_that_the_vocabulary_is_padded() {
    let d = derived(&crate::fixtures().join("megatron/ckpt/llama_tp2_padded_vocab"));
    assert_eq!(d.warnings.len(), 2, "{:?}", d.warnings);
    assert!(
        d.warnings[0].contains("common.pt") && d.warnings[0].contains("as a llama model"),
        "{}",
        d.warnings[0]
    );
    assert!(
        d.warnings[1].contains("vocab_size 256") && d.warnings[1].contains("--base"),
        "{}",
        d.warnings[1]
    );
}

#[test]
fn the_warning_names_the_training_s_tokenizer_when_the_arguments_do() {
    let d = with(&[(
        "tokenizer_model",
        Arg::Str("meta-llama/Llama-3.2-1B".into()),
    )])
    .unwrap();
    assert!(
        d.warnings[0].contains(
            "--base <HF model dir or Hub id> (the training's tokenizer: meta-llama/Llama-3.2-1B)"
        ),
        "{}",
        d.warnings[0]
    );
}

fn llama_args() -> TrainingArgs {
    args::read(&crate::fixtures().join("megatron/ckpt/llama_tp2/iter_0000100"))
        .unwrap()
        .unwrap()
}

fn with(changes: &[(&str, Arg)]) -> Result<DerivedConfig> {
    let mut a = llama_args();
    for (k, v) in changes {
        a.values.insert(k.to_string(), v.clone());
    }
    hf_config(&a)
}

fn refused(changes: &[(&str, Arg)]) -> String {
    let e = with(changes).unwrap_err();
    let hint = e.hint().unwrap_or_default();
    assert!(hint.contains("--base"), "{hint}");
    e.to_string()
}

#[test]
fn what_no_family_expresses_is_refused_by_the_argument_s_name() {
    for (name, value) in [
        ("multi_latent_attention", Arg::Bool(true)),
        ("use_rope_scaling", Arg::Bool(true)),
        ("rotary_percent", Arg::Float(0.5)),
        ("normalization", Arg::Str("LayerNorm".into())),
        (
            "position_embedding_type",
            Arg::Str("learned_absolute".into()),
        ),
        ("add_bias_linear", Arg::Bool(true)),
        ("swiglu", Arg::Bool(false)),
        ("moe_shared_expert_intermediate_size", Arg::Int(32)),
        ("moe_router_score_function", Arg::Str("sigmoid".into())),
        ("window_size", Arg::List(vec![Arg::Int(128), Arg::Int(0)])),
        ("layernorm_zero_centered_gamma", Arg::Bool(true)),
    ] {
        let e = refused(&[(name, value.clone())]);
        assert!(e.contains(&format!("{name} = {}", value.show())), "{e}");
        assert!(e.contains("common.pt"), "{e}");
    }
    // Sizes no model has are not believed (a config lists some per layer).
    let e = refused(&[("num_layers", Arg::Int(1 << 40))]);
    assert!(e.contains("num_layers = 1099511627776"), "{e}");
    let e = refused(&[("hidden_size", Arg::Int(i64::MAX))]);
    assert!(e.contains("at most"), "{e}");
    let e = refused(&[("kv_channels", Arg::Int(-16))]);
    assert!(e.contains("kv_channels = -16"), "{e}");
    let e = refused(&[("num_layers", Arg::None)]);
    assert!(e.contains("num_layers = None"), "{e}");
    let e = refused(&[("hidden_size", Arg::Str("64".into()))]);
    assert!(
        e.contains("hidden_size = '64'") && e.contains("not an integer"),
        "{e}"
    );
}

#[test]
fn features_choose_the_family() {
    let family = |changes: &[(&str, Arg)]| {
        with(changes).unwrap().config["model_type"]
            .as_str()
            .unwrap()
            .to_string()
    };
    assert_eq!(family(&[]), "llama");
    assert_eq!(family(&[("add_qkv_bias", Arg::Bool(true))]), "qwen2");
    assert_eq!(family(&[("qk_layernorm", Arg::Bool(true))]), "qwen3");
    let moe = [
        ("num_experts", Arg::Int(4)),
        ("moe_ffn_hidden_size", Arg::Int(32)),
    ];
    assert_eq!(family(&moe), "mixtral");
    let mut qwen3_moe = moe.to_vec();
    qwen3_moe.push(("qk_layernorm", Arg::Bool(true)));
    assert_eq!(family(&qwen3_moe), "qwen3_moe");
    let mut both = qwen3_moe.clone();
    both.push(("add_qkv_bias", Arg::Bool(true)));
    assert!(refused(&both).contains("add_qkv_bias = True"));
}

#[test]
fn mixtral_refuses_dense_layers_and_qwen3_moe_lists_them() {
    let mixtral = [
        ("num_experts", Arg::Int(4)),
        ("moe_layer_freq", Arg::Int(2)),
    ];
    assert!(refused(&mixtral).contains("moe_layer_freq = 2"));
    let mut q = mixtral.to_vec();
    q.push(("qk_layernorm", Arg::Bool(true)));
    // Megatron: layer i has experts when i % freq == 0.
    let c = with(&q).unwrap().config;
    assert_eq!(c["mlp_only_layers"], serde_json::json!([1]));
    q.push(("moe_router_pre_softmax", Arg::Bool(true)));
    assert_eq!(with(&q).unwrap().config["norm_topk_prob"], false);
}

#[test]
fn dtype_comes_from_the_precision_flags_then_params_dtype() {
    let dtype = |changes: &[(&str, Arg)]| with(changes).unwrap().config["dtype"].clone();
    assert_eq!(dtype(&[]), "bfloat16");
    let off = [("bf16", Arg::Bool(false)), ("fp16", Arg::Bool(false))];
    let mut f32 = off.to_vec();
    f32.push(("params_dtype", Arg::Global("torch.float32".into())));
    assert_eq!(dtype(&f32), "float32");
    assert_eq!(
        dtype(&[("bf16", Arg::Bool(false)), ("fp16", Arg::Bool(true))]),
        "float16"
    );
    let mut none = off.to_vec();
    none.push(("params_dtype", Arg::None));
    assert!(refused(&none).contains("params_dtype = None"));
}

#[test]
fn floats_are_written_as_python_writes_them() {
    // Python's repr of each (what transformers' config.json holds).
    for (f, text) in [
        (1e-5, "1e-05"),
        (1e-6, "1e-06"),
        (0.02, "0.02"),
        (0.0, "0.0"),
        (0.001, "0.001"),
        (1e-4, "0.0001"),
        (10000.0, "10000.0"),
        (1000000.0, "1000000.0"),
        (500000.0, "500000.0"),
        (1.5, "1.5"),
        (123.25, "123.25"),
        (1e16, "1e+16"),
        (2.5e-7, "2.5e-07"),
        (-0.5, "-0.5"),
    ] {
        assert_eq!(py_float(f).to_string(), text, "{f}");
    }
}
