//! Where each storage of a `torch.save` file is, by key; and the table of an
//! archive's records kept from one file to read others of the same records.
//!
//! The per-rank files of one job are written by the same code: their archives list
//! the same records in the same order, under a folder named after each file
//! (`model_world_size_2_rank_0/data/0`, `model_world_size_2_rank_1/data/0`), with
//! their own sizes, offsets and CRCs. Rank 0's archive is checked as any other
//! (one folder, no duplicate record, no TorchScript code, a `data.pkl`) and its
//! records kept as a [`RecordTable`]. An archive whose index lists, entry by entry,
//! the same names but for the folder is then known to pass the same checks, holds
//! its pickle and byte order at the same entries and its storages under the same
//! keys: the key table is shared, and only each storage's place is taken from the
//! archive's own index. Its index is still read and checked in full (every offset
//! and size in bounds, every local header where the directory says); any other
//! archive goes through the checks again.

use std::collections::HashMap;
use std::sync::Arc;

use super::StorageLoc;
use crate::source::zip::{ZipIndex, METHOD_STORED};

/// Storage key → where its bytes are. The key table can be shared by the payloads
/// of files whose archives hold the same records.
#[derive(Clone, Debug, Default)]
pub struct Storages {
    keys: Arc<HashMap<String, usize>>,
    locs: Vec<StorageLoc>,
}

impl Storages {
    /// Sets where storage `key` is (replacing what was set for it).
    pub fn insert(&mut self, key: String, loc: StorageLoc) {
        if let Some(&i) = self.keys.get(&key) {
            if let Some(l) = self.locs.get_mut(i) {
                *l = loc;
            }
            return;
        }
        Arc::make_mut(&mut self.keys).insert(key, self.locs.len());
        self.locs.push(loc);
    }

    /// Where storage `key` is.
    pub fn get(&self, key: &str) -> Option<&StorageLoc> {
        self.keys.get(key).and_then(|&i| self.locs.get(i))
    }

    /// Every storage's place, in no particular order.
    #[cfg_attr(not(feature = "internals"), allow(dead_code))] // for the tests and fuzz targets
    pub fn values(&self) -> impl Iterator<Item = &StorageLoc> {
        self.locs.iter()
    }

    /// How many storages there are.
    pub fn len(&self) -> usize {
        self.locs.len()
    }

    /// Whether there are none.
    #[cfg_attr(not(feature = "internals"), allow(dead_code))] // for the tests and fuzz targets
    pub fn is_empty(&self) -> bool {
        self.locs.is_empty()
    }
}

impl PartialEq for Storages {
    fn eq(&self, other: &Storages) -> bool {
        self.len() == other.len()
            && self
                .keys
                .iter()
                .all(|(k, &i)| self.locs.get(i) == other.get(k))
    }
}

impl Eq for Storages {}

/// The records of one `torch.save` archive that passed the checks of a full read,
/// kept to recognise archives of the same records under another folder.
#[derive(Debug)]
pub(super) struct RecordTable {
    /// Each entry's name without the folder (starting with `/`).
    suffixes: Vec<String>,
    /// The entry of `data.pkl`, and of `byteorder` if there is one.
    pub(super) pkl: usize,
    pub(super) byteorder: Option<usize>,
    /// Per entry, its storage's index in `keys` (storage records only).
    slots: Vec<Option<usize>>,
    keys: Arc<HashMap<String, usize>>,
}

impl RecordTable {
    /// The table of `index`, an archive whose records were checked under `folder`
    /// (`None` when an entry lies outside it, or a storage record is compressed).
    pub(super) fn new(index: &ZipIndex, folder: &str) -> Option<RecordTable> {
        let mut suffixes = Vec::with_capacity(index.entries.len());
        let mut slots = Vec::with_capacity(index.entries.len());
        let mut keys = HashMap::new();
        let (mut pkl, mut byteorder) = (None, None);
        for (i, e) in index.entries.iter().enumerate() {
            let suffix = e.name.strip_prefix(folder).filter(|s| s.starts_with('/'))?;
            match suffix {
                "/data.pkl" => pkl = pkl.or(Some(i)),
                "/byteorder" => byteorder = byteorder.or(Some(i)),
                _ => {}
            }
            let slot = match suffix.strip_prefix("/data/") {
                Some(key) => {
                    if e.method != METHOD_STORED {
                        return None;
                    }
                    let n = keys.len();
                    Some(*keys.entry(key.to_string()).or_insert(n))
                }
                None => None,
            };
            suffixes.push(suffix.to_string());
            slots.push(slot);
        }
        // Names are distinct (checked by the full read), so slots are too.
        Some(RecordTable {
            suffixes,
            pkl: pkl?,
            byteorder,
            slots,
            keys: Arc::new(keys),
        })
    }

    /// The folder of `index` if it lists the table's records, in order, under it.
    pub(super) fn folder_of<'i>(&self, index: &'i ZipIndex) -> Option<&'i str> {
        if index.entries.len() != self.suffixes.len() {
            return None;
        }
        let (folder, _) = index.entries.first()?.name.split_once('/')?;
        let same = index.entries.iter().zip(&self.suffixes).all(|(e, s)| {
            e.name.len() == folder.len() + s.len()
                && e.name.starts_with(folder)
                && e.name.as_bytes()[folder.len()..] == *s.as_bytes()
        });
        same.then_some(folder)
    }

    /// The storages of `index` (which [`RecordTable::folder_of`] matched), with their
    /// offsets from `base`; `None` when a storage record is compressed (the caller
    /// reads the archive in full).
    pub(super) fn storages(&self, index: &ZipIndex, base: u64) -> Option<Storages> {
        let mut locs = vec![
            StorageLoc {
                offset: 0,
                len: 0,
                inflated: false
            };
            self.keys.len()
        ];
        for (e, slot) in index.entries.iter().zip(&self.slots) {
            let Some(i) = *slot else { continue };
            if e.method != METHOD_STORED {
                return None;
            }
            let loc = locs.get_mut(i)?;
            *loc = StorageLoc {
                offset: base + e.data_offset,
                len: e.size,
                inflated: false,
            };
        }
        Some(Storages {
            keys: Arc::clone(&self.keys),
            locs,
        })
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::path::PathBuf;

    use super::super::{read_zip_file, read_zip_file_as_template, TemplateReader};
    use crate::source::zip::ZipIndex;
    use crate::source::Blob;

    fn rank_file(r: usize) -> (PathBuf, Vec<u8>) {
        let path = crate::fixtures()
            .join("sharded/llama_w2_ranks")
            .join(format!("model_world_size_2_rank_{r}.pt"));
        let data = std::fs::read(&path).unwrap();
        (path, data)
    }

    /// Reads `rank1` (rank 1's file, as mutated by the caller) against rank 0's
    /// template: whether its records were taken from rank 0's table, and what a
    /// full read of the same bytes gives beside what the template read gives.
    fn read_beside_full(rank1: Vec<u8>) -> (u64, String, String) {
        let (path0, data0) = rank_file(0);
        let blob0 = Blob::owned(path0, data0);
        let (payload0, template) = read_zip_file_as_template(&blob0).unwrap();
        let template = template.unwrap();
        let mut reader = TemplateReader::new(&template, payload0.pickle);
        let blob1 = Blob::owned(rank_file(1).0, rank1);
        let got = reader.read(&blob1).map(|p| p.storages);
        let full = read_zip_file(&blob1).map(|p| p.storages);
        let show = |r: &crate::error::Result<super::Storages>| match r {
            Ok(s) => {
                let mut v: Vec<_> = s
                    .keys
                    .iter()
                    .map(|(k, &i)| (k.clone(), s.locs[i]))
                    .collect();
                v.sort_by(|a, b| a.0.cmp(&b.0));
                format!("{v:?}")
            }
            Err(e) => format!("error: {e}"),
        };
        (reader.tables, show(&got), show(&full))
    }

    /// Central-directory records of the entries named `data/{key}`.
    fn central(data: &[u8], key: &str) -> (u64, u64) {
        let index = ZipIndex::parse(data).unwrap();
        let e = index
            .entries
            .iter()
            .find(|e| e.name.ends_with(&format!("/data/{key}")))
            .unwrap();
        (e.central_offset, e.size)
    }

    #[test]
    fn a_file_listing_rank_0s_records_shares_its_storage_keys() {
        let (tables, got, full) = read_beside_full(rank_file(1).1);
        assert_eq!(tables, 1);
        assert_eq!(got, full);
        assert!(!got.starts_with("error"), "{got}");
    }

    /// Two storage records of the same size whose names are swapped in the central
    /// directory: torch (and a full read) take each key's bytes from the record the
    /// directory names, so rank 0's table must not be used.
    #[test]
    fn records_renamed_in_the_central_directory_are_read_in_full() {
        let (_, mut data) = rank_file(1);
        let index = ZipIndex::parse(&data).unwrap();
        let storages: Vec<_> = index
            .entries
            .iter()
            .filter(|e| e.name.contains("/data/"))
            .collect();
        let (a, b) = storages
            .iter()
            .enumerate()
            .find_map(|(i, a)| {
                let b = storages[i + 1..]
                    .iter()
                    .find(|b| b.size == a.size && b.name.len() == a.name.len())?;
                Some((*a, *b))
            })
            .unwrap();
        let (na, nb) = (a.name.clone(), b.name.clone());
        for (e, name) in [(a, &nb), (b, &na)] {
            let at = e.central_offset as usize + 46;
            data[at..at + name.len()].copy_from_slice(name.as_bytes());
        }
        let (_, unchanged, _) = read_beside_full(rank_file(1).1);
        let (tables, got, full) = read_beside_full(data);
        assert_eq!(tables, 0);
        assert_eq!(got, full);
        assert_ne!(got, unchanged, "the swap moves the two storages");
    }

    /// The end records claim one entry fewer (the last, `.data/serialization_id`, is
    /// no longer listed): a full read indexes the others, so does the template read.
    #[test]
    fn a_central_directory_of_another_entry_count_is_read_in_full() {
        let (_, mut data) = rank_file(1);
        let n = ZipIndex::parse(&data).unwrap().entries.len() as u64;
        // The count fields of the ZIP64 end record (two u64) and of the end record
        // (two u16), which torch writes both of.
        let z64 = data.len() - 22 - 20 - 56;
        assert_eq!(data[z64..z64 + 4], [0x50, 0x4b, 0x06, 0x06]);
        for at in [z64 + 24, z64 + 32] {
            data[at..at + 8].copy_from_slice(&(n - 1).to_le_bytes());
        }
        let eocd = data.len() - 22;
        for at in [eocd + 8, eocd + 10] {
            data[at..at + 2].copy_from_slice(&(n as u16 - 1).to_le_bytes());
        }
        assert_eq!(ZipIndex::parse(&data).unwrap().entries.len() as u64, n - 1);
        let (tables, got, full) = read_beside_full(data);
        assert_eq!(tables, 0);
        assert_eq!(got, full);
    }

    /// A storage record's size is each file's own: one that disagrees with the
    /// pickle is reported, naming the file and the storage, as a full read does.
    #[test]
    fn a_storage_size_changed_in_the_central_directory_is_reported() {
        let (path, mut data) = rank_file(1);
        let (at, size) = central(&data, "0");
        let at = at as usize;
        for field in [at + 20, at + 24] {
            data[field..field + 4].copy_from_slice(&(size as u32 - 2).to_le_bytes());
        }
        let (tables, got, full) = read_beside_full(data);
        assert_eq!(tables, 1, "the same records, of other sizes");
        assert_eq!(got, full);
        assert!(got.contains("storage '0'"), "{got}");
        assert!(got.contains(&path.display().to_string()), "{got}");
    }

    #[test]
    fn a_truncated_file_is_reported_by_name() {
        let (path, data) = rank_file(1);
        for keep in [data.len() - 10, data.len() / 2, 100] {
            let (tables, got, full) = read_beside_full(data[..keep].to_vec());
            assert_eq!(tables, 0);
            assert_eq!(got, full);
            assert!(got.starts_with("error"), "{keep}: {got}");
            assert!(got.contains(&path.display().to_string()), "{got}");
        }
    }
}
