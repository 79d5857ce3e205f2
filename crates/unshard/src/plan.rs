//! The merge plan: what to write, and why.
//!
//! Planning is pure. It takes descriptions (the checkpoint's tensors, the base's
//! config and tensors) and options, and returns a [`Plan`] — every output tensor
//! with its source and output dtype, the shard layout, the new config — plus a
//! [`Report`] of every renamed, dropped, base-filled, cast or tied tensor. Or it
//! returns an error naming the offending tensors. Nothing is written before a plan
//! is complete and valid, so bad input costs no disk and leaves nothing behind.
//!
//! The policies follow design.md: strip wrapper prefixes, align a constant prefix
//! with the base, drop known non-persistent buffers, overlay the checkpoint on the
//! base's tensor set, write tied embeddings once, cast floats only, and shard the
//! way huggingface_hub does.

use std::collections::{HashMap, HashSet};

use regex::Regex;
use serde_json::{Map, Value};

use crate::report::list_some;
use crate::source::{Checkpoint, TensorSource};
use crate::{DType, Error, Result};

/// The dtype the user asked for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum DtypeChoice {
    /// The base config's dtype, else the base weights', else the checkpoint's.
    #[default]
    Auto,
    Fixed(DType),
}

/// Options that shape a plan.
#[derive(Clone, Debug)]
pub struct PlanOptions {
    pub dtype: DtypeChoice,
    /// Base-only tensors are an error instead of a note.
    pub strict: bool,
    /// `--rename REGEX=REPLACEMENT`, applied in order after prefix stripping.
    pub renames: Vec<(Regex, String)>,
    /// Largest shard, in bytes.
    pub max_shard_size: u64,
}

impl Default for PlanOptions {
    fn default() -> Self {
        PlanOptions {
            dtype: DtypeChoice::Auto,
            strict: false,
            renames: Vec::new(),
            max_shard_size: 5_000_000_000,
        }
    }
}

/// The base model as planning sees it.
#[derive(Clone, Copy, Debug, Default)]
pub struct BaseView<'a> {
    pub config: Option<&'a Map<String, Value>>,
    pub weights: Option<&'a Checkpoint>,
    /// `metadata.total_parameters` of the base's index, if it has one.
    pub total_parameters: Option<u64>,
}

/// Which input a planned tensor comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Origin {
    Checkpoint,
    Base,
}

/// One tensor to write.
#[derive(Clone, Debug)]
pub struct PlannedTensor {
    /// Output name.
    pub name: String,
    pub origin: Origin,
    pub source: TensorSource,
    pub dtype: DType,
}

impl PlannedTensor {
    pub fn nbytes(&self) -> u64 {
        self.source.numel() * self.dtype.size() as u64
    }
}

/// One output file: which tensors, where.
#[derive(Clone, Debug)]
pub struct ShardPlan {
    pub file_name: String,
    /// The serialized header including the 8-byte length prefix and padding.
    pub header: Vec<u8>,
    /// `(tensor index into Plan::tensors, byte offset of its data in the file)`,
    /// in header (file) order.
    pub entries: Vec<(usize, u64)>,
    /// Total file size.
    pub file_size: u64,
}

/// What planning decided, for the user.
#[derive(Clone, Debug, Default)]
pub struct Report {
    /// `(old name, new name)`.
    pub renamed: Vec<(String, String)>,
    /// `(name, reason)`.
    pub dropped: Vec<(String, String)>,
    /// Base tensors the checkpoint does not have.
    pub from_base: Vec<String>,
    /// Tensors whose dtype changes: `(from, to, count)`.
    pub casts: Vec<(DType, DType, usize)>,
    pub notes: Vec<String>,
    pub warnings: Vec<String>,
}

/// Everything the writer needs.
#[derive(Clone, Debug)]
pub struct Plan {
    pub tensors: Vec<PlannedTensor>,
    pub shards: Vec<ShardPlan>,
    /// The dtype written into config.json (the first floating tensor's).
    pub dtype: Option<DType>,
    /// The config to write, dtype updated; `None` when there is no config at all.
    pub config: Option<Map<String, Value>>,
    /// `model.safetensors.index.json`, when there is more than one shard.
    pub index: Option<String>,
    pub total_size: u64,
    pub report: Report,
}

/// Wrapper components that FSDP, activation checkpointing and torch.compile insert.
const WRAPPER_PARTS: &[&str] = &[
    "_fsdp_wrapped_module",
    "_checkpoint_wrapped_module",
    "_orig_mod",
];

/// Strips wrapper components anywhere and a leading `module.` (DDP, DeepSpeed).
pub fn strip_wrappers(name: &str) -> String {
    let parts: Vec<&str> = name
        .split('.')
        .filter(|p| !WRAPPER_PARTS.contains(p))
        .collect();
    let parts = match parts.first() {
        Some(&"module") if parts.len() > 1 => &parts[1..],
        _ => &parts[..],
    };
    parts.join(".")
}

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

/// Builds the plan for merging `ckpt` onto `base`.
pub fn plan(ckpt: &Checkpoint, base: BaseView<'_>, opts: &PlanOptions) -> Result<Plan> {
    let mut report = Report::default();

    // 1. Names: wrapper prefixes, user renames.
    let mut names: Vec<String> = Vec::with_capacity(ckpt.tensors.len());
    for t in &ckpt.tensors {
        let mut n = strip_wrappers(&t.name);
        for (re, rep) in &opts.renames {
            n = re.replace_all(&n, rep.as_str()).into_owned();
        }
        names.push(n);
    }

    // 2. Align a constant prefix difference with the base.
    let base_names: Option<HashSet<&str>> = base
        .weights
        .map(|w| w.tensors.iter().map(|t| t.name.as_str()).collect());
    if let Some(bn) = &base_names {
        if let Some((strip, add)) = align_prefix(&names, bn) {
            for n in &mut names {
                if let Some(rest) = n.strip_prefix(strip.as_str()) {
                    *n = format!("{add}{rest}");
                } else if strip.is_empty() {
                    *n = format!("{add}{n}");
                }
            }
            report.notes.push(match (strip.is_empty(), add.is_empty()) {
                (false, true) => format!("stripped the prefix '{strip}' to match the base's names"),
                (true, false) => format!("added the prefix '{add}' to match the base's names"),
                _ => {
                    format!("replaced the prefix '{strip}' with '{add}' to match the base's names")
                }
            });
        }
    }
    for (t, n) in ckpt.tensors.iter().zip(&names) {
        if &t.name != n {
            report.renamed.push((t.name.clone(), n.clone()));
        }
    }

    // 3. Duplicates after renaming.
    let mut first_of: HashMap<&str, usize> = HashMap::new();
    for (i, n) in names.iter().enumerate() {
        if let Some(&j) = first_of.get(n.as_str()) {
            return Err(Error::plan(
                format!(
                    "checkpoint tensors '{}' and '{}' both become '{n}' after renaming",
                    ckpt.tensors[j].name, ckpt.tensors[i].name
                ),
                Some("use --rename to keep them apart, or --key to pick one state dict".into()),
            ));
        }
        first_of.insert(n, i);
    }

    // 4. Which checkpoint tensors to keep.
    let base_map: Option<HashMap<&str, &TensorSource>> = base
        .weights
        .map(|w| w.tensors.iter().map(|t| (t.name.as_str(), t)).collect());
    let ties = config_ties(base.config);
    let mut keep: Vec<bool> = vec![true; names.len()];
    for (i, n) in names.iter().enumerate() {
        let in_base = base_map.as_ref().map(|m| m.contains_key(n.as_str()));
        if in_base == Some(true) {
            continue;
        }
        if let Some(why) = is_nonpersistent_buffer(n) {
            keep[i] = false;
            report.dropped.push((n.clone(), why.to_string()));
        }
    }
    // Tied output head: written once, as transformers does (the embedding stays).
    if let Some(head) = names.iter().position(|n| n == "lm_head.weight") {
        let head_in_base = base_map.as_ref().map(|m| m.contains_key("lm_head.weight"));
        let shares = ckpt.tensors[head].storage.as_ref().and_then(|s| {
            ckpt.tensors
                .iter()
                .enumerate()
                .find(|(j, t)| {
                    *j != head
                        && t.storage.as_ref() == Some(s)
                        && t.shape == ckpt.tensors[head].shape
                })
                .map(|(j, _)| names[j].clone())
        });
        let embedding = shares.clone().or_else(|| {
            EMBEDDING_NAMES
                .iter()
                .find(|e| names.iter().any(|n| n == *e))
                .map(|e| e.to_string())
        });
        let tied = match (ties, head_in_base) {
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

    // 5. Overlay on the base's tensor set.
    let mut tensors: Vec<PlannedTensor> = Vec::new();
    let kept_from_checkpoint = || {
        names
            .iter()
            .zip(&ckpt.tensors)
            .zip(&keep)
            .filter(|(_, k)| **k)
            .map(|((n, t), _)| PlannedTensor {
                name: n.clone(),
                origin: Origin::Checkpoint,
                source: t.clone(),
                dtype: t.dtype,
            })
    };
    if let (Some(bmap), Some(bw)) = (&base_map, base.weights) {
        let mut unknown = Vec::new();
        let mut mismatched = Vec::new();
        for (i, n) in names.iter().enumerate() {
            if !keep[i] {
                continue;
            }
            match bmap.get(n.as_str()) {
                None => unknown.push(n.clone()),
                Some(b) if b.shape != ckpt.tensors[i].shape => mismatched.push(format!(
                    "'{n}': checkpoint {:?}, base {:?}",
                    ckpt.tensors[i].shape, b.shape
                )),
                Some(_) => {}
            }
        }
        if !unknown.is_empty() {
            let near: Vec<String> = unknown
                .iter()
                .take(3)
                .filter_map(|u| closest(u, bw.tensors.iter().map(|t| t.name.as_str())))
                .collect();
            return Err(Error::plan(
                format!(
                    "{} checkpoint tensor(s) are not in the base model {}: {}",
                    unknown.len(),
                    bw.path.display(),
                    list_some(&unknown, 8)
                ),
                Some(if near.is_empty() {
                    "check that --base is the model that was trained, or map names with --rename REGEX=REPLACEMENT".into()
                } else {
                    format!(
                        "the base has similar names ({}); map them with --rename REGEX=REPLACEMENT, or check that --base is the model that was trained",
                        near.join(", ")
                    )
                }),
            ));
        }
        if !mismatched.is_empty() {
            return Err(Error::plan(
                format!(
                    "{} tensor(s) have a different shape in the checkpoint and the base: {}",
                    mismatched.len(),
                    list_some(&mismatched, 6)
                ),
                Some(
                    "the checkpoint was trained from a different architecture or size than --base"
                        .into(),
                ),
            ));
        }
        tensors.extend(kept_from_checkpoint());
        let have: HashSet<&str> = names.iter().map(String::as_str).collect();
        for b in &bw.tensors {
            if have.contains(b.name.as_str()) {
                continue;
            }
            report.from_base.push(b.name.clone());
            tensors.push(PlannedTensor {
                name: b.name.clone(),
                origin: Origin::Base,
                source: b.clone(),
                dtype: b.dtype,
            });
        }
        if opts.strict && !report.from_base.is_empty() {
            return Err(Error::plan(
                format!(
                    "--strict: {} base tensor(s) are missing from the checkpoint: {}",
                    report.from_base.len(),
                    list_some(&report.from_base, 8)
                ),
                Some("without --strict they are copied from the base".into()),
            ));
        }
    } else {
        tensors.extend(kept_from_checkpoint());
    }
    if tensors.is_empty() {
        return Err(Error::plan(
            "nothing to write: no tensors left after dropping buffers",
            None,
        ));
    }

    // 6. dtype.
    let config_dtype = base.config.and_then(config_dtype_of);
    let base_dtypes: Option<HashMap<&str, DType>> = base.weights.map(|w| {
        w.tensors
            .iter()
            .map(|t| (t.name.as_str(), t.dtype))
            .collect()
    });
    for t in &mut tensors {
        if !t.source.dtype.is_float() {
            continue;
        }
        let target = match opts.dtype {
            DtypeChoice::Fixed(d) => Some(d),
            DtypeChoice::Auto => base_dtypes
                .as_ref()
                .and_then(|m| m.get(t.name.as_str()).copied())
                .filter(|d| d.is_float())
                .or(config_dtype.map(|(_, d)| d)),
        };
        if let Some(d) = target {
            if !crate::dtype::can_convert(t.source.dtype, d) {
                return Err(Error::plan(
                    format!(
                        "tensor '{}' cannot be cast from {} to {d}",
                        t.name, t.source.dtype
                    ),
                    None,
                ));
            }
            t.dtype = d;
        }
    }
    let mut casts: Vec<(DType, DType, usize)> = Vec::new();
    for t in &tensors {
        if t.source.dtype != t.dtype {
            match casts
                .iter_mut()
                .find(|c| c.0 == t.source.dtype && c.1 == t.dtype)
            {
                Some(c) => c.2 += 1,
                None => casts.push((t.source.dtype, t.dtype, 1)),
            }
        }
    }
    report.casts = casts;
    let out_dtype = tensors.iter().find(|t| t.dtype.is_float()).map(|t| t.dtype);

    // 7. Config: the base's, with only the dtype key changed.
    let config = base.config.map(|c| {
        let mut c = c.clone();
        if let Some(d) = out_dtype {
            set_dtype(&mut c, d, true);
        }
        c
    });
    if config.is_none() {
        report
            .warnings
            .push("no config.json (no --base given): the output has weights only and transformers cannot load it as is".into());
    }

    // 8. Shards and index. transformers (v5) sorts the state dict by natural key
    // before splitting it, so shards group tensors as its output does.
    tensors.sort_by(|a, b| natural_cmp(&a.name, &b.name));
    let (shards, total_size) = shard(&tensors, opts.max_shard_size);
    let index = (shards.len() > 1).then(|| {
        let same_set = base.weights.is_some_and(|w| {
            w.tensors.len() == tensors.len()
                && tensors.iter().all(|t| {
                    base_names
                        .as_ref()
                        .is_some_and(|b| b.contains(t.name.as_str()))
                })
        });
        let params = match base.total_parameters {
            Some(p) if same_set => p,
            _ => tensors.iter().map(|t| t.source.numel()).sum(),
        };
        index_json(&tensors, &shards, total_size, params)
    });
    Ok(Plan {
        tensors,
        shards,
        dtype: out_dtype,
        config,
        index,
        total_size,
        report,
    })
}

/// The dtype a config declares and the key it uses.
pub fn config_dtype_of(c: &Map<String, Value>) -> Option<(&'static str, DType)> {
    for key in ["dtype", "torch_dtype"] {
        if let Some(d) = c
            .get(key)
            .and_then(Value::as_str)
            .and_then(DType::from_torch_name)
        {
            return Some((key, d));
        }
    }
    None
}

/// Sets the dtype key(s) the config already uses (in nested sub-configs too);
/// at the top level, adds `dtype` if it has neither.
fn set_dtype(c: &mut Map<String, Value>, d: DType, top: bool) {
    let mut had = false;
    for key in ["dtype", "torch_dtype"] {
        if let Some(v) = c.get_mut(key) {
            if v.is_string() || v.is_null() {
                *v = Value::String(d.torch_name().into());
                had = true;
            }
        }
    }
    if top && !had {
        c.insert("dtype".into(), Value::String(d.torch_name().into()));
    }
    for (_, v) in c.iter_mut() {
        if let Value::Object(sub) = v {
            if sub.contains_key("dtype") || sub.contains_key("torch_dtype") {
                set_dtype(sub, d, false);
            }
        }
    }
}

/// Finds `(strip, add)` such that replacing a leading `strip` with `add` makes more
/// checkpoint names match the base, or `None` if names already match best.
fn align_prefix(names: &[String], base: &HashSet<&str>) -> Option<(String, String)> {
    let matched = |strip: &str, add: &str| -> usize {
        names
            .iter()
            .filter(|n| match n.strip_prefix(strip) {
                Some(rest) => base.contains(format!("{add}{rest}").as_str()),
                None => false,
            })
            .count()
    };
    let now = names.iter().filter(|n| base.contains(n.as_str())).count();
    if now == names.len() {
        return None;
    }
    let mut candidates: Vec<(String, String)> = Vec::new();
    for n in names.iter().filter(|n| !base.contains(n.as_str())).take(4) {
        // Strip leading components of the checkpoint name.
        let mut at = 0;
        while let Some(dot) = n[at..].find('.') {
            at += dot + 1;
            if base.contains(&n[at..]) {
                candidates.push((n[..at].to_string(), String::new()));
            }
        }
        // Add leading components from a base name that ends with this name.
        for b in base.iter() {
            if let Some(p) = b.strip_suffix(n.as_str()) {
                if p.ends_with('.') {
                    candidates.push((String::new(), p.to_string()));
                }
            }
        }
    }
    let mut best: Option<((String, String), usize)> = None;
    for (s, a) in candidates {
        let m = matched(&s, &a);
        if m > now && best.as_ref().is_none_or(|(_, bm)| m > *bm) {
            best = Some(((s, a), m));
        }
    }
    best.map(|(c, _)| c)
}

/// The base name closest to `name` by shared trailing components.
fn closest<'a>(name: &str, base: impl Iterator<Item = &'a str>) -> Option<String> {
    let tail: Vec<&str> = name.rsplit('.').collect();
    let mut best: Option<(&str, usize)> = None;
    for b in base {
        let common = b
            .rsplit('.')
            .zip(&tail)
            .take_while(|(x, y)| x == *y)
            .count();
        if common >= 2 && best.is_none_or(|(_, c)| common > c) {
            best = Some((b, common));
        }
    }
    best.map(|(b, _)| format!("'{b}'"))
}

/// transformers' `dot_natural_key` order: components split on `.`; all-digit
/// components sort first and numerically; others by text, then by trailing number.
pub fn natural_cmp(a: &str, b: &str) -> std::cmp::Ordering {
    use std::cmp::Ordering;
    fn num_cmp(x: &str, y: &str) -> Ordering {
        let (x, y) = (x.trim_start_matches('0'), y.trim_start_matches('0'));
        x.len().cmp(&y.len()).then_with(|| x.cmp(y))
    }
    fn is_num(s: &str) -> bool {
        !s.is_empty() && s.bytes().all(|c| c.is_ascii_digit())
    }
    let mut xa = a.split('.');
    let mut xb = b.split('.');
    loop {
        let (pa, pb) = match (xa.next(), xb.next()) {
            (None, None) => return Ordering::Equal,
            (None, Some(_)) => return Ordering::Less,
            (Some(_), None) => return Ordering::Greater,
            (Some(pa), Some(pb)) => (pa, pb),
        };
        let ord = match (is_num(pa), is_num(pb)) {
            (true, true) => num_cmp(pa, pb),
            (true, false) => Ordering::Less,
            (false, true) => Ordering::Greater,
            (false, false) => {
                let ta = pa.trim_end_matches(|c: char| c.is_ascii_digit());
                let tb = pb.trim_end_matches(|c: char| c.is_ascii_digit());
                let (da, db) = (&pa[ta.len()..], &pb[tb.len()..]);
                ta.cmp(tb)
                    .then_with(|| match (da.is_empty(), db.is_empty()) {
                        (true, true) => Ordering::Equal,
                        (true, false) => Ordering::Less,
                        (false, true) => Ordering::Greater,
                        (false, false) => num_cmp(da, db),
                    })
            }
        };
        if ord != Ordering::Equal {
            return ord;
        }
    }
}

/// Splits tensors into shards as huggingface_hub does (formats.md §4.3), then lays
/// out each file: header in safetensors' canonical order (dtype descending, then
/// name), data in that order.
pub fn shard(tensors: &[PlannedTensor], max: u64) -> (Vec<ShardPlan>, u64) {
    let mut groups: Vec<Vec<usize>> = Vec::new();
    let mut cur: Vec<usize> = Vec::new();
    let mut cur_size = 0u64;
    let mut total = 0u64;
    for (i, t) in tensors.iter().enumerate() {
        let size = t.nbytes();
        total += size;
        if size > max {
            groups.push(vec![i]);
            continue;
        }
        if cur_size + size > max {
            groups.push(std::mem::take(&mut cur));
            cur_size = 0;
        }
        cur.push(i);
        cur_size += size;
    }
    if !cur.is_empty() {
        groups.push(cur);
    }
    let n = groups.len();
    let shards = groups
        .into_iter()
        .enumerate()
        .map(|(k, mut idx)| {
            idx.sort_by(|&a, &b| {
                tensors[b]
                    .dtype
                    .cmp(&tensors[a].dtype)
                    .then_with(|| tensors[a].name.cmp(&tensors[b].name))
            });
            let file_name = if n == 1 {
                "model.safetensors".to_string()
            } else {
                format!("model-{:05}-of-{:05}.safetensors", k + 1, n)
            };
            layout(file_name, tensors, idx)
        })
        .collect();
    (shards, total)
}

/// Serializes a safetensors header exactly as the reference writer does.
fn layout(file_name: String, tensors: &[PlannedTensor], order: Vec<usize>) -> ShardPlan {
    let mut json = String::from("{\"__metadata__\":{\"format\":\"pt\"}");
    let mut offset = 0u64;
    let mut rel = Vec::with_capacity(order.len());
    for &i in &order {
        let t = &tensors[i];
        let end = offset + t.nbytes();
        let shape: Vec<String> = t.source.shape.iter().map(u64::to_string).collect();
        json.push_str(&format!(
            ",{}:{{\"dtype\":\"{}\",\"shape\":[{}],\"data_offsets\":[{offset},{end}]}}",
            serde_json::to_string(&t.name).unwrap_or_default(),
            t.dtype.safetensors_name(),
            shape.join(",")
        ));
        rel.push((i, offset));
        offset = end;
    }
    json.push('}');
    while json.len() % 8 != 0 {
        json.push(' ');
    }
    let mut header = (json.len() as u64).to_le_bytes().to_vec();
    header.extend_from_slice(json.as_bytes());
    let data_start = header.len() as u64;
    ShardPlan {
        file_name,
        entries: rel.into_iter().map(|(i, o)| (i, data_start + o)).collect(),
        file_size: data_start + offset,
        header,
    }
}

/// `model.safetensors.index.json` as transformers writes it (sorted keys, indent 2).
fn index_json(
    tensors: &[PlannedTensor],
    shards: &[ShardPlan],
    total_size: u64,
    params: u64,
) -> String {
    let mut weight_map = std::collections::BTreeMap::new();
    for s in shards {
        for (i, _) in &s.entries {
            weight_map.insert(tensors[*i].name.clone(), s.file_name.clone());
        }
    }
    let index = serde_json::json!({
        "metadata": {"total_parameters": params, "total_size": total_size},
        "weight_map": weight_map,
    });
    let mut s = serde_json::to_string_pretty(&index).unwrap_or_default();
    s.push('\n');
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strips_fsdp_compile_and_ddp_wrappers() {
        assert_eq!(
            strip_wrappers(
                "module._fsdp_wrapped_module.model.layers.0._checkpoint_wrapped_module.mlp.weight"
            ),
            "model.layers.0.mlp.weight"
        );
        assert_eq!(strip_wrappers("_orig_mod.lm_head.weight"), "lm_head.weight");
        // Only a leading `module.` is a wrapper; inner ones are real module names.
        assert_eq!(strip_wrappers("model.module.weight"), "model.module.weight");
    }

    #[test]
    fn recognises_nonpersistent_buffers() {
        assert!(is_nonpersistent_buffer("model.layers.3.self_attn.rotary_emb.inv_freq").is_some());
        assert!(is_nonpersistent_buffer("transformer.h.0.attn.masked_bias").is_some());
        assert!(is_nonpersistent_buffer("transformer.h.0.attn.c_attn.bias").is_none());
        assert!(is_nonpersistent_buffer("model.layers.0.self_attn.q_proj.bias").is_none());
    }

    #[test]
    fn natural_order_compares_numbers_numerically() {
        let mut v = vec![
            "model.layers.10.w",
            "model.layers.2.w",
            "lm_head.weight",
            "model.norm.weight",
            "model.embed_tokens.weight",
            "a.shard_11",
            "a.shard_2",
            "a.shard",
        ];
        v.sort_by(|a, b| natural_cmp(a, b));
        assert_eq!(
            v,
            vec![
                "a.shard",
                "a.shard_2",
                "a.shard_11",
                "lm_head.weight",
                "model.embed_tokens.weight",
                "model.layers.2.w",
                "model.layers.10.w",
                "model.norm.weight"
            ]
        );
    }

    #[test]
    fn aligns_a_constant_prefix_both_ways() {
        let base: HashSet<&str> = ["model.x.weight", "lm_head.weight"].into_iter().collect();
        let names = vec![
            "model.model.x.weight".to_string(),
            "model.lm_head.weight".to_string(),
        ];
        assert_eq!(
            align_prefix(&names, &base),
            Some(("model.".into(), String::new()))
        );
        let base: HashSet<&str> = ["model.x.weight", "model.y.weight"].into_iter().collect();
        let names = vec!["x.weight".to_string(), "y.weight".to_string()];
        assert_eq!(
            align_prefix(&names, &base),
            Some((String::new(), "model.".into()))
        );
    }
}
