//! The two kinds of file in a DeepSpeed tag folder, read into plain values.
//!
//! `*_model_states.pt` holds the module's state dict (16-bit; under ZeRO-3 every
//! partitioned parameter is a `[0]`-shaped placeholder), `param_shapes` (one ordered
//! `{name: torch.Size}` per optimizer parameter group, in the order the parameters
//! were flattened), `buffer_names`, `shared_params` (`{alias: name}`) and, for
//! frozen parameters, `frozen_param_shapes` / `frozen_param_fragments`.
//! `*_optim_states.pt` holds, under `optimizer_state_dict`, this rank's flat fp32
//! partition of every group (`single_partition_of_fp32_groups` for ZeRO-1/2 and
//! `BF16_Optimizer`, `fp32_flat_groups` for ZeRO-3), `partition_count`,
//! `zero_stage` and the wrapped optimizer's own state (Adam moments), which is
//! described but never read.
//!
//! Only the pickles are parsed; every tensor is kept as a reference to its storage.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use unshard_pickle::{NodeId, Pickle, Value};

use super::super::torch::{
    self, dict_get, dict_of, dims_of, int_of, seq_of, str_of, Leaf, PayloadTemplate,
    TemplateReader, TensorRef, TorchPayload,
};
use super::super::{Blob, Piece};
use crate::bytes::{fs, FilePool, PooledFile};
use crate::error::{Error, Result};

/// A parsed `torch.save` file of the tag folder.
pub struct Parsed {
    pub path: PathBuf,
    pub blob: Arc<Blob>,
    pub payload: TorchPayload,
}

impl Parsed {
    /// Opens and parses a file; with a pool, its descriptor is the pool's (opened on
    /// demand, closed when others need the room), so that a folder of more rank
    /// files than the limit on open files is read.
    pub fn open(path: &Path, pool: Option<&Arc<FilePool>>) -> Result<Parsed> {
        let blob = Self::blob(path, pool)?;
        let payload = torch::read_zip_file(&blob)?;
        Ok(Parsed {
            path: path.to_path_buf(),
            blob,
            payload,
        })
    }

    fn blob(path: &Path, pool: Option<&Arc<FilePool>>) -> Result<Arc<Blob>> {
        Ok(Arc::new(match pool {
            Some(pool) if !fs::is_url(path) => Blob::new(Arc::new(PooledFile::open(path, pool)?)),
            _ => fs::open(path)?,
        }))
    }

    /// [`Parsed::open`], keeping the file's pickle as a template for the other
    /// ranks' files of its kind (`None` when it cannot be one, e.g. a pickle that
    /// calls something unsafe).
    pub fn open_as_template(
        path: &Path,
        pool: Option<&Arc<FilePool>>,
    ) -> Result<(Parsed, Option<PayloadTemplate>)> {
        let blob = Self::blob(path, pool)?;
        let (payload, template) = torch::read_zip_file_as_template(&blob)?;
        let parsed = Parsed {
            path: path.to_path_buf(),
            blob,
            payload,
        };
        Ok((parsed, template))
    }

    /// [`Parsed::open`] through a reader of the first rank's template: a file
    /// whose pickle differs from it only in free integers and strings (a
    /// partition's length, a rank number) borrows the reader's copy of its arena
    /// with those values changed instead of being parsed. Give the payload back
    /// with [`TemplateReader::done`] before the next file.
    pub fn open_from(
        path: &Path,
        pool: Option<&Arc<FilePool>>,
        reader: Option<&mut TemplateReader<'_>>,
    ) -> Result<Parsed> {
        let Some(reader) = reader else {
            return Self::open(path, pool);
        };
        let blob = Self::blob(path, pool)?;
        let payload = reader.read(&blob)?;
        Ok(Parsed {
            path: path.to_path_buf(),
            blob,
            payload,
        })
    }

    fn p(&self) -> &Pickle {
        &self.payload.pickle
    }

    fn bad(&self, msg: impl Into<String>) -> Error {
        Error::corrupt(&self.path, msg)
    }

    /// A top-level key of the root dict.
    fn top(&self, key: &str) -> Option<NodeId> {
        dict_get(self.p(), self.p().root(), key)
    }

    /// A tensor node as a plain tensor reference.
    pub fn tensor(&self, name: &str, id: NodeId) -> Result<TensorRef> {
        match torch::leaf(self.p(), id) {
            Ok(Some(Leaf::Tensor(t))) => Ok(t),
            Ok(_) => Err(Error::bad_tensor(&self.path, name, "is not a plain tensor")),
            Err(m) => Err(Error::bad_tensor(&self.path, name, m)),
        }
    }

    /// The contiguous 1-D run of elements a flat tensor occupies in the file.
    pub fn flat(&self, name: &str, id: NodeId, file: usize) -> Result<Flat> {
        let t = self.tensor(name, id)?;
        let numel: u64 = t.shape.iter().product();
        let contiguous = super::super::contiguous_strides(&t.shape);
        if t.strides != contiguous && numel > 1 {
            return Err(Error::bad_tensor(
                &self.path,
                name,
                format!(
                    "shape {:?} with strides {:?} is not contiguous",
                    t.shape, t.strides
                ),
            ));
        }
        let piece = self.payload.piece(file, name, &t, vec![0; t.shape.len()])?;
        Ok(Flat { piece, numel })
    }
}

/// A contiguous run of elements in a file: a flat partition or a whole tensor.
#[derive(Clone, Debug)]
pub struct Flat {
    /// The tensor as stored (its byte offset, dtype, byte order).
    pub piece: Piece,
    pub numel: u64,
}

/// What a model-states file says about the model.
pub struct ModelStates {
    /// `module`: `(name, tensor node)` in the model's order.
    pub module: Vec<(String, NodeId)>,
    pub buffer_names: Vec<String>,
    /// One `[(name, shape)]` per parameter group, in flattening order.
    pub param_shapes: Vec<Vec<(String, Vec<u64>)>>,
    pub frozen_shapes: Vec<(String, Vec<u64>)>,
    /// `frozen_param_fragments`: `(name, tensor node)`.
    pub frozen_fragments: Vec<(String, NodeId)>,
    /// `shared_params`: `(alias, name)`.
    pub shared: Vec<(String, String)>,
    /// `ds_version`, for `inspect`.
    pub version: Option<String>,
}

/// Whether a parsed pickle is a DeepSpeed model-states dict.
pub fn is_model_states(p: &Pickle) -> bool {
    let root = p.root();
    dict_get(p, root, "param_shapes").is_some() && dict_get(p, root, "buffer_names").is_some()
}

/// Whether a parsed pickle is one rank's DeepSpeed optimizer-states dict.
pub fn is_optim_states(p: &Pickle) -> bool {
    dict_get(p, p.root(), "optimizer_state_dict").is_some_and(|o| {
        ["single_partition_of_fp32_groups", "fp32_flat_groups"]
            .iter()
            .any(|k| dict_get(p, o, k).is_some())
    })
}

pub fn model_states(f: &Parsed) -> Result<ModelStates> {
    let p = f.p();
    if !is_model_states(p) {
        return Err(f.bad("not a DeepSpeed model-states file: no 'param_shapes' or 'buffer_names'"));
    }
    let module = match f.top("module").and_then(|m| dict_of(p, m)) {
        Some(items) => items
            .iter()
            .map(|(k, v)| {
                let k = str_of(p, *k).ok_or_else(|| f.bad("a 'module' key is not a string"))?;
                Ok((k.to_string(), *v))
            })
            .collect::<Result<Vec<_>>>()?,
        None => return Err(f.bad("no 'module' state dict")),
    };
    let strings = |key: &str| -> Result<Vec<String>> {
        match f.top(key).map(|id| p.get(id)) {
            None | Some(Value::None) => Ok(Vec::new()),
            Some(Value::List(v) | Value::Tuple(v) | Value::Set(v) | Value::FrozenSet(v)) => v
                .iter()
                .map(|&s| {
                    str_of(p, s)
                        .map(str::to_string)
                        .ok_or_else(|| f.bad(format!("'{key}' holds a non-string")))
                })
                .collect(),
            Some(_) => Err(f.bad(format!("'{key}' is not a list"))),
        }
    };
    let buffer_names = strings("buffer_names")?;
    let shapes_of = |id: NodeId, what: &str| -> Result<Vec<(String, Vec<u64>)>> {
        let items = dict_of(p, id).ok_or_else(|| f.bad(format!("'{what}' is not a dict")))?;
        items
            .iter()
            .map(|(k, v)| {
                let k = str_of(p, *k)
                    .ok_or_else(|| f.bad(format!("a '{what}' key is not a string")))?;
                let s = dims_of(p, *v).ok_or_else(|| {
                    f.bad(format!(
                        "'{what}' gives '{k}' a shape that is not a torch.Size"
                    ))
                })?;
                // Element counts are summed and multiplied later: refuse shapes
                // whose element count does not fit, so nothing there can overflow.
                if s.iter()
                    .try_fold(1u64, |a, &d| a.checked_mul(d))
                    .filter(|&n| n < 1 << 60)
                    .is_none()
                {
                    return Err(f.bad(format!("'{what}' gives '{k}' the shape {s:?}, too large")));
                }
                Ok((k.to_string(), s))
            })
            .collect()
    };
    let param_shapes = match f.top("param_shapes").map(|id| (id, p.get(id))) {
        Some((_, Value::List(groups) | Value::Tuple(groups))) => groups
            .iter()
            .map(|&g| shapes_of(g, "param_shapes"))
            .collect::<Result<Vec<_>>>()?,
        // Older DeepSpeed saved a single dict.
        Some((id, Value::Dict(_))) => vec![shapes_of(id, "param_shapes")?],
        _ => return Err(f.bad("'param_shapes' is not a list of dicts")),
    };
    let frozen_shapes = match f.top("frozen_param_shapes") {
        Some(id) if !matches!(p.get(id), Value::None) => shapes_of(id, "frozen_param_shapes")?,
        _ => Vec::new(),
    };
    let frozen_fragments = match f.top("frozen_param_fragments") {
        Some(id) if !matches!(p.get(id), Value::None) => dict_of(p, id)
            .ok_or_else(|| f.bad("'frozen_param_fragments' is not a dict"))?
            .iter()
            .map(|(k, v)| {
                let k = str_of(p, *k)
                    .ok_or_else(|| f.bad("a 'frozen_param_fragments' key is not a string"))?;
                Ok((k.to_string(), *v))
            })
            .collect::<Result<Vec<_>>>()?,
        _ => Vec::new(),
    };
    let shared = match f.top("shared_params") {
        Some(id) if !matches!(p.get(id), Value::None) => dict_of(p, id)
            .ok_or_else(|| f.bad("'shared_params' is not a dict"))?
            .iter()
            .map(|(k, v)| match (str_of(p, *k), str_of(p, *v)) {
                (Some(a), Some(b)) => Ok((a.to_string(), b.to_string())),
                _ => Err(f.bad("'shared_params' holds a non-string")),
            })
            .collect::<Result<Vec<_>>>()?,
        _ => Vec::new(),
    };
    let version = f
        .top("ds_version")
        .and_then(|v| str_of(p, v))
        .map(str::to_string);
    Ok(ModelStates {
        module,
        buffer_names,
        param_shapes,
        frozen_shapes,
        frozen_fragments,
        shared,
        version,
    })
}

/// What one rank's optimizer-states file holds.
pub struct OptimStates {
    /// `zero_stage` (absent in `BF16_Optimizer` files).
    pub stage: Option<i64>,
    /// `partition_count`: the data-parallel world size (the largest, when per group).
    pub partition_count: u64,
    /// This rank's flat fp32 partition of each group (tensor nodes).
    pub groups: Vec<NodeId>,
    /// Which key held them.
    pub groups_key: &'static str,
    /// `param_alignment_paddings`: elements left after each parameter, per group.
    pub alignment_paddings: Option<Vec<Vec<u64>>>,
    /// Number of tensors in the wrapped optimizer's state (moments), not read.
    pub moments: usize,
}

pub fn optim_states(f: &Parsed) -> Result<OptimStates> {
    let p = f.p();
    let osd = f
        .top("optimizer_state_dict")
        .filter(|&id| dict_of(p, id).is_some())
        .ok_or_else(|| f.bad("not a DeepSpeed optimizer-states file: no 'optimizer_state_dict'"))?;
    let get = |k: &str| dict_get(p, osd, k);
    // `ZeroStageEnum(2)` is pickled as a call; older files hold a plain int.
    let stage = get("zero_stage").and_then(|id| {
        int_of(p, id).or_else(|| match p.get(id) {
            Value::Object { args, .. } => int_of(p, *seq_of(p, *args)?.first()?),
            _ => None,
        })
    });
    let partition_count = match get("partition_count").map(|id| (id, p.get(id))) {
        Some((id, Value::Int(_))) => int_of(p, id).and_then(|i| u64::try_from(i).ok()),
        Some((id, Value::List(_) | Value::Tuple(_))) => seq_of(p, id).and_then(|v| {
            v.iter()
                .map(|&x| int_of(p, x).and_then(|i| u64::try_from(i).ok()))
                .collect::<Option<Vec<u64>>>()
                .and_then(|v| v.into_iter().max())
        }),
        _ => None,
    }
    .filter(|&n| n > 0)
    .ok_or_else(|| f.bad("'partition_count' is missing or not a positive int"))?;
    let (groups_key, groups) = ["fp32_flat_groups", "single_partition_of_fp32_groups"]
        .into_iter()
        .find_map(|k| Some((k, get(k)?)))
        .ok_or_else(|| {
            f.bad("no fp32 master weights: neither 'single_partition_of_fp32_groups' nor 'fp32_flat_groups'")
        })?;
    let groups = seq_of(p, groups)
        .ok_or_else(|| f.bad(format!("'{groups_key}' is not a list")))?
        .to_vec();
    let alignment_paddings = match get("param_alignment_paddings") {
        Some(id) if !matches!(p.get(id), Value::None) => Some(
            seq_of(p, id)
                .and_then(|g| {
                    g.iter()
                        .map(|&l| {
                            seq_of(p, l)?
                                .iter()
                                .map(|&x| int_of(p, x).and_then(|i| u64::try_from(i).ok()))
                                .collect::<Option<Vec<u64>>>()
                        })
                        .collect::<Option<Vec<_>>>()
                })
                .ok_or_else(|| f.bad("'param_alignment_paddings' is not a list of int lists"))?,
        ),
        _ => None,
    };
    let moments = ["optimizer_state_dict", "base_optimizer_state"]
        .into_iter()
        .filter_map(get)
        .map(|id| count_tensors(p, id, 0))
        .sum();
    Ok(OptimStates {
        stage,
        partition_count,
        groups,
        groups_key,
        alignment_paddings,
        moments,
    })
}

/// Counts tensor nodes under a value, for the note on skipped optimizer moments.
fn count_tensors(p: &Pickle, id: NodeId, depth: usize) -> usize {
    if depth > 16 {
        return 0;
    }
    if torch::is_tensor_like(p, id) {
        return 1;
    }
    match p.get(id) {
        Value::Dict(items) => items
            .iter()
            .map(|(_, v)| count_tensors(p, *v, depth + 1))
            .sum(),
        Value::List(v) | Value::Tuple(v) => v.iter().map(|x| count_tensors(p, *x, depth + 1)).sum(),
        _ => 0,
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::source::torch::{StorageLoc, Storages};

    /// A Python value, pickled with protocol 2 opcodes.
    enum Py {
        None,
        False,
        Int(i64),
        Str(&'static str),
        Tuple(Vec<Py>),
        List(Vec<Py>),
        Dict(Vec<(&'static str, Py)>),
        /// `module.name(*args)`.
        Call(&'static str, &'static str, Vec<Py>),
        /// The class `module.name`.
        Global(&'static str, &'static str),
        /// A persistent id (what a storage is pickled as).
        Pid(Box<Py>),
    }
    use Py::*;

    impl Py {
        fn pickle(&self, out: &mut Vec<u8>) {
            match self {
                None => out.push(b'N'),
                False => out.push(0x89),
                Int(i) => {
                    out.extend([0x8a, 8]);
                    out.extend(i.to_le_bytes());
                }
                Str(s) => {
                    out.push(b'X');
                    out.extend((s.len() as u32).to_le_bytes());
                    out.extend(s.as_bytes());
                }
                Tuple(v) => {
                    out.push(b'(');
                    v.iter().for_each(|x| x.pickle(out));
                    out.push(b't');
                }
                List(v) => {
                    out.extend(b"](");
                    v.iter().for_each(|x| x.pickle(out));
                    out.push(b'e');
                }
                Dict(items) => {
                    out.extend(b"}(");
                    for (k, v) in items {
                        Str(k).pickle(out);
                        v.pickle(out);
                    }
                    out.push(b'u');
                }
                Call(module, name, args) => {
                    Global(module, name).pickle(out);
                    out.push(b'(');
                    args.iter().for_each(|x| x.pickle(out));
                    out.extend(b"tR");
                }
                Global(module, name) => out.extend(format!("c{module}\n{name}\n").as_bytes()),
                Pid(v) => {
                    v.pickle(out);
                    out.push(b'Q');
                }
            }
        }
    }

    fn size(dims: &[i64]) -> Py {
        Tuple(dims.iter().map(|&d| Int(d)).collect())
    }

    /// A float32 tensor of `shape` and `strides` on the 16-element storage '0'.
    fn tensor(shape: &[i64], strides: &[i64]) -> Py {
        let storage = Tuple(vec![
            Str("storage"),
            Global("torch", "FloatStorage"),
            Str("0"),
            Str("cpu"),
            Int(16),
        ]);
        Call(
            "torch._utils",
            "_rebuild_tensor_v2",
            vec![
                Pid(Box::new(storage)),
                Int(0),
                size(shape),
                size(strides),
                False,
                Dict(vec![]),
            ],
        )
    }

    /// A parsed file holding `root`, and a storage '0' of 16 float32 elements.
    fn parsed(root: &Py) -> Parsed {
        let mut bytes = vec![0x80, 2];
        root.pickle(&mut bytes);
        bytes.push(b'.');
        let path = PathBuf::from("rank.pt");
        let mut storages = Storages::default();
        storages.insert(
            "0".into(),
            StorageLoc {
                offset: 0,
                len: 64,
                inflated: false,
            },
        );
        Parsed {
            path: path.clone(),
            blob: Arc::new(Blob::owned(path.clone(), vec![0; 64])),
            payload: TorchPayload {
                path,
                pickle: unshard_pickle::parse(&bytes).unwrap(),
                storages,
                big_endian: false,
                unsafe_calls: Vec::new(),
                inflated: Vec::new(),
                inflated_file: Option::None,
            },
        }
    }

    fn root(f: &Parsed) -> NodeId {
        f.p().root()
    }

    #[test]
    fn a_flat_partition_is_contiguous() {
        let f = parsed(&List(vec![
            tensor(&[16], &[1]),
            tensor(&[4, 4], &[4, 1]),
            // One element: its stride says nothing.
            tensor(&[1], &[7]),
            tensor(&[1, 1], &[3, 5]),
            // Every other element, or a transposed matrix.
            tensor(&[8], &[2]),
            tensor(&[4, 4], &[1, 4]),
        ]));
        let items = seq_of(f.p(), root(&f)).unwrap().to_vec();
        for (i, &id) in items.iter().enumerate() {
            let got = f.flat("p", id, 3);
            if i < 4 {
                let flat = got.unwrap();
                assert_eq!(flat.piece.file, 3);
                assert_eq!(flat.numel, [16, 16, 1, 1][i]);
            } else {
                let e = got.unwrap_err().to_string();
                assert!(e.contains("is not contiguous"), "{i}: {e}");
            }
        }
    }

    #[test]
    fn the_two_kinds_of_file_are_told_by_their_keys() {
        let is_model = |v: Py| is_model_states(parsed(&v).p());
        let is_optim = |v: Py| is_optim_states(parsed(&v).p());
        let shapes = || ("param_shapes", List(vec![]));
        let buffers = || ("buffer_names", List(vec![]));
        assert!(is_model(Dict(vec![shapes(), buffers()])));
        assert!(!is_model(Dict(vec![shapes()])));
        assert!(!is_model(Dict(vec![buffers()])));
        let osd = |k: &'static str| {
            Dict(vec![(
                "optimizer_state_dict",
                Dict(vec![(k, List(vec![]))]),
            )])
        };
        assert!(is_optim(osd("fp32_flat_groups")));
        assert!(is_optim(osd("single_partition_of_fp32_groups")));
        assert!(!is_optim(osd("state")));
        assert!(!is_optim(Dict(vec![("fp32_flat_groups", List(vec![]))])));
    }

    fn model(entries: Vec<(&'static str, Py)>) -> Result<ModelStates> {
        let mut all = vec![
            ("module", Dict(vec![("w", None), ("b", None)])),
            ("buffer_names", List(vec![Str("b")])),
        ];
        all.extend(entries);
        model_states(&parsed(&Dict(all)))
    }

    #[test]
    fn model_states_of_older_and_newer_files() {
        // Older DeepSpeed: one param_shapes dict, None where nothing is recorded.
        let m = model(vec![
            ("param_shapes", Dict(vec![("w", size(&[2, 3]))])),
            ("frozen_param_shapes", None),
            ("frozen_param_fragments", None),
            ("shared_params", None),
        ])
        .unwrap();
        assert_eq!(m.param_shapes, [vec![("w".to_string(), vec![2, 3])]]);
        assert!(m.frozen_shapes.is_empty() && m.frozen_fragments.is_empty());
        assert!(m.shared.is_empty());
        assert_eq!(m.buffer_names, ["b"]);
        // Newer: a list of group dicts, and each record present.
        let m = model(vec![
            (
                "param_shapes",
                List(vec![
                    Dict(vec![("w", size(&[2, 3]))]),
                    Dict(vec![("v", size(&[4]))]),
                ]),
            ),
            ("frozen_param_shapes", Dict(vec![("e", size(&[5]))])),
            ("frozen_param_fragments", Dict(vec![("e", None)])),
            ("shared_params", Dict(vec![("head", Str("e"))])),
        ])
        .unwrap();
        assert_eq!(m.param_shapes.len(), 2);
        assert_eq!(m.frozen_shapes, [("e".to_string(), vec![5])]);
        assert_eq!(m.frozen_fragments.len(), 1);
        assert_eq!(m.shared, [("head".to_string(), "e".to_string())]);
        // Anything else is refused.
        for (key, v, says) in [
            (
                "param_shapes",
                Int(1),
                "'param_shapes' is not a list of dicts",
            ),
            (
                "frozen_param_shapes",
                Int(1),
                "'frozen_param_shapes' is not a dict",
            ),
            (
                "frozen_param_fragments",
                Int(1),
                "'frozen_param_fragments' is not a dict",
            ),
            ("shared_params", Int(1), "'shared_params' is not a dict"),
            (
                "shared_params",
                Dict(vec![("head", Int(1))]),
                "holds a non-string",
            ),
        ] {
            let mut entries = vec![("param_shapes", List(vec![]))];
            entries.retain(|(k, _)| *k != key);
            entries.push((key, v));
            let e = model(entries).err().unwrap().to_string();
            assert!(e.contains(says), "{key}: {e}");
        }
    }

    #[test]
    fn a_shape_of_two_to_the_sixty_elements_is_refused() {
        let shapes = |n: i64| {
            model(vec![(
                "param_shapes",
                List(vec![Dict(vec![("w", size(&[2, n]))])]),
            )])
        };
        assert_eq!(
            shapes((1 << 59) - 1).unwrap().param_shapes[0][0].1[1],
            (1 << 59) - 1
        );
        let e = shapes(1 << 59).err().unwrap().to_string();
        assert!(e.contains("too large"), "{e}");
    }

    fn optim(entries: Vec<(&'static str, Py)>) -> Result<OptimStates> {
        optim_states(&parsed(&Dict(vec![(
            "optimizer_state_dict",
            Dict(entries),
        )])))
    }

    fn moment() -> Py {
        Call("torch._utils", "_rebuild_tensor_v2", vec![])
    }

    #[test]
    fn optim_states_of_each_kind() {
        // ZeRO-2: the stage as a ZeroStageEnum, one partition count per group.
        let o = optim(vec![
            (
                "zero_stage",
                Call(
                    "deepspeed.runtime.zero.config",
                    "ZeroStageEnum",
                    vec![Int(2)],
                ),
            ),
            ("partition_count", List(vec![Int(3), Int(4)])),
            ("single_partition_of_fp32_groups", List(vec![None, None])),
            (
                "param_alignment_paddings",
                List(vec![List(vec![Int(0), Int(2)])]),
            ),
            (
                "base_optimizer_state",
                Dict(vec![(
                    "state",
                    List(vec![moment(), Dict(vec![("m", moment())])]),
                )]),
            ),
        ])
        .unwrap();
        assert_eq!((o.stage, o.partition_count), (Some(2), 4));
        assert_eq!(
            (o.groups.len(), o.groups_key),
            (2, "single_partition_of_fp32_groups")
        );
        assert_eq!(o.alignment_paddings, Some(vec![vec![0, 2]]));
        assert_eq!(o.moments, 2);
        // ZeRO-3: plain ints; no paddings recorded.
        let o = optim(vec![
            ("zero_stage", Int(3)),
            ("partition_count", Int(2)),
            ("fp32_flat_groups", List(vec![None])),
            ("param_alignment_paddings", None),
        ])
        .unwrap();
        assert_eq!(
            (o.stage, o.partition_count, o.groups_key),
            (Some(3), 2, "fp32_flat_groups")
        );
        assert_eq!((o.alignment_paddings, o.moments), (Option::None, 0));
        for count in [Int(0), List(vec![Int(0)]), Int(-1), None] {
            let e = optim(vec![
                ("partition_count", count),
                ("fp32_flat_groups", List(vec![])),
            ])
            .err()
            .unwrap()
            .to_string();
            assert!(
                e.contains("'partition_count' is missing or not a positive int"),
                "{e}"
            );
        }
    }

    #[test]
    fn moments_are_counted_sixteen_levels_deep() {
        // A tensor under `depth` lists.
        let nested = |depth: usize| {
            let mut v = moment();
            for _ in 0..depth {
                v = List(vec![v]);
            }
            v
        };
        let count = |v: Py| {
            let f = parsed(&v);
            count_tensors(f.p(), root(&f), 0)
        };
        assert_eq!(count(nested(16)), 1);
        assert_eq!(count(nested(17)), 0);
        // The same through dicts.
        let in_dicts = |depth: usize| {
            let mut v = moment();
            for _ in 0..depth {
                v = Dict(vec![("state", v)]);
            }
            v
        };
        assert_eq!(count(in_dicts(16)), 1);
        assert_eq!(count(in_dicts(17)), 0);
        assert_eq!(count(Tuple(vec![nested(3), moment(), Int(1)])), 2);
        assert_eq!(count(Dict(vec![("a", moment()), ("b", nested(2))])), 2);
    }
}
