//! torch.distributed.checkpoint's Hugging Face storage writer, saving distributed
//! (`HuggingFaceStorageWriter(..., save_distributed=True)`): every rank writes its own
//! safetensors files, `shard-0000R-model-0000K-of-0000N.safetensors` (rank R counted
//! from 1, output file K of N), each holding that rank's boxes of the tensors assigned
//! to output file K. The header's `__metadata__` carries `DCP_SHARDING_INFO`, a JSON
//! string mapping each tensor to `{"saved_offsets": [...]}`: where its box sits in the
//! full tensor. The full shape is not written anywhere; it is the largest extent of
//! the boxes along each dimension (as torch's own consolidation computes it).
//!
//! Each box is a contiguous C-order piece, described as a [`Piece`]; the engine
//! assembles them like DCP chunks.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::{
    check_coverage, contiguous_strides, fs, safetensors, Checkpoint, Format, Piece, TensorSource,
};
use crate::dtype::DType;
use crate::error::{Error, Result};

/// The folder `HuggingFaceStorageWriter(enable_consolidation=True)` writes the rank
/// files into, beside the consolidated ones.
const SHARDED_DIR: &str = "sharded";

/// The `__metadata__` key holding the sharding.
const SHARDING_KEY: &str = "DCP_SHARDING_INFO";

/// `(rank, file index, file count)` of `shard-0000R-model-0000K-of-0000N.safetensors`.
pub fn parse_name(name: &str) -> Option<(u64, u64, u64)> {
    let rest = name.strip_prefix("shard-")?.strip_suffix(".safetensors")?;
    let (rank, rest) = rest.split_once("-model-")?;
    let (k, n) = rest.split_once("-of-")?;
    let num = |s: &str| {
        (!s.is_empty() && s.len() <= 12 && s.bytes().all(|b| b.is_ascii_digit()))
            .then(|| s.parse::<u64>().ok())
            .flatten()
    };
    Some((num(rank)?, num(k)?, num(n)?))
}

/// The folder of rank files to read for `dir`: `dir` itself when it holds them, or
/// its `sharded/` folder when `dir` holds no safetensors of its own (a consolidated
/// save beside its rank files is an HF directory, read as such). The second value is
/// a note for the user when the folder inside was chosen.
pub fn find(dir: &Path) -> Result<Option<(PathBuf, Option<String>)>> {
    let entries = fs::list(dir)?;
    if entries
        .iter()
        .any(|e| !e.is_dir && parse_name(&e.name).is_some())
    {
        return Ok(Some((dir.to_path_buf(), None)));
    }
    let own_weights = entries
        .iter()
        .any(|e| !e.is_dir && e.name.ends_with(".safetensors"));
    if own_weights || !entries.iter().any(|e| e.is_dir && e.name == SHARDED_DIR) {
        return Ok(None);
    }
    let sub = dir.join(SHARDED_DIR);
    if fs::list(&sub)?
        .iter()
        .any(|e| !e.is_dir && parse_name(&e.name).is_some())
    {
        let note = format!(
            "read the rank files of {SHARDED_DIR}/ inside {}",
            dir.display()
        );
        return Ok(Some((sub, Some(note))));
    }
    Ok(None)
}

/// A file name of the writer's pattern, for messages.
fn file_name(rank: u64, k: u64, n: u64) -> String {
    format!("shard-{rank:05}-model-{k:05}-of-{n:05}.safetensors")
}

/// What a shape that does not fit may mean for rank files: the full shapes are the
/// extents of the boxes present, so a save whose last ranks' files were not copied
/// reads as a smaller model (no gap in the rank numbers tells). `None` when `ckpt`
/// is not a folder of rank files.
pub fn shape_hint(ckpt: &Checkpoint) -> Option<String> {
    if ckpt.format != Format::HfSharded {
        return None;
    }
    let ranks: BTreeSet<(u64, u64)> = ckpt
        .files
        .iter()
        .filter_map(|b| parse_name(b.path.file_name()?.to_str()?))
        .map(|(r, _, n)| (r, n))
        .collect();
    let &(last, n) = ranks.last()?;
    Some(format!(
        "the full shapes of rank files are the extent of the boxes present, here those of ranks 1 to {last}: if the save ran on more ranks, their files ({}, ...) are missing from {}; copy them in. Otherwise pass the config (--base) of the model that was trained",
        file_name(last + 1, 1, n),
        ckpt.path.display()
    ))
}

/// A tensor being gathered: its dtype, its pieces and the files they are in.
struct Gathered {
    dtype: DType,
    ndim: usize,
    pieces: Vec<Piece>,
    files: BTreeSet<String>,
}

/// Opens a folder of rank files and describes every tensor as the boxes the ranks
/// saved.
pub fn open(dir: &Path) -> Result<Checkpoint> {
    let mut found: Vec<(u64, u64, u64, String, PathBuf)> = Vec::new();
    let mut skipped = Vec::new();
    for e in fs::list(dir)? {
        if e.is_dir {
            continue;
        }
        match parse_name(&e.name) {
            Some((r, k, n)) => found.push((k, r, n, e.name, e.path)),
            None if e.name.ends_with(".safetensors") => skipped.push(e.name),
            None => {}
        }
    }
    found.sort();
    let Some(&(_, _, count, ref first, _)) = found.first() else {
        return Err(Error::NoTensors {
            path: dir.to_path_buf(),
            at: None,
            hint: Some("expected shard-0000R-model-0000K-of-0000N.safetensors files".into()),
        });
    };
    let incomplete = |msg: String| {
        Error::Incomplete {
        path: dir.to_path_buf(),
        msg,
        hint: Some(
            "copy every rank's files of the save into the folder (or pass the folder holding all of them)"
                .into(),
        ),
    }
    };
    if let Some((_, _, _, name, _)) = found.iter().find(|f| f.2 != count) {
        return Err(Error::Corrupt {
            path: dir.to_path_buf(),
            msg: format!(
                "{name} belongs to a save of a different number of files than {first} (two saves mixed in one folder?)"
            ),
        });
    }
    let ranks: BTreeSet<u64> = found.iter().map(|f| f.1).collect();
    let files_k: BTreeSet<u64> = found.iter().map(|f| f.0).collect();
    let max_rank = ranks.last().copied().unwrap_or(0);
    if let Some(r) = (1..=max_rank).find(|r| !ranks.contains(r)) {
        return Err(incomplete(format!(
            "rank {r}'s files ({}, ...) are missing: the folder holds files of ranks {} up to {max_rank}",
            file_name(r, 1, count),
            ranks.first().copied().unwrap_or(0)
        )));
    }
    if let Some(k) = (1..=count).find(|k| !files_k.contains(k)) {
        return Err(incomplete(format!(
            "no rank's part of output file {k} of {count} ({}) is here",
            file_name(1, k, count)
        )));
    }
    if let Some(&(k, r, n, ref name, _)) = found.iter().find(|f| f.0 == 0 || f.0 > f.2 || f.1 == 0)
    {
        return Err(Error::Corrupt {
            path: dir.join(name),
            msg: format!(
                "rank {r}, file {k} of {n}: ranks and files are counted from 1 and a file index is at most the file count"
            ),
        });
    }

    let mut files = Vec::with_capacity(found.len());
    let mut order: Vec<String> = Vec::new();
    let mut tensors: HashMap<String, Gathered> = HashMap::new();
    for (_, _, _, name, path) in &found {
        let blob = Arc::new(fs::open(path)?);
        let header = safetensors::read_header_from(&blob)?;
        let sharding = sharding_info(path, &header.metadata)?;
        let id = files.len();
        files.push(blob);
        for (tname, dtype, shape, begin, _) in &header.tensors {
            let bad = |msg: String| Error::bad_tensor(path, tname, msg);
            let offsets = sharding.get(tname).ok_or_else(|| {
                bad(format!(
                    "not in the file's {SHARDING_KEY}: where its box sits in the full tensor is unknown"
                ))
            })?;
            if offsets.len() != shape.len() {
                return Err(bad(format!(
                    "saved_offsets {offsets:?} do not have the {} dimension(s) of its shape {shape:?}",
                    shape.len()
                )));
            }
            let piece = Piece {
                file: id,
                byte_offset: header.data_start + begin,
                dtype: *dtype,
                shape: shape.clone(),
                strides: contiguous_strides(shape),
                global_offset: offsets.clone(),
                big_endian: false,
            };
            match tensors.get_mut(tname) {
                Some(g) => {
                    if g.dtype != *dtype || g.ndim != shape.len() {
                        return Err(bad(format!(
                            "{dtype} with {} dimension(s) here, but {} with {} in {}",
                            shape.len(),
                            g.dtype,
                            g.ndim,
                            g.files.iter().next().cloned().unwrap_or_default()
                        )));
                    }
                    g.pieces.push(piece);
                    g.files.insert(name.clone());
                }
                None => {
                    order.push(tname.clone());
                    tensors.insert(
                        tname.clone(),
                        Gathered {
                            dtype: *dtype,
                            ndim: shape.len(),
                            pieces: vec![piece],
                            files: BTreeSet::from([name.clone()]),
                        },
                    );
                }
            }
        }
        if let Some(extra) = sharding
            .keys()
            .find(|k| !header.tensors.iter().any(|t| &t.0 == *k))
        {
            return Err(Error::bad_tensor(
                path,
                extra,
                format!("listed in {SHARDING_KEY} but not stored in the file"),
            ));
        }
    }

    let mut out = Vec::with_capacity(order.len());
    for name in order {
        let Some(g) = tensors.remove(&name) else {
            continue;
        };
        let mut shape = vec![0u64; g.ndim];
        for p in &g.pieces {
            for (d, s) in shape.iter_mut().enumerate() {
                let end = p.global_offset[d].checked_add(p.shape[d]).ok_or_else(|| {
                    Error::bad_tensor(
                        dir,
                        &name,
                        format!("saved_offsets {:?} overflow", p.global_offset),
                    )
                })?;
                *s = (*s).max(end);
            }
        }
        let t = TensorSource {
            name: name.clone(),
            dtype: g.dtype,
            shape,
            layout: Some(format!(
                "HF-sharded safetensors, {} box(es) in {} rank file(s)",
                g.pieces.len(),
                g.files.len()
            )),
            pieces: g.pieces.into(),
            storage: None,
        };
        check_coverage(dir, &t).map_err(|e| match e {
            Error::BadTensor { path, tensor, msg } => Error::BadTensor {
                path,
                tensor,
                msg: format!(
                    "{msg} (its boxes are in {})",
                    g.files.iter().cloned().collect::<Vec<_>>().join(", ")
                ),
            },
            e => e,
        })?;
        out.push(t);
    }
    let mut notes = Vec::new();
    if !skipped.is_empty() {
        notes.push(format!(
            "skipped {} (not a rank file of the save)",
            crate::text::list_some(&skipped, 4)
        ));
    }
    Ok(Checkpoint {
        format: Format::HfSharded,
        path: dir.to_path_buf(),
        files,
        key: None,
        tensors: out,
        extras: Vec::new(),
        notes,
        unsafe_calls: Vec::new(),
    })
}

/// The saved offsets of each tensor, from the file's `DCP_SHARDING_INFO`.
fn sharding_info(path: &Path, metadata: &[(String, String)]) -> Result<BTreeMap<String, Vec<u64>>> {
    let text = metadata
        .iter()
        .find(|(k, _)| k == SHARDING_KEY)
        .map(|(_, v)| v)
        .ok_or_else(|| {
            Error::corrupt(
                path,
                format!("named like a rank file of HuggingFaceStorageWriter(save_distributed=True) but its __metadata__ has no {SHARDING_KEY}"),
            )
        })?;
    let json: serde_json::Map<String, serde_json::Value> = serde_json::from_str(text)
        .map_err(|e| Error::corrupt(path, format!("{SHARDING_KEY} is not a JSON object: {e}")))?;
    let mut out = BTreeMap::new();
    for (name, v) in json {
        let offsets: Vec<u64> = v
            .get("saved_offsets")
            .and_then(|o| o.as_array())
            .and_then(|a| a.iter().map(|x| x.as_u64()).collect())
            .ok_or_else(|| {
                Error::bad_tensor(
                    path,
                    &name,
                    format!("{SHARDING_KEY} has no saved_offsets list of non-negative ints"),
                )
            })?;
        out.insert(name, offsets);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn names_of_the_writer_are_parsed_and_others_are_not() {
        assert_eq!(
            parse_name("shard-00002-model-00003-of-00005.safetensors"),
            Some((2, 3, 5))
        );
        assert_eq!(parse_name("model-00001-of-00005.safetensors"), None);
        assert_eq!(parse_name("shard-00002-model-00003-of-00005.bin"), None);
        assert_eq!(parse_name("shard--model-00003-of-00005.safetensors"), None);
        assert_eq!(
            parse_name("shard-0x2-model-00003-of-00005.safetensors"),
            None
        );
    }
}
