//! The staging transaction: output goes to a directory beside the destination,
//! which is fsynced and renamed into place only when everything succeeded; on any
//! error or interruption the staging directory is removed. Stale staging
//! directories of runs that died are found and removed before a new run starts.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use super::WriteOptions;
use crate::error::{Error, Result};

/// A staging directory that removes itself unless committed.
pub struct Staging {
    pub path: PathBuf,
    committed: bool,
}

impl Drop for Staging {
    fn drop(&mut self) {
        if !self.committed {
            let _ = std::fs::remove_dir_all(&self.path);
        }
    }
}

fn staging_prefix(out: &Path) -> String {
    let name = out
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "out".into());
    format!(".{name}.unshard-tmp-")
}

fn parent_of(out: &Path) -> PathBuf {
    match out.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

/// Checks that `out` can be written and removes the staging directories that
/// interrupted runs left beside it. Returns the removed paths.
pub fn check_output(out: &Path, opts: &WriteOptions) -> Result<Vec<PathBuf>> {
    let parent = parent_of(out);
    let out_abs = absolute(out);
    for p in &opts.protected {
        let p_abs = absolute(p);
        if out_abs == p_abs || out_abs.starts_with(&p_abs) && p.is_dir() {
            return Err(Error::Output {
                path: out.to_path_buf(),
                msg: format!("the output would be inside the input {}", p.display()),
                hint: Some("choose an output outside the checkpoint and base directories".into()),
            });
        }
        if p_abs.starts_with(&out_abs) {
            return Err(Error::Output {
                path: out.to_path_buf(),
                msg: format!("the output directory contains the input {}", p.display()),
                hint: Some("choose an output that does not hold the inputs".into()),
            });
        }
    }
    match std::fs::metadata(out) {
        Ok(m) if !m.is_dir() => {
            return Err(Error::Output {
                path: out.to_path_buf(),
                msg: "exists and is not a directory".into(),
                hint: None,
            })
        }
        Ok(_) => {
            let non_empty = std::fs::read_dir(out)
                .map_err(|e| Error::io("list", out, e))?
                .next()
                .is_some();
            if non_empty && !opts.force {
                return Err(Error::OutputExists {
                    path: out.to_path_buf(),
                });
            }
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(Error::io("inspect", out, e)),
    }
    // Staging directories of earlier runs that died (their pid is gone).
    let prefix = staging_prefix(out);
    let mut cleaned = Vec::new();
    if let Ok(rd) = std::fs::read_dir(&parent) {
        for e in rd.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let Some(pid) = name.strip_prefix(&prefix) else {
                continue;
            };
            let pid: i32 = pid.parse().unwrap_or(0);
            if pid > 0 && pid_alive(pid) {
                return Err(Error::Output {
                    path: out.to_path_buf(),
                    msg: format!("another unshard (pid {pid}) is writing this output"),
                    hint: Some(format!(
                        "wait for it, or stop it and remove {}",
                        e.path().display()
                    )),
                });
            }
            if std::fs::remove_dir_all(e.path()).is_ok() {
                cleaned.push(e.path());
            }
        }
    }
    Ok(cleaned)
}

fn pid_alive(pid: i32) -> bool {
    // SAFETY: kill with signal 0 only checks whether the process exists.
    let r = unsafe { libc::kill(pid, 0) };
    r == 0 || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
}

fn absolute(p: &Path) -> PathBuf {
    std::fs::canonicalize(p).unwrap_or_else(|_| {
        match p.parent().and_then(|pp| std::fs::canonicalize(pp).ok()) {
            Some(pp) => pp.join(p.file_name().unwrap_or_default()),
            None => p.to_path_buf(),
        }
    })
}

/// Creates the staging directory for `out`.
pub fn create_staging(out: &Path) -> Result<Staging> {
    let parent = parent_of(out);
    // The output is written beside itself and renamed into place: a failure here
    // is about the output's directory, not the internal staging name.
    let unwritable = |e: std::io::Error| {
        Error::Output {
        path: out.to_path_buf(),
        msg: format!("cannot write into {}: {e}", parent.display()),
        hint: Some(
            "choose an output in a directory you can write to, or fix that directory's permissions (`ls -ld` shows them)"
                .into(),
        ),
    }
    };
    std::fs::create_dir_all(&parent).map_err(unwritable)?;
    let path = parent.join(format!("{}{}", staging_prefix(out), std::process::id()));
    let _ = std::fs::remove_dir_all(&path);
    std::fs::create_dir(&path).map_err(unwritable)?;
    Ok(Staging {
        path,
        committed: false,
    })
}

/// Makes the staged output visible at `out` (replacing an existing one).
pub fn commit(mut staging: Staging, out: &Path) -> Result<()> {
    sync_dir(&staging.path)?;
    let old = parent_of(out).join(format!("{}old-{}", staging_prefix(out), std::process::id()));
    let replaced = out.exists();
    if replaced {
        std::fs::rename(out, &old)
            .map_err(|e| Error::io("move aside the existing output", out, e))?;
    }
    if let Err(e) = std::fs::rename(&staging.path, out) {
        if replaced {
            let _ = std::fs::rename(&old, out);
        }
        return Err(Error::io("move the finished output into place at", out, e));
    }
    staging.committed = true;
    if replaced {
        let _ = std::fs::remove_dir_all(&old);
    }
    sync_dir(&parent_of(out))?;
    Ok(())
}

pub(crate) fn write_file(path: &Path, bytes: &[u8]) -> Result<()> {
    let f = File::create(path).map_err(|e| Error::io("create", path, e))?;
    f.write_all_at(bytes, 0)
        .map_err(|e| Error::io("write", path, e))?;
    f.sync_all().map_err(|e| Error::io("flush", path, e))
}

pub(crate) fn sync_dir(path: &Path) -> Result<()> {
    File::open(path)
        .and_then(|f| f.sync_all())
        .map_err(|e| Error::io("flush", path, e))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn opts(protected: &[&Path], force: bool) -> WriteOptions {
        WriteOptions {
            force,
            protected: protected.iter().map(|p| p.to_path_buf()).collect(),
            ..WriteOptions::default()
        }
    }

    fn names(dir: &Path) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    }

    fn output_msg(r: Result<Vec<PathBuf>>) -> String {
        match r {
            Err(Error::Output { msg, .. }) => msg,
            other => panic!("expected an output error, got {other:?}"),
        }
    }

    #[test]
    fn a_bare_output_name_is_staged_in_the_current_directory() {
        assert_eq!(parent_of(Path::new("out")), PathBuf::from("."));
        assert_eq!(parent_of(Path::new("a/out")), PathBuf::from("a"));
        assert_eq!(parent_of(Path::new("/x/out")), PathBuf::from("/x"));
        assert_eq!(staging_prefix(Path::new("/x/out")), ".out.unshard-tmp-");
    }

    #[test]
    fn pid_alive_tells_a_running_process_from_a_gone_one() {
        assert!(pid_alive(std::process::id() as i32));
        // Above any pid_max (at most 2^22): no such process.
        assert!(!pid_alive(i32::MAX));
    }

    #[test]
    fn a_live_runs_staging_is_refused_and_dead_ones_are_removed() {
        let tmp = tempfile::tempdir().unwrap();
        let out = tmp.path().join("out");
        let live = tmp
            .path()
            .join(format!(".out.unshard-tmp-{}", std::process::id()));
        std::fs::create_dir(&live).unwrap();
        let msg = output_msg(check_output(&out, &opts(&[], false)));
        assert!(
            msg.contains(&format!("another unshard (pid {})", std::process::id())),
            "{msg}"
        );
        assert!(live.is_dir(), "a live run's staging must stay");
        std::fs::remove_dir(&live).unwrap();

        // A pid no process has, a name with no pid, and another output's staging.
        for n in [
            ".out.unshard-tmp-2147483647",
            ".out.unshard-tmp-junk",
            ".other.unshard-tmp-2147483647",
        ] {
            std::fs::create_dir(tmp.path().join(n)).unwrap();
        }
        let mut cleaned = check_output(&out, &opts(&[], false)).unwrap();
        cleaned.sort();
        assert_eq!(
            cleaned,
            [
                tmp.path().join(".out.unshard-tmp-2147483647"),
                tmp.path().join(".out.unshard-tmp-junk"),
            ]
        );
        assert_eq!(names(tmp.path()), [".other.unshard-tmp-2147483647"]);
    }

    #[test]
    fn an_output_that_is_a_file_or_under_one_is_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let file = tmp.path().join("file");
        std::fs::write(&file, "x").unwrap();
        let msg = output_msg(check_output(&file, &opts(&[], true)));
        assert!(msg.contains("not a directory"), "{msg}");
        // Looking at file/out fails with ENOTDIR, which is not "absent".
        match check_output(&file.join("out"), &opts(&[], true)) {
            Err(Error::Io { op, .. }) => assert_eq!(op, "inspect"),
            other => panic!("expected an I/O error, got {other:?}"),
        }
        assert_eq!(std::fs::read_to_string(&file).unwrap(), "x");
    }

    #[test]
    fn an_output_inside_an_input_or_holding_one_is_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let input = tmp.path().join("in");
        std::fs::create_dir(&input).unwrap();
        let ckpt = tmp.path().join("ckpt.pt");
        std::fs::write(&ckpt, "x").unwrap();
        let protected = [input.as_path(), ckpt.as_path()];
        for out in [input.clone(), input.join("sub"), ckpt.clone()] {
            let msg = output_msg(check_output(&out, &opts(&protected, true)));
            assert!(msg.contains("inside the input"), "{}: {msg}", out.display());
        }
        let msg = output_msg(check_output(tmp.path(), &opts(&protected, true)));
        assert!(msg.contains("contains the input"), "{msg}");
        // A sibling whose name merely starts like the input's is fine.
        assert_eq!(
            check_output(&tmp.path().join("in2"), &opts(&protected, false)).unwrap(),
            Vec::<PathBuf>::new()
        );
    }

    #[test]
    fn a_non_empty_output_needs_force() {
        let tmp = tempfile::tempdir().unwrap();
        let out = tmp.path().join("out");
        std::fs::create_dir(&out).unwrap();
        check_output(&out, &opts(&[], false)).unwrap();
        std::fs::write(out.join("mine"), "x").unwrap();
        assert!(matches!(
            check_output(&out, &opts(&[], false)),
            Err(Error::OutputExists { .. })
        ));
        check_output(&out, &opts(&[], true)).unwrap();
    }

    #[test]
    fn staging_goes_away_unless_committed_and_commit_replaces_the_output() {
        let tmp = tempfile::tempdir().unwrap();
        let out = tmp.path().join("out");
        let staging = create_staging(&out).unwrap();
        assert_eq!(
            staging.path,
            tmp.path()
                .join(format!(".out.unshard-tmp-{}", std::process::id()))
        );
        assert!(staging.path.is_dir());
        drop(staging);
        assert_eq!(names(tmp.path()), Vec::<String>::new());

        std::fs::create_dir(&out).unwrap();
        std::fs::write(out.join("old"), "old").unwrap();
        let staging = create_staging(&out).unwrap();
        write_file(&staging.path.join("new"), b"new").unwrap();
        commit(staging, &out).unwrap();
        assert_eq!(names(tmp.path()), ["out"]);
        assert_eq!(names(&out), ["new"]);
        assert_eq!(std::fs::read(out.join("new")).unwrap(), b"new");
    }
}
