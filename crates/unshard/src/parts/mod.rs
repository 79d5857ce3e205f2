//! One merge split over N processes or machines: `--part I/N` (or `auto`, from the
//! launcher's variables; see [`Part::from_env`]).
//!
//! Every part opens the same inputs and computes the same plan (planning is
//! deterministic), so the parts agree on every output byte without talking. The
//! shards are dealt out by size (`assign`); part I writes only its own. They meet
//! in a staging directory beside the output, named by a hash of the plan
//! (`.<out>.unshard-parts-<hash>`), on a filesystem every part sees:
//!
//! 1. part I writes its shards there under temporary names, fsyncs them, and
//!    renames them to their final names (a shard present is a shard complete);
//! 2. it then creates its done-marker `done-I-of-N` (written aside and renamed into
//!    place: atomic);
//! 3. a part that finds every marker present tries to create `commit` with
//!    `O_EXCL`; the one that succeeds writes the index, the config and the base's
//!    small files, and renames the staging directory into place as the output (as a
//!    single-process merge does). Markers are created before they are counted, so
//!    the last part to finish always sees them all: the output is committed exactly
//!    once.
//!
//! A part that dies leaves the others' shards and markers: running it again (same
//! command) writes its shards and finishes the job. A part whose plan differs
//! (other inputs or options, another N) has another hash, and refuses to start
//! while the staging directory of another plan for the same output exists.
//!
//! A LoRA adapter's fused weights are computed tensors like any other: every part
//! plans the same fuses, and the part that owns a shard computes the tensors in it
//! (the engine evaluates them block by block); with `--no-fuse`, the committing
//! part writes the adapter directory with the small files.
//!
//! With the output in object storage the parts meet in the bucket instead, through
//! conditional puts (`bucket`).
//!
//! Reads stay local to a part only where its shards' tensors live in files it can
//! read; every part opens every input file's metadata, so each must see all inputs
//! (a shared filesystem, or object storage).

mod assign;
#[cfg(feature = "remote")]
mod bucket;
mod shared_dir;

use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};

pub use assign::{assign, Part};

use crate::error::{Error, Result};
use crate::manifest::{FileEntry, Manifest, MANIFEST};
use crate::merge::MergeOptions;
use crate::plan::Plan;
use crate::prepare::{prepare, Prepared};
use crate::source::audit::UnsafeCall;
use crate::source::{fs, Checkpoint};
use crate::write::{self, Progress, WriteOptions};
use shared_dir::PartDir;

/// What one part did.
#[derive(Debug)]
pub struct PartOutcome {
    /// How many shards the whole merge writes (every part plans them all).
    pub total_shards: usize,
    /// The plan's hash, which names the staging directory.
    pub plan_hash: String,
    /// The shards this part wrote.
    pub shards: Vec<String>,
    /// Whether this part committed the output (it finished last).
    pub committed: bool,
    /// Parts not done yet when this one finished (empty when committed).
    pub waiting_for: Vec<usize>,
    /// The staging directory the parts share.
    pub staging: PathBuf,
}

/// What a part says once its shards are in place, before it marks itself done.
fn done_stage(part: Part) -> String {
    format!(
        "part {} of {}: shards written, marking the part done",
        part.index, part.count
    )
}

/// Runs part `part` of the merge `opts`.
pub fn merge_part(opts: &MergeOptions, part: Part, progress: &dyn Progress) -> Result<PartOutcome> {
    let remote = fs::is_url(&opts.output);
    if remote && !cfg!(feature = "remote") {
        return Err(Error::Unsupported {
            path: opts.output.clone(),
            what: "writing to object storage in this build".into(),
            hint: Some(
                "build unshard with the `remote` feature (the default for the command-line tool)"
                    .into(),
            ),
        });
    }
    if opts.verify {
        return Err(Error::Usage(
            "--verify with --part: run `unshard verify` on the output once the last part has committed it".into(),
        ));
    }
    let mut protected = vec![opts.checkpoint.clone()];
    protected.extend(opts.base.clone());
    let wopts = WriteOptions {
        force: opts.force,
        allow_overflow: opts.allow_overflow,
        extra_files: Vec::new(),
        protected,
        cancel: opts.cancel.clone(),
        checksums: !opts.no_manifest,
    };
    if !remote {
        write::check_output(&opts.output, &wopts)?;
    }
    progress.stage(&format!(
        "reading {} (part {} of {})",
        opts.checkpoint.display(),
        part.index,
        part.count
    ));
    let Prepared {
        checkpoint: ckpt,
        base,
        plan,
        adapter,
    } = prepare(opts)?;
    crate::merge::check_loadable(opts, &plan)?;
    let calls = crate::prepare::unsafe_calls(&ckpt, base.as_ref());
    let inputs = Prepared::inputs_of(&ckpt, base.as_ref());
    let hash = plan_hash(&plan, inputs, opts, part.count);
    let sizes: Vec<u64> = plan.shards.iter().map(|s| s.file_size).collect();
    let owner = assign(&sizes, part.count);
    let mut mine = plan.clone();
    mine.shards = plan
        .shards
        .iter()
        .zip(&owner)
        .filter(|(_, &o)| o == part.index)
        .map(|(s, _)| s.clone())
        .collect();
    mine.index = None;
    mine.config = None;
    let shards: Vec<String> = mine.shards.iter().map(|s| s.file_name.clone()).collect();
    let extra = WriteOptions {
        extra_files: base
            .as_ref()
            .map(|b| b.dir.extra_files.clone())
            .unwrap_or_default(),
        ..wopts.clone()
    };
    let mut last = plan.clone();
    last.shards.clear();
    #[cfg(feature = "remote")]
    if remote {
        if adapter.as_deref().is_some_and(|a| a.no_fuse()) {
            return Err(Error::Usage(crate::merge::NO_FUSE_NEEDS_A_DIRECTORY.into()));
        }
        let all: Vec<String> = plan.shards.iter().map(|s| s.file_name.clone()).collect();
        let meeting = bucket::Meeting::open(&opts.output, &hash, part, &all, opts.force)?;
        let sink = meeting.shard_sink()?;
        let written = write::write_into(&mine, inputs, &sink, &wopts, progress)?;
        write::Sink::commit(Box::new(sink))?;
        progress.stage(&done_stage(part));
        // The done-marker carries this part's checksums, for unshard.json.
        let waiting_for =
            meeting.mark_done(&FileEntry::of_written(&written.files, &written.digests))?;
        let mut committed = false;
        if waiting_for.is_empty() && meeting.claim_commit()? {
            let commit = || -> Result<()> {
                let sink = meeting.commit_sink()?;
                let small = write::write_into(&last, inputs, &sink, &extra, &write::NoProgress)?;
                if !opts.no_manifest {
                    let bytes = manifest(opts, &ckpt, &plan, meeting.checksums()?, &small, &calls);
                    write::Sink::write_file(&sink, MANIFEST, &bytes)?;
                }
                write::Sink::commit(Box::new(sink))?;
                meeting.finish()
            };
            // A commit that fails (an error, Ctrl-C) gives the claim back, so that
            // running any part again commits.
            commit().inspect_err(|_| meeting.release_claim())?;
            committed = true;
        }
        return Ok(PartOutcome {
            total_shards: plan.shards.len(),
            plan_hash: hash,
            shards,
            committed,
            waiting_for,
            staging: meeting.path(),
        });
    }
    let dir = PartDir::open(&opts.output, &hash, part)?;
    let written = write::write_into(&mine, inputs, &dir, &wopts, progress)?;
    dir.publish_shards(&shards)?;
    progress.stage(&done_stage(part));
    if !opts.no_manifest {
        // For the part that commits: it writes every shard's checksum in unshard.json.
        let entries = FileEntry::of_written(&written.files, &written.digests);
        let path = dir.path().join(format!(
            "{}{}-of-{}.json",
            shared_dir::CHECKSUMS,
            part.index,
            part.count
        ));
        write::write_file(&path, &serde_json::to_vec(&entries).unwrap_or_default())?;
    }
    let waiting_for = dir.mark_done()?;
    let mut committed = false;
    if waiting_for.is_empty() && dir.claim_commit()? {
        // The last part: index, config and the base's small files, then the rename.
        let small = write::write_into(&last, inputs, &dir, &extra, &write::NoProgress)?;
        if !opts.no_manifest {
            let bytes = manifest(
                opts,
                &ckpt,
                &plan,
                shard_checksums(dir.path())?,
                &small,
                &calls,
            );
            write::write_file(&dir.path().join(MANIFEST), &bytes)?;
        }
        if let Some(a) = adapter.as_deref().filter(|a| a.no_fuse()) {
            // `--no-fuse`: the adapter directory goes in with the small files.
            crate::lora::export::write_adapter_dir(
                &dir.path().join("adapter"),
                a.resolved(),
                &ckpt.files,
            )?;
        }
        dir.commit(&opts.output, opts.force)?;
        committed = true;
    }
    Ok(PartOutcome {
        total_shards: plan.shards.len(),
        plan_hash: hash,
        shards,
        committed,
        waiting_for,
        staging: dir.path().to_path_buf(),
    })
}

/// The checksums the parts left in the staging directory, in files beside their
/// shards.
fn shard_checksums(dir: &Path) -> Result<Vec<FileEntry>> {
    let mut found = Vec::new();
    for e in std::fs::read_dir(dir)
        .map_err(|e| Error::io("list", dir, e))?
        .flatten()
    {
        if !e
            .file_name()
            .to_string_lossy()
            .starts_with(shared_dir::CHECKSUMS)
        {
            continue;
        }
        let bytes = std::fs::read(e.path()).map_err(|err| Error::io("read", e.path(), err))?;
        let entries: Vec<FileEntry> = serde_json::from_slice(&bytes)
            .map_err(|err| Error::corrupt(e.path(), format!("not a list of checksums: {err}")))?;
        found.extend(entries);
    }
    Ok(found)
}

/// `unshard.json` of a split merge: every shard's entry from the checksums the parts
/// left (`shards`), then the small files the committing part wrote.
fn manifest(
    opts: &MergeOptions,
    ckpt: &Checkpoint,
    plan: &Plan,
    shards: Vec<FileEntry>,
    small: &write::WriteSummary,
    unsafe_calls: &[UnsafeCall],
) -> Vec<u8> {
    let mut files = in_plan_order(plan, shards);
    files.extend(FileEntry::of_written(&small.files, &small.digests));
    Manifest::new(opts, ckpt.format.id(), plan.dtype, files, unsafe_calls).to_bytes()
}

/// Every shard's entry for `unshard.json`, in the plan's order, from those the
/// parts left; a shard whose part left none gets its size only.
fn in_plan_order(plan: &Plan, found: Vec<FileEntry>) -> Vec<FileEntry> {
    let mut found: std::collections::HashMap<String, FileEntry> =
        found.into_iter().map(|f| (f.name.clone(), f)).collect();
    plan.shards
        .iter()
        .map(|s| {
            found.remove(&s.file_name).unwrap_or(FileEntry {
                name: s.file_name.clone(),
                size: s.file_size,
                checksum: None,
            })
        })
        .collect()
}

/// A hash of everything that decides the output's bytes: the number of parts, the
/// options, every shard's layout (names, sizes, headers), the index and config,
/// and where each tensor's bytes come from (input files by path and length).
/// Parts that disagree on any of it compute different hashes.
pub fn plan_hash(
    plan: &Plan,
    inputs: crate::prepare::Inputs<'_>,
    opts: &MergeOptions,
    count: usize,
) -> String {
    let mut h = DefaultHasher::new();
    count.hash(&mut h);
    let p = &opts.plan;
    let renames: Vec<(&str, &str)> = p
        .renames
        .iter()
        .map(|(r, s)| (r.as_str(), s.as_str()))
        .collect();
    // Options by value (not by `Debug` of trait objects, which could differ between
    // processes); what the mappings did is in the plan's tensors below.
    format!(
        "{:?}|{}|{renames:?}|{}|{:?}|{}",
        p.dtype, p.strict, p.max_shard_size, opts.open.key, opts.allow_overflow
    )
    .hash(&mut h);
    for s in &plan.shards {
        (&s.file_name, s.file_size, &s.header).hash(&mut h);
    }
    plan.index.hash(&mut h);
    serde_json::to_string(&plan.config)
        .unwrap_or_default()
        .hash(&mut h);
    for t in &plan.tensors {
        format!("{:?}|{:?}|{:?}", t.name, t.dtype, t.content).hash(&mut h);
    }
    for c in inputs.all() {
        for f in &c.files {
            (f.path.to_string_lossy(), f.len()).hash(&mut h);
        }
    }
    format!("{:016x}", h.finish())
}

/// The staging directory of a split merge into `out` with plan hash `hash`.
#[cfg_attr(not(feature = "internals"), allow(dead_code))] // for the tests and fuzz targets
pub fn staging_dir(out: &Path, hash: &str) -> PathBuf {
    shared_dir::staging_dir(out, hash)
}

#[cfg(test)]
mod tests;
