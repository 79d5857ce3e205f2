//! Step 2 of planning: which checkpoint tensors to write. Known non-persistent
//! buffers are dropped (unless the base has them), and so is an output head tied
//! to the input embedding: transformers writes a tied head once, as the embedding.

use std::collections::HashMap;

use serde_json::{Map, Value};

use super::{Candidate, Report};
use crate::source::TensorSource;

/// Buffers that models register as non-persistent today but older versions saved:
/// transformers recomputes them, and loading them is an "unexpected key".
pub fn is_nonpersistent_buffer(name: &str) -> Option<&'static str> {
    let last2: Vec<&str> = name.rsplitn(3, '.').take(2).collect();
    match last2.as_slice() {
        ["inv_freq" | "original_inv_freq", "rotary_emb"] => {
            Some("rotary embedding buffer, recomputed from the config")
        }
        ["bias" | "masked_bias", "attn"] => Some("causal-mask buffer, rebuilt by the model"),
        _ => None,
    }
}

/// Names of input embeddings that an output head may be tied to, most common first.
const EMBEDDING_NAMES: &[&str] = &[
    "model.embed_tokens.weight",
    "transformer.wte.weight",
    "model.decoder.embed_tokens.weight",
    "gpt_neox.embed_in.weight",
    "transformer.word_embeddings.weight",
    "embed_tokens.weight",
];

/// Whether the config ties input and output embeddings. transformers' default is
/// to tie, so a config that does not say is taken to tie only if the base weights
/// lack the head (checked by the caller).
fn config_ties(config: Option<&Map<String, Value>>) -> Option<bool> {
    let c = config?;
    if let Some(b) = c.get("tie_word_embeddings").and_then(Value::as_bool) {
        return Some(b);
    }
    c.get("text_config")
        .and_then(|t| t.get("tie_word_embeddings"))
        .and_then(Value::as_bool)
}

/// Which tensors to keep (by position in `names`): all but the non-persistent
/// buffers the base does not hold.
pub(crate) fn drop_buffers(
    names: &[String],
    base: Option<&HashMap<&str, &TensorSource>>,
    report: &mut Report,
) -> Vec<bool> {
    let mut keep = vec![true; names.len()];
    for (i, n) in names.iter().enumerate() {
        if base.is_some_and(|m| m.contains_key(n.as_str())) {
            continue;
        }
        if let Some(why) = is_nonpersistent_buffer(n) {
            keep[i] = false;
            report.dropped.push((n.clone(), why.to_string()));
        }
    }
    keep
}

/// Drops `lm_head.weight` when it is tied to the input embedding: the config says
/// so, or (when it does not say) the base lacks a head or the checkpoint stores
/// both in one storage. A head the base has is always written.
pub(crate) fn drop_tied_head(
    cands: &[Candidate],
    names: &[String],
    base: Option<&HashMap<&str, &TensorSource>>,
    config: Option<&Map<String, Value>>,
    keep: &mut [bool],
    report: &mut Report,
) {
    let Some(head) = names.iter().position(|n| n == "lm_head.weight") else {
        return;
    };
    let head_in_base = base.map(|m| m.contains_key("lm_head.weight"));
    let shares = cands[head].storage.as_ref().and_then(|s| {
        cands
            .iter()
            .enumerate()
            .find(|(j, t)| {
                *j != head && t.storage.as_ref() == Some(s) && t.shape == cands[head].shape
            })
            .map(|(j, _)| names[j].clone())
    });
    let embedding = shares.clone().or_else(|| {
        EMBEDDING_NAMES
            .iter()
            .find(|e| names.iter().any(|n| n == *e))
            .map(|e| e.to_string())
    });
    let tied = match (config_ties(config), head_in_base) {
        (Some(false), _) => false,
        (Some(true), _) => true,
        (None, Some(false)) => true,
        (None, _) => shares.is_some(),
    };
    if tied && head_in_base != Some(true) {
        if let Some(e) = embedding {
            keep[head] = false;
            report.dropped.push((
                "lm_head.weight".into(),
                format!("tied to {e}; written once"),
            ));
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::dtype::DType;
    use crate::plan::mapping::candidates;
    use crate::plan::testing::{checkpoint, f32s, sharing, tensor};
    use crate::source::Checkpoint;

    #[test]
    fn recognises_nonpersistent_buffers() {
        assert!(is_nonpersistent_buffer("model.layers.3.self_attn.rotary_emb.inv_freq").is_some());
        assert!(is_nonpersistent_buffer("transformer.h.0.attn.masked_bias").is_some());
        assert!(is_nonpersistent_buffer("transformer.h.0.attn.c_attn.bias").is_none());
        assert!(is_nonpersistent_buffer("model.layers.0.self_attn.q_proj.bias").is_none());
    }

    fn names_of(ckpt: &Checkpoint) -> Vec<String> {
        ckpt.tensors.iter().map(|t| t.name.clone()).collect()
    }

    #[test]
    fn a_buffer_is_dropped_unless_the_base_holds_it() {
        let ckpt = checkpoint(
            "c",
            f32s(&[("m.rotary_emb.inv_freq", &[4]), ("m.q.weight", &[4])]),
        );
        let names = names_of(&ckpt);
        let mut report = Report::default();
        assert_eq!(drop_buffers(&names, None, &mut report), [false, true]);
        assert_eq!(report.dropped[0].0, "m.rotary_emb.inv_freq");
        let t = tensor("m.rotary_emb.inv_freq", DType::F32, &[4]);
        let base: HashMap<&str, &TensorSource> = [(t.name.as_str(), &t)].into_iter().collect();
        let mut report = Report::default();
        assert_eq!(drop_buffers(&names, Some(&base), &mut report), [true, true]);
        assert!(report.dropped.is_empty());
    }

    fn tie(ckpt: &Checkpoint, config: Option<&str>, base_has_head: Option<bool>) -> Vec<bool> {
        let names = names_of(ckpt);
        let config: Option<Map<String, Value>> = config.map(|c| serde_json::from_str(c).unwrap());
        let head = tensor("lm_head.weight", DType::F32, &[8, 4]);
        let emb = tensor("model.embed_tokens.weight", DType::F32, &[8, 4]);
        let base: Option<HashMap<&str, &TensorSource>> = base_has_head.map(|has| {
            let mut m: HashMap<&str, &TensorSource> = HashMap::new();
            m.insert(emb.name.as_str(), &emb);
            if has {
                m.insert(head.name.as_str(), &head);
            }
            m
        });
        let mut keep = vec![true; names.len()];
        let mut report = Report::default();
        drop_tied_head(
            &candidates(ckpt),
            &names,
            base.as_ref(),
            config.as_ref(),
            &mut keep,
            &mut report,
        );
        keep
    }

    #[test]
    fn a_tied_head_is_written_once_as_the_config_or_the_storage_says() {
        let ckpt = checkpoint(
            "c",
            f32s(&[
                ("model.embed_tokens.weight", &[8, 4]),
                ("lm_head.weight", &[8, 4]),
            ]),
        );
        // The config decides.
        assert_eq!(
            tie(&ckpt, Some(r#"{"tie_word_embeddings": true}"#), None),
            [true, false]
        );
        assert_eq!(
            tie(&ckpt, Some(r#"{"tie_word_embeddings": false}"#), None),
            [true, true]
        );
        assert_eq!(
            tie(
                &ckpt,
                Some(r#"{"text_config": {"tie_word_embeddings": true}}"#),
                None
            ),
            [true, false]
        );
        // Silent config: a base without a head means tied; one with a head, untied.
        assert_eq!(tie(&ckpt, Some("{}"), Some(false)), [true, false]);
        assert_eq!(tie(&ckpt, Some("{}"), Some(true)), [true, true]);
        // A head the base has is written even if the config says tied.
        assert_eq!(
            tie(&ckpt, Some(r#"{"tie_word_embeddings": true}"#), Some(true)),
            [true, true]
        );
        // No config, no base: shared storage is the only evidence.
        assert_eq!(tie(&ckpt, None, None), [true, true]);
        let shared = checkpoint(
            "c",
            vec![
                sharing(tensor("wte", DType::F32, &[8, 4]), "0"),
                sharing(tensor("lm_head.weight", DType::F32, &[8, 4]), "0"),
            ],
        );
        assert_eq!(tie(&shared, None, None), [true, false]);
    }
}
