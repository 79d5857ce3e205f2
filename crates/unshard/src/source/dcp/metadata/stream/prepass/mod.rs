//! The pre-pass: one walk over the opcodes, before the reading pass, that finds
//! which memo keys are ever fetched again, and where the pickle can be cut in two
//! for a second thread.
//!
//! The cut is at a batch boundary of a dict: Python's pickler writes a dict's items
//! in batches of a thousand, each `MARK ... SETITEMS`, so a `MARK` right after a
//! `SETITEMS` starts a batch on the dict below it. `storage_data` (most of the file)
//! is such a dict. The second half is read from there on its own stack and memo
//! (`half`), and only needs the values of the keys it fetches from before the cut:
//! class names and fqns, strings and globals, which this pass records where they are
//! memoized. Nothing here is trusted: the first half checks, when it reaches the
//! cut, that its own state is the one the second half assumed.
//!
//! In a big framed file the pre-pass itself runs on two threads: a second walks
//! from a frame near the middle to the end, noting only the keys it fetches (see
//! `tail`), while the first walks from the start until it is past both that frame
//! and the cut. The result is the one a single walk gives.

use std::sync::atomic::{AtomicBool, Ordering};

use super::input::{Input, Used};
use super::op::*;
use super::{GiveUp, R};
use crate::source::Blob;
use tail::Parts;

mod frames;
mod tail;
#[cfg(test)]
mod tests;

/// What the pre-pass found.
pub(super) struct Pass {
    pub(super) used: Used,
    pub(super) cut: Option<Cut>,
}

/// Where the second half starts, and what it needs from before it.
#[derive(Debug)]
pub(super) struct Cut {
    /// The offset of the `MARK` that starts a batch of a dict's items.
    pub(super) offset: u64,
    /// Memo keys assigned before it.
    pub(super) memo_len: u32,
    /// The values of the keys from before the cut that the second half fetches, by
    /// key.
    pub(super) imports: Vec<(u32, Import)>,
}

/// The value of a memo key from before the cut.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Import {
    /// A string.
    Str(Vec<u8>),
    /// A global: module and name.
    Global(Vec<u8>, Vec<u8>),
}

/// Where to cut the pickle.
#[derive(Clone, Copy, Debug)]
pub(in crate::source::dcp::metadata) enum CutAt {
    /// At the first batch boundary at or after this offset (for tests).
    #[cfg_attr(not(test), allow(dead_code))]
    Offset(u64),
    /// At the first batch boundary where the opcodes before it are about as many as
    /// those after it, estimated from the last batch: the halves then take about as
    /// long. (State-dict entries, before `storage_data`, hold more opcodes per byte
    /// than storage pairs do, so the middle byte is not the middle of the work.)
    Balanced,
}

/// Where a value on the stack came from, as far as the pre-pass follows it.
#[derive(Clone, Copy, Debug)]
enum Src {
    /// Anything else.
    Other,
    /// A string opcode's bytes, at this offset and length.
    Bytes(u64, u32),
    /// Fetched from the memo.
    Key(u32),
}

/// What a memo key assigned before the cut holds, as far as the pre-pass follows it.
#[derive(Clone, Copy, Debug)]
enum Def {
    Str(u64, u32),
    Global(Src, Src),
}

/// Walks the opcodes once, noting every memo key fetched. Gives up on any opcode the
/// reading pass does not handle, and on memo keys that are not assigned in order.
/// With `cut_at`, looks for a batch boundary to cut at; in a big framed file, on two
/// threads (see `tail`), with the same result as one.
pub(super) fn pre_pass(blob: &Blob, cut_at: Option<CutAt>) -> R<Pass> {
    let from = cut_at.and_then(|_| tail::split_at(blob));
    pre_pass_split(blob, cut_at, from).map(|(pass, _)| pass)
}

/// [`pre_pass`], with a second thread walking from the frame at `from` to the end
/// when there is a cut to look for (`from` is any offset in tests). Also says at
/// which part of the tail the walk from the start stopped, if it did.
fn pre_pass_split(
    blob: &Blob,
    cut_at: Option<CutAt>,
    from: Option<u64>,
) -> R<(Pass, Option<usize>)> {
    let Some(from) = from.filter(|_| cut_at.is_some()) else {
        return Ok((finish(blob, walk(blob, cut_at, None)?), None));
    };
    let parts = Parts::new(from, blob.len());
    let cancel = &AtomicBool::new(false);
    std::thread::scope(|scope| {
        let tail = std::thread::Builder::new()
            .name("unshard-prepass".into())
            .spawn_scoped(scope, move || tail::walk(blob, parts, cancel));
        let head = walk(blob, cut_at, tail.is_ok().then_some(parts));
        let met = head.as_ref().ok().and_then(|h| h.met);
        if met.is_none() {
            // Walked alone to the end, or gave up: the tail is not needed.
            cancel.store(true, Ordering::Relaxed);
        }
        let tail = tail.map(|t| t.join());
        let mut head = head?;
        let Some((base, part)) = met else {
            return Ok((finish(blob, head), None));
        };
        let tail = match tail {
            Ok(Ok(tail)) => tail,
            Ok(Err(panic)) => std::panic::resume_unwind(panic),
            // Not reached: `met` needs a spawned tail.
            Err(_) => return Err(GiveUp::Stop),
        };
        let fetched = tail.fetched(base)?;
        for (i, keys) in fetched.iter().enumerate() {
            head.used.union(keys);
            if i >= part {
                head.imported.union(keys);
            }
        }
        Ok((finish(blob, head), Some(part)))
    })
}

/// What the walk from the start found, up to where it stopped.
struct Head {
    used: Used,
    /// Keys fetched after the cut (the ones below it are imports).
    imported: Used,
    defs: Vec<(u32, Def)>,
    cut: Option<(u64, u32)>,
    /// Where it stopped, when it left the rest to the tail: the memo keys assigned
    /// before the tail's start, and the part of the tail it stopped at.
    met: Option<(u64, usize)>,
}

/// The pre-pass's result from a walk that covered the whole file (with the tail's
/// keys added when it stopped early).
fn finish(blob: &Blob, head: Head) -> Pass {
    let Head {
        mut used,
        imported,
        defs,
        cut,
        ..
    } = head;
    used.count();
    let cut = match cut {
        Some((offset, memo_len)) => resolve(blob, &defs, &imported, memo_len).map(|imports| Cut {
            offset,
            memo_len,
            imports,
        }),
        None => None,
    };
    Pass { used, cut }
}

/// Walks from the start. With `parts`, stops at the first part of the tail that
/// starts after the cut (and after the tail's start), since from there on what
/// matters is only which keys are fetched, which the tail finds.
fn walk(blob: &Blob, cut_at: Option<CutAt>, parts: Option<Parts>) -> R<Head> {
    let mut input = Input::new(blob);
    let mut used = Used::default();
    // Keys are assigned in increasing order (MEMOIZE: the memo's size; BINPUT: by
    // the pickler, which does the same); anything else is left to the full reader.
    let mut next: u64 = 0;
    // The last two values pushed, when nothing but memo puts and frames came between
    // (for the operands of `STACK_GLOBAL`); what a memo put right now would hold.
    let mut last = [Src::Other; 2];
    let mut pending: Option<Def> = None;
    // The strings and globals memoized before the cut, by key (in increasing order).
    let mut defs: Vec<(u32, Def)> = Vec::new();
    let mut cut: Option<(u64, u32)> = None;
    // Keys below the cut fetched after it.
    let mut imported = Used::default();
    let mut prev = STOP;
    // Opcodes so far, and the offset and count at the last batch boundary.
    let mut ops: u64 = 0;
    let mut boundary: Option<(u64, u64)> = None;
    // Where to look at the tail next: its start, then the start of each part.
    let mut look_at = parts.map_or(u64::MAX, |p| p.from);
    // The memo keys assigned before the tail's start, once there.
    let mut base: Option<u64> = None;
    let mut met = None;
    loop {
        ops += 1;
        let at = input.position();
        if at >= look_at {
            look_at = u64::MAX;
            // A tail that does not start at an opcode is not the rest of this walk.
            if let Some(parts) = parts.filter(|p| base.is_some() || at == p.from) {
                let base = *base.get_or_insert(next);
                let part = parts.of(at);
                if cut.is_some() {
                    met = Some((base, part));
                    break;
                }
                look_at = parts.start(part + 1);
            }
        }
        let op = input.byte()?;
        let arg = operand(&mut input, op)?;
        let mut pushed = Src::Other;
        match op {
            STOP => break,
            MARK if cut.is_none() && prev == SETITEMS => {
                let here = match cut_at {
                    None => false,
                    Some(CutAt::Offset(c)) => at >= c,
                    Some(CutAt::Balanced) => boundary.is_some_and(|(at0, ops0)| {
                        // Opcodes per byte in the last batch, times the bytes left.
                        let density = (ops - ops0) as f64 / (at - at0).max(1) as f64;
                        ops as f64 >= density * blob.len().saturating_sub(at) as f64
                    }),
                };
                if here {
                    cut = Some((at, u32::try_from(next).map_err(|_| GiveUp::Stop)?));
                }
                boundary = Some((at, ops));
            }
            STACK_GLOBAL => {
                if let [m @ (Src::Bytes(..) | Src::Key(_)), n @ (Src::Bytes(..) | Src::Key(_))] =
                    last
                {
                    pending = Some(Def::Global(m, n));
                }
            }
            MEMOIZE | BINPUT | LONG_BINPUT => {
                if let Operand::Key(key) = arg {
                    if key != next {
                        return Err(GiveUp::Stop);
                    }
                }
                if let (None, Some(def)) = (cut, pending.take()) {
                    defs.push((next as u32, def));
                }
                next += 1;
                if next > u64::from(u32::MAX) {
                    return Err(GiveUp::Stop);
                }
                continue;
            }
            BINGET | LONG_BINGET => {
                let Operand::Key(key) = arg else {
                    return Err(GiveUp::Stop);
                };
                if key >= next {
                    return Err(GiveUp::Stop);
                }
                used.insert(key as u32);
                if cut.is_some_and(|(_, n)| key < u64::from(n)) {
                    imported.insert(key as u32);
                }
                pushed = Src::Key(key as u32);
            }
            FRAME => continue,
            _ => {
                if let Operand::Str(at, n) = arg {
                    if let Ok(n) = u32::try_from(n) {
                        pushed = Src::Bytes(at, n);
                    }
                }
            }
        }
        prev = op;
        if op != STACK_GLOBAL {
            pending = match pushed {
                Src::Bytes(at, n) => Some(Def::Str(at, n)),
                _ => None,
            };
        }
        last = [last[1], pushed];
    }
    Ok(Head {
        used,
        imported,
        defs,
        cut,
        met,
    })
}

/// An opcode's operand, as far as the walks look at it.
#[derive(Clone, Copy)]
enum Operand {
    None,
    /// A memo key (`BINPUT`, `BINGET` and their long forms).
    Key(u64),
    /// A string's bytes, at this offset and length.
    Str(u64, u64),
}

/// Reads the operand of `op`; gives up on an opcode the reading pass does not
/// handle. Both walks read opcodes with this, so they see the same ones.
#[inline(always)]
fn operand(input: &mut Input<'_>, op: u8) -> R<Operand> {
    let skip = |input: &mut Input<'_>, n: usize| input.bytes(n).map(|_| Operand::None);
    match op {
        STOP | MARK | POP | EMPTY_TUPLE | TUPLE | TUPLE1 | TUPLE2 | TUPLE3 | EMPTY_LIST
        | EMPTY_DICT | APPEND | APPENDS | SETITEM | SETITEMS | NEWOBJ | REDUCE | BUILD | NONE
        | NEWTRUE | NEWFALSE | STACK_GLOBAL | MEMOIZE => Ok(Operand::None),
        BINPUT | BINGET => Ok(Operand::Key(input.uint(1)?)),
        LONG_BINPUT | LONG_BINGET => Ok(Operand::Key(input.uint(4)?)),
        PROTO | BININT1 => skip(input, 1),
        BININT2 => skip(input, 2),
        BININT => skip(input, 4),
        FRAME | BINFLOAT => skip(input, 8),
        SHORT_BINUNICODE | BINUNICODE | BINUNICODE8 => {
            let width = match op {
                SHORT_BINUNICODE => 1,
                BINUNICODE => 4,
                _ => 8,
            };
            let n = input.length(width)?;
            let start = input.position();
            input.bytes(n)?;
            Ok(Operand::Str(start, n as u64))
        }
        SHORT_BINBYTES | LONG1 => {
            let n = input.length(1)?;
            skip(input, n)
        }
        BINBYTES => {
            let n = input.length(4)?;
            skip(input, n)
        }
        GLOBAL => {
            input.line()?;
            input.line()?;
            Ok(Operand::None)
        }
        _ => Err(GiveUp::Stop),
    }
}

/// The values of the keys in `imported` (all below `memo_len`) from `defs`; `None`
/// when one of them is not a string or global the pre-pass followed, or cannot be
/// read (the second half is then not read apart).
fn resolve(
    blob: &Blob,
    defs: &[(u32, Def)],
    imported: &Used,
    memo_len: u32,
) -> Option<Vec<(u32, Import)>> {
    let def = |key: u32| {
        defs.binary_search_by_key(&key, |(k, _)| *k)
            .ok()
            .map(|i| defs[i].1)
    };
    let bytes = |src: Src| -> Option<Vec<u8>> {
        let (at, n) = match src {
            Src::Bytes(at, n) => (at, n),
            Src::Key(k) => match def(k)? {
                Def::Str(at, n) => (at, n),
                Def::Global(..) => return None,
            },
            Src::Other => return None,
        };
        blob.read_vec(at, u64::from(n)).ok()
    };
    let mut imports = Vec::new();
    for key in imported.keys().take_while(|&k| k < memo_len) {
        let import = match def(key)? {
            Def::Str(at, n) => Import::Str(bytes(Src::Bytes(at, n))?),
            Def::Global(m, n) => Import::Global(bytes(m)?, bytes(n)?),
        };
        imports.push((key, import));
    }
    Some(imports)
}
