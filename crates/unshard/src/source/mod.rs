//! Readers: every input format reduces to a list of [`TensorSource`]s.
//!
//! A reader parses metadata and *describes* where each tensor's elements are: a
//! tensor is a list of [`Piece`]s, each a strided box of elements at a byte offset
//! of an input file, placed at `global_offset` inside the full tensor. A full-state
//! `.pt` gives one piece per tensor; a DCP chunk or a DTensor shard gives one piece
//! each. Readers never copy tensor bytes: the engine (`write`) assembles, converts and
//! writes. Adding a format means writing a reader that produces a [`Checkpoint`].

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::{DType, Error, Result};

pub mod dcp;
pub mod detect;
pub mod hf_dir;
pub mod legacy;
pub mod safetensors;
pub mod sharded;
pub mod torch;
pub mod zip;

pub use detect::{open, Format, OpenOptions};

/// The bytes of one input file, mapped read-only (or held, for decoded data).
#[derive(Debug)]
pub struct Blob {
    pub path: PathBuf,
    data: BlobData,
}

#[derive(Debug)]
enum BlobData {
    /// Metadata is parsed from the map; tensor data is read with `pread` from the
    /// file, so a file that shrinks under us gives a short read (an error), not SIGBUS.
    Mapped(memmap2::Mmap, File),
    Owned(Vec<u8>),
}

impl Blob {
    /// Maps a file read-only. An empty file gives an empty blob.
    pub fn open(path: &Path) -> Result<Blob> {
        let file = File::open(path).map_err(|e| Error::io("open", path, e))?;
        let len = file
            .metadata()
            .map_err(|e| Error::io("read the size of", path, e))?
            .len();
        if len == 0 {
            return Ok(Blob {
                path: path.to_path_buf(),
                data: BlobData::Owned(Vec::new()),
            });
        }
        // SAFETY: the map is read-only and used for metadata (headers, pickles), which
        // is parsed once up front. If another process truncated the file during that
        // parse, a read past the new end would fault (SIGBUS); tensor data, read for the
        // whole length of a merge, goes through `read_at` instead.
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| Error::io("map", path, e))?;
        // Readers touch the map here and there (a zip record, a pickle); tensor data is
        // read with `read_at`. Without this hint every touch of a page not in the cache
        // reads the whole readahead window around it: for a DCP directory, whose
        // every chunk is a small archive with records at both ends, that reads most of
        // the checkpoint before the merge starts, one fault at a time.
        let _ = map.advise(memmap2::Advice::Random);
        Ok(Blob {
            path: path.to_path_buf(),
            data: BlobData::Mapped(map, file),
        })
    }

    /// Wraps bytes decoded in memory (e.g. a decompressed DCP chunk).
    pub fn owned(path: PathBuf, bytes: Vec<u8>) -> Blob {
        Blob {
            path,
            data: BlobData::Owned(bytes),
        }
    }

    pub fn bytes(&self) -> &[u8] {
        match &self.data {
            BlobData::Mapped(m, _) => m,
            BlobData::Owned(v) => v,
        }
    }

    /// Fills `buf` with the bytes at `offset`. A short read means the file shrank
    /// since it was opened (its extent was validated then) and is an error.
    pub fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        use std::os::unix::fs::FileExt;
        let len = buf.len();
        let changed = || {
            Error::corrupt(
                &self.path,
                format!(
                    "cannot read {len} bytes at byte {offset}: the file is shorter than when it was opened (it changed while being read)"
                ),
            )
        };
        match &self.data {
            BlobData::Mapped(_, f) => f.read_exact_at(buf, offset).map_err(|e| {
                if e.kind() == std::io::ErrorKind::UnexpectedEof {
                    changed()
                } else {
                    Error::io("read", &self.path, e)
                }
            }),
            BlobData::Owned(v) => {
                let start = usize::try_from(offset).ok();
                let src = start.and_then(|s| v.get(s..s.checked_add(buf.len())?));
                buf.copy_from_slice(src.ok_or_else(changed)?);
                Ok(())
            }
        }
    }

    /// Whether the bytes come from a mapped file (rather than memory).
    pub fn is_mapped(&self) -> bool {
        matches!(self.data, BlobData::Mapped(..))
    }

    pub fn len(&self) -> u64 {
        self.bytes().len() as u64
    }

    pub fn is_empty(&self) -> bool {
        self.bytes().is_empty()
    }

    /// Asks the kernel to start reading a byte range into the page cache now, so that
    /// the reads that follow find it there or in flight. A hint: errors are ignored.
    pub fn will_need(&self, offset: u64, len: u64) {
        use std::os::fd::AsRawFd;
        // One request reads at most the device's readahead size (128 KiB by default),
        // so a long range is asked for in steps.
        const STEP: u64 = 1 << 20;
        if let BlobData::Mapped(_, f) = &self.data {
            let end = offset.saturating_add(len).min(self.len());
            let mut at = offset;
            while at < end {
                let n = STEP.min(end - at);
                // SAFETY: posix_fadvise only reads its arguments; the descriptor is open.
                let _ = unsafe {
                    libc::posix_fadvise(
                        f.as_raw_fd(),
                        at as libc::off_t,
                        n as libc::off_t,
                        libc::POSIX_FADV_WILLNEED,
                    )
                };
                at += n;
            }
        }
    }

    /// Unmaps every page of the map that parsing touched (see [`Blob::release`]).
    pub fn release_all(&self) {
        self.release(0, self.len());
    }

    /// Tells the kernel that a byte range will not be read again, so its pages stop
    /// counting toward the resident set. A hint: errors are ignored.
    pub fn release(&self, offset: u64, len: u64) {
        if let BlobData::Mapped(m, _) = &self.data {
            const PAGE: u64 = 4096;
            let start = offset.div_ceil(PAGE) * PAGE;
            let end = (offset.saturating_add(len) / PAGE * PAGE).min(m.len() as u64);
            if end > start {
                // SAFETY: DONTNEED on a private read-only file mapping only drops
                // clean pages; later reads fault them back in from the file.
                let _ = unsafe {
                    m.unchecked_advise_range(
                        memmap2::UncheckedAdvice::DontNeed,
                        start as usize,
                        (end - start) as usize,
                    )
                };
            }
        }
    }
}

/// Index of a [`Blob`] in [`Checkpoint::files`].
pub type FileId = usize;

/// A strided box of elements in a file, placed inside a full tensor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Piece {
    pub file: FileId,
    /// Byte offset, in the file, of the piece's first element (index `[0, 0, ...]`).
    pub byte_offset: u64,
    /// dtype of the stored elements.
    pub dtype: DType,
    /// Shape of the box.
    pub shape: Vec<u64>,
    /// Element strides of the box in the file (torch strides; never negative).
    pub strides: Vec<u64>,
    /// Where the box's first element sits in the full tensor.
    pub global_offset: Vec<u64>,
    /// Elements are stored big-endian and must be byte-swapped.
    pub big_endian: bool,
}

impl Piece {
    /// Number of elements in the box.
    pub fn numel(&self) -> u64 {
        self.shape.iter().product()
    }

    /// Whether the box's elements are laid out contiguously in C order.
    pub fn is_contiguous(&self) -> bool {
        let mut expect = 1u64;
        for (&n, &s) in self.shape.iter().zip(&self.strides).rev() {
            if n != 1 && s != expect {
                return false;
            }
            expect = expect.saturating_mul(n);
        }
        true
    }

    /// Bytes from `byte_offset` to one past the last element (0 for an empty box).
    pub fn span_bytes(&self) -> u64 {
        if self.shape.contains(&0) {
            return 0;
        }
        let last: u64 = self
            .shape
            .iter()
            .zip(&self.strides)
            .map(|(&n, &s)| (n - 1) * s)
            .sum();
        (last + 1) * self.dtype.size() as u64
    }
}

/// Which input a set of tensors shares storage with, for tie detection.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct StorageId {
    pub file: FileId,
    pub key: String,
}

/// One tensor of a checkpoint: what it is and where its pieces are.
#[derive(Clone, Debug)]
pub struct TensorSource {
    /// Name relative to the tensor dict found (before any renaming).
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<u64>,
    pub pieces: Vec<Piece>,
    /// The storage this tensor views, when it is a single view of one (plain `.pt`):
    /// two tensors with the same id share memory in torch.
    pub storage: Option<StorageId>,
    /// How the tensor was sharded, for `inspect` (e.g. `DTensor Shard(0), 2 ranks`).
    pub layout: Option<String>,
}

impl TensorSource {
    pub fn numel(&self) -> u64 {
        self.shape.iter().product()
    }
    pub fn nbytes(&self) -> u64 {
        self.numel() * self.dtype.size() as u64
    }
}

/// A non-tensor entry found near the tensors (step counters, metrics, optimizer
/// state), listed by `inspect` and otherwise ignored.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Extra {
    pub name: String,
    pub kind: String,
}

/// Everything a reader found in an input.
#[derive(Debug)]
pub struct Checkpoint {
    pub format: Format,
    pub path: PathBuf,
    pub files: Vec<Arc<Blob>>,
    /// Where the tensor dict was found (`state`, `model.module`); `None` = top level.
    pub key: Option<String>,
    pub tensors: Vec<TensorSource>,
    pub extras: Vec<Extra>,
    /// Things the reader noticed and the user should know (skipped optimizer state...).
    pub notes: Vec<String>,
    /// What the pickles read would run under `torch.load` (see [`crate::scan`]):
    /// unshard runs none of it, but the file is compromised and the user is told.
    pub unsafe_calls: Vec<crate::scan::UnsafeCall>,
}

impl Checkpoint {
    pub fn total_bytes(&self) -> u64 {
        self.tensors.iter().map(TensorSource::nbytes).sum()
    }
    pub fn total_parameters(&self) -> u64 {
        self.tensors.iter().map(TensorSource::numel).sum()
    }
}

/// Checks that a strided box fits inside `storage_bytes` bytes starting at
/// `storage_offset_bytes`, with overflow-safe arithmetic. Returns the byte span.
pub fn check_view(
    shape: &[u64],
    strides: &[u64],
    elem: u64,
    offset_elems: u64,
    storage_bytes: u64,
) -> std::result::Result<(), String> {
    if shape.len() != strides.len() {
        return Err(format!(
            "shape {shape:?} and strides {strides:?} have different lengths"
        ));
    }
    let mut numel: u64 = 1;
    for &n in shape {
        numel = numel
            .checked_mul(n)
            .ok_or_else(|| format!("shape {shape:?} overflows"))?;
    }
    let bytes = numel
        .checked_mul(elem)
        .ok_or_else(|| format!("shape {shape:?} is too large"))?;
    // Stride-0 (broadcast) views can describe huge tensors over a tiny storage; a real
    // checkpoint never expands a storage a thousandfold, a hostile one might.
    if bytes > storage_bytes.saturating_mul(1024).max(1 << 30) {
        return Err(format!(
            "shape {shape:?} would materialise {bytes} bytes from a {storage_bytes}-byte storage"
        ));
    }
    if numel == 0 {
        return Ok(());
    }
    let mut last = offset_elems;
    for (&n, &s) in shape.iter().zip(strides) {
        last = (n - 1)
            .checked_mul(s)
            .and_then(|x| last.checked_add(x))
            .ok_or_else(|| format!("strides {strides:?} overflow"))?;
    }
    let end = last
        .checked_add(1)
        .and_then(|x| x.checked_mul(elem))
        .ok_or_else(|| "offset overflows".to_string())?;
    if end > storage_bytes {
        return Err(format!(
            "shape {shape:?}, strides {strides:?} and offset {offset_elems} reach byte {end} of a {storage_bytes}-byte storage"
        ));
    }
    Ok(())
}

/// C-order strides of a shape.
pub fn contiguous_strides(shape: &[u64]) -> Vec<u64> {
    let mut strides = vec![0u64; shape.len()];
    let mut acc = 1u64;
    for (s, &n) in strides.iter_mut().zip(shape).rev() {
        *s = acc;
        acc = acc.saturating_mul(n.max(1));
    }
    strides
}

/// Checks that a tensor's pieces tile it exactly: every box lies inside the tensor,
/// no two boxes share an element, and together they hold as many elements as the
/// tensor. The engine writes each output element from the one piece that covers it,
/// so a gap would leave uninitialised bytes in the output and an overlap would make
/// the result depend on piece order: both are errors naming the tensor. Empty boxes
/// (the empty shards of `torch.chunk`) are allowed anywhere inside the bounds.
pub fn check_coverage(path: &Path, t: &TensorSource) -> Result<()> {
    let bad = |msg: String| Error::bad_tensor(path, &t.name, msg);
    let ndim = t.shape.len();
    let numel = t
        .shape
        .iter()
        .try_fold(1u64, |acc, &n| acc.checked_mul(n))
        .ok_or_else(|| bad(format!("shape {:?} overflows", t.shape)))?;
    let mut total: u64 = 0;
    let mut boxes: Vec<(&[u64], Vec<u64>)> = Vec::with_capacity(t.pieces.len());
    for p in &t.pieces {
        let at = |what: &str| {
            format!(
                "the chunk at offsets {:?} with sizes {:?} {what}",
                p.global_offset, p.shape
            )
        };
        if p.shape.len() != ndim || p.global_offset.len() != ndim || p.strides.len() != ndim {
            return Err(bad(at(&format!(
                "does not have the tensor's {ndim} dimension(s)"
            ))));
        }
        let mut end = Vec::with_capacity(ndim);
        let mut volume: u64 = 1;
        for d in 0..ndim {
            let e = p.global_offset[d]
                .checked_add(p.shape[d])
                .filter(|&e| e <= t.shape[d])
                .ok_or_else(|| {
                    bad(at(&format!(
                        "reaches past the end of dimension {d} (size {})",
                        t.shape[d]
                    )))
                })?;
            end.push(e);
            volume = volume
                .checked_mul(p.shape[d])
                .ok_or_else(|| bad(at("overflows")))?;
        }
        total = total
            .checked_add(volume)
            .ok_or_else(|| bad("its chunks overflow".into()))?;
        if volume > 0 {
            boxes.push((&p.global_offset, end));
        }
    }
    if let Some((a, b)) = first_overlap(&boxes) {
        let (sa, ea) = &boxes[a];
        let (sb, eb) = &boxes[b];
        return Err(bad(format!(
            "chunks overlap: [{}] and [{}]",
            ranges(sa, ea),
            ranges(sb, eb)
        )));
    }
    if total != numel {
        return Err(bad(format!(
            "its chunks cover {total} of its {numel} elements; a chunk or a rank's shard is missing"
        )));
    }
    Ok(())
}

/// `0..126, 0..64` for a box.
fn ranges(start: &[u64], end: &[u64]) -> String {
    start
        .iter()
        .zip(end)
        .map(|(s, e)| format!("{s}..{e}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The first pair of boxes (`start`, exclusive `end`) that share an element. A sweep
/// along the dimension where the boxes differ most keeps this near-linear for the
/// usual row or column shards.
fn first_overlap(boxes: &[(&[u64], Vec<u64>)]) -> Option<(usize, usize)> {
    let ndim = boxes.first()?.0.len();
    if boxes.len() < 2 {
        return None;
    }
    let sweep = (0..ndim)
        .max_by_key(|&d| {
            let mut starts: Vec<u64> = boxes.iter().map(|b| b.0[d]).collect();
            starts.sort_unstable();
            starts.dedup();
            starts.len()
        })
        .unwrap_or(0);
    let mut order: Vec<usize> = (0..boxes.len()).collect();
    if ndim > 0 {
        order.sort_by_key(|&i| boxes[i].0[sweep]);
    }
    let mut active: Vec<usize> = Vec::new();
    for &i in &order {
        let (start, end) = &boxes[i];
        if ndim > 0 {
            active.retain(|&j| boxes[j].1[sweep] > start[sweep]);
        }
        for &j in &active {
            let (s2, e2) = &boxes[j];
            if (0..ndim).all(|d| start[d] < e2[d] && s2[d] < end[d]) {
                return Some((j.min(i), j.max(i)));
            }
        }
        active.push(i);
    }
    None
}

/// A config directory that travels with a checkpoint and serves as the base config
/// when `--base` is not given: verl writes one as `huggingface/` beside its rank files.
pub fn config_dir_for(checkpoint: &Path) -> Option<PathBuf> {
    let dir = if checkpoint.is_dir() {
        checkpoint
    } else {
        checkpoint.parent()?
    };
    let hf = dir.join("huggingface");
    hf.join("config.json").is_file().then_some(hf)
}
