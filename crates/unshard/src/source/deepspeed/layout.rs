//! Where each parameter's elements are: the ZeRO-1/2 and ZeRO-3 partition layouts,
//! frozen parameters, buffers and tied aliases, checked and turned into tensors.

use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::sync::Arc;

use super::super::torch::TemplateReader;
use super::files::{self, Parsed};
use super::partitions::{
    frozen, zero12_params, zero3_params, Ctx, FrozenFile, RankOptim, ZERO3_KEY,
};
use super::{names, Found};
use crate::bytes::{open_file_budget, FilePool};
use crate::error::{Error, Result};
use crate::source::{check_coverage, Checkpoint, Extra, Format, TensorSource};

pub fn open(found: &Found) -> Result<Checkpoint> {
    open_with(found, open_file_budget()).map(|(c, _, _)| c)
}

/// [`open`] keeping at most `max_open` files open at once when the tag folder
/// holds more; returns the pool of descriptors, if one was needed, and how many
/// files were read from the first rank's template instead of parsed (for tests).
pub(super) fn open_with(
    found: &Found,
    max_open: usize,
) -> Result<(Checkpoint, Option<Arc<FilePool>>, u64)> {
    let dir = found.tag_dir.as_path();
    let n = names(dir)?;
    if !n.model_parallel.is_empty() {
        return Err(Error::Unsupported {
            path: dir.to_path_buf(),
            what: format!(
                "a DeepSpeed checkpoint with tensor or pipeline parallelism ({})",
                crate::text::list_some(&n.model_parallel, 3)
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

    // Rank files beyond what the limit on open files leaves room for are opened on
    // demand (frontier runs save thousands of ranks, two files each under ZeRO-3).
    let count = n.optim.len() + if zero3_layout { n.model_ranks.len() } else { 1 };
    let pool = (count > max_open).then(|| FilePool::new(max_open));

    // Optimizer states of every rank, read one at a time: the world size, checked
    // against every file, and each rank's flat partitions. Each pickle is dropped
    // once its partitions are taken out.
    let mut files: Vec<Arc<crate::source::Blob>> = Vec::with_capacity(count);
    // What every file's pickle would run under torch.load, in file order.
    let mut unsafe_calls = Vec::new();
    let mut optim: Vec<RankOptim> = Vec::with_capacity(n.optim.len());
    let prefix = |name: &str| name.starts_with("bf16_");
    let mut world = 0usize;
    // Rank 0's pickle is the template the other ranks' files are read from where
    // only integers and strings differ (see `unshard_pickle::Template`).
    let Some((_, name0)) = n.optim.first() else {
        return Err(Error::corrupt(dir, "no optimizer-state file"));
    };
    let (f0, template) = Parsed::open_as_template(&dir.join(name0), pool.as_ref())?;
    let mut reader = template
        .as_ref()
        .map(|t| TemplateReader::new(t, f0.payload.pickle.clone()));
    let mut first = Some(f0);
    for (i, (r, name)) in n.optim.iter().enumerate() {
        let f = match first.take() {
            Some(f) => f,
            None => Parsed::open_from(&dir.join(name), pool.as_ref(), reader.as_mut())?,
        };
        let mut o = files::optim_states(&f)?;
        if i == 0 {
            world = usize::try_from(o.partition_count)
                .ok()
                .filter(|&w| w <= MAX_WORLD)
                .ok_or_else(|| {
                    Error::corrupt(
                        &f.path,
                        format!("partition_count {} is not believable", o.partition_count),
                    )
                })?;
        } else {
            let first = &optim[0].states;
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
                    &f,
                ));
            }
            if o.groups.len() != first.groups.len()
                || o.groups_key != first.groups_key
                || o.stage != first.stage
            {
                return Err(mixed(
                    dir,
                    &format!(
                        "its ZeRO stage or parameter groups differ from {}'s",
                        n.optim[0].1
                    ),
                    &f,
                ));
            }
            // Only rank 0's alignment paddings are read (one entry per parameter:
            // not kept for every rank).
            o.alignment_paddings = None;
        }
        let rank = RankOptim::take(&f, o, files.len())?;
        files.push(f.blob.clone());
        unsafe_calls.extend(f.payload.unsafe_calls.iter().cloned());
        optim.push(rank);
        if let Some(reader) = reader.as_mut() {
            reader.done(f.payload);
        }
    }
    let mut hits = reader.map_or(0, |r| r.hits);
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
    let groups_key = optim[0].states.groups_key;
    let zero3 = groups_key == ZERO3_KEY;
    let stage = optim[0].states.stage;
    if zero3 != zero3_layout {
        return Err(Error::corrupt(
            dir,
            format!(
            "the optimizer-state files hold {} but the model-states files are named for ZeRO-{}",
            groups_key,
            if zero3_layout { "3" } else { "1/2" }
        ),
        ));
    }

    // Model states: rank 0's (ZeRO-1/2's only one) describes the layout; under
    // ZeRO-3 every rank's holds its share of the frozen parameters.
    let mut model_names: Vec<&str> = Vec::new();
    if zero3 {
        for r in 0..world {
            match n.model_ranks.get(r) {
                Some((x, name)) if *x == r => model_names.push(name),
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
        model_names.push(name);
    }
    let Some(first_name) = model_names.first() else {
        return Err(Error::Incomplete {
            path: dir.to_path_buf(),
            msg: "no model-states file (mp_rank_00_model_states.pt or zero_pp_rank_0_mp_rank_00_model_states.pt): it records which parameter is where".into(),
            hint: Some("copy the tag folder's *_model_states.pt files back into it".into()),
        });
    };
    let (m0, template) = Parsed::open_as_template(&dir.join(first_name), pool.as_ref())?;
    let mut reader = template
        .as_ref()
        .map(|t| TemplateReader::new(t, m0.payload.pickle.clone()));
    let model = files::model_states(&m0)?;
    let first_model_file = files.len();
    let mut frozen_files: Vec<FrozenFile> = Vec::new();
    if !model.frozen_shapes.is_empty() {
        frozen_files.push(FrozenFile::take(
            &model,
            &m0,
            &model.frozen_fragments,
            first_model_file,
        )?);
    }
    files.push(m0.blob.clone());
    unsafe_calls.extend(m0.payload.unsafe_calls.iter().cloned());
    for name in &model_names[1..] {
        // The other ranks' model states, one at a time: only their frozen shares
        // are kept.
        let f = Parsed::open_from(&dir.join(name), pool.as_ref(), reader.as_mut())?;
        if !model.frozen_shapes.is_empty() {
            let fragments = files::model_states(&f)?.frozen_fragments;
            frozen_files.push(FrozenFile::take(&model, &f, &fragments, files.len())?);
        }
        files.push(f.blob.clone());
        unsafe_calls.extend(f.payload.unsafe_calls.iter().cloned());
        if let Some(reader) = reader.as_mut() {
            reader.done(f.payload);
        }
    }
    hits += reader.map_or(0, |r| r.hits);

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
    if model.param_shapes.len() != optim[0].flats.len() {
        return Err(Error::corrupt(
            &m0.path,
            format!(
                "'param_shapes' lists {} parameter group(s), the optimizer-state files hold {}",
                model.param_shapes.len(),
                optim[0].flats.len()
            ),
        ));
    }
    if zero3 {
        zero3_params(&ctx, &model, &optim, &mut built)?;
    } else {
        zero12_params(&ctx, &model, &optim, &mut built)?;
    }
    let frozen_from_fragments = frozen(&ctx, &model, &frozen_files, zero3, &mut built)?;
    drop(frozen_files);

    // Buffers, and (ZeRO-1) frozen parameters kept only in the module.
    let aliases: HashSet<&str> = model.shared.iter().map(|(a, _)| a.as_str()).collect();
    let buffers: HashSet<&str> = model.buffer_names.iter().map(String::as_str).collect();
    let mut from_module = Vec::new();
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
        groups_key,
        world
    ));
    if frozen_from_fragments > 0 {
        notes.push(format!("{frozen_from_fragments} frozen parameter(s) from frozen_param_fragments (16-bit, as trained)"));
    }
    if !from_module.is_empty() {
        notes.push(format!(
            "frozen parameter(s) recorded only in the 16-bit module, read from there: {}",
            crate::text::list_some(&from_module, 4)
        ));
    }
    if !zero3 {
        notes.push("skipped the module's 16-bit copy of the trained parameters (the fp32 masters are the weights)".into());
    }
    let moments: usize = optim.iter().map(|o| o.states.moments).sum();
    drop(optim);
    if moments > 0 {
        notes.push(format!(
            "skipped the optimizer's state (Adam's exp_avg, exp_avg_sq...): {moments} tensor(s) over {world} file(s), not read"
        ));
    }
    let mut skipped = n.other.clone();
    if found.path != found.tag_dir {
        if let Ok(entries) = crate::bytes::fs::list(&found.path) {
            let tag_name = found.tag_dir.file_name().map(|n| n.to_string_lossy());
            skipped.extend(
                entries
                    .into_iter()
                    .filter(|e| Some(e.name.as_str()) != tag_name.as_deref())
                    .map(|e| e.name),
            );
        }
    }
    if !skipped.is_empty() {
        notes.push(format!(
            "skipped (not weights): {}",
            crate::text::list_some(&skipped, 10)
        ));
    }
    let mut extras = Vec::new();
    if let Some(v) = &model.version {
        extras.push(Extra {
            name: "ds_version".into(),
            kind: format!("str '{v}'"),
        });
    }
    let checkpoint = Checkpoint {
        format: Format::DeepSpeed,
        path: found.path.clone(),
        files,
        key: None,
        tensors,
        extras,
        notes,
        unsafe_calls,
    };
    Ok((checkpoint, pool, hits))
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

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::dtype::DType;
    use crate::read::read_tensor;
    use crate::source::OpenOptions;

    fn found(case: &str) -> Found {
        let path = crate::fixtures().join("deepspeed").join(case);
        super::super::find(&path, &OpenOptions::default())
            .unwrap()
            .unwrap()
    }

    /// Under ZeRO-3 the ranks' files of one kind hold pickles that differ only in
    /// integers and strings, and all but the first of each kind are read from the
    /// first's template (what they hold is checked against zero_to_fp32's output
    /// in tests/deepspeed.rs); a file that differs otherwise is parsed.
    #[test]
    fn rank_files_are_read_from_the_first_ranks_template() {
        // (case, files, files read from a template)
        for (case, files, hits) in [
            // 3 optimizer-state and 3 model-states files.
            ("llama_z3_fp16_w3_frozen", 6, 4),
            // Rank 0's model states alone record the tied alias (shared_params):
            // the other two are parsed.
            ("qwen2_z3_bf16_w3", 6, 2),
            // ZeRO-2: each rank's param_slice_mappings names the parameters in
            // its partition (dict keys), the same only for ranks 0 and 1 here.
            ("llama12_z2_fp16_w12", 13, 1),
        ] {
            let (ckpt, _, got) = open_with(&found(case), usize::MAX).unwrap();
            assert_eq!((ckpt.files.len(), got), (files, hits), "{case}");
        }
    }

    #[test]
    fn notes_say_what_was_read_and_what_was_skipped() {
        let open = |case: &str| open_with(&found(case), usize::MAX).unwrap().0;
        let has = |c: &Checkpoint, s: &str| c.notes.iter().any(|n| n.contains(s));
        // (case, frozen fragments read, frozen parameters read from the module, ZeRO-1/2)
        for (case, fragments, in_module, zero12) in [
            ("llama_z3_fp16_w3_frozen", true, false, false),
            ("llama_z3_bf16_w2", false, false, false),
            ("llama_z1_bf16_w2", false, true, true),
            ("qwen2_z2_bf16_w3_frozen", true, false, true),
        ] {
            let c = open(case);
            assert_eq!(
                has(&c, "from frozen_param_fragments"),
                fragments,
                "{case}: {:?}",
                c.notes
            );
            assert_eq!(
                has(&c, "recorded only in the 16-bit module"),
                in_module,
                "{case}: {:?}",
                c.notes
            );
            assert_eq!(
                has(&c, "skipped the module's 16-bit copy"),
                zero12,
                "{case}: {:?}",
                c.notes
            );
            // Beside the tag folder: `latest` and DeepSpeed's scripts, not the tag folder.
            let skipped = c
                .notes
                .iter()
                .find(|n| n.starts_with("skipped (not weights)"));
            let skipped = skipped.unwrap_or_else(|| panic!("{case}: {:?}", c.notes));
            assert!(
                skipped.contains("latest") && skipped.contains("zero_to_fp32.py"),
                "{skipped}"
            );
            assert!(!skipped.contains("global_step1"), "{skipped}");
        }
        // The tag folder itself holds nothing else.
        let c = open("llama_z3_bf16_w2/global_step1");
        assert!(!has(&c, "skipped (not weights)"), "{:?}", c.notes);
    }

    /// A tag folder in a temporary directory made of fixture files: `(from, as)`.
    fn tag_folder(files: &[(String, String)]) -> (tempfile::TempDir, Found) {
        let tmp = tempfile::tempdir().unwrap();
        let fixtures = crate::fixtures();
        for (from, to) in files {
            std::fs::copy(fixtures.join(from), tmp.path().join(to)).unwrap();
        }
        let f = super::super::find(tmp.path(), &OpenOptions::default())
            .unwrap()
            .unwrap();
        (tmp, f)
    }

    #[test]
    fn files_of_two_runs_are_refused() {
        let z3 = "deepspeed/llama_z3_bf16_w2/global_step1/";
        let z1 = "deepspeed/llama_z1_bf16_w2/global_step1/";
        let z2 = "deepspeed/llama_z2_bf16_w2_accelerate/pytorch_model/";
        let z2g1 = "deepspeed_combos/z2_w2_g1_tied/global_step1/";
        let optim = |r: usize| format!("bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt");
        let model = |r: usize| format!("zero_pp_rank_{r}_mp_rank_00_model_states.pt");
        let z3_model = [
            (format!("{z3}{}", model(0)), model(0)),
            (format!("{z3}{}", model(1)), model(1)),
        ];
        let z12_model = (
            format!("{z1}mp_rank_00_model_states.pt"),
            "mp_rank_00_model_states.pt".to_string(),
        );
        let cases: Vec<(Vec<(String, String)>, &str)> = vec![
            // A third rank's file in a run of two.
            (
                vec![
                    (format!("{z3}{}", optim(0)), optim(0)),
                    (format!("{z3}{}", optim(1)), optim(1)),
                    (format!("{z3}{}", optim(1)), optim(2)),
                ],
                "this file says world size 2",
            ),
            // Rank 1's file named as a plain (not BF16) run's.
            (
                vec![
                    (format!("{z3}{}", optim(0)), optim(0)),
                    (
                        format!("{z3}{}", optim(1)),
                        "zero_pp_rank_1_mp_rank_00_optim_states.pt".into(),
                    ),
                ],
                "this file says world size 2",
            ),
            // Ranks of a ZeRO-1 and a ZeRO-2 run: the stage alone differs.
            (
                vec![
                    (format!("{z1}{}", optim(0)), optim(0)),
                    (format!("{z2}{}", optim(1)), optim(1)),
                    z12_model.clone(),
                ],
                "its ZeRO stage or parameter groups differ",
            ),
            // Two ZeRO-2 runs, of two parameter groups and of one.
            (
                vec![
                    (format!("{z2}{}", optim(0)), optim(0)),
                    (format!("{z2g1}{}", optim(1)), optim(1)),
                    z12_model.clone(),
                ],
                "its ZeRO stage or parameter groups differ",
            ),
        ];
        for (i, (mut files, says)) in cases.into_iter().enumerate() {
            if i < 2 {
                files.extend(z3_model.iter().cloned());
            }
            let (_tmp, f) = tag_folder(&files);
            let e = open_with(&f, usize::MAX).err().unwrap().to_string();
            assert!(
                e.contains(says) && e.contains("files of different runs"),
                "{i}: {e}"
            );
        }
    }

    #[test]
    fn a_missing_model_states_rank_is_named() {
        let z3 = "deepspeed/llama_z3_bf16_w2/global_step1/";
        let name = |kind: &str, r: usize| {
            format!(
                "{kind}zero_pp_rank_{r}_mp_rank_00_{}_states.pt",
                if kind.is_empty() { "model" } else { "optim" }
            )
        };
        let files = [
            (format!("{z3}{}", name("bf16_", 0)), name("bf16_", 0)),
            (format!("{z3}{}", name("bf16_", 1)), name("bf16_", 1)),
            (format!("{z3}{}", name("", 0)), name("", 0)),
            // Rank 1's model states under rank 2's name.
            (format!("{z3}{}", name("", 1)), name("", 2)),
        ];
        let (_tmp, f) = tag_folder(&files);
        let e = open_with(&f, usize::MAX).err().unwrap().to_string();
        assert!(e.contains("rank 1's model-states file is missing"), "{e}");
    }

    /// A pool of descriptors is made when the files outnumber the budget, and only
    /// then.
    #[test]
    fn a_pool_is_made_for_more_files_than_the_budget() {
        for (case, files) in [
            ("llama_z3_fp16_w3_frozen", 6),
            ("qwen2_z2_bf16_w3_frozen", 4),
            ("llama_z1_bf16_w2", 3),
        ] {
            let f = found(case);
            let (_, pool, _) = open_with(&f, files).unwrap();
            assert!(pool.is_none(), "{case}: {files} files, budget {files}");
            let (_, pool, _) = open_with(&f, files - 1).unwrap();
            assert!(
                pool.is_some(),
                "{case}: {files} files, budget {}",
                files - 1
            );
        }
    }

    /// More rank files than the budget: the same tensors, read through a pool that
    /// never holds more than the budget open, give the same bytes.
    #[test]
    fn rank_files_past_the_budget_are_opened_on_demand() {
        // ZeRO-3 over 3 ranks (6 files, frozen shares in every model-states file)
        // and ZeRO-2 over 3 ranks (4 files, frozen parameters in the one).
        for (case, files) in [
            ("llama_z3_fp16_w3_frozen", 6),
            ("qwen2_z2_bf16_w3_frozen", 4),
        ] {
            let f = found(case);
            let (all, none, _) = open_with(&f, usize::MAX).unwrap();
            assert!(none.is_none(), "{case}: no pool needed");
            assert_eq!(all.files.len(), files, "{case}");
            let (few, pool, _) = open_with(&f, 2).unwrap();
            let pool = pool.unwrap_or_else(|| panic!("{case}: {files} files, budget 2"));
            assert!(pool.open_now() <= 2, "{case}: {} open", pool.open_now());
            let names =
                |c: &Checkpoint| c.tensors.iter().map(|t| t.name.clone()).collect::<Vec<_>>();
            assert_eq!(names(&all), names(&few), "{case}");
            for (a, b) in all.tensors.iter().zip(&few.tensors) {
                assert_eq!(*a.pieces, *b.pieces, "{case}: {}", a.name);
                let (x, _) = read_tensor(&all.files, a, DType::F32).unwrap();
                let (y, _) = read_tensor(&few.files, b, DType::F32).unwrap();
                assert!(x == y, "{case}: {} differs", a.name);
                assert!(pool.open_now() <= 2, "{case}: {} open", pool.open_now());
            }
            // Files were closed and opened again: more opens than files.
            assert!(
                pool.opens() > files as u64,
                "{case}: {} opens",
                pool.opens()
            );
        }
    }
}
