//! The engine: streams tensors from input files into output shards.
//!
//! Every shard file is laid out by the plan before a byte is written, so each
//! tensor's place in its file is known. The work is cut into blocks: aligned ranges
//! of [`WINDOW_BYTES`] of an output file. A block is filled from whatever it overlaps
//! (the header, the tensors, and for each tensor the pieces that hold its elements),
//! reading the inputs with positioned reads a chunk at a time, byte-swapping and
//! converting on the way, and is written with one positioned write, straight to the
//! disk where the filesystem allows direct I/O. Each input byte is read once and
//! each output byte written once. Blocks run in parallel across all shards and
//! within large tensors, so memory is a block and a chunk per thread, whatever the
//! model size: tensor data is not read through the inputs' maps (a strided view,
//! rare, is gathered from the map and its pages released), and the pages the readers
//! touched while parsing are unmapped before writing starts.
//!
//! Output goes to a staging directory beside the destination, which is fsynced and
//! renamed into place only when everything succeeded; on any error or interruption
//! the staging directory is removed.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use rayon::prelude::*;

use crate::dtype::{self, ConvertStats};
use crate::plan::{Origin, Plan, PlannedTensor};
use crate::source::{contiguous_strides, Blob, Checkpoint, FileId, Piece};
use crate::{DType, Error, Result};

/// Output bytes assembled per unit of work (a multiple of the direct I/O alignment).
pub const WINDOW_BYTES: u64 = 8 << 20;

/// Set by a signal handler to stop the writer at the next block.
pub static INTERRUPTED: AtomicBool = AtomicBool::new(false);

/// Receives progress in output bytes.
pub trait Progress: Sync {
    /// A step before any bytes are counted (reading metadata, planning).
    fn stage(&self, _what: &str) {}
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
        files.push(OutFile::create(&staging.join(&s.file_name), s.file_size)?);
    }
    let total: u64 = plan
        .shards
        .iter()
        .map(|s| s.file_size - s.header.len() as u64)
        .sum();
    progress.start(total);
    let stats = write_blocks(plan, inputs, &files, WINDOW_BYTES, progress)?;
    // A signal that arrived while the last blocks were in flight still stops the run.
    if INTERRUPTED.load(Ordering::Relaxed) {
        return Err(Error::Interrupted);
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
    for f in &files {
        f.file
            .sync_all()
            .map_err(|e| Error::io("flush", &f.path, e))?;
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
        bytes_written: total,
        files: names,
        cleaned: Vec::new(),
    })
}

/// Fills and writes every block of every shard, in parallel; returns what conversion
/// saw per planned tensor. `block_bytes` is a multiple of [`DIRECT_ALIGN`].
fn write_blocks(
    plan: &Plan,
    inputs: Inputs<'_>,
    files: &[OutFile],
    block_bytes: u64,
    progress: &dyn Progress,
) -> Result<Vec<ConvertStats>> {
    let mut blocks = Vec::new();
    for (shard, s) in plan.shards.iter().enumerate() {
        let mut start = 0;
        while start < s.file_size {
            let len = block_bytes.min(s.file_size - start);
            blocks.push(Block { shard, start, len });
            start += len;
        }
    }
    // Pages the readers touched while parsing are not needed again.
    for blob in inputs
        .checkpoint
        .files
        .iter()
        .chain(inputs.base.into_iter().flat_map(|b| &b.files))
    {
        blob.release_all();
    }
    // Blocks are written in any order, so take them in the order their input lies
    // on the disk: the threads then read a few streams front to back instead of
    // jumping about (a DCP file holds its chunks largest first, not by name).
    blocks.sort_by_cached_key(|b| input_position(plan, b));
    let pool = BufferPool::new(block_bytes as usize);
    let run = || {
        blocks
            .par_iter()
            .map(|b| {
                if INTERRUPTED.load(Ordering::Relaxed) {
                    return Err(Error::Interrupted);
                }
                let mut bufs = pool.take();
                let out = bufs.block.slice_mut(b.len as usize);
                let (stats, tensor_bytes) = fill_block(plan, inputs, b, out, &mut bufs.scratch)?;
                files[b.shard].write_block(out, b.start)?;
                pool.give(bufs);
                progress.advance(tensor_bytes);
                Ok(stats)
            })
            .collect::<Result<Vec<Vec<(usize, ConvertStats)>>>>()
    };
    let workers = rayon::ThreadPoolBuilder::new()
        .num_threads(worker_threads())
        .thread_name(|i| format!("unshard-write-{i}"))
        .build();
    let per_block = match workers {
        Ok(workers) => workers.install(run)?,
        // No threads to spare: the global pool does the work.
        Err(_) => run()?,
    };
    let mut stats = vec![ConvertStats::default(); plan.tensors.len()];
    for (ti, s) in per_block.into_iter().flatten() {
        stats[ti].add(s);
    }
    Ok(stats)
}

/// Where a block starts reading: the input (checkpoint before base), file and byte
/// offset of the first element of the first tensor it holds. `None` (sorted first)
/// for a block of header only.
fn input_position(plan: &Plan, b: &Block) -> Option<(bool, FileId, u64)> {
    let shard = &plan.shards[b.shard];
    let first = shard
        .entries
        .partition_point(|&(ti, off)| off + plan.tensors[ti].nbytes() <= b.start);
    let &(ti, off) = shard.entries[first..]
        .iter()
        .find(|&&(ti, _)| plan.tensors[ti].nbytes() > 0)?;
    let t = &plan.tensors[ti];
    let e = (b.start.max(off) - off) / t.dtype.size() as u64;
    t.source.pieces.iter().find_map(|p| {
        let runs = PieceRuns::new(p, &t.source.shape);
        let j = runs.first_ending_after(e);
        if j >= runs.count {
            return None;
        }
        let r = runs.run(j);
        (r.out <= e).then(|| {
            let src = r.src + (e - r.out) * runs.stride;
            (
                t.origin == Origin::Base,
                p.file,
                p.byte_offset + src * p.dtype.size() as u64,
            )
        })
    })
}

/// Threads that fill and write blocks. One per core keeps the cores busy while data
/// is in the page cache; twice that keeps them busy while some threads wait for the
/// disk (a direct write returns when the data is on the device). Each holds a block
/// and a chunk (9 MiB); 16 of them convert far faster than any disk delivers, so more
/// would only add memory.
fn worker_threads() -> usize {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    (2 * cores).min(16)
}

/// One unit of work: bytes `[start, start + len)` of shard `shard`'s file.
#[derive(Clone, Copy, Debug)]
struct Block {
    shard: usize,
    start: u64,
    len: u64,
}

/// Alignment of direct I/O: of file offsets, lengths and buffer addresses.
const DIRECT_ALIGN: usize = 4096;

/// Input bytes read and converted at a time: small enough to stay in a core's cache
/// between the read and the conversion.
const CHUNK_BYTES: usize = 1 << 20;

/// A buffer whose start is aligned for direct I/O.
struct AlignedBuf {
    raw: Vec<u8>,
    start: usize,
}

impl AlignedBuf {
    fn new(len: usize) -> AlignedBuf {
        let raw = vec![0u8; len + DIRECT_ALIGN];
        let misalign = raw.as_ptr() as usize % DIRECT_ALIGN;
        let start = (DIRECT_ALIGN - misalign) % DIRECT_ALIGN;
        AlignedBuf { raw, start }
    }

    fn slice_mut(&mut self, len: usize) -> &mut [u8] {
        &mut self.raw[self.start..self.start + len]
    }
}

/// What a worker fills a block with: the block itself and a scratch buffer for
/// input that needs converting.
struct Buffers {
    block: AlignedBuf,
    scratch: Vec<u8>,
}

/// Buffers handed from block to block, so memory is a few buffers per thread and
/// nothing is allocated or zeroed per block.
struct BufferPool {
    block_bytes: usize,
    free: std::sync::Mutex<Vec<Buffers>>,
}

impl BufferPool {
    fn new(block_bytes: usize) -> BufferPool {
        BufferPool {
            block_bytes,
            free: std::sync::Mutex::new(Vec::new()),
        }
    }

    fn take(&self) -> Buffers {
        let reused = self.free.lock().ok().and_then(|mut f| f.pop());
        reused.unwrap_or_else(|| Buffers {
            block: AlignedBuf::new(self.block_bytes),
            scratch: vec![0u8; CHUNK_BYTES],
        })
    }

    fn give(&self, bufs: Buffers) {
        if let Ok(mut f) = self.free.lock() {
            f.push(bufs);
        }
    }
}

/// An output shard file. Blocks go straight to the disk with direct I/O where the
/// filesystem supports it: the output is written once, not copied into the page cache
/// and written back later (which `fsync` would then wait for), and it does not push
/// the inputs out of the cache. Elsewhere, and for a file's unaligned last bytes,
/// writes are buffered.
struct OutFile {
    path: PathBuf,
    file: File,
    direct: Option<File>,
    direct_refused: AtomicBool,
}

impl OutFile {
    /// Creates the file with `size` bytes reserved on the disk.
    fn create(path: &Path, size: u64) -> Result<OutFile> {
        let file = File::create(path).map_err(|e| Error::io("create", path, e))?;
        preallocate(&file, size).map_err(|e| Error::io("allocate space for", path, e))?;
        #[cfg(target_os = "linux")]
        let direct = {
            use std::os::unix::fs::OpenOptionsExt;
            std::fs::OpenOptions::new()
                .write(true)
                .custom_flags(libc::O_DIRECT)
                .open(path)
                .ok()
        };
        #[cfg(not(target_os = "linux"))]
        let direct = None;
        Ok(OutFile {
            path: path.to_path_buf(),
            file,
            direct,
            direct_refused: AtomicBool::new(false),
        })
    }

    /// Writes `buf` at `offset`, a multiple of [`DIRECT_ALIGN`] like `buf`'s address.
    fn write_block(&self, buf: &[u8], offset: u64) -> Result<()> {
        let aligned = buf.len() / DIRECT_ALIGN * DIRECT_ALIGN;
        let mut done = 0;
        if let Some(direct) = &self.direct {
            if aligned > 0 && !self.direct_refused.load(Ordering::Relaxed) {
                match direct.write_all_at(&buf[..aligned], offset) {
                    Ok(()) => done = aligned,
                    // The filesystem takes O_DIRECT opens but not these writes: buffer.
                    Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                        self.direct_refused.store(true, Ordering::Relaxed)
                    }
                    Err(e) => return Err(Error::io("write", &self.path, e)),
                }
            }
        }
        self.file
            .write_all_at(&buf[done..], offset + done as u64)
            .map_err(|e| Error::io("write", &self.path, e))
    }
}

/// Fills `out` with the bytes of `block`: the header and the tensors it overlaps.
/// Returns what conversion saw, per tensor, and how many tensor bytes were filled.
fn fill_block(
    plan: &Plan,
    inputs: Inputs<'_>,
    block: &Block,
    out: &mut [u8],
    scratch: &mut Vec<u8>,
) -> Result<(Vec<(usize, ConvertStats)>, u64)> {
    let shard = &plan.shards[block.shard];
    let (b0, b1) = (block.start, block.start + block.len);
    let header = shard.header.len() as u64;
    // Bytes of `out` filled so far; gaps (a plan leaves none) are zeroed.
    let mut filled = 0u64;
    if b0 < header {
        let n = header.min(b1) - b0;
        out[..n as usize].copy_from_slice(&shard.header[b0 as usize..(b0 + n) as usize]);
        filled = n;
    }
    let mut stats = Vec::new();
    let first = shard
        .entries
        .partition_point(|&(ti, off)| off + plan.tensors[ti].nbytes() <= b0);
    for &(ti, off) in &shard.entries[first..] {
        if off >= b1 {
            break;
        }
        let t = &plan.tensors[ti];
        let (lo, hi) = (off.max(b0), (off + t.nbytes()).min(b1));
        if lo >= hi {
            continue;
        }
        if lo - b0 > filled {
            out[filled as usize..(lo - b0) as usize].fill(0);
        }
        let dst = &mut out[(lo - b0) as usize..(hi - b0) as usize];
        let s = fill_bytes(t, inputs.files(t.origin), lo - off, hi - off, dst, scratch)?;
        stats.push((ti, s));
        filled = hi - b0;
    }
    out[filled as usize..].fill(0);
    Ok((stats, block.len - header.saturating_sub(b0).min(block.len)))
}

/// Fills `out` with bytes `[byte0, byte1)` of tensor `t`'s output data. An element
/// cut by the range's edges (possible only if a tensor's offset in its file were not
/// a multiple of its element size, which the canonical layout never produces) is
/// converted whole and the part inside copied; it is counted in the stats of the
/// range that holds its last byte.
fn fill_bytes(
    t: &PlannedTensor,
    files: &[Arc<Blob>],
    byte0: u64,
    byte1: u64,
    out: &mut [u8],
    scratch: &mut Vec<u8>,
) -> Result<ConvertStats> {
    let size = t.dtype.size() as u64;
    let (e0, e1) = (byte0.div_ceil(size), byte1 / size);
    let mut stats = ConvertStats::default();
    if e0 < e1 {
        let dst = &mut out[(e0 * size - byte0) as usize..(e1 * size - byte0) as usize];
        stats = fill_window(t, files, e0, e1, dst, scratch)?;
    }
    let mut cut = |e: u64| -> Result<()> {
        let mut elem = [0u8; 8];
        let elem = &mut elem[..size as usize];
        let s = fill_window(t, files, e, e + 1, elem, scratch)?;
        let (from, to) = (byte0.max(e * size), byte1.min((e + 1) * size));
        out[(from - byte0) as usize..(to - byte0) as usize]
            .copy_from_slice(&elem[(from - e * size) as usize..(to - e * size) as usize]);
        if (e + 1) * size <= byte1 {
            stats.add(s);
        }
        Ok(())
    };
    let head_cut = byte0 % size != 0;
    if head_cut {
        cut(byte0 / size)?;
    }
    // The last element, unless the range lies inside the one just done.
    if byte1 % size != 0 && !(head_cut && byte1 / size == byte0 / size) {
        cut(byte1 / size)?;
    }
    Ok(stats)
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
/// a single run; a column shard is one run per row. Runs are computed on demand, so
/// a window finds its first run by binary search instead of walking all before it.
struct PieceRuns<'a> {
    /// Shape of the dims that are not merged into a run.
    outer: &'a [u64],
    /// Their element strides in the source and in the full tensor.
    src_strides: &'a [u64],
    out_strides: Vec<u64>,
    /// Output position of the piece's first element.
    base_out: u64,
    len: u64,
    stride: u64,
    count: u64,
}

impl<'a> PieceRuns<'a> {
    fn new(p: &'a Piece, global: &[u64]) -> PieceRuns<'a> {
        let n = p.shape.len();
        let mut runs = PieceRuns {
            outer: &[],
            src_strides: &[],
            out_strides: Vec::new(),
            base_out: 0,
            len: 1,
            stride: 1,
            count: 1,
        };
        if p.shape.contains(&0) {
            runs.count = 0;
            return runs;
        }
        if n == 0 {
            return runs;
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
        runs.base_out = (0..n).map(|d| p.global_offset[d] * gs[d]).sum();
        runs.outer = &p.shape[..k];
        runs.src_strides = &p.strides[..k];
        runs.out_strides = gs[..k].to_vec();
        runs.len = len;
        runs.stride = stride;
        runs.count = runs.outer.iter().product();
        runs
    }

    /// Run `j` (`j < count`), counting in C order over the outer dims.
    fn run(&self, mut j: u64) -> Run {
        let (mut out, mut src) = (self.base_out, 0);
        for d in (0..self.outer.len()).rev() {
            let i = j % self.outer[d];
            j /= self.outer[d];
            out += i * self.out_strides[d];
            src += i * self.src_strides[d];
        }
        Run {
            out,
            src,
            len: self.len,
        }
    }

    /// The first run that ends after output element `e` (`count` if none does).
    fn first_ending_after(&self, e: u64) -> u64 {
        let (mut lo, mut hi) = (0, self.count);
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            let r = self.run(mid);
            if r.out + r.len <= e {
                lo = mid + 1;
            } else {
                hi = mid;
            }
        }
        lo
    }
}

/// Fills output elements `[e0, e1)` of tensor `t` into `out`, reading the inputs
/// with positioned reads: straight into `out` when no conversion is needed, else a
/// chunk of `scratch` at a time.
fn fill_window(
    t: &PlannedTensor,
    files: &[Arc<Blob>],
    e0: u64,
    e1: u64,
    out: &mut [u8],
    scratch: &mut Vec<u8>,
) -> Result<ConvertStats> {
    if scratch.len() < CHUNK_BYTES {
        scratch.resize(CHUNK_BYTES, 0);
    }
    let mut stats = ConvertStats::default();
    let osz = t.dtype.size() as u64;
    for p in &t.source.pieces {
        let blob = files.get(p.file).ok_or_else(|| {
            Error::bad_tensor(Path::new("?"), &t.name, "piece refers to a missing file")
        })?;
        let isz = p.dtype.size() as u64;
        let chunk = CHUNK_BYTES as u64 / isz;
        let runs = PieceRuns::new(p, &t.source.shape);
        let stride = runs.stride;
        prefetch(blob, p, &runs, e0, e1);
        // Bytes of the map a strided gather touched, released when the piece is done.
        let mut touched: Option<(u64, u64)> = None;
        for j in runs.first_ending_after(e0)..runs.count {
            let r = runs.run(j);
            if r.out >= e1 {
                break;
            }
            let (a, b) = (r.out.max(e0), (r.out + r.len).min(e1));
            if a >= b {
                continue;
            }
            let first_src = r.src + (a - r.out) * stride;
            let start = p.byte_offset + first_src * isz;
            let dst = &mut out[((a - e0) * osz) as usize..((b - e0) * osz) as usize];
            if stride == 1 && p.dtype == t.dtype && !p.big_endian {
                // Stored as written: one positioned read straight into the output.
                blob.read_at(start, dst)?;
                if t.dtype.is_float() {
                    stats.add(dtype::scan(dst, t.dtype));
                }
                continue;
            }
            let mut done = 0;
            while done < b - a {
                let n = chunk.min(b - a - done);
                let src = &mut scratch[..(n * isz) as usize];
                let at = start + done * stride * isz;
                if stride == 1 {
                    blob.read_at(at, src)?;
                } else {
                    // Strided (a transposed or expanded view, rare in checkpoints):
                    // gathered element by element from the map.
                    let data = blob.bytes();
                    for (i, e) in src.chunks_exact_mut(isz as usize).enumerate() {
                        let from = (at + i as u64 * stride * isz) as usize;
                        e.copy_from_slice(data.get(from..from + isz as usize).ok_or_else(
                            || {
                                Error::bad_tensor(
                                    &blob.path,
                                    &t.name,
                                    "data lies past the end of the file",
                                )
                            },
                        )?);
                    }
                    let end = at + ((n - 1) * stride + 1) * isz;
                    touched = Some(touched.map_or((at, end), |(lo, hi)| (lo.min(at), hi.max(end))));
                }
                if p.big_endian {
                    dtype::byteswap(src, isz as usize);
                }
                let d = &mut dst[(done * osz) as usize..((done + n) * osz) as usize];
                stats.add(convert_run(src, p.dtype, d, t.dtype));
                done += n;
            }
        }
        if let Some((lo, hi)) = touched {
            blob.release(lo, hi - lo);
        }
    }
    Ok(stats)
}

/// Starts reading the bytes of piece `p` that elements `[e0, e1)` need, all at once,
/// so that the chunked reads that follow do not wait for the disk one after the other
/// (several threads reading different places of one file confuse the kernel's own
/// readahead). Only for contiguous runs whose span is not mostly gaps.
fn prefetch(blob: &Blob, p: &Piece, runs: &PieceRuns<'_>, e0: u64, e1: u64) {
    let isz = p.dtype.size() as u64;
    let j0 = runs.first_ending_after(e0);
    if runs.stride != 1 || j0 >= runs.count || e1 == 0 {
        return;
    }
    let mut j1 = runs.first_ending_after(e1 - 1).min(runs.count - 1);
    if runs.run(j1).out >= e1 && j1 > j0 {
        j1 -= 1;
    }
    let (first, last) = (runs.run(j0), runs.run(j1));
    let a = first.out.max(e0);
    let b = (last.out + last.len).min(e1);
    if a >= b || first.out >= e1 {
        return;
    }
    let start = first.src + (a - first.out);
    let end = last.src + (b - last.out);
    if end <= start || (end - start) > 2 * (b - a) {
        return;
    }
    blob.will_need(p.byte_offset + start * isz, (end - start) * isz);
}

thread_local! {
    /// Scratch for [`read_tensor`] and [`read_tensor_range`], which `verify` and `diff`
    /// call once per window.
    static SCRATCH: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Reads a whole tensor into memory in C order, converted to `to`. For tests,
/// `verify` and `diff` on tensors of reasonable size; merging streams instead.
pub fn read_tensor(
    files: &[Arc<Blob>],
    source: &crate::source::TensorSource,
    to: DType,
) -> Result<(Vec<u8>, ConvertStats)> {
    let n = source.numel();
    let mut out = vec![0u8; (n * to.size() as u64) as usize];
    let stats = read_tensor_range(files, source, to, 0, n, &mut out)?;
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
    SCRATCH.with_borrow_mut(|scratch| fill_window(&t, files, e0, e1, out, scratch))
}

fn convert_run(src: &[u8], from: DType, dst: &mut [u8], to: DType) -> ConvertStats {
    dtype::convert(src, from, dst, to)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::source::{Format, TensorSource};

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

    /// All runs of a piece, and their source stride.
    fn piece_runs(p: &Piece, global: &[u64]) -> (Vec<Run>, u64) {
        let runs = PieceRuns::new(p, global);
        ((0..runs.count).map(|j| runs.run(j)).collect(), runs.stride)
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

    #[test]
    fn a_window_finds_its_first_run_by_search() {
        // Columns 1..3 of a 5x3 tensor: one run of 2 per row, at outputs 1, 4, 7, 10, 13.
        let p = piece(&[5, 2], &[2, 1], &[0, 1]);
        let runs = PieceRuns::new(&p, &[5, 3]);
        assert_eq!(runs.count, 5);
        assert_eq!(runs.first_ending_after(0), 0);
        assert_eq!(runs.first_ending_after(3), 1);
        assert_eq!(runs.first_ending_after(6), 2);
        assert_eq!(runs.first_ending_after(14), 4);
        assert_eq!(runs.first_ending_after(15), 5);
        assert_eq!(
            runs.run(3),
            Run {
                out: 10,
                src: 6,
                len: 2
            }
        );
    }

    fn le_bytes(values: &[f32]) -> Vec<u8> {
        values.iter().flat_map(|v| v.to_le_bytes()).collect()
    }

    fn source(name: &str, dtype: DType, shape: &[u64], pieces: Vec<Piece>) -> TensorSource {
        TensorSource {
            name: name.into(),
            dtype,
            shape: shape.to_vec(),
            pieces,
            storage: None,
            layout: None,
        }
    }

    fn stored(dtype: DType, byte_offset: u64, shape: &[u64], global_offset: &[u64]) -> Piece {
        Piece {
            file: 0,
            byte_offset,
            dtype,
            shape: shape.to_vec(),
            strides: contiguous_strides(shape),
            global_offset: global_offset.to_vec(),
            big_endian: false,
        }
    }

    /// A shard laid out by hand so that elements straddle block edges (a 14-byte
    /// header, then 3 bytes, then 2- and 4-byte elements at odd offsets), written in
    /// 4 KiB blocks: the file must equal the tensors converted whole, and a value
    /// cut by a block edge must be counted once.
    #[test]
    fn blocks_fill_elements_cut_by_their_edges() {
        let a: Vec<f32> = (0..3000)
            .map(|i| {
                if i == 2039 {
                    f32::NAN
                } else {
                    i as f32 * 0.37 - 5.0
                }
            })
            .collect();
        let c: Vec<f32> = (0..4000)
            .map(|i| {
                if i == 543 {
                    f32::INFINITY
                } else {
                    1.0 / (i as f32 + 0.5)
                }
            })
            .collect();
        // Input file: A, then B's 3 bytes, then C as two column shards of a 4x1000.
        let mut input = le_bytes(&a);
        input.extend_from_slice(&[7, 8, 9]);
        let c_at = input.len() as u64;
        for half in 0..2 {
            for row in 0..4 {
                input.extend(le_bytes(
                    &c[row * 1000 + half * 500..row * 1000 + half * 500 + 500],
                ));
            }
        }
        let blob = Arc::new(Blob::owned(PathBuf::from("input"), input));
        let ckpt = Checkpoint {
            format: Format::TorchZip,
            path: PathBuf::from("input"),
            files: vec![blob],
            key: None,
            tensors: Vec::new(),
            extras: Vec::new(),
            notes: Vec::new(),
            unsafe_calls: Vec::new(),
        };
        let planned = |name: &str, dtype: DType, source: TensorSource| PlannedTensor {
            name: name.into(),
            origin: Origin::Checkpoint,
            source,
            dtype,
        };
        let tensors = vec![
            planned(
                "a",
                DType::BF16,
                source(
                    "a",
                    DType::F32,
                    &[3000],
                    vec![stored(DType::F32, 0, &[3000], &[0])],
                ),
            ),
            planned(
                "b",
                DType::U8,
                source(
                    "b",
                    DType::U8,
                    &[3],
                    vec![stored(DType::U8, 12_000, &[3], &[0])],
                ),
            ),
            planned(
                "c",
                DType::F32,
                source(
                    "c",
                    DType::F32,
                    &[4, 1000],
                    vec![
                        stored(DType::F32, c_at, &[4, 500], &[0, 0]),
                        stored(DType::F32, c_at + 8000, &[4, 500], &[0, 500]),
                    ],
                ),
            ),
        ];
        let header = b"fourteen bytes".to_vec();
        let entries = vec![(1, 14), (0, 17), (2, 6017)];
        let file_size = 6017 + 16_000;
        let plan = Plan {
            tensors,
            shards: vec![crate::plan::ShardPlan {
                file_name: "x.safetensors".into(),
                header: header.clone(),
                entries,
                file_size,
            }],
            dtype: None,
            config: None,
            index: None,
            total_size: file_size - 14,
            report: Default::default(),
        };
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("x.safetensors");
        let files = vec![OutFile::create(&path, file_size).unwrap()];
        let inputs = Inputs {
            checkpoint: &ckpt,
            base: None,
        };
        let stats = write_blocks(&plan, inputs, &files, 4096, &NoProgress).unwrap();
        drop(files);

        let mut want = header;
        want.extend_from_slice(&[7, 8, 9]);
        let mut a_bf16 = vec![0u8; 6000];
        dtype::convert(&le_bytes(&a), DType::F32, &mut a_bf16, DType::BF16);
        want.extend(a_bf16);
        want.extend(le_bytes(&c));
        assert_eq!(std::fs::read(&path).unwrap(), want);
        assert_eq!(stats[0].nan, 1, "a NaN cut by a block edge is counted once");
        assert_eq!(
            stats[2].inf, 1,
            "an inf cut by a block edge is counted once"
        );
    }
}
