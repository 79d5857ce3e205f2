//! The partition layouts: where each trained parameter's elements are in the
//! ranks' flat fp32 partitions (ZeRO-1/2 and `BF16_Optimizer`, ZeRO-3), and where
//! frozen parameters are in the model-states files.

use std::collections::HashMap;

use super::files::{self, Flat, ModelStates, OptimStates, Parsed};
use super::runs;
use crate::source::{StorageId, TensorSource};
use crate::{Error, Result};

/// What the layouts need to know about the checkpoint.
pub(super) struct Ctx<'a> {
    pub dir: &'a std::path::Path,
    pub world: usize,
    pub stage_label: String,
}

/// The optim files' key for ZeRO-3's partitions.
pub(super) const ZERO3_KEY: &str = "fp32_flat_groups";

fn numel(shape: &[u64]) -> u64 {
    shape.iter().product()
}

fn new_tensor(
    name: &str,
    dtype: crate::DType,
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
    optim: &[(Parsed, OptimStates)],
    built: &mut HashMap<String, TensorSource>,
) -> Result<()> {
    let paddings = optim[0].1.alignment_paddings.as_ref();
    for (g, shapes) in model.param_shapes.iter().enumerate() {
        let flats: Vec<Flat> = optim
            .iter()
            .enumerate()
            .map(|(r, (f, o))| f.flat(&format!("{}[{g}]", o.groups_key), o.groups[g], r))
            .collect::<Result<_>>()?;
        // Partitions are equal in size, but ZeRO-1/2 saves the last rank's without
        // the padding that made the group divisible by the world size (it can be
        // shorter); BF16_Optimizer keeps it. Each rank's run starts where the
        // previous one ended.
        let part = flats[0].numel;
        let last = flats.len() - 1;
        if let Some((r, f)) = flats
            .iter()
            .enumerate()
            .find(|(r, f)| f.numel != part && !(*r == last && f.numel < part))
        {
            return Err(Error::corrupt(&optim[r].0.path, format!(
                "its partition of group {g} holds {} elements, rank 0's holds {part}: partitions are equal in size",
                f.numel
            )));
        }
        let starts: Vec<u64> = (0..flats.len() as u64).map(|r| r * part).collect();
        let total = part * last as u64 + flats[last].numel;
        let pads = paddings.and_then(|p| p.get(g));
        if let Some(p) = pads {
            if p.len() != shapes.len() {
                return Err(Error::corrupt(
                    &optim[0].0.path,
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
            for (f, &start) in flats.iter().zip(&starts) {
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

/// ZeRO-3: every parameter cut into `world` equal shares (the last padded); a rank's
/// groups, concatenated, hold its shares in `param_shapes` order.
pub(super) fn zero3_params(
    ctx: &Ctx,
    model: &ModelStates,
    optim: &[(Parsed, OptimStates)],
    built: &mut HashMap<String, TensorSource>,
) -> Result<()> {
    // Per rank: the flat groups and where each starts in the rank's concatenation.
    let mut ranks: Vec<Vec<(u64, Flat)>> = Vec::with_capacity(ctx.world);
    for (r, (f, o)) in optim.iter().enumerate() {
        let mut at = 0u64;
        let mut v = Vec::new();
        for (g, &id) in o.groups.iter().enumerate() {
            let flat = f.flat(&format!("{ZERO3_KEY}[{g}]"), id, r)?;
            let n = flat.numel;
            v.push((at, flat));
            at += n;
        }
        ranks.push(v);
    }
    let total = |v: &Vec<(u64, Flat)>| v.last().map_or(0, |(a, f)| a + f.numel);
    let per_rank = total(&ranks[0]);
    if let Some(r) = ranks.iter().position(|v| total(v) != per_rank) {
        return Err(Error::corrupt(
            &optim[r].0.path,
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
/// in its ZeRO-3 model-states file. Returns how many were read.
pub(super) fn frozen(
    ctx: &Ctx,
    model: &ModelStates,
    model_files: &[Parsed],
    first_file: usize,
    zero3: bool,
    built: &mut HashMap<String, TensorSource>,
) -> Result<usize> {
    let mut count = 0;
    let w = ctx.world as u64;
    for (name, shape) in &model.frozen_shapes {
        let n = numel(shape);
        let share = if zero3 { n.div_ceil(w) } else { n };
        let mut t: Option<TensorSource> = None;
        for (r, f) in model_files.iter().enumerate() {
            let frags = if r == 0 {
                model.frozen_fragments.clone()
            } else {
                files::model_states(f)?.frozen_fragments
            };
            let Some((_, id)) = frags.iter().find(|(k, _)| k == name) else {
                return Err(Error::corrupt(&f.path, format!(
                    "'frozen_param_shapes' lists '{name}' but 'frozen_param_fragments' does not hold it"
                )));
            };
            let flat = f.flat(
                &format!("frozen_param_fragments.{name}"),
                *id,
                first_file + r,
            )?;
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
