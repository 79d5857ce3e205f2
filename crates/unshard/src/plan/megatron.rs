//! The `Megatron` mapping: Megatron-Core's tensor names and fused layouts
//! (`embedding.word_embeddings`, `decoder.layers...`, `output_layer`) written as
//! the Hugging Face names of the base's `model_type` (Llama, Mistral, Qwen2,
//! Qwen3, Mixtral, Qwen3-MoE).
//!
//! It owns which Megatron tensor makes which Hugging Face tensor, and the boxes
//! each is cut into: a stacked `decoder.layers.X` `[L, ...]` gives one tensor per
//! layer; the group-interleaved fused QKV gives q, k and v as unions of row
//! blocks (query group `g` of `G` holds its `r` q heads, then one k and one v
//! head, `d` rows each); SwiGLU's `linear_fc1` gives the gate rows then the up
//! rows; stacked experts `[.., E, ...]` give one tensor per expert; a vocabulary
//! padded past the base's `vocab_size` keeps its first rows. Every output is a
//! [`Content::Copy`] of the Megatron tensor's pieces narrowed to those boxes and
//! placed at their rows, so bytes are copied unchanged for every dtype. A name no
//! rule explains is refused by name.

use std::sync::Mutex;

use serde_json::{Map, Value};

use super::conversion::{narrow, select_rows, Run};
use super::{Candidate, Content, MapInputs, Mapping, Report};
use crate::arch::conversions::Region;
use crate::error::{Error, Result};
use crate::source::TensorSource;

/// See the module documentation.
#[derive(Debug)]
pub struct Megatron {
    config: Option<Map<String, Value>>,
    /// What the last `map` did, for the report.
    done: Mutex<Option<Applied>>,
}

#[derive(Clone, Debug)]
struct Applied {
    model_type: String,
    read: usize,
    written: usize,
    /// `(padded rows, rows kept)` when the vocabulary was trimmed.
    trimmed: Option<(u64, u64)>,
}

/// Where a model family keeps its mixture-of-experts tensors.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Family {
    Dense,
    Mixtral,
    Qwen3Moe,
}

/// What the mapping needs of the base's config.
#[derive(Debug)]
struct Shape {
    model_type: String,
    family: Family,
    heads: u64,
    groups: u64,
    head_dim: Option<u64>,
    /// `num_hidden_layers`.
    layers: Option<u64>,
    /// `num_local_experts` (Mixtral) or `num_experts` (Qwen3-MoE).
    experts: Option<u64>,
    vocab: Option<u64>,
}

/// A block of rows: `len` rows from `from` of the source, placed at `to`.
#[derive(Clone, Copy, Debug)]
struct Rows {
    from: u64,
    len: u64,
    to: u64,
}

const HINT: &str = "the checkpoint may come from another Megatron spec or model; rename the tensor with --rename to the Hugging Face name it stands for";

impl Megatron {
    /// The mapping, given the base's config.json (which gives the heads, query
    /// groups and vocabulary size the layouts need).
    pub fn for_config(config: Option<&Map<String, Value>>) -> Megatron {
        Megatron {
            config: config.cloned(),
            done: Mutex::new(None),
        }
    }

    /// Adds a note on what the mapping did (nothing when it changed nothing).
    pub fn note(&self, report: &mut Report) {
        let done = self.done.lock().map(|d| d.clone()).unwrap_or(None);
        if let Some(a) = done {
            let trim = a
                .trimmed
                .map(|(p, v)| {
                    format!("; the padded vocabulary ({p} rows) trimmed to the base's {v}")
                })
                .unwrap_or_default();
            report.notes.push(format!(
                "layout: Megatron-Core names; {} tensor(s) written as {} tensor(s) of the Hugging Face {} layout (stacked layers and experts unstacked, fused QKV and SwiGLU fc1 split, each a box of the Megatron tensor){trim}",
                a.read, a.written, a.model_type
            ));
        }
    }

    /// Whether a checkpoint holds Megatron-Core names (before any mapping).
    pub fn names_in(checkpoint: &crate::source::Checkpoint) -> bool {
        checkpoint.tensors.iter().any(|t| is_megatron(&t.name))
    }

    fn shape(&self, first: &str) -> Result<Shape> {
        let Some(cfg) = &self.config else {
            return Err(Error::plan(
                format!("checkpoint tensor '{first}' is a Megatron-Core name, and there is no config.json to map it to Hugging Face names with, nor training arguments (common.pt, or args in the rank files) to derive one from"),
                Some("pass --base with the Hugging Face model directory (or its config.json alone) the training started from".into()),
            ));
        };
        let model_type = cfg
            .get("model_type")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_string();
        let family = match model_type.as_str() {
            "llama" | "mistral" | "qwen2" | "qwen3" => Family::Dense,
            "mixtral" => Family::Mixtral,
            "qwen3_moe" => Family::Qwen3Moe,
            _ => {
                return Err(Error::plan(
                    format!(
                        "checkpoint tensor '{first}' is a Megatron-Core name, and the base's model_type '{model_type}' is not one unshard maps Megatron names to (llama, mistral, qwen2, qwen3, mixtral, qwen3_moe)"
                    ),
                    Some("convert with Megatron-Bridge, or rename the tensors with --rename".into()),
                ))
            }
        };
        let num = |k: &str| cfg.get(k).and_then(Value::as_u64);
        let Some(heads) = num("num_attention_heads").filter(|&h| h > 0) else {
            return Err(Error::plan(
                format!("checkpoint tensor '{first}' is a Megatron-Core name, and the base's config.json has no num_attention_heads to split the fused QKV with"),
                Some("pass a base whose config.json is the model's".into()),
            ));
        };
        let groups = num("num_key_value_heads").unwrap_or(heads);
        if groups == 0 || heads % groups != 0 {
            return Err(Error::plan(
                format!("the base's config.json has {heads} attention heads and {groups} key-value heads: not a whole number of heads per group"),
                Some("pass a base whose config.json is the model's".into()),
            ));
        }
        Ok(Shape {
            model_type,
            family,
            heads,
            groups,
            head_dim: num("head_dim"),
            layers: num("num_hidden_layers"),
            experts: num("num_local_experts").or_else(|| num("num_experts")),
            vocab: num("vocab_size"),
        })
    }

    fn record(&self, a: Applied) {
        if let Ok(mut d) = self.done.lock() {
            *d = Some(a);
        }
    }
}

/// A name with one leading `module.` (a wrapped model's) removed.
fn unprefixed(name: &str) -> &str {
    match name.strip_prefix("module.") {
        Some(rest)
            if rest.starts_with("embedding.")
                || rest.starts_with("decoder.")
                || rest.starts_with("output_layer.") =>
        {
            rest
        }
        _ => name,
    }
}

/// Whether a name is one only Megatron-Core writes.
fn is_megatron(name: &str) -> bool {
    let n = unprefixed(name);
    n == "embedding.word_embeddings.weight"
        || n == "output_layer.weight"
        || n == "decoder.final_layernorm.weight"
        || (n.starts_with("decoder.layers.") && n.contains(".linear_qkv."))
}

impl Mapping for Megatron {
    fn map(&self, candidates: Vec<Candidate>, _inputs: MapInputs<'_>) -> Result<Vec<Candidate>> {
        let Some(first) = candidates.iter().find(|c| is_megatron(&c.name)) else {
            return Ok(candidates);
        };
        let shape = self.shape(&first.source_name)?;
        let mut out = Vec::with_capacity(candidates.len() * 2);
        let mut trimmed = None;
        let read = candidates.len();
        for c in candidates {
            let Content::Copy(src) = &c.content else {
                return Err(Error::plan(
                    format!(
                        "checkpoint tensor '{}' is computed, and Megatron-Core names are mapped only for copied tensors",
                        c.source_name
                    ),
                    None,
                ));
            };
            let name = unprefixed(&c.name).to_string();
            let emit = |out: &mut Vec<Candidate>, hf: String, t: TensorSource| {
                out.push(c.part(hf, t));
            };
            match name.as_str() {
                "embedding.word_embeddings.weight" | "output_layer.weight" => {
                    let hf = if name.starts_with("embedding.") {
                        "model.embed_tokens.weight"
                    } else {
                        "lm_head.weight"
                    };
                    let rows = first_dim(&c, src, 2)?;
                    let keep = match shape.vocab {
                        Some(v) if v < rows => {
                            trimmed = Some((rows, v));
                            v
                        }
                        Some(v) if v > rows => {
                            return Err(Error::plan(
                                format!(
                                    "checkpoint tensor '{}' has {rows} vocabulary rows, fewer than the base's vocab_size {v}",
                                    c.source_name
                                ),
                                Some("pass the base the training started from".into()),
                            ))
                        }
                        _ => rows,
                    };
                    let blocks = [Rows {
                        from: 0,
                        len: keep,
                        to: 0,
                    }];
                    emit(&mut out, hf.into(), take(&c, src, &[], Some(&blocks), hf)?);
                }
                "decoder.final_layernorm.weight" => {
                    emit(
                        &mut out,
                        "model.norm.weight".into(),
                        whole(&c, src, &[], "model.norm.weight")?,
                    );
                }
                n if n.starts_with("decoder.layers.") => {
                    let rest = &n["decoder.layers.".len()..];
                    let (layer, sub) = match rest.split_once('.') {
                        Some((l, sub))
                            if l.bytes().all(|b| b.is_ascii_digit()) && !l.is_empty() =>
                        {
                            let l: u64 = l.parse().map_err(|_| unexplained(&c, &shape))?;
                            (Some(l), sub)
                        }
                        _ => (None, rest),
                    };
                    match layer {
                        Some(l) => {
                            within(&c, "layer", l, shape.layers, false)?;
                            layer_tensors(&c, src, &shape, sub, l, &[], &mut out)?
                        }
                        None => {
                            let layers = first_dim(&c, src, 1)?;
                            within(&c, "layer", layers, shape.layers, true)?;
                            for l in 0..layers {
                                layer_tensors(&c, src, &shape, sub, l, &[l], &mut out)?;
                            }
                        }
                    }
                }
                _ => return Err(unexplained(&c, &shape)),
            }
        }
        self.record(Applied {
            model_type: shape.model_type.clone(),
            read,
            written: out.len(),
            trimmed,
        });
        Ok(out)
    }
}

fn unexplained(c: &Candidate, shape: &Shape) -> Error {
    Error::plan(
        format!(
            "checkpoint tensor '{}' {:?}: no rule maps this Megatron-Core name to the Hugging Face {} layout",
            c.source_name, c.shape, shape.model_type
        ),
        Some(HINT.into()),
    )
}

/// Most layers or experts a stacked tensor may hold when the config does not say.
const MAX_STACKED: u64 = 1 << 16;

/// Checks a stacked count (`count`, equal to the config's) or an index (below it)
/// of layers or experts against the base's config.
fn within(c: &Candidate, what: &str, n: u64, config: Option<u64>, count: bool) -> Result<()> {
    let fits = match (config, count) {
        (Some(k), true) => n == k,
        (Some(k), false) => n < k,
        (None, _) => n < MAX_STACKED,
    };
    if fits {
        return Ok(());
    }
    let said = if count {
        format!("holds {n} {what}s")
    } else {
        format!("is {what} {n}")
    };
    Err(Error::plan(
        format!(
            "checkpoint tensor '{}' {:?} {said}, and the base's config.json has {}",
            c.source_name,
            c.shape,
            config.map_or_else(
                || format!("no {what} count (at most {MAX_STACKED} are read)"),
                |k| format!("{k}")
            )
        ),
        Some("pass the base the training started from".into()),
    ))
}

/// The length of `src`'s first dimension, which must have at least `min` dimensions.
fn first_dim(c: &Candidate, src: &TensorSource, min: usize) -> Result<u64> {
    match src.shape.first() {
        Some(&n) if src.shape.len() >= min => Ok(n),
        _ => Err(Error::plan(
            format!(
                "checkpoint tensor '{}' has shape {:?}: Megatron-Core's layout has at least {min} dimension(s) here",
                c.source_name, src.shape
            ),
            Some(HINT.into()),
        )),
    }
}

/// The tensors of layer `l` that `sub` (the name after `decoder.layers.[N.]`)
/// makes; `fixed` indexes the leading layer axis of a stacked tensor.
fn layer_tensors(
    c: &Candidate,
    src: &TensorSource,
    shape: &Shape,
    sub: &str,
    l: u64,
    fixed: &[u64],
    out: &mut Vec<Candidate>,
) -> Result<()> {
    let p = format!("model.layers.{l}.");
    let mut push = |hf: String, t: TensorSource| {
        out.push(c.part(hf, t));
    };
    let plain = match sub {
        "self_attention.linear_qkv.layer_norm_weight" | "input_layernorm.weight" => {
            Some("input_layernorm.weight")
        }
        "mlp.linear_fc1.layer_norm_weight" | "pre_mlp_layernorm.weight" => {
            Some("post_attention_layernorm.weight")
        }
        "self_attention.linear_proj.weight" => Some("self_attn.o_proj.weight"),
        "self_attention.linear_proj.bias" => Some("self_attn.o_proj.bias"),
        "self_attention.q_layernorm.weight" => Some("self_attn.q_norm.weight"),
        "self_attention.k_layernorm.weight" => Some("self_attn.k_norm.weight"),
        "mlp.linear_fc2.weight" => Some("mlp.down_proj.weight"),
        "mlp.router.weight" => match shape.family {
            Family::Mixtral => Some("block_sparse_moe.gate.weight"),
            Family::Qwen3Moe => Some("mlp.gate.weight"),
            Family::Dense => None,
        },
        _ => None,
    };
    if let Some(hf) = plain {
        let name = format!("{p}{hf}");
        push(name.clone(), whole(c, src, fixed, &name)?);
        return Ok(());
    }
    match sub {
        "self_attention.linear_qkv.weight" | "self_attention.linear_qkv.bias" => {
            let kind = if sub.ends_with("weight") {
                "weight"
            } else {
                "bias"
            };
            let rows = dim(c, src, fixed.len())?;
            for (proj, blocks) in qkv_blocks(c, shape, rows)? {
                let name = format!("{p}self_attn.{proj}.{kind}");
                push(name.clone(), take(c, src, fixed, Some(&blocks), &name)?);
            }
        }
        "mlp.linear_fc1.weight" => {
            let rows = dim(c, src, fixed.len())?;
            for (proj, blocks) in swiglu_blocks(c, rows)? {
                let name = format!("{p}mlp.{proj}.weight");
                push(name.clone(), take(c, src, fixed, Some(&blocks), &name)?);
            }
        }
        "mlp.experts.experts.linear_fc1.weight" | "mlp.experts.experts.linear_fc2.weight" => {
            let (base, gate, up, down) = match shape.family {
                Family::Mixtral => ("block_sparse_moe.experts", "w1", "w3", "w2"),
                Family::Qwen3Moe => ("mlp.experts", "gate_proj", "up_proj", "down_proj"),
                Family::Dense => return Err(unexplained(c, shape)),
            };
            let experts = dim(c, src, fixed.len())?;
            within(c, "expert", experts, shape.experts, true)?;
            for e in 0..experts {
                let at: Vec<u64> = fixed.iter().copied().chain([e]).collect();
                let ep = format!("{p}{base}.{e}.");
                if sub.ends_with("fc2.weight") {
                    let name = format!("{ep}{down}.weight");
                    push(name.clone(), whole(c, src, &at, &name)?);
                } else {
                    let rows = dim(c, src, at.len())?;
                    let [(_, g), (_, u)] = swiglu_blocks(c, rows)?;
                    for (proj, blocks) in [(gate, g), (up, u)] {
                        let name = format!("{ep}{proj}.weight");
                        push(name.clone(), take(c, src, &at, Some(&blocks), &name)?);
                    }
                }
            }
        }
        _ => return Err(unexplained(c, shape)),
    }
    Ok(())
}

/// The length of `src`'s dimension `d`.
fn dim(c: &Candidate, src: &TensorSource, d: usize) -> Result<u64> {
    src.shape.get(d).copied().ok_or_else(|| {
        Error::plan(
            format!(
                "checkpoint tensor '{}' has shape {:?}: Megatron-Core's layout has more dimensions here",
                c.source_name, src.shape
            ),
            Some(HINT.into()),
        )
    })
}

/// The row blocks of q, k and v in a fused QKV of `rows` rows: per query group
/// `g`, its `r` q heads, then its k head, then its v head, `d` rows each.
fn qkv_blocks(c: &Candidate, shape: &Shape, rows: u64) -> Result<[(&'static str, Vec<Rows>); 3]> {
    let (h, g) = (shape.heads, shape.groups);
    let r = h / g;
    let per_head = h + 2 * g;
    let d = rows / per_head;
    if d == 0 || rows % per_head != 0 || shape.head_dim.is_some_and(|hd| hd != d) {
        return Err(Error::plan(
            format!(
                "checkpoint tensor '{}' has {rows} fused QKV rows, which {h} heads in {g} query groups{} do not make ((heads + 2 x groups) x head_dim)",
                c.source_name,
                shape.head_dim.map(|d| format!(" of head_dim {d}")).unwrap_or_default()
            ),
            Some("pass the base the training started from (num_attention_heads, num_key_value_heads, head_dim)".into()),
        ));
    }
    let mut q = Vec::new();
    let mut k = Vec::new();
    let mut v = Vec::new();
    for i in 0..g {
        let at = i * (r + 2) * d;
        q.push(Rows {
            from: at,
            len: r * d,
            to: i * r * d,
        });
        k.push(Rows {
            from: at + r * d,
            len: d,
            to: i * d,
        });
        v.push(Rows {
            from: at + (r + 1) * d,
            len: d,
            to: i * d,
        });
    }
    Ok([("q_proj", q), ("k_proj", k), ("v_proj", v)])
}

/// The gate rows then the up rows of a SwiGLU fc1 of `rows` rows.
fn swiglu_blocks(c: &Candidate, rows: u64) -> Result<[(&'static str, Vec<Rows>); 2]> {
    if rows == 0 || rows % 2 != 0 {
        return Err(Error::plan(
            format!(
                "checkpoint tensor '{}' has {rows} fc1 rows: a SwiGLU fc1 holds the gate rows then as many up rows",
                c.source_name
            ),
            Some(HINT.into()),
        ));
    }
    let f = rows / 2;
    Ok([
        (
            "gate_proj",
            vec![Rows {
                from: 0,
                len: f,
                to: 0,
            }],
        ),
        (
            "up_proj",
            vec![Rows {
                from: f,
                len: f,
                to: 0,
            }],
        ),
    ])
}

/// The tensor at `fixed` on `src`'s leading dimensions, whole.
fn whole(c: &Candidate, src: &TensorSource, fixed: &[u64], name: &str) -> Result<TensorSource> {
    take(c, src, fixed, None, name)
}

/// The tensor at `fixed` on `src`'s leading dimensions, made of `blocks` of rows
/// of the next dimension (all of it when `None`), each placed at its row.
fn take(
    c: &Candidate,
    src: &TensorSource,
    fixed: &[u64],
    blocks: Option<&[Rows]>,
    name: &str,
) -> Result<TensorSource> {
    let k = fixed.len();
    let ndim = src.shape.len();
    let fail = |why: String| {
        Error::plan(
            format!(
                "checkpoint tensor '{}' {:?}, as '{name}': {why}",
                c.source_name, src.shape
            ),
            Some(HINT.into()),
        )
    };
    if ndim <= k {
        return Err(fail(format!(
            "{ndim} dimension(s), and Megatron-Core's layout has more than {k} here"
        )));
    }
    let region = |from: u64, len: u64| Region {
        start: fixed
            .iter()
            .copied()
            .chain([from])
            .chain(std::iter::repeat_n(0, ndim - k - 1))
            .collect(),
        len: std::iter::repeat_n(1, k)
            .chain([len])
            .chain(src.shape[k + 1..].iter().copied())
            .collect(),
        kept: (k..ndim).collect(),
    };
    let slice = narrow(src, &region(0, src.shape[k]), name).map_err(&fail)?;
    let Some(blocks) = blocks else {
        return Ok(slice);
    };
    let runs: Vec<Run> = blocks
        .iter()
        .map(|b| Run {
            from: b.from,
            step: 1,
            count: b.len,
            to: b.to,
        })
        .collect();
    let rows = blocks.iter().map(|b| b.to + b.len).max().unwrap_or(0);
    select_rows(&slice, &runs, rows, name).map_err(fail)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::dtype::DType;
    use crate::plan::mapping::candidates;
    use crate::plan::testing::{checkpoint, tensor};
    use crate::source::Piece;

    fn config(json: &str) -> Map<String, Value> {
        serde_json::from_str(json).unwrap()
    }

    const LLAMA: &str = r#"{"model_type": "llama", "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 6}"#;

    /// A bf16 tensor stored whole and contiguous at byte 0 of file 0.
    fn stored(name: &str, shape: &[u64]) -> TensorSource {
        let mut t = tensor(name, DType::BF16, shape);
        let mut strides = vec![1u64; shape.len()];
        for d in (0..shape.len().saturating_sub(1)).rev() {
            strides[d] = strides[d + 1] * shape[d + 1];
        }
        t.pieces = vec![Piece {
            file: 0,
            byte_offset: 0,
            dtype: DType::BF16,
            shape: shape.to_vec(),
            strides,
            global_offset: vec![0; shape.len()],
            big_endian: false,
        }]
        .into();
        t
    }

    fn run(cfg: Option<&str>, tensors: Vec<TensorSource>) -> Result<Vec<Candidate>> {
        let cfg = cfg.map(config);
        let m = Megatron::for_config(cfg.as_ref());
        m.map(candidates(&checkpoint("c", tensors)), MapInputs::default())
    }

    #[test]
    fn a_stacked_fused_qkv_is_split_per_layer_and_group() {
        // 2 layers; 4 heads in 2 groups of head_dim 16: 128 rows of 4 columns.
        let got = run(
            Some(LLAMA),
            vec![stored(
                "decoder.layers.self_attention.linear_qkv.weight",
                &[2, 128, 4],
            )],
        )
        .unwrap();
        let names: Vec<&str> = got.iter().map(|c| c.name.as_str()).collect();
        assert_eq!(names.len(), 6);
        let q = got
            .iter()
            .find(|c| c.name == "model.layers.1.self_attn.q_proj.weight")
            .unwrap();
        assert_eq!(q.shape, [64, 4]);
        let Content::Copy(t) = &q.content else {
            panic!()
        };
        let at: Vec<(u64, Vec<u64>, Vec<u64>)> = t
            .pieces
            .iter()
            .map(|p| (p.byte_offset, p.shape.clone(), p.global_offset.clone()))
            .collect();
        // Group 1's q heads: rows 64..96 of layer 1, placed at rows 32..64.
        assert_eq!(
            at,
            [
                (128 * 4 * 2, vec![32, 4], vec![0, 0]),
                ((128 + 64) * 4 * 2, vec![32, 4], vec![32, 0]),
            ]
        );
        let v = got
            .iter()
            .find(|c| c.name == "model.layers.0.self_attn.v_proj.weight")
            .unwrap();
        let Content::Copy(t) = &v.content else {
            panic!()
        };
        let starts: Vec<u64> = t.pieces.iter().map(|p| p.byte_offset / 8).collect();
        // Group 0's v head at row 48, group 1's at row 112.
        assert_eq!(starts, [48, 112]);
    }

    #[test]
    fn a_padded_vocabulary_keeps_the_base_s_rows() {
        let got = run(
            Some(LLAMA),
            vec![stored("embedding.word_embeddings.weight", &[8, 4])],
        )
        .unwrap();
        assert_eq!(got[0].name, "model.embed_tokens.weight");
        assert_eq!(got[0].shape, [6, 4]);
    }

    #[test]
    fn a_name_no_rule_explains_is_named() {
        let e = run(
            Some(LLAMA),
            vec![
                stored("embedding.word_embeddings.weight", &[6, 4]),
                stored(
                    "decoder.layers.0.mlp.shared_experts.linear_fc1.weight",
                    &[4, 4],
                ),
            ],
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("'decoder.layers.0.mlp.shared_experts.linear_fc1.weight'"),
            "{e}"
        );
    }

    #[test]
    fn megatron_names_need_a_config_and_a_known_model_type() {
        let t = || vec![stored("output_layer.weight", &[6, 4])];
        let e = run(None, t()).unwrap_err().to_string();
        assert!(
            e.contains("'output_layer.weight'") && e.contains("no config.json"),
            "{e}"
        );
        let e = run(
            Some(r#"{"model_type": "gpt2", "num_attention_heads": 4}"#),
            t(),
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("model_type 'gpt2'"), "{e}");
    }

    #[test]
    fn qkv_rows_the_heads_do_not_make_are_refused() {
        let e = run(
            Some(LLAMA),
            vec![stored(
                "decoder.layers.0.self_attention.linear_qkv.weight",
                &[100, 4],
            )],
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("100 fused QKV rows"), "{e}");
    }

    #[test]
    fn layers_or_experts_the_config_does_not_have_are_refused() {
        let cfg = r#"{"model_type": "mixtral", "num_attention_heads": 4, "num_hidden_layers": 2, "num_local_experts": 4}"#;
        let refused = |cfg: &str, name: &str, shape: &[u64]| {
            let marker = stored("decoder.final_layernorm.weight", &[4]);
            run(Some(cfg), vec![marker, stored(name, shape)])
                .unwrap_err()
                .to_string()
        };
        let e = refused(cfg, "decoder.layers.input_layernorm.weight", &[3, 4]);
        assert!(e.contains("holds 3 layers") && e.contains("has 2"), "{e}");
        let e = refused(cfg, "decoder.layers.2.input_layernorm.weight", &[4]);
        assert!(e.contains("is layer 2"), "{e}");
        let name = "decoder.layers.0.mlp.experts.experts.linear_fc2.weight";
        let e = refused(cfg, name, &[5, 4, 2]);
        assert!(e.contains("holds 5 experts"), "{e}");
        // A stacked count the config does not give is bounded.
        let e = refused(
            LLAMA,
            "decoder.layers.input_layernorm.weight",
            &[1 << 40, 4],
        );
        assert!(e.contains("no layer count"), "{e}");
    }

    #[test]
    fn other_names_pass_untouched() {
        let got = run(None, vec![stored("model.norm.weight", &[4])]).unwrap();
        assert_eq!(got[0].name, "model.norm.weight");
    }
}
