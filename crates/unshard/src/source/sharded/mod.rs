//! Per-rank `torch.save` files: one state dict per rank, holding DTensors (FSDP2,
//! verl's `model_world_size_N_rank_R.pt`), ShardedTensors (FSDP1
//! `SHARDED_STATE_DICT`) or plain tensors (world size 1, or replicated values).
//!
//! Each rank's file is read like any `torch.save` file; the tensor subclasses are
//! pickled without data (`_rebuild_wrapper_subclass`, see docs/formats.md) and carry
//! their local tensor and how it fits in the global one:
//! - a DTensor has a spec (placements over a device mesh, and the saving rank's
//!   mesh coordinate). Its box follows torch's `compute_local_shape_and_global_offset`:
//!   `Shard(d)` splits dimension `d` by the `torch.chunk` rule (uneven and empty shards
//!   included), `Replicate` keeps it whole, mesh dimensions apply left to right.
//!   `Partial` (values still to be summed) and `_StridedShard` (interleaved shards)
//!   are refused;
//! - a ShardedTensor lists its local shards with their offsets and sizes.
//!
//! Every rank's local tensor becomes one piece at its box; replicas (identical boxes)
//! are kept once, from the lowest rank. The engine assembles them; this module only
//! describes, then checks that the boxes tile each tensor exactly.
//!
//! By job: `ranks` finds the set of files in a directory, this file opens them and
//! checks they belong together, `dtensor` places DTensor shards, `sharded_tensor`
//! places ShardedTensor shards.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use unshard_pickle::NodeId;

use super::torch::{self, Found, Leaf, TensorRef, TorchPayload};
use super::{check_coverage, legacy, Blob, Checkpoint, Format, OpenOptions, TensorSource};
use crate::{Error, Result};

mod dtensor;
mod ranks;
mod sharded_tensor;

use ranks::MAX_RANKS;
pub use ranks::{find_rank_files, RankSet};

/// One rank's file, parsed.
struct RankFile {
    path: PathBuf,
    payload: TorchPayload,
    found: Found,
    /// Tensor name → node, for lookups by name.
    by_name: HashMap<String, NodeId>,
}

/// Opens every rank's file and describes the global tensors.
pub fn open(set: &RankSet, opts: &OpenOptions) -> Result<Checkpoint> {
    let n = check_complete(set)?;
    let mut files = Vec::with_capacity(n);
    let mut ranks = Vec::with_capacity(n);
    let mut unsafe_calls = Vec::new();
    for (_, name) in &set.ranks {
        let path = set.dir.join(name);
        let blob = Arc::new(crate::source::fs::open(&path)?);
        let mut payload = read_payload(&path, &blob)?;
        unsafe_calls.append(&mut payload.unsafe_calls);
        let found = torch::find_tensors(&payload.pickle, &path, opts.key.as_deref())?;
        let by_name = found.tensors.iter().cloned().collect();
        files.push(blob);
        ranks.push(RankFile {
            path,
            payload,
            found,
            by_name,
        });
    }
    let first = ranks
        .first()
        .ok_or_else(|| Error::corrupt(&set.dir, "the set of per-rank files is empty"))?;
    refuse_flat_params(set, first)?;
    check_same_names(&ranks)?;
    let mut tensors = Vec::with_capacity(first.found.tensors.len());
    for (name, _) in &first.found.tensors {
        tensors.push(global_tensor(set, &ranks, name)?);
    }
    let mut notes = vec![format!("{n} per-rank file(s) {}", set.pattern())];
    for s in &set.skipped {
        notes.push(format!(
            "skipped {s} (optimizer or trainer state, not model weights)"
        ));
    }
    Ok(Checkpoint {
        format: Format::Ranks,
        path: set.dir.clone(),
        files,
        key: first.found.key.clone(),
        tensors,
        extras: first.found.extras.clone(),
        notes,
        unsafe_calls,
    })
}

/// The world size, after checking that every rank's file is there.
fn check_complete(set: &RankSet) -> Result<usize> {
    let max = set.ranks.last().map(|(r, _)| *r).unwrap_or(0);
    let n = set.world_size.unwrap_or(max + 1);
    if n == 0 || n > MAX_RANKS {
        return Err(Error::corrupt(
            &set.dir,
            format!("the file names give a world size of {n}"),
        ));
    }
    if let Some((r, name)) = set.ranks.iter().find(|(r, _)| *r >= n) {
        return Err(Error::corrupt(
            set.dir.join(name),
            format!("this is rank {r}, but the file names give a world size of {n}"),
        ));
    }
    // Ranks are sorted and distinct: the first position that does not hold its own
    // rank number is the first missing rank.
    let missing = set
        .ranks
        .iter()
        .enumerate()
        .find(|(i, (r, _))| i != r)
        .map(|(i, _)| i)
        .unwrap_or(set.ranks.len());
    if missing < n {
        return Err(missing_rank(set, missing, n));
    }
    Ok(n)
}

/// The files hold ranks `0..present`; a tensor says it lives on `needed` ranks.
/// Rank `present` is then the first missing one.
fn check_ranks_present(set: &RankSet, present: usize, needed: &[u64]) -> Result<()> {
    match needed.iter().max() {
        Some(&max) if max >= present as u64 => {
            let world = usize::try_from(max).unwrap_or(usize::MAX).saturating_add(1);
            Err(missing_rank(set, present, world))
        }
        _ => Ok(()),
    }
}

fn missing_rank(set: &RankSet, r: usize, n: usize) -> Error {
    Error::Incomplete {
        path: set.dir.join(set.name_of(r)),
        msg: format!("rank {r}'s file is missing (world size {n})"),
        hint: Some(format!(
            "sharded tensors need every rank's file: copy all {n} files {} into {}",
            set.pattern(),
            set.dir.display()
        )),
    }
}

fn read_payload(path: &Path, blob: &Blob) -> Result<TorchPayload> {
    let head = blob.head(64)?;
    if torch::is_zip(&head) {
        torch::read_zip_file(blob)
    } else if legacy::is_legacy(&head) {
        legacy::read_legacy_payload(blob)
    } else {
        Err(Error::UnknownFormat {
            path: path.to_path_buf(),
            found: "a per-rank file that is not a torch.save archive".into(),
        })
    }
}

/// FSDP1 `LOCAL_STATE_DICT` saves each wrapped module's parameters flattened and
/// concatenated into one padded 1-D `flat_param`. Which slice is which parameter,
/// and its shape, is known only to the live model: the files cannot be unflattened.
fn refuse_flat_params(set: &RankSet, first: &RankFile) -> Result<()> {
    let flat: Vec<&str> = first
        .found
        .tensors
        .iter()
        .map(|(n, _)| n.as_str())
        .filter(|n| *n == "flat_param" || n.ends_with("_flat_param") || n.ends_with(".flat_param"))
        .collect();
    if flat.is_empty() {
        return Ok(());
    }
    Err(Error::Unsupported {
        path: set.dir.clone(),
        what: format!(
            "an FSDP1 LOCAL_STATE_DICT of flat parameters ({})",
            crate::report::list_some(&flat.iter().map(|s| s.to_string()).collect::<Vec<_>>(), 3)
        ),
        hint: Some(
            "each flat parameter is all of a wrapped module's parameters flattened, concatenated and padded into one 1-D buffer; \
             their names and shapes exist only in the Python model, not in these files. \
             Save a SHARDED_STATE_DICT instead (`with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT): \
             torch.distributed.checkpoint.save(...)`), or a FULL_STATE_DICT"
                .into(),
        ),
    })
}

/// Every rank must hold the same tensor names.
fn check_same_names(ranks: &[RankFile]) -> Result<()> {
    let Some(first) = ranks.first() else {
        return Ok(());
    };
    for rank in &ranks[1..] {
        if let Some((name, _)) = rank
            .found
            .tensors
            .iter()
            .find(|(n, _)| !first.by_name.contains_key(n))
        {
            return Err(Error::bad_tensor(
                &rank.path,
                name,
                format!("not in {}", first.path.display()),
            ));
        }
        if let Some((name, _)) = first
            .found
            .tensors
            .iter()
            .find(|(n, _)| !rank.by_name.contains_key(n))
        {
            return Err(Error::bad_tensor(
                &rank.path,
                name,
                format!(
                    "in {} but missing from this rank's file",
                    first.path.display()
                ),
            ));
        }
    }
    Ok(())
}

/// The leaf of tensor `name` in each rank's file.
fn leaves(ranks: &[RankFile], name: &str) -> Result<Vec<Leaf>> {
    let mut out = Vec::with_capacity(ranks.len());
    for rank in ranks {
        let id =
            rank.by_name.get(name).copied().ok_or_else(|| {
                Error::bad_tensor(&rank.path, name, "missing from this rank's file")
            })?;
        match torch::leaf(&rank.payload.pickle, id) {
            Ok(Some(l)) => out.push(l),
            Ok(None) => return Err(Error::bad_tensor(&rank.path, name, "not a tensor")),
            Err(m) => return Err(Error::bad_tensor(&rank.path, name, m)),
        }
    }
    Ok(out)
}

fn global_tensor(set: &RankSet, ranks: &[RankFile], name: &str) -> Result<TensorSource> {
    let leaves = leaves(ranks, name)?;
    let source = match leaves.first() {
        Some(Leaf::Tensor(_)) => plain(ranks, name, &leaves)?,
        Some(Leaf::Subclass(s)) if s.class == "DTensor" => {
            dtensor::dtensor(set, ranks, name, &leaves)?
        }
        Some(Leaf::Subclass(s)) if s.class == "ShardedTensor" => {
            sharded_tensor::sharded_tensor(set, ranks, name, &leaves)?
        }
        Some(Leaf::Subclass(s)) => {
            return Err(Error::Unsupported {
                path: ranks[0].path.clone(),
                what: format!(
                    "tensor '{name}': the tensor subclass {}.{}",
                    s.module, s.class
                ),
                hint: None,
            })
        }
        None => return Err(Error::bad_tensor(&set.dir, name, "no rank holds it")),
    };
    check_coverage(&set.dir, &source)?;
    Ok(source)
}

/// Plain tensors: world size 1, or the same value saved by every rank.
fn plain(ranks: &[RankFile], name: &str, leaves: &[Leaf]) -> Result<TensorSource> {
    let mut first: Option<&TensorRef> = None;
    for (rank, leaf) in ranks.iter().zip(leaves) {
        let Leaf::Tensor(t) = leaf else {
            return Err(Error::bad_tensor(
                &rank.path,
                name,
                "a distributed tensor here but a plain tensor in rank 0's file",
            ));
        };
        match first {
            None => first = Some(t),
            Some(f) if f.shape != t.shape || f.dtype != t.dtype => {
                return Err(Error::bad_tensor(
                    &rank.path,
                    name,
                    format!(
                        "{} {:?} here but {} {:?} in rank 0's file",
                        t.dtype.safetensors_name(),
                        t.shape,
                        f.dtype.safetensors_name(),
                        f.shape
                    ),
                ))
            }
            Some(_) => {}
        }
    }
    let (Some(t), Some(rank0)) = (first, ranks.first()) else {
        return Err(Error::bad_tensor(Path::new("?"), name, "no rank holds it"));
    };
    let mut source = rank0.payload.source(0, name, t)?;
    if ranks.len() > 1 {
        source.layout = Some(format!(
            "plain tensor in each of {} ranks (rank 0's copy)",
            ranks.len()
        ));
    }
    Ok(source)
}
