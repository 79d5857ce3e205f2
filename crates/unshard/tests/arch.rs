//! The layout table against transformers: for each family, fixtures/arch/<family>/
//! holds a tiny config.json and the names and shapes `save_pretrained` wrote for
//! it (fixtures/gen_arch_table.py); evaluating the table on the config must give
//! exactly that list. `<family>/<flag>=<value>/` holds the same with one layout
//! flag flipped (biases, a tied head, a null head_dim or q_lora_rank).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

fn arch_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/arch")
}

fn fixture(family: &str) -> (Map<String, Value>, BTreeMap<String, Vec<u64>>) {
    fixture_at(&arch_dir().join(family))
}

fn fixture_at(dir: &Path) -> (Map<String, Value>, BTreeMap<String, Vec<u64>>) {
    let config: Map<String, Value> =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    let expected: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("expected.json")).unwrap()).unwrap();
    let tensors = expected["tensors"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| {
            let shape = t["shape"]
                .as_array()
                .unwrap()
                .iter()
                .map(|d| d.as_u64().unwrap())
                .collect();
            (t["name"].as_str().unwrap().to_string(), shape)
        })
        .collect();
    (config, tensors)
}

const FAMILIES: &[&str] = &[
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "qwen2_moe",
    "qwen3_moe",
    "gemma",
    "gemma2",
    "gemma3_text",
    "phi3",
    "gpt2",
    "gpt_neox",
    "olmo2",
    "deepseek_v2",
    "deepseek_v3",
    "mixtral",
];

/// The family's fixture and its flag variants (`attention_bias=true/`, ...).
fn cases(family: &str) -> Vec<(String, PathBuf)> {
    let dir = arch_dir().join(family);
    let mut v = vec![(family.to_string(), dir.clone())];
    let mut subs: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_dir())
        .collect();
    subs.sort();
    for s in subs {
        let name = format!("{family}/{}", s.file_name().unwrap().to_string_lossy());
        v.push((name, s));
    }
    v
}

#[test]
fn every_family_reproduces_what_transformers_saves() {
    let mut count = 0;
    for (family, dir) in FAMILIES.iter().flat_map(|f| cases(f)) {
        count += 1;
        let (config, want) = fixture_at(&dir);
        let exp = unshard::arch::expected(&config).unwrap_or_else(|e| panic!("{family}: {e}"));
        let got: BTreeMap<String, Vec<u64>> = exp
            .tensors
            .iter()
            .map(|t| (t.name.clone(), t.shape.clone()))
            .collect();
        assert_eq!(exp.tensors.len(), got.len(), "{family}: duplicate names");
        for (n, s) in &want {
            assert_eq!(got.get(n), Some(s), "{family}: {n}");
        }
        for n in got.keys() {
            assert!(
                want.contains_key(n),
                "{family}: {n} is not written by transformers"
            );
        }
        // And the checkpoint of that layout passes the check.
        let pairs: Vec<(&str, &[u64])> = want
            .iter()
            .map(|(n, s)| (n.as_str(), s.as_slice()))
            .collect();
        unshard::arch::check(&exp, &pairs, None).unwrap_or_else(|e| panic!("{family}: {e}"));
    }
    // The flag variants are there (biases, tied heads, a null head_dim, ...).
    assert!(count > 2 * FAMILIES.len(), "{count} cases");
}

#[test]
fn moe_fixtures_mix_dense_and_sparse_layers() {
    // The fixtures must exercise per-layer variation, or the test above proves little.
    for family in ["qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3"] {
        let (_, want) = fixture(family);
        let dense = want
            .keys()
            .filter(|n| n.ends_with("mlp.gate_proj.weight"))
            .count();
        let sparse = want
            .keys()
            .filter(|n| n.ends_with("mlp.gate.weight"))
            .count();
        assert!(
            dense > 0 && sparse > 0,
            "{family}: {dense} dense, {sparse} sparse layers"
        );
    }
}

#[test]
fn a_config_without_defaults_the_table_knows_still_evaluates() {
    // An old Llama config.json has no head_dim: transformers derives hidden/heads.
    let (mut config, want) = fixture("llama");
    config.remove("head_dim");
    let hidden = config["hidden_size"].as_u64().unwrap();
    let exp = unshard::arch::expected(&config).unwrap();
    let q = exp
        .tensors
        .iter()
        .find(|t| t.name == "model.layers.0.self_attn.q_proj.weight")
        .unwrap();
    assert_eq!(q.shape, vec![hidden, hidden]);
    assert_ne!(
        Some(&q.shape),
        want.get(&q.name),
        "the fixture's head_dim differs from hidden/heads"
    );
}

#[test]
fn an_unknown_architecture_is_said_so() {
    let mut config = Map::new();
    config.insert(
        "architectures".into(),
        serde_json::json!(["LlamaForSequenceClassification"]),
    );
    config.insert("model_type".into(), "llama".into());
    let e = unshard::arch::expected(&config).unwrap_err();
    assert!(
        e.to_string().contains("LlamaForSequenceClassification"),
        "{e}"
    );
}

#[test]
fn absurd_config_numbers_are_not_expanded() {
    // A config is input too: 10^12 experts must not allocate 10^12 names.
    let (mut config, _) = fixture("mixtral");
    config.insert(
        "num_local_experts".into(),
        serde_json::json!(1_000_000_000_000u64),
    );
    assert!(unshard::arch::expected(&config).is_err());
    let (mut config, _) = fixture("llama");
    config.insert("num_hidden_layers".into(), serde_json::json!(u64::MAX));
    let e = unshard::arch::expected(&config).unwrap_err().to_string();
    assert!(
        e.contains("'num_hidden_layers' asks for more tensors"),
        "{e}"
    );
}
