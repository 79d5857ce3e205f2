//! `torch.save` files: the zip container and the meaning of its pickle.
//!
//! The pickle is parsed inertly by `unshard-pickle`; this module interprets the few
//! calls that describe tensors (`torch._utils._rebuild_tensor_v2` and friends,
//! formats.md §1.4) and resolves their storages to byte ranges of the file. Nothing
//! else in the pickle is ever called: an `os.system` reduce stays an opaque object
//! that `inspect` lists and `merge` ignores.
//!
//! The same code reads the archives embedded in DCP `.distcp` files (an archive is a
//! byte range of a file) and the storages of legacy (pre-zip) files, which
//! `legacy.rs` locates and hands over as a storage table.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use unshard_pickle::{NodeId, Pickle, Value};

use super::zip::ZipIndex;
use super::{check_view, Blob, Extra, FileId, Piece, StorageId, TensorSource};
use crate::{DType, Error, Result};

/// How deep value walks may go before the structure is called hostile. Real state
/// dicts are 2-4 levels deep; a cycle or a bomb hits this quickly.
const MAX_DEPTH: usize = 64;

/// Where a storage's bytes are, in the file holding them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StorageLoc {
    pub offset: u64,
    pub len: u64,
    /// The record was deflated: `offset` is into [`TorchPayload::inflated`].
    pub inflated: bool,
}

/// Most bytes of deflated storage records inflated into memory for one archive.
/// torch writes stored records; deflated ones come from archives repacked by a zip
/// tool, and are read (torch reads them) as long as they fit.
const MAX_INFLATED_STORAGES: u64 = 2 << 30;
/// Most bytes a deflated pickle or byte-order record may inflate to.
const MAX_INFLATED_RECORD: u64 = 1 << 30;

/// A parsed `torch.save` payload: the pickle and where its storages are.
#[derive(Debug)]
pub struct TorchPayload {
    pub path: PathBuf,
    pub pickle: Pickle,
    pub storages: HashMap<String, StorageLoc>,
    pub big_endian: bool,
    /// What the file's pickles would run under `torch.load` (never run here).
    pub unsafe_calls: Vec<crate::scan::UnsafeCall>,
    /// The deflated storage records, inflated back to back (empty if none).
    pub inflated: Vec<u8>,
    /// The file id under which the caller holds `inflated` as a blob; storages in it
    /// cannot be read until it is set.
    pub inflated_file: Option<FileId>,
}

/// A tensor as torch rebuilds it: a strided view of a storage.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorRef {
    pub key: String,
    pub dtype: DType,
    /// Offset of the view into the storage, in elements.
    pub offset: u64,
    pub shape: Vec<u64>,
    pub strides: Vec<u64>,
}

/// A tensor subclass pickled without data (`_rebuild_wrapper_subclass`): DTensor,
/// ShardedTensor. `state` holds its parts; `sharded.rs` interprets them.
#[derive(Clone, Debug)]
pub struct SubclassRef {
    pub module: String,
    pub class: String,
    pub dtype: Option<DType>,
    pub shape: Vec<u64>,
    pub state: Option<NodeId>,
}

/// A value that is a tensor of some kind.
#[derive(Clone, Debug)]
pub enum Leaf {
    Tensor(TensorRef),
    Subclass(SubclassRef),
}

/// Reads a zip archive occupying `data` (a whole `.pt` file, or a DCP chunk at
/// `base` bytes into its file) and parses its pickle.
pub fn read_zip_payload(path: &Path, data: &[u8], base: u64) -> Result<TorchPayload> {
    let index = ZipIndex::parse(data).map_err(|e| Error::corrupt(path, e.0))?;
    payload_from_index(path, data, base, index)
}

/// Reads a `.pt` file that is a zip archive, reading the per-entry local headers with
/// positioned reads rather than through the map, so that the resident set does not
/// grow with the number of tensors (see [`ZipIndex::parse_with`]).
pub fn read_zip_file(path: &Path, blob: &Blob) -> Result<TorchPayload> {
    let data = blob.bytes();
    let read_local = |at: u64, buf: &mut [u8]| {
        blob.read_at(at, buf)
            .map_err(|e| super::zip::ZipError(e.to_string()))
    };
    let index = ZipIndex::parse_with(data, &read_local).map_err(|e| Error::corrupt(path, e.0))?;
    payload_from_index(path, data, 0, index)
}

fn payload_from_index(
    path: &Path,
    data: &[u8],
    base: u64,
    index: ZipIndex,
) -> Result<TorchPayload> {
    let Some(first) = index.entries.first() else {
        return Err(Error::corrupt(path, "the zip archive has no entries"));
    };
    let prefix = match first.name.split_once('/') {
        Some((p, _)) => p.to_string(),
        None => {
            return Err(Error::UnknownFormat {
                path: path.to_path_buf(),
                found: format!("a zip archive whose first entry '{}' is not in a folder, so not written by torch.save", first.name),
            })
        }
    };
    // Two records of one name: torch reads the first, other zip readers the last, so
    // the file does not say which tensor (or which pickle) it holds.
    let mut names = std::collections::HashSet::new();
    if let Some(dup) = index
        .entries
        .iter()
        .find(|e| !names.insert(e.name.as_str()))
    {
        return Err(Error::corrupt(
            path,
            format!(
                "the archive holds two records named '{}': torch reads one, other zip readers the other, so it is ambiguous which it holds; re-save the file with torch.save",
                dup.name
            ),
        ));
    }
    let has = |name: &str| index.find(&format!("{prefix}/{name}")).is_some();
    if has("constants.pkl")
        || index
            .entries
            .iter()
            .any(|e| e.name.starts_with(&format!("{prefix}/code/")))
    {
        return Err(Error::Unsupported {
            path: path.to_path_buf(),
            what: "a TorchScript archive (torch.jit.save)".into(),
            hint: Some("TorchScript programs carry code, not a state dict; in Python, save `model.state_dict()` with torch.save instead".into()),
        });
    }
    let pkl_name = format!("{prefix}/data.pkl");
    let Some(pkl) = index.find(&pkl_name) else {
        return Err(Error::UnknownFormat {
            path: path.to_path_buf(),
            found: format!("a zip archive without {pkl_name}"),
        });
    };
    let pkl_bytes = record(data, pkl).map_err(|e| Error::corrupt(path, e.0))?;
    let big_endian = match index.find(&format!("{prefix}/byteorder")) {
        None => false,
        Some(e) => {
            let b = record(data, e).map_err(|e| Error::corrupt(path, e.0))?;
            match &b[..] {
                b"little" => false,
                b"big" => true,
                other => {
                    return Err(Error::corrupt(
                        path,
                        format!(
                            "unknown byteorder record '{}'",
                            String::from_utf8_lossy(other)
                        ),
                    ))
                }
            }
        }
    };
    let pickle = unshard_pickle::parse(&pkl_bytes).map_err(|source| Error::Pickle {
        path: path.to_path_buf(),
        entry: pkl_name.clone(),
        source,
    })?;
    let data_prefix = format!("{prefix}/data/");
    let mut storages = HashMap::new();
    let mut inflated = Vec::new();
    for e in &index.entries {
        if let Some(key) = e.name.strip_prefix(&data_prefix) {
            let loc = if e.method == super::zip::METHOD_STORED {
                StorageLoc {
                    offset: base + e.data_offset,
                    len: e.size,
                    inflated: false,
                }
            } else {
                let total = (inflated.len() as u64).saturating_add(e.size);
                if total > MAX_INFLATED_STORAGES {
                    return Err(Error::corrupt(path, format!("the archive's compressed storage records hold more than {MAX_INFLATED_STORAGES} bytes, which unshard will not hold in memory; unzip and re-zip it without compression (zip -0), or re-save it with torch.save")));
                }
                let bytes = super::zip::inflate(data, e, MAX_INFLATED_STORAGES)
                    .map_err(|err| Error::corrupt(path, err.0))?;
                let loc = StorageLoc {
                    offset: inflated.len() as u64,
                    len: e.size,
                    inflated: true,
                };
                inflated.extend_from_slice(&bytes);
                loc
            };
            storages.insert(key.to_string(), loc);
        }
    }
    check_storage_sizes(&pickle, &storages).map_err(|m| Error::corrupt(path, m))?;
    // An archive inside a larger file (a DCP chunk) is named by where it starts.
    let entry = if base > 0 {
        format!("{pkl_name} of the archive at byte {base}")
    } else {
        pkl_name.clone()
    };
    let (unsafe_calls, _) = crate::scan::audit_pickle(path, &entry, &pickle);
    Ok(TorchPayload {
        path: path.to_path_buf(),
        pickle,
        storages,
        big_endian,
        unsafe_calls,
        inflated,
        inflated_file: None,
    })
}

/// A record's bytes: borrowed when stored, inflated when deflated (torch reads both).
fn record<'a>(
    data: &'a [u8],
    e: &super::zip::ZipEntry,
) -> std::result::Result<std::borrow::Cow<'a, [u8]>, super::zip::ZipError> {
    if e.method == super::zip::METHOD_DEFLATED {
        return super::zip::inflate(data, e, MAX_INFLATED_RECORD).map(std::borrow::Cow::Owned);
    }
    ZipIndex::default()
        .stored_bytes(data, e)
        .map(std::borrow::Cow::Borrowed)
}

/// Each storage's declared element count (in its persistent id) against the size of
/// its record: torch refuses a file where they differ, and a reader that trusted
/// either would read something else than torch.
fn check_storage_sizes(
    p: &Pickle,
    storages: &HashMap<String, StorageLoc>,
) -> std::result::Result<(), String> {
    for id in p.ids() {
        let Value::PersistentId(pid) = p.get(id) else {
            continue;
        };
        let Some(t) = seq_of(p, *pid) else { continue };
        if t.len() < 5 || str_of(p, t[0]) != Some("storage") {
            continue;
        }
        let key = match p.get(t[2]) {
            Value::Str(s) => s.clone(),
            Value::Int(i) => i.to_string(),
            _ => continue,
        };
        let class = global_of(p, t[1]).map(|g| g.1).unwrap_or("?");
        let size = if class == "UntypedStorage" {
            Some(1)
        } else {
            DType::from_storage_class(class).map(|d| d.size() as u64)
        };
        let (Some(size), Some(numel), Some(loc)) = (
            size,
            int_of(p, t[4]).and_then(|n| u64::try_from(n).ok()),
            storages.get(&key),
        ) else {
            continue;
        };
        if numel.checked_mul(size) != Some(loc.len) {
            return Err(format!(
                "storage '{key}' declares {numel} elements of {class} ({} bytes) but its record holds {} bytes; torch refuses this file too",
                numel.saturating_mul(size),
                loc.len
            ));
        }
    }
    Ok(())
}

/// Accessors over pickle values that fail softly.
pub(crate) fn str_of(p: &Pickle, id: NodeId) -> Option<&str> {
    match p.get(id) {
        Value::Str(s) => Some(s),
        _ => None,
    }
}

pub(crate) fn int_of(p: &Pickle, id: NodeId) -> Option<i64> {
    match p.get(id) {
        Value::Int(i) => Some(*i),
        Value::Bool(b) => Some(*b as i64),
        _ => None,
    }
}

pub(crate) fn seq_of(p: &Pickle, id: NodeId) -> Option<&[NodeId]> {
    match p.get(id) {
        Value::Tuple(v) | Value::List(v) => Some(v),
        _ => None,
    }
}

pub(crate) fn global_of(p: &Pickle, id: NodeId) -> Option<(&str, &str)> {
    match p.get(id) {
        Value::Global(g) => Some((&g.module, &g.name)),
        _ => None,
    }
}

/// The dict items of a dict node.
pub(crate) fn dict_of(p: &Pickle, id: NodeId) -> Option<&[(NodeId, NodeId)]> {
    match p.get(id) {
        Value::Dict(items) => Some(items),
        _ => None,
    }
}

/// Looks up a string key in a dict node.
pub(crate) fn dict_get(p: &Pickle, id: NodeId, key: &str) -> Option<NodeId> {
    dict_of(p, id)?
        .iter()
        .rev()
        .find(|(k, _)| str_of(p, *k) == Some(key))
        .map(|(_, v)| *v)
}

/// An applied object: `(callable global, args, BUILD state)`.
pub(crate) type Call<'a> = ((&'a str, &'a str), &'a [NodeId], Option<NodeId>);

pub(crate) fn call_of(p: &Pickle, id: NodeId) -> Option<Call<'_>> {
    match p.get(id) {
        Value::Object {
            callable,
            args,
            state,
            ..
        } => Some((
            global_of(p, *callable)?,
            seq_of(p, *args).unwrap_or(&[]),
            *state,
        )),
        _ => None,
    }
}

/// A tuple of non-negative ints (a shape or strides); `torch.Size(t)` is unwrapped.
pub(crate) fn dims_of(p: &Pickle, id: NodeId) -> Option<Vec<u64>> {
    let id = match call_of(p, id) {
        Some((("torch", "Size"), args, _)) => *args.first()?,
        _ => id,
    };
    seq_of(p, id)?
        .iter()
        .map(|&d| int_of(p, d).and_then(|i| u64::try_from(i).ok()))
        .collect()
}

/// A dtype token: `GLOBAL 'torch float32'`.
pub(crate) fn dtype_of(p: &Pickle, id: NodeId) -> Option<DType> {
    match global_of(p, id)? {
        ("torch", name) => DType::from_torch_name(name),
        _ => None,
    }
}

/// The class an object was made from (`NEWOBJ`/`REDUCE` on a global).
pub(crate) fn class_of(p: &Pickle, id: NodeId) -> Option<(&str, &str)> {
    call_of(p, id).map(|(class, _, _)| class)
}

/// A field of an object's `BUILD` state. Dataclasses and plain classes build from
/// their `__dict__`; classes with `__slots__` build from `(dict or None, {slots})`.
pub(crate) fn field_of(p: &Pickle, id: NodeId, name: &str) -> Option<NodeId> {
    let Value::Object { state: Some(s), .. } = p.get(id) else {
        return None;
    };
    match p.get(*s) {
        Value::Dict(_) => dict_get(p, *s, name),
        Value::Tuple(parts) => parts.iter().rev().find_map(|&d| dict_get(p, d, name)),
        _ => None,
    }
}

/// A short human description of a value, for `inspect`.
pub fn describe(p: &Pickle, id: NodeId) -> String {
    match p.get(id) {
        Value::None => "None".into(),
        Value::Bool(b) => format!("bool {}", if *b { "True" } else { "False" }),
        Value::Int(i) => format!("int {i}"),
        Value::BigInt(_) => "int (large)".into(),
        Value::Float(f) => format!("float {f}"),
        Value::Str(s) if s.chars().count() > 40 => {
            format!("str '{}…'", s.chars().take(40).collect::<String>())
        }
        Value::Str(s) => format!("str '{s}'"),
        Value::Bytes(b) => format!("bytes ({} bytes)", b.len()),
        Value::Tuple(v) => format!("tuple ({} items)", v.len()),
        Value::List(v) => format!("list ({} items)", v.len()),
        Value::Dict(v) => format!("dict ({} items)", v.len()),
        Value::Set(v) | Value::FrozenSet(v) => format!("set ({} items)", v.len()),
        Value::Global(g) => format!("class {}.{}", g.module, g.name),
        Value::Object { callable, .. } => match global_of(p, *callable) {
            Some((m, n)) => format!("object {m}.{n} (not executed)"),
            // A callable made by calls: `functools.partial(posix.system)`.
            None => format!(
                "object {}(...) (not executed)",
                unshard_pickle::audit::chain(p, *callable)
            ),
        },
        Value::PersistentId(_) => "persistent id".into(),
    }
}

const REBUILD_TENSOR: &[&str] = &[
    "_rebuild_tensor",
    "_rebuild_tensor_v2",
    "_rebuild_tensor_v3",
];

/// Whether a node looks like a tensor (without validating it).
pub fn is_tensor_like(p: &Pickle, id: NodeId) -> bool {
    match call_of(p, id) {
        Some(((m, n), _, _)) => {
            (m == "torch._utils" && n.starts_with("_rebuild_"))
                || (m == "torch._tensor" && n == "_rebuild_from_type_v2")
                || (m == "torch.nn.parameter" && n == "Parameter")
        }
        None => false,
    }
}

/// Interprets a tensor-like node. `Ok(None)` = not a tensor; `Err(msg)` = a tensor
/// unshard cannot represent (the caller adds the file and key).
pub fn leaf(p: &Pickle, id: NodeId) -> std::result::Result<Option<Leaf>, String> {
    leaf_at(p, id, 0)
}

fn leaf_at(p: &Pickle, id: NodeId, depth: usize) -> std::result::Result<Option<Leaf>, String> {
    if depth > 8 {
        return Err("tensor rebuild calls nest too deeply".into());
    }
    let Some(((module, name), args, state)) = call_of(p, id) else {
        return Ok(None);
    };
    apply(p, (module, name), args, state, depth)
}

fn apply(
    p: &Pickle,
    (module, name): (&str, &str),
    args: &[NodeId],
    state: Option<NodeId>,
    depth: usize,
) -> std::result::Result<Option<Leaf>, String> {
    let arg = |i: usize| -> std::result::Result<NodeId, String> {
        args.get(i)
            .copied()
            .ok_or_else(|| format!("{module}.{name} called with {} argument(s)", args.len()))
    };
    match (module, name) {
        ("torch._utils", n) if REBUILD_TENSOR.contains(&n) => {
            rebuild_tensor(p, n, args).map(|t| Some(Leaf::Tensor(t)))
        }
        (
            "torch._utils",
            "_rebuild_parameter"
            | "_rebuild_parameter_with_state"
            | "_rebuild_device_tensor_from_cpu_tensor",
        )
        | ("torch.nn.parameter", "Parameter") => {
            let inner = arg(0)?;
            match leaf_at(p, inner, depth + 1)? {
                Some(l) => Ok(Some(l)),
                None => Err(format!("{module}.{name} does not wrap a tensor")),
            }
        }
        ("torch._tensor", "_rebuild_from_type_v2") => {
            let func = arg(0)?;
            let new_type = arg(1)?;
            let fargs =
                seq_of(p, arg(2)?).ok_or("_rebuild_from_type_v2 arguments are not a tuple")?;
            let fstate = args.get(3).copied().or(state);
            let f = global_of(p, func).ok_or("_rebuild_from_type_v2 of a non-global function")?;
            if f == ("torch._utils", "_rebuild_wrapper_subclass") {
                let (m, c) = global_of(p, new_type).unwrap_or(("?", "?"));
                let dtype = fargs.get(1).and_then(|&d| dtype_of(p, d));
                let shape = fargs
                    .get(2)
                    .and_then(|&s| dims_of(p, s))
                    .unwrap_or_default();
                return Ok(Some(Leaf::Subclass(SubclassRef {
                    module: m.to_string(),
                    class: c.to_string(),
                    dtype,
                    shape,
                    state: fstate,
                })));
            }
            apply(p, f, fargs, None, depth + 1)
        }
        ("torch._utils", "_rebuild_qtensor") => Err(
            "quantized tensors are not supported; dequantize before saving (tensor.dequantize())"
                .into(),
        ),
        ("torch._utils", n) if n.starts_with("_rebuild_sparse") => {
            Err("sparse tensors are not supported; save tensor.to_dense()".into())
        }
        ("torch._utils", "_rebuild_nested_tensor") => {
            Err("nested tensors are not supported".into())
        }
        ("torch._utils", "_rebuild_meta_tensor_no_storage") => {
            Err("a meta tensor has no data (it was saved from a model on the meta device)".into())
        }
        ("torch._utils", n) => Err(format!("unsupported tensor kind torch._utils.{n}")),
        _ => Ok(None),
    }
}

fn rebuild_tensor(
    p: &Pickle,
    which: &str,
    args: &[NodeId],
) -> std::result::Result<TensorRef, String> {
    let need = match which {
        "_rebuild_tensor" => 4,
        "_rebuild_tensor_v2" => 6,
        _ => 7,
    };
    if args.len() < need {
        return Err(format!(
            "{which} called with {} arguments, expected {need}",
            args.len()
        ));
    }
    let Value::PersistentId(pid) = p.get(args[0]) else {
        return Err(format!("{which}: the storage is not a persistent id"));
    };
    let pid = seq_of(p, *pid).ok_or("the storage persistent id is not a tuple")?;
    if pid.len() < 5 || str_of(p, pid[0]) != Some("storage") {
        return Err("the persistent id is not a ('storage', ...) tuple".into());
    }
    let (_, storage_class) = global_of(p, pid[1]).ok_or("the storage type is not a class")?;
    let key = match p.get(pid[2]) {
        Value::Str(s) => s.clone(),
        Value::Int(i) => i.to_string(),
        _ => return Err("the storage key is not a string".into()),
    };
    let dtype = if storage_class == "UntypedStorage" {
        if which != "_rebuild_tensor_v3" {
            return Err("an untyped storage without a dtype".into());
        }
        let d = args[6];
        dtype_of(p, d).ok_or_else(|| match global_of(p, d) {
            Some((m, n)) => format!("unsupported dtype {m}.{n}"),
            None => "the dtype argument is not a dtype".into(),
        })?
    } else {
        DType::from_storage_class(storage_class).ok_or_else(|| {
            if storage_class.starts_with("Complex") {
                "complex tensors are not supported (no Hugging Face model stores complex weights); save the real and imaginary parts as separate tensors".to_string()
            } else if storage_class.starts_with("Q") {
                format!(
                    "quantized storage {storage_class} is not supported; dequantize before saving"
                )
            } else {
                format!("unsupported storage type {storage_class}")
            }
        })?
    };
    let mut offset = int_of(p, args[1])
        .and_then(|i| u64::try_from(i).ok())
        .ok_or("the storage offset is not a non-negative int")?;
    // Very old legacy files: ('storage', T, root_key, loc, numel, (view_key, offset, size)).
    if let Some(&view) = pid.get(5) {
        if let Some(v) = seq_of(p, view) {
            let extra = v
                .get(1)
                .and_then(|&o| int_of(p, o))
                .and_then(|o| u64::try_from(o).ok());
            offset = offset
                .checked_add(extra.ok_or("bad legacy view metadata")?)
                .ok_or("storage offset overflows")?;
        }
    }
    let shape = dims_of(p, args[2]).ok_or("the size is not a tuple of non-negative ints")?;
    let strides = dims_of(p, args[3]).ok_or("the stride is not a tuple of non-negative ints")?;
    if shape.len() != strides.len() {
        return Err(format!(
            "size {shape:?} and stride {strides:?} differ in length"
        ));
    }
    let meta = match which {
        "_rebuild_tensor_v2" => args.get(6),
        "_rebuild_tensor_v3" => args.get(7),
        _ => None,
    };
    if let Some(&m) = meta {
        if let Some(items) = dict_of(p, m) {
            for (k, v) in items {
                let on = matches!(p.get(*v), Value::Bool(true));
                if on {
                    let k = str_of(p, *k).unwrap_or("?");
                    return Err(format!("the tensor has the lazy '{k}' bit set; save tensor.resolve_conj().resolve_neg() instead"));
                }
            }
        }
    }
    Ok(TensorRef {
        key,
        dtype,
        offset,
        shape,
        strides,
    })
}

impl TorchPayload {
    /// Turns a plain tensor into a one-piece [`TensorSource`] after checking that the
    /// view fits in its storage record.
    pub fn source(&self, file: FileId, name: &str, t: &TensorRef) -> Result<TensorSource> {
        let piece = self.piece(file, name, t, vec![0; t.shape.len()])?;
        Ok(TensorSource {
            name: name.to_string(),
            dtype: t.dtype,
            shape: t.shape.clone(),
            pieces: vec![piece],
            storage: Some(StorageId {
                file,
                key: t.key.clone(),
            }),
            layout: None,
        })
    }

    /// The piece a tensor view occupies, placed at `global_offset`.
    pub fn piece(
        &self,
        file: FileId,
        name: &str,
        t: &TensorRef,
        global_offset: Vec<u64>,
    ) -> Result<Piece> {
        let loc = self.storages.get(&t.key).ok_or_else(|| {
            Error::bad_tensor(
                &self.path,
                name,
                format!("its storage '{}' is missing from the file", t.key),
            )
        })?;
        let elem = t.dtype.size() as u64;
        check_view(&t.shape, &t.strides, elem, t.offset, loc.len)
            .map_err(|m| Error::bad_tensor(&self.path, name, m))?;
        let file = match (loc.inflated, self.inflated_file) {
            (false, _) => file,
            (true, Some(inflated)) => inflated,
            (true, None) => {
                return Err(Error::bad_tensor(
                    &self.path,
                    name,
                    format!("its storage record '{}' is compressed, which is read in single torch.save files only; unzip and re-zip the archive without compression (zip -0)", t.key),
                ))
            }
        };
        Ok(Piece {
            file,
            byte_offset: loc.offset + t.offset * elem,
            dtype: t.dtype,
            shape: t.shape.clone(),
            strides: t.strides.clone(),
            global_offset,
            big_endian: self.big_endian,
        })
    }
}

/// Where the tensors are inside a payload.
#[derive(Debug)]
pub struct Found {
    /// Dotted path of the tensor dict (`None` = the top level).
    pub key: Option<String>,
    /// `(name, node)` of every tensor-like entry, in file order.
    pub tensors: Vec<(String, NodeId)>,
    /// Non-tensor entries of the dict and of the wrappers around it.
    pub extras: Vec<Extra>,
}

/// How `inspect` describes one rank's local shard of a distributed tensor read from
/// a single file; merging such a file alone is refused.
pub const LOCAL_SHARD: &str = "local shard of global shape";

/// Keys under which trainers nest the state dict, in the order they are tried.
pub const WRAPPER_KEYS: &[&str] = &["state", "state_dict", "model", "module", "model_state_dict"];

/// Finds the tensor dict: at `key` when given, else at the top level, else under the
/// usual wrapper keys, else the only nested dict that holds tensors.
pub fn find_tensors(p: &Pickle, path: &Path, key: Option<&str>) -> Result<Found> {
    let root = p.root();
    let mut extras = Vec::new();
    let (dict, at) = match key {
        Some(k) if !k.is_empty() => (
            navigate(p, path, root, k, &mut extras)?,
            Some(k.to_string()),
        ),
        _ => match auto_find(p, root, "", 0, &mut extras, &mut Search::default())? {
            Some((d, k)) => (d, k),
            None => {
                let mut candidates = Vec::new();
                any_tensor_dicts(p, root, "", 0, &mut candidates, &mut Search::default());
                return Err(match candidates.len() {
                    0 | 1 => Error::NoTensors {
                        path: path.to_path_buf(),
                        at: None,
                        hint: Some(format!(
                            "the file holds {}; it is not a state dict",
                            describe(p, root)
                        )),
                    },
                    _ => Error::AmbiguousTensors {
                        path: path.to_path_buf(),
                        candidates,
                    },
                });
            }
        },
    };
    let Some(items) = dict_of(p, dict) else {
        return Err(Error::NoTensors {
            path: path.to_path_buf(),
            at,
            hint: Some(format!(
                "that key holds {}, not a dict of tensors",
                describe(p, dict)
            )),
        });
    };
    let prefix = at.as_ref().map(|k| format!("{k}.")).unwrap_or_default();
    let mut tensors = Vec::new();
    for (k, v) in items {
        let name = match p.get(*k) {
            Value::Str(s) => s.clone(),
            Value::Int(i) => i.to_string(),
            _ => continue,
        };
        if is_tensor_like(p, *v) {
            tensors.push((name, *v));
        } else {
            extras.push(Extra {
                name: format!("{prefix}{name}"),
                kind: describe(p, *v),
            });
        }
    }
    if tensors.is_empty() {
        return Err(Error::NoTensors {
            path: path.to_path_buf(),
            at,
            hint: None,
        });
    }
    Ok(Found {
        key: at,
        tensors,
        extras,
    })
}

fn dict_has_tensors(p: &Pickle, id: NodeId) -> bool {
    dict_of(p, id).is_some_and(|items| items.iter().any(|(_, v)| is_tensor_like(p, *v)))
}

fn join(prefix: &str, key: &str) -> String {
    if prefix.is_empty() {
        key.to_string()
    } else {
        format!("{prefix}.{key}")
    }
}

/// Dict entries a search for the tensor dict may look at in all. Real checkpoints
/// hold a few thousand entries around their tensors; a hostile nest of shared dicts
/// stops here instead of running for days.
const SEARCH_BUDGET: usize = 4_000_000;

/// The state of one search for the tensor dict: the dict nodes already visited (a
/// node shared through the memo is looked at once, not once per path to it: 16 keys
/// pointing at the same next layer, 8 layers deep, would be 16^8 paths) and the work
/// left.
#[derive(Default)]
struct Search {
    visited: std::collections::HashSet<NodeId>,
    /// Whether a dict holds tensors, for dicts already looked at (a dict many
    /// entries point at is scanned once).
    holds_tensors: HashMap<NodeId, bool>,
    spent: usize,
}

impl Search {
    /// Marks a dict of `len` entries as visited; false if it was already, or if the
    /// budget is spent.
    fn visit(&mut self, id: NodeId, len: usize) -> bool {
        self.spent = self.spent.saturating_add(len);
        self.spent <= SEARCH_BUDGET && self.visited.insert(id)
    }

    /// [`dict_has_tensors`], scanned once per dict and charged to the budget.
    fn has_tensors(&mut self, p: &Pickle, id: NodeId) -> bool {
        if let Some(&known) = self.holds_tensors.get(&id) {
            return known;
        }
        self.spent = self
            .spent
            .saturating_add(dict_of(p, id).map_or(0, <[_]>::len));
        let known = self.spent <= SEARCH_BUDGET && dict_has_tensors(p, id);
        self.holds_tensors.insert(id, known);
        known
    }
}

/// Top level, then wrapper keys (recursively), then a unique nested tensor dict.
fn auto_find(
    p: &Pickle,
    id: NodeId,
    at: &str,
    depth: usize,
    extras: &mut Vec<Extra>,
    search: &mut Search,
) -> Result<Option<(NodeId, Option<String>)>> {
    if depth > 6 || !search.visit(id, dict_of(p, id).map_or(0, <[_]>::len)) {
        return Ok(None);
    }
    if search.has_tensors(p, id) {
        return Ok(Some((id, (!at.is_empty()).then(|| at.to_string()))));
    }
    let Some(items) = dict_of(p, id) else {
        return Ok(None);
    };
    for wk in WRAPPER_KEYS {
        if let Some(child) = dict_get(p, id, wk) {
            let mut inner = Vec::new();
            if let Some(found) = auto_find(p, child, &join(at, wk), depth + 1, &mut inner, search)?
            {
                push_siblings(p, items, wk, at, extras);
                extras.extend(inner);
                return Ok(Some(found));
            }
        }
    }
    let mut candidates = Vec::new();
    // A search of its own: dicts the wrapper-key walk visited may hold tensors.
    let mut nested = Search {
        spent: search.spent,
        ..Search::default()
    };
    any_tensor_dicts(p, id, at, depth, &mut candidates, &mut nested);
    search.spent = nested.spent;
    if candidates.len() == 1 {
        let key = candidates.remove(0);
        let mut node = id;
        let rel = key
            .strip_prefix(&format!("{at}."))
            .unwrap_or(&key)
            .to_string();
        for part in rel.split('.') {
            match dict_get(p, node, part) {
                Some(n) => node = n,
                None => return Ok(None),
            }
        }
        let first = rel.split('.').next().unwrap_or("");
        push_siblings(p, items, first, at, extras);
        return Ok(Some((node, Some(key))));
    }
    Ok(None)
}

fn push_siblings(
    p: &Pickle,
    items: &[(NodeId, NodeId)],
    taken: &str,
    at: &str,
    extras: &mut Vec<Extra>,
) {
    for (k, v) in items {
        if let Some(name) = str_of(p, *k) {
            if name != taken {
                extras.push(Extra {
                    name: join(at, name),
                    kind: describe(p, *v),
                });
            }
        }
    }
}

/// Dotted paths of every nested dict holding tensors directly (each dict node once,
/// under the first path that reaches it).
fn any_tensor_dicts(
    p: &Pickle,
    id: NodeId,
    at: &str,
    depth: usize,
    out: &mut Vec<String>,
    search: &mut Search,
) {
    if depth > 6 || out.len() > 16 {
        return;
    }
    let Some(items) = dict_of(p, id) else { return };
    if !search.visit(id, items.len()) {
        return;
    }
    for (k, v) in items {
        let Some(name) = str_of(p, *k) else { continue };
        let path = join(at, name);
        if search.has_tensors(p, *v) {
            out.push(path);
        } else {
            any_tensor_dicts(p, *v, &path, depth + 1, out, search);
        }
    }
}

/// Follows a dotted `--key` path. A key that itself contains dots is tried whole first.
fn navigate(
    p: &Pickle,
    path: &Path,
    root: NodeId,
    key: &str,
    extras: &mut Vec<Extra>,
) -> Result<NodeId> {
    let mut node = root;
    let mut rest = key;
    let mut at = String::new();
    let mut depth = 0;
    while !rest.is_empty() {
        depth += 1;
        if depth > MAX_DEPTH {
            break;
        }
        let items = dict_of(p, node).ok_or_else(|| Error::KeyNotFound {
            path: path.to_path_buf(),
            key: key.to_string(),
            available: vec![],
        })?;
        let (part, tail) = if dict_get(p, node, rest).is_some() {
            (rest, "")
        } else {
            rest.split_once('.').unwrap_or((rest, ""))
        };
        let Some(next) = dict_get(p, node, part) else {
            return Err(Error::KeyNotFound {
                path: path.to_path_buf(),
                key: key.to_string(),
                available: items
                    .iter()
                    .filter_map(|(k, _)| str_of(p, *k).map(str::to_string))
                    .collect(),
            });
        };
        push_siblings(p, items, part, &at, extras);
        at = join(&at, part);
        node = next;
        rest = tail;
    }
    Ok(node)
}

/// Reads the tensors of a payload found by [`find_tensors`] as plain tensors.
/// Subclass tensors (DTensor, ShardedTensor) in a single file are described by their
/// local data and flagged: merging them needs every rank (see `sharded.rs`).
pub fn plain_sources(
    payload: &TorchPayload,
    file: FileId,
    found: &Found,
) -> Result<Vec<TensorSource>> {
    let p = &payload.pickle;
    let mut out = Vec::with_capacity(found.tensors.len());
    for (name, id) in &found.tensors {
        match leaf(p, *id).map_err(|m| Error::bad_tensor(&payload.path, name, m))? {
            Some(Leaf::Tensor(t)) => out.push(payload.source(file, name, &t)?),
            Some(Leaf::Subclass(s)) => {
                let local = subclass_local(p, &s);
                match local {
                    Some(t) => {
                        let mut src = payload.source(file, name, &t)?;
                        src.layout = Some(format!("{} {LOCAL_SHARD} {:?}", s.class, s.shape));
                        out.push(src);
                    }
                    None => {
                        return Err(Error::bad_tensor(
                            &payload.path,
                            name,
                            format!("a {}.{} without readable local data", s.module, s.class),
                        ))
                    }
                }
            }
            None => {}
        }
    }
    Ok(out)
}

/// The local tensor of a DTensor (`_local_tensor` in its slots state).
pub fn subclass_local(p: &Pickle, s: &SubclassRef) -> Option<TensorRef> {
    let state = s.state?;
    let dicts: Vec<NodeId> = match p.get(state) {
        Value::Tuple(parts) => parts.clone(),
        Value::Dict(_) => vec![state],
        _ => vec![],
    };
    for d in dicts {
        if let Some(local) = dict_get(p, d, "_local_tensor") {
            if let Ok(Some(Leaf::Tensor(t))) = leaf(p, local) {
                return Some(t);
            }
        }
    }
    None
}

/// Every `('storage', type, key, ...)` persistent id in the pickle, with its dtype
/// and element count (legacy files need them to walk their storage records).
pub fn storage_table(p: &Pickle) -> std::result::Result<Vec<(String, DType, u64)>, String> {
    let mut out: Vec<(String, DType, u64)> = Vec::new();
    let mut seen = std::collections::HashSet::new();
    for i in 0..p.len() {
        let Value::PersistentId(pid) = p.get(NodeId(i as u32)) else {
            continue;
        };
        let Some(t) = seq_of(p, *pid) else { continue };
        if t.len() < 5 || str_of(p, t[0]) != Some("storage") {
            if t.first().and_then(|&x| str_of(p, x)) == Some("module") {
                return Err("the file pickles a whole nn.Module (with its source code), not a state dict; in Python, load it and save model.state_dict()".into());
            }
            continue;
        }
        let key = match p.get(t[2]) {
            Value::Str(s) => s.clone(),
            Value::Int(i) => i.to_string(),
            _ => return Err("a storage key is not a string".into()),
        };
        let class = global_of(p, t[1]).map(|g| g.1).unwrap_or("?");
        // An untyped storage counts bytes; the tensor's dtype comes from its rebuild call.
        let dtype = if class == "UntypedStorage" {
            DType::U8
        } else {
            DType::from_storage_class(class)
                .ok_or_else(|| format!("unsupported storage type {class}"))?
        };
        let numel = int_of(p, t[4])
            .and_then(|n| u64::try_from(n).ok())
            .ok_or("a storage size is not a non-negative int")?;
        if seen.insert(key.clone()) {
            out.push((key, dtype, numel));
        }
    }
    Ok(out)
}
