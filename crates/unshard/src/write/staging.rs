//! The staging transaction: output goes to a directory beside the destination,
//! which is fsynced and renamed into place only when everything succeeded; on any
//! error or interruption the staging directory is removed. Stale staging
//! directories of runs that died are found and removed before a new run starts.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use super::WriteOptions;
use crate::{Error, Result};

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
    std::fs::create_dir_all(&parent)
        .map_err(|e| Error::io("create the output's parent directory", &parent, e))?;
    let path = parent.join(format!("{}{}", staging_prefix(out), std::process::id()));
    let _ = std::fs::remove_dir_all(&path);
    std::fs::create_dir(&path).map_err(|e| Error::io("create the staging directory", &path, e))?;
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
