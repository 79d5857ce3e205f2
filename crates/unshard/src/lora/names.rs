//! peft's tensor names, read back into base-model names.
//!
//! Two spellings reach unshard. An adapter directory (`save_pretrained`) holds
//! `base_model.model.<module>.lora_A.weight`, `.lora_B.weight`,
//! `.lora_magnitude_vector`, `.lora_embedding_A`/`_B`, and full tensors under their
//! base names (`lm_head.weight` for a saved module, `<emb>.base_layer.weight` for a
//! targeted embedding). A training checkpoint of the wrapped model (its
//! `state_dict()`) adds the adapter's name (`lora_A.default.weight`,
//! `lora_magnitude_vector.default.weight`, `lora_embedding_A.default`), keeps the
//! frozen weights as `<module>.base_layer.weight`, and a saved module twice:
//! `<m>.original_module.<p>` and `<m>.modules_to_save.<adapter>.<p>`.

/// What one tensor name means to the fuse.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PeftName {
    /// A base-model tensor, under its base name (`.base_layer` and
    /// `.original_module` removed).
    Base(String),
    /// `<module>.lora_A[.<adapter>].weight` (`[r, in]`).
    LoraA(Adapted),
    /// `<module>.lora_B[.<adapter>].weight` (`[out, r]`).
    LoraB(Adapted),
    /// `<module>.lora_magnitude_vector[.<adapter>.weight]` (DoRA, `[out]`).
    Magnitude(Adapted),
    /// `<module>.lora_embedding_A[.<adapter>]` (`[r, num_embeddings]`).
    EmbeddingA(Adapted),
    /// `<module>.lora_embedding_B[.<adapter>]` (`[embedding_dim, r]`).
    EmbeddingB(Adapted),
    /// `<m>.modules_to_save.<adapter>.<p>`: the trained copy that replaces `<m>.<p>`.
    SavedCopy { name: String, adapter: String },
    /// A tensor of a part of peft unshard does not fuse (`lora_B.bias`, VeRA, LoHa...):
    /// the whole merge is refused, naming it and the reason.
    Unsupported { what: &'static str },
}

/// The module an adapter tensor belongs to, and which adapter (None in adapter
/// directories, where the name is implied).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Adapted {
    /// The module's name in the base model (`model.layers.0.self_attn.q_proj`).
    pub module: String,
    /// The adapter's name, when the tensor name carries one.
    pub adapter: Option<String>,
}

/// The prefix `PeftModel` puts before the wrapped model's names.
const PEFT_PREFIX: &str = "base_model.model.";

/// Components of other peft methods, which cannot be fused as LoRA.
const OTHER_METHODS: &[(&str, &str)] = &[
    ("vera_", "a VeRA adapter"),
    ("hada_", "a LoHa adapter"),
    ("lokr_", "a LoKr adapter"),
    ("ia3_", "an IA3 adapter"),
    ("oft_", "an OFT adapter"),
    ("boft_", "a BOFT adapter"),
    ("lora_E", "an AdaLoRA adapter"),
    ("ranknum", "an AdaLoRA adapter"),
    ("fourierft_", "a FourierFT adapter"),
    ("vblora_", "a VB-LoRA adapter"),
    ("randlora_", "a RandLoRA adapter"),
    ("shira_", "a SHiRA adapter"),
];

/// Whether a name can only come from peft (used to recognise a checkpoint of a
/// peft-wrapped model).
pub fn looks_like_peft(name: &str) -> bool {
    name.split('.').any(|c| {
        matches!(
            c,
            "lora_A"
                | "lora_B"
                | "lora_magnitude_vector"
                | "lora_embedding_A"
                | "lora_embedding_B"
                | "base_layer"
                | "modules_to_save"
        )
    })
}

/// Removes peft's `base_model.model.` prefix, wherever wrappers left it (call after
/// [`crate::plan::strip_wrappers`]).
pub fn strip_peft_prefix(name: &str) -> &str {
    name.strip_prefix(PEFT_PREFIX).unwrap_or(name)
}

/// Classifies a name (wrappers and the peft prefix already stripped).
pub fn classify(name: &str) -> PeftName {
    let parts: Vec<&str> = name.split('.').collect();
    for p in &parts {
        if let Some((_, what)) = OTHER_METHODS.iter().find(|(pre, _)| p.starts_with(pre)) {
            return PeftName::Unsupported { what };
        }
    }
    if let Some(i) = parts.iter().position(|p| *p == "modules_to_save") {
        if i > 0 && i + 2 < parts.len() {
            let name = [&parts[..i], &parts[i + 2..]].concat().join(".");
            return PeftName::SavedCopy {
                name,
                adapter: parts[i + 1].to_string(),
            };
        }
    }
    for (marker, kind) in [
        ("lora_A", 0u8),
        ("lora_B", 1),
        ("lora_magnitude_vector", 2),
        ("lora_embedding_A", 3),
        ("lora_embedding_B", 4),
    ] {
        let Some(i) = parts.iter().rposition(|p| *p == marker) else {
            continue;
        };
        if i == 0 {
            break;
        }
        let module = parts[..i].join(".");
        let tail = &parts[i + 1..];
        // Parameters of nn.Linear end in `.weight` (or `.bias`), ParameterDict
        // entries (embedding A/B) and the saved magnitude do not.
        let (adapter, param) = match (kind, tail) {
            (0 | 1, [p]) => (None, Some(*p)),
            (0 | 1, [a, p]) => (Some(*a), Some(*p)),
            (2, []) | (3 | 4, []) => (None, None),
            (2, [a, "weight"]) => (Some(*a), None),
            (3 | 4, [a]) => (Some(*a), None),
            _ => {
                return PeftName::Unsupported {
                    what: "a LoRA tensor of a layout unshard does not know",
                }
            }
        };
        if param == Some("bias") {
            return PeftName::Unsupported {
                what: "a bias on lora_B (lora_bias)",
            };
        }
        if param.is_some_and(|p| p != "weight") {
            return PeftName::Unsupported {
                what: "a LoRA tensor of a layout unshard does not know",
            };
        }
        let a = Adapted {
            module,
            adapter: adapter.map(str::to_string),
        };
        return match kind {
            0 => PeftName::LoraA(a),
            1 => PeftName::LoraB(a),
            2 => PeftName::Magnitude(a),
            3 => PeftName::EmbeddingA(a),
            _ => PeftName::EmbeddingB(a),
        };
    }
    let kept: Vec<&str> = parts
        .iter()
        .copied()
        .filter(|p| *p != "base_layer" && *p != "original_module")
        .collect();
    PeftName::Base(kept.join("."))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn adapted(module: &str, adapter: Option<&str>) -> Adapted {
        Adapted {
            module: module.into(),
            adapter: adapter.map(Into::into),
        }
    }

    #[test]
    fn reads_adapter_directory_names() {
        let n = |s| classify(strip_peft_prefix(s));
        let q = "model.layers.0.self_attn.q_proj";
        assert_eq!(
            n("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"),
            PeftName::LoraA(adapted(q, None))
        );
        assert_eq!(
            n("base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector"),
            PeftName::Magnitude(adapted(q, None))
        );
        assert_eq!(
            n("base_model.model.model.embed_tokens.lora_embedding_B"),
            PeftName::EmbeddingB(adapted("model.embed_tokens", None))
        );
        assert_eq!(
            n("base_model.model.model.embed_tokens.base_layer.weight"),
            PeftName::Base("model.embed_tokens.weight".into())
        );
        assert_eq!(
            n("base_model.model.lm_head.weight"),
            PeftName::Base("lm_head.weight".into())
        );
        assert!(matches!(
            n("base_model.model.model.layers.0.self_attn.q_proj.lora_B.bias"),
            PeftName::Unsupported { .. }
        ));
        assert!(matches!(
            n("base_model.model.model.layers.0.self_attn.q_proj.vera_lambda_b"),
            PeftName::Unsupported { .. }
        ));
    }

    #[test]
    fn reads_training_checkpoint_names() {
        let n = |s| classify(strip_peft_prefix(s));
        let q = "model.layers.0.self_attn.q_proj";
        assert_eq!(
            n("base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"),
            PeftName::Base("model.layers.0.self_attn.q_proj.weight".into())
        );
        assert_eq!(
            n("base_model.model.model.layers.0.self_attn.q_proj.lora_B.second.weight"),
            PeftName::LoraB(adapted(q, Some("second")))
        );
        assert_eq!(
            n("base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector.default.weight"),
            PeftName::Magnitude(adapted(q, Some("default")))
        );
        assert_eq!(
            n("base_model.model.model.embed_tokens.lora_embedding_A.default"),
            PeftName::EmbeddingA(adapted("model.embed_tokens", Some("default")))
        );
        assert_eq!(
            n("base_model.model.lm_head.modules_to_save.default.weight"),
            PeftName::SavedCopy {
                name: "lm_head.weight".into(),
                adapter: "default".into()
            }
        );
        assert_eq!(
            n("base_model.model.lm_head.original_module.weight"),
            PeftName::Base("lm_head.weight".into())
        );
        assert!(looks_like_peft(
            "base_model.model.lm_head.modules_to_save.default.weight"
        ));
        assert!(!looks_like_peft("model.layers.0.self_attn.q_proj.weight"));
    }

    #[test]
    fn a_saved_copy_has_a_module_before_the_marker_and_an_adapter_and_a_parameter_after() {
        assert_eq!(
            classify("model.layers.0.mlp.modules_to_save.default.weight"),
            PeftName::SavedCopy {
                name: "model.layers.0.mlp.weight".into(),
                adapter: "default".into()
            }
        );
        // Anything shorter is not peft's spelling: the name is kept as it is.
        for name in [
            "modules_to_save.default.weight",
            "lm_head.modules_to_save.default",
        ] {
            assert_eq!(classify(name), PeftName::Base(name.into()));
        }
    }
}
