//! The staging directory a split merge's parts share, as a [`Sink`]: shards go in
//! under temporary names, the done-markers and the commit claim beside them.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

use super::Part;
use crate::error::{Error, Result};
use crate::write::{sync_dir, write_file, OutFile, ShardFile, Sink};

const PREFIX: &str = "unshard-parts-";
const COMMIT: &str = "commit";

/// `.<out name>.unshard-parts-<hash>` beside `out`.
pub fn staging_dir(out: &Path, hash: &str) -> PathBuf {
    let name = out
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "out".into());
    parent_of(out).join(format!(".{name}.{PREFIX}{hash}"))
}

fn parent_of(out: &Path) -> PathBuf {
    match out.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

/// Prefix of the files in which each part leaves its shards' checksums for the
/// part that commits (which writes them into `unshard.json`).
pub const CHECKSUMS: &str = "checksums-";

fn marker(part: Part) -> String {
    format!("done-{}-of-{}", part.index, part.count)
}

/// A part's view of the shared staging directory.
pub struct PartDir {
    dir: PathBuf,
    part: Part,
}

impl PartDir {
    /// Joins (or starts) the staging directory of plan `hash`; refuses when the
    /// staging directory of another plan for the same output is there.
    pub fn open(out: &Path, hash: &str, part: Part) -> Result<PartDir> {
        let dir = staging_dir(out, hash);
        let name = dir
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let others_prefix = name.trim_end_matches(hash).to_string();
        if let Ok(rd) = std::fs::read_dir(parent_of(out)) {
            for e in rd.flatten() {
                let n = e.file_name().to_string_lossy().into_owned();
                if n.starts_with(&others_prefix) && n != name {
                    let done: Vec<String> = std::fs::read_dir(e.path())
                        .map(|rd| {
                            rd.flatten()
                                .map(|e| e.file_name().to_string_lossy().into_owned())
                                .filter(|n| n.starts_with("done-"))
                                .collect()
                        })
                        .unwrap_or_default();
                    return Err(Error::Output {
                        path: out.to_path_buf(),
                        msg: format!(
                            "part {}/{} computed plan {hash}, but the parts already working on this output have another plan ({}; finished: {}): they were started with other inputs, options or number of parts",
                            part.index,
                            part.count,
                            n.trim_start_matches(&others_prefix),
                            if done.is_empty() { "none".to_string() } else { done.join(", ") }
                        ),
                        hint: Some(format!(
                            "start every part with the same command; to abandon the other merge, remove {}",
                            e.path().display()
                        )),
                    });
                }
            }
        }
        std::fs::create_dir_all(&dir).map_err(|e| Error::io("create", &dir, e))?;
        Ok(PartDir { dir, part })
    }

    pub fn path(&self) -> &Path {
        &self.dir
    }

    fn temp_name(&self, name: &str) -> String {
        format!(".{name}.part{}.tmp", self.part.index)
    }

    /// Renames this part's finished shards to their final names.
    pub fn publish_shards(&self, names: &[String]) -> Result<()> {
        for n in names {
            let from = self.dir.join(self.temp_name(n));
            let to = self.dir.join(n);
            std::fs::rename(&from, &to).map_err(|e| Error::io("rename", &from, e))?;
        }
        sync_dir(&self.dir)
    }

    /// Creates this part's done-marker atomically; returns the parts not done yet.
    pub fn mark_done(&self) -> Result<Vec<usize>> {
        let name = marker(self.part);
        let tmp = self.dir.join(format!(".{name}.tmp"));
        let text = format!(
            "{{\"part\": {}, \"of\": {}, \"pid\": {}}}\n",
            self.part.index,
            self.part.count,
            std::process::id()
        );
        write_file(&tmp, text.as_bytes())?;
        let done = self.dir.join(&name);
        std::fs::rename(&tmp, &done).map_err(|e| Error::io("create", &done, e))?;
        sync_dir(&self.dir)?;
        Ok((0..self.part.count)
            .filter(|&i| {
                let p = Part {
                    index: i,
                    count: self.part.count,
                };
                !self.dir.join(marker(p)).exists()
            })
            .collect())
    }

    /// Claims the commit: true for exactly one part (`O_EXCL`).
    pub fn claim_commit(&self) -> Result<bool> {
        let path = self.dir.join(COMMIT);
        match OpenOptions::new().write(true).create_new(true).open(&path) {
            Ok(mut f) => {
                let _ = writeln!(f, "{}", self.part.index);
                Ok(true)
            }
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(false),
            Err(e) => Err(Error::io("create", &path, e)),
        }
    }

    /// Removes the bookkeeping files and renames the directory into place as `out`
    /// (moving an existing output aside first when `force`).
    pub fn commit(&self, out: &Path, force: bool) -> Result<()> {
        for e in std::fs::read_dir(&self.dir)
            .map_err(|e| Error::io("list", &self.dir, e))?
            .flatten()
        {
            let n = e.file_name().to_string_lossy().into_owned();
            if n == COMMIT
                || n.starts_with("done-")
                || n.starts_with(CHECKSUMS)
                || n.ends_with(".tmp")
            {
                let _ = std::fs::remove_file(e.path());
            }
        }
        sync_dir(&self.dir)?;
        let old = parent_of(out).join(format!(
            ".{}.unshard-parts-old-{}",
            out.file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default(),
            std::process::id()
        ));
        let replaced = out.exists();
        if replaced {
            if !force {
                return Err(Error::Output {
                    path: out.to_path_buf(),
                    msg: "the output appeared while the parts were writing".into(),
                    hint: Some("pass --force to replace it".into()),
                });
            }
            std::fs::rename(out, &old)
                .map_err(|e| Error::io("move aside the existing output", out, e))?;
        }
        if let Err(e) = std::fs::rename(&self.dir, out) {
            if replaced {
                let _ = std::fs::rename(&old, out);
            }
            return Err(Error::io("move the finished output into place at", out, e));
        }
        if replaced {
            let _ = std::fs::remove_dir_all(&old);
        }
        sync_dir(&parent_of(out))
    }
}

impl Sink for PartDir {
    fn create_shard(&self, name: &str, size: u64) -> Result<Box<dyn ShardFile>> {
        Ok(Box::new(OutFile::create(
            &self.dir.join(self.temp_name(name)),
            size,
        )?))
    }

    fn write_file(&self, name: &str, bytes: &[u8]) -> Result<()> {
        write_file(&self.dir.join(name), bytes)
    }

    fn copy_file(&self, name: &str, from: &Path) -> Result<bool> {
        let dst = self.dir.join(name);
        if dst.exists() {
            return Ok(false);
        }
        if crate::bytes::fs::is_url(from) {
            write_file(&dst, &crate::bytes::fs::read(from)?)?;
        } else {
            std::fs::copy(from, &dst).map_err(|e| Error::io("copy", from, e))?;
            File::open(&dst)
                .and_then(|f| f.sync_all())
                .map_err(|e| Error::io("flush", &dst, e))?;
        }
        Ok(true)
    }

    fn staged_dir(&self) -> Option<&Path> {
        Some(&self.dir)
    }

    /// The parts commit through [`PartDir::commit`], once, when all are done.
    fn commit(self: Box<Self>) -> Result<()> {
        Ok(())
    }
}
