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
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use unshard_pickle::NodeId;

use super::torch::{self, Found, Leaf, TensorRef, TorchPayload};
use super::{check_coverage, legacy, Blob, Checkpoint, Format, OpenOptions, Piece, TensorSource};
use crate::dtype::DType;
use crate::error::{Error, Result};

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

/// Most threads reading rank files at once (each holds one pickle arena).
const READ_THREADS: usize = 4;

/// What rank 0's file says, which every later rank's is checked against.
struct First<'a> {
    set: &'a RankSet,
    opts: &'a OpenOptions,
    n: usize,
    path0: &'a Path,
    /// The tensor names in file order, and where each is.
    names: &'a [String],
    index: &'a HashMap<String, usize>,
    /// The node of each tensor in rank 0's pickle, which a pickle read from its
    /// template has at the same nodes.
    nodes: &'a [NodeId],
    heads: &'a [Head],
}

/// What one later rank's file holds.
struct RankOut {
    blob: Arc<Blob>,
    /// One record per tensor, in rank 0's order (`Held::Plain` for plain tensors).
    held: Vec<Held>,
    /// The rank's distinct mesh coordinates.
    coords: Vec<Vec<u64>>,
    unsafe_calls: Vec<crate::source::audit::UnsafeCall>,
}

/// What the threads reading ranks 1.. fill in, rank by rank.
#[derive(Default)]
struct Collected {
    /// Per tensor, one record per rank (empty for a plain tensor).
    held: Vec<Vec<Held>>,
    files: Vec<Option<Arc<Blob>>>,
    coords: Vec<Vec<Vec<u64>>>,
    unsafe_calls: Vec<Vec<crate::source::audit::UnsafeCall>>,
    /// The error of the lowest rank that failed.
    error: Option<(usize, Error)>,
    /// What was taken from rank 0's file instead of read again.
    reused: Reused,
}

/// How many later ranks' files were read with what rank 0's file holds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Reused {
    /// Files whose pickle was read from rank 0's template instead of parsed.
    pickles: u64,
    /// Files whose archive lists rank 0's records, whose checks and storage keys
    /// were taken from rank 0's.
    tables: u64,
}

/// Opens every rank's file and describes the global tensors.
///
/// Rank 0's file is read first: its pickle is parsed and kept as a template, and
/// the head of each tensor (names, global shape and dtype, placements) is taken
/// from it. The other ranks' files are then read on up to `READ_THREADS` (4)
/// threads, each holding one copy of rank 0's arena: a file whose pickle differs
/// from rank 0's only in free integers and strings (a shard's size, a mesh
/// coordinate, a process group's name) is read as that arena with those values
/// changed instead of being parsed, and holds its tensors at rank 0's nodes; any
/// other is parsed in full. Each file's zip index is read and checked in full; one
/// that lists rank 0's records, entry by entry, under the file's own folder shares
/// rank 0's checks of the record names and its table of storage keys (see
/// `torch/storages.rs`). Either way the records of its tensors (where the local
/// tensor's bytes are, its box) are taken out, checked against rank 0's, and its
/// pickle is dropped (or given back) before the thread reads another file. What is
/// held is one record per tensor per rank, however many objects each rank's pickle
/// holds.
pub fn open(set: &RankSet, opts: &OpenOptions) -> Result<Checkpoint> {
    open_counted(set, opts).map(|(c, _)| c)
}

/// [`open`], and how many files were read with what rank 0's holds.
fn open_counted(set: &RankSet, opts: &OpenOptions) -> Result<(Checkpoint, Reused)> {
    let n = check_complete(set)?;
    let Some((_, name0)) = set.ranks.first() else {
        return Err(Error::corrupt(
            &set.dir,
            "the set of per-rank files is empty",
        ));
    };
    let path0 = set.dir.join(name0);
    let blob0 = Arc::new(crate::bytes::fs::open(&path0)?);
    let (mut payload, template) = read_first_payload(&path0, &blob0)?;
    let mut unsafe0 = std::mem::take(&mut payload.unsafe_calls);
    let found = torch::find_tensors(&payload.pickle, &path0, opts.key.as_deref())?;
    refuse_flat_params(set, &found)?;
    // From rank 0: the tensor names in file order, where each is, and its head.
    let mut names: Vec<String> = Vec::new();
    let mut index: HashMap<String, usize> = HashMap::new();
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
    let mut heads: Vec<Head> = Vec::with_capacity(names.len());
    let mut held: Vec<Vec<Held>> = Vec::with_capacity(names.len());
    let mut coords0: Vec<Vec<u64>> = Vec::new();
    {
        let rank = RankFile {
            path: &path0,
            payload: &payload,
            rank: 0,
        };
        for (name, &id) in names.iter().zip(&nodes) {
            let leaf = match torch::leaf(&payload.pickle, id) {
                Ok(Some(l)) => l,
                Ok(None) => return Err(Error::bad_tensor(&path0, name, "not a tensor")),
                Err(m) => return Err(Error::bad_tensor(&path0, name, m)),
            };
            let (head, h) = first_head(&rank, name, &leaf, n, set, &mut coords0)?;
            heads.push(head);
            // Slots for every rank's record, filled as the ranks are read.
            let v = match h {
                Held::Plain => Vec::new(),
                h => {
                    let mut v = Vec::with_capacity(n);
                    v.push(h);
                    v.resize_with(n, || Held::Plain);
                    v
                }
            };
            held.push(v);
        }
    }
    let key = found.key;
    let extras = found.extras;
    let nfiles = set.ranks.len();
    let mut collected = Collected {
        held,
        files: vec![None; nfiles],
        coords: vec![Vec::new(); nfiles],
        unsafe_calls: vec![Vec::new(); nfiles],
        ..Collected::default()
    };
    collected.files[0] = Some(blob0);
    collected.coords[0] = coords0;
    let first = First {
        set,
        opts,
        n,
        path0: &path0,
        names: &names,
        index: &index,
        nodes: &nodes,
        heads: &heads,
    };
    let arena = template.as_ref().map(|_| payload.pickle);
    read_later_ranks(&first, template.as_ref(), arena, &mut collected);
    if let Some((_, e)) = collected.error.take() {
        return Err(e);
    }
    let Collected {
        held,
        files,
        coords,
        unsafe_calls,
        reused,
        ..
    } = collected;
    unsafe0.extend(unsafe_calls.into_iter().flatten());
    let unsafe_calls = unsafe0;
    let files: Vec<Arc<Blob>> = files.into_iter().flatten().collect();
    let paths: Vec<PathBuf> = set.ranks.iter().map(|(_, f)| set.dir.join(f)).collect();
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
    let ckpt = Checkpoint {
        format: Format::Ranks,
        path: set.dir.clone(),
        files,
        key,
        tensors,
        extras,
        notes,
        unsafe_calls,
    };
    Ok((ckpt, reused))
}

/// Reads ranks 1.. into `out`, on up to [`READ_THREADS`] threads taking the next
/// rank in turn. Each thread reads against `template` with its own copy of rank
/// 0's `arena` (when both are given). A rank that fails stops the threads from
/// starting higher ranks; the lowest rank's error is kept, as reading the ranks in
/// order would have found it.
fn read_later_ranks(
    first: &First<'_>,
    template: Option<&torch::PayloadTemplate>,
    arena: Option<unshard_pickle::Pickle>,
    out: &mut Collected,
) {
    let nfiles = first.set.ranks.len();
    if nfiles <= 1 {
        return;
    }
    let threads = std::thread::available_parallelism()
        .map_or(1, |t| t.get())
        .clamp(1, READ_THREADS)
        .min(nfiles - 1);
    let next = AtomicUsize::new(1);
    let failed = AtomicUsize::new(usize::MAX);
    let shared = Mutex::new(std::mem::take(out));
    let work = |arena: Option<unshard_pickle::Pickle>| {
        let mut reader = match (template, arena) {
            (Some(t), Some(a)) => Some(torch::TemplateReader::new(t, a)),
            _ => None,
        };
        loop {
            let r = next.fetch_add(1, Ordering::Relaxed);
            if r >= nfiles || r > failed.load(Ordering::Relaxed) {
                break;
            }
            let got = read_rank(first, r, reader.as_mut());
            let mut c = shared.lock().unwrap_or_else(|e| e.into_inner());
            match got {
                Ok(o) => {
                    for (slots, h) in c.held.iter_mut().zip(o.held) {
                        if let Some(slot) = slots.get_mut(r) {
                            *slot = h;
                        }
                    }
                    c.files[r] = Some(o.blob);
                    c.coords[r] = o.coords;
                    c.unsafe_calls[r] = o.unsafe_calls;
                }
                Err(e) => {
                    failed.fetch_min(r, Ordering::Relaxed);
                    if c.error.as_ref().is_none_or(|(at, _)| r < *at) {
                        c.error = Some((r, e));
                    }
                }
            }
        }
        if let Some(reader) = reader {
            let mut c = shared.lock().unwrap_or_else(|e| e.into_inner());
            c.reused.pickles += reader.hits;
            c.reused.tables += reader.tables;
        }
    };
    let work = &work;
    std::thread::scope(|scope| {
        let mut handles = Vec::new();
        for _ in 1..threads {
            let copy = arena.clone();
            let h = std::thread::Builder::new()
                .name("unshard-ranks".into())
                .spawn_scoped(scope, move || work(copy));
            handles.push(h);
        }
        // This thread reads too (and alone, if no other could start).
        work(arena);
        for h in handles.into_iter().flatten() {
            let _ = h.join();
        }
    });
    *out = shared.into_inner().unwrap_or_else(|e| e.into_inner());
    // A thread that stopped abnormally leaves ranks unread: name the first.
    if out.error.is_none() {
        if let Some(r) = out.files.iter().position(Option::is_none) {
            let path = first.set.dir.join(&first.set.ranks[r].1);
            out.error = Some((
                r,
                Error::corrupt(path, "this rank's file could not be read"),
            ));
        }
    }
}

/// Reads rank `r`'s file (`r` > 0) and checks it against rank 0's.
fn read_rank(
    first: &First<'_>,
    r: usize,
    mut reader: Option<&mut torch::TemplateReader<'_>>,
) -> Result<RankOut> {
    let set = first.set;
    let path = set.dir.join(&set.ranks[r].1);
    let blob = Arc::new(crate::bytes::fs::open(&path)?);
    let (mut payload, from_template) = match reader.as_deref_mut() {
        Some(t) if torch::is_zip(&blob.head(64)?) => {
            let hits = t.hits;
            let payload = t.read(&blob)?;
            (payload, t.hits > hits)
        }
        _ => (read_payload(&path, &blob)?, false),
    };
    let unsafe_calls = std::mem::take(&mut payload.unsafe_calls);
    let records = records_of(first, r, &path, &payload, from_template);
    if let Some(t) = reader {
        t.done(payload);
    }
    let (held, coords) = records?;
    Ok(RankOut {
        blob,
        held,
        coords,
        unsafe_calls,
    })
}

/// The record of each of rank 0's tensors in rank `r`'s payload, checked against
/// rank 0's heads, and the rank's distinct mesh coordinates.
///
/// A payload read `from_template` holds its tensors at rank 0's nodes: finding the
/// state dict looks at the pickle's structure, its dict keys and the globals of its
/// calls only, none of which a template lets differ.
fn records_of(
    first: &First<'_>,
    r: usize,
    path: &Path,
    payload: &TorchPayload,
    from_template: bool,
) -> Result<(Vec<Held>, Vec<Vec<u64>>)> {
    let rank = RankFile {
        path,
        payload,
        rank: r,
    };
    let found;
    let nodes = if from_template {
        std::borrow::Cow::Borrowed(first.nodes)
    } else {
        found = torch::find_tensors(&payload.pickle, path, first.opts.key.as_deref())?;
        let nodes = same_names(&rank, &found, first.names, first.index, first.path0)?;
        std::borrow::Cow::Owned(nodes)
    };
    let mut mine: Vec<Vec<u64>> = Vec::new();
    let mut held = Vec::with_capacity(first.names.len());
    for ((name, &id), head) in first.names.iter().zip(nodes.iter()).zip(first.heads) {
        let leaf = match torch::leaf(&payload.pickle, id) {
            Ok(Some(l)) => l,
            Ok(None) => return Err(Error::bad_tensor(path, name, "not a tensor")),
            Err(m) => return Err(Error::bad_tensor(path, name, m)),
        };
        let h = match head {
            Head::Plain { dtype, shape, .. } => {
                plain_rank(&rank, name, &leaf, *dtype, shape)?;
                Held::Plain
            }
            Head::DTensor(head) => dtensor::rank(&rank, name, &leaf, head, &mut mine)?,
            Head::Sharded(head) => {
                sharded_tensor::rank(first.set, first.n, &rank, name, &leaf, head)?
            }
        };
        held.push(h);
    }
    Ok((held, mine))
}

/// Rank 0's payload, and its pickle kept as a template for the other ranks' when it
/// can be one.
fn read_first_payload(
    path: &Path,
    blob: &Blob,
) -> Result<(TorchPayload, Option<torch::PayloadTemplate>)> {
    let head = blob.head(64)?;
    if torch::is_zip(&head) {
        torch::read_zip_file_as_template(blob)
    } else {
        read_payload(path, blob).map(|p| (p, None))
    }
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
            crate::text::list_some(&flat.iter().map(|s| s.to_string()).collect::<Vec<_>>(), 3)
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

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn open_fixture(name: &str) -> (Checkpoint, Reused) {
        let dir = crate::fixtures().join(name);
        let set = find_rank_files(&dir).unwrap().unwrap();
        open_counted(&set, &OpenOptions::default()).unwrap_or_else(|e| panic!("{name}: {e}"))
    }

    /// Files torch wrote for the ranks of one job differ from rank 0's only in
    /// integers and strings (on a 2-d mesh, the names of its process groups), and
    /// are read from its template; a file whose opcodes differ
    /// (`gen_swapped_ranks.py`) is parsed. What each holds is checked against the
    /// full state dict in tests/sharded.rs.
    #[test]
    fn ranks_of_rank_0s_structure_are_read_from_its_template() {
        for (name, files) in [
            ("sharded/llama_w2_ranks", 2),
            ("sharded/llama_w3_ranks", 3),
            // A 2-d mesh: each rank's pickle also names its own process groups.
            ("sharded/llama_hsdp_2x2_ranks", 4),
            ("placements/ranks", 4),
        ] {
            let (ckpt, reused) = open_fixture(name);
            assert_eq!(ckpt.files.len(), files, "{name}");
            assert_eq!(reused.pickles, files as u64 - 1, "{name}");
            assert_eq!(reused.tables, files as u64 - 1, "{name}");
        }
        // Rank 1 names two tensors' storages the other way round: strings that
        // differ, read from the template (what it then holds: tests/sharded.rs).
        let (_, reused) = open_fixture("sharded/llama_w2_ranks_swapped");
        assert_eq!(reused.pickles, 1);
        let (_, reused) = open_fixture("sharded/llama_w2_ranks_long_memo");
        assert_eq!(reused.pickles, 0, "rank 1's opcodes are not rank 0's");
    }
}
