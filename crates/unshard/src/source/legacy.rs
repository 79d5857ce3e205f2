//! The legacy (pre-zip) `torch.save` stream: `_use_new_zipfile_serialization=False`.
//!
//! Five pickles follow one another (magic number, protocol version, system info, the
//! object, the list of storage keys), then each storage in key-list order as an
//! 8-byte element count and its raw bytes (formats.md §1.10). The element size of a
//! storage comes from its type in the object pickle, so the object is parsed before
//! the storages can be located.

use std::collections::HashMap;
use std::path::Path;

use unshard_pickle::{Limits, Value};

use super::torch::{dict_get, seq_of, storage_table, str_of, StorageLoc, TorchPayload};
use crate::{Error, Result};

/// The magic number pickled first, as LONG1 little-endian bytes.
const MAGIC: [u8; 10] = [0x6c, 0xfc, 0x9c, 0x46, 0xf9, 0x20, 0x6a, 0xa8, 0x50, 0x19];

/// Whether `data` starts with the legacy magic pickle.
pub fn is_legacy(data: &[u8]) -> bool {
    data.len() >= 14 && data[..4] == [0x80, 0x02, 0x8a, 0x0a] && data[4..14] == MAGIC
}

/// Parses a legacy stream occupying all of `data`.
pub fn read_legacy_payload(path: &Path, data: &[u8]) -> Result<TorchPayload> {
    // One budget for the five pickles: the limits hold per file, not per pickle.
    let mut limits = Limits::default();
    let mut at = 0usize;
    let mut unsafe_calls = Vec::new();
    let mut next = |what: &str| -> Result<unshard_pickle::Pickle> {
        let rest = data.get(at..).unwrap_or(&[]);
        let entry = format!("the legacy {what} pickle at byte {at}");
        let (p, used) =
            unshard_pickle::parse_prefix(rest, &limits).map_err(|source| Error::Pickle {
                path: path.to_path_buf(),
                entry: entry.clone(),
                source,
            })?;
        limits = limits.remaining_after(&p);
        // Each of the five runs under torch.load, not only the object.
        unsafe_calls.extend(crate::scan::audit_pickle(path, &entry, &p).0);
        at += used;
        Ok(p)
    };
    let magic = next("magic-number")?;
    match magic.get(magic.root()) {
        Value::BigInt(b) if b[..] == MAGIC => {}
        _ => return Err(Error::corrupt(path, "bad legacy magic number")),
    }
    let version = next("protocol-version")?;
    if !matches!(version.get(version.root()), Value::Int(1001)) {
        return Err(Error::Unsupported {
            path: path.to_path_buf(),
            what: "this legacy torch.save protocol version".into(),
            hint: Some(
                "only protocol 1001 (torch >= 0.4) is read; re-save the file with a recent torch"
                    .into(),
            ),
        });
    }
    let sys_info = next("system-info")?;
    let big_endian = dict_get(&sys_info, sys_info.root(), "little_endian")
        .map(|v| matches!(sys_info.get(v), Value::Bool(false)))
        .unwrap_or(false);
    let object = next("object")?;
    let keys = next("storage-keys")?;
    let key_list: Vec<String> = seq_of(&keys, keys.root())
        .ok_or_else(|| Error::corrupt(path, "the legacy storage-key list is not a list"))?
        .iter()
        .map(|&k| str_of(&keys, k).map(str::to_string))
        .collect::<Option<_>>()
        .ok_or_else(|| Error::corrupt(path, "a legacy storage key is not a string"))?;
    let table = storage_table(&object).map_err(|m| Error::corrupt(path, m))?;
    let types: HashMap<&str, _> = table
        .iter()
        .map(|(k, d, n)| (k.as_str(), (*d, *n)))
        .collect();
    let mut storages = HashMap::new();
    let mut pos = at as u64;
    let len = data.len() as u64;
    for key in &key_list {
        let (dtype, _) = types.get(key.as_str()).ok_or_else(|| {
            Error::corrupt(
                path,
                format!("storage '{key}' is listed but no tensor uses it"),
            )
        })?;
        let count_bytes = data
            .get(pos as usize..pos as usize + 8)
            .ok_or_else(|| Error::corrupt(path, format!("storage '{key}' at byte {pos} lies past the end of the file ({len} bytes); the file is truncated")))?;
        let mut c = [0u8; 8];
        c.copy_from_slice(count_bytes);
        let count = if big_endian {
            u64::from_be_bytes(c)
        } else {
            u64::from_le_bytes(c)
        };
        let bytes = count.checked_mul(dtype.size() as u64).ok_or_else(|| {
            Error::corrupt(path, format!("storage '{key}' claims {count} elements"))
        })?;
        let start = pos + 8;
        let end = start
            .checked_add(bytes)
            .filter(|&e| e <= len)
            .ok_or_else(|| Error::corrupt(path, format!("storage '{key}' ({bytes} bytes at byte {start}) lies past the end of the file ({len} bytes); the file is truncated")))?;
        storages.insert(
            key.clone(),
            StorageLoc {
                offset: start,
                len: bytes,
                inflated: false,
            },
        );
        pos = end;
    }
    Ok(TorchPayload {
        path: path.to_path_buf(),
        pickle: object,
        storages,
        big_endian,
        unsafe_calls,
        inflated: Vec::new(),
        inflated_file: None,
    })
}
