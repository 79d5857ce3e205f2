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
//! - `find`: where the state dict is inside the pickle ([`find_tensors`]).

use std::collections::HashMap;
use std::path::PathBuf;

use unshard_pickle::Pickle;

use super::zip::{Archive, ZipIndex, METHOD_STORED};
use super::{check_view, legacy, Blob, FileId, Piece, StorageId, TensorSource};
use crate::{Error, Result};

mod find;
mod rebuild;
mod values;

pub use find::{find_tensors, plain_sources, Found, LOCAL_SHARD, WRAPPER_KEYS};
pub use rebuild::{
    is_tensor_like, leaf, storage_table, subclass_local, Leaf, SubclassRef, TensorRef,
};
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
}

/// A parsed `torch.save` payload: the pickle and where its storages are.
#[derive(Debug)]
pub struct TorchPayload {
    /// The file it was read from.
    pub path: PathBuf,
    /// The object pickle (`data.pkl`), parsed inertly.
    pub pickle: Pickle,
    /// Storage key → where its bytes are.
    pub storages: HashMap<String, StorageLoc>,
    /// Whether storages hold big-endian elements.
    pub big_endian: bool,
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
    let big_endian = match index.find(&format!("{prefix}/byteorder")) {
        None => false,
        Some(e) => {
            let b = index.stored(a, e)?;
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
    for e in &index.entries {
        if let Some(key) = e.name.strip_prefix(&data_prefix) {
            if e.method != METHOD_STORED {
                return Err(Error::corrupt(
                    path,
                    format!(
                        "storage record '{}' is compressed; torch writes stored entries only",
                        e.name
                    ),
                ));
            }
            storages.insert(
                key.to_string(),
                StorageLoc {
                    offset: a.base() + e.data_offset,
                    len: e.size,
                },
            );
        }
    }
    Ok(TorchPayload {
        path: path.to_path_buf(),
        pickle,
        storages,
        big_endian,
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
