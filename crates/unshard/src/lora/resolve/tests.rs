//! Which factors pair with which base weights, and the refusals, over adapter
//! configurations and state dicts built in the tests.

#![allow(clippy::unwrap_used)]

use serde_json::{json, Value};

use super::*;
use crate::dtype::DType;
use crate::lora::config::from_layers;
use crate::plan::testing::{checkpoint, tensor};

/// A config of rank 2 with `extra`.
fn config(extra: Value) -> AdapterConfig {
    from_layers(&[json!({"r": 2, "lora_alpha": 4}), extra]).unwrap()
}

/// A fuse of rank 2 whose layout comes from the layer's class: `nn.Linear`.
fn linear(a: &[u64], b: &[u64]) -> Fuse {
    Fuse {
        target: "m.weight".into(),
        module: "m".into(),
        embedding: false,
        fan_in_fan_out: false,
        class_known: true,
        a: tensor("m.lora_A.weight", DType::F32, a),
        b: tensor("m.lora_B.weight", DType::F32, b),
        magnitude: None,
        rank: 2,
        scale: 1.0,
    }
}

#[test]
fn both_factors_must_fit_the_weight() {
    // W [out 4, in 6], rank 2: A [2, 6], B [4, 2].
    assert_eq!(
        linear(&[2, 6], &[4, 2]).layout_for(&[4, 6]).unwrap(),
        Layout::Linear
    );
    let e = linear(&[2, 6], &[5, 2]).layout_for(&[4, 6]).unwrap_err();
    assert!(e.to_string().contains("lora_B is [5, 2]"), "{e}");
    let e = linear(&[2, 7], &[4, 2]).layout_for(&[4, 6]).unwrap_err();
    assert!(e.to_string().contains("lora_A is [2, 7]"), "{e}");
}

/// A training checkpoint of a wrapped model: the frozen base under
/// `base_layer`, one module saved whole, and a second adapter's factors.
fn wrapped() -> Checkpoint {
    let p = "base_model.model.";
    let q = "model.layers.0.self_attn.q_proj";
    checkpoint(
        "policy.pt",
        vec![
            tensor(&format!("{p}{q}.base_layer.weight"), DType::F32, &[4, 6]),
            tensor(
                &format!("{p}{q}.lora_A.default.weight"),
                DType::F32,
                &[2, 6],
            ),
            tensor(
                &format!("{p}{q}.lora_B.default.weight"),
                DType::F32,
                &[4, 2],
            ),
            tensor(&format!("{p}{q}.lora_A.other.weight"), DType::F32, &[2, 6]),
            tensor(&format!("{p}{q}.lora_B.other.weight"), DType::F32, &[4, 2]),
            tensor(
                &format!("{p}lm_head.original_module.weight"),
                DType::F32,
                &[10, 6],
            ),
            tensor(
                &format!("{p}lm_head.modules_to_save.default.weight"),
                DType::F32,
                &[10, 6],
            ),
            tensor(
                &format!("{p}lm_head.modules_to_save.other.weight"),
                DType::F32,
                &[10, 6],
            ),
        ],
    )
}

#[test]
fn a_wrapped_model_gives_its_tensors_under_base_names() {
    let c = config(json!({"target_modules": ["q_proj"], "modules_to_save": ["lm_head"]}));
    let r = resolve(&wrapped(), c, None, Some("default")).unwrap();
    let q = "model.layers.0.self_attn.q_proj";
    let names: Vec<&str> = r.tensors.iter().map(|t| t.name.as_str()).collect();
    assert_eq!(names, ["lm_head.weight", &format!("{q}.weight")]);
    assert_eq!(
        r.kept["base_model.model.lm_head.modules_to_save.default.weight"],
        "lm_head.weight"
    );
    assert_eq!(r.fuses.len(), 1);
    assert_eq!(r.fuses[0].target, format!("{q}.weight"));
    // The saved module's tensors are the adapter's; the frozen weight is the base's.
    assert!(r.owns("lm_head.weight"));
    assert!(!r.owns(&format!("{q}.weight")));
    assert_eq!(
        r.notes,
        ["3 tensor(s) of other adapters left out (adapter 'default' fused)"]
    );
}

#[test]
fn an_adapter_name_that_is_not_there_is_refused() {
    let c = config(json!({"target_modules": ["q_proj"], "modules_to_save": ["lm_head"]}));
    let e = resolve(&wrapped(), c, None, Some("third")).unwrap_err();
    assert!(
        e.to_string()
            .contains("no adapter named 'third' (adapters here: default, other)"),
        "{e}"
    );
}

/// An adapter file of one module, `q` (`[4, 6]`), with these factors and, if
/// asked, a DoRA magnitude.
fn one_module(a: &[u64], b: &[u64], magnitude: bool) -> Checkpoint {
    let mut t = vec![
        tensor("base_model.model.q.lora_A.weight", DType::F32, a),
        tensor("base_model.model.q.lora_B.weight", DType::F32, b),
    ];
    if magnitude {
        t.push(tensor(
            "base_model.model.q.lora_magnitude_vector",
            DType::F32,
            &[4],
        ));
    }
    checkpoint("adapter_model.safetensors", t)
}

/// [`config`] on `q` and `emb`, with `extra`.
fn on_q(extra: Value) -> AdapterConfig {
    let on = json!({"target_modules": ["q", "emb"]});
    from_layers(&[json!({"r": 2, "lora_alpha": 4}), on, extra]).unwrap()
}

fn refusal(ckpt: &Checkpoint, extra: Value) -> String {
    resolve(ckpt, on_q(extra), Some("default"), None)
        .unwrap_err()
        .to_string()
}

#[test]
fn factors_that_disagree_with_the_config_are_refused() {
    let fine = one_module(&[2, 6], &[4, 2], false);
    assert!(resolve(&fine, on_q(json!({})), Some("default"), None).is_ok());
    for (a, b) in [([3, 6], [4, 2]), ([2, 6], [4, 3])] {
        let e = refusal(&one_module(&a, &b, false), json!({}));
        assert!(e.contains("the config gives rank 2"), "{e}");
    }
    let e = refusal(&one_module(&[2, 6, 1, 1], &[4, 2], false), json!({}));
    assert!(e.contains("LoRA on a convolution"), "{e}");
    let e = refusal(&fine, json!({"use_dora": true}));
    assert!(
        e.contains("use_dora is set but there is no lora_magnitude_vector"),
        "{e}"
    );
    let dora = one_module(&[2, 6], &[4, 2], true);
    assert!(resolve(&dora, on_q(json!({"use_dora": true})), None, None).is_ok());
    let e = refusal(&dora, json!({}));
    assert!(e.contains("use_dora is not set"), "{e}");
    let dora_embedding = checkpoint(
        "adapter_model.safetensors",
        vec![
            tensor(
                "base_model.model.emb.lora_embedding_A",
                DType::F32,
                &[2, 10],
            ),
            tensor("base_model.model.emb.lora_embedding_B", DType::F32, &[6, 2]),
            tensor(
                "base_model.model.emb.lora_magnitude_vector",
                DType::F32,
                &[6],
            ),
        ],
    );
    let e = refusal(&dora_embedding, json!({"use_dora": true}));
    assert!(e.contains("DoRA on an embedding cannot be fused"), "{e}");
}

#[test]
fn the_adapter_is_the_one_named_the_only_one_or_the_implied_one() {
    let c = || config(json!({"target_modules": ["q_proj"], "modules_to_save": ["lm_head"]}));
    let e = resolve(&wrapped(), c(), None, None).unwrap_err();
    assert!(
        e.to_string()
            .contains("holds several adapters: default, other"),
        "{e}"
    );
    // Names without an adapter's (an adapter file): the directory's, else peft's default.
    let file = one_module(&[2, 6], &[4, 2], false);
    let adapter = |implied| {
        resolve(&file, on_q(json!({})), implied, None)
            .unwrap()
            .adapter
    };
    assert_eq!(adapter(Some("second")), "second");
    assert_eq!(adapter(None), "default");
    // One adapter in the names: that one.
    let only_other = checkpoint(
        "policy.pt",
        vec![
            tensor(
                "base_model.model.q.lora_A.other.weight",
                DType::F32,
                &[2, 6],
            ),
            tensor(
                "base_model.model.q.lora_B.other.weight",
                DType::F32,
                &[4, 2],
            ),
        ],
    );
    let r = resolve(&only_other, on_q(json!({})), None, None).unwrap();
    assert_eq!((r.adapter.as_str(), r.fuses.len()), ("other", 1));
    // Nothing was left out: no note says so.
    assert!(r.notes.is_empty(), "{:?}", r.notes);
}

/// An adapter on GPT-2's `c_attn` (a `Conv1D`), on a module of another class
/// and on the token embedding, with the config's `fan_in_fan_out` as given.
fn on_three_layers(fan_in_fan_out: bool) -> Resolved {
    let c = config(json!({
        "target_modules": ["c_attn", "score", "wte"],
        "fan_in_fan_out": fan_in_fan_out,
    }));
    let ckpt = checkpoint(
        "adapter_model.safetensors",
        vec![
            tensor(
                "transformer.h.0.attn.c_attn.lora_A.weight",
                DType::F32,
                &[2, 6],
            ),
            tensor(
                "transformer.h.0.attn.c_attn.lora_B.weight",
                DType::F32,
                &[18, 2],
            ),
            tensor("score.lora_A.weight", DType::F32, &[2, 6]),
            tensor("score.lora_B.weight", DType::F32, &[3, 2]),
            tensor("transformer.wte.lora_embedding_A", DType::F32, &[2, 10]),
            tensor("transformer.wte.lora_embedding_B", DType::F32, &[6, 2]),
        ],
    );
    resolve(&ckpt, c, Some("default"), None).unwrap()
}

/// `(module, fan_in_fan_out, class_known)` of each fuse.
fn orientations(r: &Resolved) -> Vec<(&str, bool, bool)> {
    r.fuses
        .iter()
        .map(|f| (f.module.as_str(), f.fan_in_fan_out, f.class_known))
        .collect()
}

#[test]
fn the_layer_class_of_a_known_model_type_overrides_the_config() {
    let mut r = on_three_layers(false);
    r.use_layer_classes(Some("gpt2"));
    assert_eq!(
        orientations(&r),
        [
            ("score", false, true),
            ("transformer.h.0.attn.c_attn", true, true),
            // An embedding has one layout: its flags are left alone.
            ("transformer.wte", false, false),
        ]
    );
    let mut r = on_three_layers(true);
    r.use_layer_classes(Some("gpt2"));
    assert_eq!(orientations(&r)[0], ("score", false, true));
}

#[test]
fn other_model_types_keep_the_config_flag() {
    for model_type in [Some("llama"), None] {
        let mut r = on_three_layers(true);
        r.use_layer_classes(model_type);
        assert_eq!(
            orientations(&r),
            [
                ("score", true, false),
                ("transformer.h.0.attn.c_attn", true, false),
                ("transformer.wte", true, false),
            ],
            "{model_type:?}"
        );
    }
}
