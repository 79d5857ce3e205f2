//! The `.metadata` file read front to back through a buffer of a few MB, so that a
//! pickle of hundreds of MB is never held whole, and the set of memo keys the pickle
//! fetches again (found by the pre-pass).

use super::{GiveUp, R};
use crate::source::Blob;

/// Bytes read from the file at a time.
const BUFFER: usize = 4 << 20;

/// A sequential reader of a [`Blob`].
pub(super) struct Input<'a> {
    blob: &'a Blob,
    buf: Vec<u8>,
    /// File offset of `buf[0]`.
    start: u64,
    /// Position in `buf`.
    pos: usize,
}

impl<'a> Input<'a> {
    pub(super) fn new(blob: &'a Blob) -> Input<'a> {
        Input::at(blob, 0)
    }

    /// A reader from byte `offset` of the file (the start of an opcode).
    pub(super) fn at(blob: &'a Blob, offset: u64) -> Input<'a> {
        Input {
            blob,
            buf: Vec::new(),
            start: offset,
            pos: 0,
        }
    }

    /// The offset in the file of the next byte read.
    #[inline]
    pub(super) fn position(&self) -> u64 {
        self.start + self.pos as u64
    }

    /// Goes on from byte `offset` of the file.
    pub(super) fn seek(&mut self, offset: u64) {
        self.buf.clear();
        self.start = offset;
        self.pos = 0;
    }

    /// Makes `n` bytes available at `pos`; gives up at the end of the file.
    #[inline]
    fn fill(&mut self, n: usize) -> R<()> {
        if self.buf.len() - self.pos >= n {
            return Ok(());
        }
        self.refill(n)
    }

    /// [`Input::fill`] when the buffer holds fewer than `n` bytes: reads the next part
    /// of the file, keeping what is left of the buffer.
    #[cold]
    #[inline(never)]
    fn refill(&mut self, n: usize) -> R<()> {
        let offset = self.start + self.pos as u64;
        let left = self.blob.len().saturating_sub(offset);
        if (n as u64) > left {
            return Err(GiveUp::Stop);
        }
        let want = (n.max(BUFFER) as u64).min(left) as usize;
        self.buf.drain(..self.pos);
        self.start = offset;
        self.pos = 0;
        let have = self.buf.len();
        self.buf.resize(want, 0);
        self.blob
            .read_at(offset + have as u64, &mut self.buf[have..])
            .map_err(GiveUp::Io)?;
        Ok(())
    }

    #[inline]
    pub(super) fn byte(&mut self) -> R<u8> {
        self.fill(1)?;
        let b = self.buf[self.pos];
        self.pos += 1;
        Ok(b)
    }

    #[inline]
    pub(super) fn bytes(&mut self, n: usize) -> R<&[u8]> {
        self.fill(n)?;
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    #[inline]
    pub(super) fn uint(&mut self, n: usize) -> R<u64> {
        let b = self.bytes(n)?;
        Ok(b.iter().rev().fold(0u64, |a, &x| (a << 8) | u64::from(x)))
    }

    /// A length field of `n` bytes, bounded by what is left of the file.
    pub(super) fn length(&mut self, n: usize) -> R<usize> {
        let len = self.uint(n)?;
        let left = self.blob.len() - self.start - self.pos as u64;
        if len > left {
            return Err(GiveUp::Stop);
        }
        Ok(len as usize)
    }

    /// A `\n`-terminated line (`GLOBAL`'s arguments), at most 1 KiB.
    pub(super) fn line(&mut self) -> R<String> {
        let mut out = Vec::new();
        loop {
            match self.byte()? {
                b'\n' => break,
                b if out.len() < 1024 => out.push(b),
                _ => return Err(GiveUp::Stop),
            }
        }
        String::from_utf8(out).map_err(|_| GiveUp::Stop)
    }
}

/// The memo keys the pickle fetches again (`BINGET`/`LONG_BINGET`), as a bit set
/// indexed by key: only those are kept by the reading pass, so that the memo holds
/// what is shared (class names, fqns, offsets reused as storage keys), not the
/// millions of objects DCP's pickler memoizes and never refers to again.
///
/// The keys kept are numbered in order ([`Used::index`]), so that the memo is a plain
/// vector of their values: a fetch is a look-up, not a search.
#[derive(Default)]
pub(super) struct Used {
    bits: Vec<u64>,
    /// Per word of `bits`: how many keys the words before it hold.
    before: Vec<u32>,
}

impl Used {
    /// The place of `key` among the keys fetched again, in increasing order; `None`
    /// when it is not one of them.
    #[inline]
    pub(super) fn index(&self, key: u32) -> Option<usize> {
        let k = key as usize;
        let word = *self.bits.get(k / 64)?;
        (word & (1u64 << (k % 64)) != 0).then(|| self.count_below(key))
    }

    /// How many of the keys fetched again are below `key`.
    #[inline]
    pub(super) fn count_below(&self, key: u32) -> usize {
        let k = key as usize;
        match self.bits.get(k / 64) {
            Some(&word) => {
                let below = (word & ((1u64 << (k % 64)) - 1)).count_ones() as usize;
                self.before.get(k / 64).map_or(0, |&b| b as usize) + below
            }
            None => self.bits.iter().map(|w| w.count_ones() as usize).sum(),
        }
    }

    /// The keys in the set, in increasing order.
    pub(super) fn keys(&self) -> impl Iterator<Item = u32> + '_ {
        self.bits.iter().enumerate().flat_map(|(w, &bits)| {
            let mut left = bits;
            std::iter::from_fn(move || {
                (left != 0).then(|| {
                    let b = left.trailing_zeros();
                    left &= left - 1;
                    w as u32 * 64 + b
                })
            })
        })
    }

    /// Notes that `key` is fetched again.
    pub(super) fn insert(&mut self, key: u32) {
        let k = key as usize;
        if self.bits.len() <= k / 64 {
            self.bits.resize(k / 64 + 1, 0);
        }
        self.bits[k / 64] |= 1 << (k % 64);
    }

    /// Adds the keys in `other`.
    pub(super) fn union(&mut self, other: &Used) {
        if self.bits.len() < other.bits.len() {
            self.bits.resize(other.bits.len(), 0);
        }
        for (word, &more) in self.bits.iter_mut().zip(&other.bits) {
            *word |= more;
        }
    }

    /// Numbers the keys once the pre-pass has found them all.
    pub(super) fn count(&mut self) {
        let mut n = 0u32;
        self.before = self
            .bits
            .iter()
            .map(|w| {
                let at = n;
                n += w.count_ones();
                at
            })
            .collect();
    }
}
