//! DTensors (FSDP2, verl): each rank's local tensor placed where torch's
//! `compute_local_shape_and_global_offset` puts it, from the placements over the
//! device mesh and the rank's mesh coordinate.

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use unshard_pickle::{NodeId, Pickle, Value};

use super::super::torch::{self, class_of, field_of, int_of, seq_of, Leaf, SubclassRef, TensorRef};
use super::super::{Piece, TensorSource};
use super::{check_ranks_present, Held, Local, RankFile, RankSet};
use crate::dtype::DType;
use crate::error::{Error, Result};

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
    /// Global ranks of the mesh, when recorded: read only when needed (rank 0's
    /// highest, or a rank's coordinate when it is not recorded), as the mesh of a
    /// job of N ranks lists N of them in every DTensor of every rank's file.
    mesh_ranks: Option<NodeId>,
    /// The saving process's global rank, when recorded.
    rank: Option<u64>,
    local: TensorRef,
}

/// What rank 0's file says of a DTensor; the other ranks' must agree.
pub(super) struct DtHead {
    dtype: Option<DType>,
    shape: Vec<u64>,
    placements: Vec<Placement>,
    mesh_shape: Option<Vec<u64>>,
    /// The highest global rank rank 0's mesh names.
    mesh_max_rank: Option<u64>,
}

/// Rank 0's DTensor: the head every rank is checked against, and its local tensor.
pub(super) fn first(
    rank: &RankFile<'_>,
    name: &str,
    s: &SubclassRef,
    coords: &mut Vec<Vec<u64>>,
) -> Result<(DtHead, Held)> {
    let p = &rank.payload.pickle;
    let local = dtensor_local(p, s, rank.path, name)?;
    let head = DtHead {
        dtype: s.dtype,
        shape: s.shape.clone(),
        placements: local.placements.clone(),
        mesh_shape: local.mesh_shape.clone(),
        mesh_max_rank: mesh_ranks(p, local.mesh_ranks).iter().max().copied(),
    };
    let held = held(rank, name, &head, local, coords)?;
    Ok((head, held))
}

/// A later rank's DTensor, checked against rank 0's.
pub(super) fn rank(
    rank: &RankFile<'_>,
    name: &str,
    leaf: &Leaf,
    head: &DtHead,
    coords: &mut Vec<Vec<u64>>,
) -> Result<Held> {
    let s = match leaf {
        Leaf::Subclass(s) if s.class == "DTensor" => s,
        _ => {
            return Err(Error::bad_tensor(
                rank.path,
                name,
                "not a DTensor here, but a DTensor in rank 0's file",
            ))
        }
    };
    if head.shape != s.shape || head.dtype != s.dtype {
        return Err(Error::bad_tensor(
            rank.path,
            name,
            format!(
                "global {:?} {:?} here but {:?} {:?} in rank 0's file",
                s.dtype, s.shape, head.dtype, head.shape
            ),
        ));
    }
    let local = dtensor_local(&rank.payload.pickle, s, rank.path, name)?;
    held(rank, name, head, local, coords)
}

/// A rank's record of a DTensor: its local tensor and its mesh coordinate, after
/// checking its placements against rank 0's.
fn held(
    rank: &RankFile<'_>,
    name: &str,
    head: &DtHead,
    local: DtLocal,
    coords: &mut Vec<Vec<u64>>,
) -> Result<Held> {
    let bad = |m: String| Error::bad_tensor(rank.path, name, m);
    let placements = &head.placements;
    if local.placements != *placements {
        return Err(bad(format!(
            "placements {} here but {} in rank 0's file",
            placements_text(&local.placements),
            placements_text(placements)
        )));
    }
    let coord = match &local.coord {
        Some(c) => c.clone(),
        None => derive_coord(&rank.payload.pickle, &local, rank.rank as u64).ok_or_else(|| {
            bad("the DTensor's mesh does not record this rank's coordinate".into())
        })?,
    };
    if coord.len() != placements.len() {
        return Err(bad(format!(
            "mesh coordinate {coord:?} does not match {} placement(s)",
            placements.len()
        )));
    }
    let at = match coords.iter().position(|c| *c == coord) {
        Some(i) => i,
        None => {
            coords.push(coord);
            coords.len() - 1
        }
    };
    let at = u32::try_from(at).map_err(|_| bad("too many mesh coordinates".into()))?;
    Ok(Held::DTensor {
        local: Local::new(rank.payload, rank.rank, name, &local.local, Vec::new()),
        coord: at,
    })
}

/// The global DTensor from every rank's record: each local tensor placed at its box.
pub(super) fn build(
    set: &RankSet,
    paths: &[PathBuf],
    name: &str,
    head: &DtHead,
    held: Vec<Held>,
    coords: &[Vec<Vec<u64>>],
) -> Result<TensorSource> {
    let path0 = paths.first().map(PathBuf::as_path).unwrap_or(&set.dir);
    let dtype = head
        .dtype
        .ok_or_else(|| Error::bad_tensor(path0, name, "the DTensor has no dtype"))?;
    let shape = head.shape.clone();
    let placements = &head.placements;
    let ndim_mesh = placements.len();

    // Every rank the mesh names must have its file.
    let n = held.len();
    check_ranks_present(set, n, head.mesh_max_rank.as_slice())?;

    // Each rank's mesh coordinate, then the mesh shape (recorded, else the largest
    // coordinate).
    let mut locals = Vec::with_capacity(n);
    for (r, h) in held.into_iter().enumerate() {
        let Held::DTensor { local, coord } = h else {
            return Err(Error::bad_tensor(
                &paths[r],
                name,
                "not a DTensor here, but a DTensor in rank 0's file",
            ));
        };
        let coord = coords
            .get(r)
            .and_then(|c| c.get(coord as usize))
            .ok_or_else(|| Error::bad_tensor(&paths[r], name, "no mesh coordinate"))?;
        locals.push((local, coord));
    }
    let mesh_shape = match &head.mesh_shape {
        Some(m) if m.len() == ndim_mesh => m.clone(),
        _ => (0..ndim_mesh)
            .map(|i| {
                locals
                    .iter()
                    .filter_map(|(_, c)| c.get(i)?.checked_add(1))
                    .max()
                    .unwrap_or(1)
            })
            .collect(),
    };

    let mut pieces: Vec<Piece> = Vec::new();
    let mut boxes: HashSet<(Vec<u64>, Vec<u64>)> = HashSet::new();
    for (r, (mut local, coord)) in locals.into_iter().enumerate() {
        let path = &paths[r];
        let (box_shape, offset) = shard_box(&shape, placements, &mesh_shape, coord)
            .map_err(|m| Error::bad_tensor(path, name, m))?;
        if local.shape() != box_shape {
            return Err(Error::bad_tensor(
                path,
                name,
                format!(
                    "the local tensor is {:?} but placements {} on mesh {:?} at coordinate {coord:?} give {box_shape:?}",
                    local.shape(),
                    placements_text(placements),
                    mesh_shape
                ),
            ));
        }
        if local.dtype() != dtype {
            return Err(Error::bad_tensor(
                path,
                name,
                format!(
                    "the local tensor is {} but the DTensor is {}",
                    local.dtype().safetensors_name(),
                    dtype.safetensors_name()
                ),
            ));
        }
        // Replicas hold the same box: keep the lowest rank's. Empty shards hold nothing.
        if box_shape.contains(&0) || !boxes.insert((offset.clone(), box_shape)) {
            continue;
        }
        local.set_global_offset(offset);
        pieces.push(local.piece()?);
    }
    let layout = format!(
        "DTensor {} on mesh {:?}: {n} rank(s), {} chunk(s)",
        placements_text(placements),
        mesh_shape,
        pieces.len()
    );
    Ok(TensorSource {
        name: name.to_string(),
        dtype,
        shape,
        pieces: pieces.into(),
        storage: None,
        layout: Some(layout),
    })
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
fn derive_coord(p: &Pickle, local: &DtLocal, file_rank: u64) -> Option<Vec<u64>> {
    let rank = local.rank.unwrap_or(file_rank);
    let mesh_ranks = mesh_ranks(p, local.mesh_ranks);
    if local.placements.len() == 1 && mesh_ranks.is_empty() {
        return Some(vec![rank]);
    }
    let mesh = local.mesh_shape.as_ref()?;
    let mut pos = mesh_ranks.iter().position(|&r| r == rank)? as u64;
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

/// Reads a DTensor's spec and local tensor (see docs/formats.md).
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
    let coord = ints(p, field_of(p, mesh, "_coordinate_on_dim"));
    let mesh_ranks = field_of(p, mesh, "_flatten_rank_map");
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

/// A sequence of non-negative integers.
fn ints(p: &Pickle, id: Option<NodeId>) -> Option<Vec<u64>> {
    seq_of(p, id?)?
        .iter()
        .map(|&x| int_of(p, x).and_then(|i| u64::try_from(i).ok()))
        .collect()
}

/// The mesh's global ranks (`_flatten_rank_map`), empty when not recorded or not
/// a sequence of ranks.
fn mesh_ranks(p: &Pickle, id: Option<NodeId>) -> Vec<u64> {
    ints(p, id).unwrap_or_default()
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
