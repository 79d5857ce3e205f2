//! `inspect`: what an input holds, as a report (the CLI prints it as a table, or
//! as JSON: the report's `Serialize` form is the schema the README documents).

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;

use serde::Serialize;

use crate::arch::conversions::Ruleset;
use crate::dtype::DType;
use crate::error::Result;
use crate::options::InspectOptions;
use crate::source::audit::UnsafeCall;
use crate::source::format_id;
use crate::source::{self, Checkpoint, Format};
use crate::stats::{checkpoint_stats, TensorStats};
use crate::text::display_path;

/// What an input holds.
#[derive(Clone, Debug, Serialize)]
pub struct InspectReport {
    /// Its format (its id in JSON: `torch-zip`, `dcp`...).
    #[serde(serialize_with = "format_id")]
    pub format: Format,
    /// The input.
    #[serde(serialize_with = "display_path")]
    pub path: PathBuf,
    /// Where the tensor dict was found (`state`, `model.module`); `None` at the top.
    pub key: Option<String>,
    /// Every tensor, in the input's order.
    pub tensors: Vec<InspectedTensor>,
    /// How many tensors.
    pub total_tensors: usize,
    /// Their elements.
    pub total_parameters: u64,
    /// Their bytes.
    pub total_bytes: u64,
    /// Tensors per dtype (safetensors names).
    pub dtypes: BTreeMap<&'static str, usize>,
    /// Entries that are not tensors (step counters, optimizer state...).
    pub non_tensor: Vec<NonTensor>,
    /// What the reader noticed that the user should know.
    pub notes: Vec<String>,
    /// What the input's pickles would run under `torch.load` (unshard runs none
    /// of it; the file is compromised).
    #[serde(rename = "unsafe")]
    pub unsafe_calls: Vec<UnsafeCall>,
}

/// One tensor of an inspected input.
#[derive(Clone, Debug, Serialize)]
pub struct InspectedTensor {
    /// Its name in the input.
    pub name: String,
    /// Its dtype.
    pub dtype: DType,
    /// Its shape.
    pub shape: Vec<u64>,
    /// Its size in bytes.
    pub bytes: u64,
    /// How it was sharded (`DTensor Shard(0), 2 ranks`), when it was.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub layout: Option<String>,
    /// Its statistics, when asked for.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stats: Option<TensorStats>,
}

/// An entry near the tensors that is not one.
#[derive(Clone, Debug, Serialize)]
pub struct NonTensor {
    /// Its dotted path.
    pub name: String,
    /// What it is.
    pub kind: String,
}

/// Opens an input and describes it (and its values' statistics, if asked).
pub fn inspect(opts: &InspectOptions) -> Result<InspectReport> {
    let ckpt = source::open(&opts.path, &opts.open)?;
    let stats = if opts.stats {
        Some(checkpoint_stats(&ckpt, &opts.cancel)?)
    } else {
        None
    };
    Ok(report(&ckpt, stats))
}

/// The report of an opened input.
pub fn report(ckpt: &Checkpoint, stats: Option<Vec<TensorStats>>) -> InspectReport {
    let mut stats = stats.map(Vec::into_iter);
    let tensors = ckpt
        .tensors
        .iter()
        .map(|t| InspectedTensor {
            name: t.name.clone(),
            dtype: t.dtype,
            shape: t.shape.clone(),
            bytes: t.nbytes(),
            layout: t.layout.clone(),
            stats: stats.as_mut().and_then(Iterator::next),
        })
        .collect();
    let mut dtypes = BTreeMap::new();
    for t in &ckpt.tensors {
        *dtypes.entry(t.dtype.safetensors_name()).or_insert(0) += 1;
    }
    InspectReport {
        format: ckpt.format,
        path: ckpt.path.clone(),
        key: ckpt.key.clone(),
        tensors,
        total_tensors: ckpt.tensors.len(),
        total_parameters: ckpt.total_parameters(),
        total_bytes: ckpt.total_bytes(),
        dtypes,
        non_tensor: ckpt
            .extras
            .iter()
            .map(|e| NonTensor {
                name: e.name.clone(),
                kind: e.kind.clone(),
            })
            .collect(),
        notes: ckpt
            .notes
            .iter()
            .cloned()
            .chain(packed_note(ckpt))
            .collect(),
        unsafe_calls: ckpt.unsafe_calls.clone(),
    }
}

/// A note on expert tensors in transformers' in-memory layout (experts packed into a
/// few tensors), which `merge` writes in the layout of the base's files. Names are
/// matched once per pattern (numbered components aside), so a checkpoint of
/// tens of thousands of tensors costs a few dozen matches per rule set.
fn packed_note(ckpt: &Checkpoint) -> Option<String> {
    let rulesets = Ruleset::all();
    let mut seen: HashMap<String, bool> = HashMap::new();
    let packed: Vec<&str> = ckpt
        .tensors
        .iter()
        .map(|t| t.name.as_str())
        // Rules of other kinds (q, k and v fused in memory by some models) depend
        // on the model type, which only the base's config names.
        .filter(|n| n.split('.').any(|c| c == "experts"))
        .filter(|n| {
            let pattern: Vec<&str> = n
                .split('.')
                .map(|c| {
                    if c.bytes().all(|b| b.is_ascii_digit()) {
                        "#"
                    } else {
                        c
                    }
                })
                .collect();
            let pattern = pattern.join(".");
            *seen
                .entry(pattern)
                .or_insert_with(|| rulesets.iter().any(|r| r.is_stacked(n)))
        })
        .collect();
    (!packed.is_empty()).then(|| {
        format!(
            "layout: {} tensor(s) hold experts packed as transformers keeps them in memory ({}); merge writes them in the layout of the base's files (one tensor per expert for most models), by the rules of its model_type",
            packed.len(),
            crate::text::list_some(&packed, 2)
        )
    })
}
