//! `.metadata`, interpreted: a pickle of torch.distributed.checkpoint dataclasses.
//! For every entry of the flattened state dict it gives the global shape and dtype
//! and the chunks it was saved in; `storage_data` maps each chunk to a byte range of
//! a `.distcp` file, which is kept on the chunk itself.
//!
//! A checkpoint of many ranks lists millions of chunks, so the result is compact: a
//! chunk is its place in one pool of offsets and sizes plus its byte range, files
//! and transform lists are interned, and the chunks of entries the merge will not
//! read (optimizer state, entries outside `--key`) are not kept at all.
//!
//! By job: `stream` reads the pickle's opcodes from the file in one pass (and a
//! pre-pass that finds which memo entries are used again), folding each DCP
//! dataclass into its compact record as it is built, so no object tree is ever held;
//! it knows only the classes DCP writes and gives up on anything else. `full` parses
//! the whole pickle with the general reader (audit included) and interprets the
//! tree: the fallback, which also gives the precise error for a broken file.

use std::collections::HashMap;
use std::path::Path;

use crate::dtype::DType;
use crate::error::Result;

mod full;
mod stream;

/// One chunk of a tensor entry: where its offsets and sizes are in its
/// [`Chunks`], and where its bytes are.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Chunk {
    /// Index in [`Chunks::dims`] of the chunk's offsets, followed by its sizes.
    dims: usize,
    /// Its storage entry, if `storage_data` has one.
    pub(super) item: Option<Item>,
}

/// The chunks of a tensor entry, with their offsets and sizes in one pool, so that
/// the entry's chunks go (with [`Chunks::clear`]) once its tensor is built.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(super) struct Chunks {
    pub(super) list: Vec<Chunk>,
    dims: Vec<u64>,
    ndim: usize,
}

impl Chunks {
    fn new(ndim: usize) -> Chunks {
        Chunks {
            ndim,
            ..Chunks::default()
        }
    }

    /// A chunk's offsets.
    pub(super) fn offsets(&self, c: &Chunk) -> &[u64] {
        self.dims.get(c.dims..c.dims + self.ndim).unwrap_or(&[])
    }

    /// A chunk's sizes.
    pub(super) fn sizes(&self, c: &Chunk) -> &[u64] {
        let n = self.ndim;
        self.dims.get(c.dims + n..c.dims + 2 * n).unwrap_or(&[])
    }

    /// Adds a chunk with no storage entry yet; `false` when its offsets or sizes do
    /// not have one value per dimension.
    fn push(&mut self, offsets: &[u64], sizes: &[u64]) -> bool {
        if offsets.len() != self.ndim || sizes.len() != self.ndim {
            return false;
        }
        let dims = self.dims.len();
        self.dims.extend_from_slice(offsets);
        self.dims.extend_from_slice(sizes);
        self.list.push(Chunk { dims, item: None });
        true
    }

    /// The chunk whose offsets are `offsets`, looked for first at `hint` (chunks
    /// are usually listed in the order of their storage entries).
    fn find(&self, offsets: &[u64], hint: usize) -> Option<usize> {
        let n = self.list.len();
        (0..n)
            .map(|i| (hint + i) % n)
            .find(|&i| self.offsets(&self.list[i]) == offsets)
    }

    /// Gives back the memory of chunks that are no longer needed.
    pub(super) fn clear(&mut self) {
        *self = Chunks::new(self.ndim);
    }

    fn shrink(&mut self) {
        self.list.shrink_to_fit();
        self.dims.shrink_to_fit();
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum EntryKind {
    Tensor {
        dtype: DType,
        shape: Vec<u64>,
        /// Empty when `dropped`.
        chunks: Chunks,
        /// The chunks were not kept, as the entry looked like one the merge skips.
        dropped: bool,
    },
    Bytes {
        item: Option<Item>,
    },
}

/// One entry of the flattened state dict.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Entry {
    pub(super) fqn: String,
    /// Where the entry sat in the nested state dict that was saved (`planner_data`),
    /// or just the fqn when the planner did not record it.
    pub(super) path: Vec<String>,
    pub(super) kind: EntryKind,
}

/// Where an item's bytes are: a byte range of a file, and the transforms it went
/// through (indexes into [`Metadata`]'s interned tables).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Item {
    file: u32,
    pub(super) offset: u64,
    pub(super) length: u64,
    transforms: u32,
}

/// `.metadata`, interpreted.
#[derive(Debug, Default, PartialEq)]
pub(super) struct Metadata {
    pub(super) entries: Vec<Entry>,
    /// The files items are stored in, each once.
    files: Vec<String>,
    /// The transform lists of items, each once; the first is the empty list.
    transforms: Vec<Vec<String>>,
    /// What the `.metadata` pickle would run under `torch.load`.
    pub(super) unsafe_calls: Vec<crate::source::audit::UnsafeCall>,
}

impl Item {
    /// Which file the item is in (an index, the same for items of one file).
    pub(super) fn file_index(&self) -> u32 {
        self.file
    }
}

impl Metadata {
    /// How many files items are stored in.
    pub(super) fn file_count(&self) -> usize {
        self.files.len()
    }

    /// The file an item is stored in (relative to the checkpoint directory).
    pub(super) fn file(&self, item: &Item) -> &str {
        self.files
            .get(item.file as usize)
            .map_or("", String::as_str)
    }

    /// The transforms an item went through, in order.
    pub(super) fn transforms(&self, item: &Item) -> &[String] {
        self.transforms
            .get(item.transforms as usize)
            .map_or(&[], Vec::as_slice)
    }
}

/// Which entries keep their chunks.
#[derive(Clone, Copy, Debug)]
pub(super) enum Keep<'a> {
    /// Every entry.
    All,
    /// Entries the merge may read: under `key.` when a key is given, else every
    /// entry but those under an optimizer key. A guess from the fqn alone (the
    /// planner's path, which decides, may come later in the file); the caller
    /// checks it against the selection and parses again with [`Keep::All`] when
    /// it was wrong.
    Model {
        key: Option<&'a str>,
        optimizer_keys: &'a [&'a str],
    },
    /// No tensor's chunks: only the byte entries are wanted.
    NoChunks,
}

impl Keep<'_> {
    fn chunks_of(&self, fqn: &str) -> bool {
        match *self {
            Keep::All => true,
            Keep::NoChunks => false,
            Keep::Model { key: Some(k), .. } if !k.is_empty() => fqn
                .strip_prefix(k)
                .is_some_and(|rest| rest.starts_with('.')),
            Keep::Model { optimizer_keys, .. } => {
                let first = fqn.split('.').next().unwrap_or(fqn);
                !(fqn.contains('.') && optimizer_keys.contains(&first))
            }
        }
    }
}

/// Builds the compact tables of a [`Metadata`], interning files and transforms.
#[derive(Default)]
struct Builder {
    md: Metadata,
    files: HashMap<String, u32>,
    transforms: HashMap<Vec<String>, u32>,
    /// The file of the item made last.
    last_file: u32,
}

impl Builder {
    fn new() -> Builder {
        let mut b = Builder::default();
        b.md.transforms.push(Vec::new());
        b.transforms.insert(Vec::new(), 0);
        b
    }

    fn item(&mut self, file: &str, offset: u64, length: u64, transforms: &[String]) -> Item {
        // Items come file by file: the last file is checked before the table.
        let file = match self.md.files.get(self.last_file as usize) {
            Some(last) if last == file => self.last_file,
            _ => {
                let next = self.md.files.len() as u32;
                let i = match self.files.get(file) {
                    Some(&i) => i,
                    None => {
                        self.files.insert(file.to_string(), next);
                        self.md.files.push(file.to_string());
                        next
                    }
                };
                self.last_file = i;
                i
            }
        };
        let next = self.md.transforms.len() as u32;
        let transforms = if transforms.is_empty() {
            0
        } else if let Some(&i) = self.transforms.get(transforms) {
            i
        } else {
            self.transforms.insert(transforms.to_vec(), next);
            self.md.transforms.push(transforms.to_vec());
            next
        };
        Item {
            file,
            offset,
            length,
            transforms,
        }
    }
}

/// Parses the `.metadata` file at `path`: in one streaming pass when it holds only
/// what DCP writes, else (or when the stream gives up) with the full pickle reader.
pub(super) fn parse_metadata(path: &Path, keep: Keep<'_>) -> Result<Metadata> {
    let blob = crate::bytes::fs::open(path)?;
    if let Some(md) = stream::read(&blob, keep)? {
        return Ok(md);
    }
    let raw = blob.read_vec(0, blob.len())?;
    drop(blob);
    full::parse(path, &raw, keep)
}

#[cfg(test)]
mod tests;
