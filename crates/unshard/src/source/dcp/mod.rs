//! torch.distributed.checkpoint directories: `.metadata` + `__R_I.distcp`.
//!
//! FSDP `SHARDED_STATE_DICT`, FSDP2, accelerate's `pytorch_model_fsdp_0/` and
//! torchtitan all save this way (docs/formats.md). `.metadata` is a plain pickle
//! (protocol 4 or 5) of dataclasses, read here as opaque objects: for every entry
//! of the flattened state dict it gives the global shape and dtype and the chunks
//! (offset and size boxes) it was saved in; `storage_data` maps each chunk
//! (`MetadataIndex(fqn, offsets)`) to a byte range of a `.distcp` file. Each range
//! is a complete `torch.save` archive of one tensor, so a chunk becomes one
//! [`Piece`](super::Piece) pointing into the `.distcp` file, placed at the chunk's
//! offsets. Ranges that went through the `stream.zstd/1` transform are decompressed
//! into memory first; that is the only copy of tensor bytes a reader makes.
//!
//! Nested state dicts are flattened by DCP (`{"model": sd}` gives `model.<fqn>`);
//! `planner_data` keeps the original path, which tells where the model is and which
//! entries are optimizer state (skipped, with a note). Byte entries (step counters,
//! param groups, anything not a tensor) are listed as extras and never read as weights.
//!
//! By job: `metadata` interprets `.metadata`; this file picks the model's entries;
//! `chunks` locates each chunk's archive in its `.distcp` file and reads the
//! archive's records, ahead of need.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::torch;
use super::{Checkpoint, Extra, Format, OpenOptions};
use crate::bytes::FilePool;
use crate::error::{Error, Result};

mod batch;
mod chunks;
mod metadata;
mod readahead;
mod template;

use chunks::Reader;
use metadata::{parse_metadata, Entry, EntryKind, Keep, Metadata};

/// Top-level state-dict keys under which trainers put optimizer state.
const OPTIMIZER_KEYS: &[&str] = &[
    "optim",
    "optimizer",
    "optimizers",
    "optim_state",
    "optimizer_state_dict",
];

/// Whether a directory is a DCP checkpoint.
pub fn is_dcp_dir(path: &Path) -> bool {
    crate::bytes::fs::is_file(&path.join(".metadata"))
}

/// Opens a DCP directory and describes the model tensors in it.
pub fn open(dir: &Path, opts: &OpenOptions) -> Result<Checkpoint> {
    open_tuned(dir, opts, &Tuning::default()).map(|(c, _)| c)
}

/// How [`open`] reads: the defaults, or what a test wants to compare them with.
struct Tuning {
    /// Bytes read at each end of every chunk archive up front.
    ends: u64,
    /// Files kept open at once when the checkpoint has more (the rest are opened on
    /// demand: 16,384 rank files against a limit of a few thousand).
    max_open: usize,
    /// Whether archives are checked against a parsed one of the same structure
    /// instead of each being parsed.
    templates: bool,
    /// Whether the files are read ahead while `.metadata` is parsed.
    readahead: bool,
    /// Threads that build the tensors whose chunks the scan resolved.
    build_threads: usize,
}

impl Default for Tuning {
    fn default() -> Self {
        Tuning {
            ends: chunks::ENDS,
            max_open: crate::bytes::open_file_budget(),
            templates: true,
            readahead: true,
            build_threads: std::thread::available_parallelism()
                .map_or(1, |n| n.get())
                .min(chunks::BUILD_THREADS),
        }
    }
}

/// Statistics of an open, for tests: the file pool, if one was used, how many
/// archives were taken from a template, and how many reads the scan of the archives
/// made.
#[cfg_attr(not(test), allow(dead_code))]
struct Opened {
    pool: Option<Arc<FilePool>>,
    template_hits: u64,
    scan_reads: usize,
    /// How many tensors each thread that built resolved tensors was given.
    built_parts: Vec<usize>,
}

/// [`open`], tuned.
fn open_tuned(dir: &Path, opts: &OpenOptions, tuning: &Tuning) -> Result<(Checkpoint, Opened)> {
    let (ends, max_open) = (tuning.ends, tuning.max_open);
    let meta_path = dir.join(".metadata");
    let key = opts.key.as_deref();
    let model = Keep::Model {
        key,
        optimizer_keys: OPTIMIZER_KEYS,
    };
    // The disk reads the files while the CPU parses `.metadata`; stopped when the
    // open is over (the scan below reads the same files).
    let readahead = tuning
        .readahead
        .then(|| readahead::Readahead::start(dir))
        .flatten();
    let mut md = parse_metadata(&meta_path, model)?;
    super::release_freed_memory();
    if wants_dropped(dir, &md, key)? {
        // The guess from the fqns was wrong (the planner's paths put an entry the
        // merge reads under a key that looked like optimizer state): read it all.
        md = parse_metadata(&meta_path, Keep::All)?;
    }
    let selection = select(dir, &md, key)?;
    let pooled = md.file_count() > max_open && !crate::bytes::fs::is_url(dir);
    let mut reader = Reader::new(dir, ends, pooled.then_some(max_open), tuning.templates);
    let chosen: Vec<(String, &Entry)> = selection
        .tensors
        .iter()
        .map(|(name, i)| (name.clone(), &md.entries[*i]))
        .collect();
    reader.scan(&md, &chosen);
    drop(chosen);
    let tensors = reader.build(&mut md, &selection.tensors, tuning.build_threads)?;
    let mut extras = Vec::new();
    for e in &md.entries {
        if matches!(e.kind, EntryKind::Bytes { .. }) {
            extras.push(Extra {
                name: e.fqn.clone(),
                kind: reader.describe_bytes(&md, e),
            });
        }
    }
    extras.extend(selection.extras);
    let mut unsafe_calls = md.unsafe_calls.clone();
    unsafe_calls.append(&mut reader.unsafe_calls);
    drop(readahead);
    let opened = Opened {
        pool: reader.pool.clone(),
        template_hits: reader.templates.as_ref().map_or(0, |t| t.hits),
        scan_reads: reader.scan_reads,
        built_parts: std::mem::take(&mut reader.built_parts),
    };
    let checkpoint = Checkpoint {
        format: Format::Dcp,
        path: dir.to_path_buf(),
        files: reader.files,
        key: selection.key,
        tensors,
        extras,
        notes: selection.notes,
        unsafe_calls,
    };
    Ok((checkpoint, opened))
}

/// The bytes of the first byte entry of the DCP directory `dir` whose name starts
/// with `prefix` (Megatron-Core's `common_state/shard_0_1`), decoded, with its
/// name and the file it is in; `None` when there is none. Parses `.metadata`
/// without any tensor's chunks; an item larger than `limit` is an error.
pub fn read_bytes_item(
    dir: &Path,
    prefix: &str,
    limit: u64,
) -> Result<Option<(String, PathBuf, Vec<u8>)>> {
    let md = parse_metadata(&dir.join(".metadata"), Keep::NoChunks)?;
    let found = md.entries.iter().find_map(|e| match e.kind {
        EntryKind::Bytes { item: Some(item) } if e.fqn.starts_with(prefix) => Some((e, item)),
        _ => None,
    });
    let Some((entry, item)) = found else {
        return Ok(None);
    };
    let mut reader = Reader::new(dir, chunks::ENDS, None, false);
    let what = format!("the byte entry '{}'", entry.fqn);
    let (file, bytes) = reader.read_item(&md, &item, &what, limit)?;
    Ok(Some((entry.fqn.clone(), file, bytes)))
}

/// Finds the one DCP directory inside `dir` that holds a model, as in a HF Trainer
/// or accelerate `checkpoint-N/` (`pytorch_model_fsdp_0/` beside `optimizer_0/`).
/// Optimizer-only directories are passed over; when nothing else is there, the
/// optimizer directory is returned so that opening it explains what it holds.
pub fn find_model_subdir(dir: &Path) -> Result<Option<(PathBuf, Vec<String>)>> {
    let mut models = Vec::new();
    let mut optimizers = Vec::new();
    for entry in crate::bytes::fs::list(dir)? {
        let p = entry.path;
        if !entry.is_dir || !is_dcp_dir(&p) {
            continue;
        }
        let name = entry.name;
        if name.starts_with("optim") {
            optimizers.push(name);
        } else {
            models.push(name);
        }
    }
    models.sort();
    optimizers.sort();
    match models.len() {
        0 => Ok(optimizers.first().map(|o| (dir.join(o), Vec::new()))),
        1 => Ok(Some((dir.join(&models[0]), optimizers))),
        _ => Err(Error::Unsupported {
            path: dir.to_path_buf(),
            what: format!(
                "a directory holding several torch.distributed.checkpoint directories ({})",
                models.join(", ")
            ),
            hint: Some(format!(
                "pass the one to merge, e.g. {}",
                dir.join(&models[0]).display()
            )),
        }),
    }
}

/// Whether the selection holds an entry whose chunks were not kept.
fn wants_dropped(dir: &Path, md: &Metadata, key: Option<&str>) -> Result<bool> {
    let dropped = |e: &Entry| matches!(e.kind, EntryKind::Tensor { dropped: true, .. });
    if !md.entries.iter().any(dropped) {
        return Ok(false);
    }
    Ok(select(dir, md, key)?
        .tensors
        .iter()
        .any(|(_, i)| dropped(&md.entries[*i])))
}

/// What to merge: the tensor entries of the model (indexes in the metadata's
/// entries), with their names in it.
struct Selection {
    key: Option<String>,
    tensors: Vec<(String, usize)>,
    extras: Vec<Extra>,
    notes: Vec<String>,
}

/// The top-level key an entry was saved under, if the state dict was nested.
fn group_of(e: &Entry) -> Option<&str> {
    match e.path.as_slice() {
        [first, _, ..] => Some(first),
        _ => None,
    }
}

fn is_optimizer_group(g: &str) -> bool {
    OPTIMIZER_KEYS.contains(&g)
}

/// Picks the model's tensors: under `--key` when given, else the top level, else
/// the one non-optimizer group holding tensors (or the first of the usual wrapper keys).
fn select(dir: &Path, md: &Metadata, key: Option<&str>) -> Result<Selection> {
    let is_tensor = |e: &Entry| matches!(e.kind, EntryKind::Tensor { .. });
    let mut groups: Vec<Option<&str>> = Vec::new();
    for e in md.entries.iter().filter(|e| is_tensor(e)) {
        let g = group_of(e);
        if !groups.contains(&g) {
            groups.push(g);
        }
    }
    let chosen = match key {
        Some(k) if !k.is_empty() => {
            let prefix = format!("{k}.");
            if !md
                .entries
                .iter()
                .any(|e| is_tensor(e) && e.fqn.starts_with(&prefix))
            {
                return Err(Error::KeyNotFound {
                    path: dir.to_path_buf(),
                    key: k.to_string(),
                    available: groups.iter().flatten().map(|g| g.to_string()).collect(),
                });
            }
            Some(k)
        }
        _ => model_group(dir, &groups)?,
    };
    let prefix = chosen.map(|k| format!("{k}.")).unwrap_or_default();
    let mut tensors = Vec::new();
    let mut extras = Vec::new();
    let mut skipped: HashMap<&str, usize> = HashMap::new();
    for (i, e) in md.entries.iter().enumerate().filter(|(_, e)| is_tensor(e)) {
        let mine = match chosen {
            Some(_) => e.fqn.strip_prefix(&prefix),
            None => group_of(e).is_none().then_some(e.fqn.as_str()),
        };
        match (mine, group_of(e)) {
            (Some(name), _) => tensors.push((name.to_string(), i)),
            (None, Some(g)) if is_optimizer_group(g) => *skipped.entry(g).or_insert(0) += 1,
            (None, _) => {
                if let EntryKind::Tensor { dtype, shape, .. } = &e.kind {
                    extras.push(Extra {
                        name: e.fqn.clone(),
                        kind: format!(
                            "tensor {} {shape:?} (not merged; select it with --key)",
                            dtype.safetensors_name()
                        ),
                    });
                }
            }
        }
    }
    let mut notes = Vec::new();
    let mut skipped: Vec<_> = skipped.into_iter().collect();
    skipped.sort();
    for (g, n) in skipped {
        notes.push(format!(
            "skipped optimizer state under '{g}' ({n} tensor entries); only model weights are merged"
        ));
    }
    let mut seen = HashSet::new();
    for (name, _) in &tensors {
        if !seen.insert(name.as_str()) {
            return Err(Error::corrupt(
                dir.join(".metadata"),
                format!("tensor '{name}' appears twice"),
            ));
        }
    }
    Ok(Selection {
        key: chosen.map(str::to_string),
        tensors,
        extras,
        notes,
    })
}

/// The group the model was saved under (`None` = the top level), among the groups
/// holding tensors: optimizer state never, the top level first, else the only
/// remaining group, else the first usual wrapper key.
fn model_group<'g>(dir: &Path, groups: &[Option<&'g str>]) -> Result<Option<&'g str>> {
    let model: Vec<Option<&str>> = groups
        .iter()
        .copied()
        .filter(|g| !g.is_some_and(is_optimizer_group))
        .collect();
    if model.contains(&None) {
        return Ok(None);
    }
    if let [only] = model.as_slice() {
        return Ok(*only);
    }
    if let Some(w) = torch::WRAPPER_KEYS
        .iter()
        .find(|w| model.contains(&Some(**w)))
    {
        return Ok(Some(*w));
    }
    if !model.is_empty() {
        return Err(Error::AmbiguousTensors {
            path: dir.to_path_buf(),
            candidates: model.iter().flatten().map(|g| g.to_string()).collect(),
        });
    }
    let what = if groups.is_empty() {
        "no tensors at all".to_string()
    } else {
        let names: Vec<&str> = groups.iter().flatten().copied().collect();
        format!("only optimizer state under '{}'", names.join("', '"))
    };
    Err(Error::NoTensors {
        path: dir.to_path_buf(),
        at: None,
        hint: Some(format!(
            "no model tensors: the checkpoint holds {what}; the model weights are saved in a sibling directory (accelerate: pytorch_model_fsdp_0)"
        )),
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::read::read_tensor;

    /// Every chunk archive of a real DCP directory gives the same tensors, byte for
    /// byte, whether it is read whole up front, read record by record from the file,
    /// or with the ends `open` reads.
    #[test]
    fn archives_read_whole_or_record_by_record_give_the_same_tensors() {
        let dir = crate::fixtures().join("sharded/llama_w3_dcp");
        let opts = OpenOptions::default();
        let tuned = |ends, templates| {
            let t = Tuning {
                ends,
                templates,
                ..Tuning::default()
            };
            open_tuned(&dir, &opts, &t).unwrap().0
        };
        let in_memory = tuned(u64::MAX, false);
        let in_map = tuned(0, false);
        let default = open(&dir, &opts).unwrap();
        assert_eq!(default.tensors.len(), in_map.tensors.len());
        for (a, b) in default.tensors.iter().zip(&in_map.tensors) {
            assert_eq!(a.pieces, b.pieces, "{}", a.name);
        }
        assert_eq!(in_memory.tensors.len(), in_map.tensors.len());
        assert!(in_map.tensors.iter().any(|t| t.pieces.len() == 3));
        for (a, b) in in_memory.tensors.iter().zip(&in_map.tensors) {
            assert_eq!(a.name, b.name);
            assert_eq!(a.pieces.len(), b.pieces.len());
            let (x, _) = read_tensor(&in_memory.files, a, a.dtype).unwrap();
            let (y, _) = read_tensor(&in_map.files, b, b.dtype).unwrap();
            assert_eq!(x, y, "{}", a.name);
        }
    }

    /// Reading the files ahead changes nothing read: the same pieces, the same bytes.
    #[test]
    fn reading_ahead_gives_the_same_tensors() {
        let dir = crate::fixtures().join("sharded/llama_w8_dcp");
        let opts = OpenOptions::default();
        let with = |readahead| Tuning {
            readahead,
            ..Tuning::default()
        };
        let (plain, _) = open_tuned(&dir, &opts, &with(false)).unwrap();
        let (ahead, _) = open_tuned(&dir, &opts, &with(true)).unwrap();
        assert_eq!(plain.tensors.len(), ahead.tensors.len());
        for (a, b) in plain.tensors.iter().zip(&ahead.tensors) {
            assert_eq!(a.name, b.name);
            assert_eq!(a.pieces, b.pieces, "{}", a.name);
            let (x, _) = read_tensor(&plain.files, a, a.dtype).unwrap();
            let (y, _) = read_tensor(&ahead.files, b, b.dtype).unwrap();
            assert_eq!(x, y, "{}", a.name);
        }
    }

    /// With fewer files allowed open than the checkpoint has, files are opened on
    /// demand, never more than allowed at once, and every tensor reads the same.
    #[test]
    fn files_beyond_the_open_limit_are_opened_on_demand() {
        let dir = crate::fixtures().join("sharded/llama_w3_dcp");
        let opts = OpenOptions::default();
        let max_open = |max_open| Tuning {
            max_open,
            ..Tuning::default()
        };
        let (all, _) = open_tuned(&dir, &opts, &max_open(usize::MAX)).unwrap();
        let (one, opened) = open_tuned(&dir, &opts, &max_open(1)).unwrap();
        let pool = opened.pool.unwrap();
        assert_eq!(all.files.len(), 3);
        assert_eq!(one.files.len(), 3);
        for (a, b) in all.tensors.iter().zip(&one.tensors) {
            assert_eq!(a.pieces, b.pieces, "{}", a.name);
            let (x, _) = read_tensor(&all.files, a, a.dtype).unwrap();
            let (y, _) = read_tensor(&one.files, b, b.dtype).unwrap();
            assert_eq!(x, y, "{}", a.name);
        }
        // Every open beyond the first closed another file: one at a time, and the
        // files were opened again and again as the chunks alternate between ranks.
        assert!(pool.opens() > 3, "{}", pool.opens());
        assert_eq!(pool.open_now(), 1);
        assert!(open_tuned(&dir, &opts, &max_open(3))
            .unwrap()
            .1
            .pool
            .is_none());
    }

    /// Archives checked against a parsed one of the same structure give the pieces
    /// parsing each gives, and most of the eight ranks' archives are taken that way.
    #[test]
    fn archives_like_a_parsed_one_give_the_pieces_parsing_gives() {
        let dir = crate::fixtures().join("sharded/llama_w8_dcp");
        let opts = OpenOptions::default();
        let with = |templates| Tuning {
            templates,
            ..Tuning::default()
        };
        let (parsed, p) = open_tuned(&dir, &opts, &with(false)).unwrap();
        let (checked, c) = open_tuned(&dir, &opts, &with(true)).unwrap();
        assert_eq!(p.template_hits, 0);
        let chunks: usize = parsed.tensors.iter().map(|t| t.pieces.len()).sum();
        assert!(
            c.template_hits as usize > chunks / 2,
            "{} of {chunks}",
            c.template_hits
        );
        // The archives' ends were read a file at a time, not one read each, and
        // every file was scanned (the files are small: one read each), whichever
        // thread took it.
        assert_eq!(p.scan_reads, 0);
        assert_eq!(c.scan_reads, checked.files.len());
        assert_eq!(parsed.tensors.len(), checked.tensors.len());
        for (a, b) in parsed.tensors.iter().zip(&checked.tensors) {
            assert_eq!(a.name, b.name);
            assert_eq!(a.pieces, b.pieces, "{}", a.name);
            // The layout counts the files its chunks are in.
            let files: HashSet<usize> = b.pieces.iter().map(|p| p.file).collect();
            let layout = b.layout.as_deref().unwrap_or_default();
            if b.pieces.len() > 1 {
                assert!(
                    layout.ends_with(&format!(" in {} file(s)", files.len())),
                    "{layout}"
                );
            }
        }
        assert!(checked.tensors.iter().any(|t| t
            .layout
            .as_deref()
            .is_some_and(|l| l.ends_with(" in 8 file(s)"))));
    }

    /// The tensors whose chunks were all resolved, built in two parts on two
    /// threads, are those one thread builds: the same order, pieces and layouts.
    #[test]
    fn tensors_built_on_two_threads_are_those_built_on_one() {
        let dir = crate::fixtures().join("sharded/llama_w8_dcp");
        let threads = |build_threads| Tuning {
            build_threads,
            ..Tuning::default()
        };
        for opts in [OpenOptions::default()] {
            let (one, o) = open_tuned(&dir, &opts, &threads(1)).unwrap();
            let (two, t) = open_tuned(&dir, &opts, &threads(2)).unwrap();
            assert_eq!(o.built_parts, vec![one.tensors.len()]);
            // Every tensor was built on a thread, and the cut fell inside the list.
            assert_eq!(t.built_parts.len(), 2);
            assert!(t.built_parts.iter().all(|&n| n > 0), "{:?}", t.built_parts);
            assert_eq!(t.built_parts.iter().sum::<usize>(), two.tensors.len());
            assert_eq!(one.tensors.len(), two.tensors.len());
            for (a, b) in one.tensors.iter().zip(&two.tensors) {
                assert_eq!(a.name, b.name);
                assert_eq!((a.dtype, &a.shape), (b.dtype, &b.shape), "{}", a.name);
                assert_eq!(a.pieces, b.pieces, "{}", a.name);
                assert_eq!(a.layout, b.layout, "{}", a.name);
            }
            // Built one by one on the reader's thread, as before there were threads.
            let (read, _) = open_tuned(
                &dir,
                &opts,
                &Tuning {
                    templates: false,
                    ..threads(2)
                },
            )
            .unwrap();
            for (a, b) in read.tensors.iter().zip(&two.tensors) {
                assert_eq!(a.pieces, b.pieces, "{}", a.name);
                assert_eq!(a.layout, b.layout, "{}", a.name);
            }
        }
    }

    /// A copy of `llama_w8_dcp` in `tmp` with the middle chunk archive of one rank
    /// file changed by `change` (given the archive's bytes); returns its directory
    /// and the archive's range in the file.
    pub(crate) fn w8_with_one_archive_changed(
        tmp: &Path,
        change: impl FnOnce(&mut [u8]),
    ) -> (PathBuf, std::ops::Range<usize>) {
        let src = crate::fixtures().join("sharded/llama_w8_dcp");
        let dir = tmp.join("dcp");
        std::fs::create_dir_all(&dir).unwrap();
        for e in std::fs::read_dir(src).unwrap() {
            let e = e.unwrap();
            std::fs::copy(e.path(), dir.join(e.file_name())).unwrap();
        }
        let rank = dir.join("__3_0.distcp");
        let mut bytes = std::fs::read(&rank).unwrap();
        // Each archive starts with the local header of its pickle.
        let starts: Vec<usize> = bytes
            .windows(16)
            .enumerate()
            .filter(|(i, w)| *w == b"archive/data.pkl" && *i >= 30)
            .map(|(i, _)| i - 30)
            .filter(|&i| bytes[i..].starts_with(b"PK\x03\x04"))
            .collect();
        assert!(starts.len() > 20, "{}", starts.len());
        let k = starts.len() / 2;
        let range = starts[k]..starts[k + 1];
        change(&mut bytes[range.clone()]);
        std::fs::write(&rank, &bytes).unwrap();
        (dir, range)
    }

    /// Tensors whose chunks the scan left (an archive whose pickle calls a function
    /// the scan does not take, parsed when its tensor is built) are built in order
    /// on the reader's thread, between those built on threads, and give what
    /// parsing every archive gives; an archive that fails to parse fails the open
    /// as it does when every archive is parsed.
    #[test]
    fn tensors_left_by_the_scan_are_built_between_the_others() {
        let tuned = |templates, build_threads| Tuning {
            templates,
            build_threads,
            ..Tuning::default()
        };
        let opts = OpenOptions::default();
        let tmp = tempfile::tempdir().unwrap();
        let (dir, _) = w8_with_one_archive_changed(tmp.path(), |a| {
            let p = a.windows(11).position(|w| w == b"OrderedDict").unwrap();
            a[p + 10] = b'T';
        });
        let (parsed, _) = open_tuned(&dir, &opts, &tuned(false, 1)).unwrap();
        let (mixed, m) = open_tuned(&dir, &opts, &tuned(true, 2)).unwrap();
        let on_threads: usize = m.built_parts.iter().sum();
        assert!(
            on_threads > 0 && on_threads < mixed.tensors.len(),
            "{:?}",
            m.built_parts
        );
        assert!(!mixed.unsafe_calls.is_empty());
        assert_eq!(parsed.tensors.len(), mixed.tensors.len());
        for (a, b) in parsed.tensors.iter().zip(&mixed.tensors) {
            assert_eq!(a.name, b.name);
            assert_eq!(a.pieces, b.pieces, "{}", a.name);
            assert_eq!(a.layout, b.layout, "{}", a.name);
        }
        let tmp = tempfile::tempdir().unwrap();
        let (dir, _) = w8_with_one_archive_changed(tmp.path(), |a| {
            let p = a.windows(2).position(|w| w == b"\x80\x02").unwrap();
            a[p + 12] ^= 0x20;
        });
        let e = open_tuned(&dir, &opts, &tuned(false, 1))
            .map(|_| ())
            .unwrap_err();
        let e2 = open_tuned(&dir, &opts, &tuned(true, 2))
            .map(|_| ())
            .unwrap_err();
        assert!(e.to_string().contains("__3_0.distcp"), "{e}");
        assert_eq!(e.to_string(), e2.to_string());
    }

    /// A chunk archive whose tensor has another shape than `.metadata` gives its
    /// chunk (rows 8 of 64 written as 4 of 64, the dtype unchanged) is refused when
    /// its tensor is built, the error naming both shapes.
    #[test]
    fn a_chunk_archive_of_another_shape_than_the_metadata_says_is_refused() {
        let half = |a: &mut [u8]| {
            let at = a
                .windows(7)
                .position(|w| w == b"K\x00K\x08K@\x86")
                .expect("the size tuple (8, 64) of the chunk's pickle");
            a[at + 3] = 4;
        };
        let tmp = tempfile::tempdir().unwrap();
        let (dir, _) = w8_with_one_archive_changed(tmp.path(), half);
        let e = match open_tuned(&dir, &OpenOptions::default(), &Tuning::default()) {
            Err(e) => e,
            Ok((c, _)) => c
                .tensors
                .iter()
                .find_map(|t| read_tensor(&c.files, t, t.dtype).err())
                .expect("the archive of another shape is refused"),
        };
        let m = e.to_string();
        assert!(m.contains("__3_0.distcp"), "{m}");
        assert!(m.contains("[4, 64]") && m.contains("[8, 64]"), "{m}");
    }
}
