//! Megatron-LM's legacy layout: `mp_rank_TT[_PPP]/model_optim_rng.pt`, one
//! `torch.save` per tensor- and pipeline-parallel rank, each holding its rank's
//! slice of the model under `model`.
//!
//! The ranks' tensors are joined into the global Megatron tensors the
//! `torch_dist` layout names, as pieces of the rank files (bytes are never
//! read here): a stage's local layer numbers are shifted by the layers of the
//! stages before it (Megatron's offset, uneven first or last stages included);
//! column-parallel tensors (fused QKV and its bias, the vocabulary-parallel
//! embedding and output layer) join along rows; row-parallel ones (`linear_proj`,
//! `linear_fc2`) along columns; SwiGLU's `linear_fc1`, whose rank slice is its
//! own `[gate_i; up_i]`, gives its gate rows to the global gate half and its up
//! rows to the up half; norms, routers and row-parallel biases are replicated and
//! taken from tensor rank 0.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use regex::Regex;

use crate::bytes::fs;
use crate::error::{Error, Result};
use crate::source::{open, Checkpoint, Format, OpenOptions, Piece, TensorSource};

/// The model file in each rank folder.
pub const MODEL_FILE: &str = "model_optim_rng.pt";

/// The rank folders of a legacy save: `(tensor rank, pipeline rank) -> folder`.
pub type Ranks = BTreeMap<(usize, usize), String>;

/// Rank numbers above this are not believed.
const MAX_RANK: usize = 1 << 16;

/// The `mp_rank_*` folders of `path`; `None` when it has none.
pub fn find(path: &Path) -> Result<Option<Ranks>> {
    let Ok(re) = Regex::new(r"^mp_rank_(\d+)(?:_(\d+))?(?:_(\d+))?$") else {
        return Ok(None);
    };
    let Ok(entries) = fs::list(path) else {
        return Ok(None);
    };
    let mut ranks = Ranks::new();
    for e in entries.into_iter().filter(|e| e.is_dir) {
        let Some(c) = re.captures(&e.name) else {
            continue;
        };
        let num = |i: usize| {
            c.get(i)
                .map(|m| m.as_str().parse::<usize>().ok().filter(|&n| n < MAX_RANK))
        };
        if num(3).is_some() {
            return Err(Error::Unsupported {
                path: path.join(&e.name),
                what: "a Megatron-LM legacy folder of an expert-parallel rank (mp_rank_TT_PPP_EEE)".into(),
                hint: Some("convert the save to torch_dist with Megatron-LM's checkpoint converter (--ckpt-convert-format torch_dist), then pass the result".into()),
            });
        }
        let (Some(Some(t)), pp) = (num(1), num(2)) else {
            continue;
        };
        let p = match pp {
            None => 0,
            Some(Some(p)) => p,
            Some(None) => continue,
        };
        ranks.insert((t, p), e.name);
    }
    Ok((!ranks.is_empty()).then_some(ranks))
}

/// Where a tensor's tensor-parallel slices go in the global tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Split {
    /// Joined along dimension 0 (column-parallel, vocabulary-parallel).
    Rows,
    /// Joined along dimension 1 (row-parallel).
    Columns,
    /// SwiGLU fc1: each slice is `[gate_i; up_i]`.
    GateUp,
    /// The same on every rank: rank 0's is taken.
    Replicated,
}

/// How `name` is split over tensor ranks; `None` when no rule says.
fn split_of(name: &str) -> Option<Split> {
    let leaf = name.rsplit('.').next().unwrap_or("");
    let module = name
        .strip_suffix(leaf)
        .and_then(|m| m.strip_suffix('.'))
        .unwrap_or("");
    let vocab = name.ends_with("word_embeddings.weight") || name.ends_with("output_layer.weight");
    let qkv = module.ends_with("linear_qkv") && (leaf == "weight" || leaf == "bias");
    let split = if vocab || qkv {
        Split::Rows
    } else if module.ends_with("linear_fc1") && (leaf == "weight" || leaf == "bias") {
        Split::GateUp
    } else if (module.ends_with("linear_proj") || module.ends_with("linear_fc2"))
        && leaf == "weight"
    {
        Split::Columns
    } else if module.ends_with("layernorm")
        || leaf.starts_with("layer_norm_")
        || module.ends_with("router")
        || name.ends_with("position_embeddings.weight")
        || ((module.ends_with("linear_proj") || module.ends_with("linear_fc2")) && leaf == "bias")
    {
        Split::Replicated
    } else {
        return None;
    };
    Some(split)
}

/// A name with its local layer number `decoder.layers.N.` made global.
fn global_name(name: &str, offset: u64) -> (String, Option<u64>) {
    let (prefix, rest) = match name.find("decoder.layers.") {
        Some(i) => name.split_at(i + "decoder.layers.".len()),
        None => return (name.to_string(), None),
    };
    let Some((num, tail)) = rest.split_once('.') else {
        return (name.to_string(), None);
    };
    match num.parse::<u64>() {
        Ok(n) => (format!("{prefix}{}.{tail}", n + offset), Some(n)),
        Err(_) => (name.to_string(), None),
    }
}

/// Opens a legacy save's rank folders in `dir` as one checkpoint of global
/// Megatron tensors.
pub fn open_legacy(dir: &Path, ranks: &Ranks, opts: &OpenOptions) -> Result<Checkpoint> {
    let tp = ranks.keys().map(|k| k.0).max().unwrap_or(0) + 1;
    let pp = ranks.keys().map(|k| k.1).max().unwrap_or(0) + 1;
    let with_pp = ranks.values().any(|n| n.matches('_').count() >= 3);
    let folder = |t: usize, p: usize| {
        if with_pp {
            format!("mp_rank_{t:02}_{p:03}")
        } else {
            format!("mp_rank_{t:02}")
        }
    };
    for p in 0..pp {
        for t in 0..tp {
            if !ranks.contains_key(&(t, p)) {
                return Err(Error::Incomplete {
                    path: dir.to_path_buf(),
                    msg: format!(
                        "a Megatron-LM legacy save of {tp} tensor x {pp} pipeline ranks, and the folder {}/ (tensor rank {t}, pipeline stage {p}) is missing",
                        folder(t, p)
                    ),
                    hint: Some(format!(
                        "copy every rank folder (mp_rank_*/ with its {MODEL_FILE}) into {}",
                        dir.display()
                    )),
                });
            }
        }
    }
    let key = opts.key.clone().unwrap_or_else(|| "model".into());
    let file_opts = OpenOptions {
        key: Some(key),
        tag: None,
    };
    let mut files = Vec::new();
    let mut unsafe_calls = Vec::new();
    let mut extras = Vec::new();
    // Per stage, per tensor rank: the rank's tensors (pieces renumbered to `files`).
    let mut stages: Vec<Vec<Vec<TensorSource>>> = Vec::with_capacity(pp);
    for p in 0..pp {
        let mut stage = Vec::with_capacity(tp);
        for t in 0..tp {
            let name = &ranks[&(t, p)];
            let path = dir.join(name).join(MODEL_FILE);
            if !fs::is_file(&path) {
                return Err(Error::Incomplete {
                    path: dir.join(name),
                    msg: format!("the rank folder {name}/ has no {MODEL_FILE}"),
                    hint: Some(format!("copy {name}/{MODEL_FILE} from the save")),
                });
            }
            let c = open(&path, &file_opts)?;
            let base = files.len();
            files.extend(c.files);
            unsafe_calls.extend(c.unsafe_calls);
            if t == 0 && p == 0 {
                extras = c.extras;
            }
            let tensors = c
                .tensors
                .into_iter()
                .map(|mut s| {
                    for piece in s.pieces.iter_mut() {
                        piece.file += base;
                    }
                    s.storage = None;
                    s
                })
                .collect();
            stage.push(tensors);
        }
        stages.push(stage);
    }
    let mut tensors = Vec::new();
    let mut offset = 0u64;
    let mut seen = BTreeSet::new();
    for (p, stage) in stages.iter().enumerate() {
        let mut layers = 0u64;
        for first in &stage[0] {
            let (name, local) = global_name(&first.name, offset);
            if let Some(n) = local {
                layers = layers.max(n + 1);
            }
            let slices: Vec<&TensorSource> = stage
                .iter()
                .enumerate()
                .map(|(t, ts)| {
                    ts.iter()
                        .find(|s| s.name == first.name)
                        .ok_or_else(|| Error::Corrupt {
                            path: dir.join(folder(t, p)).join(MODEL_FILE),
                            msg: format!(
                                "tensor '{}' of {}/ is missing here",
                                first.name,
                                folder(0, p)
                            ),
                        })
                })
                .collect::<Result<_>>()?;
            // Embeddings tied across stages are stored on the first and the last.
            if !seen.insert(name.clone()) {
                continue;
            }
            let at = |t: usize| dir.join(folder(t, p)).join(MODEL_FILE);
            let split = match split_of(&first.name) {
                Some(s) => s,
                None if tp == 1 => Split::Replicated,
                None => {
                    return Err(Error::Unsupported {
                        path: at(0),
                        what: format!(
                            "tensor '{}' of a Megatron-LM legacy save of {tp} tensor ranks: no rule says how its slices join",
                            first.name
                        ),
                        hint: Some("convert the save to torch_dist with Megatron-LM's checkpoint converter (--ckpt-convert-format torch_dist), then pass the result".into()),
                    })
                }
            };
            tensors.push(join(&name, &slices, split, tp, pp, &at)?);
        }
        offset += layers;
    }
    let notes = vec![format!(
        "a Megatron-LM legacy save: {tp} tensor x {pp} pipeline rank folder(s) joined ({offset} layers); optimizer and rng state not read"
    )];
    Ok(Checkpoint {
        format: Format::Ranks,
        path: dir.to_path_buf(),
        files,
        key: file_opts.key,
        tensors,
        extras,
        notes,
        unsafe_calls,
    })
}

/// The global tensor `name` made of one slice per tensor rank.
fn join(
    name: &str,
    slices: &[&TensorSource],
    split: Split,
    tp: usize,
    pp: usize,
    at: &dyn Fn(usize) -> PathBuf,
) -> Result<TensorSource> {
    let first = slices[0];
    for (t, s) in slices.iter().enumerate() {
        if s.shape != first.shape || s.dtype != first.dtype {
            return Err(Error::Corrupt {
                path: at(t),
                msg: format!(
                    "tensor '{}' is {} {:?} here and {} {:?} on tensor rank 0",
                    s.name, s.dtype, s.shape, first.dtype, first.shape
                ),
            });
        }
    }
    let layout = Some(format!(
        "Megatron legacy, {tp} tensor x {pp} pipeline ranks"
    ));
    let dim = match split {
        Split::Replicated => {
            let mut t = first.clone();
            t.name = name.to_string();
            t.layout = layout;
            return Ok(t);
        }
        Split::Rows | Split::GateUp => 0,
        Split::Columns => 1,
    };
    let Some(&local) = first.shape.get(dim) else {
        return Err(Error::Corrupt {
            path: at(0),
            msg: format!(
                "tensor '{}' has shape {:?}: a tensor-parallel slice of it has at least {} dimension(s)",
                first.name,
                first.shape,
                dim + 1
            ),
        });
    };
    let n = tp as u64;
    let mut shape = first.shape.clone();
    shape[dim] = local.checked_mul(n).ok_or_else(|| Error::Corrupt {
        path: at(0),
        msg: format!("tensor '{}' has shape {:?}", first.name, first.shape),
    })?;
    let mut pieces = Vec::new();
    for (t, s) in slices.iter().enumerate() {
        let t = t as u64;
        if split == Split::GateUp {
            if local % 2 != 0 {
                return Err(Error::Corrupt {
                    path: at(t as usize),
                    msg: format!(
                        "tensor '{}' has {local} rows: a SwiGLU fc1 slice holds its gate rows then as many up rows",
                        s.name
                    ),
                });
            }
            let f = local / 2;
            for piece in s.pieces.iter() {
                pieces.extend(rows_of(piece, 0, f, t * f));
                pieces.extend(rows_of(piece, f, f, n * f + t * f));
            }
        } else {
            for piece in s.pieces.iter() {
                let mut q = piece.clone();
                q.global_offset[dim] += t * local;
                pieces.push(q);
            }
        }
    }
    Ok(TensorSource {
        name: name.to_string(),
        dtype: first.dtype,
        shape,
        pieces: pieces.into(),
        storage: None,
        layout,
    })
}

/// The part of `piece` covering rows `from..from + len` of its tensor, placed
/// with those rows starting at row `to`; `None` when it holds none of them.
fn rows_of(piece: &Piece, from: u64, len: u64, to: u64) -> Option<Piece> {
    let (&g0, &n) = (piece.global_offset.first()?, piece.shape.first()?);
    let lo = from.max(g0);
    let hi = (from + len).min(g0 + n);
    if lo >= hi {
        return None;
    }
    let mut q = piece.clone();
    q.byte_offset += (lo - g0) * piece.strides[0] * piece.dtype.size() as u64;
    q.shape[0] = hi - lo;
    q.global_offset[0] = lo - from + to;
    Some(q)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::dtype::DType;

    #[test]
    fn local_layer_numbers_are_shifted_by_the_stage_offset() {
        let (n, local) = global_name("decoder.layers.1.mlp.linear_fc1.weight", 2);
        assert_eq!(
            (n.as_str(), local),
            ("decoder.layers.3.mlp.linear_fc1.weight", Some(1))
        );
        let (n, local) = global_name("decoder.final_layernorm.weight", 2);
        assert_eq!(
            (n.as_str(), local),
            ("decoder.final_layernorm.weight", None)
        );
    }

    #[test]
    fn parallel_dimensions_per_parameter() {
        let s = |n: &str| split_of(n);
        assert_eq!(
            s("decoder.layers.0.self_attention.linear_qkv.bias"),
            Some(Split::Rows)
        );
        assert_eq!(s("embedding.word_embeddings.weight"), Some(Split::Rows));
        assert_eq!(
            s("decoder.layers.0.mlp.linear_fc1.weight"),
            Some(Split::GateUp)
        );
        assert_eq!(
            s("decoder.layers.0.mlp.linear_fc2.weight"),
            Some(Split::Columns)
        );
        assert_eq!(
            s("decoder.layers.0.self_attention.linear_proj.bias"),
            Some(Split::Replicated)
        );
        assert_eq!(
            s("decoder.layers.0.input_layernorm.weight"),
            Some(Split::Replicated)
        );
        assert_eq!(
            s("decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight"),
            Some(Split::GateUp)
        );
        assert_eq!(s("decoder.layers.0.mlp.shared_experts.gate_weight"), None);
    }

    #[test]
    fn a_piece_s_rows_are_cut_and_placed() {
        let p = Piece {
            file: 0,
            byte_offset: 100,
            dtype: DType::BF16,
            shape: vec![4, 3],
            strides: vec![3, 1],
            global_offset: vec![2, 0],
            big_endian: false,
        };
        // Rows 3..5 of the tensor: the piece's rows 1..3, placed at 10.
        let q = rows_of(&p, 3, 2, 10).unwrap();
        assert_eq!(
            (q.byte_offset, q.shape.clone(), q.global_offset.clone()),
            (106, vec![2, 3], vec![10, 0])
        );
        assert!(rows_of(&p, 6, 2, 0).is_none());
    }
}
