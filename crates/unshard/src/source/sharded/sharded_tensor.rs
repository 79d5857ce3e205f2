//! ShardedTensors (FSDP1 `SHARDED_STATE_DICT` saved per rank): each rank lists its
//! local shards with their offsets and sizes; the metadata says which rank holds
//! which shard.

use std::collections::HashSet;

use unshard_pickle::{NodeId, Pickle};

use super::super::torch::{self, dims_of, field_of, int_of, seq_of, Leaf};
use super::super::{Piece, TensorSource};
use super::{check_ranks_present, Held, Local, RankFile, RankSet};
use crate::dtype::DType;
use crate::error::{Error, Result};

/// What rank 0's file says of a ShardedTensor: its global dtype and shape.
pub(super) struct StHead {
    pub(super) dtype: Option<DType>,
    pub(super) shape: Vec<u64>,
}

/// One rank's local shards of a ShardedTensor, placed at their offsets.
pub(super) fn rank(
    set: &RankSet,
    n: usize,
    rank: &RankFile<'_>,
    name: &str,
    leaf: &Leaf,
    head: &StHead,
) -> Result<Held> {
    let p = &rank.payload.pickle;
    let bad = |m: String| Error::bad_tensor(rank.path, name, m);
    let s = match leaf {
        Leaf::Subclass(s) if s.class == "ShardedTensor" => s,
        _ => {
            return Err(bad(
                "not a ShardedTensor here, but a ShardedTensor in rank 0's file".into(),
            ))
        }
    };
    if head.shape != s.shape || head.dtype != s.dtype {
        return Err(bad(format!(
            "global shape {:?} here but {:?} in rank 0's file",
            s.shape, head.shape
        )));
    }
    let parts = s
        .state
        .and_then(|st| seq_of(p, st))
        .ok_or_else(|| bad("the ShardedTensor has no state".into()))?;
    // Shards the metadata places on ranks whose file is absent.
    if let Some(meta) = parts.get(1) {
        check_ranks_present(set, n, &shard_owners(p, *meta))?;
    }
    let locals = parts
        .first()
        .and_then(|&l| seq_of(p, l))
        .ok_or_else(|| bad("the ShardedTensor has no local shard list".into()))?;
    let mut out = Vec::with_capacity(locals.len());
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
        out.push(Local::new(rank.payload, rank.rank, name, &t, offsets));
    }
    Ok(Held::Sharded(out))
}

/// The global ShardedTensor from every rank's local shards.
pub(super) fn build(
    set: &RankSet,
    n: usize,
    name: &str,
    head: &StHead,
    held: Vec<Held>,
) -> Result<TensorSource> {
    let mut pieces: Vec<Piece> = Vec::new();
    let mut boxes: HashSet<(Vec<u64>, Vec<u64>)> = HashSet::new();
    for h in held {
        let Held::Sharded(locals) = h else {
            return Err(Error::bad_tensor(
                &set.dir,
                name,
                "not a ShardedTensor in every rank's file",
            ));
        };
        for local in locals {
            if local.shape().contains(&0)
                || !boxes.insert((local.global_offset().to_vec(), local.shape().to_vec()))
            {
                continue;
            }
            pieces.push(local.piece()?);
        }
    }
    let dtype = head
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
        shape: head.shape.clone(),
        layout: Some(format!(
            "ShardedTensor: {n} rank(s), {} shard(s)",
            pieces.len()
        )),
        pieces: pieces.into(),
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
