//! Where the parts of a split merge meet when the output is in object storage. A
//! bucket has no rename and no directory to stage in, so the parts agree through
//! objects created with conditional puts (`If-None-Match: *`, object_store's
//! `PutMode::Create`): of two parts creating the same key, exactly one succeeds.
//!
//! Under the output prefix, in `.unshard-parts/`:
//! - `plan`: the plan hash and the number of parts. The first part creates it; a
//!   later part reads it and joins only if its own hash is the same, else it
//!   refuses, naming the other plan and the parts it has done.
//! - `<hash>/done-I-of-N`: part I's done-marker, created once all its shards are
//!   complete objects (each shard is a multipart upload, invisible until complete);
//!   it holds the checksums of those shards, which the committing part writes into
//!   `unshard.json`.
//! - `<hash>/commit`: the commit claim, created by a part that finds every marker
//!   there. S3 lists what was written before (strong read-after-write consistency),
//!   so the last part to write its marker sees them all; if two see them all at
//!   once, the claim picks one.
//!
//! The part holding the claim writes the base's small files, the index and
//! `config.json` last (what loaders open first), deletes objects of an older output
//! (`--force`), then the bookkeeping: `plan` first, so that a part started after
//! that finds a complete output and refuses to write over it without `--force`.
//! A commit that fails (an error, Ctrl-C) deletes the claim again, so running any
//! part again commits.
//!
//! Shards go straight to their final keys: a part that dies or fails (an error,
//! Ctrl-C) aborts its open uploads and leaves the shards it completed (another run
//! of the same part may have written the same objects); run again, it rewrites
//! the same bytes.

use std::path::{Path, PathBuf};

use object_store::{ObjectStoreExt, PutMode, PutOptions, PutPayload};

use super::Part;
use crate::bytes::remote::store::{self, block_on, io_error, Location};
use crate::error::{Error, Result};
use crate::manifest::FileEntry;
use crate::write::bucket::BucketSink;

/// The bookkeeping folder under the output prefix.
const DIR: &str = ".unshard-parts";
const PLAN: &str = "plan";
const COMMIT: &str = "commit";

fn marker(part: Part) -> String {
    format!("done-{}-of-{}", part.index, part.count)
}

/// A part's view of the bucket the parts meet in.
pub struct Meeting {
    dest: Location,
    hash: String,
    part: Part,
    /// Objects under the prefix that are not this plan's (an older output), listed
    /// when the part joined.
    foreign: Vec<String>,
    /// The plan's shard names.
    shards: Vec<String>,
}

/// Creates `loc` with `bytes` unless it exists: `true` if this call created it.
/// A request cut off by the network is made again; a repeat that finds the object
/// there reads it back, since the cut request may have created it: the same bytes
/// are this caller's (each caller writes its own: a part's index, a process id).
fn create(loc: &Location, bytes: Vec<u8>) -> Result<bool> {
    let payload = PutPayload::from(bytes.clone());
    let mut tries = 0;
    let put = block_on(store::again(|| {
        tries += 1;
        let opts = PutOptions::from(PutMode::Create);
        loc.store.put_opts(&loc.key, payload.clone(), opts)
    }));
    match put {
        Ok(_) => Ok(true),
        Err(object_store::Error::AlreadyExists { .. }) if tries > 1 => {
            Ok(store::get_whole(loc)?.as_deref() == Some(bytes.as_slice()))
        }
        Err(object_store::Error::AlreadyExists { .. }) => Ok(false),
        Err(e @ object_store::Error::NotImplemented { .. }) => Err(Error::Unsupported {
            path: loc.url.clone(),
            what: format!("--part with this object store ({e})"),
            hint: Some(
                "the parts agree through conditional puts (If-None-Match); use a store that has them (S3, GCS, Azure, MinIO, R2), or write the parts to a shared filesystem".into(),
            ),
        }),
        Err(e) => Err(io_error("create", &loc.url, e)),
    }
}

fn delete(loc: &Location) -> Result<()> {
    match block_on(store::again(|| loc.store.delete(&loc.key))) {
        Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
        Err(e) => Err(io_error("delete", &loc.url, e)),
    }
}

/// Keys under the prefix that are not bookkeeping.
fn outputs(dest: &Location) -> Result<Vec<String>> {
    Ok(store::list_all(dest)?
        .into_iter()
        .map(|(k, _)| k)
        .filter(|k| !k.starts_with(&format!("{DIR}/")))
        .collect())
}

impl Meeting {
    /// Joins (or starts) the meeting of plan `hash` under `out`. `shards` are the
    /// plan's shard names (objects of that name are this plan's, not foreign).
    /// Refuses another plan's meeting, a plan already being committed, and a
    /// prefix holding an older output unless `force`.
    pub fn open(
        out: &Path,
        hash: &str,
        part: Part,
        shards: &[String],
        force: bool,
    ) -> Result<Meeting> {
        Meeting::open_at(store::locate(out)?, hash, part, shards, force)
    }

    /// [`Meeting::open`] with the output's location resolved.
    fn open_at(
        dest: Location,
        hash: &str,
        part: Part,
        shards: &[String],
        force: bool,
    ) -> Result<Meeting> {
        let out = &dest.url.clone();
        if dest.multipart.is_none() {
            return Err(Error::Output {
                path: out.to_path_buf(),
                msg: "this store is read-only for unshard (plain HTTP has no uploads)".into(),
                hint: Some("write to s3://, gs:// or az:// instead".into()),
            });
        }
        let dir = dest.child(DIR);
        // Listed before the plan exists: nothing of this plan can be there yet.
        let before = outputs(&dest)?;
        let body = serde_json::json!({ "plan": hash, "parts": part.count }).to_string();
        let plan_loc = dir.child(PLAN);
        let created = create(&plan_loc, body.into_bytes())?;
        let foreign = if created {
            before
        } else {
            let text = store::get_whole(&plan_loc)?.unwrap_or_default();
            let other = serde_json::from_slice::<serde_json::Value>(&text)
                .ok()
                .and_then(|v| v.get("plan").and_then(|p| p.as_str()).map(str::to_string))
                .unwrap_or_default();
            if other != hash {
                return Err(other_plan(out, &dir, hash, &other, part));
            }
            // Shards of this plan are the other parts' work.
            before.into_iter().filter(|k| !shards.contains(k)).collect()
        };
        let meeting = Meeting {
            dest,
            hash: hash.to_string(),
            part,
            foreign,
            shards: shards.to_vec(),
        };
        if store::head(&meeting.dir().child(COMMIT))?.is_some() {
            return Err(Error::Output {
                path: out.to_path_buf(),
                msg: format!(
                    "part {}/{}: every part of plan {hash} is done and another part is committing the output",
                    part.index, part.count
                ),
                hint: Some(format!(
                    "nothing to do; if that part died while committing, delete {} and run this part again",
                    meeting.dir().child(COMMIT).url.display()
                )),
            });
        }
        if !meeting.foreign.is_empty() {
            if !force {
                // Leave the prefix as found when this part started the meeting.
                if created {
                    let _ = delete(&plan_loc);
                }
                return Err(Error::Output {
                    path: out.to_path_buf(),
                    msg: format!(
                        "it is not empty ({} object(s) that are not this merge's, such as {})",
                        meeting.foreign.len(),
                        meeting.foreign[0]
                    ),
                    hint: Some("pass --force (to every part) to replace what is there".into()),
                });
            }
            // An older output stops being loadable before new shards land beside it.
            for old in ["config.json", "model.safetensors.index.json"] {
                if meeting.foreign.iter().any(|k| k == old) {
                    delete(&meeting.dest.child(old))?;
                }
            }
        }
        Ok(meeting)
    }

    fn dir(&self) -> Location {
        self.dest.child(DIR).child(&self.hash)
    }

    /// Where the bookkeeping lives, for messages.
    pub fn path(&self) -> PathBuf {
        self.dir().url
    }

    /// The sink this part writes its shards through (straight to their keys).
    pub fn shard_sink(&self) -> Result<BucketSink> {
        BucketSink::for_part(&self.dest.url, Vec::new(), true)
    }

    fn done_markers(&self) -> Result<Vec<String>> {
        Ok(store::list_all(&self.dir())?
            .into_iter()
            .map(|(k, _)| k)
            .filter(|k| k.starts_with("done-"))
            .collect())
    }

    /// Creates this part's done-marker (once: a rerun finds it there), holding the
    /// checksums of the shards it wrote; returns the parts not done yet.
    pub fn mark_done(&self, files: &[FileEntry]) -> Result<Vec<usize>> {
        let text = serde_json::json!({
            "part": self.part.index,
            "of": self.part.count,
            "pid": std::process::id(),
            "files": files,
        });
        let mine = self.dir().child(&marker(self.part));
        create(&mine, text.to_string().into_bytes())?;
        if store::head(&self.dest.child(DIR).child(PLAN))?.is_none() {
            // Another run of this part finished and the output was committed while
            // this one was writing (the same bytes): leave no marker behind.
            delete(&mine)?;
            return Err(Error::Output {
                path: self.dest.url.clone(),
                msg: format!(
                    "part {}/{}: the output was committed while this run was writing (another run of the same part finished first)",
                    self.part.index, self.part.count
                ),
                hint: Some("nothing to do: the output is complete".into()),
            });
        }
        let done = self.done_markers()?;
        Ok((0..self.part.count)
            .filter(|&i| {
                let p = Part {
                    index: i,
                    count: self.part.count,
                };
                !done.contains(&marker(p))
            })
            .collect())
    }

    /// The checksums the parts' done-markers hold.
    pub fn checksums(&self) -> Result<Vec<FileEntry>> {
        #[derive(serde::Deserialize)]
        struct Marker {
            #[serde(default)]
            files: Vec<FileEntry>,
        }
        let mut found = Vec::new();
        for name in self.done_markers()? {
            let loc = self.dir().child(&name);
            let bytes = store::get_whole(&loc)?.ok_or_else(|| {
                Error::corrupt(&loc.url, "a part's done-marker vanished while it was read")
            })?;
            let m: Marker = serde_json::from_slice(&bytes)
                .map_err(|e| Error::corrupt(&loc.url, format!("not a part's done-marker: {e}")))?;
            found.extend(m.files);
        }
        Ok(found)
    }

    /// Claims the commit: true for exactly one part.
    pub fn claim_commit(&self) -> Result<bool> {
        create(
            &self.dir().child(COMMIT),
            format!("{}\n", self.part.index).into_bytes(),
        )
    }

    /// Gives the commit claim back (the commit failed): the next part to find every
    /// marker commits.
    pub fn release_claim(&self) {
        let _ = delete(&self.dir().child(COMMIT));
    }

    /// The sink the committing part writes the small files through: `commit`
    /// writes the index and `config.json` last and deletes the older output's
    /// objects that the new one does not have.
    pub fn commit_sink(&self) -> Result<BucketSink> {
        let old = self.foreign.iter().filter(|k| !self.shards.contains(k));
        BucketSink::for_part(&self.dest.url, old.cloned().collect(), false)
    }

    /// Removes the bookkeeping once the output is complete: the plan first (see the
    /// module docs), then the markers and the claim.
    pub fn finish(&self) -> Result<()> {
        delete(&self.dest.child(DIR).child(PLAN))?;
        let dir = self.dir();
        for (k, _) in store::list_all(&dir)? {
            delete(&dir.child(&k))?;
        }
        Ok(())
    }
}

fn other_plan(out: &Path, dir: &Location, hash: &str, other: &str, part: Part) -> Error {
    let done: Vec<String> = if other.is_empty() {
        Vec::new()
    } else {
        store::list_all(&dir.child(other))
            .map(|l| {
                l.into_iter()
                    .map(|(k, _)| k)
                    .filter(|k| k.starts_with("done-"))
                    .collect()
            })
            .unwrap_or_default()
    };
    Error::Output {
        path: out.to_path_buf(),
        msg: format!(
            "part {}/{} computed plan {hash}, but the parts already working on this output have another plan ({}; finished: {}): they were started with other inputs, options or number of parts",
            part.index,
            part.count,
            if other.is_empty() { "unreadable" } else { other },
            if done.is_empty() { "none".to_string() } else { done.join(", ") }
        ),
        hint: Some(format!(
            "start every part with the same command; to abandon the other merge, delete the objects under {}",
            dir.url.display()
        )),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use std::sync::Arc;

    use object_store::memory::InMemory;
    use object_store::multipart::MultipartStore;
    use object_store::ObjectStore;

    use crate::bytes::remote::cut::Cut;

    /// `s3://<bucket>/out` in a new bucket on the test server
    /// ([`crate::bytes::remote::cut::server_bucket`]).
    fn test_output(bucket: &str) -> Location {
        let (bucket, s3) = crate::bytes::remote::cut::server_bucket(bucket);
        Location {
            store: s3.clone(),
            multipart: Some(s3),
            key: "out".into(),
            url: format!("s3://{bucket}/out").into(),
        }
    }

    fn part(index: usize, count: usize) -> Part {
        Part { index, count }
    }

    /// Two parts finishing at once both find every marker: the conditional put lets
    /// exactly one of them commit. Against a real S3-compatible server.
    #[test]
    #[ignore = "needs moto_server on UNSHARD_TEST_S3_ENDPOINT (see docs/testing.md)"]
    fn of_two_parts_that_see_every_marker_exactly_one_claims_the_commit() {
        exactly_one_claims(test_output("claim"));
    }

    /// The same against object_store's in-memory store (conditional puts included),
    /// in every `cargo test`.
    #[test]
    fn of_two_parts_in_a_memory_store_exactly_one_claims_the_commit() {
        exactly_one_claims(memory_output(Arc::new(InMemory::new())));
    }

    /// `s3://mem/out` on `store`, a store of this process.
    fn memory_output<S: ObjectStore + MultipartStore + 'static>(store: Arc<S>) -> Location {
        Location {
            store: store.clone(),
            multipart: Some(store),
            key: "out".into(),
            url: "s3://mem/out".into(),
        }
    }

    /// Conditional puts whose connection is cut, before the server made the object
    /// or after (the answer lost): made again, and a repeat that finds the object
    /// tells this part's own claim from another's by its bytes. Exactly one of two
    /// parts claims the commit either way, and a part's marker counts as written.
    #[test]
    fn a_claim_or_marker_cut_off_by_the_network_is_still_this_parts() {
        for after in [false, true] {
            let cut = Arc::new(Cut::new(&[("put", 1, after)]));
            let out = memory_output(cut.clone());
            // The plan, each marker and the first claim each cut once.
            let a = Meeting::open_at(out.clone(), "h1", part(0, 2), &[], false).unwrap();
            let b = Meeting::open_at(out.clone(), "h1", part(1, 2), &[], false).unwrap();
            cut.arm("put", 1, after);
            assert_eq!(a.mark_done(&[]).unwrap(), [1], "after: {after}");
            cut.arm("put", 1, after);
            assert_eq!(
                b.mark_done(&[]).unwrap(),
                Vec::<usize>::new(),
                "after: {after}"
            );
            cut.arm("put", 1, after);
            let claims = [a.claim_commit().unwrap(), b.claim_commit().unwrap()];
            assert_eq!(claims, [true, false], "after: {after}");
            assert_eq!(cut.cut.lock().unwrap().len(), 4, "after: {after}");
        }
    }

    /// Objects already under the output prefix: another plan's output is refused
    /// without `--force` (and the prefix left as found), and with it its index and
    /// config go first; the shards this plan's other parts wrote are not foreign.
    #[test]
    fn an_older_output_is_refused_unless_forced_and_a_partners_shards_are_not_foreign() {
        let keys = |out: &Location| -> Vec<String> {
            let mut k: Vec<String> = store::list_all(out)
                .unwrap()
                .into_iter()
                .map(|(k, _)| k)
                .collect();
            k.sort();
            k
        };
        let out = memory_output(Arc::new(InMemory::new()));
        assert!(create(&out.child("config.json"), b"{}".to_vec()).unwrap());
        assert!(create(&out.child("old.safetensors"), b"old".to_vec()).unwrap());
        let err = Meeting::open_at(out.clone(), "h1", part(0, 1), &[], false)
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("not empty (2 object(s)"), "{err}");
        assert_eq!(keys(&out), ["config.json", "old.safetensors"]);
        Meeting::open_at(out.clone(), "h1", part(0, 1), &[], true).unwrap();
        assert!(keys(&out).contains(&"old.safetensors".to_string()));
        assert!(!keys(&out).contains(&"config.json".to_string()));

        let out = memory_output(Arc::new(InMemory::new()));
        let shards = ["s1.safetensors".to_string(), "s2.safetensors".to_string()];
        let a = Meeting::open_at(out.clone(), "h1", part(0, 2), &shards, false).unwrap();
        assert_eq!(a.path(), Path::new("s3://mem/out/.unshard-parts/h1"));
        assert!(create(&out.child("s1.safetensors"), b"s1".to_vec()).unwrap());
        Meeting::open_at(out.clone(), "h1", part(1, 2), &shards, false).unwrap();
    }

    /// The committing part deletes an older output's objects, never a shard of its
    /// own plan that the older output also had (another part rewrote it); a claim
    /// given back after a failed commit can be taken again.
    #[test]
    fn the_commit_deletes_only_the_older_outputs_objects_and_a_released_claim_is_free() {
        let mem = Arc::new(InMemory::new());
        store::register("s3://parts-commit", mem.clone());
        let out = store::locate(Path::new("s3://parts-commit/out")).unwrap();
        assert!(create(&out.child("s1.safetensors"), b"old s1".to_vec()).unwrap());
        assert!(create(&out.child("old.safetensors"), b"old".to_vec()).unwrap());
        let shards = ["s1.safetensors".to_string()];
        let a = Meeting::open_at(out.clone(), "h1", part(0, 1), &shards, true).unwrap();
        assert_eq!(a.mark_done(&[]).unwrap(), Vec::<usize>::new());
        assert!(a.claim_commit().unwrap());
        a.release_claim();
        assert!(a.claim_commit().unwrap());
        let sink = a.commit_sink().unwrap();
        crate::write::Sink::commit(Box::new(sink)).unwrap();
        a.finish().unwrap();
        let keys: Vec<String> = store::list_all(&out)
            .unwrap()
            .into_iter()
            .map(|(k, _)| k)
            .collect();
        assert_eq!(keys, ["s1.safetensors"]);
    }

    fn exactly_one_claims(out: Location) {
        let a = Meeting::open_at(out.clone(), "h1", part(0, 2), &[], false).unwrap();
        let b = Meeting::open_at(out.clone(), "h1", part(1, 2), &[], false).unwrap();
        let entry = |name: &str| FileEntry {
            name: name.into(),
            size: 7,
            checksum: Some(format!("sum-of-{name}")),
        };
        assert_eq!(a.mark_done(&[entry("s1")]).unwrap(), [1]);
        assert_eq!(b.mark_done(&[entry("s2")]).unwrap(), Vec::<usize>::new());
        // A part run again finds its marker there, and the others' too.
        assert_eq!(a.mark_done(&[entry("s1")]).unwrap(), Vec::<usize>::new());
        // The markers carry each part's checksums to the committing part.
        let mut sums = a.checksums().unwrap();
        sums.sort_by(|x, y| x.name.cmp(&y.name));
        assert_eq!(sums, [entry("s1"), entry("s2")]);
        let claims = [a.claim_commit().unwrap(), b.claim_commit().unwrap()];
        assert_eq!(claims, [true, false]);
        assert!(!a.claim_commit().unwrap(), "a claim is taken once");
        // A late part of the same plan is told the commit is under way.
        let late = Meeting::open_at(out.clone(), "h1", part(1, 2), &[], false);
        let err = late.err().unwrap().to_string();
        assert!(err.contains("committing"), "{err}");
        // A part of another plan refuses, naming the parts the first plan has done.
        let other = Meeting::open_at(out.clone(), "h2", part(0, 2), &[], false);
        let err = other.err().unwrap().to_string();
        assert!(
            err.contains("another plan") && err.contains("done-0-of-2, done-1-of-2"),
            "{err}"
        );
        // Once finished, nothing of the bookkeeping is left, and a run of a part
        // that ends after the commit leaves no marker either.
        a.finish().unwrap();
        assert!(store::list_all(&out).unwrap().is_empty());
        let err = b.mark_done(&[]).unwrap_err().to_string();
        assert!(err.contains("committed while"), "{err}");
        assert!(store::list_all(&out).unwrap().is_empty());
    }
}
