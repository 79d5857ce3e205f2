//! Checksums of the output's files compared with what they should be: the block
//! digests the writer took while writing (`merge --verify`: a block read back that
//! differs is a torn or corrupted write), or the file checksums a merge recorded
//! in `unshard.json` (`verify`: a file changed since the merge).
//!
//! The shards' digests come from the content pass's one read (`blocks`); the
//! small files (index, config, tokenizer) are read here.

use std::collections::HashMap;
use std::path::Path;

use super::report::{problem, Problem};
use crate::bytes::fs;
use crate::digest::{hex, Expected, ExpectedDigest, FileDigest, WINDOW_BYTES};
use crate::error::Result;

/// Compares the files of `dir` with `expected`: shards by the digests of the
/// content pass's read (`read`, by file name), other files by reading them.
/// Returns how many files matched.
pub(crate) fn check_files(
    dir: &Path,
    expected: &[Expected],
    read: &HashMap<&str, Option<&FileDigest>>,
    problems: &mut Vec<Problem>,
) -> Result<usize> {
    let mut matched = 0;
    for e in expected {
        let digest = match read.get(e.name.as_str()) {
            // A shard whose read failed is reported by the content pass.
            Some(None) => continue,
            Some(Some(d)) => (*d).clone(),
            None => {
                let path = dir.join(&e.name);
                if !fs::is_file(&path) {
                    problems.push(problem(
                        Some(&e.name),
                        None,
                        "missing: the merge wrote it (it is in unshard.json)",
                    ));
                    continue;
                }
                // A shard the index does not list is read here, a block at a time.
                match fs::is_url(&path) {
                    false => FileDigest::of_file(&path)?,
                    true => FileDigest::of_bytes(&fs::read(&path)?),
                }
            }
        };
        if digest.size != e.size {
            problems.push(problem(
                Some(&e.name),
                None,
                format!(
                    "{} bytes, but the merge wrote {}{}",
                    digest.size,
                    e.size,
                    changed_since(&e.digest)
                ),
            ));
            continue;
        }
        let ok = match &e.digest {
            ExpectedDigest::Written(blocks) => {
                let bad: Vec<usize> = blocks
                    .iter()
                    .zip(&digest.blocks)
                    .enumerate()
                    .filter(|(_, (w, r))| w.is_some() && w != r)
                    .map(|(k, _)| k)
                    .collect();
                if let Some(&k) = bad.first() {
                    let from = k as u64 * WINDOW_BYTES;
                    let to = (from + WINDOW_BYTES).min(e.size);
                    problems.push(problem(
                        Some(&e.name),
                        None,
                        format!(
                            "{} block(s) read back differ from what was written, the first at bytes {from}..{to} (BLAKE3 of each {} MiB block): a torn or corrupted write; check the disk and run the merge again",
                            bad.len(),
                            WINDOW_BYTES >> 20
                        ),
                    ));
                }
                bad.is_empty()
            }
            ExpectedDigest::Recorded(tree) => {
                let found = digest.tree();
                if found.as_ref() != Some(tree) {
                    problems.push(problem(
                        Some(&e.name),
                        None,
                        format!(
                            "its checksum is {}, but unshard.json records {}: the file changed since the merge wrote it",
                            found.as_ref().map_or("unknown".into(), hex),
                            hex(tree)
                        ),
                    ));
                }
                found.as_ref() == Some(tree)
            }
        };
        matched += usize::from(ok);
    }
    Ok(matched)
}

fn changed_since(d: &ExpectedDigest) -> &'static str {
    match d {
        ExpectedDigest::Written(_) => " (a short or torn write)",
        ExpectedDigest::Recorded(_) => ": the file changed since the merge wrote it",
    }
}
