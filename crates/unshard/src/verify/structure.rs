//! Structure checks: the shard headers are valid safetensors, the index and the
//! shards agree, no shard is missing or left over, and config.json declares the
//! dtype the tensors have. Findings are [`Problem`]s; only an unreadable directory
//! is an error.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::path::Path;

use serde::de::{Deserialize, Deserializer, IgnoredAny, MapAccess, Visitor};

use super::report::{problem, Problem};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::plan::Plan;
use crate::source::{fs, safetensors, Blob};
use crate::text::list_some;

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

    use ::safetensors::tensor::{serialize, Dtype, TensorView};

    #[test]
    pub(crate) fn finds_duplicate_keys_that_json_maps_fold_away() {
        let KeyList(keys) = serde_json::from_str(r#"{"a": 1, "b": {"x": 2}, "a": 3}"#).unwrap();
        assert_eq!(duplicates(&keys), ["a"]);
    }

    /// A safetensors file of float32 tensors, written by the `safetensors` crate.
    fn st(tensors: &[(&str, &[f32])], format: Option<&str>) -> Vec<u8> {
        let bytes: Vec<(&str, Vec<u8>)> = tensors
            .iter()
            .map(|(n, v)| (*n, v.iter().flat_map(|x| x.to_le_bytes()).collect()))
            .collect();
        let views = bytes
            .iter()
            .zip(tensors)
            .map(|((n, b), (_, v))| (*n, TensorView::new(Dtype::F32, vec![v.len()], b).unwrap()));
        let meta = format.map(|f| [("format".to_string(), f.to_string())].into());
        serialize(views, meta).unwrap()
    }

    fn write(dir: &Path, name: &str, bytes: &[u8]) {
        std::fs::write(dir.join(name), bytes).unwrap();
    }

    /// `model.safetensors.index.json` placing `(tensor, file)`, with `total_size`.
    fn index(map: &[(&str, &str)], total_size: u64) -> String {
        let m: serde_json::Map<String, serde_json::Value> = map
            .iter()
            .map(|(t, f)| (t.to_string(), (*f).into()))
            .collect();
        serde_json::json!({"metadata": {"total_size": total_size}, "weight_map": m}).to_string()
    }

    fn read(dir: &Path) -> (Written, Vec<String>) {
        let mut problems = Vec::new();
        let w = Written::read(dir, &mut problems).unwrap();
        (w, problems.iter().map(|p| p.to_string()).collect())
    }

    const S1: &str = "model-00001-of-00002.safetensors";
    const S2: &str = "model-00002-of-00002.safetensors";

    /// Two shards: `a` (2 floats) and `b` (3) in the first, `c` (1) in the second:
    /// 24 bytes of tensor data.
    fn two_shards(dir: &Path) {
        write(
            dir,
            S1,
            &st(&[("a", &[1.0, 2.0]), ("b", &[3.0, 4.0, 5.0])], Some("pt")),
        );
        write(dir, S2, &st(&[("c", &[6.0])], Some("pt")));
    }

    #[test]
    fn a_single_file_is_read_and_each_tensor_located_at_its_data() {
        let tmp = tempfile::tempdir().unwrap();
        let bytes = st(&[("a", &[1.0, 2.0]), ("b", &[3.0, 4.0, 5.0])], Some("pt"));
        write(tmp.path(), SINGLE, &bytes);
        // Files that are not weights of another write are not findings.
        write(tmp.path(), "other.safetensors", b"x");
        write(tmp.path(), "model.bin", b"x");
        let (w, problems) = read(tmp.path());
        assert!(problems.is_empty(), "{problems:?}");
        assert_eq!(w.shards.len(), 1);
        assert_eq!(w.shards[0].name, SINGLE);
        assert!(w.shards[0].file.is_some());
        // Where the safetensors crate says the data of each tensor is.
        let (n, meta) = ::safetensors::SafeTensors::read_metadata(&bytes).unwrap();
        for (name, want) in [("a", vec![1.0f32, 2.0]), ("b", vec![3.0, 4.0, 5.0])] {
            let loc = &w.tensors[name];
            let begin = meta.info(name).unwrap().data_offsets.0;
            assert_eq!(loc.offset, (8 + n + begin) as u64, "{name}");
            assert_eq!((loc.shard, loc.dtype), (0, DType::F32));
            assert_eq!(loc.shape, [want.len() as u64]);
            let mut buf = vec![0u8; 4 * want.len()];
            read_output(w.shards[0].file.as_ref().unwrap(), loc.offset, &mut buf).unwrap();
            let got: Vec<f32> = buf
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                .collect();
            assert_eq!(got, want);
        }
    }

    #[test]
    fn a_directory_without_weights_is_one_problem() {
        let tmp = tempfile::tempdir().unwrap();
        write(tmp.path(), "config.json", b"{}");
        let (w, problems) = read(tmp.path());
        assert_eq!(
            problems,
            ["no model.safetensors and no model.safetensors.index.json: the directory holds no safetensors weights"]
        );
        assert!(w.shards.is_empty() && w.tensors.is_empty());
    }

    #[test]
    fn shards_left_over_from_another_write_are_named() {
        let tmp = tempfile::tempdir().unwrap();
        write(tmp.path(), SINGLE, &st(&[("a", &[1.0])], None));
        write(tmp.path(), S2, &st(&[("a", &[1.0])], None));
        let (w, problems) = read(tmp.path());
        assert_eq!(
            problems,
            [format!(
                "{S2}: beside model.safetensors (left over from another write?)"
            )]
        );
        assert_eq!(w.shards.len(), 1);

        let tmp = tempfile::tempdir().unwrap();
        two_shards(tmp.path());
        write(
            tmp.path(),
            INDEX,
            index(&[("a", S1), ("b", S1), ("c", S2)], 24).as_bytes(),
        );
        write(tmp.path(), "model-00001-of-00003.safetensors", b"stale");
        let (w, problems) = read(tmp.path());
        assert_eq!(
            problems,
            ["model-00001-of-00003.safetensors: not listed in model.safetensors.index.json (left over from another write?)"]
        );
        assert_eq!(w.shards.len(), 2);
    }

    #[test]
    fn an_index_that_agrees_with_its_shards_is_no_problem() {
        let tmp = tempfile::tempdir().unwrap();
        two_shards(tmp.path());
        write(
            tmp.path(),
            INDEX,
            index(&[("a", S1), ("b", S1), ("c", S2)], 24).as_bytes(),
        );
        let (w, problems) = read(tmp.path());
        assert!(problems.is_empty(), "{problems:?}");
        let names: Vec<&str> = w.shards.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(names, [S1, S2]);
        assert_eq!(w.tensors["c"].shard, 1);
        assert_eq!(w.tensors["a"].shard, 0);
        assert!(w.in_unreadable.is_empty());

        // A model.safetensors the index lists is one of its shards, not an extra.
        let tmp = tempfile::tempdir().unwrap();
        write(tmp.path(), SINGLE, &st(&[("a", &[1.0])], None));
        write(tmp.path(), INDEX, index(&[("a", SINGLE)], 4).as_bytes());
        let (w, problems) = read(tmp.path());
        assert!(problems.is_empty(), "{problems:?}");
        assert_eq!(w.shards.len(), 1);
    }

    #[test]
    fn a_model_safetensors_beside_an_index_that_does_not_list_it_is_named() {
        let tmp = tempfile::tempdir().unwrap();
        two_shards(tmp.path());
        write(
            tmp.path(),
            INDEX,
            index(&[("a", S1), ("b", S1), ("c", S2)], 24).as_bytes(),
        );
        write(tmp.path(), SINGLE, &st(&[("a", &[1.0])], None));
        let (w, problems) = read(tmp.path());
        // Named as not listed, and as a left-over like any other.
        assert_eq!(
            problems,
            [
                "model.safetensors: present beside model.safetensors.index.json, which does not list it; loaders read model.safetensors and ignore the index",
                "model.safetensors: not listed in model.safetensors.index.json (left over from another write?)",
            ]
        );
        assert_eq!(w.shards.len(), 2);
    }

    #[test]
    fn disagreements_between_the_index_and_the_shards_are_each_named() {
        let tmp = tempfile::tempdir().unwrap();
        two_shards(tmp.path());
        // `b` placed in the wrong shard, `d` in a shard without it, `c` not listed,
        // `a` listed: 24 bytes are stored, 20 declared.
        write(
            tmp.path(),
            INDEX,
            index(&[("a", S1), ("b", S2), ("d", S1)], 20).as_bytes(),
        );
        let (w, problems) = read(tmp.path());
        assert_eq!(
            problems,
            [
                format!("{INDEX}: tensor 'b': listed in {S2}, but it is stored in {S1}"),
                format!("{INDEX}: tensor 'd': listed in {S1}, which does not hold it"),
                format!("{INDEX}: tensor 'c': stored in {S2} but missing from the weight_map, so loaders never read it"),
                format!("{INDEX}: metadata.total_size is 20, but the shards hold 24 bytes of tensor data"),
            ]
        );
        assert!(w.in_unreadable.is_empty());
    }

    #[test]
    fn a_tensor_in_two_shards_is_named_with_both() {
        let tmp = tempfile::tempdir().unwrap();
        write(tmp.path(), S1, &st(&[("a", &[1.0])], None));
        write(tmp.path(), S2, &st(&[("a", &[2.0]), ("c", &[3.0])], None));
        write(
            tmp.path(),
            INDEX,
            index(&[("a", S1), ("c", S2)], 8).as_bytes(),
        );
        let (w, problems) = read(tmp.path());
        assert_eq!(
            problems,
            [format!("{S2}: tensor 'a': stored twice: also in {S1}")]
        );
        assert_eq!(w.tensors["a"].shard, 0);
        assert_eq!(w.tensors.len(), 2);
    }

    #[test]
    fn a_missing_or_unreadable_shard_is_named_once_with_the_tensors_it_should_hold() {
        let tmp = tempfile::tempdir().unwrap();
        write(tmp.path(), S1, &st(&[("a", &[1.0, 2.0])], None));
        // The total size is wrong too, but with a shard unread it is not judged.
        let ix = index(&[("a", S1), ("layer.10", S2), ("layer.9", S2)], 999);
        write(tmp.path(), INDEX, ix.as_bytes());
        let (w, problems) = read(tmp.path());
        assert_eq!(
            problems,
            [
                format!("{INDEX}: lists {S2}, which does not exist"),
                format!("{S2}: unreadable, so the 2 tensor(s) the index puts in it were not checked: layer.9, layer.10"),
            ]
        );
        let lost: HashSet<String> = ["layer.9".to_string(), "layer.10".to_string()].into();
        assert_eq!(w.in_unreadable, lost);
        assert_eq!(w.shards.len(), 2);
        assert!(w.shards[0].file.is_some() && w.shards[1].file.is_none());

        // A shard whose header is not safetensors: the reader's error, then the same.
        write(tmp.path(), S2, b"\x05\0\0\0\0\0\0\0{}");
        let (w, problems) = read(tmp.path());
        assert_eq!(problems.len(), 2, "{problems:?}");
        assert!(problems[0].contains(S2), "{problems:?}");
        assert!(problems[1].starts_with(&format!("{S2}: unreadable, so the 2 tensor(s)")));
        assert_eq!(w.in_unreadable, lost);
    }

    /// A shard whose header is written by hand (the `safetensors` crate writes
    /// neither a name twice nor a `format` loaders refuse).
    fn by_hand(header: &str, data: usize) -> Vec<u8> {
        let mut v = (header.len() as u64).to_le_bytes().to_vec();
        v.extend(header.as_bytes());
        v.resize(v.len() + data, 0);
        v
    }

    fn shard_problems(bytes: &[u8]) -> Vec<String> {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("s.safetensors");
        std::fs::write(&path, bytes).unwrap();
        let mut problems = Vec::new();
        read_shard(&path, "s.safetensors", &mut problems).unwrap();
        problems.iter().map(|p| p.to_string()).collect()
    }

    #[test]
    fn a_header_naming_a_tensor_twice_or_a_format_loaders_refuse_is_named() {
        let t = r#""dtype":"F32","shape":[1],"data_offsets":[0,4]"#;
        let b = r#""dtype":"F32","shape":[1],"data_offsets":[4,8]"#;
        let twice = format!(r#"{{"a":{{{t}}},"b":{{{b}}},"a":{{{t}}}}}"#);
        assert_eq!(
            shard_problems(&by_hand(&twice, 8)),
            ["s.safetensors: tensor 'a': named twice in the header (readers keep only the last entry)"]
        );
        let np = format!(r#"{{"__metadata__":{{"format":"np"}},"a":{{{t}}}}}"#);
        assert_eq!(
            shard_problems(&by_hand(&np, 4)),
            ["s.safetensors: __metadata__.format is 'np'; transformers loads only 'pt' (or tf, flax, mlx)"]
        );
        for ok in ["pt", "mlx"] {
            assert!(shard_problems(&st(&[("a", &[1.0])], Some(ok))).is_empty());
        }
        assert!(shard_problems(&st(&[("a", &[1.0])], None)).is_empty());
    }

    fn index_problems(text: &str) -> (Index, Vec<String>) {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join(INDEX);
        std::fs::write(&path, text).unwrap();
        let mut problems = Vec::new();
        let ix = read_index(&path, &mut problems).unwrap();
        (ix, problems.iter().map(|p| p.to_string()).collect())
    }

    #[test]
    fn an_index_is_read_in_file_order_and_its_faults_named() {
        let (ix, p) = index_problems(
            r#"{"metadata": {"total_size": 12}, "weight_map": {"b": "x.safetensors", "a": "y.safetensors"}}"#,
        );
        assert!(p.is_empty(), "{p:?}");
        assert_eq!(ix.total_size, Some(12));
        let want = [("b", "x.safetensors"), ("a", "y.safetensors")];
        let got: Vec<(&str, &str)> = ix
            .weight_map
            .iter()
            .map(|(t, f)| (t.as_str(), f.as_str()))
            .collect();
        assert_eq!(got, want);

        let (ix, p) = index_problems("{not json");
        assert_eq!(p.len(), 1);
        assert!(
            p[0].starts_with(&format!("{INDEX}: not valid JSON")),
            "{p:?}"
        );
        assert!(ix.weight_map.is_empty() && ix.total_size.is_none());

        let (ix, p) = index_problems(r#"{"metadata": {"total_size": "12"}}"#);
        assert_eq!(
            p,
            [
                format!(r#"{INDEX}: metadata.total_size is "12", not a byte count"#),
                format!("{INDEX}: no weight_map object"),
            ]
        );
        assert_eq!(ix.total_size, None);

        let (_, p) =
            index_problems(r#"{"weight_map": {"a": "x.safetensors", "a": "y.safetensors"}}"#);
        assert_eq!(
            p,
            [
                format!("{INDEX}: no metadata.total_size"),
                format!("{INDEX}: tensor 'a': listed twice in the weight_map (readers keep only the last entry)"),
            ]
        );

        let (ix, p) = index_problems(
            r#"{"metadata": {"total_size": 0}, "weight_map": {"a": "../x", "b": "", "c": "..", "d": "s\\x", "e": 5, "f": "ok"}}"#,
        );
        assert_eq!(
            p,
            [
                format!(
                    r#"{INDEX}: tensor 'a': weight_map entry "../x" is not a file name in the directory"#
                ),
                format!(
                    r#"{INDEX}: tensor 'b': weight_map entry "" is not a file name in the directory"#
                ),
                format!(
                    r#"{INDEX}: tensor 'c': weight_map entry ".." is not a file name in the directory"#
                ),
                format!(
                    r#"{INDEX}: tensor 'd': weight_map entry "s\\x" is not a file name in the directory"#
                ),
                format!(
                    "{INDEX}: tensor 'e': weight_map entry 5 is not a file name in the directory"
                ),
            ]
        );
        assert_eq!(ix.weight_map, [("f".to_string(), "ok".to_string())]);
    }

    fn plan(dtype: Option<DType>, config: bool) -> Plan {
        Plan {
            tensors: Vec::new(),
            shards: Vec::new(),
            dtype,
            config: config.then(serde_json::Map::new),
            index: None,
            total_size: 0,
            report: Default::default(),
        }
    }

    /// Weights of these dtypes, as `Written::read` would find them.
    fn stored(dtypes: &[DType]) -> Written {
        let tensors = dtypes.iter().enumerate().map(|(i, &dtype)| {
            let loc = Located {
                shard: 0,
                dtype,
                shape: vec![1],
                offset: 0,
            };
            (format!("t{i}"), loc)
        });
        Written {
            shards: Vec::new(),
            tensors: tensors.collect(),
            in_unreadable: HashSet::new(),
        }
    }

    fn config_problems(config: Option<&[u8]>, plan: &Plan, written: &Written) -> Vec<String> {
        let tmp = tempfile::tempdir().unwrap();
        if let Some(c) = config {
            write(tmp.path(), "config.json", c);
        }
        let mut problems = Vec::new();
        check_config(tmp.path(), plan, written, &mut problems);
        problems.iter().map(|p| p.to_string()).collect()
    }

    #[test]
    fn config_json_must_be_there_when_the_merge_writes_one_and_be_a_json_object() {
        let f32s = stored(&[DType::F32]);
        assert_eq!(
            config_problems(None, &plan(None, true), &f32s),
            ["config.json: missing: the merge writes the base's config"]
        );
        assert!(config_problems(None, &plan(None, false), &f32s).is_empty());
        let p = config_problems(Some(b"{\"a\": \"\xff\"}"), &plan(None, true), &f32s);
        assert_eq!(p.len(), 1);
        assert!(
            p[0].starts_with("config.json: cannot be read: not UTF-8 text"),
            "{p:?}"
        );
        let p = config_problems(Some(b"[1]"), &plan(None, true), &f32s);
        assert_eq!(p.len(), 1);
        assert!(p[0].starts_with("config.json: not a JSON object"), "{p:?}");
        assert!(config_problems(Some(b"{}"), &plan(None, true), &f32s).is_empty());
    }

    #[test]
    fn config_json_must_declare_the_dtype_of_the_floating_tensors() {
        let cfg = |s: &str| {
            config_problems(
                Some(s.as_bytes()),
                &plan(None, true),
                &stored(&[DType::F32, DType::I64]),
            )
        };
        assert!(cfg(r#"{"torch_dtype": "float32", "dtype": "torch.float32"}"#).is_empty());
        assert_eq!(
            cfg(r#"{"torch_dtype": "bfloat16"}"#),
            [r#"config.json: declares "torch_dtype": "bfloat16", but the tensors are float32"#]
        );
        // Both keys are checked, each on its own.
        assert_eq!(
            cfg(r#"{"dtype": 5, "torch_dtype": "float99"}"#),
            [
                r#"config.json: "dtype" is 5, not a dtype name"#,
                r#"config.json: "torch_dtype": "float99" is not a dtype torch knows"#,
            ]
        );
        assert!(cfg(r#"{"dtype": null, "torch_dtype": null}"#).is_empty());
        assert_eq!(
            cfg(r#"{"dtype": "float16", "torch_dtype": "float32"}"#),
            [r#"config.json: declares "dtype": "float16", but the tensors are float32"#]
        );

        // Tensors of two floating dtypes: either may be declared; another names both.
        let mixed = stored(&[DType::F32, DType::BF16]);
        let with = |s: &str, p: &Plan| config_problems(Some(s.as_bytes()), p, &mixed);
        assert!(with(r#"{"dtype": "bfloat16"}"#, &plan(None, true)).is_empty());
        assert!(with(r#"{"dtype": "float32"}"#, &plan(None, true)).is_empty());
        assert_eq!(
            with(r#"{"dtype": "float16"}"#, &plan(None, true)),
            [r#"config.json: declares "dtype": "float16", but the tensors are bfloat16, float32"#]
        );
    }

    #[test]
    fn without_floating_tensors_config_json_must_declare_what_the_merge_writes() {
        let ints = stored(&[DType::I64]);
        let cfg = |d: Option<DType>| {
            config_problems(
                Some(br#"{"torch_dtype": "float32"}"#),
                &plan(d, true),
                &ints,
            )
        };
        assert_eq!(
            cfg(Some(DType::BF16)),
            [r#"config.json: declares "torch_dtype": "float32", but the merge writes bfloat16"#]
        );
        assert!(cfg(Some(DType::F32)).is_empty());
        assert!(cfg(None).is_empty());
        // Floating tensors that agree with it do not excuse a merge that writes
        // another dtype.
        let f32s = stored(&[DType::F32]);
        let p = config_problems(
            Some(br#"{"torch_dtype": "float32"}"#),
            &plan(Some(DType::BF16), true),
            &f32s,
        );
        assert_eq!(
            p,
            [r#"config.json: declares "torch_dtype": "float32", but the merge writes bfloat16"#]
        );
    }
}
