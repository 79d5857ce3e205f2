//! `.metadata`, interpreted: a pickle of torch.distributed.checkpoint dataclasses,
//! read as opaque objects. For every entry of the flattened state dict it gives the
//! global shape and dtype and the chunks it was saved in; `storage_data` maps each
//! chunk to a byte range of a `.distcp` file.

use std::collections::HashMap;
use std::path::Path;

use unshard_pickle::{NodeId, Pickle, Value};

use super::super::torch::{
    self, class_of, dict_of, dims_of, dtype_of, field_of, int_of, seq_of, str_of,
};
use crate::{DType, Error, Result};

/// One chunk of a tensor entry.
#[derive(Clone, Debug)]
pub(super) struct Chunk {
    pub(super) offsets: Vec<u64>,
    pub(super) sizes: Vec<u64>,
}

#[derive(Clone, Debug)]
pub(super) enum EntryKind {
    Tensor {
        dtype: DType,
        shape: Vec<u64>,
        chunks: Vec<Chunk>,
    },
    Bytes,
}

/// One entry of the flattened state dict.
#[derive(Clone, Debug)]
pub(super) struct Entry {
    pub(super) fqn: String,
    /// Where the entry sat in the nested state dict that was saved (`planner_data`),
    /// or just the fqn when the planner did not record it.
    pub(super) path: Vec<String>,
    pub(super) kind: EntryKind,
}

/// Where an item's bytes are.
#[derive(Clone, Debug)]
pub(super) struct Item {
    pub(super) file: String,
    pub(super) offset: u64,
    pub(super) length: u64,
    pub(super) transforms: Vec<String>,
}

/// `.metadata`, interpreted.
#[derive(Debug, Default)]
pub(super) struct Metadata {
    pub(super) entries: Vec<Entry>,
    /// `(fqn, chunk offsets)` → item. Byte entries have no offsets.
    pub(super) items: HashMap<(String, Option<Vec<u64>>), Item>,
}

/// Parses `.metadata` (held in `raw`) into entries and item locations.
pub(super) fn parse_metadata(path: &Path, raw: &[u8]) -> Result<Metadata> {
    // A checkpoint of thousands of ranks has a `.metadata` of hundreds of MB, which
    // may hold more nodes than the default limits allow: scale them to its size.
    let limits = unshard_pickle::Limits::default().scaled_to(raw.len());
    let p = unshard_pickle::parse_with_limits(raw, &limits).map_err(|source| Error::Pickle {
        path: path.to_path_buf(),
        entry: "the DCP metadata".into(),
        source,
    })?;
    let corrupt = |msg: String| Error::corrupt(path, msg);
    let root = p.root();
    match class_of(&p, root) {
        Some((m, "Metadata")) if m.starts_with("torch.distributed") => {}
        _ => {
            return Err(corrupt(format!(
                "not a torch.distributed.checkpoint Metadata pickle (it holds {})",
                torch::describe(&p, root)
            )))
        }
    }
    let sdm = field_of(&p, root, "state_dict_metadata")
        .and_then(|d| dict_of(&p, d))
        .ok_or_else(|| corrupt("the metadata has no state_dict_metadata dict".into()))?;
    let planner: HashMap<&str, NodeId> = field_of(&p, root, "planner_data")
        .and_then(|d| dict_of(&p, d))
        .unwrap_or(&[])
        .iter()
        .filter_map(|(k, v)| Some((str_of(&p, *k)?, *v)))
        .collect();
    let mut entries = Vec::with_capacity(sdm.len());
    for (k, v) in sdm {
        let fqn = str_of(&p, *k)
            .ok_or_else(|| corrupt("a state_dict_metadata key is not a string".into()))?
            .to_string();
        let kind = entry_kind(&p, *v).map_err(|m| corrupt(format!("entry '{fqn}': {m}")))?;
        let path = planner
            .get(fqn.as_str())
            .and_then(|&t| seq_of(&p, t))
            .and_then(|parts| {
                parts
                    .iter()
                    .map(|&x| match p.get(x) {
                        Value::Str(s) => Some(s.clone()),
                        Value::Int(i) => Some(i.to_string()),
                        _ => None,
                    })
                    .collect::<Option<Vec<String>>>()
            })
            .filter(|parts| !parts.is_empty())
            .unwrap_or_else(|| vec![fqn.clone()]);
        entries.push(Entry { fqn, path, kind });
    }
    let storage = field_of(&p, root, "storage_data")
        .and_then(|d| dict_of(&p, d))
        .ok_or_else(|| corrupt("the metadata has no storage_data dict".into()))?;
    let mut items = HashMap::with_capacity(storage.len());
    for (k, v) in storage {
        let (fqn, offsets) = metadata_index(&p, *k).map_err(corrupt)?;
        let item = storage_info(&p, *v)
            .map_err(|m| corrupt(format!("the storage entry of '{fqn}': {m}")))?;
        items.insert((fqn, offsets), item);
    }
    Ok(Metadata { entries, items })
}

fn entry_kind(p: &Pickle, id: NodeId) -> std::result::Result<EntryKind, String> {
    match class_of(p, id) {
        Some((_, "BytesStorageMetadata")) => Ok(EntryKind::Bytes),
        Some((_, "TensorStorageMetadata")) => {
            let props = field_of(p, id, "properties").ok_or("no tensor properties")?;
            let dtype = properties_dtype(p, props)?;
            let shape = field_of(p, id, "size")
                .and_then(|s| dims_of(p, s))
                .ok_or("the size is not a tuple of non-negative ints")?;
            let chunk_ids = field_of(p, id, "chunks")
                .and_then(|c| seq_of(p, c))
                .ok_or("no chunk list")?;
            let mut chunks = Vec::with_capacity(chunk_ids.len());
            for &c in chunk_ids {
                let offsets = field_of(p, c, "offsets").and_then(|o| dims_of(p, o));
                let sizes = field_of(p, c, "sizes").and_then(|o| dims_of(p, o));
                match (offsets, sizes) {
                    (Some(offsets), Some(sizes)) => chunks.push(Chunk { offsets, sizes }),
                    _ => return Err("a chunk without offsets and sizes".into()),
                }
            }
            Ok(EntryKind::Tensor {
                dtype,
                shape,
                chunks,
            })
        }
        Some((m, n)) => Err(format!("unknown storage metadata class {m}.{n}")),
        None => Err(format!(
            "expected storage metadata, found {}",
            torch::describe(p, id)
        )),
    }
}

/// `TensorProperties` builds from a tuple `(dtype, layout, requires_grad, ...)`.
fn properties_dtype(p: &Pickle, props: NodeId) -> std::result::Result<DType, String> {
    let token = match p.get(props) {
        Value::Object { state: Some(s), .. } => match p.get(*s) {
            Value::Tuple(parts) => parts.first().copied(),
            Value::Dict(_) => field_of(p, props, "dtype"),
            _ => None,
        },
        _ => None,
    }
    .ok_or("tensor properties without a dtype")?;
    dtype_of(p, token).ok_or_else(|| match p.get(token) {
        Value::Global(g) => format!("unsupported dtype {}.{}", g.module, g.name),
        _ => "the dtype is not a torch dtype".into(),
    })
}

fn metadata_index(
    p: &Pickle,
    id: NodeId,
) -> std::result::Result<(String, Option<Vec<u64>>), String> {
    let fqn = field_of(p, id, "fqn")
        .and_then(|f| str_of(p, f))
        .ok_or_else(|| {
            format!(
                "a storage_data key is not a MetadataIndex (found {})",
                torch::describe(p, id)
            )
        })?
        .to_string();
    let offsets = match field_of(p, id, "offset") {
        None => None,
        Some(o) if matches!(p.get(o), Value::None) => None,
        Some(o) => Some(dims_of(p, o).ok_or_else(|| {
            format!("the storage key of '{fqn}' has offsets that are not non-negative ints")
        })?),
    };
    Ok((fqn, offsets))
}

fn storage_info(p: &Pickle, id: NodeId) -> std::result::Result<Item, String> {
    let file = field_of(p, id, "relative_path")
        .and_then(|f| str_of(p, f))
        .ok_or("no relative_path")?
        .to_string();
    let num = |name: &str| {
        field_of(p, id, name)
            .and_then(|v| int_of(p, v))
            .and_then(|v| u64::try_from(v).ok())
            .ok_or_else(|| format!("the {name} is not a non-negative int"))
    };
    let offset = num("offset")?;
    let length = num("length")?;
    let transforms = match field_of(p, id, "transform_descriptors") {
        None => Vec::new(),
        Some(t) if matches!(p.get(t), Value::None) => Vec::new(),
        Some(t) => seq_of(p, t)
            .ok_or("transform_descriptors is not a list")?
            .iter()
            .map(|&d| str_of(p, d).map(str::to_string))
            .collect::<Option<Vec<_>>>()
            .ok_or("a transform descriptor is not a string")?,
    };
    Ok(Item {
        file,
        offset,
        length,
        transforms,
    })
}
