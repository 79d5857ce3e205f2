//! Chunk archives checked byte for byte against one parsed archive of the same
//! structure, instead of each being parsed.
//!
//! The chunk archives of one checkpoint are `torch.save` zips of one tensor each,
//! written by the same code: two archives of the same length holding tensors of the
//! same dtype and shape are identical but for the tensor's bytes, the random
//! `.data/serialization_id`, and the CRC-32 fields of those two records (in the
//! local header, the data descriptor after the data, the central directory). So the
//! first archive of each (length, dtype, shape) is parsed in full and kept as a
//! template: its ends as read, and where those free bytes are. A later archive of
//! the same key whose ends equal the template's outside the free bytes holds the
//! same records, the same pickle (so the same view of the same storage) and the
//! same zip layout, and becomes the template's piece moved to its own offset.
//! Anything else (a different byte anywhere else, a key not seen yet) is parsed in
//! full, as before. The check is as strict as the parse: the parse verifies the
//! CRC of the records it reads (the pickle and the byte order), which are compared
//! here byte for byte with CRC fields included, and never reads the free bytes.

use super::super::zip::{Archive, ZipIndex};
use super::super::Piece;
use super::batch::Ends;
use crate::dtype::DType;
use crate::error::Result;

/// What every archive of one template's structure holds: the template's ends but
/// for ranges free to differ (the tensor's bytes, the serialization id, their CRCs).
#[derive(Clone, Debug, PartialEq, Eq)]
struct Pattern {
    /// Bytes `0..head.len()` of the archive.
    head: Vec<u8>,
    /// Where `tail` starts in the archive (the archive's length when the head holds it all).
    tail_at: u64,
    /// Bytes `tail_at..` of the archive. Bytes between the head and the tail are free.
    tail: Vec<u8>,
    /// Archive byte ranges free to differ, sorted by start.
    free: Vec<(u64, u64)>,
}

impl Pattern {
    /// Whether an archive whose first `head.len()` bytes are `head` and whose bytes from
    /// `tail_at` on are `tail` matches the pattern.
    fn matches_ends(&self, head: &[u8], tail_at: u64, tail: &[u8]) -> bool {
        tail_at == self.tail_at
            && same(0, head, &self.head, &self.free)
            && same(tail_at, tail, &self.tail, &self.free)
    }
}

/// Whether `bytes` (archive bytes from `at`) equal `want` outside the `free` ranges.
fn same(at: u64, bytes: &[u8], want: &[u8], free: &[(u64, u64)]) -> bool {
    if bytes.len() != want.len() {
        return false;
    }
    let end = at + bytes.len() as u64;
    let mut pos = at;
    for &(s, e) in free.iter().chain(std::iter::once(&(end, end))) {
        let (s, e) = (s.clamp(at, end), e.clamp(at, end));
        if s > pos {
            let (i, j) = ((pos - at) as usize, (s - at) as usize);
            if bytes[i..j] != want[i..j] {
                return false;
            }
        }
        pos = pos.max(e);
    }
    true
}

/// Templates kept at once (keys are few: one per chunk shape and length).
const MAX_TEMPLATES: usize = 256;

#[derive(Clone, Debug, Hash, PartialEq, Eq)]
struct Key {
    len: u64,
    dtype: DType,
    sizes: Vec<u64>,
}

struct Template {
    /// Its ends as read, and the bytes free to differ.
    pattern: Pattern,
    /// The tensor's first byte, from the start of the archive.
    rel_offset: u64,
    strides: Vec<u64>,
    big_endian: bool,
}

/// The templates of one checkpoint.
#[derive(Default)]
pub(super) struct Templates {
    /// Few (one per chunk shape and length): looked through in order.
    by_key: Vec<(Key, Template)>,
    /// Archives taken from a template.
    pub(super) hits: u64,
}

/// The ends of an archive as [`Archive::read_ends`] holds them: `(head, tail_at, tail)`.
fn ends(a: &Archive<'_>, ends: u64) -> Result<(Vec<u8>, u64, Vec<u8>)> {
    let len = a.len();
    if ends.saturating_mul(2) >= len {
        return Ok((a.read_vec(0, len)?, len, Vec::new()));
    }
    Ok((
        a.read_vec(0, ends)?,
        len - ends,
        a.read_vec(len - ends, ends)?,
    ))
}

/// Where a template puts the tensor of an archive that matches it.
pub(super) struct Layout<'t> {
    /// The tensor's first byte, from the start of the archive.
    pub(super) rel_offset: u64,
    pub(super) strides: &'t [u64],
    pub(super) big_endian: bool,
}

impl Templates {
    fn find(&self, len: u64, dtype: DType, sizes: &[u64]) -> Option<&Template> {
        self.by_key
            .iter()
            .find(|(k, _)| k.len == len && k.dtype == dtype && k.sizes == sizes)
            .map(|(_, t)| t)
    }

    /// The layout of the tensor of an archive of `len` bytes whose ends are `ends`
    /// (read as [`Archive::read_ends`] reads them), if the archive matches the
    /// template of its key; `None` when it must be parsed.
    pub(super) fn layout(
        &mut self,
        len: u64,
        dtype: DType,
        sizes: &[u64],
        ends: &Ends<'_>,
    ) -> Option<Layout<'_>> {
        let hit = {
            let t = self.find(len, dtype, sizes)?;
            t.pattern.matches_ends(ends.head, ends.tail_at, ends.tail)
        };
        if !hit {
            return None;
        }
        self.hits += 1;
        let t = self.find(len, dtype, sizes)?;
        Some(Layout {
            rel_offset: t.rel_offset,
            strides: &t.strides,
            big_endian: t.big_endian,
        })
    }

    /// The piece of archive `a` (read with [`Archive::read_ends`]`(ends, ends)`), if it
    /// matches the template of its key; `None` when it must be parsed.
    pub(super) fn piece(
        &mut self,
        a: &Archive<'_>,
        ends_len: u64,
        dtype: DType,
        sizes: &[u64],
        file: usize,
        offsets: &[u64],
    ) -> Result<Option<Piece>> {
        if self.find(a.len(), dtype, sizes).is_none() {
            return Ok(None);
        }
        let (head, tail_at, tail) = ends(a, ends_len)?;
        let ends = Ends {
            head: &head,
            tail_at,
            tail: &tail,
        };
        let base = a.base();
        Ok(self.layout(a.len(), dtype, sizes, &ends).map(|l| Piece {
            file,
            byte_offset: base + l.rel_offset,
            dtype,
            shape: sizes.to_vec(),
            strides: l.strides.to_vec(),
            global_offset: offsets.to_vec(),
            big_endian: l.big_endian,
        }))
    }

    /// Keeps archive `a`, just parsed in full into `piece`, as the template of its
    /// key, when every byte that can differ between archives of its structure is
    /// known and every other byte is in its ends.
    pub(super) fn learn(
        &mut self,
        a: &mut Archive<'_>,
        ends_len: u64,
        piece: &Piece,
    ) -> Result<()> {
        let key = Key {
            len: a.len(),
            dtype: piece.dtype,
            sizes: piece.shape.clone(),
        };
        if self.by_key.iter().any(|(k, _)| *k == key) || self.by_key.len() >= MAX_TEMPLATES {
            return Ok(());
        }
        let Ok(index) = ZipIndex::read(a) else {
            return Ok(());
        };
        let (head, tail_at, tail) = ends(a, ends_len)?;
        let byte = |at: u64| {
            let i = at as usize;
            head.get(i)
                .or_else(|| at.checked_sub(tail_at).and_then(|j| tail.get(j as usize)))
        };
        let mut free = Vec::new();
        let mut data = None;
        for e in &index.entries {
            let storage = e.name.contains("/data/") && !e.name.contains("/.data/");
            if !storage && !e.name.ends_with("/.data/serialization_id") {
                continue;
            }
            if storage {
                if data.is_some() {
                    return Ok(()); // one storage per chunk archive, or no template
                }
                data = Some((e.data_offset, e.data_offset + e.compressed_size));
            }
            let end = e.data_offset + e.compressed_size;
            free.push((e.data_offset, end));
            free.push((e.header_offset + 14, e.header_offset + 18));
            free.push((e.central_offset + 16, e.central_offset + 20));
            // torch's writer streams records: bit 3 of the flags says a data
            // descriptor follows the data, with the CRC after its signature.
            let Some(&flags) = byte(e.header_offset + 6) else {
                return Ok(());
            };
            if flags & 8 != 0 {
                let sig = [0, 1, 2, 3].map(|i| byte(end + i).copied());
                let crc = if sig == [Some(b'P'), Some(b'K'), Some(7), Some(8)] {
                    end + 4
                } else {
                    end
                };
                free.push((crc, crc + 4));
            }
        }
        let Some((ds, de)) = data else {
            return Ok(());
        };
        free.sort_unstable();
        // Bytes between the ends are not compared: they must all be tensor bytes.
        let middle = (head.len() as u64, tail_at);
        if middle.0 < middle.1 && !(ds <= middle.0 && middle.1 <= de) {
            return Ok(());
        }
        let Some(rel_offset) = piece.byte_offset.checked_sub(a.base()) else {
            return Ok(());
        };
        self.by_key.push((
            key,
            Template {
                pattern: Pattern {
                    head,
                    tail_at,
                    tail,
                    free,
                },
                rel_offset,
                strides: piece.strides.clone(),
                big_endian: piece.big_endian,
            },
        ));
        Ok(())
    }
}
