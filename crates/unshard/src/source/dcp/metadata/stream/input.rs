//! The `.metadata` file read front to back through a buffer of a few MB, so that a
//! pickle of hundreds of MB is never held whole, and the pre-pass that finds which
//! memo entries are ever fetched again.

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
        Input {
            blob,
            buf: Vec::new(),
            start: 0,
            pos: 0,
        }
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
        let bit = 1u64 << (k % 64);
        if word & bit == 0 {
            return None;
        }
        let below = (word & (bit - 1)).count_ones() as usize;
        Some(*self.before.get(k / 64)? as usize + below)
    }

    /// Numbers the keys once the pre-pass has found them all.
    fn count(&mut self) {
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

    fn insert(&mut self, key: u32) {
        let k = key as usize;
        if self.bits.len() <= k / 64 {
            self.bits.resize(k / 64 + 1, 0);
        }
        self.bits[k / 64] |= 1 << (k % 64);
    }
}

/// Walks the opcodes once, noting every memo key fetched. Gives up on any opcode the
/// reading pass does not handle, and on memo keys that are not assigned in order.
pub(super) fn used_memo(blob: &Blob) -> R<Used> {
    use super::op::*;
    let mut input = Input::new(blob);
    let mut used = Used {
        bits: Vec::new(),
        before: Vec::new(),
    };
    // Keys are assigned in increasing order (MEMOIZE: the memo's size; BINPUT: by
    // the pickler, which does the same); anything else is left to the full reader.
    let mut next: u64 = 0;
    loop {
        let op = input.byte()?;
        match op {
            STOP => {
                used.count();
                return Ok(used);
            }
            MARK | POP | EMPTY_TUPLE | TUPLE | TUPLE1 | TUPLE2 | TUPLE3 | EMPTY_LIST
            | EMPTY_DICT | APPEND | APPENDS | SETITEM | SETITEMS | NEWOBJ | REDUCE | BUILD
            | NONE | NEWTRUE | NEWFALSE | STACK_GLOBAL => {}
            MEMOIZE => next += 1,
            BINPUT | LONG_BINPUT => {
                let key = input.uint(if op == BINPUT { 1 } else { 4 })?;
                if key != next {
                    return Err(GiveUp::Stop);
                }
                next += 1;
            }
            BINGET | LONG_BINGET => {
                let key = input.uint(if op == BINGET { 1 } else { 4 })?;
                if key >= next {
                    return Err(GiveUp::Stop);
                }
                used.insert(key as u32);
            }
            PROTO | BININT1 => {
                input.bytes(1)?;
            }
            BININT2 => {
                input.bytes(2)?;
            }
            BININT => {
                input.bytes(4)?;
            }
            FRAME | BINFLOAT => {
                input.bytes(8)?;
            }
            SHORT_BINUNICODE | SHORT_BINBYTES | LONG1 => {
                let n = input.length(1)?;
                input.bytes(n)?;
            }
            BINUNICODE | BINBYTES => {
                let n = input.length(4)?;
                input.bytes(n)?;
            }
            BINUNICODE8 => {
                let n = input.length(8)?;
                input.bytes(n)?;
            }
            GLOBAL => {
                input.line()?;
                input.line()?;
            }
            _ => return Err(GiveUp::Stop),
        }
        if next > u64::from(u32::MAX) {
            return Err(GiveUp::Stop);
        }
    }
}
