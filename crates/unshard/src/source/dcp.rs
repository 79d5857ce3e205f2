//! torch.distributed.checkpoint directories: `.metadata` + `__R_I.distcp`.
//!
//! FSDP `SHARDED_STATE_DICT`, FSDP2, accelerate's `pytorch_model_fsdp_0/` and
//! torchtitan all save this way (formats.md §2). `.metadata` is a plain pickle
//! (protocol 4 or 5) of dataclasses, read here as opaque objects: for every entry
//! of the flattened state dict it gives the global shape and dtype and the chunks
//! (offset and size boxes) it was saved in; `storage_data` maps each chunk
//! (`MetadataIndex(fqn, offsets)`) to a byte range of a `.distcp` file. Each range
//! is a complete `torch.save` archive of one tensor, so a chunk becomes one
//! [`Piece`](super::Piece) pointing into the `.distcp` file, placed at the chunk's
//! offsets. Ranges that went through the `stream.zstd/1` transform are decompressed
//! into memory first; that is the only copy of tensor bytes a reader makes.
//!
//! Nested state dicts are flattened by DCP (`{"model": sd}` gives `model.<fqn>`);
//! `planner_data` keeps the original path, which tells where the model is and which
//! entries are optimizer state (skipped, with a note). Byte entries (step counters,
//! param groups, anything not a tensor) are listed as extras and never read as weights.

use std::collections::{HashMap, HashSet};
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use unshard_pickle::{NodeId, Pickle, Value};

use super::torch::{
    self, class_of, dict_of, dims_of, dtype_of, field_of, int_of, seq_of, str_of, Leaf,
};
use super::{check_coverage, Blob, Checkpoint, Extra, FileId, Format, OpenOptions, TensorSource};
use crate::{DType, Error, Result};

/// The transform DCP's `ZStandard` extension records on each item it compressed.
const ZSTD: &str = "stream.zstd/1";

/// Top-level state-dict keys under which trainers put optimizer state.
const OPTIMIZER_KEYS: &[&str] = &[
    "optim",
    "optimizer",
    "optimizers",
    "optim_state",
    "optimizer_state_dict",
];

/// Whether a directory is a DCP checkpoint.
pub fn is_dcp_dir(path: &Path) -> bool {
    path.join(".metadata").is_file()
}

/// One chunk of a tensor entry.
#[derive(Clone, Debug)]
struct Chunk {
    offsets: Vec<u64>,
    sizes: Vec<u64>,
}

#[derive(Clone, Debug)]
enum EntryKind {
    Tensor {
        dtype: DType,
        shape: Vec<u64>,
        chunks: Vec<Chunk>,
    },
    Bytes,
}

/// One entry of the flattened state dict.
#[derive(Clone, Debug)]
struct Entry {
    fqn: String,
    /// Where the entry sat in the nested state dict that was saved (`planner_data`),
    /// or just the fqn when the planner did not record it.
    path: Vec<String>,
    kind: EntryKind,
}

/// Where an item's bytes are.
#[derive(Clone, Debug)]
struct Item {
    file: String,
    offset: u64,
    length: u64,
    transforms: Vec<String>,
}

/// `.metadata`, interpreted.
#[derive(Debug, Default)]
struct Metadata {
    entries: Vec<Entry>,
    /// `(fqn, chunk offsets)` → item. Byte entries have no offsets.
    items: HashMap<(String, Option<Vec<u64>>), Item>,
    /// What the `.metadata` pickle would run under `torch.load`.
    unsafe_calls: Vec<crate::scan::UnsafeCall>,
}

/// Chunk archives up to this size are read into memory with one positioned read to be
/// parsed; larger ones (mostly tensor bytes) are parsed in the map.
const SMALL_ARCHIVE: u64 = 1 << 20;

/// Hands memory freed by the allocator back to the system. The `.metadata` of a
/// checkpoint of many ranks is parsed into millions of small allocations; once they are
/// freed, glibc keeps most of them for reuse, and the merge that follows (minutes, for
/// a big model) would hold hundreds of MB it no longer needs.
fn release_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only returns free heap memory to the system.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Opens a DCP directory and describes the model tensors in it.
pub fn open(dir: &Path, opts: &OpenOptions) -> Result<Checkpoint> {
    open_with(dir, opts, SMALL_ARCHIVE)
}

fn open_with(dir: &Path, opts: &OpenOptions, small_archive: u64) -> Result<Checkpoint> {
    let meta_path = dir.join(".metadata");
    let raw = std::fs::read(&meta_path).map_err(|e| Error::io("read", &meta_path, e))?;
    let md = parse_metadata(&meta_path, &raw)?;
    drop(raw);
    release_freed_memory();
    let selection = select(dir, &md, opts.key.as_deref())?;
    let mut reader = Reader {
        dir,
        files: Vec::new(),
        by_name: HashMap::new(),
        ahead: Vec::new(),
        asked: 0,
        parsed: 0,
        small_archive,
        unsafe_calls: Vec::new(),
    };
    reader.plan_prefetch(&md, &selection.tensors);
    let mut tensors = Vec::with_capacity(selection.tensors.len());
    for (name, entry) in &selection.tensors {
        tensors.push(reader.tensor(&md, name, entry)?);
    }
    let mut extras = Vec::new();
    for e in &md.entries {
        if matches!(e.kind, EntryKind::Bytes) {
            extras.push(Extra {
                name: e.fqn.clone(),
                kind: reader.describe_bytes(&md, &e.fqn),
            });
        }
    }
    extras.extend(selection.extras);
    let mut unsafe_calls = md.unsafe_calls.clone();
    unsafe_calls.append(&mut reader.unsafe_calls);
    Ok(Checkpoint {
        format: Format::Dcp,
        path: dir.to_path_buf(),
        files: reader.files,
        key: selection.key,
        tensors,
        extras,
        notes: selection.notes,
        unsafe_calls,
    })
}

/// Finds the one DCP directory inside `dir` that holds a model, as in a HF Trainer
/// or accelerate `checkpoint-N/` (`pytorch_model_fsdp_0/` beside `optimizer_0/`).
/// Optimizer-only directories are passed over; when nothing else is there, the
/// optimizer directory is returned so that opening it explains what it holds.
pub fn find_model_subdir(dir: &Path) -> Result<Option<(PathBuf, Vec<String>)>> {
    let mut models = Vec::new();
    let mut optimizers = Vec::new();
    let rd = std::fs::read_dir(dir).map_err(|e| Error::io("list", dir, e))?;
    for entry in rd.flatten() {
        let p = entry.path();
        if !p.is_dir() || !is_dcp_dir(&p) {
            continue;
        }
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.starts_with("optim") {
            optimizers.push(name);
        } else {
            models.push(name);
        }
    }
    models.sort();
    optimizers.sort();
    match models.len() {
        0 => Ok(optimizers.first().map(|o| (dir.join(o), Vec::new()))),
        1 => Ok(Some((dir.join(&models[0]), optimizers))),
        _ => Err(Error::Unsupported {
            path: dir.to_path_buf(),
            what: format!(
                "a directory holding several torch.distributed.checkpoint directories ({})",
                models.join(", ")
            ),
            hint: Some(format!(
                "pass the one to merge, e.g. {}",
                dir.join(&models[0]).display()
            )),
        }),
    }
}

fn parse_metadata(path: &Path, raw: &[u8]) -> Result<Metadata> {
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
    let (unsafe_calls, _) = crate::scan::audit_pickle(path, ".metadata", &p);
    Ok(Metadata {
        entries,
        items,
        unsafe_calls,
    })
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

/// What to merge: the tensor entries of the model, with their names in it.
struct Selection<'a> {
    key: Option<String>,
    tensors: Vec<(String, &'a Entry)>,
    extras: Vec<Extra>,
    notes: Vec<String>,
}

/// The top-level key an entry was saved under, if the state dict was nested.
fn group_of(e: &Entry) -> Option<&str> {
    match e.path.as_slice() {
        [first, _, ..] => Some(first),
        _ => None,
    }
}

fn is_optimizer_group(g: &str) -> bool {
    OPTIMIZER_KEYS.contains(&g)
}

/// Picks the model's tensors: under `--key` when given, else the top level, else
/// the one non-optimizer group holding tensors (or the first of the usual wrapper keys).
fn select<'a>(dir: &Path, md: &'a Metadata, key: Option<&str>) -> Result<Selection<'a>> {
    let is_tensor = |e: &Entry| matches!(e.kind, EntryKind::Tensor { .. });
    let mut groups: Vec<Option<&str>> = Vec::new();
    for e in md.entries.iter().filter(|e| is_tensor(e)) {
        let g = group_of(e);
        if !groups.contains(&g) {
            groups.push(g);
        }
    }
    let chosen = match key {
        Some(k) if !k.is_empty() => {
            let prefix = format!("{k}.");
            if !md
                .entries
                .iter()
                .any(|e| is_tensor(e) && e.fqn.starts_with(&prefix))
            {
                return Err(Error::KeyNotFound {
                    path: dir.to_path_buf(),
                    key: k.to_string(),
                    available: groups.iter().flatten().map(|g| g.to_string()).collect(),
                });
            }
            Some(k)
        }
        _ => model_group(dir, &groups)?,
    };
    let prefix = chosen.map(|k| format!("{k}.")).unwrap_or_default();
    let mut tensors = Vec::new();
    let mut extras = Vec::new();
    let mut skipped: HashMap<&str, usize> = HashMap::new();
    for e in md.entries.iter().filter(|e| is_tensor(e)) {
        let mine = match chosen {
            Some(_) => e.fqn.strip_prefix(&prefix),
            None => group_of(e).is_none().then_some(e.fqn.as_str()),
        };
        match (mine, group_of(e)) {
            (Some(name), _) => tensors.push((name.to_string(), e)),
            (None, Some(g)) if is_optimizer_group(g) => *skipped.entry(g).or_insert(0) += 1,
            (None, _) => {
                if let EntryKind::Tensor { dtype, shape, .. } = &e.kind {
                    extras.push(Extra {
                        name: e.fqn.clone(),
                        kind: format!(
                            "tensor {} {shape:?} (not merged; select it with --key)",
                            dtype.safetensors_name()
                        ),
                    });
                }
            }
        }
    }
    let mut notes = Vec::new();
    let mut skipped: Vec<_> = skipped.into_iter().collect();
    skipped.sort();
    for (g, n) in skipped {
        notes.push(format!(
            "skipped optimizer state under '{g}' ({n} tensor entries); only model weights are merged"
        ));
    }
    let mut seen = HashSet::new();
    for (name, _) in &tensors {
        if !seen.insert(name.as_str()) {
            return Err(Error::corrupt(
                dir.join(".metadata"),
                format!("tensor '{name}' appears twice"),
            ));
        }
    }
    Ok(Selection {
        key: chosen.map(str::to_string),
        tensors,
        extras,
        notes,
    })
}

/// The group the model was saved under (`None` = the top level), among the groups
/// holding tensors: optimizer state never, the top level first, else the only
/// remaining group, else the first usual wrapper key.
fn model_group<'g>(dir: &Path, groups: &[Option<&'g str>]) -> Result<Option<&'g str>> {
    let model: Vec<Option<&str>> = groups
        .iter()
        .copied()
        .filter(|g| !g.is_some_and(is_optimizer_group))
        .collect();
    if model.contains(&None) {
        return Ok(None);
    }
    if let [only] = model.as_slice() {
        return Ok(*only);
    }
    if let Some(w) = torch::WRAPPER_KEYS
        .iter()
        .find(|w| model.contains(&Some(**w)))
    {
        return Ok(Some(*w));
    }
    if !model.is_empty() {
        return Err(Error::AmbiguousTensors {
            path: dir.to_path_buf(),
            candidates: model.iter().flatten().map(|g| g.to_string()).collect(),
        });
    }
    let what = if groups.is_empty() {
        "no tensors at all".to_string()
    } else {
        let names: Vec<&str> = groups.iter().flatten().copied().collect();
        format!("only optimizer state under '{}'", names.join("', '"))
    };
    Err(Error::NoTensors {
        path: dir.to_path_buf(),
        at: None,
        hint: Some(format!(
            "no model tensors: the checkpoint holds {what}; the model weights are saved in a sibling directory (accelerate: pytorch_model_fsdp_0)"
        )),
    })
}

/// Opens `.distcp` files once each and turns chunks into pieces.
struct Reader<'a> {
    dir: &'a Path,
    files: Vec<Arc<Blob>>,
    by_name: HashMap<String, FileId>,
    /// Every chunk archive to be parsed, in parsing order: file, offset, length.
    ahead: Vec<(FileId, u64, u64)>,
    /// How many of `ahead` have been asked for.
    asked: usize,
    /// How many of `ahead` have been parsed.
    parsed: usize,
    /// See [`SMALL_ARCHIVE`].
    small_archive: u64,
    /// What the chunk archives' pickles would run under `torch.load`.
    unsafe_calls: Vec<crate::scan::UnsafeCall>,
}

/// Chunk archives whose ends are asked for ahead of the parse.
const PREFETCH_CHUNKS: usize = 1024;

/// Bytes asked for at each end of a chunk archive: its zip records and pickle take
/// about 2 KiB at the start and 1 KiB at the end.
const PREFETCH_END: u64 = 4 << 10;

impl Reader<'_> {
    /// Lists the chunk archives that are about to be parsed, in the order they will
    /// be, and asks for the first [`PREFETCH_CHUNKS`] of them. Parsing touches each
    /// archive's two ends one after the other; from a cold cache each touch would wait
    /// for its own disk read, which for a checkpoint of many ranks (hundreds of
    /// thousands of chunks) takes longer than reading the weights. Asking the kernel
    /// for the ends of the next thousand archives keeps the disk busy with many small
    /// reads at once, and no more than a few MB of them ahead of the parse. Files that
    /// do not open are left for the parse to report.
    fn plan_prefetch(&mut self, md: &Metadata, tensors: &[(String, &Entry)]) {
        for (_, entry) in tensors {
            let EntryKind::Tensor { chunks, .. } = &entry.kind else {
                continue;
            };
            for chunk in chunks {
                let key = (entry.fqn.clone(), Some(chunk.offsets.clone()));
                let Some(item) = md.items.get(&key) else {
                    continue;
                };
                if chunk.sizes.contains(&0) || !item.transforms.is_empty() {
                    continue;
                }
                if let Ok(id) = self.file(&item.file, &entry.fqn) {
                    self.ahead.push((id, item.offset, item.length));
                }
            }
        }
        self.prefetch_more();
    }

    /// Notes that one more chunk archive has been parsed and asks for the next.
    fn prefetch_more(&mut self) {
        let until = (self.parsed + PREFETCH_CHUNKS).min(self.ahead.len());
        while self.asked < until {
            let (id, offset, length) = self.ahead[self.asked];
            let blob = &self.files[id];
            if length <= 2 * PREFETCH_END {
                blob.will_need(offset, length);
            } else {
                blob.will_need(offset, PREFETCH_END);
                blob.will_need(offset.saturating_add(length - PREFETCH_END), PREFETCH_END);
            }
            self.asked += 1;
        }
    }

    fn file(&mut self, name: &str, tensor: &str) -> Result<FileId> {
        if let Some(&id) = self.by_name.get(name) {
            return Ok(id);
        }
        let plain = !name.is_empty()
            && name != "."
            && name != ".."
            && !name.contains('/')
            && !name.contains('\\');
        if !plain {
            return Err(Error::corrupt(
                self.dir.join(".metadata"),
                format!("tensor '{tensor}' is stored in '{name}', which is not a file of the checkpoint directory"),
            ));
        }
        let path = self.dir.join(name);
        let blob = Blob::open(&path)?;
        let id = self.files.len();
        self.files.push(Arc::new(blob));
        self.by_name.insert(name.to_string(), id);
        Ok(id)
    }

    /// The bytes of an item as stored: `(file, offset, length)` after checking the
    /// range lies inside its file.
    fn locate(&mut self, item: &Item, what: &str) -> Result<(FileId, u64, u64)> {
        let id = self.file(&item.file, what)?;
        let blob = &self.files[id];
        let end = item.offset.checked_add(item.length);
        match end {
            Some(end) if end <= blob.len() => Ok((id, item.offset, item.length)),
            _ => Err(Error::corrupt(
                &blob.path,
                format!(
                    "{what} is stored at bytes {}..{} but the file has {} bytes; it is truncated or incomplete",
                    item.offset,
                    item.offset.saturating_add(item.length),
                    blob.len()
                ),
            )),
        }
    }

    /// The item's bytes as a torch.save archive: the range of its file, or a
    /// decompressed copy (then a new in-memory file). Returns the file holding them,
    /// the archive's offset in it and its length.
    fn archive(&mut self, item: &Item, what: &str, max_decoded: u64) -> Result<(FileId, u64, u64)> {
        let (id, offset, length) = self.locate(item, what)?;
        if item.transforms.is_empty() {
            return Ok((id, offset, length));
        }
        let path = self.files[id].path.clone();
        if let Some(t) = item.transforms.iter().find(|t| t.as_str() != ZSTD) {
            return Err(Error::Unsupported {
                path,
                what: format!("{what}: the DCP stream transform '{t}'"),
                hint: Some(format!(
                    "unshard decodes only '{ZSTD}' (torch's ZStandard extension); load the checkpoint in Python and save it again without the extension"
                )),
            });
        }
        let mut data = slice(&self.files[id], offset, length).to_vec();
        for _ in &item.transforms {
            data = unzstd(&data, max_decoded)
                .map_err(|m| Error::corrupt(&path, format!("{what}: {m}")))?;
        }
        let len = data.len() as u64;
        let new = self.files.len();
        self.files.push(Arc::new(Blob::owned(path, data)));
        Ok((new, 0, len))
    }

    fn tensor(&mut self, md: &Metadata, name: &str, entry: &Entry) -> Result<TensorSource> {
        let EntryKind::Tensor {
            dtype,
            shape,
            chunks,
        } = &entry.kind
        else {
            return Err(Error::bad_tensor(self.dir, name, "not a tensor entry"));
        };
        let mut pieces = Vec::with_capacity(chunks.len());
        let mut files_used = HashSet::new();
        let mut compressed = false;
        let elem = dtype.size() as u64;
        for chunk in chunks {
            let numel = chunk
                .sizes
                .iter()
                .try_fold(1u64, |a, &n| a.checked_mul(n))
                .and_then(|n| n.checked_mul(elem))
                .ok_or_else(|| {
                    Error::bad_tensor(
                        self.dir,
                        name,
                        format!("chunk sizes {:?} overflow", chunk.sizes),
                    )
                })?;
            if numel == 0 {
                continue;
            }
            let what = format!("tensor '{}' chunk at {:?}", entry.fqn, chunk.offsets);
            let item = md
                .items
                .get(&(entry.fqn.clone(), Some(chunk.offsets.clone())))
                .ok_or_else(|| {
                    Error::corrupt(
                        self.dir.join(".metadata"),
                        format!("{what} has no storage entry"),
                    )
                })?
                .clone();
            // A chunk archive is the tensor's bytes plus a small pickle and zip records.
            let max_decoded = numel.saturating_add(16 << 20);
            let (file, offset, length) = self.archive(&item, &what, max_decoded)?;
            files_used.insert(item.file.clone());
            compressed |= !item.transforms.is_empty();
            let blob = self.files[file].clone();
            // A small archive is read into memory with one positioned read; a large one
            // (mostly tensor bytes) is parsed in the map, where only its two ends are
            // touched. Either way no mapped page stays resident: touching one maps the
            // whole page-cache folio around it (up to 2 MiB), so what the parse touched
            // is released with that margin; a neighbour's pages just fault back in.
            const FOLIO: u64 = 2 << 20;
            let small = length <= self.small_archive && blob.is_mapped();
            let owned;
            let data = if small {
                let mut buf = vec![0; length as usize];
                blob.read_at(offset, &mut buf)?;
                owned = buf;
                &owned[..]
            } else {
                slice(&blob, offset, length)
            };
            if !data.starts_with(b"PK") {
                return Err(Error::Unsupported {
                    path: blob.path.clone(),
                    what: format!("{what}: a DCP item that is not a torch.save archive (safetensors-format DCP)"),
                    hint: Some("save with the default FileSystemWriter, or convert with torch.distributed.checkpoint.format_utils.dcp_to_torch_save".into()),
                });
            }
            let mut payload = torch::read_zip_payload(&blob.path, data, offset)?;
            self.unsafe_calls.append(&mut payload.unsafe_calls);
            if item.transforms.is_empty() {
                self.parsed += 1;
                self.prefetch_more();
            }
            if !small {
                let first = offset / FOLIO * FOLIO;
                blob.release(first, (offset + length).div_ceil(FOLIO) * FOLIO - first);
            }
            let t = match torch::leaf(&payload.pickle, payload.pickle.root()) {
                Ok(Some(Leaf::Tensor(t))) => t,
                Ok(_) => {
                    return Err(Error::corrupt(
                        &blob.path,
                        format!("{what}: the archive does not hold a plain tensor"),
                    ))
                }
                Err(m) => return Err(Error::bad_tensor(&blob.path, name, m)),
            };
            if t.shape != chunk.sizes || t.dtype != *dtype {
                return Err(Error::bad_tensor(
                    &blob.path,
                    name,
                    format!(
                        "the chunk at {:?} holds a {} {:?} tensor where the metadata says {} {:?}",
                        chunk.offsets,
                        t.dtype.safetensors_name(),
                        t.shape,
                        dtype.safetensors_name(),
                        chunk.sizes
                    ),
                ));
            }
            pieces.push(payload.piece(file, name, &t, chunk.offsets.clone())?);
        }
        let split: Vec<String> = (0..shape.len())
            .filter(|&d| chunks.iter().any(|c| c.sizes.get(d) != shape.get(d)))
            .map(|d| d.to_string())
            .collect();
        let kind = if compressed { "DCP (zstd)" } else { "DCP" };
        let layout = match (pieces.len(), split.is_empty()) {
            (1, true) => format!("{kind}, 1 chunk"),
            (n, _) => format!(
                "{kind}, {n} chunks{} in {} file(s)",
                if split.is_empty() {
                    String::new()
                } else {
                    format!(" split on dim {}", split.join(" and "))
                },
                files_used.len()
            ),
        };
        let source = TensorSource {
            name: name.to_string(),
            dtype: *dtype,
            shape: shape.clone(),
            pieces,
            storage: None,
            layout: Some(layout),
        };
        check_coverage(self.dir, &source)?;
        Ok(source)
    }

    /// What a byte entry holds, for `inspect`: small items are unpickled (inertly);
    /// anything unreadable is just described by its size.
    fn describe_bytes(&mut self, md: &Metadata, fqn: &str) -> String {
        let Some(item) = md.items.get(&(fqn.to_string(), None)).cloned() else {
            return "non-tensor entry (no storage entry)".into();
        };
        let fallback = format!("non-tensor entry ({} bytes)", item.length);
        if item.length > 1 << 20 {
            return fallback;
        }
        let Ok((file, offset, length)) = self.locate(&item, fqn) else {
            return fallback;
        };
        let blob = self.files[file].clone();
        let mut data = slice(&blob, offset, length).to_vec();
        for t in &item.transforms {
            match (t.as_str(), unzstd(&data, 1 << 20)) {
                (ZSTD, Ok(d)) => data = d,
                _ => return fallback,
            }
        }
        match torch::read_zip_payload(&blob.path, &data, 0) {
            Ok(mut payload) => {
                self.unsafe_calls.append(&mut payload.unsafe_calls);
                torch::describe(&payload.pickle, payload.pickle.root())
            }
            Err(_) => fallback,
        }
    }
}

/// A checked range of a blob (callers checked it already; empty if not).
fn slice(blob: &Blob, offset: u64, length: u64) -> &[u8] {
    let start = usize::try_from(offset).unwrap_or(usize::MAX);
    let end = offset
        .checked_add(length)
        .and_then(|e| usize::try_from(e).ok())
        .unwrap_or(usize::MAX);
    blob.bytes().get(start..end).unwrap_or(&[])
}

/// Decompresses a zstd stream, refusing to produce more than `limit` bytes.
fn unzstd(data: &[u8], limit: u64) -> std::result::Result<Vec<u8>, String> {
    let decoder = zstd::stream::read::Decoder::new(data)
        .map_err(|e| format!("cannot start zstd decompression: {e}"))?;
    let mut out = Vec::new();
    decoder
        .take(limit.saturating_add(1))
        .read_to_end(&mut out)
        .map_err(|e| format!("the zstd stream is corrupt: {e}"))?;
    if out.len() as u64 > limit {
        return Err(format!(
            "the zstd stream decompresses to more than the {limit} bytes the chunk can hold"
        ));
    }
    Ok(out)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::write::read_tensor;

    /// Every chunk archive of a real DCP directory parsed in the map gives the same
    /// tensors, byte for byte, as read into memory (the fixtures' archives are small,
    /// so `open` reads them all with `pread`).
    #[test]
    fn archives_parsed_in_the_map_or_in_memory_give_the_same_tensors() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/sharded/llama_w3_dcp");
        let opts = OpenOptions::default();
        let in_memory = open_with(&dir, &opts, u64::MAX).unwrap();
        let in_map = open_with(&dir, &opts, 0).unwrap();
        assert_eq!(in_memory.tensors.len(), in_map.tensors.len());
        assert!(in_map.tensors.iter().any(|t| t.pieces.len() == 3));
        for (a, b) in in_memory.tensors.iter().zip(&in_map.tensors) {
            assert_eq!(a.name, b.name);
            assert_eq!(a.pieces.len(), b.pieces.len());
            let (x, _) = read_tensor(&in_memory.files, a, a.dtype).unwrap();
            let (y, _) = read_tensor(&in_map.files, b, b.dtype).unwrap();
            assert_eq!(x, y, "{}", a.name);
        }
    }
}
