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
use super::{check_coverage, legacy, Blob, Checkpoint, Format, OpenOptions, Piece, TensorSource};
use crate::dtype::DType;
use crate::{Error, Result};

mod dtensor;
mod ranks;
mod sharded_tensor;

use ranks::MAX_RANKS;
pub use ranks::{find_rank_files, RankSet};

/// One rank's file while it is read: its payload is dropped once the records of its
/// tensors are taken out of it, so that only one rank's pickle is held at a time.
struct RankFile<'a> {
    path: &'a Path,
    payload: &'a TorchPayload,
    /// Rank number (the file id of its blob).
    rank: usize,
}

/// What rank 0's file says of one tensor; every other rank's file must agree.
enum Head {
    Plain {
        dtype: DType,
        shape: Vec<u64>,
        /// Rank 0's copy, or why it cannot be read.
        source: std::result::Result<TensorSource, Box<Error>>,
    },
    DTensor(dtensor::DtHead),
    Sharded(sharded_tensor::StHead),
}

/// A local tensor of one rank: its piece (placed later, for a DTensor), or why its
/// bytes cannot be read, kept until the tensor is built (a replica or an empty
/// shard is never read, and so never an error).
enum Local {
    Ready(Piece),
    Unreadable {
        shape: Vec<u64>,
        dtype: DType,
        global_offset: Vec<u64>,
        err: Box<Error>,
    },
}

impl Local {
    fn new(
        payload: &TorchPayload,
        rank: usize,
        name: &str,
        t: &TensorRef,
        offset: Vec<u64>,
    ) -> Local {
        match payload.piece(rank, name, t, offset.clone()) {
            Ok(p) => Local::Ready(p),
            Err(e) => Local::Unreadable {
                shape: t.shape.clone(),
                dtype: t.dtype,
                global_offset: offset,
                err: Box::new(e),
            },
        }
    }

    fn shape(&self) -> &[u64] {
        match self {
            Local::Ready(p) => &p.shape,
            Local::Unreadable { shape, .. } => shape,
        }
    }

    fn dtype(&self) -> DType {
        match self {
            Local::Ready(p) => p.dtype,
            Local::Unreadable { dtype, .. } => *dtype,
        }
    }

    fn global_offset(&self) -> &[u64] {
        match self {
            Local::Ready(p) => &p.global_offset,
            Local::Unreadable { global_offset, .. } => global_offset,
        }
    }

    fn set_global_offset(&mut self, offset: Vec<u64>) {
        match self {
            Local::Ready(p) => p.global_offset = offset,
            Local::Unreadable { global_offset, .. } => *global_offset = offset,
        }
    }

    fn piece(self) -> Result<Piece> {
        match self {
            Local::Ready(p) => Ok(p),
            Local::Unreadable { err, .. } => Err(*err),
        }
    }
}

/// What one rank's file holds of one tensor, beyond what rank 0's [`Head`] says.
enum Held {
    /// A plain tensor (only rank 0's copy is read).
    Plain,
    /// A DTensor's local tensor and the rank's mesh coordinate (an index into the
    /// rank's distinct coordinates).
    DTensor { local: Local, coord: u32 },
    /// A ShardedTensor's local shards, placed.
    Sharded(Vec<Local>),
}

/// Opens every rank's file and describes the global tensors.
///
/// The files are read one at a time: each rank's pickle is parsed, the records of its
/// tensors (where the local tensor's bytes are, its box) are taken out, checked
/// against rank 0's, and the pickle is dropped before the next file is read. What is
/// held is one record per tensor per rank, however many objects each rank's pickle
/// holds.
pub fn open(set: &RankSet, opts: &OpenOptions) -> Result<Checkpoint> {
    let n = check_complete(set)?;
    let mut files = Vec::with_capacity(n);
    let mut paths: Vec<PathBuf> = Vec::with_capacity(n);
    let mut unsafe_calls = Vec::new();
    // From rank 0: the tensor names in file order, where each is, and its head.
    let mut names: Vec<String> = Vec::new();
    let mut index: HashMap<String, usize> = HashMap::new();
    let mut heads: Vec<Head> = Vec::new();
    let mut held: Vec<Vec<Held>> = Vec::new();
    // Each rank's distinct mesh coordinates (one, for a checkpoint of one mesh).
    let mut coords: Vec<Vec<Vec<u64>>> = Vec::with_capacity(n);
    let mut key = None;
    let mut extras = Vec::new();
    for (r, (_, file_name)) in set.ranks.iter().enumerate() {
        let path = set.dir.join(file_name);
        let blob = Arc::new(crate::source::fs::open(&path)?);
        let mut payload = read_payload(&path, &blob)?;
        unsafe_calls.append(&mut payload.unsafe_calls);
        let found = torch::find_tensors(&payload.pickle, &path, opts.key.as_deref())?;
        files.push(blob);
        let rank = RankFile {
            path: &path,
            payload: &payload,
            rank: r,
        };
        let nodes = if r == 0 {
            refuse_flat_params(set, &found)?;
            let mut nodes: Vec<NodeId> = Vec::with_capacity(found.tensors.len());
            for (name, id) in &found.tensors {
                match index.get(name) {
                    // The same key twice: the last one is the dict's value.
                    Some(&i) => nodes[i] = *id,
                    None => {
                        index.insert(name.clone(), names.len());
                        names.push(name.clone());
                        nodes.push(*id);
                    }
                }
            }
            nodes
        } else {
            same_names(&rank, &found, &names, &index, &paths[0])?
        };
        let mut mine: Vec<Vec<u64>> = Vec::new();
        for (i, (name, id)) in names.iter().zip(nodes).enumerate() {
            let leaf = match torch::leaf(&payload.pickle, id) {
                Ok(Some(l)) => l,
                Ok(None) => return Err(Error::bad_tensor(&path, name, "not a tensor")),
                Err(m) => return Err(Error::bad_tensor(&path, name, m)),
            };
            if r == 0 {
                let (head, h) = first_head(&rank, name, &leaf, n, set, &mut mine)?;
                heads.push(head);
                let mut v = Vec::with_capacity(if matches!(h, Held::Plain) { 0 } else { n });
                if !matches!(h, Held::Plain) {
                    v.push(h);
                }
                held.push(v);
            } else {
                let h = match &heads[i] {
                    Head::Plain { dtype, shape, .. } => {
                        plain_rank(&rank, name, &leaf, *dtype, shape)?;
                        Held::Plain
                    }
                    Head::DTensor(head) => dtensor::rank(&rank, name, &leaf, head, &mut mine)?,
                    Head::Sharded(head) => sharded_tensor::rank(set, n, &rank, name, &leaf, head)?,
                };
                if !matches!(h, Held::Plain) {
                    held[i].push(h);
                }
            }
        }
        if r == 0 {
            key = found.key.clone();
            extras = found.extras;
        }
        coords.push(mine);
        paths.push(path);
    }
    if paths.is_empty() {
        return Err(Error::corrupt(
            &set.dir,
            "the set of per-rank files is empty",
        ));
    }
    let mut tensors = Vec::with_capacity(names.len());
    for ((name, head), held) in names.iter().zip(heads).zip(held) {
        let source = match head {
            Head::Plain { source, .. } => {
                let mut source = source.map_err(|e| *e)?;
                if n > 1 {
                    source.layout =
                        Some(format!("plain tensor in each of {n} ranks (rank 0's copy)"));
                }
                source
            }
            Head::DTensor(head) => dtensor::build(set, &paths, name, &head, held, &coords)?,
            Head::Sharded(head) => sharded_tensor::build(set, n, name, &head, held)?,
        };
        check_coverage(&set.dir, &source)?;
        tensors.push(source);
    }
    super::release_freed_memory();
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
        key,
        tensors,
        extras,
        notes,
        unsafe_calls,
    })
}

/// Rank 0's head of one tensor, and what rank 0 holds of it.
fn first_head(
    rank: &RankFile<'_>,
    name: &str,
    leaf: &Leaf,
    n: usize,
    set: &RankSet,
    coords: &mut Vec<Vec<u64>>,
) -> Result<(Head, Held)> {
    match leaf {
        Leaf::Tensor(t) => Ok((
            Head::Plain {
                dtype: t.dtype,
                shape: t.shape.clone(),
                source: rank.payload.source(0, name, t).map_err(Box::new),
            },
            Held::Plain,
        )),
        Leaf::Subclass(s) if s.class == "DTensor" => {
            let (head, held) = dtensor::first(rank, name, s, coords)?;
            Ok((Head::DTensor(head), held))
        }
        Leaf::Subclass(s) if s.class == "ShardedTensor" => {
            let head = sharded_tensor::StHead {
                dtype: s.dtype,
                shape: s.shape.clone(),
            };
            let held = sharded_tensor::rank(set, n, rank, name, leaf, &head)?;
            Ok((Head::Sharded(head), held))
        }
        Leaf::Subclass(s) => Err(Error::Unsupported {
            path: rank.path.to_path_buf(),
            what: format!(
                "tensor '{name}': the tensor subclass {}.{}",
                s.module, s.class
            ),
            hint: None,
        }),
    }
}

/// A plain tensor in a rank after 0: it must match rank 0's.
fn plain_rank(
    rank: &RankFile<'_>,
    name: &str,
    leaf: &Leaf,
    dtype: DType,
    shape: &[u64],
) -> Result<()> {
    let Leaf::Tensor(t) = leaf else {
        return Err(Error::bad_tensor(
            rank.path,
            name,
            "a distributed tensor here but a plain tensor in rank 0's file",
        ));
    };
    if t.shape != shape || t.dtype != dtype {
        return Err(Error::bad_tensor(
            rank.path,
            name,
            format!(
                "{} {:?} here but {} {:?} in rank 0's file",
                t.dtype.safetensors_name(),
                t.shape,
                dtype.safetensors_name(),
                shape
            ),
        ));
    }
    Ok(())
}

/// The node of each of rank 0's tensors in a later rank's file, after checking that
/// it holds the same names.
fn same_names(
    rank: &RankFile<'_>,
    found: &Found,
    names: &[String],
    index: &HashMap<String, usize>,
    first: &Path,
) -> Result<Vec<NodeId>> {
    let mut nodes: Vec<Option<NodeId>> = vec![None; names.len()];
    for (name, id) in &found.tensors {
        let Some(&i) = index.get(name) else {
            return Err(Error::bad_tensor(
                rank.path,
                name,
                format!("not in {}", first.display()),
            ));
        };
        nodes[i] = Some(*id);
    }
    nodes
        .iter()
        .zip(names)
        .map(|(id, name)| {
            id.ok_or_else(|| {
                Error::bad_tensor(
                    rank.path,
                    name,
                    format!("in {} but missing from this rank's file", first.display()),
                )
            })
        })
        .collect()
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
fn refuse_flat_params(set: &RankSet, first: &Found) -> Result<()> {
    let flat: Vec<&str> = first
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
