//! DCP's dataclasses folded into compact records as the pickle builds them: a
//! `ChunkStorageMetadata` becomes a chunk of the tensor entry being built (or just a
//! number, when that entry's chunks are not kept), a `_StorageInfo` stored under a
//! `MetadataIndex` goes straight onto the chunk it names, and `Metadata` ties the
//! entries to their keys and planner paths at the end.
//!
//! A storage key names its chunk by fqn and offsets (`MetadataIndex.__post_init__`
//! makes a new `torch.Size` of them, so they are never shared with the chunk): the
//! entry is found by fqn and the chunk by offsets, looked for first just after the
//! previous one found, as storage keys usually follow the chunks' order.

use std::collections::HashMap;

use super::super::{Builder, Chunks, Entry, EntryKind, Item, Keep, Metadata};
use super::{Class, GiveUp, OrStop, R, V};
use crate::dtype::DType;

/// A `MetadataIndex`: an entry's fqn and, for a chunk, its offsets.
#[derive(Clone, Debug)]
pub(super) struct Index {
    fqn: u32,
    at: At,
}

/// A second half's storage pairs, kept in order for the first half to fold onto its
/// chunks, compactly: there may be hundreds of thousands.
#[derive(Default)]
pub(super) struct Deferred {
    /// Per pair: the fqn, where its offsets start in `dims` (`u32::MAX`: a byte
    /// entry, no offsets) and how many there are, and the item.
    pub(super) pairs: Vec<(u32, u32, u32, Item)>,
    /// The offsets of the pairs' chunks, one after the other.
    pub(super) dims: Vec<u64>,
    /// The fqns of pairs whose chunks are not kept, only checked (each run once).
    pub(super) dropped: Vec<u32>,
}

#[derive(Clone, Debug)]
enum At {
    /// A byte entry (no offsets).
    Entry,
    /// A chunk, by its offsets.
    Dims(Box<[u64]>),
}

/// A state-dict entry, as folded.
struct Rec {
    fqn: u32,
    kind: Option<EntryKind>,
    /// Where the next storage key given by value is looked for first.
    cursor: usize,
    /// Whether a `state_dict_metadata` key holds it.
    placed: bool,
}

/// The tensor entry whose chunks are being built.
struct Open {
    fqn: u32,
    keep: bool,
    /// Chunks folded so far (kept or not).
    count: usize,
    ndim: Option<usize>,
    chunks: Chunks,
}

pub(super) struct Fold<'k> {
    pub(super) keep: Keep<'k>,
    b: Builder,
    recs: Vec<Rec>,
    by_fqn: HashMap<u32, u32>,
    open: Option<Open>,
    /// The `BUILD` state of `Metadata`.
    meta: Option<Vec<(V, V)>>,
    /// A second half's fold: storage pairs are kept here, in order, for the first
    /// half to fold onto its chunks, and nothing that needs the entries is allowed.
    deferred: Option<Deferred>,
}

/// The dataclass fields the fold reads. The reader interns their names before
/// anything else, so that the string numbered `f as u32` is `f.name()` and a field
/// is found by number.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Field {
    Dtype,
    Offsets,
    Sizes,
    Properties,
    Size,
    Chunks,
    Fqn,
    Offset,
    RelativePath,
    Length,
    TransformDescriptors,
    StateDictMetadata,
    StorageData,
    PlannerData,
}

impl Field {
    /// Every field, in the order of their numbers.
    pub(super) const ALL: [Field; 14] = [
        Field::Dtype,
        Field::Offsets,
        Field::Sizes,
        Field::Properties,
        Field::Size,
        Field::Chunks,
        Field::Fqn,
        Field::Offset,
        Field::RelativePath,
        Field::Length,
        Field::TransformDescriptors,
        Field::StateDictMetadata,
        Field::StorageData,
        Field::PlannerData,
    ];

    /// The field's name in the dataclass.
    pub(super) fn name(self) -> &'static str {
        match self {
            Field::Dtype => "dtype",
            Field::Offsets => "offsets",
            Field::Sizes => "sizes",
            Field::Properties => "properties",
            Field::Size => "size",
            Field::Chunks => "chunks",
            Field::Fqn => "fqn",
            Field::Offset => "offset",
            Field::RelativePath => "relative_path",
            Field::Length => "length",
            Field::TransformDescriptors => "transform_descriptors",
            Field::StateDictMetadata => "state_dict_metadata",
            Field::StorageData => "storage_data",
            Field::PlannerData => "planner_data",
        }
    }
}

/// The field `f` of a dataclass state (a dict with string keys): the last value
/// set for it, as Python's dict keeps.
fn field(state: &[(V, V)], f: Field) -> Option<&V> {
    let id = f as u32;
    state.iter().rev().find_map(|(k, v)| match k {
        V::Str(s) if *s == id => Some(v),
        _ => None,
    })
}

fn size_of(v: Option<&V>) -> R<&[u64]> {
    match v {
        Some(V::Size(dims)) => Ok(dims),
        _ => Err(GiveUp::Stop),
    }
}

fn uint_of(v: Option<&V>) -> R<u64> {
    match v {
        Some(V::Int(i)) => u64::try_from(*i).map_err(|_| GiveUp::Stop),
        _ => Err(GiveUp::Stop),
    }
}

fn dtype_of(v: Option<&V>) -> R<DType> {
    match v {
        Some(V::Global(Class::DType(d))) => Ok(*d),
        _ => Err(GiveUp::Stop),
    }
}

impl<'k> Fold<'k> {
    pub(super) fn new(keep: Keep<'k>) -> Self {
        Fold {
            keep,
            b: Builder::new(),
            recs: Vec::new(),
            by_fqn: HashMap::new(),
            open: None,
            meta: None,
            deferred: None,
        }
    }

    /// The fold of a second half (see [`Fold::deferred`]), keeping the chunks of the
    /// entries `keep` keeps.
    pub(super) fn second_half(keep: Keep<'k>) -> Fold<'k> {
        Fold {
            deferred: Some(Deferred::default()),
            ..Fold::new(keep)
        }
    }

    /// How many storage pairs a second half's fold has kept, and checks.
    pub(super) fn deferred_len(&self) -> (usize, usize) {
        self.deferred
            .as_ref()
            .map_or((0, 0), |d| (d.pairs.len(), d.dropped.len()))
    }

    /// A second half's storage pairs (`n` of them, from [`Fold::deferred_len`]), and
    /// its tables of the files and transforms their items refer to.
    pub(super) fn into_deferred(
        self,
        n: (usize, usize),
    ) -> (Deferred, Vec<String>, Vec<Vec<String>>) {
        let mut d = self.deferred.unwrap_or_default();
        d.pairs.truncate(n.0);
        d.dropped.truncate(n.1);
        (d, self.b.md.files, self.b.md.transforms)
    }

    /// Folds a storage pair read by a second half onto its chunk: `fqn` in this
    /// fold's strings, the chunk's offsets (`None`: a byte entry), and the item's
    /// place in `file` after `transforms`.
    pub(super) fn adopt_storage(
        &mut self,
        fqn: u32,
        dims: Option<&[u64]>,
        item: &Item,
        (file, transforms): (&str, &[String]),
    ) -> R<()> {
        let item = self.b.item(file, item.offset, item.length, transforms);
        self.apply(fqn, dims, item)
    }

    /// Checks what a second half only checked: that `fqn` is a tensor entry whose
    /// chunks are not kept.
    pub(super) fn adopt_dropped(&mut self, fqn: u32) -> R<()> {
        let r = *self.by_fqn.get(&fqn).or_stop()?;
        match self.recs.get(r as usize).and_then(|rec| rec.kind.as_ref()) {
            Some(EntryKind::Tensor { dropped: true, .. }) => Ok(()),
            _ => Err(GiveUp::Stop),
        }
    }

    /// A `TensorStorageMetadata` stored under `fqn` was made; its chunks follow.
    pub(super) fn begin_tensor(&mut self, fqn: u32, keep: bool) -> R<()> {
        if self.open.is_some() || self.deferred.is_some() {
            return Err(GiveUp::Stop);
        }
        self.open = Some(Open {
            fqn,
            keep,
            count: 0,
            ndim: None,
            chunks: Chunks::default(),
        });
        Ok(())
    }

    fn add_rec(&mut self, rec: Rec) -> R<u32> {
        if self.deferred.is_some() {
            return Err(GiveUp::Stop);
        }
        let id = u32::try_from(self.recs.len()).map_err(|_| GiveUp::Stop)?;
        if self.by_fqn.insert(rec.fqn, id).is_some() {
            return Err(GiveUp::Stop);
        }
        self.recs.push(rec);
        Ok(id)
    }

    /// `BUILD` of an object of a known class with `state`.
    pub(super) fn build(&mut self, class: Class, state: V, strings: &[String]) -> R<V> {
        if let (Class::Properties, V::Tuple(parts)) = (class, &state) {
            // `TensorProperties.__getstate__`: (dtype, layout, requires_grad, ...).
            return Ok(V::Properties(dtype_of(parts.first())?));
        }
        if class == Class::Bytes {
            return Ok(V::Obj(Class::Bytes));
        }
        let V::Dict(state) = state else {
            return Err(GiveUp::Stop);
        };
        let f = |name: Field| field(&state, name);
        match class {
            Class::Properties => Ok(V::Properties(dtype_of(f(Field::Dtype))?)),
            Class::Chunk => {
                let offsets = size_of(f(Field::Offsets))?;
                let sizes = size_of(f(Field::Sizes))?;
                let open = self.open.as_mut().or_stop()?;
                if offsets.len() != sizes.len() || open.ndim.is_some_and(|n| n != sizes.len()) {
                    return Err(GiveUp::Stop);
                }
                if open.ndim.is_none() {
                    open.chunks = Chunks::new(sizes.len());
                }
                open.ndim = Some(sizes.len());
                let n = open.count;
                open.count += 1;
                if open.keep && !open.chunks.push(offsets, sizes) {
                    return Err(GiveUp::Stop);
                }
                Ok(V::Chunk(u32::try_from(n).map_err(|_| GiveUp::Stop)?))
            }
            Class::Tensor => {
                let open = self.open.take().or_stop()?;
                let V::Properties(dtype) = f(Field::Properties).or_stop()? else {
                    return Err(GiveUp::Stop);
                };
                let shape = size_of(f(Field::Size))?.to_vec();
                let Some(V::List(list)) = f(Field::Chunks) else {
                    return Err(GiveUp::Stop);
                };
                // The list holds the chunks folded since the entry was made, in order.
                let in_order = list.len() == open.count
                    && list
                        .iter()
                        .zip(0u32..)
                        .all(|(c, n)| matches!(c, V::Chunk(x) if *x == n));
                if !in_order || open.ndim.is_some_and(|n| n != shape.len()) {
                    return Err(GiveUp::Stop);
                }
                let mut chunks = open.chunks;
                if open.ndim.is_none() {
                    chunks = Chunks::new(shape.len());
                }
                chunks.shrink();
                let rec = Rec {
                    fqn: open.fqn,
                    cursor: 0,
                    placed: false,
                    kind: Some(EntryKind::Tensor {
                        dtype: *dtype,
                        shape,
                        chunks,
                        dropped: !open.keep,
                    }),
                };
                Ok(V::Entry(self.add_rec(rec)?))
            }
            Class::Index => {
                let Some(V::Str(fqn)) = f(Field::Fqn) else {
                    return Err(GiveUp::Stop);
                };
                let at = match f(Field::Offset) {
                    None | Some(V::None) => At::Entry,
                    Some(V::Size(dims)) => At::Dims(dims.clone()),
                    _ => return Err(GiveUp::Stop),
                };
                Ok(V::Index(Box::new(Index { fqn: *fqn, at })))
            }
            Class::StorageInfo => {
                let Some(V::Str(file)) = f(Field::RelativePath) else {
                    return Err(GiveUp::Stop);
                };
                let offset = uint_of(f(Field::Offset))?;
                let length = uint_of(f(Field::Length))?;
                let transforms = match f(Field::TransformDescriptors) {
                    None | Some(V::None) => Vec::new(),
                    Some(V::List(items)) => strs(items, strings)?,
                    Some(V::Tuple(items)) => strs(items, strings)?,
                    _ => return Err(GiveUp::Stop),
                };
                let file = strings.get(*file as usize).or_stop()?;
                let item = self.b.item(file, offset, length, &transforms);
                Ok(V::Storage(Box::new(item)))
            }
            Class::Metadata => {
                if self.meta.is_some() || self.deferred.is_some() {
                    return Err(GiveUp::Stop);
                }
                self.meta = Some(*state);
                Ok(V::Obj(Class::Metadata))
            }
            _ => Err(GiveUp::Stop),
        }
    }

    /// One `key: value` pair set on a dict. Storage pairs are folded onto their
    /// chunk (`None`); entries are checked against their key.
    pub(super) fn pair(&mut self, k: V, v: V, strings: &[String]) -> R<Option<(V, V)>> {
        match (k, v) {
            (V::Index(index), V::Storage(item)) => {
                let dims = match &index.at {
                    At::Entry => None,
                    At::Dims(d) => Some(&d[..]),
                };
                self.storage(index.fqn, dims, *item, strings)?;
                Ok(None)
            }
            (V::Str(s), V::Entry(r)) => {
                let rec = self.recs.get_mut(r as usize).or_stop()?;
                if rec.fqn != s || rec.placed {
                    return Err(GiveUp::Stop);
                }
                rec.placed = true;
                Ok(Some((V::Str(s), V::Entry(r))))
            }
            (V::Str(s), V::Obj(Class::Bytes)) => {
                let r = self.add_rec(Rec {
                    fqn: s,
                    kind: Some(EntryKind::Bytes { item: None }),
                    cursor: 0,
                    placed: true,
                })?;
                Ok(Some((V::Str(s), V::Entry(r))))
            }
            (V::Index(_) | V::Storage(_) | V::Entry(_) | V::Obj(_), _)
            | (_, V::Index(_) | V::Storage(_) | V::Entry(_) | V::Obj(_)) => Err(GiveUp::Stop),
            (k, v) => Ok(Some((k, v))),
        }
    }

    /// A storage pair: `item` is where the chunk at offsets `dims` (`None`: the
    /// byte entry) of entry `fqn` is. A second half keeps it (in `strings`' numbers)
    /// for the first half.
    fn storage(&mut self, fqn: u32, dims: Option<&[u64]>, item: Item, strings: &[String]) -> R<()> {
        if let Some(d) = &mut self.deferred {
            let name = strings.get(fqn as usize).or_stop()?;
            if dims.is_some() && !self.keep.chunks_of(name) {
                if d.dropped.last() != Some(&fqn) {
                    d.dropped.push(fqn);
                }
                return Ok(());
            }
            let (at, n) = match dims {
                None => (u32::MAX, 0),
                Some(dims) => {
                    let end = d.dims.len() + dims.len();
                    let at = u32::try_from(d.dims.len()).map_err(|_| GiveUp::Stop)?;
                    if end >= u32::MAX as usize {
                        return Err(GiveUp::Stop);
                    }
                    d.dims.extend_from_slice(dims);
                    (at, dims.len() as u32)
                }
            };
            d.pairs.push((fqn, at, n, item));
            return Ok(());
        }
        self.apply(fqn, dims, item)
    }

    /// Puts `item` on the chunk at `dims` of entry `fqn` (or on the byte entry).
    fn apply(&mut self, fqn: u32, dims: Option<&[u64]>, item: Item) -> R<()> {
        let r = *self.by_fqn.get(&fqn).or_stop()?;
        let rec = self.recs.get_mut(r as usize).or_stop()?;
        match (dims, rec.kind.as_mut().or_stop()?) {
            (None, EntryKind::Bytes { item: slot }) => *slot = Some(item),
            (Some(_), EntryKind::Tensor { dropped: true, .. }) => {}
            (Some(d), EntryKind::Tensor { chunks, .. }) => {
                let i = chunks.find(d, rec.cursor).or_stop()?;
                chunks.list[i].item = Some(item);
                rec.cursor = i + 1;
            }
            _ => return Err(GiveUp::Stop),
        }
        Ok(())
    }

    /// The `Metadata` object the pickle returned, as the compact tables.
    pub(super) fn finish(mut self, top: V, strings: &[String]) -> R<Metadata> {
        let (V::Obj(Class::Metadata), Some(state)) = (top, self.meta.take()) else {
            return Err(GiveUp::Stop);
        };
        if self.open.is_some() {
            return Err(GiveUp::Stop);
        }
        let f = |name: Field| field(&state, name);
        let Some(V::Dict(sdm)) = f(Field::StateDictMetadata) else {
            return Err(GiveUp::Stop);
        };
        match f(Field::StorageData) {
            Some(V::Dict(rest)) if rest.is_empty() => {}
            _ => return Err(GiveUp::Stop),
        }
        let mut paths: HashMap<u32, Vec<String>> = HashMap::new();
        match f(Field::PlannerData) {
            Some(V::Dict(planner)) => {
                for (k, v) in planner.iter() {
                    let V::Str(k) = k else { continue };
                    let parts: &[V] = match v {
                        V::Tuple(p) => p,
                        V::List(p) => p,
                        _ => {
                            paths.remove(k);
                            continue;
                        }
                    };
                    let path = parts
                        .iter()
                        .map(|x| match x {
                            V::Str(s) => strings.get(*s as usize).cloned(),
                            V::Int(i) => Some(i.to_string()),
                            _ => None,
                        })
                        .collect::<Option<Vec<String>>>();
                    match path {
                        Some(p) if !p.is_empty() => paths.insert(*k, p),
                        _ => paths.remove(k),
                    };
                }
            }
            None | Some(V::None) => {}
            _ => return Err(GiveUp::Stop),
        }
        if sdm.len() != self.recs.len() {
            return Err(GiveUp::Stop);
        }
        let mut entries = Vec::with_capacity(sdm.len());
        for (k, v) in sdm.iter() {
            let (V::Str(s), V::Entry(r)) = (k, v) else {
                return Err(GiveUp::Stop);
            };
            let kind = self
                .recs
                .get_mut(*r as usize)
                .and_then(|rec| rec.kind.take())
                .or_stop()?;
            let fqn = strings.get(*s as usize).or_stop()?.clone();
            let path = paths.remove(s).unwrap_or_else(|| vec![fqn.clone()]);
            entries.push(Entry { fqn, path, kind });
        }
        let mut md = self.b.md;
        md.entries = entries;
        Ok(md)
    }
}

fn strs(items: &[V], strings: &[String]) -> R<Vec<String>> {
    items
        .iter()
        .map(|x| match x {
            V::Str(s) => strings.get(*s as usize).cloned(),
            _ => None,
        })
        .collect::<Option<Vec<String>>>()
        .or_stop()
}
