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

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn part(index: usize, count: usize) -> Part {
        Part { index, count }
    }

    fn names(dir: &Path) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    }

    /// Writes `bytes` as shard `name` through the sink (not yet published).
    fn shard(dir: &PartDir, name: &str, bytes: &[u8]) {
        let f = dir.create_shard(name, bytes.len() as u64).unwrap();
        f.write_at(bytes, 0).unwrap();
        f.finish().unwrap();
    }

    /// The staging directory is `.<out name>.unshard-parts-<hash>` beside the output
    /// (the current directory for a bare name).
    #[test]
    fn the_staging_directory_sits_beside_the_output() {
        assert_eq!(
            staging_dir(Path::new("/data/run/merged"), "00ff"),
            Path::new("/data/run/.merged.unshard-parts-00ff")
        );
        assert_eq!(
            staging_dir(Path::new("merged"), "00ff"),
            Path::new("./.merged.unshard-parts-00ff")
        );
    }

    /// Two parts of one plan: shards stay under temporary names until published,
    /// each part's marker says who is left, one claim wins, and the commit leaves
    /// the shards and the small files alone in the output.
    #[test]
    fn two_parts_meet_mark_claim_and_commit_once() {
        let tmp = tempfile::tempdir().unwrap();
        std::fs::create_dir(tmp.path().join("ckpt")).unwrap();
        let out = tmp.path().join("out");
        let a = PartDir::open(&out, "h1", part(0, 2)).unwrap();
        let b = PartDir::open(&out, "h1", part(1, 2)).unwrap();
        assert_eq!(a.path(), staging_dir(&out, "h1"));
        assert_eq!(a.staged_dir(), Some(staging_dir(&out, "h1").as_path()));

        // Two shards of one part written before either is published.
        shard(&a, "s1.safetensors", b"first");
        shard(&a, "s2.safetensors", b"second");
        shard(&b, "s3.safetensors", b"third");
        assert!(
            !a.path().join("s1.safetensors").exists(),
            "a shard present is complete"
        );
        a.publish_shards(&["s1.safetensors".into(), "s2.safetensors".into()])
            .unwrap();
        b.publish_shards(&["s3.safetensors".into()]).unwrap();
        let read = |n: &str| std::fs::read(a.path().join(n)).unwrap();
        assert_eq!(read("s1.safetensors"), b"first");
        assert_eq!(read("s2.safetensors"), b"second");
        assert_eq!(read("s3.safetensors"), b"third");

        assert_eq!(a.mark_done().unwrap(), [1]);
        assert_eq!(b.mark_done().unwrap(), Vec::<usize>::new());
        assert_eq!(a.mark_done().unwrap(), Vec::<usize>::new());
        assert!(a.claim_commit().unwrap());
        assert!(!b.claim_commit().unwrap());
        assert!(!a.claim_commit().unwrap());

        // The small files, and the bookkeeping the commit removes: the parts'
        // checksums and a temporary file a killed part left.
        a.write_file("config.json", b"{}").unwrap();
        let small = tmp.path().join("tokenizer.json");
        std::fs::write(&small, b"tok").unwrap();
        assert!(a.copy_file("tokenizer.json", &small).unwrap());
        std::fs::write(&small, b"other").unwrap();
        assert!(!a.copy_file("tokenizer.json", &small).unwrap());
        std::fs::write(a.path().join(format!("{CHECKSUMS}0-of-2.json")), b"[]").unwrap();
        std::fs::write(a.path().join(".s9.safetensors.part1.tmp"), b"x").unwrap();

        a.commit(&out, false).unwrap();
        assert!(!staging_dir(&out, "h1").exists());
        assert_eq!(
            names(&out),
            [
                "config.json",
                "s1.safetensors",
                "s2.safetensors",
                "s3.safetensors",
                "tokenizer.json"
            ]
        );
        assert_eq!(std::fs::read(out.join("config.json")).unwrap(), b"{}");
        assert_eq!(std::fs::read(out.join("tokenizer.json")).unwrap(), b"tok");
    }

    /// A part of another plan refuses to join, naming the parts done; a part of the
    /// same plan joins beside other files of the output's directory.
    #[test]
    fn a_part_of_another_plan_refuses_to_join() {
        let tmp = tempfile::tempdir().unwrap();
        std::fs::create_dir(tmp.path().join("ckpt")).unwrap();
        std::fs::write(tmp.path().join(".out.notes"), b"").unwrap();
        let out = tmp.path().join("out");
        let a = PartDir::open(&out, "h1", part(0, 2)).unwrap();
        a.mark_done().unwrap();
        let err = PartDir::open(&out, "h2", part(1, 2))
            .err()
            .unwrap()
            .to_string();
        assert!(
            err.contains("another plan (h1; finished: done-0-of-2)"),
            "{err}"
        );
        PartDir::open(&out, "h1", part(1, 2)).unwrap();
    }

    /// The claim is an exclusive create: any other failure is an error, not a loss.
    #[test]
    fn a_claim_that_cannot_be_created_is_an_error() {
        let tmp = tempfile::tempdir().unwrap();
        let out = tmp.path().join("out");
        let a = PartDir::open(&out, "h1", part(0, 1)).unwrap();
        std::fs::remove_dir(a.path()).unwrap();
        assert!(a.claim_commit().is_err());
    }

    /// An output that appeared meanwhile is replaced only with `force`.
    #[test]
    fn the_commit_replaces_an_output_only_when_forced() {
        let tmp = tempfile::tempdir().unwrap();
        let out = tmp.path().join("out");
        std::fs::create_dir(&out).unwrap();
        std::fs::write(out.join("old.safetensors"), b"old").unwrap();
        let a = PartDir::open(&out, "h1", part(0, 1)).unwrap();
        a.write_file("config.json", b"{}").unwrap();
        let err = a.commit(&out, false).unwrap_err().to_string();
        assert!(err.contains("appeared"), "{err}");
        assert_eq!(names(&out), ["old.safetensors"]);
        a.commit(&out, true).unwrap();
        assert_eq!(names(&out), ["config.json"]);
    }
}
