//! The legacy (pre-zip) `torch.save` stream: `_use_new_zipfile_serialization=False`.
//!
//! Five pickles follow one another (magic number, protocol version, system info, the
//! object, the list of storage keys), then each storage in key-list order as an
//! 8-byte element count and its raw bytes (docs/formats.md). The element size of a
//! storage comes from its type in the object pickle, so the object is parsed before
//! the storages can be located.
//!
//! The pickles are read into memory from the start of the file, in a buffer that
//! doubles until they fit (their length is not recorded anywhere); each storage's
//! count is one 8-byte read, and its bytes are never read here.

use std::collections::HashMap;
use std::path::Path;

use unshard_pickle::{ErrorKind, Limits, Pickle, Value};

use super::torch::{dict_get, seq_of, storage_table, str_of, StorageLoc, Storages, TorchPayload};
use super::Blob;
use crate::error::{Error, Result};

/// The first read of the pickles; most files' pickles fit in it.
const FIRST_READ: u64 = 64 << 10;

/// The magic number pickled first, as LONG1 little-endian bytes.
const MAGIC: [u8; 10] = [0x6c, 0xfc, 0x9c, 0x46, 0xf9, 0x20, 0x6a, 0xa8, 0x50, 0x19];

/// Whether `data` starts with the legacy magic pickle.
pub fn is_legacy(data: &[u8]) -> bool {
    data.len() >= 14 && data[..4] == [0x80, 0x02, 0x8a, 0x0a] && data[4..14] == MAGIC
}

/// The five pickles at the start of a legacy stream, and where the storages begin.
struct Pickles {
    magic: Pickle,
    version: Pickle,
    sys_info: Pickle,
    object: Pickle,
    keys: Pickle,
    end: u64,
    /// How messages name each of the five, in order (`the legacy object pickle at
    /// byte 120`).
    entries: Vec<String>,
}

/// Parses the five pickles from the start of the file, reading more of it while a
/// pickle runs past what was read.
fn read_pickles(blob: &Blob, first: u64) -> Result<Pickles> {
    let path = &blob.path;
    let mut want = first.max(1).min(blob.len());
    loop {
        let data = blob.read_vec(0, want)?;
        match parse_pickles(path, &data, want == blob.len()) {
            Ok(p) => return Ok(p),
            Err(Cut) => want = want.saturating_mul(2).min(blob.len()),
            Err(Failed(e)) => return Err(e),
        }
    }
}

/// Why the pickles did not parse from a prefix of the file.
enum Stop {
    /// A pickle ran past the bytes read: read more.
    Cut,
    /// Anything else: reading more would not help.
    Failed(Error),
}
use Stop::{Cut, Failed};

/// Parses the pickles from `data`, the first bytes of the file (`whole`: all of it).
fn parse_pickles(path: &Path, data: &[u8], whole: bool) -> std::result::Result<Pickles, Stop> {
    // One budget for the five pickles: the limits hold per file, not per pickle.
    let mut limits = Limits::default();
    let mut at = 0usize;
    let mut entries = Vec::with_capacity(5);
    let mut next = |what: &str| -> std::result::Result<Pickle, Stop> {
        let rest = data.get(at..).unwrap_or(&[]);
        match unshard_pickle::parse_prefix(rest, &limits) {
            Ok((p, used)) => {
                limits = limits.remaining_after(&p);
                entries.push(format!("the legacy {what} pickle at byte {at}"));
                at += used;
                Ok(p)
            }
            Err(source) => {
                let cut = matches!(source.kind, ErrorKind::Truncated | ErrorKind::NoStop);
                if cut && !whole {
                    return Err(Cut);
                }
                Err(Failed(Error::Pickle {
                    path: path.to_path_buf(),
                    entry: format!("the legacy {what} pickle at byte {at}"),
                    source,
                }))
            }
        }
    };
    Ok(Pickles {
        magic: next("magic-number")?,
        version: next("protocol-version")?,
        sys_info: next("system-info")?,
        object: next("object")?,
        keys: next("storage-keys")?,
        end: 0,
        entries: Vec::new(),
    })
    .map(|mut p| {
        p.end = at as u64;
        p.entries = entries;
        p
    })
}

/// Parses a legacy stream occupying all of `blob`.
pub fn read_legacy_payload(blob: &Blob) -> Result<TorchPayload> {
    read_legacy_with(blob, FIRST_READ)
}

/// [`read_legacy_payload`], reading the pickles from a first prefix of `first` bytes.
fn read_legacy_with(blob: &Blob, first: u64) -> Result<TorchPayload> {
    let path = blob.path.as_path();
    let Pickles {
        magic,
        version,
        sys_info,
        object,
        keys,
        end: at,
        entries,
    } = read_pickles(blob, first)?;
    // Each of the five runs under torch.load, not only the object.
    let mut unsafe_calls = Vec::new();
    for (p, entry) in [&magic, &version, &sys_info, &object, &keys]
        .into_iter()
        .zip(&entries)
    {
        unsafe_calls.extend(crate::source::audit::audit_pickle(path, entry, p).0);
    }
    match magic.get(magic.root()) {
        Value::BigInt(b) if b[..] == MAGIC => {}
        _ => return Err(Error::corrupt(path, "bad legacy magic number")),
    }
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
    let big_endian = dict_get(&sys_info, sys_info.root(), "little_endian")
        .map(|v| matches!(sys_info.get(v), Value::Bool(false)))
        .unwrap_or(false);
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
    let mut storages = Storages::default();
    let mut pos = at;
    let len = blob.len();
    for key in &key_list {
        let (dtype, _) = types.get(key.as_str()).ok_or_else(|| {
            Error::corrupt(
                path,
                format!("storage '{key}' is listed but no tensor uses it"),
            )
        })?;
        if pos.checked_add(8).is_none_or(|e| e > len) {
            return Err(Error::corrupt(path, format!("storage '{key}' at byte {pos} lies past the end of the file ({len} bytes); the file is truncated")));
        }
        let mut c = [0u8; 8];
        blob.read_at(pos, &mut c)?;
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

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    /// Pickles longer than the first read are read by growing the prefix, and give
    /// the same storages as when they fit; a truncated file is still an error.
    #[test]
    fn pickles_longer_than_the_first_read_are_read_in_full() {
        let path = crate::fixtures().join("ckpt/llama_policy_legacy.pt");
        let data = std::fs::read(&path).unwrap();
        let blob = Blob::owned(path.clone(), data.clone());
        let whole = read_legacy_with(&blob, u64::MAX).unwrap();
        for first in [1, 64, 1000] {
            let grown = read_legacy_with(&blob, first).unwrap();
            assert_eq!(grown.storages, whole.storages, "first read {first}");
            assert_eq!(grown.pickle.len(), whole.pickle.len());
        }
        let cut = Blob::owned(path, data[..300].to_vec());
        assert!(read_legacy_with(&cut, 16).is_err());
    }
}
