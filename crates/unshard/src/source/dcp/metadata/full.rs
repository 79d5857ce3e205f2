//! The fallback reader of `.metadata`: the whole pickle parsed by the general
//! reader (which audits what it would run), then the tree interpreted. Used when the
//! streaming pass meets anything beyond what DCP writes; its errors say what is wrong.

use std::collections::HashMap;
use std::path::Path;

use unshard_pickle::{NodeId, Pickle, Value};

use super::super::super::torch::{
    self, class_of, dict_of, dims_of, dtype_of, field_of, int_of, seq_of, str_of,
};
use super::{Builder, Chunks, Entry, EntryKind, Keep, Metadata};
use crate::dtype::DType;
use crate::error::{Error, Result};

/// A chunk as the tree gives it.
struct Chunk {
    offsets: Vec<u64>,
    sizes: Vec<u64>,
}

/// An entry as the tree gives it.
enum Kind {
    Tensor {
        dtype: DType,
        shape: Vec<u64>,
        chunks: Vec<Chunk>,
    },
    Bytes,
}

/// Where an item's bytes are, as the tree gives it.
struct Item {
    file: String,
    offset: u64,
    length: u64,
    transforms: Vec<String>,
}

/// Parses `.metadata` (held in `raw`) into entries and item locations.
pub(super) fn parse(path: &Path, raw: &[u8], keep: Keep<'_>) -> Result<Metadata> {
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
        // Megatron-Core 0.15's subclass: the same fields, and `mcore_data`.
        Some(("megatron.core.dist_checkpointing.strategies.torch", "MCoreMetadata")) => {}
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
    let mut b = Builder::new();
    let item_of = |b: &mut Builder, fqn: &str, offsets: Option<Vec<u64>>| {
        items
            .get(&(fqn.to_string(), offsets))
            .map(|i| b.item(&i.file, i.offset, i.length, &i.transforms))
    };
    let mut entries = Vec::with_capacity(sdm.len());
    for (k, v) in sdm {
        let fqn = str_of(&p, *k)
            .ok_or_else(|| corrupt("a state_dict_metadata key is not a string".into()))?
            .to_string();
        let kind = entry_kind(&p, *v).map_err(|m| corrupt(format!("entry '{fqn}': {m}")))?;
        let kind = match kind {
            Kind::Bytes => EntryKind::Bytes {
                item: item_of(&mut b, &fqn, None),
            },
            Kind::Tensor {
                dtype,
                shape,
                chunks,
            } => {
                let dropped = !keep.chunks_of(&fqn);
                let mut kept = Chunks::new(shape.len());
                for c in chunks.into_iter().filter(|_| !dropped) {
                    if !kept.push(&c.offsets, &c.sizes) {
                        return Err(corrupt(format!(
                            "entry '{fqn}': a chunk at {:?} of size {:?} in a tensor of shape {shape:?}",
                            c.offsets, c.sizes
                        )));
                    }
                    let item = item_of(&mut b, &fqn, Some(c.offsets));
                    if let Some(last) = kept.list.last_mut() {
                        last.item = item;
                    }
                }
                kept.shrink();
                EntryKind::Tensor {
                    dtype,
                    shape,
                    chunks: kept,
                    dropped,
                }
            }
        };
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
    let (unsafe_calls, _) = crate::source::audit::audit_pickle(path, ".metadata", &p);
    let mut md = b.md;
    md.entries = entries;
    md.unsafe_calls = unsafe_calls;
    Ok(md)
}

fn entry_kind(p: &Pickle, id: NodeId) -> std::result::Result<Kind, String> {
    match class_of(p, id) {
        Some((_, "BytesStorageMetadata")) => Ok(Kind::Bytes),
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
            Ok(Kind::Tensor {
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
