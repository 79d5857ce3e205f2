//! Where each parameter's elements are: the ZeRO-1/2 and ZeRO-3 partition layouts,
//! frozen parameters, buffers and tied aliases, checked and turned into tensors.

use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::sync::Arc;

use super::files::{self, Flat, ModelStates, OptimStates, Parsed};
use super::{names, runs, Found};
use crate::source::{check_coverage, Checkpoint, Extra, Format, StorageId, TensorSource};
use crate::{Error, Result};

/// The optim files' key for ZeRO-3's partitions.
const ZERO3_KEY: &str = "fp32_flat_groups";

struct Ctx<'a> {
    dir: &'a Path,
    world: usize,
    stage_label: String,
}

pub fn open(found: &Found) -> Result<Checkpoint> {
    let dir = found.tag_dir.as_path();
    let n = names(dir)?;
    if !n.model_parallel.is_empty() {
        return Err(Error::Unsupported {
            path: dir.to_path_buf(),
            what: format!(
                "a DeepSpeed checkpoint with tensor or pipeline parallelism ({})",
                crate::report::list_some(&n.model_parallel, 3)
            ),
            hint: Some("only data-parallel ZeRO checkpoints (mp_rank_00 files) are read".into()),
        });
    }
    let zero3_layout = !n.model_ranks.is_empty();
    if n.optim.is_empty() {
        let what = if zero3_layout {
            "ZeRO-3's weights live only there: its model-states files hold [0]-shaped placeholders"
        } else {
            "the fp32 master weights live there"
        };
        return Err(Error::Incomplete {
            path: dir.to_path_buf(),
            msg: format!("no optimizer-state files (*_optim_states.pt): {what}"),
            hint: Some(format!(
                "copy every rank's zero_pp_rank_R_mp_rank_00_optim_states.pt into {}{}",
                dir.display(),
                if zero3_layout {
                    ""
                } else {
                    ", or pass mp_rank_00_model_states.pt itself to merge its 16-bit copy of the weights"
                }
            )),
        });
    }

    // Optimizer states of every rank: the world size, checked against every file.
    let mut files: Vec<Arc<crate::source::Blob>> = Vec::new();
    let mut optim: Vec<(Parsed, OptimStates)> = Vec::new();
    for (_, name) in &n.optim {
        let f = Parsed::open(&dir.join(name))?;
        let o = files::optim_states(&f)?;
        optim.push((f, o));
    }
    let world = optim[0].1.partition_count;
    let world = usize::try_from(world)
        .ok()
        .filter(|&w| w <= MAX_WORLD)
        .ok_or_else(|| {
            Error::corrupt(
                &optim[0].0.path,
                format!("partition_count {world} is not believable"),
            )
        })?;
    let prefix = |name: &str| name.starts_with("bf16_");
    for ((r, name), (f, o)) in n.optim.iter().zip(&optim) {
        if o.partition_count as usize != world
            || *r >= world
            || prefix(name) != prefix(&n.optim[0].1)
        {
            return Err(mixed(
                dir,
                &format!(
                    "this file says world size {} (partition_count), {} says {world}",
                    o.partition_count, n.optim[0].1
                ),
                f,
            ));
        }
        if o.groups.len() != optim[0].1.groups.len()
            || o.groups_key != optim[0].1.groups_key
            || o.stage != optim[0].1.stage
        {
            return Err(mixed(
                dir,
                &format!(
                    "its ZeRO stage or parameter groups differ from {}'s",
                    n.optim[0].1
                ),
                f,
            ));
        }
    }
    for r in 0..world {
        if n.optim.get(r).map(|(x, _)| *x) != Some(r) {
            let stem = if prefix(&n.optim[0].1) { "bf16_" } else { "" };
            return Err(Error::Incomplete {
                path: dir.join(format!("{stem}zero_pp_rank_{r}_mp_rank_00_optim_states.pt")),
                msg: format!("rank {r}'s optimizer-state file is missing (world size {world}); it holds that rank's share of the fp32 weights"),
                hint: Some(format!("copy all {world} *_optim_states.pt files of the tag folder into {}", dir.display())),
            });
        }
    }
    let zero3 = optim[0].1.groups_key == ZERO3_KEY;
    let stage = optim[0].1.stage;
    if zero3 != zero3_layout {
        return Err(Error::corrupt(
            dir,
            format!(
            "the optimizer-state files hold {} but the model-states files are named for ZeRO-{}",
            optim[0].1.groups_key,
            if zero3_layout { "3" } else { "1/2" }
        ),
        ));
    }
    for (f, _) in &optim {
        files.push(f.blob.clone());
    }

    // Model states: rank 0's (ZeRO-1/2's only one) describes the layout.
    let mut model_files: Vec<Parsed> = Vec::new();
    if zero3 {
        for r in 0..world {
            match n.model_ranks.get(r) {
                Some((x, name)) if *x == r => model_files.push(Parsed::open(&dir.join(name))?),
                _ => {
                    return Err(Error::Incomplete {
                        path: dir.join(format!("zero_pp_rank_{r}_mp_rank_00_model_states.pt")),
                        msg: format!(
                            "rank {r}'s model-states file is missing (world size {world})"
                        ),
                        hint: Some(format!(
                            "copy all {world} *_model_states.pt files of the tag folder into {}",
                            dir.display()
                        )),
                    })
                }
            }
        }
        if let Some((r, name)) = n.model_ranks.iter().find(|(r, _)| *r >= world) {
            return Err(Error::Incomplete {
                path: dir.join(name),
                msg: format!("a model-states file of rank {r}, but the optimizer-state files give world size {world}: files of two runs are mixed"),
                hint: Some("keep only the files of one save_checkpoint in the tag folder".into()),
            });
        }
    } else if let Some(name) = &n.model {
        model_files.push(Parsed::open(&dir.join(name))?);
    }
    let model = files::model_states(&model_files[0])?;
    let first_model_file = files.len();
    for f in &model_files {
        files.push(f.blob.clone());
    }

    let stage_label = match (stage, zero3) {
        (_, true) => "ZeRO-3".to_string(),
        (Some(s), false) => format!("ZeRO-{s}"),
        (None, false) => "BF16_Optimizer (ZeRO-1 layout)".to_string(),
    };
    let ctx = Ctx {
        dir,
        world,
        stage_label: stage_label.clone(),
    };
    let mut built: HashMap<String, TensorSource> = HashMap::new();
    if model.param_shapes.len() != optim[0].1.groups.len() {
        return Err(Error::corrupt(
            &model_files[0].path,
            format!(
                "'param_shapes' lists {} parameter group(s), the optimizer-state files hold {}",
                model.param_shapes.len(),
                optim[0].1.groups.len()
            ),
        ));
    }
    if zero3 {
        zero3_params(&ctx, &model, &optim, &mut built)?;
    } else {
        zero12_params(&ctx, &model, &optim, &mut built)?;
    }
    let frozen_from_fragments = frozen(
        &ctx,
        &model,
        &model_files,
        first_model_file,
        zero3,
        &mut built,
    )?;

    // Buffers, and (ZeRO-1) frozen parameters kept only in the module.
    let aliases: HashSet<&str> = model.shared.iter().map(|(a, _)| a.as_str()).collect();
    let buffers: HashSet<&str> = model.buffer_names.iter().map(String::as_str).collect();
    let mut from_module = Vec::new();
    let m0 = &model_files[0];
    for (name, id) in &model.module {
        if built.contains_key(name) || aliases.contains(name.as_str()) {
            continue;
        }
        let t = m0.tensor(name, *id)?;
        if t.shape.contains(&0) && zero3 {
            return Err(Error::corrupt(&m0.path, format!(
                "'{name}' is a [0]-shaped ZeRO-3 placeholder in the module, but neither 'param_shapes' nor 'frozen_param_shapes' lists it"
            )));
        }
        let mut s = m0.payload.source(first_model_file, name, &t)?;
        s.layout = Some(if buffers.contains(name.as_str()) {
            "buffer (from the module)".to_string()
        } else {
            from_module.push(name.clone());
            "frozen, 16-bit module copy".to_string()
        });
        built.insert(name.clone(), s);
    }
    // Tied aliases: the same pieces and storage, so the plan writes one copy.
    for (alias, target) in &model.shared {
        if let Some(t) = built.get(target) {
            let mut a = t.clone();
            a.name = alias.clone();
            a.layout = Some(format!("tied to {target}"));
            built.insert(alias.clone(), a);
        }
    }

    // Model order first, then anything the module does not list.
    let mut tensors = Vec::with_capacity(built.len());
    let mut order: Vec<&str> = model.module.iter().map(|(n, _)| n.as_str()).collect();
    order.extend(model.param_shapes.iter().flatten().map(|(n, _)| n.as_str()));
    order.extend(model.frozen_shapes.iter().map(|(n, _)| n.as_str()));
    order.extend(model.shared.iter().map(|(a, _)| a.as_str()));
    for name in order {
        if let Some(t) = built.remove(name) {
            check_coverage(dir, &t)?;
            tensors.push(t);
        }
    }

    let mut notes = vec![format!(
        "DeepSpeed {stage_label} checkpoint, {world} rank(s), {}: {}",
        found.how,
        dir.display()
    )];
    notes.push(format!(
        "rebuilt {} parameter(s) from the fp32 master partitions ({}) in {} optimizer-state file(s)",
        model.param_shapes.iter().map(Vec::len).sum::<usize>(),
        optim[0].1.groups_key,
        world
    ));
    if frozen_from_fragments > 0 {
        notes.push(format!("{frozen_from_fragments} frozen parameter(s) from frozen_param_fragments (16-bit, as trained)"));
    }
    if !from_module.is_empty() {
        notes.push(format!(
            "frozen parameter(s) recorded only in the 16-bit module, read from there: {}",
            crate::report::list_some(&from_module, 4)
        ));
    }
    if !zero3 {
        notes.push("skipped the module's 16-bit copy of the trained parameters (the fp32 masters are the weights)".into());
    }
    let moments: usize = optim.iter().map(|(_, o)| o.moments).sum();
    if moments > 0 {
        notes.push(format!(
            "skipped the optimizer's state (Adam's exp_avg, exp_avg_sq...): {moments} tensor(s) over {world} file(s), not read"
        ));
    }
    let mut skipped = n.other.clone();
    if found.path != found.tag_dir {
        if let Ok(rd) = std::fs::read_dir(&found.path) {
            let tag_name = found.tag_dir.file_name();
            let mut more: Vec<String> = rd
                .filter_map(|e| e.ok())
                .filter(|e| Some(e.file_name().as_os_str()) != tag_name)
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect();
            more.sort();
            skipped.extend(more);
        }
    }
    if !skipped.is_empty() {
        notes.push(format!(
            "skipped (not weights): {}",
            crate::report::list_some(&skipped, 10)
        ));
    }
    let mut extras = Vec::new();
    if let Some(v) = &model.version {
        extras.push(Extra {
            name: "ds_version".into(),
            kind: format!("str '{v}'"),
        });
    }
    Ok(Checkpoint {
        format: Format::DeepSpeed,
        path: found.path.clone(),
        files,
        key: None,
        tensors,
        extras,
        notes,
    })
}

/// The largest world size believed.
const MAX_WORLD: usize = 1 << 20;

fn mixed(dir: &Path, what: &str, f: &Parsed) -> Error {
    Error::Incomplete {
        path: f.path.clone(),
        msg: format!("{what}: files of different runs (or world sizes) are mixed"),
        hint: Some(format!(
            "keep only the files of one save_checkpoint in {} (every rank's file of the same world size)",
            dir.display()
        )),
    }
}

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
        pieces: Vec::new(),
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
fn zero12_params(
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
            offset = end + pads.map_or(0, |p| p[i]);
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
fn zero3_params(
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
        if offset + share > per_rank {
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
            let (a, b) = ((r as u64 * share).min(n), ((r as u64 + 1) * share).min(n));
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
fn frozen(
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
            let (a, b) = ((r as u64 * share).min(n), ((r as u64 + 1) * share).min(n));
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
