//! `torch.save` files: the zip container and the meaning of its pickle.
//!
//! The pickle is parsed inertly by `unshard-pickle`; this module interprets the few
//! calls that describe tensors (`torch._utils._rebuild_tensor_v2` and friends, see
//! docs/formats.md) and resolves their storages to byte ranges of the file. Nothing
//! else in the pickle is ever called: an `os.system` reduce stays an opaque object
//! that `inspect` lists and `merge` ignores.
//!
//! The same code reads the archives embedded in DCP `.distcp` files (an archive is a
//! byte range of a file) and the storages of legacy (pre-zip) files, which
//! `legacy.rs` locates and hands over as a storage table. By job:
//! - this file: reading the archive into a [`TorchPayload`] (pickle + storage table)
//!   and turning tensor views into [`Piece`]s;
//! - `values`: soft accessors over pickle values;
//! - `rebuild`: the rebuild calls that make a tensor ([`leaf`]);
//! - `find`: where the state dict is inside the pickle ([`find_tensors`]);
//! - `storages`: the storage table ([`Storages`]), and the records of one archive
//!   kept to read others listing the same ones.

use std::path::PathBuf;

use unshard_pickle::{NodeId, Pickle, Value};

use super::zip::{Archive, ZipEntry, ZipIndex, METHOD_STORED};
use super::{check_view, legacy, Blob, FileId, Piece, StorageId, TensorSource};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::source::audit::UnsafeCall;

mod find;
mod rebuild;
mod storages;
mod values;

pub use find::{find_tensors, plain_sources, Found, LOCAL_SHARD, WRAPPER_KEYS};
pub use rebuild::{
    is_tensor_like, leaf, storage_table, subclass_local, Leaf, SubclassRef, TensorRef,
};
use storages::RecordTable;
pub use storages::Storages;
pub use values::describe;
pub(crate) use values::{
    class_of, dict_get, dict_of, dims_of, dtype_of, field_of, int_of, seq_of, str_of,
};

/// Where a storage's bytes are, in the file holding them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StorageLoc {
    /// Offset of its first byte in the file.
    pub offset: u64,
    /// Its length in bytes.
    pub len: u64,
    /// The record was deflated: `offset` is into [`TorchPayload::inflated`].
    pub inflated: bool,
}

/// Most bytes of deflated storage records inflated into memory for one archive.
/// torch writes stored records; deflated ones come from archives repacked by a zip
/// tool, and are read (torch reads them) as long as they fit.
const MAX_INFLATED_STORAGES: u64 = 2 << 30;

/// A parsed `torch.save` payload: the pickle and where its storages are.
#[derive(Debug)]
pub struct TorchPayload {
    /// The file it was read from.
    pub path: PathBuf,
    /// The object pickle (`data.pkl`), parsed inertly.
    pub pickle: Pickle,
    /// Storage key → where its bytes are.
    pub storages: Storages,
    /// Whether storages hold big-endian elements.
    pub big_endian: bool,
    /// What the file's pickles would run under `torch.load` (never run here).
    pub unsafe_calls: Vec<UnsafeCall>,
    /// The deflated storage records, inflated back to back (empty if none).
    pub inflated: Vec<u8>,
    /// The file id under which the caller holds `inflated` as a blob; storages in it
    /// cannot be read until it is set.
    pub inflated_file: Option<FileId>,
}

/// Reads the `torch.save` archive `a` (a whole `.pt` file, or a DCP chunk inside its
/// `.distcp` file) and parses its pickle. Only records are read: the zip index, the
/// pickle and the byte-order record; storages are located, never read.
pub fn read_zip_payload(a: &mut Archive<'_>) -> Result<TorchPayload> {
    let index = ZipIndex::read(a)?;
    payload_from_index(a, index)
}

/// Reads a file that is a `torch.save` zip archive.
pub fn read_zip_file(blob: &Blob) -> Result<TorchPayload> {
    read_zip_payload(&mut Archive::whole(blob))
}

/// Whether the first bytes of a file are a zip archive's (a `.pt` file, or an empty
/// archive).
pub fn is_zip(head: &[u8]) -> bool {
    head.starts_with(b"PK\x03\x04") || head.starts_with(b"PK\x05\x06")
}

/// Reads a `torch.save` file of either container: zip, or legacy (pre-zip). Anything
/// else is an error saying the file is not a `torch.save` file.
pub fn read_payload(blob: &Blob) -> Result<TorchPayload> {
    let head = blob.head(64)?;
    if is_zip(&head) {
        read_zip_file(blob)
    } else if legacy::is_legacy(&head) {
        legacy::read_legacy_payload(blob)
    } else {
        Err(Error::UnknownFormat {
            path: blob.path.clone(),
            found: "a file that is not a torch.save archive".into(),
        })
    }
}

fn payload_from_index(a: &Archive<'_>, index: ZipIndex) -> Result<TorchPayload> {
    let records = records(a, &index)?;
    let pickle = parse_pickle(a, &records)?;
    finish(a, &index, records, pickle, None)
}

/// What an archive's records say before its pickle is parsed.
struct Records<'a> {
    pkl_name: String,
    pkl_bytes: std::borrow::Cow<'a, [u8]>,
    big_endian: bool,
    data_prefix: String,
}

/// Checks that the archive is a `torch.save` one and reads its pickle and byte order.
fn records<'a>(a: &'a Archive<'_>, index: &ZipIndex) -> Result<Records<'a>> {
    let path = &a.blob().path;
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
    if let Some(dup) = index.duplicate() {
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
        || index.entries.iter().any(|e| {
            e.name
                .strip_prefix(prefix.as_str())
                .is_some_and(|rest| rest.starts_with("/code/"))
        })
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
    let pkl_bytes = index.stored(a, pkl)?;
    let big_endian = byte_order(a, index, index.find(&format!("{prefix}/byteorder")))?;
    Ok(Records {
        pkl_name,
        pkl_bytes,
        big_endian,
        data_prefix: format!("{prefix}/data/"),
    })
}

/// Whether the byte-order record says big-endian (no record: little-endian).
fn byte_order(a: &Archive<'_>, index: &ZipIndex, entry: Option<&ZipEntry>) -> Result<bool> {
    let Some(e) = entry else { return Ok(false) };
    let b = index.stored(a, e)?;
    match &b[..] {
        b"little" => Ok(false),
        b"big" => Ok(true),
        other => Err(Error::corrupt(
            &a.blob().path,
            format!(
                "unknown byteorder record '{}'",
                String::from_utf8_lossy(other)
            ),
        )),
    }
}

/// [`records`] of an archive whose index lists `table`'s records under its own
/// folder: the checks rank 0's archive passed hold for it too (see `storages.rs`).
/// `None` when it lists anything else.
fn records_like<'a>(
    a: &'a Archive<'_>,
    index: &ZipIndex,
    table: &RecordTable,
) -> Result<Option<Records<'a>>> {
    let Some(folder) = table.folder_of(index) else {
        return Ok(None);
    };
    let (Some(pkl), byteorder) = (
        index.entries.get(table.pkl),
        table.byteorder.and_then(|i| index.entries.get(i)),
    ) else {
        return Ok(None);
    };
    Ok(Some(Records {
        pkl_name: format!("{folder}/data.pkl"),
        pkl_bytes: index.stored(a, pkl)?,
        big_endian: byte_order(a, index, byteorder)?,
        data_prefix: format!("{folder}/data/"),
    }))
}

fn pickle_error(a: &Archive<'_>, records: &Records<'_>, source: unshard_pickle::Error) -> Error {
    Error::Pickle {
        path: a.blob().path.to_path_buf(),
        entry: records.pkl_name.clone(),
        source,
    }
}

fn parse_pickle(a: &Archive<'_>, records: &Records<'_>) -> Result<Pickle> {
    unshard_pickle::parse(&records.pkl_bytes).map_err(|e| pickle_error(a, records, e))
}

/// The payload of an archive whose pickle is parsed: where its storages are, checked
/// against the pickle, and what the pickle would run (`unsafe_calls`, audited here
/// when `None`).
fn finish(
    a: &Archive<'_>,
    index: &ZipIndex,
    records: Records<'_>,
    pickle: Pickle,
    unsafe_calls: Option<Vec<UnsafeCall>>,
) -> Result<TorchPayload> {
    let (storages, inflated) = storages_of(a, index, &records.data_prefix)?;
    let all = (0..pickle.len()).map(|i| NodeId(i as u32));
    check_storage_sizes(&pickle, all, &storages).map_err(|m| Error::corrupt(&a.blob().path, m))?;
    Ok(payload(
        a,
        records,
        pickle,
        storages,
        inflated,
        unsafe_calls,
    ))
}

/// The storages `index` lists under `data_prefix`, deflated ones inflated back to
/// back into the returned bytes.
fn storages_of(
    a: &Archive<'_>,
    index: &ZipIndex,
    data_prefix: &str,
) -> Result<(Storages, Vec<u8>)> {
    let path = &a.blob().path;
    let mut storages = Storages::default();
    let mut inflated = Vec::new();
    for e in &index.entries {
        let Some(key) = e.name.strip_prefix(data_prefix) else {
            continue;
        };
        let loc = if e.method == METHOD_STORED {
            StorageLoc {
                offset: a.base() + e.data_offset,
                len: e.size,
                inflated: false,
            }
        } else {
            let total = (inflated.len() as u64).saturating_add(e.size);
            if total > MAX_INFLATED_STORAGES {
                return Err(Error::corrupt(path, format!("the archive's compressed storage records hold more than {MAX_INFLATED_STORAGES} bytes, which unshard will not hold in memory; unzip and re-zip it without compression (zip -0), or re-save it with torch.save")));
            }
            let bytes = index.inflate(a, e, MAX_INFLATED_STORAGES)?;
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
    Ok((storages, inflated))
}

/// The payload of an archive whose storages are located and checked against its
/// pickle; what the pickle would run (`unsafe_calls`) is audited here when `None`.
fn payload(
    a: &Archive<'_>,
    records: Records<'_>,
    pickle: Pickle,
    storages: Storages,
    inflated: Vec<u8>,
    unsafe_calls: Option<Vec<UnsafeCall>>,
) -> TorchPayload {
    let path = &a.blob().path;
    let Records {
        pkl_name,
        big_endian,
        ..
    } = records;
    let unsafe_calls = match unsafe_calls {
        Some(calls) => calls,
        None => {
            // An archive inside a larger file (a DCP chunk) is named by where it starts.
            let entry = if a.base() > 0 {
                format!("{pkl_name} of the archive at byte {}", a.base())
            } else {
                pkl_name
            };
            crate::source::audit::audit_pickle(path, &entry, &pickle).0
        }
    };
    TorchPayload {
        path: path.to_path_buf(),
        pickle,
        storages,
        big_endian,
        unsafe_calls,
        inflated,
        inflated_file: None,
    }
}

/// A `torch.save` file's pickle kept to read other files written by the same code
/// (the other ranks' files of one job) without parsing theirs: a file whose pickle
/// differs from it only in integers and strings (see [`unshard_pickle::Template`])
/// gets the template's arena with those values changed. Its archive's records are
/// kept too: a file listing the same ones under its own folder shares their
/// checks and storage keys. Kept only for a pickle that calls
/// nothing `torch.load` would run unsafely, so that a file matching it does not
/// either.
#[derive(Debug)]
pub struct PayloadTemplate {
    template: unshard_pickle::Template,
    /// The arena's persistent ids: an arena read from the template has them at the
    /// same nodes (only integer and string values change), so only they are checked
    /// against the storages.
    pids: Vec<NodeId>,
    /// The archive's records, when a file listing the same ones can share them.
    table: Option<RecordTable>,
}

/// Reads a `torch.save` zip file and keeps its pickle as a template for others
/// (`None` when it cannot be one).
pub fn read_zip_file_as_template(blob: &Blob) -> Result<(TorchPayload, Option<PayloadTemplate>)> {
    let mut a = Archive::whole(blob);
    let index = ZipIndex::read(&mut a)?;
    let records = records(&a, &index)?;
    let (pickle, template) =
        unshard_pickle::Template::parse(&records.pkl_bytes, &unshard_pickle::Limits::default())
            .map_err(|e| pickle_error(&a, &records, e))?;
    let folder = records
        .data_prefix
        .strip_suffix("/data/")
        .unwrap_or_default()
        .to_string();
    let payload = finish(&a, &index, records, pickle, None)?;
    let template = template
        .filter(|_| payload.unsafe_calls.is_empty())
        .map(|template| PayloadTemplate {
            template,
            pids: persistent_ids(&payload.pickle),
            table: RecordTable::new(&index, &folder),
        });
    Ok((payload, template))
}

fn persistent_ids(p: &Pickle) -> Vec<NodeId> {
    (0..p.len())
        .map(|i| NodeId(i as u32))
        .filter(|&id| matches!(p.get(id), Value::PersistentId(_)))
        .collect()
}

/// Reads `torch.save` files against a [`PayloadTemplate`], holding one copy of the
/// template's arena: a file that matches the template is lent that copy with its
/// integers changed ([`TemplateReader::done`] takes it back); any other file is read
/// and parsed in full.
pub struct TemplateReader<'t> {
    template: &'t PayloadTemplate,
    /// The template's arena, while no payload holds it.
    arena: Option<Pickle>,
    /// How to undo the changes made for the payload that holds the arena.
    undo: Option<unshard_pickle::Changes>,
    /// Files read from the template.
    pub hits: u64,
    /// Files whose archive lists the template's records (under their own folder),
    /// whose storage keys were taken from the template's.
    pub tables: u64,
}

impl<'t> TemplateReader<'t> {
    /// A reader lending `arena`, which must be the arena `template` was parsed into
    /// (or a copy of it).
    pub fn new(template: &'t PayloadTemplate, arena: Pickle) -> Self {
        TemplateReader {
            template,
            arena: Some(arena),
            undo: None,
            hits: 0,
            tables: 0,
        }
    }

    /// Reads a `torch.save` zip file.
    pub fn read(&mut self, blob: &Blob) -> Result<TorchPayload> {
        let mut a = Archive::whole(blob);
        let index = ZipIndex::read(&mut a)?;
        let table = self.template.table.as_ref();
        let like = match table {
            Some(table) => records_like(&a, &index, table)?,
            None => None,
        };
        let shared = match (&like, table) {
            (Some(_), Some(table)) => table.storages(&index, a.base()),
            _ => None,
        };
        if shared.is_some() {
            self.tables += 1;
        }
        let records = match like {
            Some(r) => r,
            None => records(&a, &index)?,
        };
        let (storages, inflated) = match shared {
            Some(s) => (s, Vec::new()),
            None => storages_of(&a, &index, &records.data_prefix)?,
        };
        let bad_size = |m| Error::corrupt(&blob.path, m);
        let changes = self.template.template.changes(&records.pkl_bytes);
        let (Some(changes), Some(mut arena)) = (changes, self.arena.take()) else {
            let pickle = parse_pickle(&a, &records)?;
            let all = (0..pickle.len()).map(|i| NodeId(i as u32));
            check_storage_sizes(&pickle, all, &storages).map_err(bad_size)?;
            return Ok(payload(&a, records, pickle, storages, inflated, None));
        };
        let undo = arena.apply(&changes);
        // On an error the arena is dropped with the payload, and every later file
        // is parsed in full: `undo` is kept only for a payload that holds it.
        let pids = self.template.pids.iter().copied();
        check_storage_sizes(&arena, pids, &storages).map_err(bad_size)?;
        let payload = payload(&a, records, arena, storages, inflated, Some(Vec::new()));
        self.undo = Some(undo);
        self.hits += 1;
        Ok(payload)
    }

    /// Takes back the arena a payload from [`TemplateReader::read`] holds, if it
    /// holds it.
    /// Must be called with each payload [`TemplateReader::read`] returned before
    /// the next `read`.
    pub fn done(&mut self, payload: TorchPayload) {
        if self.arena.is_some() {
            return;
        }
        if let Some(undo) = self.undo.take() {
            let mut arena = payload.pickle;
            arena.apply(&undo);
            self.arena = Some(arena);
        }
    }
}

/// Each storage's declared element count (in its persistent id) against the size of
/// its record: torch refuses a file where they differ, and a reader that trusted
/// either would read something else than torch. `nodes` are the nodes to look at:
/// every node, or the persistent ids of a template whose arena this is.
fn check_storage_sizes(
    p: &Pickle,
    nodes: impl Iterator<Item = NodeId>,
    storages: &Storages,
) -> std::result::Result<(), String> {
    for id in nodes {
        let Value::PersistentId(pid) = p.get(id) else {
            continue;
        };
        let Some(t) = seq_of(p, *pid) else { continue };
        if t.len() < 5 || str_of(p, t[0]) != Some("storage") {
            continue;
        }
        let key = match p.get(t[2]) {
            Value::Str(s) => std::borrow::Cow::Borrowed(s.as_str()),
            Value::Int(i) => std::borrow::Cow::Owned(i.to_string()),
            _ => continue,
        };
        let class = values::global_of(p, t[1]).map(|g| g.1).unwrap_or("?");
        let size = if class == "UntypedStorage" {
            Some(1)
        } else {
            DType::from_storage_class(class).map(|d| d.size() as u64)
        };
        let (Some(size), Some(numel), Some(loc)) = (
            size,
            int_of(p, t[4]).and_then(|n| u64::try_from(n).ok()),
            storages.get(&key[..]),
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

impl TorchPayload {
    /// Turns a plain tensor into a one-piece [`TensorSource`] after checking that the
    /// view fits in its storage record.
    pub fn source(&self, file: FileId, name: &str, t: &TensorRef) -> Result<TensorSource> {
        let piece = self.piece(file, name, t, vec![0; t.shape.len()])?;
        Ok(TensorSource {
            name: name.to_string(),
            dtype: t.dtype,
            shape: t.shape.clone(),
            pieces: vec![piece].into(),
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
