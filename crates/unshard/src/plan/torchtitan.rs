//! The `Torchtitan` mapping: a torchtitan checkpoint (the DCP `step-N/` folder its
//! `CheckpointManager` writes, model keys flat at the top level) written under the
//! Hugging Face names of the base's architecture (`model_type` llama, qwen3,
//! qwen3_moe or deepseek_v3), from the names of either torchtitan era.
//!
//! It owns the recognition of torchtitan's names, the rule for each, and the pieces
//! of each output tensor. Every output tensor stays a [`Content::Copy`], so the
//! engine and verify treat it as any other copy, bit-exact for every dtype:
//! - a rename keeps the pieces;
//! - Llama's `wq` and `wk` hold each head's rows in the interleaved RoPE order, and
//!   transformers in the half-split order: per head, HF rows `i < hd/2` are
//!   torchtitan's even rows and HF rows `hd/2 + i` its odd ones, i.e. two selections
//!   of every other row, each a piece whose row stride is doubled;
//! - a fused `wqkv` (rows `[n_kv, heads_per_kv + 2, hd]`) is split into runs of rows;
//! - a grouped expert tensor `[E, ...]` gives each expert its box.
//!
//! A selection is intersected with each piece, so chunks sharded on rows are cut
//! where the selection crosses them. The training state torchtitan saves beside
//! the model (`optimizer.`, `lr_scheduler.`, `dataloader.`, `train_state.`) is
//! dropped. A torchtitan name no rule explains is an error naming it.

use std::sync::Mutex;

use serde_json::{Map, Value};

use super::conversion::{narrow, select_rows, Run};
use super::{Candidate, Content, MapInputs, Mapping, Report};
use crate::arch::conversions::Region;
use crate::error::{Error, Result};
use crate::source::TensorSource;

/// Top-level keys torchtitan's `CheckpointManager` saves beside the model.
const TRAINING_STATE: &[&str] = &["optimizer.", "lr_scheduler.", "dataloader.", "train_state."];

/// What follows `layers.N.` in the names only torchtitan's models use.
const LAYER_PARTS: &[&str] = &[
    "attention.",
    "attention_norm.",
    "feed_forward.",
    "ffn_norm.",
    "moe.",
];

/// Whether `name` is one of torchtitan's model names (`tok_embeddings.weight`,
/// `layers.N.attention.*`, `layers.N.feed_forward.*`, `layers.N.moe.*`, ...).
pub fn is_torchtitan_name(name: &str) -> bool {
    if name == "tok_embeddings.weight" {
        return true;
    }
    layer_of(name).is_some_and(|(_, rest)| LAYER_PARTS.iter().any(|p| rest.starts_with(p)))
}

/// `layers.N.rest` as `(N, rest)`.
fn layer_of(name: &str) -> Option<(&str, &str)> {
    let (n, rest) = name.strip_prefix("layers.")?.split_once('.')?;
    (!n.is_empty() && n.bytes().all(|b| b.is_ascii_digit())).then_some((n, rest))
}

/// The architectures whose torchtitan names are mapped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Family {
    Llama,
    Qwen3,
    Qwen3Moe,
    DeepseekV3,
}

impl Family {
    fn of(model_type: &str) -> Option<Family> {
        match model_type {
            "llama" => Some(Family::Llama),
            "qwen3" => Some(Family::Qwen3),
            "qwen3_moe" => Some(Family::Qwen3Moe),
            "deepseek_v3" => Some(Family::DeepseekV3),
            _ => None,
        }
    }
}

/// The naming era of a checkpoint, from its names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Era {
    /// torchtitan <= 0.2: `output.weight`, `attention.wq`, `moe.experts.w1`.
    Old,
    /// torchtitan 0.3: `lm_head.weight`, `attention.qkv_linear.wq`,
    /// `moe.routed_experts.inner_experts.w1_EFD`.
    Current,
    /// No name tells.
    Either,
}

/// The attention geometry of config.json: what permuting or splitting q/k/v rows needs.
#[derive(Clone, Copy, Debug, Default)]
struct Heads {
    n_heads: Option<u64>,
    n_kv: Option<u64>,
    head_dim: Option<u64>,
    hidden: Option<u64>,
}

impl Heads {
    fn of(config: &Map<String, Value>) -> Heads {
        let get = |k: &str| config.get(k).and_then(Value::as_u64);
        let n_heads = get("num_attention_heads");
        let hidden = get("hidden_size");
        let head_dim = get("head_dim").or_else(|| match (hidden, n_heads) {
            (Some(h), Some(n)) if n > 0 => Some(h / n),
            _ => None,
        });
        Heads {
            n_heads,
            n_kv: get("num_key_value_heads").or(n_heads),
            head_dim,
            hidden,
        }
    }
}

/// q or k.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Proj {
    Q,
    K,
}

/// How a grouped expert tensor is laid out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Grouped {
    /// `[E, F, D]`: each expert `[F, D]` (gate and up).
    Efd,
    /// `[E, D, F]`: each expert `[D, F]` (down).
    Edf,
}

/// What becomes of one torchtitan tensor.
#[derive(Debug, PartialEq, Eq)]
enum Rule {
    /// The same bytes under this name.
    Rename(String),
    /// Llama's q or k projection: each head's rows from the interleaved RoPE order.
    Rope(String, Proj),
    /// The fused q/k/v projection of the layer whose HF attention prefix this is.
    Fused(String),
    /// Grouped experts: expert `j` is `{prefix}{j}.{proj}.weight`.
    Experts {
        prefix: String,
        proj: &'static str,
        layout: Grouped,
        /// Named by the old era, whose names do not say the layout.
        old: bool,
    },
    /// No tensor of the HF model.
    Drop(&'static str),
}

/// See the module documentation.
#[derive(Debug)]
pub struct Torchtitan {
    model_type: String,
    family: Family,
    heads: Heads,
    /// What the last `map` did, for the report.
    done: Mutex<Option<Applied>>,
}

/// What a run of the mapping did.
#[derive(Clone, Debug, Default)]
struct Applied {
    era: Option<Era>,
    renamed: usize,
    permuted: usize,
    split: usize,
    experts: usize,
    training_state: usize,
    dropped: Vec<(String, &'static str)>,
}

impl Torchtitan {
    /// The mapping for a base whose config.json names a `model_type` whose
    /// torchtitan names are known; `None` otherwise.
    pub fn for_config(config: Option<&Map<String, Value>>) -> Option<Torchtitan> {
        let config = config?;
        let mt = config.get("model_type")?.as_str()?;
        let family = Family::of(mt)?;
        Some(Torchtitan {
            model_type: mt.to_string(),
            family,
            heads: Heads::of(config),
            done: Mutex::new(None),
        })
    }

    /// Adds a note on what the mapping did, and the model tensors it dropped
    /// (nothing when the checkpoint does not hold torchtitan's names).
    pub fn note(&self, report: &mut Report) {
        let Some(a) = self.done.lock().ok().and_then(|d| d.clone()) else {
            return;
        };
        let era = match a.era {
            Some(Era::Old) => "torchtitan <= 0.2",
            Some(Era::Current) => "torchtitan 0.3",
            _ => "torchtitan",
        };
        let mut did = format!("{} renamed", a.renamed);
        if a.permuted > 0 {
            did += &format!(
                ", {} q/k projection(s) reordered from the interleaved RoPE rows",
                a.permuted
            );
        }
        if a.split > 0 {
            did += &format!(", {} fused wqkv split into q, k and v", a.split);
        }
        if a.experts > 0 {
            did += &format!(", {} grouped expert tensor(s) split per expert", a.experts);
        }
        if a.training_state > 0 {
            did += &format!(
                ", {} entries of training state (optimizer, scheduler, dataloader, train state) left out",
                a.training_state
            );
        }
        report.notes.push(format!(
            "names: the checkpoint holds {era}'s names, written as transformers' {} names: {did}",
            self.model_type
        ));
        for (n, why) in a.dropped {
            report.dropped.push((n, why.to_string()));
        }
    }

    /// The rule for one name; `None` when no rule explains it.
    fn rule(&self, name: &str) -> Option<Rule> {
        use Family::*;
        if TRAINING_STATE.iter().any(|p| name.starts_with(p)) {
            return Some(Rule::Drop("torchtitan's training state"));
        }
        let top = |s: &str| Some(Rule::Rename(s.to_string()));
        match name {
            "tok_embeddings.weight" => return top("model.embed_tokens.weight"),
            "norm.weight" => return top("model.norm.weight"),
            "output.weight" | "lm_head.weight" => return top("lm_head.weight"),
            _ => {}
        }
        let (n, rest) = layer_of(name)?;
        let hf = format!("model.layers.{n}.");
        let f = self.family;
        let (llama, dsv3) = (f == Llama, f == DeepseekV3);
        let qwen = matches!(f, Qwen3 | Qwen3Moe);
        let moe = matches!(f, Qwen3Moe | DeepseekV3);
        let r = |s: &str| Some(Rule::Rename(format!("{hf}{s}")));
        let qk = |s: &str, p: Proj| {
            let name = format!("{hf}self_attn.{s}");
            Some(if llama {
                Rule::Rope(name, p)
            } else {
                Rule::Rename(name)
            })
        };
        let experts = |proj: &'static str, layout: Grouped, old: bool| {
            Some(Rule::Experts {
                prefix: format!("{hf}mlp.experts."),
                proj,
                layout,
                old,
            })
        };
        match rest {
            "attention_norm.weight" => r("input_layernorm.weight"),
            "ffn_norm.weight" => r("post_attention_layernorm.weight"),
            "attention.wo.weight" => r("self_attn.o_proj.weight"),
            "feed_forward.w1.weight" => r("mlp.gate_proj.weight"),
            "feed_forward.w2.weight" => r("mlp.down_proj.weight"),
            "feed_forward.w3.weight" => r("mlp.up_proj.weight"),
            "attention.wq.weight" if dsv3 => r("self_attn.q_proj.weight"),
            "attention.wq.weight" | "attention.qkv_linear.wq.weight" if !dsv3 => {
                qk("q_proj.weight", Proj::Q)
            }
            "attention.wk.weight" | "attention.qkv_linear.wk.weight" if !dsv3 => {
                qk("k_proj.weight", Proj::K)
            }
            "attention.wv.weight" | "attention.qkv_linear.wv.weight" if !dsv3 => {
                r("self_attn.v_proj.weight")
            }
            "attention.qkv_linear.wqkv.weight" if !dsv3 => {
                Some(Rule::Fused(format!("{hf}self_attn.")))
            }
            "attention.q_norm.weight" if qwen => r("self_attn.q_norm.weight"),
            "attention.k_norm.weight" if qwen => r("self_attn.k_norm.weight"),
            "attention.q_norm.weight" if dsv3 => r("self_attn.q_a_layernorm.weight"),
            "attention.wq_a.weight" if dsv3 => r("self_attn.q_a_proj.weight"),
            "attention.wq_b.weight" if dsv3 => r("self_attn.q_b_proj.weight"),
            "attention.wkv_a.weight" if dsv3 => r("self_attn.kv_a_proj_with_mqa.weight"),
            "attention.kv_norm.weight" if dsv3 => r("self_attn.kv_a_layernorm.weight"),
            "attention.wkv_b.weight" if dsv3 => r("self_attn.kv_b_proj.weight"),
            "moe.router.gate.weight" if moe => r("mlp.gate.weight"),
            "moe.shared_experts.w1.weight" if dsv3 => r("mlp.shared_experts.gate_proj.weight"),
            "moe.shared_experts.w2.weight" if dsv3 => r("mlp.shared_experts.down_proj.weight"),
            "moe.shared_experts.w3.weight" if dsv3 => r("mlp.shared_experts.up_proj.weight"),
            "moe.expert_bias_E" | "moe.expert_bias" if dsv3 => {
                r("mlp.gate.e_score_correction_bias")
            }
            "moe.expert_bias_E" | "moe.expert_bias" if moe => Some(Rule::Drop(
                "torchtitan's load-balancing expert bias: transformers' Qwen3-MoE has no such tensor",
            )),
            "moe.routed_experts.inner_experts.w1_EFD" if moe => {
                experts("gate_proj", Grouped::Efd, false)
            }
            "moe.routed_experts.inner_experts.w3_EFD" if moe => {
                experts("up_proj", Grouped::Efd, false)
            }
            "moe.routed_experts.inner_experts.w2_EDF" if moe => {
                experts("down_proj", Grouped::Edf, false)
            }
            "moe.experts.w1" if moe => experts("gate_proj", Grouped::Efd, true),
            "moe.experts.w3" if moe => experts("up_proj", Grouped::Efd, true),
            "moe.experts.w2" if moe => experts("down_proj", Grouped::Edf, true),
            _ => None,
        }
    }

    /// The era the names are of; names of both eras are refused.
    fn era(&self, cands: &[Candidate]) -> Result<Era> {
        let dsv3 = self.family == Family::DeepseekV3;
        let old = |n: &str| {
            n == "output.weight"
                || n.contains(".moe.experts.")
                || n.ends_with(".moe.expert_bias")
                || (!dsv3
                    && layer_of(n).is_some_and(|(_, r)| {
                        matches!(
                            r,
                            "attention.wq.weight" | "attention.wk.weight" | "attention.wv.weight"
                        )
                    }))
        };
        let current = |n: &str| {
            n == "lm_head.weight"
                || n.contains(".qkv_linear.")
                || n.contains(".routed_experts.inner_experts.")
                || n.ends_with(".moe.expert_bias_E")
        };
        let o = cands.iter().find(|c| old(&c.name));
        let c = cands.iter().find(|c| current(&c.name));
        match (o, c) {
            (Some(o), Some(c)) => Err(Error::plan(
                format!(
                    "the checkpoint holds torchtitan names of two eras: '{}' (torchtitan <= 0.2) and '{}' (torchtitan 0.3)",
                    o.source_name, c.source_name
                ),
                Some("a checkpoint written by one torchtitan holds the names of one era: check how it was made".into()),
            )),
            (Some(_), None) => Ok(Era::Old),
            (None, Some(_)) => Ok(Era::Current),
            (None, None) => Ok(Era::Either),
        }
    }

    /// The error for a tensor a rule cannot be applied to.
    fn refuse(&self, c: &Candidate, why: &str) -> Error {
        Error::plan(
            format!(
                "checkpoint tensor '{}' {:?} (torchtitan, model_type {}): {why}",
                c.source_name, c.shape, self.model_type
            ),
            Some("check that the base is the model the training started from (its config.json gives the heads and sizes)".into()),
        )
    }

    /// Heads and head_dim of Llama's q or k, checked against its rows.
    fn head_runs(&self, c: &Candidate, p: Proj) -> Result<(u64, u64)> {
        let (heads, hd) = self.head_runs_geometry(c, p)?;
        if c.shape.first() != heads.checked_mul(hd).as_ref() {
            return Err(self.refuse(
                c,
                &format!("its rows are not {heads} heads of head_dim {hd}, as config.json says"),
            ));
        }
        Ok((heads, hd))
    }

    fn source<'c>(&self, c: &'c Candidate) -> Result<&'c TensorSource> {
        match &c.content {
            Content::Copy(s) => Ok(s),
            Content::Computed(_) => Err(self.refuse(
                c,
                "it is computed (a fused adapter), and only copied tensors are reordered or split",
            )),
        }
    }

    /// A copy of `c` as `rows` rows selected by `runs`, named `name`.
    fn selected(&self, c: &Candidate, runs: &[Run], rows: u64, name: String) -> Result<Candidate> {
        let src = self.source(c)?;
        let t = select_rows(src, runs, rows, &name).map_err(|why| self.refuse(c, &why))?;
        Ok(c.part(name, t))
    }

    /// q, k and v of a fused `wqkv`.
    fn split_fused(&self, c: &Candidate, prefix: &str) -> Result<Vec<Candidate>> {
        let (n_heads, _) = self.head_runs_geometry(c, Proj::Q)?;
        let (n_kv, hd) = self.head_runs_geometry(c, Proj::K)?;
        if n_kv == 0 || n_heads % n_kv != 0 {
            return Err(self.refuse(
                c,
                &format!("{n_heads} query heads do not group over {n_kv} key/value heads"),
            ));
        }
        let hpk = n_heads / n_kv;
        let rows = n_kv * (hpk + 2) * hd;
        if c.shape.first() != Some(&rows) {
            return Err(self.refuse(
                c,
                &format!("a fused wqkv of {n_heads} query and {n_kv} key/value heads of {hd} rows has {rows} rows"),
            ));
        }
        let rope = self.family == Family::Llama;
        let (mut q, mut k, mut v) = (Vec::new(), Vec::new(), Vec::new());
        for g in 0..n_kv {
            let base = g * (hpk + 2) * hd;
            for j in 0..hpk {
                q.extend(one_head(base + j * hd, (g * hpk + j) * hd, hd, rope));
            }
            k.extend(one_head(base + hpk * hd, g * hd, hd, rope));
            v.extend(one_head(base + (hpk + 1) * hd, g * hd, hd, false));
        }
        Ok(vec![
            self.selected(
                c,
                &joined(q),
                n_heads * hd,
                format!("{prefix}q_proj.weight"),
            )?,
            self.selected(c, &joined(k), n_kv * hd, format!("{prefix}k_proj.weight"))?,
            self.selected(c, &joined(v), n_kv * hd, format!("{prefix}v_proj.weight"))?,
        ])
    }

    /// Heads and head_dim of q or k from config.json, without a shape check.
    fn head_runs_geometry(&self, c: &Candidate, p: Proj) -> Result<(u64, u64)> {
        let h = self.heads;
        let heads = match p {
            Proj::Q => h.n_heads,
            Proj::K => h.n_kv,
        };
        match (heads, h.head_dim) {
            (Some(n), Some(hd)) if hd > 0 && hd % 2 == 0 => Ok((n, hd)),
            _ => Err(self.refuse(
                c,
                "config.json does not give num_attention_heads, num_key_value_heads and an even head_dim (or hidden_size), which splitting it needs",
            )),
        }
    }

    /// One expert box per expert of a grouped tensor.
    fn split_experts(
        &self,
        c: &Candidate,
        prefix: &str,
        proj: &str,
        layout: Grouped,
        old: bool,
    ) -> Result<Vec<Candidate>> {
        let src = self.source(c)?;
        let [e, a, b] = c.shape[..] else {
            return Err(self.refuse(c, "grouped experts are [experts, out, in]"));
        };
        if let Some(d) = self.heads.hidden {
            // The hidden size sits last for gate/up ([E, F, D]) and in the middle
            // for down ([E, D, F]).
            let (want, other) = match layout {
                Grouped::Efd => (b, a),
                Grouped::Edf => (a, b),
            };
            if want != d {
                let why = if other == d {
                    format!("it is laid out the other way round ([E, in, out], each expert transposed against transformers' [out, in]; hidden_size {d}): not a box of it")
                } else {
                    format!("neither of its last dimensions is hidden_size {d}")
                };
                return Err(self.refuse(c, &why));
            }
        }
        if old && (a == b || self.heads.hidden.is_none()) {
            return Err(self.refuse(
                c,
                "the names of torchtitan <= 0.2 do not say whether each expert is [out, in] or transposed, and its shape does not tell (square experts, or no hidden_size in config.json)",
            ));
        }
        let mut out = Vec::new();
        for j in 0..e {
            let name = format!("{prefix}{j}.{proj}.weight");
            let region = Region {
                start: vec![j, 0, 0],
                len: vec![1, a, b],
                kept: vec![1, 2],
            };
            let t = narrow(src, &region, &name).map_err(|why| self.refuse(c, &why))?;
            out.push(c.part(name, t));
        }
        Ok(out)
    }

    fn record(&self, a: Applied) {
        if let Ok(mut d) = self.done.lock() {
            *d = Some(a);
        }
    }
}

impl Mapping for Torchtitan {
    fn map(&self, candidates: Vec<Candidate>, _inputs: MapInputs<'_>) -> Result<Vec<Candidate>> {
        if !candidates.iter().any(|c| is_torchtitan_name(&c.name)) {
            return Ok(candidates);
        }
        let mut a = Applied {
            era: Some(self.era(&candidates)?),
            ..Applied::default()
        };
        let mut out = Vec::with_capacity(candidates.len());
        for c in candidates {
            let Some(rule) = self.rule(&c.name) else {
                return Err(Error::plan(
                    format!(
                        "checkpoint tensor '{}' {:?}: the checkpoint holds torchtitan's names, and no rule maps this one to transformers' {} names",
                        c.source_name, c.shape, self.model_type
                    ),
                    Some("check that the base is the model the training started from; a tensor of another torchtitan model or version can be renamed with --rename".into()),
                ));
            };
            match rule {
                Rule::Rename(name) => {
                    a.renamed += 1;
                    out.push(Candidate { name, ..c });
                }
                Rule::Rope(name, p) => {
                    let (heads, hd) = self.head_runs(&c, p)?;
                    let runs: Vec<Run> = (0..heads)
                        .flat_map(|h| one_head(h * hd, h * hd, hd, true))
                        .collect();
                    out.push(self.selected(&c, &runs, heads * hd, name)?);
                    a.permuted += 1;
                }
                Rule::Fused(prefix) => {
                    out.extend(self.split_fused(&c, &prefix)?);
                    a.split += 1;
                }
                Rule::Experts {
                    prefix,
                    proj,
                    layout,
                    old,
                } => {
                    out.extend(self.split_experts(&c, &prefix, proj, layout, old)?);
                    a.experts += 1;
                }
                Rule::Drop(why) => {
                    if TRAINING_STATE.iter().any(|p| c.name.starts_with(p)) {
                        a.training_state += 1;
                    } else {
                        a.dropped.push((c.source_name.clone(), why));
                    }
                }
            }
        }
        self.record(a);
        Ok(out)
    }
}

/// The rows of one head of `hd` rows, source rows from `from`, output rows from
/// `to`: in RoPE order when `rope` (output row `i` is source row `2i`, output row
/// `hd/2 + i` source row `2i + 1`), else as they are.
fn one_head(from: u64, to: u64, hd: u64, rope: bool) -> Vec<Run> {
    if rope {
        let half = hd / 2;
        vec![
            Run {
                from,
                step: 2,
                count: half,
                to,
            },
            Run {
                from: from + 1,
                step: 2,
                count: half,
                to: to + half,
            },
        ]
    } else {
        vec![Run {
            from,
            step: 1,
            count: hd,
            to,
        }]
    }
}

/// `runs` with consecutive runs of whole rows joined: fewer pieces, the same rows.
fn joined(runs: Vec<Run>) -> Vec<Run> {
    let mut out: Vec<Run> = Vec::with_capacity(runs.len());
    for r in runs {
        if let Some(last) = out.last_mut() {
            if last.step == 1
                && r.step == 1
                && last.from + last.count == r.from
                && last.to + last.count == r.to
            {
                last.count += r.count;
                continue;
            }
        }
        out.push(r);
    }
    out
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::dtype::DType;
    use crate::plan::testing::{checkpoint, tensor};
    use crate::source::Piece;

    fn cfg(json: &str) -> Map<String, Value> {
        serde_json::from_str(json).unwrap()
    }

    fn llama() -> Torchtitan {
        Torchtitan::for_config(Some(&cfg(
            r#"{"model_type": "llama", "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 32}"#,
        )))
        .unwrap()
    }

    fn mapping(mt: &str) -> Torchtitan {
        Torchtitan::for_config(Some(&cfg(&format!(
            r#"{{"model_type": "{mt}", "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 32, "head_dim": 8}}"#
        ))))
        .unwrap()
    }

    /// A float32 tensor of `rows` x `cols` in row chunks (one file each) starting at
    /// the given rows.
    fn chunked(name: &str, rows: u64, cols: u64, starts: &[u64]) -> TensorSource {
        let mut t = tensor(name, DType::F32, &[rows, cols]);
        let mut ends = starts[1..].to_vec();
        ends.push(rows);
        t.pieces = starts
            .iter()
            .zip(&ends)
            .enumerate()
            .map(|(i, (&s, &e))| Piece {
                file: i,
                byte_offset: 1000,
                dtype: DType::F32,
                shape: vec![e - s, cols],
                strides: vec![cols, 1],
                global_offset: vec![s, 0],
                big_endian: false,
            })
            .collect::<Vec<_>>()
            .into();
        t
    }

    /// For each output row, the source row its bytes are read from (given the
    /// source chunks of `chunked`), checking every row is covered once.
    fn source_rows(src: &TensorSource, out: &TensorSource) -> Vec<u64> {
        let cols = src.shape[1];
        let mut rows = vec![None; out.shape[0] as usize];
        for q in out.pieces.iter() {
            let p = &src.pieces[q.file];
            assert_eq!(q.shape[1], cols);
            for k in 0..q.shape[0] {
                let byte = q.byte_offset + k * q.strides[0] * 4;
                let row = p.global_offset[0] + (byte - p.byte_offset) / (cols * 4);
                assert!(row < p.global_offset[0] + p.shape[0], "read past its chunk");
                let slot = &mut rows[(q.global_offset[0] + k) as usize];
                assert!(slot.is_none(), "a row written twice");
                *slot = Some(row);
            }
        }
        rows.into_iter().map(|r| r.unwrap()).collect()
    }

    /// The HF row order of `heads` heads of `hd` rows: the source row of each.
    fn rope_order(heads: u64, hd: u64) -> Vec<u64> {
        let mut v = Vec::new();
        for h in 0..heads {
            v.extend((0..hd / 2).map(|i| h * hd + 2 * i));
            v.extend((0..hd / 2).map(|i| h * hd + 2 * i + 1));
        }
        v
    }

    #[test]
    fn torchtitan_names_of_both_eras_are_recognised_and_others_are_not() {
        for n in [
            "tok_embeddings.weight",
            "layers.0.attention.wq.weight",
            "layers.12.attention.qkv_linear.wqkv.weight",
            "layers.3.feed_forward.w2.weight",
            "layers.1.attention_norm.weight",
            "layers.1.ffn_norm.weight",
            "layers.1.moe.routed_experts.inner_experts.w1_EFD",
            "layers.1.moe.experts.w1",
        ] {
            assert!(is_torchtitan_name(n), "{n}");
        }
        for n in [
            "model.layers.0.self_attn.q_proj.weight",
            "layers.x.attention.wq.weight",
            "layers..attention.wq.weight",
            "layers.0.self_attn.q_proj.weight",
            "norm.weight",
            "lm_head.weight",
            "optimizer.state.layers.0.attention.wq.weight.exp_avg",
        ] {
            assert!(!is_torchtitan_name(n), "{n}");
        }
    }

    #[test]
    fn each_name_has_its_rule_per_family() {
        let l = llama();
        let rename = |s: &str| Some(Rule::Rename(s.to_string()));
        assert_eq!(l.rule("output.weight"), rename("lm_head.weight"));
        assert_eq!(l.rule("lm_head.weight"), rename("lm_head.weight"));
        assert_eq!(
            l.rule("layers.3.attention.qkv_linear.wk.weight"),
            Some(Rule::Rope(
                "model.layers.3.self_attn.k_proj.weight".into(),
                Proj::K
            ))
        );
        assert_eq!(
            l.rule("layers.3.attention.wq.weight"),
            Some(Rule::Rope(
                "model.layers.3.self_attn.q_proj.weight".into(),
                Proj::Q
            ))
        );
        assert_eq!(
            l.rule("layers.3.feed_forward.w2.weight"),
            rename("model.layers.3.mlp.down_proj.weight")
        );
        // Llama has no experts nor q/k norms: no rule.
        assert_eq!(l.rule("layers.0.moe.router.gate.weight"), None);
        assert_eq!(l.rule("layers.0.attention.q_norm.weight"), None);
        assert!(matches!(
            l.rule("optimizer.state.tok_embeddings.weight.exp_avg"),
            Some(Rule::Drop(_))
        ));

        let q = mapping("qwen3");
        assert_eq!(
            q.rule("layers.0.attention.qkv_linear.wq.weight"),
            rename("model.layers.0.self_attn.q_proj.weight")
        );
        assert_eq!(
            q.rule("layers.0.attention.q_norm.weight"),
            rename("model.layers.0.self_attn.q_norm.weight")
        );

        let m = mapping("qwen3_moe");
        assert!(matches!(
            m.rule("layers.1.moe.expert_bias_E"),
            Some(Rule::Drop(_))
        ));
        assert_eq!(
            m.rule("layers.1.moe.routed_experts.inner_experts.w2_EDF"),
            Some(Rule::Experts {
                prefix: "model.layers.1.mlp.experts.".into(),
                proj: "down_proj",
                layout: Grouped::Edf,
                old: false
            })
        );
        assert_eq!(m.rule("layers.1.moe.shared_experts.w1.weight"), None);

        let d = mapping("deepseek_v3");
        assert_eq!(
            d.rule("layers.0.attention.wq.weight"),
            rename("model.layers.0.self_attn.q_proj.weight")
        );
        assert_eq!(
            d.rule("layers.0.attention.q_norm.weight"),
            rename("model.layers.0.self_attn.q_a_layernorm.weight")
        );
        assert_eq!(
            d.rule("layers.1.moe.expert_bias_E"),
            rename("model.layers.1.mlp.gate.e_score_correction_bias")
        );
        assert_eq!(
            d.rule("layers.1.moe.shared_experts.w3.weight"),
            rename("model.layers.1.mlp.shared_experts.up_proj.weight")
        );
        assert!(Torchtitan::for_config(Some(&cfg(r#"{"model_type": "mistral"}"#))).is_none());
    }

    #[test]
    fn rope_rows_are_read_every_other_row_across_row_chunks() {
        // wk of 2 heads of 8 rows, saved in chunks of 5 and 11 rows: the cut falls
        // inside head 0, between an even and an odd row.
        let src = chunked("wk", 16, 3, &[0, 5]);
        let runs: Vec<Run> = (0..2)
            .flat_map(|h| one_head(h * 8, h * 8, 8, true))
            .collect();
        let out = select_rows(&src, &runs, 16, "k").unwrap();
        assert_eq!(out.shape, [16, 3]);
        assert_eq!(source_rows(&src, &out), rope_order(2, 8));
        assert!(out.pieces.iter().all(|p| p.strides == [6, 1]));
    }

    #[test]
    fn a_fused_wqkv_splits_by_kv_group_with_rope_for_llama() {
        // 4 query heads over 2 key/value heads of 8 rows: 2 groups of (2 + 2) heads.
        let l = llama();
        let src = chunked("layers.0.attention.qkv_linear.wqkv.weight", 64, 2, &[0, 21]);
        let ck = checkpoint("c", vec![src.clone()]);
        let cands = crate::plan::mapping::candidates(&ck);
        let out = l.map(cands, MapInputs::default()).unwrap();
        let names: Vec<&str> = out.iter().map(|c| c.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "model.layers.0.self_attn.q_proj.weight",
                "model.layers.0.self_attn.k_proj.weight",
                "model.layers.0.self_attn.v_proj.weight"
            ]
        );
        let rows = |c: &Candidate| match &c.content {
            Content::Copy(t) => source_rows(&src, t),
            Content::Computed(_) => panic!("a copy"),
        };
        let head = |src_head: u64| rope_order(1, 8).into_iter().map(move |r| r + src_head * 8);
        // Group g's heads sit at g * 4 .. g * 4 + 4: q, q, k, v.
        let q: Vec<u64> = [0, 1, 4, 5].into_iter().flat_map(head).collect();
        let k: Vec<u64> = [2, 6].into_iter().flat_map(head).collect();
        let v: Vec<u64> = (24..32).chain(56..64).collect();
        assert_eq!(rows(&out[0]), q);
        assert_eq!(rows(&out[1]), k);
        assert_eq!(rows(&out[2]), v);
    }

    #[test]
    fn grouped_experts_give_one_box_each_and_a_transposed_layout_is_refused() {
        let m = mapping("qwen3_moe");
        let ck = checkpoint(
            "c",
            vec![
                tensor(
                    "layers.0.moe.routed_experts.inner_experts.w1_EFD",
                    DType::F32,
                    &[2, 6, 32],
                ),
                tensor("layers.0.moe.expert_bias_E", DType::F32, &[2]),
                tensor(
                    "optimizer.state.tok_embeddings.weight.step",
                    DType::F32,
                    &[],
                ),
            ],
        );
        let out = m
            .map(crate::plan::mapping::candidates(&ck), MapInputs::default())
            .unwrap();
        let got: Vec<(&str, &[u64])> = out
            .iter()
            .map(|c| (c.name.as_str(), c.shape.as_slice()))
            .collect();
        assert_eq!(
            got,
            [
                (
                    "model.layers.0.mlp.experts.0.gate_proj.weight",
                    &[6, 32][..]
                ),
                (
                    "model.layers.0.mlp.experts.1.gate_proj.weight",
                    &[6, 32][..]
                )
            ]
        );
        let mut r = Report::default();
        m.note(&mut r);
        assert_eq!(r.dropped.len(), 1, "{r:?}");
        assert!(r.notes[0].contains("1 entries of training state"), "{r:?}");

        let old = checkpoint(
            "c",
            vec![tensor("layers.0.moe.experts.w1", DType::F32, &[2, 32, 6])],
        );
        let e = m
            .map(crate::plan::mapping::candidates(&old), MapInputs::default())
            .unwrap_err()
            .to_string();
        assert!(e.contains("'layers.0.moe.experts.w1' [2, 32, 6]"), "{e}");
        assert!(e.contains("transposed"), "{e}");
        // Square experts under the old names: the layout cannot be told.
        let square = checkpoint(
            "c",
            vec![tensor("layers.0.moe.experts.w2", DType::F32, &[2, 32, 32])],
        );
        let e = m
            .map(
                crate::plan::mapping::candidates(&square),
                MapInputs::default(),
            )
            .unwrap_err()
            .to_string();
        assert!(e.contains("'layers.0.moe.experts.w2' [2, 32, 32]"), "{e}");
        assert!(e.contains("do not say whether"), "{e}");
    }

    #[test]
    fn a_torchtitan_name_no_rule_explains_is_named() {
        let l = llama();
        let ck = checkpoint(
            "c",
            vec![
                tensor("tok_embeddings.weight", DType::F32, &[4, 32]),
                tensor("layers.0.attention.rope.cache", DType::F32, &[4, 8]),
            ],
        );
        let e = l
            .map(crate::plan::mapping::candidates(&ck), MapInputs::default())
            .unwrap_err()
            .to_string();
        assert!(e.contains("'layers.0.attention.rope.cache' [4, 8]"), "{e}");
        assert!(e.contains("no rule maps this one"), "{e}");
    }

    #[test]
    fn names_of_two_eras_are_refused_and_other_checkpoints_left_alone() {
        let l = llama();
        let mixed = checkpoint(
            "c",
            vec![
                tensor("output.weight", DType::F32, &[4, 32]),
                tensor("lm_head.weight", DType::F32, &[4, 32]),
                tensor("tok_embeddings.weight", DType::F32, &[4, 32]),
            ],
        );
        let e = l
            .map(
                crate::plan::mapping::candidates(&mixed),
                MapInputs::default(),
            )
            .unwrap_err()
            .to_string();
        assert!(e.contains("two eras"), "{e}");
        let hf = checkpoint(
            "c",
            vec![tensor("model.embed_tokens.weight", DType::F32, &[4, 32])],
        );
        let out = l
            .map(crate::plan::mapping::candidates(&hf), MapInputs::default())
            .unwrap();
        assert_eq!(out[0].name, "model.embed_tokens.weight");
    }

    #[test]
    fn a_wq_whose_rows_are_not_the_configs_heads_is_refused() {
        let l = llama();
        let ck = checkpoint(
            "c",
            vec![tensor(
                "layers.0.attention.wq.weight",
                DType::F32,
                &[24, 32],
            )],
        );
        let e = l
            .map(crate::plan::mapping::candidates(&ck), MapInputs::default())
            .unwrap_err()
            .to_string();
        assert!(e.contains("'layers.0.attention.wq.weight' [24, 32]"), "{e}");
        assert!(e.contains("not 4 heads of head_dim 8"), "{e}");
    }
}
