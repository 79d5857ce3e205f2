//! Megatron-LM's training arguments, read from a save: the `argparse.Namespace`
//! its `save_checkpoint` stores under `args`.
//!
//! A save keeps them in one of three places: `common.pt` beside the
//! `torch_dist` files (megatron-core up to 0.18), the DCP bytes item
//! `common_state/shard_0_1` (from 0.19: a `torch.save` of `[common dict]`), or
//! every legacy rank file `mp_rank_*/model_optim_rng.pt` (the first is read).
//! The pickles are read inertly, like every other: the Namespace is an opaque
//! object whose `BUILD` state is the dict of its attributes, and a torch dtype
//! (`params_dtype`) is a global that is named, never resolved.
//!
//! Only the attributes' plain values are kept (numbers, strings, booleans,
//! `None`, lists of them, global names); the rest are described. What the pickle
//! read would run under `torch.load` is kept for the audit (`common.pt` is no
//! file the checkpoint's reader reads).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use unshard_pickle::{NodeId, Pickle, Value};

use super::legacy;
use crate::bytes::fs;
use crate::error::Result;
use crate::source::audit::UnsafeCall;
use crate::source::{dcp, torch, Blob};

/// The file beside a `torch_dist` directory's files that holds its common state.
pub const COMMON_FILE: &str = "common.pt";

/// The DCP bytes item that holds the common state from megatron-core 0.19.
pub const COMMON_ITEM: &str = "common_state/";

/// The most bytes a common-state item may take (the arguments are a few KB).
const MAX_COMMON_ITEM: u64 = 64 << 20;

/// Items of a list argument kept (`moe_layer_freq` has one per layer).
const MAX_LIST: usize = 1 << 16;

/// One argument's value.
#[derive(Clone, Debug, PartialEq)]
pub enum Arg {
    /// `None`: not set.
    None,
    /// A boolean flag.
    Bool(bool),
    /// An integer.
    Int(i64),
    /// A float.
    Float(f64),
    /// A string.
    Str(String),
    /// A list or tuple of plain values.
    List(Vec<Arg>),
    /// A global named by the pickle, e.g. `torch.bfloat16`.
    Global(String),
    /// Anything else, described.
    Other(String),
}

impl Arg {
    /// The value as Python would print it, for messages.
    pub fn show(&self) -> String {
        match self {
            Arg::None => "None".into(),
            Arg::Bool(b) => if *b { "True" } else { "False" }.into(),
            Arg::Int(i) => i.to_string(),
            Arg::Float(f) => format!("{f:?}"),
            Arg::Str(s) => format!("'{s}'"),
            Arg::List(items) => {
                let shown: Vec<String> = items.iter().take(8).map(Arg::show).collect();
                let more = if items.len() > 8 { ", ..." } else { "" };
                format!("[{}{more}]", shown.join(", "))
            }
            Arg::Global(g) => g.clone(),
            Arg::Other(d) => d.clone(),
        }
    }
}

/// The training arguments of a save, and where they were read.
#[derive(Clone, Debug, PartialEq)]
pub struct TrainingArgs {
    /// The file they were read from.
    pub file: PathBuf,
    /// Where in it (`args`, `common_state/shard_0_1 args`).
    pub at: String,
    /// Each attribute of the Namespace.
    pub values: BTreeMap<String, Arg>,
    /// What the pickle read would run under `torch.load` (unshard ran none of it).
    pub unsafe_calls: Vec<UnsafeCall>,
}

impl TrainingArgs {
    /// The value of `name`; `None` when the Namespace has no such attribute.
    pub fn get(&self, name: &str) -> Option<&Arg> {
        self.values.get(name)
    }

    fn audited(mut self, calls: Vec<UnsafeCall>) -> TrainingArgs {
        self.unsafe_calls = calls;
        self
    }

    /// Where the arguments were read, for messages: `common.pt (args)`.
    pub fn source(&self) -> String {
        format!("{} ({})", self.file.display(), self.at)
    }
}

/// The training arguments of the Megatron save at `path` (a `torch_dist`
/// directory, a legacy iteration folder, or one `model_optim_rng.pt`), or `None`
/// when it holds none.
///
/// A `torch_dist` directory without arguments in `common.pt` has its `.metadata`
/// parsed once more to find the common-state item; this is done only when a
/// config is derived (no base given), never on the way of a plain merge.
pub fn read(path: &Path) -> Result<Option<TrainingArgs>> {
    if fs::is_file(path) {
        return in_file(path);
    }
    let common = path.join(COMMON_FILE);
    if fs::is_file(&common) {
        if let Some(a) = in_file(&common)? {
            return Ok(Some(a));
        }
    }
    if dcp::is_dcp_dir(path) {
        let Some((name, file, bytes)) = dcp::read_bytes_item(path, COMMON_ITEM, MAX_COMMON_ITEM)?
        else {
            return Ok(None);
        };
        let blob = Blob::owned(file.clone(), bytes);
        let payload = torch::read_payload(&blob)?;
        let p = &payload.pickle;
        // `torch.save([common_dict])`: the dict is the list's one item.
        let root = p.items(p.root()).and_then(|i| i.first().copied());
        let found = root.and_then(|r| namespace_under(&file, p, r, &format!("{name} args")));
        return Ok(found.map(|a| a.audited(payload.unsafe_calls)));
    }
    if let Some(ranks) = legacy::find(path)? {
        let Some(folder) = ranks.values().next() else {
            return Ok(None);
        };
        let file = path.join(folder).join(legacy::MODEL_FILE);
        if fs::is_file(&file) {
            return in_file(&file);
        }
    }
    Ok(None)
}

/// The Namespace under `args` of a `torch.save` file's root dict.
fn in_file(file: &Path) -> Result<Option<TrainingArgs>> {
    let blob = fs::open(file)?;
    let payload = torch::read_payload(&blob)?;
    let found = from_root(file, &payload.pickle, "args");
    Ok(found.map(|a| a.audited(payload.unsafe_calls)))
}

/// The Namespace under `key` of the pickle's root dict.
fn from_root(file: &Path, p: &Pickle, key: &str) -> Option<TrainingArgs> {
    namespace_under(file, p, p.root(), key)
}

/// The Namespace stored under `args` in the dict `dict`; `at` names it.
fn namespace_under(file: &Path, p: &Pickle, dict: NodeId, at: &str) -> Option<TrainingArgs> {
    let ns = p.dict_get(dict, "args")?;
    let obj = p.object(ns)?;
    if !obj.is("argparse", "Namespace") {
        return None;
    }
    // `BUILD` state: the attribute dict, or `(dict, slots)`.
    let state = obj.state?;
    let attrs = match p.get(state) {
        Value::Dict(_) => state,
        Value::Tuple(items) => *items.first()?,
        _ => return None,
    };
    let mut values = BTreeMap::new();
    for &(k, v) in p.dict_items(attrs)? {
        if let Some(name) = p.as_str(k) {
            values.insert(name.to_string(), arg(p, v, 0));
        }
    }
    Some(TrainingArgs {
        file: file.to_path_buf(),
        at: at.to_string(),
        values,
        unsafe_calls: Vec::new(),
    })
}

/// A node as an [`Arg`], looking at most one list deep.
fn arg(p: &Pickle, id: NodeId, depth: usize) -> Arg {
    match p.get(id) {
        Value::None => Arg::None,
        Value::Bool(b) => Arg::Bool(*b),
        Value::Int(i) => Arg::Int(*i),
        Value::Float(f) => Arg::Float(*f),
        Value::Str(s) => Arg::Str(s.clone()),
        Value::Global(g) => Arg::Global(format!("{}.{}", g.module, g.name)),
        Value::List(items) | Value::Tuple(items) if depth == 0 && items.len() <= MAX_LIST => {
            Arg::List(items.iter().map(|&i| arg(p, i, depth + 1)).collect())
        }
        _ => Arg::Other(p.describe(id)),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn fixture(case: &str) -> PathBuf {
        crate::fixtures().join("megatron/ckpt").join(case)
    }

    /// The arguments of every place a save keeps them, against the fixtures'
    /// dumps (what torch.load gave the generator).
    #[test]
    fn reads_the_namespace_from_common_pt_the_dcp_item_and_legacy_files() {
        for (case, file) in [
            ("llama_tp2/iter_0000100", "common.pt"),
            ("llama_tp2_common_in_dcp/iter_0000100", ".distcp"),
            ("llama_tp2_pp2_legacy/iter_0000100", "model_optim_rng.pt"),
        ] {
            let a = read(&fixture(case)).unwrap().unwrap();
            assert!(
                a.file.to_string_lossy().ends_with(file),
                "{case}: {}",
                a.source()
            );
            assert_eq!(a.get("hidden_size"), Some(&Arg::Int(64)), "{case}");
            assert_eq!(a.get("num_query_groups"), Some(&Arg::Int(2)), "{case}");
            assert_eq!(a.get("normalization"), Some(&Arg::Str("RMSNorm".into())));
            assert_eq!(a.get("norm_epsilon"), Some(&Arg::Float(1e-5)));
            assert_eq!(a.get("num_experts"), Some(&Arg::None));
            assert_eq!(a.get("bf16"), Some(&Arg::Bool(true)));
            assert_eq!(
                a.get("params_dtype"),
                Some(&Arg::Global("torch.bfloat16".into()))
            );
        }
        let legacy = read(&fixture("llama_tp2_pp2_legacy/iter_0000100"))
            .unwrap()
            .unwrap();
        assert_eq!(legacy.get("num_layers"), Some(&Arg::Int(4)));
        let dcp = read(&fixture("llama_tp2_common_in_dcp/iter_0000100"))
            .unwrap()
            .unwrap();
        assert!(dcp.at.starts_with("common_state/shard_0_1"), "{}", dcp.at);
    }

    #[test]
    fn one_rank_file_given_alone_holds_them_too() {
        let file = fixture("llama_tp2_pp2_legacy/iter_0000100/mp_rank_01_001/model_optim_rng.pt");
        let a = read(&file).unwrap().unwrap();
        assert_eq!(a.file, file);
        assert_eq!(a.get("pipeline_model_parallel_size"), Some(&Arg::Int(2)));
    }

    #[test]
    fn a_layer_pattern_is_a_list() {
        let a = read(&fixture("qwen3_moe_tp2_dense_first"))
            .unwrap()
            .unwrap();
        assert_eq!(
            a.get("moe_layer_freq"),
            Some(&Arg::List(vec![Arg::Int(0), Arg::Int(1)]))
        );
    }

    #[test]
    fn a_directory_without_arguments_has_none() {
        let dir = crate::fixtures().join("megatron/base/llama");
        assert_eq!(read(&dir).unwrap(), None);
    }
}
