//! The partition layouts: where each trained parameter's elements are in the
//! ranks' flat fp32 partitions (ZeRO-1/2 and `BF16_Optimizer`, ZeRO-3), and where
//! frozen parameters are in the model-states files.

use std::collections::HashMap;
use std::path::PathBuf;

use unshard_pickle::NodeId;

use super::files::{Flat, ModelStates, OptimStates, Parsed};
use super::runs;
use crate::error::{Error, Result};
use crate::source::{StorageId, TensorSource};

/// What the layouts need to know about the checkpoint.
pub(super) struct Ctx<'a> {
    pub dir: &'a std::path::Path,
    pub world: usize,
    pub stage_label: String,
}

/// One rank's optimizer-state file as the layouts need it: what it says and where
/// its flat partitions are. Its pickle (the Adam moments, the groups' settings) is
/// dropped once this is taken out, so that a folder of thousands of ranks is not
/// held in memory one parsed file per rank.
pub(super) struct RankOptim {
    pub path: PathBuf,
    pub states: OptimStates,
    /// The rank's flat fp32 partition of each group, in group order.
    pub flats: Vec<Flat>,
}

impl RankOptim {
    /// Takes the partitions out of a parsed optimizer-state file, `file` in the
    /// checkpoint's list.
    pub fn take(f: &Parsed, states: OptimStates, file: usize) -> Result<RankOptim> {
        let flats = states
            .groups
            .iter()
            .enumerate()
            .map(|(g, &id)| f.flat(&format!("{}[{g}]", states.groups_key), id, file))
            .collect::<Result<Vec<_>>>()?;
        Ok(RankOptim {
            path: f.path.clone(),
            states,
            flats,
        })
    }
}

/// A model-states file's frozen fragments, one per entry of `frozen_param_shapes`
/// in its order (its pickle dropped, as for [`RankOptim`]).
pub(super) struct FrozenFile {
    pub path: PathBuf,
    pub flats: Vec<Flat>,
}

impl FrozenFile {
    /// Finds each frozen parameter of `model` in a file's `frozen_param_fragments`.
    pub fn take(
        model: &ModelStates,
        f: &Parsed,
        fragments: &[(String, NodeId)],
        file: usize,
    ) -> Result<FrozenFile> {
        let by_name: HashMap<&str, NodeId> =
            fragments.iter().map(|(k, v)| (k.as_str(), *v)).collect();
        let flats = model
            .frozen_shapes
            .iter()
            .map(|(name, _)| {
                let Some(&id) = by_name.get(name.as_str()) else {
                    return Err(Error::corrupt(&f.path, format!(
                        "'frozen_param_shapes' lists '{name}' but 'frozen_param_fragments' does not hold it"
                    )));
                };
                f.flat(&format!("frozen_param_fragments.{name}"), id, file)
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(FrozenFile {
            path: f.path.clone(),
            flats,
        })
    }
}

/// The optim files' key for ZeRO-3's partitions.
pub(super) const ZERO3_KEY: &str = "fp32_flat_groups";

fn numel(shape: &[u64]) -> u64 {
    shape.iter().product()
}

fn new_tensor(
    name: &str,
    dtype: crate::dtype::DType,
    shape: &[u64],
    file: usize,
    layout: String,
) -> TensorSource {
    TensorSource {
        name: name.to_string(),
        dtype,
        shape: shape.to_vec(),
        pieces: Vec::new().into(),
        // Aliases (tied weights) share this id; nothing else does.
        storage: Some(StorageId {
            file,
            key: format!("deepspeed:{name}"),
        }),
        layout: Some(layout),
    }
}

/// ZeRO-1/2 and `BF16_Optimizer`: per group, the ranks' partitions concatenated
/// are the group's parameters one after the other.
pub(super) fn zero12_params(
    ctx: &Ctx,
    model: &ModelStates,
    optim: &[RankOptim],
    built: &mut HashMap<String, TensorSource>,
) -> Result<()> {
    let paddings = optim[0].states.alignment_paddings.as_ref();
    for (g, shapes) in model.param_shapes.iter().enumerate() {
        let flats: Vec<&Flat> = optim.iter().map(|o| &o.flats[g]).collect();
        // Partitions are equal in size, but ZeRO-1/2 saves each rank's without the
        // part of it that is padding (the padding that made the group divisible by
        // the world size): the last rank's is short, and with many ranks and a
        // small group (the norms) the ranks before it can hold padding only and be
        // saved empty. BF16_Optimizer keeps the padding. So the saved lengths are
        // full partitions, then at most one short one, then empty ones; each rank's
        // run starts where the previous one ended.
        let part = flats[0].numel;
        if let Some(r) = unpadded_misfit(flats.iter().map(|f| f.numel)) {
            return Err(Error::corrupt(&optim[r].path, format!(
                "its partition of group {g} holds {} elements, rank 0's holds {part}: partitions are equal in size, only padding is left out",
                flats[r].numel
            )));
        }
        let starts: Vec<u64> = (0..flats.len() as u64).map(|r| r * part).collect();
        let total: u64 = flats.iter().map(|f| f.numel).sum();
        let pads = paddings.and_then(|p| p.get(g));
        if let Some(p) = pads {
            if p.len() != shapes.len() {
                return Err(Error::corrupt(
                    &optim[0].path,
                    format!(
                    "'param_alignment_paddings' gives group {g} {} entries for its {} parameters",
                    p.len(),
                    shapes.len()
                ),
                ));
            }
        }
        let mut offset = 0u64;
        for (i, (name, shape)) in shapes.iter().enumerate() {
            let n = numel(shape);
            let end = offset.checked_add(n).filter(|&e| e <= total).ok_or_else(|| {
                Error::corrupt(ctx.dir, format!(
                    "group {g}: parameter '{name}' ends past the {total} elements the {} partitions hold",
                    ctx.world
                ))
            })?;
            let mut t = new_tensor(
                name,
                flats[0].piece.dtype,
                shape,
                flats[0].piece.file,
                format!(
                    "{} fp32 master, group {g}, {} rank(s)",
                    ctx.stage_label, ctx.world
                ),
            );
            for (&f, &start) in flats.iter().zip(&starts) {
                let (lo, hi) = (offset.max(start), end.min(start + f.numel));
                if lo < hi {
                    t.pieces.extend(runs::pieces(
                        shape,
                        lo - offset,
                        hi - offset,
                        &f.piece,
                        lo - start,
                    ));
                }
            }
            built.insert(name.clone(), t);
            offset = end.saturating_add(pads.map_or(0, |p| p[i]));
        }
        // What is left is the padding that makes the group divisible by the world
        // size (DeepSpeed aligns it to 2 x world size elements).
        let align = 2 * ctx.world as u64;
        if offset.div_ceil(align) != total.div_ceil(align) {
            return Err(Error::corrupt(ctx.dir, format!(
                "group {g}: 'param_shapes' accounts for {offset} of the {total} elements the partitions hold; \
                 the model-states and optimizer-state files do not belong together"
            )));
        }
    }
    Ok(())
}

/// The first rank whose saved ZeRO-1/2 partition length cannot be: partitions are
/// rank 0's length, then at most one shorter, then empty (padding only).
fn unpadded_misfit(lengths: impl IntoIterator<Item = u64>) -> Option<usize> {
    let mut lengths = lengths.into_iter().enumerate();
    let (_, part) = lengths.next()?;
    let mut short = false;
    for (r, n) in lengths {
        if n > part || (short && n > 0) {
            return Some(r);
        }
        short |= n < part;
    }
    None
}

/// ZeRO-3: every parameter cut into `world` equal shares (the last padded); a rank's
/// groups, concatenated, hold its shares in `param_shapes` order.
pub(super) fn zero3_params(
    ctx: &Ctx,
    model: &ModelStates,
    optim: &[RankOptim],
    built: &mut HashMap<String, TensorSource>,
) -> Result<()> {
    // Per rank: the flat groups and where each starts in the rank's concatenation.
    let mut ranks: Vec<Vec<(u64, &Flat)>> = Vec::with_capacity(ctx.world);
    for o in optim {
        let mut at = 0u64;
        let mut v = Vec::with_capacity(o.flats.len());
        for flat in &o.flats {
            v.push((at, flat));
            at += flat.numel;
        }
        ranks.push(v);
    }
    let total = |v: &Vec<(u64, &Flat)>| v.last().map_or(0, |(a, f)| a + f.numel);
    let per_rank = total(&ranks[0]);
    if let Some(r) = ranks.iter().position(|v| total(v) != per_rank) {
        return Err(Error::corrupt(
            &optim[r].path,
            format!(
            "holds {} fp32 elements, rank 0's file {per_rank}: ZeRO-3 partitions are equal in size",
            total(&ranks[r])
        ),
        ));
    }
    let w = ctx.world as u64;
    let mut offset = 0u64;
    for (name, shape) in model.param_shapes.iter().flatten() {
        let n = numel(shape);
        let share = n.div_ceil(w);
        if offset.saturating_add(share) > per_rank {
            return Err(Error::corrupt(
                ctx.dir,
                format!(
                "parameter '{name}' ends past the {per_rank} elements each rank's partitions hold"
            ),
            ));
        }
        let mut t = new_tensor(
            name,
            ranks[0][0].1.piece.dtype,
            shape,
            ranks[0][0].1.piece.file,
            format!("ZeRO-3 fp32 master, {} rank(s)", ctx.world),
        );
        for (r, groups) in ranks.iter().enumerate() {
            let (a, b) = (
                (r as u64).saturating_mul(share).min(n),
                (r as u64 + 1).saturating_mul(share).min(n),
            );
            // The run [a, b) sits at `offset` in this rank's concatenated groups; it
            // may cross from one group's tensor into the next.
            let mut done = a;
            while done < b {
                let at = offset + (done - a);
                let Some((start, flat)) = groups.iter().rev().find(|(s, _)| *s <= at) else {
                    break;
                };
                let upto = b.min(done + (start + flat.numel - at));
                if upto == done {
                    break;
                }
                t.pieces
                    .extend(runs::pieces(shape, done, upto, &flat.piece, at - start));
                done = upto;
            }
        }
        built.insert(name.clone(), t);
        offset += share;
    }
    if offset != per_rank {
        return Err(Error::corrupt(ctx.dir, format!(
            "'param_shapes' accounts for {offset} of the {per_rank} elements each rank's partitions hold; \
             the model-states and optimizer-state files do not belong together"
        )));
    }
    Ok(())
}

/// Frozen parameters recorded with `frozen_param_shapes`: whole tensors in the one
/// ZeRO-1/2 model-states file, or each rank's share (as for trained parameters)
/// in its ZeRO-3 model-states file (`frozen`: one per model-states file, in rank
/// order). Returns how many were read.
pub(super) fn frozen(
    ctx: &Ctx,
    model: &ModelStates,
    frozen: &[FrozenFile],
    zero3: bool,
    built: &mut HashMap<String, TensorSource>,
) -> Result<usize> {
    let mut count = 0;
    let w = ctx.world as u64;
    for (i, (name, shape)) in model.frozen_shapes.iter().enumerate() {
        let n = numel(shape);
        let share = if zero3 { n.div_ceil(w) } else { n };
        let mut t: Option<TensorSource> = None;
        for (r, f) in frozen.iter().enumerate() {
            let flat = &f.flats[i];
            let (a, b) = (
                (r as u64).saturating_mul(share).min(n),
                (r as u64 + 1).saturating_mul(share).min(n),
            );
            if flat.numel < b - a {
                return Err(Error::bad_tensor(
                    &f.path,
                    name,
                    format!(
                        "its frozen fragment holds {} elements, {} expected",
                        flat.numel,
                        b - a
                    ),
                ));
            }
            let t = t.get_or_insert_with(|| {
                new_tensor(
                    name,
                    flat.piece.dtype,
                    shape,
                    flat.piece.file,
                    if zero3 {
                        format!("frozen, ZeRO-3 shares of {} rank(s)", ctx.world)
                    } else {
                        "frozen".to_string()
                    },
                )
            });
            t.pieces.extend(runs::pieces(shape, a, b, &flat.piece, 0));
        }
        if let Some(t) = t {
            built.insert(name.clone(), t);
            count += 1;
        }
    }
    Ok(count)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::dtype::DType;
    use crate::source::Piece;

    /// ZeRO-1/2 ranks whose one group's saved partitions hold `lengths` elements.
    fn ranks(lengths: &[u64]) -> Vec<RankOptim> {
        lengths
            .iter()
            .enumerate()
            .map(|(r, &numel)| RankOptim {
                path: PathBuf::from(format!("rank{r}.pt")),
                states: OptimStates {
                    stage: Some(2),
                    partition_count: lengths.len() as u64,
                    groups: Vec::new(),
                    groups_key: "single_partition_of_fp32_groups",
                    alignment_paddings: None,
                    moments: 0,
                },
                flats: vec![Flat {
                    piece: Piece {
                        file: r,
                        byte_offset: 0,
                        dtype: DType::F32,
                        shape: vec![numel],
                        strides: vec![1],
                        global_offset: vec![0],
                        big_endian: false,
                    },
                    numel,
                }],
            })
            .collect()
    }

    fn zero12(shape: &[u64], lengths: &[u64]) -> Result<HashMap<String, TensorSource>> {
        let dir = PathBuf::from("tag");
        let ctx = Ctx {
            dir: &dir,
            world: lengths.len(),
            stage_label: "ZeRO-2".into(),
        };
        let model = ModelStates {
            module: Vec::new(),
            buffer_names: Vec::new(),
            param_shapes: vec![vec![("w".into(), shape.to_vec())]],
            frozen_shapes: Vec::new(),
            frozen_fragments: Vec::new(),
            shared: Vec::new(),
            version: None,
        };
        let mut built = HashMap::new();
        zero12_params(&ctx, &model, &ranks(lengths), &mut built)?;
        Ok(built)
    }

    /// DeepSpeed pads a group to a multiple of twice the world size: 5 elements
    /// over 3 ranks are 6, 2 a rank. More than that padding is a mismatch.
    #[test]
    fn a_group_is_padded_to_twice_the_world_size() {
        let built = zero12(&[5], &[2, 2, 2]).unwrap();
        let files: Vec<usize> = built["w"].pieces.iter().map(|p| p.file).collect();
        assert_eq!(files, [0, 1, 2]);
        let e = zero12(&[5], &[4, 4, 4]).err().unwrap().to_string();
        assert!(e.contains("do not belong together"), "{e}");
    }

    #[test]
    fn saved_partitions_are_full_then_one_short_then_empty() {
        assert_eq!(unpadded_misfit([6, 6, 6]), None);
        // DeepSpeed at 12 ranks, a group of 60 padded to 72: the last two empty.
        assert_eq!(unpadded_misfit([6; 10].into_iter().chain([0, 0])), None);
        assert_eq!(unpadded_misfit([6, 6, 3, 0, 0]), None);
        assert_eq!(unpadded_misfit([6, 3]), None);
        assert_eq!(unpadded_misfit([3]), None);
        // Data after a short or empty partition, or a partition longer than rank 0's.
        assert_eq!(unpadded_misfit([6, 3, 6]), Some(2));
        assert_eq!(unpadded_misfit([6, 0, 3]), Some(2));
        assert_eq!(unpadded_misfit([6, 3, 1]), Some(2));
        assert_eq!(unpadded_misfit([6, 7]), Some(1));
    }
}
