//! Readers: every input format reduces to a list of [`TensorSource`]s.
//!
//! A reader parses metadata and *describes* where each tensor's elements are: a
//! tensor is a list of [`Piece`]s, each a strided box of elements at a byte offset
//! of an input file, placed at `global_offset` inside the full tensor. A full-state
//! `.pt` gives one piece per tensor; a DCP chunk or a DTensor shard gives one piece
//! each. Readers never read tensor bytes: the engine (`write`) assembles, converts and
//! writes.
//!
//! Inputs are [`Blob`]s over a [`ByteSource`] (`bytes`): readers ask for the byte
//! ranges they parse (zip records, pickles, headers), never for a whole-file map, so
//! a reader works the same over a local file, bytes in memory, or a remote object.
//!
//! # Adding a format
//!
//! 1. **Variant**: add a [`Format`] variant in `detect.rs`, with its `id()` (stable,
//!    used by `inspect --json`) and its `Display` text.
//! 2. **Detection**: recognise it in `detect.rs` from its first bytes
//!    ([`Blob::head`]) for a file, or from the directory's layout in `open_dir`; put
//!    it before any format it could be mistaken for, and keep `unknown()`'s
//!    description of unreadable files accurate.
//! 3. **Reader**: a module here that returns a [`Checkpoint`]: open files with
//!    [`Blob::open`], read metadata with [`Blob::read_vec`] / [`Blob::read_ranges`]
//!    (many small records in one request), describe every tensor as [`Piece`]s, check
//!    views with [`check_view`] and sharded tensors with [`check_coverage`]. Never
//!    read tensor data, never panic, and name the file (and tensor) in every error,
//!    with a hint when the user can do something.
//! 4. **Fuzz target**: `fuzz/fuzz_targets/<format>.rs` feeding arbitrary bytes to the
//!    reader (through [`MemBytes`] or a scratch file), with a seed corpus from the
//!    fixtures, listed in `fuzz/Cargo.toml` and `fuzz/README.md`.
//! 5. **Fixture generator**: a script in `fixtures/` that writes small inputs with the
//!    real tool, and the expected tensors from the tool itself (never from unshard).
//! 6. **Docs**: a section of `docs/inputs.md` (what the user has, what to pass, what
//!    is refused and what to do instead), and the byte layout in `docs/formats.md`.
//! 7. **Test**: merge the fixture and compare with the tool's own output, byte for
//!    byte (`crates/unshard-cli/tests/`), plus unit tests of the reader's edge cases.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::dtype::DType;
use crate::error::{Error, Result};

pub mod audit;
pub mod dcp;
pub mod deepspeed;
pub mod detect;
pub mod hf_dir;
pub mod hf_sharded;
pub mod hints;
pub mod legacy;
pub mod megatron;
pub mod safetensors;
pub mod sharded;
#[cfg(test)]
pub(crate) mod test_input;
pub mod torch;
pub mod zip;

pub use crate::bytes::{fs, Blob, ByteSource};
#[cfg(feature = "internals")]
pub use crate::bytes::{LocalFile, MemBytes};
pub(crate) use detect::format_id;
#[cfg(feature = "internals")]
pub use detect::open_blob;
pub use detect::{open, Format, OpenOptions};

/// Index of a [`Blob`] in [`Checkpoint::files`].
pub type FileId = usize;

/// A strided box of elements in a file, placed inside a full tensor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Piece {
    /// The file holding the box ([`Checkpoint::files`] index).
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
    /// The file holding the storage.
    pub file: FileId,
    /// The storage's key in that file.
    pub key: String,
}

/// The pieces of a tensor, shared between its copies: planning copies every tensor
/// (a candidate per tensor, more than once), and a DCP checkpoint of many ranks has
/// a piece per chunk, hundreds of thousands of them. Reads as a `Vec<Piece>`; a
/// change to one copy's pieces copies them first.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Pieces(Arc<Vec<Piece>>);

impl std::ops::Deref for Pieces {
    type Target = Vec<Piece>;
    fn deref(&self) -> &Vec<Piece> {
        &self.0
    }
}

impl std::ops::DerefMut for Pieces {
    fn deref_mut(&mut self) -> &mut Vec<Piece> {
        Arc::make_mut(&mut self.0)
    }
}

impl From<Vec<Piece>> for Pieces {
    /// Spare capacity is given back: a vector pushed to holds room for four pieces
    /// after its first, and a tensor has one piece more often than not, so tens of
    /// thousands of tensors (DeepSeek-V3's experts) would keep four times the memory
    /// their pieces need for as long as the plan lives.
    fn from(mut v: Vec<Piece>) -> Pieces {
        v.shrink_to_fit();
        Pieces(Arc::new(v))
    }
}

impl<'a> IntoIterator for &'a Pieces {
    type Item = &'a Piece;
    type IntoIter = std::slice::Iter<'a, Piece>;
    fn into_iter(self) -> Self::IntoIter {
        self.0.iter()
    }
}

/// One tensor of a checkpoint: what it is and where its pieces are.
#[derive(Clone, Debug)]
pub struct TensorSource {
    /// Name relative to the tensor dict found (before any renaming).
    pub name: String,
    /// Element type of the full tensor.
    pub dtype: DType,
    /// Shape of the full tensor.
    pub shape: Vec<u64>,
    /// The boxes that tile it, each in some file.
    pub pieces: Pieces,
    /// The storage this tensor views, when it is a single view of one (plain `.pt`):
    /// two tensors with the same id share memory in torch.
    pub storage: Option<StorageId>,
    /// How the tensor was sharded, for `inspect` (e.g. `DTensor Shard(0), 2 ranks`).
    pub layout: Option<String>,
}

impl TensorSource {
    /// Number of elements.
    pub fn numel(&self) -> u64 {
        self.shape.iter().product()
    }
    /// Size in bytes.
    pub fn nbytes(&self) -> u64 {
        self.numel() * self.dtype.size() as u64
    }
}

/// A non-tensor entry found near the tensors (step counters, metrics, optimizer
/// state), listed by `inspect` and otherwise ignored.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Extra {
    /// Dotted name (`optim.param_groups.0.lr`).
    pub name: String,
    /// What it holds, for display (`int 7`, `dict (2 items)`).
    pub kind: String,
}

/// Everything a reader found in an input.
#[derive(Debug)]
pub struct Checkpoint {
    /// What kind of input this is.
    pub format: Format,
    /// The path given (a file or a directory).
    pub path: PathBuf,
    /// Every input file the pieces point into, by [`FileId`].
    pub files: Vec<Arc<Blob>>,
    /// Where the tensor dict was found (`state`, `model.module`); `None` = top level.
    pub key: Option<String>,
    /// The tensors, in the order the input lists them.
    pub tensors: Vec<TensorSource>,
    /// Entries that are not tensors.
    pub extras: Vec<Extra>,
    /// Things the reader noticed and the user should know (skipped optimizer state...).
    pub notes: Vec<String>,
    /// What the pickles read would run under `torch.load` (see [`crate::scan`]):
    /// unshard runs none of it, but the file is compromised and the user is told.
    pub unsafe_calls: Vec<crate::source::audit::UnsafeCall>,
}

impl Checkpoint {
    /// Bytes of all tensors.
    pub fn total_bytes(&self) -> u64 {
        self.tensors.iter().map(TensorSource::nbytes).sum()
    }
    /// Elements of all tensors.
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

/// Hands memory freed by the allocator back to the system. The `.metadata` of a
/// DCP checkpoint of many ranks, or the pickles of many per-rank files, are parsed
/// into millions of small allocations; once they are freed, glibc keeps most of them
/// for reuse, and the merge that follows (minutes, for a big model) would hold
/// hundreds of MB it no longer needs.
pub(crate) fn release_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only returns free heap memory to the system.
    unsafe {
        libc::malloc_trim(0);
    }
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
/// when `--base` is not given: verl writes one as `huggingface/` beside its rank files
/// and, for Megatron, beside its `dist_ckpt/` (`actor/dist_ckpt/` + `actor/huggingface/`);
/// the HF Trainer writes config.json into a DeepSpeed `checkpoint-N/`.
pub fn config_dir_for(checkpoint: &Path) -> Option<PathBuf> {
    let dir = if fs::is_dir(checkpoint) {
        checkpoint
    } else {
        checkpoint.parent()?
    };
    let hf = dir.join("huggingface");
    if fs::is_file(&hf.join("config.json")) {
        return Some(hf);
    }
    if dir.file_name().is_some_and(|n| n == "dist_ckpt") {
        let beside = dir.parent()?.join("huggingface");
        if fs::is_file(&beside.join("config.json")) {
            return Some(beside);
        }
    }
    // An HF Trainer `checkpoint-N/` of a DeepSpeed run holds its config.json.
    deepspeed::config_dir_for(checkpoint)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_keep_no_spare_capacity() {
        let piece = Piece {
            file: 0,
            byte_offset: 0,
            dtype: DType::F32,
            shape: vec![2],
            strides: vec![1],
            global_offset: vec![0],
            big_endian: false,
        };
        // Built the way readers build them; `vec![piece]` would be sized exactly.
        #[allow(clippy::vec_init_then_push)]
        let v = {
            let mut v = Vec::new();
            v.push(piece);
            v
        };
        assert!(v.capacity() > 1, "a pushed-to vector has spare room");
        let pieces = Pieces::from(v);
        assert_eq!(pieces.capacity(), 1);
    }
}
