//! The engine: streams tensors from input files into output shards.
//!
//! Every shard file is laid out by the plan before a byte is written, so each
//! tensor's place in its file is known. The work is cut into windows of at most
//! [`WINDOW_BYTES`] of output; a window is filled from the pieces that overlap it
//! (gathered from the memory-mapped inputs, byte-swapped and converted on the way)
//! and written with one positioned write. Windows run in parallel across all
//! shards, so memory stays at a few windows per thread whatever the model size,
//! and input pages are released once consumed so they do not pile up in the
//! resident set.
//!
//! Output goes to a staging directory beside the destination, which is fsynced and
//! renamed into place only when everything succeeded; on any error or interruption
//! the staging directory is removed.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use rayon::prelude::*;

use crate::dtype::{self, ConvertStats};
use crate::plan::{Origin, Plan, PlannedTensor};
use crate::source::{contiguous_strides, Blob, Checkpoint, Piece};
use crate::{DType, Error, Result};

/// Output bytes assembled per unit of work.
pub const WINDOW_BYTES: u64 = 8 << 20;

/// Set by a signal handler to stop the writer at the next window.
pub static INTERRUPTED: AtomicBool = AtomicBool::new(false);

/// Receives progress in output bytes.
pub trait Progress: Sync {
    fn start(&self, _total_bytes: u64) {}
    fn advance(&self, _bytes: u64) {}
    fn finish(&self) {}
}

/// A progress sink that ignores everything.
pub struct NoProgress;
impl Progress for NoProgress {}

/// The inputs a plan's tensors point into.
#[derive(Clone, Copy)]
pub struct Inputs<'a> {
    pub checkpoint: &'a Checkpoint,
    pub base: Option<&'a Checkpoint>,
}

impl Inputs<'_> {
    fn files(&self, origin: Origin) -> &[Arc<Blob>] {
        match (origin, self.base) {
            (Origin::Checkpoint, _) => &self.checkpoint.files,
            (Origin::Base, Some(b)) => &b.files,
            (Origin::Base, None) => &[],
        }
    }
}

/// Options for writing.
#[derive(Clone, Debug, Default)]
pub struct WriteOptions {
    /// Replace a non-empty output directory.
    pub force: bool,
    /// Write inf where a cast overflows instead of failing.
    pub allow_overflow: bool,
    /// Non-weight files to copy into the output (tokenizer, generation config...).
    pub extra_files: Vec<PathBuf>,
    /// Paths the output must not overlap (inputs, base).
    pub protected: Vec<PathBuf>,
}

/// What writing did.
#[derive(Clone, Debug, Default)]
pub struct WriteSummary {
    /// Per planned tensor: what conversion saw.
    pub stats: Vec<ConvertStats>,
    pub bytes_written: u64,
    pub files: Vec<String>,
    /// Stale staging directories of interrupted runs that were removed.
    pub cleaned: Vec<PathBuf>,
}

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
                hint: Some("choose an --output outside the checkpoint and base directories".into()),
            });
        }
        if p_abs.starts_with(&out_abs) {
            return Err(Error::Output {
                path: out.to_path_buf(),
                msg: format!("the output directory contains the input {}", p.display()),
                hint: Some("choose an --output that does not hold the inputs".into()),
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
                return Err(Error::Output {
                    path: out.to_path_buf(),
                    msg: "the output directory exists and is not empty".into(),
                    hint: Some("pass --force to replace it, or choose another --output".into()),
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

/// Writes every shard, the index, the config and the extra files into `staging`.
pub fn write_into(
    plan: &Plan,
    inputs: Inputs<'_>,
    staging: &Path,
    opts: &WriteOptions,
    progress: &dyn Progress,
) -> Result<WriteSummary> {
    // Create and preallocate every file first: a full disk fails here, before work.
    let mut files = Vec::with_capacity(plan.shards.len());
    for s in &plan.shards {
        let path = staging.join(&s.file_name);
        let f = File::create(&path).map_err(|e| Error::io("create", &path, e))?;
        preallocate(&f, s.file_size).map_err(|e| Error::io("allocate space for", &path, e))?;
        f.write_all_at(&s.header, 0)
            .map_err(|e| Error::io("write", &path, e))?;
        files.push((f, path));
    }

    // Work items: windows of every tensor of every shard.
    let mut items: Vec<(usize, usize, u64, u64, u64)> = Vec::new(); // shard, tensor, e0, e1, file offset
    for (si, s) in plan.shards.iter().enumerate() {
        for &(ti, off) in &s.entries {
            let t = &plan.tensors[ti];
            let n = t.source.numel();
            let per = (WINDOW_BYTES / t.dtype.size() as u64).max(1);
            let mut e0 = 0;
            while e0 < n {
                let e1 = (e0 + per).min(n);
                items.push((si, ti, e0, e1, off + e0 * t.dtype.size() as u64));
                e0 = e1;
            }
        }
    }
    let total: u64 = plan
        .shards
        .iter()
        .map(|s| s.file_size - s.header.len() as u64)
        .sum();
    progress.start(total);
    let written = AtomicU64::new(0);
    let results: Vec<(usize, ConvertStats)> = items
        .par_iter()
        .map_init(Vec::new, |buf: &mut Vec<u8>, &(si, ti, e0, e1, off)| {
            if INTERRUPTED.load(Ordering::Relaxed) {
                return Err(Error::Interrupted);
            }
            let t = &plan.tensors[ti];
            let len = ((e1 - e0) * t.dtype.size() as u64) as usize;
            buf.resize(len, 0);
            let stats = fill_window(t, inputs.files(t.origin), e0, e1, buf)?;
            let (f, path) = &files[si];
            f.write_all_at(buf, off)
                .map_err(|e| Error::io("write", path, e))?;
            written.fetch_add(len as u64, Ordering::Relaxed);
            progress.advance(len as u64);
            Ok((ti, stats))
        })
        .collect::<Result<_>>()?;
    let mut stats = vec![ConvertStats::default(); plan.tensors.len()];
    for (ti, s) in results {
        stats[ti].add(s);
    }
    if !opts.allow_overflow {
        if let Some((i, s)) = stats.iter().enumerate().find(|(_, s)| s.overflow > 0) {
            return Err(Error::Overflow {
                tensor: plan.tensors[i].name.clone(),
                dtype: plan.tensors[i].dtype,
                count: s.overflow,
            });
        }
    }
    for (f, path) in &files {
        f.sync_all().map_err(|e| Error::io("flush", path, e))?;
    }
    let mut names: Vec<String> = plan.shards.iter().map(|s| s.file_name.clone()).collect();
    if let Some(index) = &plan.index {
        write_file(
            &staging.join("model.safetensors.index.json"),
            index.as_bytes(),
        )?;
        names.push("model.safetensors.index.json".into());
    }
    if let Some(config) = &plan.config {
        let mut text = serde_json::to_string_pretty(config).unwrap_or_default();
        text.push('\n');
        write_file(&staging.join("config.json"), text.as_bytes())?;
        names.push("config.json".into());
    }
    for src in &opts.extra_files {
        let Some(name) = src.file_name() else {
            continue;
        };
        let dst = staging.join(name);
        if dst.exists() {
            continue;
        }
        std::fs::copy(src, &dst).map_err(|e| Error::io("copy", src, e))?;
        File::open(&dst)
            .and_then(|f| f.sync_all())
            .map_err(|e| Error::io("flush", &dst, e))?;
        names.push(name.to_string_lossy().into_owned());
    }
    progress.finish();
    Ok(WriteSummary {
        stats,
        bytes_written: written.load(Ordering::Relaxed),
        files: names,
        cleaned: Vec::new(),
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

fn write_file(path: &Path, bytes: &[u8]) -> Result<()> {
    let f = File::create(path).map_err(|e| Error::io("create", path, e))?;
    f.write_all_at(bytes, 0)
        .map_err(|e| Error::io("write", path, e))?;
    f.sync_all().map_err(|e| Error::io("flush", path, e))
}

fn sync_dir(path: &Path) -> Result<()> {
    File::open(path)
        .and_then(|f| f.sync_all())
        .map_err(|e| Error::io("flush", path, e))
}

fn preallocate(f: &File, len: u64) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    if len == 0 {
        return Ok(());
    }
    let len_i = i64::try_from(len).map_err(|_| std::io::Error::from_raw_os_error(libc::EFBIG))?;
    // SAFETY: the descriptor is open for writing for the duration of the call.
    let r = unsafe { libc::posix_fallocate(f.as_raw_fd(), 0, len_i) };
    match r {
        0 => Ok(()),
        // Filesystems without fallocate: fall back to a sparse length.
        libc::EOPNOTSUPP | libc::EINVAL => f.set_len(len),
        e => Err(std::io::Error::from_raw_os_error(e)),
    }
}

/// A run of elements: contiguous in the output, uniformly strided in the source.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Run {
    out: u64,
    src: u64,
    len: u64,
}

/// The runs of a piece inside a tensor of `global` shape, in output order, with
/// their common source stride. Trailing dims are merged while the piece covers them
/// fully and the source stays uniformly strided, so a full or row-sharded tensor is
/// a single run.
fn piece_runs(p: &Piece, global: &[u64]) -> (Vec<Run>, u64) {
    let n = p.shape.len();
    if p.shape.contains(&0) {
        return (Vec::new(), 1);
    }
    if n == 0 {
        return (
            vec![Run {
                out: 0,
                src: 0,
                len: 1,
            }],
            1,
        );
    }
    let gs = contiguous_strides(global);
    let mut k = n - 1; // dims k.. form the run
    let mut len = p.shape[n - 1];
    let stride = p.strides[n - 1];
    let mut covered = p.shape[n - 1] == global[n - 1];
    while k > 0 {
        let d = k - 1;
        if covered && (p.shape[d] == 1 || p.strides[d] == stride * len) {
            len *= p.shape[d];
            covered = covered && p.shape[d] == global[d];
            k = d;
        } else {
            break;
        }
    }
    let base_out: u64 = (0..n).map(|d| p.global_offset[d] * gs[d]).sum();
    let outer = &p.shape[..k];
    let count: u64 = outer.iter().product();
    let mut runs = Vec::with_capacity(count.min(1 << 20) as usize);
    let mut idx = vec![0u64; k];
    for _ in 0..count {
        let out = base_out + idx.iter().zip(&gs).map(|(i, g)| i * g).sum::<u64>();
        let src = idx.iter().zip(&p.strides).map(|(i, s)| i * s).sum::<u64>();
        runs.push(Run { out, src, len });
        for d in (0..k).rev() {
            idx[d] += 1;
            if idx[d] < outer[d] {
                break;
            }
            idx[d] = 0;
        }
    }
    (runs, stride)
}

/// Fills output elements `[e0, e1)` of tensor `t` into `out`.
fn fill_window(
    t: &PlannedTensor,
    files: &[Arc<Blob>],
    e0: u64,
    e1: u64,
    out: &mut [u8],
) -> Result<ConvertStats> {
    let mut stats = ConvertStats::default();
    let osz = t.dtype.size() as u64;
    let mut scratch: Vec<u8> = Vec::new();
    for p in &t.source.pieces {
        let blob = files.get(p.file).ok_or_else(|| {
            Error::bad_tensor(Path::new("?"), &t.name, "piece refers to a missing file")
        })?;
        let data = blob.bytes();
        let isz = p.dtype.size() as u64;
        let (runs, stride) = piece_runs(p, &t.source.shape);
        for r in runs {
            let (a, b) = (r.out.max(e0), (r.out + r.len).min(e1));
            if a >= b {
                if r.out >= e1 {
                    break;
                }
                continue;
            }
            let count = b - a;
            let first_src = r.src + (a - r.out) * stride;
            let start = p.byte_offset + first_src * isz;
            let dst = &mut out[((a - e0) * osz) as usize..((b - e0) * osz) as usize];
            if stride == 1 {
                // Contiguous in the source: one positioned read, straight into the
                // output when no conversion is needed.
                let nbytes = (count * isz) as usize;
                if p.dtype == t.dtype && !p.big_endian {
                    blob.read_at(start, dst)?;
                    if t.dtype.is_float() {
                        stats.add(dtype::scan(dst, t.dtype));
                    }
                    continue;
                }
                scratch.resize(nbytes, 0);
                blob.read_at(start, &mut scratch)?;
                if p.big_endian {
                    dtype::byteswap(&mut scratch, isz as usize);
                }
                stats.add(convert_run(&scratch, p.dtype, dst, t.dtype));
                continue;
            }
            // Strided (a transposed or expanded view, rare in checkpoints): gather
            // element by element from the map.
            scratch.clear();
            scratch.reserve((count * isz) as usize);
            for j in 0..count {
                let at = (start + j * stride * isz) as usize;
                let e = data.get(at..at + isz as usize).ok_or_else(|| {
                    Error::bad_tensor(&blob.path, &t.name, "data lies past the end of the file")
                })?;
                scratch.extend_from_slice(e);
            }
            if p.big_endian {
                dtype::byteswap(&mut scratch, isz as usize);
            }
            stats.add(convert_run(&scratch, p.dtype, dst, t.dtype));
        }
    }
    Ok(stats)
}

/// Reads a whole tensor into memory in C order, converted to `to`. For tests,
/// `verify` and `diff` on tensors of reasonable size; merging streams instead.
pub fn read_tensor(
    files: &[Arc<Blob>],
    source: &crate::source::TensorSource,
    to: DType,
) -> Result<(Vec<u8>, ConvertStats)> {
    let t = PlannedTensor {
        name: source.name.clone(),
        origin: Origin::Checkpoint,
        source: source.clone(),
        dtype: to,
    };
    let n = source.numel();
    let mut out = vec![0u8; (n * to.size() as u64) as usize];
    let stats = fill_window(&t, files, 0, n, &mut out)?;
    Ok((out, stats))
}

/// Reads elements `[e0, e1)` of a tensor (C order), converted to `to`, into `out`.
pub fn read_tensor_range(
    files: &[Arc<Blob>],
    source: &crate::source::TensorSource,
    to: DType,
    e0: u64,
    e1: u64,
    out: &mut [u8],
) -> Result<ConvertStats> {
    let t = PlannedTensor {
        name: source.name.clone(),
        origin: Origin::Checkpoint,
        source: source.clone(),
        dtype: to,
    };
    fill_window(&t, files, e0, e1, out)
}

fn convert_run(src: &[u8], from: DType, dst: &mut [u8], to: DType) -> ConvertStats {
    dtype::convert(src, from, dst, to)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn piece(shape: &[u64], strides: &[u64], off: &[u64]) -> Piece {
        Piece {
            file: 0,
            byte_offset: 0,
            dtype: DType::F32,
            shape: shape.to_vec(),
            strides: strides.to_vec(),
            global_offset: off.to_vec(),
            big_endian: false,
        }
    }

    #[test]
    fn a_row_shard_is_one_run() {
        let (runs, stride) = piece_runs(&piece(&[2, 3], &[3, 1], &[4, 0]), &[6, 3]);
        assert_eq!(
            runs,
            vec![Run {
                out: 12,
                src: 0,
                len: 6
            }]
        );
        assert_eq!(stride, 1);
    }

    #[test]
    fn a_column_shard_is_one_run_per_row() {
        let (runs, _) = piece_runs(&piece(&[2, 2], &[2, 1], &[0, 1]), &[2, 3]);
        assert_eq!(
            runs,
            vec![
                Run {
                    out: 1,
                    src: 0,
                    len: 2
                },
                Run {
                    out: 4,
                    src: 2,
                    len: 2
                }
            ]
        );
    }

    #[test]
    fn a_transposed_view_is_strided() {
        // w.t() of a 2x3 storage: shape (3, 2), strides (1, 3).
        let (runs, stride) = piece_runs(&piece(&[3, 2], &[1, 3], &[0, 0]), &[3, 2]);
        assert_eq!(stride, 3);
        assert_eq!(
            runs,
            vec![
                Run {
                    out: 0,
                    src: 0,
                    len: 2
                },
                Run {
                    out: 2,
                    src: 1,
                    len: 2
                },
                Run {
                    out: 4,
                    src: 2,
                    len: 2
                }
            ]
        );
    }
}
