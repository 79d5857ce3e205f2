//! Per-rank `torch.save` files: one state dict per rank, holding DTensors (FSDP2,
//! verl's `model_world_size_N_rank_R.pt`), ShardedTensors (FSDP1
//! `SHARDED_STATE_DICT`) or plain tensors (world size 1, or replicated values).
//!
//! Each rank's file is read like any `torch.save` file; the tensor subclasses are
//! pickled without data (`_rebuild_wrapper_subclass`, formats.md §1.5-1.6) and carry
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

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use regex::Regex;
use unshard_pickle::{NodeId, Pickle, Value};

use super::torch::{
    self, class_of, dims_of, field_of, int_of, seq_of, Found, Leaf, SubclassRef, TensorRef,
    TorchPayload,
};
use super::{check_coverage, legacy, Blob, Checkpoint, Format, OpenOptions, Piece, TensorSource};
use crate::{Error, Result};

/// Rank numbers above this are not believed (a name like `rank_99999999999.pt`).
const MAX_RANKS: usize = 1 << 20;

/// A set of per-rank files found in a directory: `{prefix}{rank}{suffix}`.
#[derive(Clone, Debug)]
pub struct RankSet {
    pub dir: PathBuf,
    pub prefix: String,
    pub suffix: String,
    /// `(rank, file name)`, sorted by rank.
    pub ranks: Vec<(usize, String)>,
    /// Width of zero-padded rank numbers (`rank_003`), 0 when not padded.
    pub pad: usize,
    /// The world size the names state (`model_world_size_N_rank_R.pt`).
    pub world_size: Option<usize>,
    /// Other per-rank sets in the directory that are not model weights.
    pub skipped: Vec<String>,
}

impl RankSet {
    /// The file name rank `r` has (or would have).
    pub fn name_of(&self, r: usize) -> String {
        format!("{}{r:0w$}{}", self.prefix, self.suffix, w = self.pad)
    }

    fn pattern(&self) -> String {
        format!("{}*{}", self.prefix, self.suffix)
    }
}

fn rank_regex() -> Option<Regex> {
    Regex::new(r"^(.*rank[_-]?)(\d+)(\.(?:pt|pth|bin|ckpt))$").ok()
}

/// Whether a per-rank set holds something other than model weights.
fn is_not_model(prefix: &str) -> bool {
    let p = prefix.to_ascii_lowercase();
    ["optim", "extra_state", "rng", "scheduler", "lr_"]
        .iter()
        .any(|w| p.contains(w))
}

/// `(prefix, suffix)` of a set's file names.
type NamePattern = (String, String);

/// Looks for per-rank files in `dir`. `None` when there are none.
pub fn find_rank_files(dir: &Path) -> Result<Option<RankSet>> {
    let Some(re) = rank_regex() else {
        return Ok(None);
    };
    let mut groups: Vec<(NamePattern, Vec<(usize, String)>)> = Vec::new();
    let rd = std::fs::read_dir(dir).map_err(|e| Error::io("list", dir, e))?;
    for entry in rd.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(c) = re.captures(&name) else {
            continue;
        };
        if !entry.path().is_file() {
            continue;
        }
        let (Some(pre), Some(num), Some(suf)) = (c.get(1), c.get(2), c.get(3)) else {
            continue;
        };
        let Some(rank) = num
            .as_str()
            .parse::<usize>()
            .ok()
            .filter(|&r| r < MAX_RANKS)
        else {
            continue;
        };
        let key = (pre.as_str().to_string(), suf.as_str().to_string());
        match groups.iter_mut().find(|(k, _)| *k == key) {
            Some((_, v)) => v.push((rank, name)),
            None => groups.push((key, vec![(rank, name)])),
        }
    }
    groups.sort();
    let (model, other): (Vec<_>, Vec<_>) =
        groups.into_iter().partition(|((p, _), _)| !is_not_model(p));
    let skipped: Vec<String> = other.iter().map(|((p, s), _)| format!("{p}*{s}")).collect();
    let mut model = model;
    if model.len() > 1 {
        // verl and accelerate name the model's files first; prefer those.
        let preferred: Vec<_> = model
            .iter()
            .filter(|((p, _), _)| p.starts_with("model") || p.starts_with("pytorch_model"))
            .cloned()
            .collect();
        if preferred.len() == 1 {
            model = preferred;
        }
    }
    let ((prefix, suffix), mut ranks) = match model.len() {
        0 => return Ok(None),
        1 => model.remove(0),
        _ => {
            return Err(Error::Unsupported {
                path: dir.to_path_buf(),
                what: format!(
                    "a directory holding several sets of per-rank files ({})",
                    model
                        .iter()
                        .map(|((p, s), _)| format!("{p}*{s}"))
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
                hint: Some("move the set to merge into a directory of its own".into()),
            })
        }
    };
    ranks.sort();
    for w in ranks.windows(2) {
        if w[0].0 == w[1].0 {
            return Err(Error::corrupt(
                dir,
                format!("{} and {} are both rank {}", w[0].1, w[1].1, w[0].0),
            ));
        }
    }
    let pad = ranks
        .iter()
        .filter_map(|(_, n)| {
            let digits = n
                .strip_prefix(prefix.as_str())?
                .strip_suffix(suffix.as_str())?;
            (digits.len() > 1 && digits.starts_with('0')).then_some(digits.len())
        })
        .max()
        .unwrap_or(0);
    let world_size = Regex::new(r"world_size_(\d+)")
        .ok()
        .and_then(|r| r.captures(&prefix))
        .and_then(|c| c.get(1))
        .and_then(|m| m.as_str().parse::<usize>().ok());
    Ok(Some(RankSet {
        dir: dir.to_path_buf(),
        prefix,
        suffix,
        ranks,
        pad,
        world_size,
        skipped,
    }))
}

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
        let blob = Arc::new(Blob::open(&path)?);
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
    let data = blob.bytes();
    if data.starts_with(b"PK\x03\x04") || data.starts_with(b"PK\x05\x06") {
        torch::read_zip_file(path, blob)
    } else if legacy::is_legacy(data) {
        legacy::read_legacy_payload(path, data)
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
        Some(Leaf::Subclass(s)) if s.class == "DTensor" => dtensor(set, ranks, name, &leaves)?,
        Some(Leaf::Subclass(s)) if s.class == "ShardedTensor" => {
            sharded_tensor(set, ranks, name, &leaves)?
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

/// How a DTensor is laid out over one mesh dimension.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Placement {
    Shard(usize),
    Replicate,
}

impl std::fmt::Display for Placement {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Placement::Shard(d) => write!(f, "Shard({d})"),
            Placement::Replicate => f.write_str("Replicate()"),
        }
    }
}

/// One rank's DTensor: its spec and local tensor.
struct DtLocal {
    placements: Vec<Placement>,
    coord: Option<Vec<u64>>,
    mesh_shape: Option<Vec<u64>>,
    /// Global ranks of the mesh, when recorded.
    mesh_ranks: Vec<u64>,
    /// The saving process's global rank, when recorded.
    rank: Option<u64>,
    local: TensorRef,
}

fn dtensor(set: &RankSet, ranks: &[RankFile], name: &str, leaves: &[Leaf]) -> Result<TensorSource> {
    let mut locals = Vec::with_capacity(ranks.len());
    let mut global: Option<&SubclassRef> = None;
    for (rank, leaf) in ranks.iter().zip(leaves) {
        let s = match leaf {
            Leaf::Subclass(s) if s.class == "DTensor" => s,
            _ => {
                return Err(Error::bad_tensor(
                    &rank.path,
                    name,
                    "not a DTensor here, but a DTensor in rank 0's file",
                ))
            }
        };
        match global {
            None => global = Some(s),
            Some(g) if g.shape != s.shape || g.dtype != s.dtype => {
                return Err(Error::bad_tensor(
                    &rank.path,
                    name,
                    format!(
                        "global {:?} {:?} here but {:?} {:?} in rank 0's file",
                        s.dtype, s.shape, g.dtype, g.shape
                    ),
                ))
            }
            Some(_) => {}
        }
        locals.push(dtensor_local(&rank.payload.pickle, s, &rank.path, name)?);
    }
    let (Some(g), Some(l0)) = (global, locals.first()) else {
        return Err(Error::bad_tensor(&set.dir, name, "no rank holds it"));
    };
    let dtype = g
        .dtype
        .ok_or_else(|| Error::bad_tensor(&ranks[0].path, name, "the DTensor has no dtype"))?;
    let shape = g.shape.clone();
    let placements = l0.placements.clone();
    let ndim_mesh = placements.len();

    // Every rank the mesh names must have its file.
    let n = ranks.len();
    check_ranks_present(set, n, &l0.mesh_ranks)?;

    // Mesh coordinates, then the mesh shape (recorded, else the largest coordinate).
    let coords = coordinates(ranks, &locals, &placements, name)?;
    let mesh_shape = match &l0.mesh_shape {
        Some(m) if m.len() == ndim_mesh => m.clone(),
        _ => (0..ndim_mesh)
            .map(|i| {
                coords
                    .iter()
                    .filter_map(|c| c.get(i)?.checked_add(1))
                    .max()
                    .unwrap_or(1)
            })
            .collect(),
    };

    let mut pieces: Vec<Piece> = Vec::new();
    let mut boxes: HashSet<(Vec<u64>, Vec<u64>)> = HashSet::new();
    for (r, ((local, rank), coord)) in locals.iter().zip(ranks).zip(&coords).enumerate() {
        let (box_shape, offset) = shard_box(&shape, &placements, &mesh_shape, coord)
            .map_err(|m| Error::bad_tensor(&rank.path, name, m))?;
        if local.local.shape != box_shape {
            return Err(Error::bad_tensor(
                &rank.path,
                name,
                format!(
                    "the local tensor is {:?} but placements {} on mesh {:?} at coordinate {coord:?} give {box_shape:?}",
                    local.local.shape,
                    placements_text(&placements),
                    mesh_shape
                ),
            ));
        }
        if local.local.dtype != dtype {
            return Err(Error::bad_tensor(
                &rank.path,
                name,
                format!(
                    "the local tensor is {} but the DTensor is {}",
                    local.local.dtype.safetensors_name(),
                    dtype.safetensors_name()
                ),
            ));
        }
        // Replicas hold the same box: keep the lowest rank's. Empty shards hold nothing.
        if box_shape.contains(&0) || !boxes.insert((offset.clone(), box_shape)) {
            continue;
        }
        pieces.push(rank.payload.piece(r, name, &local.local, offset)?);
    }
    let layout = format!(
        "DTensor {} on mesh {:?}: {n} rank(s), {} chunk(s)",
        placements_text(&placements),
        mesh_shape,
        pieces.len()
    );
    Ok(TensorSource {
        name: name.to_string(),
        dtype,
        shape,
        pieces,
        storage: None,
        layout: Some(layout),
    })
}

/// Each rank's mesh coordinate, checked against the placements (which every rank
/// must share).
fn coordinates(
    ranks: &[RankFile],
    locals: &[DtLocal],
    placements: &[Placement],
    name: &str,
) -> Result<Vec<Vec<u64>>> {
    let mut coords = Vec::with_capacity(locals.len());
    for (r, (local, rank)) in locals.iter().zip(ranks).enumerate() {
        let bad = |m: String| Error::bad_tensor(&rank.path, name, m);
        if local.placements != placements {
            return Err(bad(format!(
                "placements {} here but {} in rank 0's file",
                placements_text(&local.placements),
                placements_text(placements)
            )));
        }
        let coord = match &local.coord {
            Some(c) => c.clone(),
            None => derive_coord(local, r as u64).ok_or_else(|| {
                bad("the DTensor's mesh does not record this rank's coordinate".into())
            })?,
        };
        if coord.len() != placements.len() {
            return Err(bad(format!(
                "mesh coordinate {coord:?} does not match {} placement(s)",
                placements.len()
            )));
        }
        coords.push(coord);
    }
    Ok(coords)
}

fn placements_text(p: &[Placement]) -> String {
    let parts: Vec<String> = p.iter().map(Placement::to_string).collect();
    format!("({})", parts.join(", "))
}

/// The box a mesh coordinate holds, as torch's `compute_local_shape_and_global_offset`
/// computes it: mesh dimensions left to right, each `Shard(d)` cutting the current
/// extent of `d` into `torch.chunk` pieces.
fn shard_box(
    global: &[u64],
    placements: &[Placement],
    mesh: &[u64],
    coord: &[u64],
) -> std::result::Result<(Vec<u64>, Vec<u64>), String> {
    let mut shape = global.to_vec();
    let mut offset = vec![0u64; global.len()];
    for (i, p) in placements.iter().enumerate() {
        let Placement::Shard(d) = *p else { continue };
        let (Some(&m), Some(&k)) = (mesh.get(i), coord.get(i)) else {
            return Err("the mesh and the placements disagree".into());
        };
        if m == 0 || k >= m {
            return Err(format!(
                "mesh coordinate {coord:?} lies outside mesh {mesh:?}"
            ));
        }
        let (Some(&n), Some(&o)) = (shape.get(d), offset.get(d)) else {
            return Err(format!(
                "Shard({d}) of a tensor with {} dimension(s)",
                global.len()
            ));
        };
        let chunk = n.div_ceil(m);
        let start = chunk.saturating_mul(k).min(n);
        let end = start.saturating_add(chunk).min(n);
        shape[d] = end - start;
        offset[d] = o.saturating_add(start);
    }
    Ok((shape, offset))
}

/// A mesh coordinate from the saving rank and the mesh's rank list (row-major).
fn derive_coord(local: &DtLocal, file_rank: u64) -> Option<Vec<u64>> {
    let rank = local.rank.unwrap_or(file_rank);
    if local.placements.len() == 1 && local.mesh_ranks.is_empty() {
        return Some(vec![rank]);
    }
    let mesh = local.mesh_shape.as_ref()?;
    let mut pos = local.mesh_ranks.iter().position(|&r| r == rank)? as u64;
    let mut coord = vec![0u64; mesh.len()];
    for (c, &m) in coord.iter_mut().zip(mesh).rev() {
        if m == 0 {
            return None;
        }
        *c = pos % m;
        pos /= m;
    }
    Some(coord)
}

/// Reads a DTensor's spec and local tensor (formats.md §1.5).
fn dtensor_local(p: &Pickle, s: &SubclassRef, path: &Path, name: &str) -> Result<DtLocal> {
    let bad = |m: &str| Error::bad_tensor(path, name, m.to_string());
    let local = torch::subclass_local(p, s)
        .ok_or_else(|| bad("the DTensor has no readable local tensor"))?;
    let state = s.state.ok_or_else(|| bad("the DTensor has no state"))?;
    let spec = slot(p, state, "_spec").ok_or_else(|| bad("the DTensor has no spec"))?;
    let placement_ids = field_of(p, spec, "placements")
        .and_then(|x| seq_of(p, x))
        .ok_or_else(|| bad("the DTensor spec has no placements"))?;
    let ndim = s.shape.len() as i64;
    let mut placements = Vec::with_capacity(placement_ids.len());
    for &pl in placement_ids {
        placements.push(placement(p, pl, ndim, path, name)?);
    }
    let mesh = field_of(p, spec, "mesh").ok_or_else(|| bad("the DTensor spec has no mesh"))?;
    let ints = |id: Option<NodeId>| -> Option<Vec<u64>> {
        seq_of(p, id?)?
            .iter()
            .map(|&x| int_of(p, x).and_then(|i| u64::try_from(i).ok()))
            .collect()
    };
    let coord = ints(field_of(p, mesh, "_coordinate_on_dim"));
    let mesh_ranks = ints(field_of(p, mesh, "_flatten_rank_map")).unwrap_or_default();
    let rank = field_of(p, mesh, "_rank")
        .and_then(|x| int_of(p, x))
        .and_then(|i| u64::try_from(i).ok());
    Ok(DtLocal {
        placements,
        coord,
        mesh_shape: mesh_shape(p, mesh),
        mesh_ranks,
        rank,
        local,
    })
}

/// An entry of a `__slots__` state `(dict or None, {slot: value})`, or of a dict state.
fn slot(p: &Pickle, state: NodeId, key: &str) -> Option<NodeId> {
    match p.get(state) {
        Value::Tuple(parts) => parts.iter().rev().find_map(|&d| torch::dict_get(p, d, key)),
        Value::Dict(_) => torch::dict_get(p, state, key),
        _ => None,
    }
}

fn placement(p: &Pickle, id: NodeId, ndim: i64, path: &Path, name: &str) -> Result<Placement> {
    let unsupported = |what: String, hint: &str| Error::Unsupported {
        path: path.to_path_buf(),
        what: format!("tensor '{name}': {what}"),
        hint: Some(hint.to_string()),
    };
    match class_of(p, id) {
        Some((_, "Shard")) => {
            let d = field_of(p, id, "dim")
                .and_then(|d| int_of(p, d))
                .map(|d| if d < 0 { d + ndim } else { d })
                .filter(|&d| (0..ndim).contains(&d))
                .and_then(|d| usize::try_from(d).ok())
                .ok_or_else(|| {
                    Error::bad_tensor(path, name, "a Shard placement without a valid dim")
                })?;
            Ok(Placement::Shard(d))
        }
        Some((_, "Replicate")) => Ok(Placement::Replicate),
        Some((_, "_StridedShard")) => Err(unsupported(
            "a DTensor with a _StridedShard placement (interleaved shards, FSDP2 with tensor parallelism)".into(),
            "gather the tensor before saving (DTensor.full_tensor(), or get_model_state_dict with full_state_dict=True), or save with torch.distributed.checkpoint",
        )),
        Some((_, c)) if c.contains("Partial") => Err(unsupported(
            format!("a DTensor with a {c} placement (each rank holds a partial value that torch reduces on use)"),
            "the shards are not the tensor until they are summed; redistribute it to Replicate() or call full_tensor() before saving",
        )),
        Some((m, c)) => Err(unsupported(
            format!("a DTensor placement {m}.{c}"),
            "only Shard and Replicate placements can be merged",
        )),
        None => Err(Error::bad_tensor(path, name, "a DTensor placement is not an object")),
    }
}

/// The mesh's shape: from its `_layout` (torch >= 2.9) or its `mesh` tensor (older).
fn mesh_shape(p: &Pickle, mesh: NodeId) -> Option<Vec<u64>> {
    if let Some(layout) = field_of(p, mesh, "_layout") {
        let axes = field_of(p, layout, "axes")
            .and_then(|a| seq_of(p, a))
            .map(|axes| {
                axes.iter()
                    .map(|&ax| field_of(p, ax, "shape").and_then(|s| numel(p, s, 0)))
                    .collect::<Option<Vec<u64>>>()
            })
            .or_else(|| {
                // A flat layout: its top-level shape entries are the mesh sizes.
                let shape = field_of(p, layout, "shape")?;
                Some(
                    seq_of(p, shape)?
                        .iter()
                        .map(|&s| numel(p, s, 0))
                        .collect::<Option<Vec<u64>>>(),
                )
            })
            .flatten();
        if axes.is_some() {
            return axes;
        }
    }
    let t = field_of(p, mesh, "mesh")?;
    match torch::leaf(p, t) {
        Ok(Some(Leaf::Tensor(t))) => Some(t.shape),
        _ => None,
    }
}

/// The product of a possibly nested tuple of sizes.
fn numel(p: &Pickle, id: NodeId, depth: usize) -> Option<u64> {
    if depth > 8 {
        return None;
    }
    if let Some(i) = int_of(p, id) {
        return u64::try_from(i).ok();
    }
    seq_of(p, id)?
        .iter()
        .try_fold(1u64, |acc, &x| acc.checked_mul(numel(p, x, depth + 1)?))
}

/// ShardedTensors: each rank lists its local shards with their offsets (formats.md §1.6).
fn sharded_tensor(
    set: &RankSet,
    ranks: &[RankFile],
    name: &str,
    leaves: &[Leaf],
) -> Result<TensorSource> {
    let mut pieces: Vec<Piece> = Vec::new();
    let mut boxes: HashSet<(Vec<u64>, Vec<u64>)> = HashSet::new();
    let mut global: Option<&SubclassRef> = None;
    for (r, (rank, leaf)) in ranks.iter().zip(leaves).enumerate() {
        let p = &rank.payload.pickle;
        let bad = |m: String| Error::bad_tensor(&rank.path, name, m);
        let s = match leaf {
            Leaf::Subclass(s) if s.class == "ShardedTensor" => s,
            _ => {
                return Err(bad(
                    "not a ShardedTensor here, but a ShardedTensor in rank 0's file".into(),
                ))
            }
        };
        match global {
            None => global = Some(s),
            Some(g) if g.shape != s.shape || g.dtype != s.dtype => {
                return Err(bad(format!(
                    "global shape {:?} here but {:?} in rank 0's file",
                    s.shape, g.shape
                )))
            }
            Some(_) => {}
        }
        let parts = s
            .state
            .and_then(|st| seq_of(p, st))
            .ok_or_else(|| bad("the ShardedTensor has no state".into()))?;
        // Shards the metadata places on ranks whose file is absent.
        if let Some(meta) = parts.get(1) {
            check_ranks_present(set, ranks.len(), &shard_owners(p, *meta))?;
        }
        let locals = parts
            .first()
            .and_then(|&l| seq_of(p, l))
            .ok_or_else(|| bad("the ShardedTensor has no local shard list".into()))?;
        for &shard in locals {
            let t = match field_of(p, shard, "tensor").map(|t| torch::leaf(p, t)) {
                Some(Ok(Some(Leaf::Tensor(t)))) => t,
                Some(Err(m)) => return Err(bad(m)),
                _ => return Err(bad("a local shard without a tensor".into())),
            };
            let md = field_of(p, shard, "metadata");
            let offsets = md
                .and_then(|m| field_of(p, m, "shard_offsets"))
                .and_then(|o| dims_of(p, o));
            let sizes = md
                .and_then(|m| field_of(p, m, "shard_sizes"))
                .and_then(|o| dims_of(p, o));
            let (Some(offsets), Some(sizes)) = (offsets, sizes) else {
                return Err(bad("a local shard without offsets and sizes".into()));
            };
            if sizes != t.shape {
                return Err(bad(format!(
                    "a local shard is {:?} but its metadata says {sizes:?}",
                    t.shape
                )));
            }
            if sizes.contains(&0) || !boxes.insert((offsets.clone(), sizes)) {
                continue;
            }
            pieces.push(rank.payload.piece(r, name, &t, offsets)?);
        }
    }
    let g = global.ok_or_else(|| Error::bad_tensor(&set.dir, name, "no rank holds it"))?;
    let dtype = g
        .dtype
        .ok_or_else(|| Error::bad_tensor(&set.dir, name, "the ShardedTensor has no dtype"))?;
    if let Some(p) = pieces.iter().find(|p| p.dtype != dtype) {
        return Err(Error::bad_tensor(
            &set.dir,
            name,
            format!(
                "a shard is {} but the tensor is {}",
                p.dtype.safetensors_name(),
                dtype.safetensors_name()
            ),
        ));
    }
    Ok(TensorSource {
        name: name.to_string(),
        dtype,
        shape: g.shape.clone(),
        layout: Some(format!(
            "ShardedTensor: {} rank(s), {} shard(s)",
            ranks.len(),
            pieces.len()
        )),
        pieces,
        storage: None,
    })
}

/// The ranks `ShardedTensorMetadata.shards_metadata` places shards on.
fn shard_owners(p: &Pickle, meta: NodeId) -> Vec<u64> {
    field_of(p, meta, "shards_metadata")
        .and_then(|s| seq_of(p, s))
        .unwrap_or(&[])
        .iter()
        .filter_map(|&sm| {
            let placement = field_of(p, sm, "placement")?;
            let r = field_of(p, placement, "_rank")?;
            u64::try_from(int_of(p, r)?).ok()
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shard_boxes_follow_torch_chunk() {
        let s0 = [Placement::Shard(0)];
        // 251 rows over 2 ranks: 126 + 125.
        assert_eq!(
            shard_box(&[251, 64], &s0, &[2], &[0]).ok(),
            Some((vec![126, 64], vec![0, 0]))
        );
        assert_eq!(
            shard_box(&[251, 64], &s0, &[2], &[1]).ok(),
            Some((vec![125, 64], vec![126, 0]))
        );
        // 5 rows over 4 ranks: 2, 2, 1, 0 (an empty last shard at the end).
        let sizes: Vec<u64> = (0..4)
            .map(|k| {
                shard_box(&[5], &s0, &[4], &[k])
                    .map(|b| b.0[0])
                    .unwrap_or(99)
            })
            .collect();
        assert_eq!(sizes, [2, 2, 1, 0]);
        assert_eq!(
            shard_box(&[5], &s0, &[4], &[3]).ok(),
            Some((vec![0], vec![5]))
        );
        // HSDP: replicate over dim 0 of the mesh, shard over dim 1.
        let hsdp = [Placement::Replicate, Placement::Shard(0)];
        assert_eq!(
            shard_box(&[173, 8], &hsdp, &[2, 2], &[1, 1]).ok(),
            Some((vec![86, 8], vec![87, 0]))
        );
        // Two mesh dims sharding one tensor dim nest left to right.
        let ss = [Placement::Shard(0), Placement::Shard(0)];
        assert_eq!(
            shard_box(&[7], &ss, &[2, 2], &[1, 0]).ok(),
            Some((vec![2], vec![4]))
        );
        assert_eq!(
            shard_box(&[7], &ss, &[2, 2], &[1, 1]).ok(),
            Some((vec![1], vec![6]))
        );
        assert!(shard_box(&[7], &s0, &[2], &[2]).is_err());
    }
}
