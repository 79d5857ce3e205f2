//! `.metadata` read in two halves on two threads. The pre-pass cuts the pickle at a
//! batch boundary of a dict (see `prepass`), near the middle of the file: for DCP,
//! inside `storage_data`, which is most of it. A second thread reads from the cut on
//! its own stack, its dict at the bottom where it may not pop it, with the strings
//! and globals it fetches from before the cut, and keeps its storage pairs aside
//! instead of folding them onto chunks it has not seen. It stops at anything that
//! needs more (a value below its dict, a tensor entry), and gives back the state at
//! the last batch boundary it passed.
//!
//! The first thread reads from the start. When it reaches the cut, it checks that
//! its state is the one the second half assumed (a dict on top with no mark above
//! it, the same memo keys, the same values for the keys fetched from before the
//! cut), takes the second half's dict items, memo values and storage pairs, and
//! goes on from where the second half stopped. When anything differs, it reads on
//! by itself: the result is the same either way, only slower.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;

use super::fold::{Deferred, Fold};
use super::input::{Input, Used};
use super::prepass::{Cut, CutAt, Import};
use super::{classify, intern, op, Keep, Machine, Metadata, OrStop, R, V};
use crate::source::Blob;

/// Files smaller than this are read by one thread: the second would save little.
pub(super) const MIN_BYTES: u64 = 8 << 20;

/// Whether to look for a cut in a file of `len` bytes: when it is big enough and
/// there is a second core to read the second half on, where the halves would take
/// about as long.
pub(super) fn cut_at(len: u64) -> Option<CutAt> {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    (len >= MIN_BYTES && cores >= 2).then_some(CutAt::Balanced)
}

/// The second half, being read on another thread.
pub(super) struct Pending {
    cut: u64,
    memo_len: u32,
    rx: mpsc::Receiver<Option<Half>>,
}

/// What the second half read, up to the last batch boundary it passed.
pub(super) struct Half {
    /// Where the first half goes on from, and the memo keys assigned by then.
    end: u64,
    memo_len: u32,
    /// The items it set on the dict (besides storage pairs), and how deep they nest.
    pairs: Vec<(V, V)>,
    depth: u16,
    /// The values of the kept memo keys from the cut to `end`.
    memo: Vec<(V, u16)>,
    /// The values it was given for keys from before the cut, by key.
    imports: Vec<(u32, (V, u16))>,
    /// Its storage pairs, and the files and transforms their items refer to.
    deferred: Deferred,
    files: Vec<String>,
    transforms: Vec<Vec<String>>,
    /// The strings its values are numbered in.
    strings: Vec<String>,
}

/// Reads the pickle in two halves cut at `cut`. Also says whether the second half
/// was taken over (for tests).
pub(super) fn read_in_two(
    blob: &Blob,
    used: &Used,
    cut: &Cut,
    keep: Keep<'_>,
) -> R<(Metadata, bool)> {
    let cancel = &AtomicBool::new(false);
    std::thread::scope(|scope| {
        let (tx, rx) = mpsc::sync_channel(1);
        let second = std::thread::Builder::new()
            .name("unshard-metadata".into())
            .spawn_scoped(scope, move || {
                let _ = tx.send(second_half(blob, used, cut, keep, cancel));
            });
        let mut first = Machine::new(blob, used, keep);
        if second.is_ok() {
            first.half = Some(Pending {
                cut: cut.offset,
                memo_len: cut.memo_len,
                rx,
            });
        }
        let out = first.run();
        // A first half that gave up before the cut does not wait for the second.
        cancel.store(true, Ordering::Relaxed);
        out
    })
}

/// The state of a second half at a batch boundary.
#[derive(Clone, Copy)]
struct Checkpoint {
    end: u64,
    memo_len: u32,
    pairs: usize,
    depth: u16,
    memo: usize,
    deferred: (usize, usize),
}

/// How many opcodes a second half reads between looks at `cancel`.
const CANCEL_EVERY: u32 = 4096;

/// Reads from the cut until something needs more than the second half has; `None`
/// when it got past no batch boundary (or was cancelled).
fn second_half(
    blob: &Blob,
    used: &Used,
    cut: &Cut,
    keep: Keep<'_>,
    cancel: &AtomicBool,
) -> Option<Half> {
    let mut m = Machine::new(blob, used, keep);
    m.input = Input::at(blob, cut.offset);
    m.fold = Fold::second_half(keep);
    m.floor = 1;
    m.push(V::Dict(Box::default()));
    m.memo_len = cut.memo_len;
    m.memo.base = used.count_below(cut.memo_len);
    for (key, import) in &cut.imports {
        let v = match import {
            Import::Str(s) => intern(&mut m.strings, &mut m.interned, s).ok(),
            Import::Global(module, name) => {
                let module = std::str::from_utf8(module).ok();
                let name = std::str::from_utf8(name).ok();
                module
                    .zip(name)
                    .and_then(|(m, n)| classify(m, n))
                    .map(V::Global)
            }
        };
        // A key it cannot give a value makes the second half stop where it is fetched.
        if let Some(v) = v {
            m.memo.imports.push((*key, (v, 0)));
            m.memo.imported.insert(*key);
        }
    }
    m.memo.imported.count();
    let mut at = checkpoint(&m);
    let mut ops = 0u32;
    loop {
        if m.stack.len() == 1 && m.marks.is_empty() {
            at = checkpoint(&m);
        }
        ops = ops.wrapping_add(1);
        if ops % CANCEL_EVERY == 0 && cancel.load(Ordering::Relaxed) {
            return None;
        }
        let Ok(op) = m.input.byte() else { break };
        if op == op::STOP || m.step(op).is_err() {
            break;
        }
    }
    if at.end == cut.offset {
        return None;
    }
    let (deferred, files, transforms) = m.fold.into_deferred(at.deferred);
    let Some(V::Dict(mut pairs)) = m.stack.into_iter().next() else {
        return None;
    };
    pairs.truncate(at.pairs);
    m.memo.values.truncate(at.memo);
    Some(Half {
        end: at.end,
        memo_len: at.memo_len,
        pairs: *pairs,
        depth: at.depth,
        memo: m.memo.values,
        imports: m.memo.imports,
        deferred,
        files,
        transforms,
        strings: m.strings,
    })
}

fn checkpoint(m: &Machine<'_, '_>) -> Checkpoint {
    Checkpoint {
        end: m.input.position(),
        memo_len: m.memo_len,
        pairs: match m.stack.first() {
            Some(V::Dict(d)) => d.len(),
            _ => 0,
        },
        depth: m.depths.first().copied().unwrap_or(0),
        memo: m.memo.values.len(),
        deferred: m.fold.deferred_len(),
    }
}

/// Renumbers a second half's strings as the first half's, interning them there.
struct Renumber<'h> {
    from: &'h [String],
    map: Vec<Option<u32>>,
    strings: &'h mut Vec<String>,
    interned: &'h mut HashMap<String, u32>,
}

impl Renumber<'_> {
    fn id(&mut self, id: u32) -> Option<u32> {
        if let Some(Some(x)) = self.map.get(id as usize) {
            return Some(*x);
        }
        let s = self.from.get(id as usize)?;
        let V::Str(x) = intern(self.strings, self.interned, s.as_bytes()).ok()? else {
            return None;
        };
        *self.map.get_mut(id as usize)? = Some(x);
        Some(x)
    }

    /// `v` in the first half's numbers; `None` for values that belong to a fold
    /// (entries, chunks, storage): the second half is then not taken.
    fn value(&mut self, v: V) -> Option<V> {
        Some(match v {
            V::Str(id) => V::Str(self.id(id)?),
            V::Tuple(items) => V::Tuple(self.values(items.into_vec())?.into()),
            V::List(items) => V::List(Box::new(self.values(*items)?)),
            V::Dict(pairs) => {
                let mut out = Vec::with_capacity(pairs.len());
                for (k, x) in *pairs {
                    let k = self.value(k)?;
                    out.push((k, self.value(x)?));
                }
                V::Dict(Box::new(out))
            }
            v @ (V::None | V::Int(_) | V::Global(_) | V::Size(_) | V::Properties(_) | V::Other) => {
                v
            }
            V::Obj(_) | V::Chunk(_) | V::Entry(_) | V::Index(_) | V::Storage(_) => return None,
        })
    }

    fn values(&mut self, items: Vec<V>) -> Option<Vec<V>> {
        items.into_iter().map(|x| self.value(x)).collect()
    }
}

impl Machine<'_, '_> {
    /// At a `MARK`: when it is the cut, waits for the second half and takes it over.
    /// `true` when it did (the input has moved on past what the second half read).
    pub(super) fn take_half(&mut self) -> R<bool> {
        let at = self.input.position().checked_sub(1);
        let Some(p) = self.half.take_if(|p| at == Some(p.cut)) else {
            return Ok(false);
        };
        let Ok(Some(half)) = p.rx.recv() else {
            return Ok(false);
        };
        let taken = self.adopt(half, p.memo_len)?;
        self.took_half = taken;
        Ok(taken)
    }

    /// Takes over what the second half read, if this half's state is the one it
    /// assumed; `Ok(false)` (nothing changed) when it is not.
    fn adopt(&mut self, half: Half, memo_len: u32) -> R<bool> {
        let top_is_dict = matches!(self.stack.last(), Some(V::Dict(_)));
        let unmarked = self.marks.last().is_none_or(|&m| m < self.stack.len());
        let aligned =
            self.memo.base == 0 && self.memo.values.len() == self.memo.used.count_below(memo_len);
        if !top_is_dict || !unmarked || !aligned || self.memo_len != memo_len {
            return Ok(false);
        }
        for (key, (theirs, _)) in &half.imports {
            let same = match (self.memo.get(*key), theirs) {
                (Some((V::Str(a), _)), V::Str(b)) => {
                    self.strings.get(*a as usize) == half.strings.get(*b as usize)
                }
                (Some((V::Global(a), _)), V::Global(b)) => a == b,
                _ => false,
            };
            if !same {
                return Ok(false);
            }
        }
        let mut r = Renumber {
            from: &half.strings,
            map: vec![None; half.strings.len()],
            strings: &mut self.strings,
            interned: &mut self.interned,
        };
        let mut pairs = Vec::with_capacity(half.pairs.len());
        for (k, v) in half.pairs {
            match (r.value(k), r.value(v)) {
                (Some(k), Some(v)) => pairs.push((k, v)),
                _ => return Ok(false),
            }
        }
        let mut memo = Vec::with_capacity(half.memo.len());
        for (v, d) in half.memo {
            let Some(v) = r.value(v) else {
                return Ok(false);
            };
            memo.push((v, d));
        }
        // Taken: from here on, anything wrong is wrong in the file, as when read alone.
        let Some(V::Dict(dict)) = self.stack.last_mut() else {
            return Ok(false);
        };
        dict.extend(pairs);
        let depth = self.depths.last_mut().or_stop()?;
        *depth = (*depth).max(half.depth);
        self.memo.values.extend(memo);
        let d = &half.deferred;
        for &(fqn, at, n, ref item) in &d.pairs {
            let fqn = r.id(fqn).or_stop()?;
            let dims = match at {
                u32::MAX => None,
                at => Some(d.dims.get(at as usize..(at + n) as usize).or_stop()?),
            };
            let file = half.files.get(item.file as usize).or_stop()?;
            let transforms = half.transforms.get(item.transforms as usize).or_stop()?;
            self.fold
                .adopt_storage(fqn, dims, item, (file, transforms))?;
        }
        for &fqn in &d.dropped {
            let fqn = r.id(fqn).or_stop()?;
            self.fold.adopt_dropped(fqn)?;
        }
        self.memo_len = half.memo_len;
        self.input.seek(half.end);
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use crate::source::dcp::metadata::stream::prepass::pre_pass;

    fn fixture() -> Blob {
        let path = crate::fixtures().join("sharded/wide_metadata_batches/.metadata");
        crate::bytes::fs::open(&path).unwrap()
    }

    /// Reads the fixture with the second half `half` handed to the first at `cut`.
    fn first_half(blob: &Blob, used: &Used, cut: &Cut, half: Option<Half>) -> (Metadata, bool) {
        let (tx, rx) = mpsc::sync_channel(1);
        tx.send(half).unwrap();
        let mut first = Machine::new(blob, used, Keep::All);
        first.half = Some(Pending {
            cut: cut.offset,
            memo_len: cut.memo_len,
            rx,
        });
        first.run().ok().unwrap()
    }

    /// A second half that assumed another value for a key from before the cut than
    /// the first half has is not taken, and the first half reads on by itself.
    #[test]
    fn a_second_half_that_assumed_other_values_is_not_taken() {
        let blob = fixture();
        let pass = pre_pass(&blob, Some(CutAt::Offset(blob.len() / 2)))
            .ok()
            .unwrap();
        let cut = pass.cut.as_ref().unwrap();
        let read = || second_half(&blob, &pass.used, cut, Keep::All, &AtomicBool::new(false));
        let (whole, took) = Machine::new(&blob, &pass.used, Keep::All)
            .run()
            .ok()
            .unwrap();
        assert!(!took);

        let (md, took) = first_half(&blob, &pass.used, cut, read());
        assert!(took);
        assert_eq!(md, whole);

        // An fqn fetched from before the cut, given another name.
        let mut half = read().unwrap();
        let (_, (v, _)) = half
            .imports
            .iter()
            .find(|(_, (v, _))| matches!(v, V::Str(s) if half.strings[*s as usize].contains('.')))
            .unwrap();
        let V::Str(s) = v else { unreachable!() };
        let s = *s as usize;
        half.strings[s] = format!("{}x", half.strings[s]);
        let (md, took) = first_half(&blob, &pass.used, cut, Some(half));
        assert!(!took);
        assert_eq!(md, whole);

        // A class fetched from before the cut, taken for another.
        let mut half = read().unwrap();
        let (_, (v, _)) = half
            .imports
            .iter_mut()
            .find(|(_, (v, _))| matches!(v, V::Global(super::super::Class::Index)))
            .unwrap();
        *v = V::Global(super::super::Class::StorageInfo);
        let (md, took) = first_half(&blob, &pass.used, cut, Some(half));
        assert!(!took);
        assert_eq!(md, whole);
    }

    /// A second half that stops inside a batch gives back its state at the last
    /// boundary it passed: the items and memo values of the unfinished batch are not
    /// in it (the first half reads that batch again).
    #[test]
    fn a_second_half_gives_back_its_state_at_the_last_boundary() {
        // One batch `{'k1': 'v1'}`, then one that memoizes 'k2' (a key fetched again)
        // and fetches a key the second half has no value for.
        let first = b"(\x8c\x02k1\x8c\x02v1u";
        let bytes = [&first[..], b"(\x8c\x02k2\x94h\x63"].concat();
        let blob = Blob::owned(std::path::PathBuf::from(".metadata"), bytes);
        let mut used = Used::default();
        used.insert(0);
        used.count();
        let cut = Cut {
            offset: 0,
            memo_len: 0,
            imports: Vec::new(),
        };
        let half = second_half(&blob, &used, &cut, Keep::All, &AtomicBool::new(false)).unwrap();
        assert_eq!(half.end, first.len() as u64);
        assert_eq!(half.memo_len, 0);
        assert!(half.memo.is_empty());
        assert_eq!(half.pairs.len(), 1);
        let (V::Str(k), V::Str(v)) = &half.pairs[0] else {
            panic!("{:?}", half.pairs)
        };
        assert_eq!(
            (&*half.strings[*k as usize], &*half.strings[*v as usize]),
            ("k1", "v1")
        );
    }

    /// The cut is at a batch boundary at or after the offset asked for, and there is
    /// none after the last one.
    #[test]
    fn the_cut_is_the_first_batch_boundary_after_the_offset_asked_for() {
        let blob = fixture();
        let raw = blob.read_vec(0, blob.len()).unwrap();
        let at = blob.len() / 2;
        let cut = pre_pass(&blob, Some(CutAt::Offset(at)))
            .ok()
            .unwrap()
            .cut
            .unwrap();
        assert!(cut.offset >= at);
        // `MARK` after `SETITEMS`.
        assert_eq!(&raw[cut.offset as usize - 1..=cut.offset as usize], b"u(");
        let pass = pre_pass(&blob, Some(CutAt::Offset(blob.len() - 1)))
            .ok()
            .unwrap();
        assert!(pass.cut.is_none());
    }
}
