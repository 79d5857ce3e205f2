//! The streaming reader of `.metadata`: one pass over the pickle's opcodes that
//! folds each DCP dataclass into its compact record as it is built (see `fold`),
//! with a stack of small values and a memo that keeps only what is fetched again.
//!
//! It stays inert the way the full reader is: nothing is called, a `REDUCE` or
//! `NEWOBJ` only builds a value. It is also narrower: it accepts only the globals
//! DCP's own dataclasses use (every one of them allowed by the pickle audit), only
//! the opcodes Python's pickler writes for them, and only their usual shape
//! (`.metadata` fields in order, chunks inside their tensor entry, storage keys
//! naming known entries). Anything else, a truncated file included, makes it give
//! up, and the full reader (which audits and explains) reads the file instead. So a
//! pickle this reader accepts has nothing for the audit to report.

use std::collections::HashMap;

use crate::dtype::DType;
use crate::error::Error;
use crate::source::Blob;

use super::{Keep, Metadata};

mod fold;
mod half;
mod input;
mod prepass;

#[cfg(test)]
pub(super) use prepass::CutAt;

use fold::{Field, Fold};
use input::{Input, Used};

/// Why the pass stopped early.
enum GiveUp {
    /// Something this reader does not handle: read the file with the full reader.
    Stop,
    /// The file could not be read.
    Io(Error),
}

type R<T> = std::result::Result<T, GiveUp>;

/// `Option` to [`R`]: `None` gives up.
trait OrStop<T> {
    fn or_stop(self) -> R<T>;
}

impl<T> OrStop<T> for Option<T> {
    fn or_stop(self) -> R<T> {
        self.ok_or(GiveUp::Stop)
    }
}

/// Reads `.metadata` in one pass. `Ok(None)` when the file holds anything beyond
/// what DCP writes (the caller reads it with the full reader). A file of more than
/// [`half::MIN_BYTES`] is read in two halves on two threads when the machine has two
/// cores.
pub(super) fn read(blob: &Blob, keep: Keep<'_>) -> crate::error::Result<Option<Metadata>> {
    read_cut(blob, keep, half::cut_at(blob.len())).map(|r| r.map(|(md, _)| md))
}

/// [`read`], cut for a second thread where `cut_at` says, if anywhere; also says
/// whether the second half was taken.
pub(super) fn read_cut(
    blob: &Blob,
    keep: Keep<'_>,
    cut_at: Option<prepass::CutAt>,
) -> crate::error::Result<Option<(Metadata, bool)>> {
    let run = || -> R<(Metadata, bool)> {
        let pass = prepass::pre_pass(blob, cut_at)?;
        let Some(cut) = &pass.cut else {
            return Machine::new(blob, &pass.used, keep).run();
        };
        half::read_in_two(blob, &pass.used, cut, keep)
    };
    match run() {
        Ok(md) => Ok(Some(md)),
        Err(GiveUp::Stop) => Ok(None),
        Err(GiveUp::Io(e)) => Err(e),
    }
}

// Opcode bytes (the `pickletools` names).
use unshard_pickle::opcode as op;

/// The globals this reader knows, and what it makes of them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Class {
    Metadata,
    Tensor,
    Properties,
    Chunk,
    Index,
    Bytes,
    StorageInfo,
    Size,
    DType(DType),
    /// Allowed, and never looked into (layouts, memory formats, `StorageMeta`, paths).
    Opaque,
}

fn classify(module: &str, name: &str) -> Option<Class> {
    if !unshard_pickle::audit::names::allowed(module, name) {
        return None;
    }
    let class = match (module, name) {
        ("torch.distributed.checkpoint.metadata", n) => match n {
            "Metadata" => Class::Metadata,
            "TensorStorageMetadata" => Class::Tensor,
            "TensorProperties" => Class::Properties,
            "ChunkStorageMetadata" => Class::Chunk,
            "MetadataIndex" => Class::Index,
            "BytesStorageMetadata" => Class::Bytes,
            "StorageMeta" | "_MEM_FORMAT_ENCODING" => Class::Opaque,
            _ => return None,
        },
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo") => Class::StorageInfo,
        ("torch", "Size") => Class::Size,
        ("torch", n) => Class::DType(DType::from_torch_name(n)?),
        ("torch.serialization", "_get_layout") => Class::Opaque,
        ("pathlib", "PosixPath" | "WindowsPath" | "PurePosixPath" | "PureWindowsPath") => {
            Class::Opaque
        }
        _ => return None,
    };
    Some(class)
}

/// A value on the stack: small, with the DCP dataclasses already folded. Lists and
/// dicts are boxed vectors so that a value is 24 bytes.
#[derive(Clone, Debug)]
#[allow(clippy::box_collection)]
enum V {
    None,
    Int(i64),
    /// An interned string.
    Str(u32),
    Global(Class),
    Tuple(Box<[V]>),
    List(Box<Vec<V>>),
    Dict(Box<Vec<(V, V)>>),
    /// `torch.Size(dims)`.
    Size(Box<[u64]>),
    /// A known class made by `NEWOBJ`, waiting for its `BUILD`.
    Obj(Class),
    /// A `ChunkStorageMetadata`, by its place in its tensor entry.
    Chunk(u32),
    /// `TensorProperties`: all that is needed of it is the dtype.
    Properties(DType),
    /// A state-dict entry (`TensorStorageMetadata` or `BytesStorageMetadata`), by record.
    Entry(u32),
    /// A `MetadataIndex`.
    Index(Box<fold::Index>),
    /// A `_StorageInfo`.
    Storage(Box<super::Item>),
    /// Anything else: never looked into.
    Other,
}

/// Containers nested deeper than this make the pass give up (values are trees here,
/// dropped and cloned recursively; the full reader's arena has no such limit).
const MAX_DEPTH: u16 = 200;

/// Values fetched again from the memo are copied, so only small ones are kept: a
/// copy costs no more than the input that asked for it, as in the full reader.
const MAX_MEMO_WEIGHT: usize = 64;

/// How many values `v` holds, counting itself, up to `cap + 1`.
fn weight(v: &V, cap: usize) -> usize {
    let inner: &[V] = match v {
        V::Tuple(items) => items,
        V::List(items) => items,
        V::Dict(pairs) => {
            let mut n = 1;
            for (k, x) in pairs.iter() {
                if n > cap {
                    break;
                }
                n += weight(k, cap) + weight(x, cap);
            }
            return n;
        }
        _ => return 1,
    };
    let mut n = 1;
    for x in inner {
        if n > cap {
            break;
        }
        n += weight(x, cap);
    }
    n
}

/// What the memo keeps of a value (and its nesting depth), for the keys fetched
/// again: the value of the `i`th of those keys ([`Used::index`]) at
/// `values[i - base]`. A second half starts at `base` with the values of the keys
/// it fetches from before its cut in `imports`.
struct Memo<'a> {
    used: &'a Used,
    base: usize,
    values: Vec<(V, u16)>,
    /// By key, the `j`th at place `j` in `imported`.
    imports: Vec<(u32, (V, u16))>,
    imported: Used,
}

impl<'a> Memo<'a> {
    fn new(used: &'a Used) -> Memo<'a> {
        Memo {
            used,
            base: 0,
            values: Vec::new(),
            imports: Vec::new(),
            imported: Used::default(),
        }
    }

    /// Keeps the value of the `i`th key fetched again. Keys come in increasing order,
    /// each once, so the value lands at its index.
    fn put(&mut self, i: usize, v: (V, u16)) -> R<()> {
        if i.checked_sub(self.base) != Some(self.values.len()) {
            return Err(GiveUp::Stop);
        }
        self.values.push(v);
        Ok(())
    }

    #[inline]
    fn get(&self, key: u32) -> Option<&(V, u16)> {
        let i = self.used.index(key)?;
        match i.checked_sub(self.base) {
            Some(i) => self.values.get(i),
            None => {
                let j = self.imported.index(key)?;
                self.imports.get(j).map(|(_, v)| v)
            }
        }
    }
}

struct Machine<'a, 'k> {
    input: Input<'a>,
    stack: Vec<V>,
    /// Values at the bottom of the stack that may not be popped (a second half's dict).
    floor: usize,
    /// How deep the containers of each stack value nest (0: not a container).
    depths: Vec<u16>,
    marks: Vec<usize>,
    memo: Memo<'a>,
    /// The number of memo keys assigned so far.
    memo_len: u32,
    strings: Vec<String>,
    interned: HashMap<String, u32>,
    fold: Fold<'k>,
    /// The second half being read on another thread, taken over at its cut.
    half: Option<half::Pending>,
    /// Whether it was.
    took_half: bool,
}

/// The number of string `bytes` in `strings`, adding it if it is new.
fn intern(strings: &mut Vec<String>, interned: &mut HashMap<String, u32>, bytes: &[u8]) -> R<V> {
    let s = std::str::from_utf8(bytes).map_err(|_| GiveUp::Stop)?;
    if let Some(&i) = interned.get(s) {
        return Ok(V::Str(i));
    }
    let i = u32::try_from(strings.len()).map_err(|_| GiveUp::Stop)?;
    strings.push(s.to_string());
    interned.insert(s.to_string(), i);
    Ok(V::Str(i))
}

impl<'a, 'k> Machine<'a, 'k> {
    fn new(blob: &'a Blob, used: &'a Used, keep: Keep<'k>) -> Self {
        Machine {
            input: Input::new(blob),
            stack: Vec::new(),
            floor: 0,
            depths: Vec::new(),
            marks: Vec::new(),
            memo: Memo::new(used),
            memo_len: 0,
            strings: Field::ALL.iter().map(|f| f.name().to_string()).collect(),
            interned: Field::ALL
                .iter()
                .map(|f| (f.name().to_string(), *f as u32))
                .collect(),
            fold: Fold::new(keep),
            half: None,
            took_half: false,
        }
    }

    fn push(&mut self, v: V) {
        self.push_nested(v, 0);
    }

    fn push_nested(&mut self, v: V, depth: u16) {
        self.stack.push(v);
        self.depths.push(depth);
    }

    /// A container of values nested `inner` deep.
    fn container_depth(inner: u16) -> R<u16> {
        if inner >= MAX_DEPTH {
            return Err(GiveUp::Stop);
        }
        Ok(inner + 1)
    }

    fn pop(&mut self) -> R<V> {
        self.pop_nested().map(|(v, _)| v)
    }

    fn pop_nested(&mut self) -> R<(V, u16)> {
        let floor = self.marks.last().map_or(self.floor, |&m| m.max(self.floor));
        if floor >= self.stack.len() {
            return Err(GiveUp::Stop);
        }
        let d = self.depths.pop().or_stop()?;
        Ok((self.stack.pop().or_stop()?, d))
    }

    /// The values above the last mark, and how deep the deepest of them nests.
    fn pop_mark(&mut self) -> R<(Vec<V>, u16)> {
        let m = self.marks.pop().or_stop()?;
        if m > self.stack.len() {
            return Err(GiveUp::Stop);
        }
        let depth = self.depths.drain(m..).max().unwrap_or(0);
        Ok((self.stack.split_off(m), depth))
    }

    /// Notes that the container on top of the stack now holds values `inner` deep.
    fn deepen_top(&mut self, inner: u16) -> R<()> {
        let d = Self::container_depth(inner)?;
        let top = self.depths.last_mut().or_stop()?;
        *top = (*top).max(d);
        Ok(())
    }

    fn top(&mut self) -> R<&mut V> {
        if self.marks.last().is_some_and(|&m| m >= self.stack.len()) {
            return Err(GiveUp::Stop);
        }
        self.stack.last_mut().or_stop()
    }

    fn memoize(&mut self, key: u32) -> R<()> {
        let Some(i) = self.memo.used.index(key) else {
            return Ok(());
        };
        let depth = self.depths.last().copied().unwrap_or(0);
        let top = self.top()?;
        if weight(top, MAX_MEMO_WEIGHT) > MAX_MEMO_WEIGHT {
            return Err(GiveUp::Stop);
        }
        match top {
            // Containers and objects still being filled in would be seen changed
            // through the memo: the full reader shares them, this one does not.
            V::List(_) | V::Dict(_) | V::Obj(_) => return Err(GiveUp::Stop),
            _ => {}
        }
        let v = top.clone();
        self.memo.put(i, (v, depth))
    }

    fn global(&mut self, module: &str, name: &str) -> R<()> {
        let class = classify(module, name).or_stop()?;
        self.push(V::Global(class));
        Ok(())
    }

    /// Reads to the end; also says whether a second half was taken over.
    fn run(mut self) -> R<(Metadata, bool)> {
        loop {
            let op = self.input.byte()?;
            match op {
                op::STOP => {
                    let top = self.pop()?;
                    if !self.stack.is_empty() || !self.marks.is_empty() {
                        return Err(GiveUp::Stop);
                    }
                    let took = self.took_half;
                    return Ok((self.fold.finish(top, &self.strings)?, took));
                }
                // The second half starts at a mark: take it over when it is here.
                op::MARK if self.half.is_some() && self.take_half()? => {}
                _ => self.step(op)?,
            }
        }
    }

    /// Runs opcode `op` (anything but `STOP`).
    fn step(&mut self, op: u8) -> R<()> {
        use op::*;
        {
            match op {
                PROTO => {
                    if self.input.byte()? > 5 {
                        return Err(GiveUp::Stop);
                    }
                }
                FRAME => {
                    self.input.bytes(8)?;
                }
                MARK => self.marks.push(self.stack.len()),
                POP => {
                    self.pop()?;
                }
                NONE => self.push(V::None),
                NEWTRUE | NEWFALSE => self.push(V::Other),
                BININT1 => {
                    let v = self.input.uint(1)?;
                    self.push(V::Int(v as i64));
                }
                BININT2 => {
                    let v = self.input.uint(2)?;
                    self.push(V::Int(v as i64));
                }
                BININT => {
                    let v = self.input.uint(4)? as u32 as i32;
                    self.push(V::Int(i64::from(v)));
                }
                LONG1 => {
                    let n = self.input.length(1)?;
                    let b = self.input.bytes(n)?;
                    let v = if n == 0 {
                        V::Int(0)
                    } else if n <= 8 {
                        let mut x = [if b[n - 1] & 0x80 != 0 { 0xff } else { 0 }; 8];
                        x[..n].copy_from_slice(b);
                        V::Int(i64::from_le_bytes(x))
                    } else {
                        V::Other
                    };
                    self.push(v);
                }
                BINFLOAT => {
                    self.input.bytes(8)?;
                    self.push(V::Other);
                }
                SHORT_BINUNICODE | BINUNICODE | BINUNICODE8 => {
                    let width = match op {
                        SHORT_BINUNICODE => 1,
                        BINUNICODE => 4,
                        _ => 8,
                    };
                    let n = self.input.length(width)?;
                    let bytes = self.input.bytes(n)?;
                    let v = intern(&mut self.strings, &mut self.interned, bytes)?;
                    self.push(v);
                }
                SHORT_BINBYTES | BINBYTES => {
                    let n = self.input.length(if op == BINBYTES { 4 } else { 1 })?;
                    self.input.bytes(n)?;
                    self.push(V::Other);
                }
                MEMOIZE => {
                    let key = self.memo_len;
                    self.memo_len = key.checked_add(1).or_stop()?;
                    self.memoize(key)?;
                }
                BINPUT | LONG_BINPUT => {
                    let key = self.input.uint(if op == BINPUT { 1 } else { 4 })? as u32;
                    self.memo_len = key.checked_add(1).or_stop()?;
                    self.memoize(key)?;
                }
                BINGET | LONG_BINGET => {
                    let key = self.input.uint(if op == BINGET { 1 } else { 4 })? as u32;
                    let (v, depth) = self.memo.get(key).or_stop()?.clone();
                    self.push_nested(v, depth);
                }
                STACK_GLOBAL => {
                    let name = self.pop()?;
                    let module = self.pop()?;
                    let (V::Str(m), V::Str(n)) = (module, name) else {
                        return Err(GiveUp::Stop);
                    };
                    let (m, n) = (
                        self.strings[m as usize].clone(),
                        self.strings[n as usize].clone(),
                    );
                    self.global(&m, &n)?;
                }
                GLOBAL => {
                    let m = self.input.line()?;
                    let n = self.input.line()?;
                    self.global(&m, &n)?;
                }
                EMPTY_TUPLE => self.push(V::Tuple(Box::new([]))),
                TUPLE1 | TUPLE2 | TUPLE3 => {
                    let n = usize::from(op - TUPLE1 + 1);
                    let mut items = Vec::with_capacity(n);
                    let mut inner = 0;
                    for _ in 0..n {
                        let (v, d) = self.pop_nested()?;
                        items.push(v);
                        inner = inner.max(d);
                    }
                    items.reverse();
                    let depth = Self::container_depth(inner)?;
                    self.push_nested(V::Tuple(items.into_boxed_slice()), depth);
                }
                TUPLE => {
                    let (items, inner) = self.pop_mark()?;
                    let depth = Self::container_depth(inner)?;
                    self.push_nested(V::Tuple(items.into_boxed_slice()), depth);
                }
                EMPTY_LIST => self.push(V::List(Box::default())),
                EMPTY_DICT => self.push(V::Dict(Box::default())),
                APPEND => {
                    let (v, inner) = self.pop_nested()?;
                    self.deepen_top(inner)?;
                    let V::List(list) = self.top()? else {
                        return Err(GiveUp::Stop);
                    };
                    list.push(v);
                }
                APPENDS => {
                    let (items, inner) = self.pop_mark()?;
                    self.deepen_top(inner)?;
                    let V::List(list) = self.top()? else {
                        return Err(GiveUp::Stop);
                    };
                    list.extend(items);
                }
                SETITEM => {
                    let at = self.stack.len().checked_sub(2).or_stop()?;
                    self.set_items(at)?;
                }
                SETITEMS => {
                    let m = self.marks.pop().or_stop()?;
                    self.set_items(m)?;
                }
                NEWOBJ => {
                    let args = self.pop()?;
                    let class = self.pop()?;
                    let (V::Global(class), V::Tuple(args)) = (class, args) else {
                        return Err(GiveUp::Stop);
                    };
                    let v = match class {
                        Class::Opaque => V::Other,
                        Class::Size | Class::DType(_) => return Err(GiveUp::Stop),
                        _ if !args.is_empty() => return Err(GiveUp::Stop),
                        Class::Tensor => {
                            // The key it will be stored under is below it on the stack.
                            let fqn = match self.stack.last() {
                                Some(V::Str(s)) => *s,
                                _ => return Err(GiveUp::Stop),
                            };
                            let keep = self.fold.keep.chunks_of(&self.strings[fqn as usize]);
                            self.fold.begin_tensor(fqn, keep)?;
                            V::Obj(class)
                        }
                        _ => V::Obj(class),
                    };
                    self.push(v);
                }
                REDUCE => {
                    let args = self.pop()?;
                    let callable = self.pop()?;
                    let (V::Global(class), V::Tuple(args)) = (callable, args) else {
                        return Err(GiveUp::Stop);
                    };
                    let v = match (class, &args[..]) {
                        (Class::Size, [V::Tuple(dims)]) => V::Size(
                            dims.iter()
                                .map(|d| match d {
                                    V::Int(i) => u64::try_from(*i).ok(),
                                    _ => None,
                                })
                                .collect::<Option<Box<[u64]>>>()
                                .or_stop()?,
                        ),
                        (Class::Opaque, _) => V::Other,
                        _ => return Err(GiveUp::Stop),
                    };
                    self.push(v);
                }
                BUILD => {
                    let state = self.pop()?;
                    let obj = self.pop()?;
                    let v = match obj {
                        V::Other => V::Other,
                        V::Obj(class) => self.fold.build(class, state, &self.strings)?,
                        _ => return Err(GiveUp::Stop),
                    };
                    self.push(v);
                }
                _ => return Err(GiveUp::Stop),
            }
        }
        Ok(())
    }

    /// `SETITEM(S)` of the values from `at` up on the dict below them: storage
    /// pairs go to their chunks, state-dict entries are checked against the key they
    /// are stored under.
    fn set_items(&mut self, at: usize) -> R<()> {
        let len = self.stack.len();
        // The dict must be above the last mark, as `top` would see it.
        let marked = self.marks.last().is_some_and(|&m| m >= at);
        if at == 0 || at < self.floor || at > len || (len - at) % 2 != 0 || marked {
            return Err(GiveUp::Stop);
        }
        let inner = self.depths.drain(at..).max().unwrap_or(0);
        self.deepen_top(inner)?;
        let (below, items) = self.stack.split_at_mut(at);
        let Some(V::Dict(dict)) = below.last_mut() else {
            return Err(GiveUp::Stop);
        };
        for pair in items.chunks_exact_mut(2) {
            let k = std::mem::replace(&mut pair[0], V::None);
            let v = std::mem::replace(&mut pair[1], V::None);
            if let Some(pair) = self.fold.pair(k, v, &self.strings)? {
                dict.push(pair);
            }
        }
        self.stack.truncate(at);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::fold::Field;
    use super::{weight, V};

    /// The field names are numbered by their place in `Field::ALL`, which is how the
    /// reader interns them.
    #[test]
    fn fields_are_numbered_in_order() {
        for (i, f) in Field::ALL.iter().enumerate() {
            assert_eq!(*f as usize, i, "{}", f.name());
        }
    }

    /// What the memo may keep is counted without walking all of a big value.
    #[test]
    fn weight_counts_values_up_to_the_cap() {
        let small = V::Tuple(vec![V::Int(1), V::Str(0)].into_boxed_slice());
        assert_eq!(weight(&small, 64), 3);
        let big = V::Tuple(vec![V::Int(1); 1000].into_boxed_slice());
        let w = weight(&big, 64);
        assert!(w > 64 && w < 100, "{w}");
        let nested = V::List(Box::new(vec![big.clone(), big]));
        assert!(weight(&nested, 64) > 64);
    }
}
