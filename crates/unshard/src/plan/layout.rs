//! Step: the checkpoint against what the config calls for, when there are no base
//! weights to compare with.
//!
//! With a config-only base (or a config found beside the checkpoint) the overlay
//! step has nothing to check names and shapes against, so a checkpoint of another
//! size or family would be written and fail only when loaded. For the
//! architectures of the layout table ([`crate::arch`]) names and shapes are
//! checked exactly and a constant prefix is aligned with the expected names; for
//! others a warning says that nothing could be checked. Zero-element tensors
//! where the config or the base expects more (a partitioned checkpoint's
//! placeholders) are an error in every case.

use std::collections::{HashMap, HashSet};

use super::mapping::Candidate;
use super::{BaseView, PlannedTensor, Report};
use crate::arch::{self, Expected};
use crate::error::{Error, Result};
use crate::source::TensorSource;

/// The config's expected layout when it is the only reference (no base weights);
/// warns when the architecture is not in the table.
pub(crate) fn expected_layout(base: BaseView<'_>, report: &mut Report) -> Option<Expected> {
    if base.weights.is_some() {
        return None;
    }
    let config = base.config?;
    match arch::expected(config) {
        Ok(e) => Some(e),
        Err(why) => {
            report.warnings.push(format!(
                "nothing could be checked against config.json: {why}; names and shapes are written as the checkpoint has them"
            ));
            None
        }
    }
}

/// Every name the layout has (both spellings of MoE experts).
pub(crate) fn expected_names(e: &Expected) -> HashSet<&str> {
    e.tensors
        .iter()
        .chain(e.state_dict.iter().flatten())
        .map(|t| t.name.as_str())
        .collect()
}

/// Zero-element checkpoint tensors where the base or the config expects more.
/// Without either, an empty `.weight` is taken as a placeholder all the same: no
/// model has an empty weight matrix.
pub(crate) fn check_placeholders(
    cands: &[Candidate],
    names: &[String],
    keep: &[bool],
    base: Option<&HashMap<&str, &TensorSource>>,
    layout: Option<&Expected>,
) -> Result<()> {
    let config: Option<HashMap<&str, &[u64]>> = layout.map(|e| {
        e.tensors
            .iter()
            .chain(e.state_dict.iter().flatten())
            .map(|t| (t.name.as_str(), t.shape.as_slice()))
            .collect()
    });
    let want = |n: &str| -> Option<(Vec<u64>, &'static str)> {
        if let Some(b) = base.and_then(|m| m.get(n)) {
            return Some((b.shape.clone(), "base"));
        }
        if let Some(s) = config.as_ref().and_then(|m| m.get(n)) {
            return Some((s.to_vec(), "config"));
        }
        (base.is_none() && config.is_none() && n.ends_with(".weight"))
            .then(|| (Vec::new(), "weight"))
    };
    let tensors = names
        .iter()
        .zip(cands)
        .zip(keep)
        .filter(|(_, k)| **k)
        .map(|((n, t), _)| (n.as_str(), t.shape.as_slice()));
    match arch::placeholders(tensors, &want) {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// The planned tensors against the layout: names and shapes exactly; `shape_hint`
/// as [`arch::check`] takes it.
pub(crate) fn check_against_config(
    tensors: &[PlannedTensor],
    layout: &Expected,
    shape_hint: Option<String>,
) -> Result<(), Error> {
    let pairs: Vec<(&str, &[u64])> = tensors
        .iter()
        .map(|t| (t.name.as_str(), t.shape.as_slice()))
        .collect();
    arch::check(layout, &pairs, shape_hint)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::super::testing::*;
    use super::super::{plan, BaseView, PlanOptions};
    use serde_json::{Map, Value};

    /// The config transformers 5.24 writes for fixtures' tiny Llama (2 layers, vocab 251).
    fn llama_config() -> Map<String, Value> {
        let path = crate::fixtures().join("models/llama-config-only/config.json");
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
    }

    /// The tensors of a Llama with that config but `layers` layers and `vocab` tokens.
    fn llama(layers: u64, vocab: u64, prefix: &str) -> Vec<(String, Vec<u64>)> {
        let mut v = vec![
            (
                format!("{prefix}model.embed_tokens.weight"),
                vec![vocab, 64],
            ),
            (format!("{prefix}model.norm.weight"), vec![64]),
            (format!("{prefix}lm_head.weight"), vec![vocab, 64]),
        ];
        for l in 0..layers {
            let p = format!("{prefix}model.layers.{l}.");
            for (n, s) in [
                ("self_attn.q_proj.weight", vec![64, 64]),
                ("self_attn.k_proj.weight", vec![32, 64]),
                ("self_attn.v_proj.weight", vec![32, 64]),
                ("self_attn.o_proj.weight", vec![64, 64]),
                ("mlp.gate_proj.weight", vec![173, 64]),
                ("mlp.up_proj.weight", vec![173, 64]),
                ("mlp.down_proj.weight", vec![64, 173]),
                ("input_layernorm.weight", vec![64]),
                ("post_attention_layernorm.weight", vec![64]),
            ] {
                v.push((format!("{p}{n}"), s));
            }
        }
        v
    }

    fn run(
        tensors: Vec<(String, Vec<u64>)>,
        config: &Map<String, Value>,
    ) -> crate::error::Result<super::super::Plan> {
        let named: Vec<(&str, &[u64])> = tensors
            .iter()
            .map(|(n, s)| (n.as_str(), s.as_slice()))
            .collect();
        let ckpt = checkpoint("c.pt", f32s(&named));
        let base = BaseView {
            config: Some(config),
            weights: None,
            total_parameters: None,
        };
        plan(&ckpt, base, &[], &PlanOptions::default())
    }

    #[test]
    fn the_right_checkpoint_passes_and_a_prefix_is_aligned() {
        let c = llama_config();
        run(llama(2, 251, ""), &c).unwrap();
        let p = run(llama(2, 251, "model."), &c).unwrap();
        assert!(p
            .tensors
            .iter()
            .all(|t| !t.name.starts_with("model.model.")));
        assert!(
            p.report.notes.iter().any(|n| n.contains("'model.'")),
            "{:?}",
            p.report.notes
        );
    }

    #[test]
    fn one_layer_too_many_names_the_field_and_both_counts() {
        let e = run(llama(3, 251, ""), &llama_config())
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("model.layers.2.* : the config has num_hidden_layers = 2 but the checkpoint has 3 layers"),
            "{e}"
        );
    }

    #[test]
    fn another_vocabulary_names_vocab_size() {
        let e = run(llama(2, 331, ""), &llama_config())
            .unwrap_err()
            .to_string();
        assert!(e.contains("vocab_size = 251, the checkpoint 331"), "{e}");
        assert!(e.contains("model.embed_tokens.weight"), "{e}");
    }

    #[test]
    fn a_missing_tensor_is_an_error_not_a_random_init() {
        let mut t = llama(2, 251, "");
        t.retain(|(n, _)| n != "model.layers.1.mlp.up_proj.weight");
        let e = run(t, &llama_config()).unwrap_err().to_string();
        assert!(
            e.contains("lacks: model.layers.1.mlp.up_proj.weight"),
            "{e}"
        );
    }

    #[test]
    fn placeholders_are_an_error_with_config_base_or_nothing() {
        let mut t = llama(2, 251, "");
        t[0].1 = vec![0];
        let e = run(t.clone(), &llama_config()).unwrap_err();
        assert!(
            e.to_string()
                .contains("'model.embed_tokens.weight' has shape [0]"),
            "{e}"
        );
        assert!(format!("{e:?}").contains("pass the folder that holds all ranks"));
        let named: Vec<(&str, &[u64])> =
            t.iter().map(|(n, s)| (n.as_str(), s.as_slice())).collect();
        let alone = plan(
            &checkpoint("c.pt", f32s(&named)),
            BaseView::default(),
            &[],
            &PlanOptions::default(),
        );
        assert!(alone.unwrap_err().to_string().contains("no elements"));
    }

    #[test]
    fn an_empty_weight_the_base_lacks_is_refused_as_unknown_not_as_a_placeholder() {
        // With base weights only the base's shapes say what a placeholder is; a
        // name the base lacks is the overlay's error, which names the base.
        let ckpt = checkpoint("c.pt", f32s(&[("x.weight", &[0])]));
        let base_w = checkpoint("b", f32s(&[("y.weight", &[2])]));
        let base = BaseView {
            config: None,
            weights: Some(&base_w),
            total_parameters: None,
        };
        let e = plan(&ckpt, base, &[], &PlanOptions::default()).unwrap_err();
        assert!(
            e.to_string().contains("not in the base model b: x.weight"),
            "{e}"
        );
    }

    #[test]
    fn an_unknown_architecture_warns_that_nothing_was_checked() {
        let mut c = llama_config();
        c.insert(
            "architectures".into(),
            serde_json::json!(["MyOwnForCausalLM"]),
        );
        let p = run(llama(3, 331, ""), &c).unwrap();
        assert!(
            p.report
                .warnings
                .iter()
                .any(|w| w.contains("nothing could be checked") && w.contains("MyOwnForCausalLM")),
            "{:?}",
            p.report.warnings
        );
    }
}
