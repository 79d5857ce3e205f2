//! A merge's output in object storage: the [`Sink`] for `--output s3://...`.
//!
//! Shards are uploaded while the engine writes them, as multipart uploads whose
//! parts are the engine's blocks: block `k` of a shard (bytes `[k × 8 MiB, ...)`) is
//! part `k + 1`, uploaded by the worker that filled it, in whatever order the
//! blocks finish. Nothing is staged on local disk, and the memory is the engine's
//! (a block per worker, plus the copy handed to the upload while it is in flight).
//! The limit this sets: 10 000 parts of 8 MiB, an 80 GB shard (the default
//! `--max-shard-size` is 5 GB).
//!
//! What appears, and when:
//! 1. When the sink opens, a manifest `.unshard-run.json` with a fresh run id, the
//!    host and process, is written under the output prefix: anything later found
//!    beside it is recognisable as this run's.
//! 2. Each shard's upload is completed when its last block is written ([`ShardFile::finish`]).
//! 3. [`Sink::commit`]: the small files (tokenizer files, then the index, then
//!    `config.json`, which loaders open first) are written last, objects of an older
//!    output that the new one does not have are deleted (`--force`), and the
//!    manifest is removed.
//!
//! On any error, Ctrl-C included (the merge returns an error and drops the sink),
//! open multipart uploads are aborted and every object this run completed is
//! deleted, manifest included. A run killed outright leaves its manifest (and
//! completed shards); the next run to that prefix reports them, and `--force`
//! deletes them. Incomplete multipart uploads of a killed run are invisible to
//! readers; a bucket lifecycle rule (`AbortIncompleteMultipartUpload`) reclaims them.
//!
//! Computed tensors (adapters fused, remaps) are filled into the blocks that hold
//! them, like copies, so they are uploaded with their parts. [`ShardFile::write_at`]
//! (a write at an arbitrary offset, which an uploaded part cannot take back) is
//! refused with a hint to write locally and upload.

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use object_store::multipart::{MultipartStore, PartId};
use object_store::path::Path as Key;
use object_store::{ObjectStoreExt, ObjectStoreScheme, PutPayload};

use super::{ShardFile, Sink, WINDOW_BYTES};
use crate::bytes::remote::store::{self, block_on, io_error, Location};
use crate::error::{Error, Result};

/// The manifest's name under the output prefix.
pub const MANIFEST: &str = ".unshard-run.json";

/// Most parts a multipart upload may have (S3, GCS).
const MAX_PARTS: u64 = 10_000;

/// Objects this run wrote, and uploads it has open: what a failure undoes.
#[derive(Default)]
struct Undo {
    written: Vec<Key>,
    open: Vec<(Key, String)>,
}

/// An output prefix being written.
pub struct BucketSink {
    dest: Location,
    multipart: Arc<dyn MultipartStore>,
    run_id: String,
    undo: Arc<Mutex<Undo>>,
    /// Small files, held until the commit writes them last.
    small: Mutex<Vec<(String, Vec<u8>)>>,
    /// Objects of an older output to delete once the new one is complete (`--force`).
    replaced: Vec<String>,
    committed: AtomicBool,
    /// On failure, keep the objects completed (a part's shards: another run of the
    /// same part may have written the same objects, and a rerun rewrites them).
    keep_completed: bool,
    /// Whether this run keeps a manifest (parts do not).
    has_manifest: bool,
    /// Files this run writes, as its manifest lists them.
    files: Mutex<Vec<String>>,
    /// When the run started (seconds since 1970).
    started: u64,
}

/// What is under an output prefix before a run writes there.
pub struct Existing {
    /// Every key below the prefix, relative to it.
    pub keys: Vec<String>,
    /// The manifest of a run that did not finish, if one is there.
    pub stale_run: Option<String>,
}

/// Lists what is under `dest` (uncached).
pub fn existing(dest: &Location) -> Result<Existing> {
    let keys: Vec<String> = store::list_all(dest)?.into_iter().map(|(k, _)| k).collect();
    let stale_run = if keys.iter().any(|k| k == MANIFEST) {
        store::get_whole(&dest.child(MANIFEST))?.map(|b| String::from_utf8_lossy(&b).into_owned())
    } else {
        None
    };
    Ok(Existing { keys, stale_run })
}

/// Checks that a run may write to `dest_url`, before anything is read: the store
/// takes uploads, and the prefix is empty or `force` is given (a stale run's
/// leftovers are named in the refusal).
pub fn check_output(dest_url: &Path, force: bool) -> Result<()> {
    let dest = store::locate(dest_url)?;
    if dest.multipart.is_none() {
        return Err(read_only(dest_url));
    }
    let found = existing(&dest)?;
    may_replace(dest_url, &dest, &found, force)
}

/// Whether a run may write where `found` is: an empty prefix, or with `force` one
/// holding only what an earlier unshard output wrote: the files its `unshard.json`
/// lists (and that file), or those a run that did not finish listed in its
/// manifest. Anything else is named and left alone.
fn may_replace(dest_url: &Path, dest: &Location, found: &Existing, force: bool) -> Result<()> {
    if found.keys.is_empty() {
        return Ok(());
    }
    if !force {
        return Err(not_empty(dest_url, found));
    }
    let mut ours: Vec<String> = vec![MANIFEST.into(), OUTPUT_MANIFEST.into()];
    if found.keys.iter().any(|k| k == OUTPUT_MANIFEST) {
        if let Some(bytes) = store::get_whole(&dest.child(OUTPUT_MANIFEST))? {
            ours.extend(listed(&bytes, "files", Some("name")));
        }
    }
    if let Some(run) = &found.stale_run {
        ours.extend(listed(run.as_bytes(), "files", None));
    }
    let foreign: Vec<&String> = found.keys.iter().filter(|k| !ours.contains(k)).collect();
    if foreign.is_empty() {
        return Ok(());
    }
    Err(Error::Output {
        path: dest_url.to_path_buf(),
        msg: format!(
            "--force replaces only an earlier unshard output, and {} object(s) here are not part of one (no {OUTPUT_MANIFEST} or unfinished run's {MANIFEST} lists them): {}",
            foreign.len(),
            crate::text::list_some(&foreign, 10)
        ),
        hint: Some(
            "write to an empty prefix, or move or delete those objects yourself first".into(),
        ),
    })
}

/// The output manifest a finished merge writes beside its files.
const OUTPUT_MANIFEST: &str = "unshard.json";

/// The strings of array `key` in a JSON document (or field `field` of its objects).
fn listed(bytes: &[u8], key: &str, field: Option<&str>) -> Vec<String> {
    let Ok(v) = serde_json::from_slice::<serde_json::Value>(bytes) else {
        return Vec::new();
    };
    let Some(items) = v.get(key).and_then(|a| a.as_array()) else {
        return Vec::new();
    };
    items
        .iter()
        .filter_map(|i| match field {
            Some(f) => i.get(f)?.as_str(),
            None => i.as_str(),
        })
        .map(str::to_string)
        .collect()
}

fn read_only(dest_url: &Path) -> Error {
    Error::Output {
        path: dest_url.to_path_buf(),
        msg: "this store is read-only for unshard (plain HTTP has no uploads)".into(),
        hint: Some("write to s3://, gs:// or az:// instead".into()),
    }
}

fn not_empty(dest_url: &Path, found: &Existing) -> Error {
    let msg = match &found.stale_run {
        Some(m) => format!(
            "it holds {} object(s) left by a run that did not finish (manifest {MANIFEST}: {})",
            found.keys.len(),
            m.trim()
        ),
        None => format!("it is not empty ({} object(s))", found.keys.len()),
    };
    Error::Output {
        path: dest_url.to_path_buf(),
        msg,
        hint: Some("pass --force to replace what is there".into()),
    }
}

impl BucketSink {
    /// Opens `dest` for a new output: refuses a non-empty prefix unless `force`
    /// (a stale run's leftovers are named), then writes the run's manifest.
    pub fn create(dest_url: &Path, force: bool) -> Result<BucketSink> {
        let dest = store::locate(dest_url)?;
        let multipart = dest.multipart.clone().ok_or_else(|| read_only(dest_url))?;
        let found = existing(&dest)?;
        may_replace(dest_url, &dest, &found, force)?;
        let run_id = run_id();
        let sink = BucketSink {
            dest,
            multipart,
            run_id,
            undo: Arc::default(),
            small: Mutex::new(Vec::new()),
            replaced: found.keys,
            committed: AtomicBool::new(false),
            keep_completed: false,
            has_manifest: true,
            files: Mutex::new(Vec::new()),
            started: now(),
        };
        sink.write_run_manifest()?;
        Ok(sink)
    }

    /// Writes the run's manifest: who is writing, and every file it has started to
    /// write, so that a later `--force` knows them as unshard's if this run dies.
    fn write_run_manifest(&self) -> Result<()> {
        let files = lock(&self.files).clone();
        let manifest = serde_json::json!({
            "run_id": self.run_id,
            "host": hostname(),
            "pid": std::process::id(),
            "started": self.started,
            "files": files,
        });
        let mut manifest = manifest.to_string();
        manifest.push('\n');
        self.put(MANIFEST, manifest.into_bytes())
    }

    /// Records `names` in the run's manifest before they are written.
    fn announce(&self, names: &[String]) -> Result<()> {
        if !self.has_manifest {
            return Ok(());
        }
        {
            let mut files = lock(&self.files);
            let before = files.len();
            for n in names {
                if !files.contains(n) {
                    files.push(n.clone());
                }
            }
            if files.len() == before {
                return Ok(());
            }
        }
        self.write_run_manifest()
    }

    /// Opens `dest` for one part of a merge split over several processes
    /// (`crate::parts`): no emptiness check and no manifest (the parts keep their
    /// own bookkeeping). `replaced`: objects of an older output, deleted by
    /// [`Sink::commit`] unless the new output has them. `keep_completed`: a failure
    /// aborts the open uploads but leaves the objects already completed.
    pub fn for_part(
        dest_url: &Path,
        replaced: Vec<String>,
        keep_completed: bool,
    ) -> Result<BucketSink> {
        let dest = store::locate(dest_url)?;
        let multipart = dest.multipart.clone().ok_or_else(|| read_only(dest_url))?;
        Ok(BucketSink {
            dest,
            multipart,
            run_id: run_id(),
            undo: Arc::default(),
            small: Mutex::new(Vec::new()),
            replaced,
            committed: AtomicBool::new(false),
            keep_completed,
            has_manifest: false,
            files: Mutex::new(Vec::new()),
            started: now(),
        })
    }

    /// The run id written in the manifest.
    #[cfg_attr(not(feature = "internals"), allow(dead_code))] // for the tests and fuzz targets
    pub fn run_id(&self) -> &str {
        &self.run_id
    }

    fn put(&self, name: &str, bytes: Vec<u8>) -> Result<()> {
        let loc = self.dest.child(name);
        let payload = PutPayload::from(bytes);
        block_on(store::again(|| loc.store.put(&loc.key, payload.clone())))
            .map_err(|e| io_error("write", &loc.url, e))?;
        lock(&self.undo).written.push(loc.key);
        Ok(())
    }

    fn delete(&self, name: &str) -> Result<()> {
        let loc = self.dest.child(name);
        match block_on(store::again(|| loc.store.delete(&loc.key))) {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
            Err(e) => Err(io_error("delete", &loc.url, e)),
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Sink for BucketSink {
    fn create_shard(&self, name: &str, size: u64) -> Result<Box<dyn ShardFile>> {
        let loc = self.dest.child(name);
        let parts = size.div_ceil(WINDOW_BYTES).max(1);
        if parts > MAX_PARTS {
            return Err(Error::Output {
                path: loc.url.clone(),
                msg: format!(
                    "a shard of {size} bytes needs {parts} parts of 8 MiB; object stores take at most {MAX_PARTS}"
                ),
                hint: Some("lower --max-shard-size".into()),
            });
        }
        self.announce(&[name.to_string()])?;
        let id = block_on(self.multipart.create_multipart(&loc.key))
            .map_err(|e| io_error("start uploading", &loc.url, e))?;
        lock(&self.undo).open.push((loc.key.clone(), id.clone()));
        Ok(Box::new(BucketShard {
            loc,
            multipart: self.multipart.clone(),
            id,
            size,
            parts: Mutex::new(vec![None; parts as usize]),
            undo: self.undo.clone(),
        }))
    }

    fn write_file(&self, name: &str, bytes: &[u8]) -> Result<()> {
        let mut small = lock(&self.small);
        small.retain(|(n, _)| n != name);
        small.push((name.to_string(), bytes.to_vec()));
        Ok(())
    }

    fn copy_file(&self, name: &str, from: &Path) -> Result<bool> {
        if lock(&self.small).iter().any(|(n, _)| n == name) {
            return Ok(false);
        }
        let bytes = crate::bytes::fs::read(from)?;
        self.write_file(name, &bytes)?;
        Ok(true)
    }

    fn staged_dir(&self) -> Option<&Path> {
        None
    }

    fn commit(self: Box<Self>) -> Result<()> {
        let small = std::mem::take(&mut *lock(&self.small));
        // Loaders open config.json and the index first: they are written last, the
        // config after the index.
        let rank = |n: &str| match n {
            "config.json" => 2,
            "model.safetensors.index.json" => 1,
            _ => 0,
        };
        let mut small = small;
        small.sort_by_key(|(n, _)| rank(n));
        // An older output being replaced stops being loadable before the new files
        // land beside it.
        for old in ["config.json", "model.safetensors.index.json"] {
            if self.replaced.iter().any(|k| k == old) {
                self.delete(old)?;
            }
        }
        let names: Vec<String> = small.iter().map(|(n, _)| n.clone()).collect();
        self.announce(&names)?;
        for (name, bytes) in small {
            self.put(&name, bytes)?;
        }
        let new: Vec<String> = lock(&self.undo)
            .written
            .iter()
            .filter_map(|k| k.filename().map(str::to_string))
            .chain(names)
            .collect();
        for old in &self.replaced {
            if old != MANIFEST && !new.iter().any(|n| n == old) {
                self.delete(old)?;
            }
        }
        self.delete(MANIFEST)?;
        self.committed.store(true, Ordering::SeqCst);
        Ok(())
    }
}

impl Drop for BucketSink {
    /// Undoes an uncommitted run: aborts open uploads, deletes what was written.
    fn drop(&mut self) {
        if self.committed.load(Ordering::SeqCst) {
            return;
        }
        let left = self.undo();
        if let Some(warning) = self.left_behind(&left) {
            // A drop has no caller to return this to, and leaving objects behind
            // unannounced is worse than a line on stderr.
            #[allow(clippy::print_stderr)]
            {
                eprint!("{warning}");
            }
        }
    }
}

impl BucketSink {
    /// Aborts the open uploads and deletes what this run wrote (unless it keeps
    /// what it completed); what could not be removed, each with how to remove it.
    fn undo(&self) -> Vec<String> {
        let mut undo = std::mem::take(&mut *lock(&self.undo));
        if self.keep_completed {
            undo.written.clear();
        }
        let (store, multipart) = (self.dest.store.clone(), self.multipart.clone());
        // `scheme://bucket`, and the bucket's name, for the commands printed below.
        let url = self.dest.url.to_string_lossy().into_owned();
        let bucket = url
            .split_once("://")
            .map_or("BUCKET", |(_, rest)| {
                rest.split('/').next().unwrap_or("BUCKET")
            })
            .to_string();
        let scheme = store::scheme_of(&self.dest.url);
        let bucket_a = bucket.clone();
        // Each request is retried as long as any (`UNSHARD_RETRY_SECONDS`), so a
        // cleanup that starts during an outage still completes when it ends.
        block_on(async move {
            let mut left = Vec::new();
            for (key, id) in &undo.open {
                if let Err(e) = store::again(|| multipart.abort_multipart(key, id)).await {
                    left.push(format!(
                        "the open multipart upload {id} of {key} ({}); {}",
                        crate::text::scrub(&e.to_string()),
                        abort_upload_advice(scheme.as_ref(), &bucket_a, key.as_ref(), id)
                    ));
                }
            }
            for key in &undo.written {
                if let Err(e) = store::again(|| store.delete(key)).await {
                    if !matches!(e, object_store::Error::NotFound { .. }) {
                        left.push(format!(
                            "the object {key} ({}); {}",
                            crate::text::scrub(&e.to_string()),
                            delete_object_advice(scheme.as_ref(), &bucket, key.as_ref())
                        ));
                    }
                }
            }
            left
        })
    }

    /// The warning about what a failed run's cleanup left, if it left anything.
    fn left_behind(&self, left: &[String]) -> Option<String> {
        if left.is_empty() {
            return None;
        }
        let mut out = format!(
            "warning: the failed run's cleanup in {} could not remove {} item(s):\n",
            self.dest.url.display(),
            left.len()
        );
        for l in left {
            out.push_str(&format!("  - {l}\n"));
        }
        Some(out)
    }
}

/// How to abort an open multipart upload by hand, in the store's own tool.
fn abort_upload_advice(
    scheme: Option<&ObjectStoreScheme>,
    bucket: &str,
    key: &str,
    id: &str,
) -> String {
    match scheme {
        Some(ObjectStoreScheme::GoogleCloudStorage) => format!(
            "abort it with a DELETE of gs://{bucket}/{key}?uploadId={id} (the XML API), or let a lifecycle rule for incomplete multipart uploads remove it"
        ),
        // Azure keeps staged blocks uncommitted, and drops them after seven days.
        Some(ObjectStoreScheme::MicrosoftAzure) => {
            "its staged blocks are not visible and Azure drops them after seven days".into()
        }
        _ => format!(
            "abort it with `aws s3api abort-multipart-upload --bucket {bucket} --key {key} --upload-id {id}`, or let a lifecycle rule for incomplete uploads remove it"
        ),
    }
}

/// How to delete an object by hand, in the store's own tool.
fn delete_object_advice(scheme: Option<&ObjectStoreScheme>, bucket: &str, key: &str) -> String {
    match scheme {
        Some(ObjectStoreScheme::GoogleCloudStorage) => {
            format!("delete it with `gcloud storage rm gs://{bucket}/{key}`")
        }
        Some(ObjectStoreScheme::MicrosoftAzure) => format!(
            "delete it with `az storage blob delete --container-name {bucket} --name {key}` (with your --account-name) or the portal"
        ),
        _ => format!("delete it with `aws s3 rm s3://{bucket}/{key}`"),
    }
}

/// One shard being uploaded: block `k` is part `k`.
struct BucketShard {
    loc: Location,
    multipart: Arc<dyn MultipartStore>,
    id: String,
    size: u64,
    parts: Mutex<Vec<Option<PartId>>>,
    undo: Arc<Mutex<Undo>>,
}

impl ShardFile for BucketShard {
    fn write_block(&self, buf: &[u8], offset: u64) -> Result<()> {
        let k = offset / WINDOW_BYTES;
        let whole = offset % WINDOW_BYTES == 0
            && (buf.len() as u64 == WINDOW_BYTES || offset + buf.len() as u64 == self.size);
        if !whole || k as usize >= lock(&self.parts).len() {
            return Err(self.not_a_block(offset, buf.len()));
        }
        let payload = PutPayload::from(buf.to_vec());
        let part = block_on(store::again(|| {
            self.multipart
                .put_part(&self.loc.key, &self.id, k as usize, payload.clone())
        }))
        .map_err(|e| io_error("upload", &self.loc.url, e))?;
        lock(&self.parts)[k as usize] = Some(part);
        Ok(())
    }

    fn write_at(&self, _buf: &[u8], offset: u64) -> Result<()> {
        Err(Error::Unsupported {
            path: self.loc.url.clone(),
            what: format!(
                "writing a computed tensor (at byte {offset}) straight to object storage"
            ),
            hint: Some("merge into a local directory, then upload it".into()),
        })
    }

    /// Completes the upload: the shard becomes an object.
    fn finish(&self) -> Result<()> {
        let parts: Option<Vec<PartId>> = lock(&self.parts).iter().cloned().collect();
        let Some(parts) = parts else {
            return Err(Error::Output {
                path: self.loc.url.clone(),
                msg: "some blocks of the shard were never written".into(),
                hint: None,
            });
        };
        let mut tries = 0;
        let done = block_on(store::again(|| {
            tries += 1;
            self.multipart
                .complete_multipart(&self.loc.key, &self.id, parts.clone())
        }));
        if let Err(e) = done {
            // A completion cut off after the server made the object is repeated by
            // `again`, and the repeat finds no upload (S3 answers 404, other stores
            // otherwise): the object is there, at its size.
            let made = tries > 1 && store::head(&self.loc).ok().flatten() == Some(self.size);
            if !made {
                return Err(io_error("finish uploading", &self.loc.url, e));
            }
        }
        let mut undo = lock(&self.undo);
        undo.open
            .retain(|(k, id)| !(k == &self.loc.key && id == &self.id));
        undo.written.push(self.loc.key.clone());
        Ok(())
    }
}

impl BucketShard {
    fn not_a_block(&self, offset: u64, len: usize) -> Error {
        Error::Output {
            path: self.loc.url.clone(),
            msg: format!(
                "a write of {len} bytes at byte {offset} is not one of the 8 MiB blocks a part is made of"
            ),
            hint: None,
        }
    }
}

fn now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// A run id: time and process, unique enough to tell two runs' leftovers apart.
fn run_id() -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!("{:x}-{:x}", nanos, std::process::id())
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

#[cfg(test)]
mod tests;
