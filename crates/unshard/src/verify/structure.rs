//! Structure checks: the shard headers are valid safetensors, the index and the
//! shards agree, no shard is missing or left over, and config.json declares the
//! dtype the tensors have. Findings are [`Problem`]s; only an unreadable directory
//! is an error.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::path::Path;

use serde::de::{Deserialize, Deserializer, IgnoredAny, MapAccess, Visitor};

use super::report::{problem, Problem};
use crate::plan::Plan;
use crate::report::list_some;
use crate::source::{fs, safetensors, Blob};
use crate::{DType, Error, Result};

const INDEX: &str = "model.safetensors.index.json";

const SINGLE: &str = "model.safetensors";

/// Values `__metadata__.format` may take for transformers to load a shard.
const LOADABLE_FORMATS: &[&str] = &["pt", "tf", "flax", "mlx"];

/// The weights of an output directory as they are on disk.
pub(crate) struct Written {
    pub(crate) shards: Vec<Shard>,
    pub(crate) tensors: HashMap<String, Located>,
    /// Tensors the index places in a shard that could not be read (reported once,
    /// with the shard, rather than one by one as missing).
    pub(crate) in_unreadable: HashSet<String>,
}

pub(crate) struct Shard {
    pub(crate) name: String,
    /// Open for reading (a local file or an object); `None` when the file is
    /// missing or its header is invalid.
    pub(crate) file: Option<Blob>,
}

#[derive(Debug)]
pub(crate) struct Located {
    pub(crate) shard: usize,
    pub(crate) dtype: DType,
    pub(crate) shape: Vec<u64>,
    /// Byte offset of the tensor's data in its file.
    pub(crate) offset: u64,
}

/// `model.safetensors.index.json`, as far as it could be parsed.
pub(crate) struct Index {
    /// `(tensor, file)` in file order.
    pub(crate) weight_map: Vec<(String, String)>,
    pub(crate) total_size: Option<u64>,
}

impl Written {
    pub(crate) fn read(dir: &Path, problems: &mut Vec<Problem>) -> Result<Written> {
        let mut written = Written {
            shards: Vec::new(),
            tensors: HashMap::new(),
            in_unreadable: HashSet::new(),
        };
        let has_single = fs::is_file(&dir.join(SINGLE));
        let index = if fs::is_file(&dir.join(INDEX)) {
            Some(read_index(&dir.join(INDEX), problems)?)
        } else {
            None
        };
        let mut names: Vec<String> = match &index {
            Some(ix) => {
                let mut v: Vec<String> = ix.weight_map.iter().map(|(_, f)| f.clone()).collect();
                v.sort();
                v.dedup();
                if has_single && !v.iter().any(|f| f == SINGLE) {
                    problems.push(problem(
                        Some(SINGLE),
                        None,
                        format!("present beside {INDEX}, which does not list it; loaders read {SINGLE} and ignore the index"),
                    ));
                }
                v
            }
            None if has_single => vec![SINGLE.to_string()],
            None => {
                problems.push(problem(
                    None,
                    None,
                    format!(
                        "no {SINGLE} and no {INDEX}: the directory holds no safetensors weights"
                    ),
                ));
                return Ok(written);
            }
        };
        names.retain(|n| !n.is_empty());

        // Left-over shards of another write confuse loaders and users alike.
        let mut stale: Vec<String> = fs::list(dir)?
            .into_iter()
            .map(|e| e.name)
            .filter(|n| n.starts_with("model") && n.ends_with(".safetensors"))
            .filter(|n| !names.contains(n))
            .collect();
        stale.sort();
        for s in stale {
            let why = if index.is_some() {
                format!("not listed in {INDEX} (left over from another write?)")
            } else {
                format!("beside {SINGLE} (left over from another write?)")
            };
            problems.push(problem(Some(&s), None, why));
        }

        for name in names {
            let path = dir.join(&name);
            let file = if !fs::is_file(&path) {
                problems.push(problem(
                    Some(INDEX),
                    None,
                    format!("lists {name}, which does not exist"),
                ));
                None
            } else {
                match read_shard(&path, &name, problems) {
                    Ok((file, header)) => {
                        let shard = written.shards.len();
                        for (t, dtype, shape, begin, _) in header.tensors {
                            if let Some(prev) = written.tensors.get(&t) {
                                problems.push(problem(
                                    Some(&name),
                                    Some(&t),
                                    format!(
                                        "stored twice: also in {}",
                                        written.shards[prev.shard].name
                                    ),
                                ));
                                continue;
                            }
                            written.tensors.insert(
                                t,
                                Located {
                                    shard,
                                    dtype,
                                    shape,
                                    offset: header.data_start + begin,
                                },
                            );
                        }
                        Some(file)
                    }
                    Err(e) => {
                        problems.push(problem(None, None, e.to_string()));
                        None
                    }
                }
            };
            written.shards.push(Shard { name, file });
        }

        if let Some(ix) = &index {
            written.check_index(ix, problems);
        }
        Ok(written)
    }

    /// The index and the shards must agree entry for entry.
    pub(crate) fn check_index(&mut self, ix: &Index, problems: &mut Vec<Problem>) {
        let shard_of: HashMap<&str, usize> = self
            .shards
            .iter()
            .enumerate()
            .map(|(i, s)| (s.name.as_str(), i))
            .collect();
        let mut listed: HashMap<&str, &str> = HashMap::new();
        for (t, f) in &ix.weight_map {
            listed.insert(t, f);
            let Some(&si) = shard_of.get(f.as_str()) else {
                continue;
            };
            if self.shards[si].file.is_none() {
                self.in_unreadable.insert(t.clone());
                continue;
            }
            match self.tensors.get(t) {
                None => problems.push(problem(
                    Some(INDEX),
                    Some(t),
                    format!("listed in {f}, which does not hold it"),
                )),
                Some(loc) if loc.shard != si => problems.push(problem(
                    Some(INDEX),
                    Some(t),
                    format!(
                        "listed in {f}, but it is stored in {}",
                        self.shards[loc.shard].name
                    ),
                )),
                Some(_) => {}
            }
        }
        let mut unlisted: Vec<(&String, &Located)> = self
            .tensors
            .iter()
            .filter(|(n, _)| !listed.contains_key(n.as_str()))
            .collect();
        unlisted.sort_by(|a, b| crate::plan::natural_cmp(a.0, b.0));
        for (n, loc) in unlisted {
            problems.push(problem(
                Some(INDEX),
                Some(n),
                format!(
                    "stored in {} but missing from the weight_map, so loaders never read it",
                    self.shards[loc.shard].name
                ),
            ));
        }
        for s in self.shards.iter().filter(|s| s.file.is_none()) {
            let mut lost: Vec<&str> = ix
                .weight_map
                .iter()
                .filter(|(_, f)| *f == s.name)
                .map(|(t, _)| t.as_str())
                .collect();
            if !lost.is_empty() {
                lost.sort_by(|a, b| crate::plan::natural_cmp(a, b));
                problems.push(problem(
                    Some(&s.name),
                    None,
                    format!(
                        "unreadable, so the {} tensor(s) the index puts in it were not checked: {}",
                        lost.len(),
                        list_some(&lost, 6)
                    ),
                ));
            }
        }
        let all_read = self.shards.iter().all(|s| s.file.is_some());
        match ix.total_size {
            Some(declared) if all_read => {
                let actual: u64 = self
                    .tensors
                    .values()
                    .map(|l| l.shape.iter().product::<u64>() * l.dtype.size() as u64)
                    .sum();
                if declared != actual {
                    problems.push(problem(
                        Some(INDEX),
                        None,
                        format!("metadata.total_size is {declared}, but the shards hold {actual} bytes of tensor data"),
                    ));
                }
            }
            _ => {}
        }
    }
}

/// Opens a shard and validates its header, beyond the reader's checks: no name twice
/// (JSON parsers silently keep the last one) and a `format` loaders accept.
pub(crate) fn read_shard(
    path: &Path,
    name: &str,
    problems: &mut Vec<Problem>,
) -> Result<(Blob, safetensors::Header)> {
    let blob = fs::open(path)?;
    let prefix = safetensors::header_bytes(&blob)?;
    let header = safetensors::parse_header(path, &prefix, blob.len())?;
    let text = prefix
        .get(8..header.data_start as usize)
        .and_then(|b| std::str::from_utf8(b).ok())
        .unwrap_or("{}");
    if let Ok(KeyList(keys)) = serde_json::from_str::<KeyList>(text.trim_end()) {
        for d in duplicates(&keys) {
            problems.push(problem(
                Some(name),
                Some(&d),
                "named twice in the header (readers keep only the last entry)",
            ));
        }
    }
    if let Some((_, f)) = header.metadata.iter().find(|(k, _)| k == "format") {
        if !LOADABLE_FORMATS.contains(&f.as_str()) {
            problems.push(problem(
                Some(name),
                None,
                format!(
                    "__metadata__.format is '{f}'; transformers loads only 'pt' (or tf, flax, mlx)"
                ),
            ));
        }
    }
    Ok((blob, header))
}

/// Reads output bytes at `offset`, first asking the source to start reading the
/// bytes that follow, so that the disk (or the network) works while this window is
/// compared.
pub(crate) fn read_output(f: &Blob, offset: u64, buf: &mut [u8]) -> Result<()> {
    f.will_need(offset + buf.len() as u64, 2 * buf.len() as u64);
    f.read_at(offset, buf)
}

pub(crate) fn read_index(path: &Path, problems: &mut Vec<Problem>) -> Result<Index> {
    let text = String::from_utf8(fs::read(path)?)
        .map_err(|e| Error::corrupt(path, format!("not UTF-8 text: {e}")))?;
    let mut ix = Index {
        weight_map: Vec::new(),
        total_size: None,
    };
    let json: serde_json::Value = match serde_json::from_str(&text) {
        Ok(v) => v,
        Err(e) => {
            problems.push(problem(Some(INDEX), None, format!("not valid JSON: {e}")));
            return Ok(ix);
        }
    };
    match json.get("metadata").and_then(|m| m.get("total_size")) {
        Some(v) => match v.as_u64() {
            Some(n) => ix.total_size = Some(n),
            None => problems.push(problem(
                Some(INDEX),
                None,
                format!("metadata.total_size is {v}, not a byte count"),
            )),
        },
        None => problems.push(problem(Some(INDEX), None, "no metadata.total_size")),
    }
    let Some(map) = json.get("weight_map").and_then(|m| m.as_object()) else {
        problems.push(problem(Some(INDEX), None, "no weight_map object"));
        return Ok(ix);
    };
    #[derive(serde::Deserialize)]
    struct MapKeys {
        weight_map: KeyList,
    }
    if let Ok(m) = serde_json::from_str::<MapKeys>(&text) {
        for d in duplicates(&m.weight_map.0) {
            problems.push(problem(
                Some(INDEX),
                Some(&d),
                "listed twice in the weight_map (readers keep only the last entry)",
            ));
        }
    }
    for (t, f) in map {
        match f.as_str() {
            Some(f) if !f.is_empty() && !f.contains(['/', '\\']) && f != ".." => {
                ix.weight_map.push((t.clone(), f.to_string()))
            }
            _ => problems.push(problem(
                Some(INDEX),
                Some(t),
                format!("weight_map entry {f} is not a file name in the directory"),
            )),
        }
    }
    Ok(ix)
}

/// The keys of a JSON object, in order and with repeats (which `serde_json::Map`
/// would fold away).
pub(crate) struct KeyList(Vec<String>);

impl<'de> Deserialize<'de> for KeyList {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct Keys;
        impl<'de> Visitor<'de> for Keys {
            type Value = KeyList;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: MapAccess<'de>>(
                self,
                mut m: A,
            ) -> std::result::Result<KeyList, A::Error> {
                let mut keys = Vec::new();
                while let Some((k, IgnoredAny)) = m.next_entry::<String, IgnoredAny>()? {
                    keys.push(k);
                }
                Ok(KeyList(keys))
            }
        }
        d.deserialize_map(Keys)
    }
}

pub(crate) fn duplicates(keys: &[String]) -> Vec<String> {
    let mut seen = HashSet::new();
    let mut dup: Vec<String> = keys
        .iter()
        .filter(|k| !seen.insert(k.as_str()))
        .cloned()
        .collect();
    dup.dedup();
    dup
}

/// config.json must be there when the merge writes one, and must declare the
/// dtype of the floating tensors (transformers loads with `dtype="auto"` from it).
pub(crate) fn check_config(
    dir: &Path,
    plan: &Plan,
    written: &Written,
    problems: &mut Vec<Problem>,
) {
    let path = dir.join("config.json");
    let text = match fs::read_optional(&path).map(|b| b.map(String::from_utf8)) {
        Ok(Some(Ok(t))) => t,
        Ok(Some(Err(e))) => {
            problems.push(problem(
                Some("config.json"),
                None,
                format!("cannot be read: not UTF-8 text: {e}"),
            ));
            return;
        }
        Ok(None) => {
            if plan.config.is_some() {
                problems.push(problem(
                    Some("config.json"),
                    None,
                    "missing: the merge writes the base's config",
                ));
            }
            return;
        }
        Err(e) => {
            problems.push(problem(
                Some("config.json"),
                None,
                format!("cannot be read: {e}"),
            ));
            return;
        }
    };
    let config: serde_json::Map<String, serde_json::Value> = match serde_json::from_str(&text) {
        Ok(c) => c,
        Err(e) => {
            problems.push(problem(
                Some("config.json"),
                None,
                format!("not a JSON object: {e}"),
            ));
            return;
        }
    };
    let mut stored: Vec<DType> = written
        .tensors
        .values()
        .map(|l| l.dtype)
        .filter(|d| d.is_float())
        .collect();
    stored.sort();
    stored.dedup();
    let stored_names: Vec<&str> = stored.iter().map(|d| d.torch_name()).collect();
    for key in ["dtype", "torch_dtype"] {
        let Some(v) = config.get(key) else {
            continue;
        };
        let Some(s) = v.as_str() else {
            if !v.is_null() {
                problems.push(problem(
                    Some("config.json"),
                    None,
                    format!("\"{key}\" is {v}, not a dtype name"),
                ));
            }
            continue;
        };
        let Some(declared) = DType::from_torch_name(s) else {
            problems.push(problem(
                Some("config.json"),
                None,
                format!("\"{key}\": \"{s}\" is not a dtype torch knows"),
            ));
            continue;
        };
        let tensors_disagree = !stored.is_empty() && !stored.contains(&declared);
        let planned = plan.dtype.filter(|&d| d != declared);
        let msg = if tensors_disagree {
            format!(
                "declares \"{key}\": \"{s}\", but the tensors are {}",
                stored_names.join(", ")
            )
        } else if let Some(d) = planned {
            format!("declares \"{key}\": \"{s}\", but the merge writes {d}")
        } else {
            continue;
        };
        problems.push(problem(Some("config.json"), None, msg));
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    pub(crate) fn finds_duplicate_keys_that_json_maps_fold_away() {
        let KeyList(keys) = serde_json::from_str(r#"{"a": 1, "b": {"x": 2}, "a": 3}"#).unwrap();
        assert_eq!(duplicates(&keys), ["a"]);
    }
}
