//! The tail of the pre-pass: a second thread walks from a frame near the middle of
//! the file to its end while the first walks from the start.
//!
//! What the pre-pass finds from a given opcode on depends on the walk's state only
//! through the memo's size (`next`): the cut, and the strings and globals memoized
//! before it, are found by the walk from the start, which goes on past the tail's
//! start when it has not cut yet. So the tail notes only the keys it fetches, and
//! checks the memo keys in relative form: counted from its start, a `BINPUT` key
//! less the keys assigned since must be one number, the memo's size at the start;
//! every fetched key must be below that size plus the keys assigned since. The walk
//! from the start gives that size when it reaches the tail's start, and the checks
//! are done then.
//!
//! The tail keeps the keys it fetches in [`Parts`] of its bytes, so that the walk
//! from the start, when it cuts after the tail's start, may stop at the next part and
//! still know which keys are fetched after the cut.

use std::sync::atomic::{AtomicBool, Ordering};

use super::super::input::{Input, Used};
use super::super::{GiveUp, R};
use super::{frames, operand, Operand};
use crate::source::Blob;
use unshard_pickle::opcode::{BINGET, BINPUT, LONG_BINGET, LONG_BINPUT, MEMOIZE, STOP};

/// Where a second thread should walk from in a file of this size: the first frame
/// at or after the middle, when the file is big enough for a second thread to save
/// time ([`super::super::half::MIN_BYTES`], as for the reading pass) and there is a
/// second core.
pub(super) fn split_at(blob: &Blob) -> Option<u64> {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    if blob.len() < super::super::half::MIN_BYTES || cores < 2 {
        return None;
    }
    frames::starts(blob).find(|&at| at >= blob.len() / 2)
}

/// The tail's bytes, from its start to the end of the file, in [`Parts::COUNT`]
/// parts of equal length; an opcode is in the part its first byte is in.
#[derive(Clone, Copy, Debug)]
pub(super) struct Parts {
    /// Where the tail starts.
    pub(super) from: u64,
    len: u64,
}

impl Parts {
    const COUNT: usize = 8;

    pub(super) fn new(from: u64, end: u64) -> Parts {
        let len = (end.saturating_sub(from) / Parts::COUNT as u64).max(1);
        Parts { from, len }
    }

    /// The part of the opcode at `at` (at or after the tail's start).
    pub(super) fn of(&self, at: u64) -> usize {
        let i = at.saturating_sub(self.from) / self.len;
        usize::try_from(i).map_or(Parts::COUNT - 1, |i| i.min(Parts::COUNT - 1))
    }

    /// Where part `i` starts; never, for a part past the last.
    pub(super) fn start(&self, i: usize) -> u64 {
        if i >= Parts::COUNT {
            return u64::MAX;
        }
        self.from + i as u64 * self.len
    }
}

/// What the tail found.
pub(super) struct Tail {
    /// The keys fetched, by part.
    fetched: Vec<Used>,
    /// A `BINPUT` key less the keys assigned before it in the tail: the memo's size
    /// at the tail's start, if the keys are in order.
    base: Option<u64>,
    /// The least memo size at the tail's start under which every fetched key was
    /// assigned.
    least: u64,
    /// The keys assigned in the tail.
    assigned: u64,
    /// How the tail ended: at `STOP`, or giving up.
    end: R<()>,
}

/// How many opcodes the tail reads between looks at `cancel`.
const CANCEL_EVERY: u32 = 4096;

/// Walks from the tail's start to the end (or until `cancel`).
pub(super) fn walk(blob: &Blob, parts: Parts, cancel: &AtomicBool) -> Tail {
    let mut tail = Tail {
        fetched: (0..Parts::COUNT).map(|_| Used::default()).collect(),
        base: None,
        least: 0,
        assigned: 0,
        end: Ok(()),
    };
    tail.end = tail.run(blob, parts, cancel);
    tail
}

impl Tail {
    fn run(&mut self, blob: &Blob, parts: Parts, cancel: &AtomicBool) -> R<()> {
        let mut input = Input::at(blob, parts.from);
        let mut part = 0;
        let mut next_part = parts.start(1);
        let mut ops = 0u32;
        loop {
            let at = input.position();
            if at >= next_part {
                part = parts.of(at);
                next_part = parts.start(part + 1);
            }
            ops = ops.wrapping_add(1);
            if ops % CANCEL_EVERY == 0 && cancel.load(Ordering::Relaxed) {
                return Err(GiveUp::Stop);
            }
            let op = input.byte()?;
            let arg = operand(&mut input, op)?;
            match (op, arg) {
                (STOP, _) => return Ok(()),
                (MEMOIZE | BINPUT | LONG_BINPUT, _) => {
                    if let Operand::Key(key) = arg {
                        // key = base + assigned, for one base.
                        let base = key.checked_sub(self.assigned).ok_or(GiveUp::Stop)?;
                        if *self.base.get_or_insert(base) != base {
                            return Err(GiveUp::Stop);
                        }
                    }
                    self.assigned += 1;
                    if self.assigned > u64::from(u32::MAX) {
                        return Err(GiveUp::Stop);
                    }
                }
                (BINGET | LONG_BINGET, Operand::Key(key)) => {
                    // key < base + assigned.
                    self.least = self.least.max((key + 1).saturating_sub(self.assigned));
                    if let (Ok(key), Some(keys)) = (u32::try_from(key), self.fetched.get_mut(part))
                    {
                        keys.insert(key);
                    }
                }
                _ => {}
            }
        }
    }

    /// The keys fetched, by part, given the memo's size at the tail's start; gives
    /// up where the walk from the start would have: on a key assigned out of order,
    /// one fetched before it is assigned, more keys than fit in 32 bits, or what made
    /// the tail give up.
    pub(super) fn fetched(self, base: u64) -> R<Vec<Used>> {
        let in_order = self.base.is_none_or(|b| b == base)
            && self.least <= base
            && base + self.assigned <= u64::from(u32::MAX);
        if !in_order {
            return Err(GiveUp::Stop);
        }
        self.end.map(|()| self.fetched)
    }
}
