//! The rebuild calls that make a tensor: `torch._utils._rebuild_tensor_v2` and
//! friends, parameters wrapping them, and tensor subclasses pickled without data
//! (DTensor, ShardedTensor), read as descriptions, never executed.

use unshard_pickle::{NodeId, Pickle, Value};

use super::values::{
    call_of, dict_get, dict_of, dims_of, dtype_of, global_of, int_of, seq_of, str_of,
};
use crate::dtype::DType;

/// A tensor as torch rebuilds it: a strided view of a storage.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorRef {
    /// Key of the storage it views.
    pub key: String,
    /// Element type.
    pub dtype: DType,
    /// Offset of the view into the storage, in elements.
    pub offset: u64,
    /// Shape of the view.
    pub shape: Vec<u64>,
    /// Element strides of the view.
    pub strides: Vec<u64>,
}

/// A tensor subclass pickled without data (`_rebuild_wrapper_subclass`): DTensor,
/// ShardedTensor. `state` holds its parts; `sharded.rs` interprets them.
#[derive(Clone, Debug)]
pub struct SubclassRef {
    /// Module of the subclass (`torch.distributed.tensor`).
    pub module: String,
    /// Class name (`DTensor`, `ShardedTensor`).
    pub class: String,
    /// Global dtype, when given.
    pub dtype: Option<DType>,
    /// Global shape.
    pub shape: Vec<u64>,
    /// The pickled state holding the local data and layout.
    pub state: Option<NodeId>,
}

/// A value that is a tensor of some kind.
#[derive(Clone, Debug)]
pub enum Leaf {
    /// A plain tensor: a view of a storage.
    Tensor(TensorRef),
    /// A tensor subclass without its own storage.
    Subclass(SubclassRef),
}

const REBUILD_TENSOR: &[&str] = &[
    "_rebuild_tensor",
    "_rebuild_tensor_v2",
    "_rebuild_tensor_v3",
];

/// Whether a node looks like a tensor (without validating it).
pub fn is_tensor_like(p: &Pickle, id: NodeId) -> bool {
    match call_of(p, id) {
        Some(((m, n), _, _)) => {
            (m == "torch._utils" && n.starts_with("_rebuild_"))
                || (m == "torch._tensor" && n == "_rebuild_from_type_v2")
                || (m == "torch.nn.parameter" && n == "Parameter")
        }
        None => false,
    }
}

/// Interprets a tensor-like node. `Ok(None)` = not a tensor; `Err(msg)` = a tensor
/// unshard cannot represent (the caller adds the file and key).
pub fn leaf(p: &Pickle, id: NodeId) -> std::result::Result<Option<Leaf>, String> {
    leaf_at(p, id, 0)
}

fn leaf_at(p: &Pickle, id: NodeId, depth: usize) -> std::result::Result<Option<Leaf>, String> {
    if depth > 8 {
        return Err("tensor rebuild calls nest too deeply".into());
    }
    let Some(((module, name), args, state)) = call_of(p, id) else {
        return Ok(None);
    };
    apply(p, (module, name), args, state, depth)
}

fn apply(
    p: &Pickle,
    (module, name): (&str, &str),
    args: &[NodeId],
    state: Option<NodeId>,
    depth: usize,
) -> std::result::Result<Option<Leaf>, String> {
    let arg = |i: usize| -> std::result::Result<NodeId, String> {
        args.get(i)
            .copied()
            .ok_or_else(|| format!("{module}.{name} called with {} argument(s)", args.len()))
    };
    match (module, name) {
        ("torch._utils", n) if REBUILD_TENSOR.contains(&n) => {
            rebuild_tensor(p, n, args).map(|t| Some(Leaf::Tensor(t)))
        }
        (
            "torch._utils",
            "_rebuild_parameter"
            | "_rebuild_parameter_with_state"
            | "_rebuild_device_tensor_from_cpu_tensor",
        )
        | ("torch.nn.parameter", "Parameter") => {
            let inner = arg(0)?;
            match leaf_at(p, inner, depth + 1)? {
                Some(l) => Ok(Some(l)),
                None => Err(format!("{module}.{name} does not wrap a tensor")),
            }
        }
        ("torch._tensor", "_rebuild_from_type_v2") => {
            let func = arg(0)?;
            let new_type = arg(1)?;
            let fargs =
                seq_of(p, arg(2)?).ok_or("_rebuild_from_type_v2 arguments are not a tuple")?;
            let fstate = args.get(3).copied().or(state);
            let f = global_of(p, func).ok_or("_rebuild_from_type_v2 of a non-global function")?;
            if f == ("torch._utils", "_rebuild_wrapper_subclass") {
                let (m, c) = global_of(p, new_type).unwrap_or(("?", "?"));
                let dtype = fargs.get(1).and_then(|&d| dtype_of(p, d));
                let shape = fargs
                    .get(2)
                    .and_then(|&s| dims_of(p, s))
                    .unwrap_or_default();
                return Ok(Some(Leaf::Subclass(SubclassRef {
                    module: m.to_string(),
                    class: c.to_string(),
                    dtype,
                    shape,
                    state: fstate,
                })));
            }
            apply(p, f, fargs, None, depth + 1)
        }
        ("torch._utils", "_rebuild_qtensor") => Err(
            "quantized tensors are not supported; dequantize before saving (tensor.dequantize())"
                .into(),
        ),
        ("torch._utils", n) if n.starts_with("_rebuild_sparse") => {
            Err("sparse tensors are not supported; save tensor.to_dense()".into())
        }
        ("torch._utils", "_rebuild_nested_tensor") => {
            Err("nested tensors are not supported".into())
        }
        ("torch._utils", "_rebuild_meta_tensor_no_storage") => {
            Err("a meta tensor has no data (it was saved from a model on the meta device)".into())
        }
        ("torch._utils", n) => Err(format!("unsupported tensor kind torch._utils.{n}")),
        _ => Ok(None),
    }
}

fn rebuild_tensor(
    p: &Pickle,
    which: &str,
    args: &[NodeId],
) -> std::result::Result<TensorRef, String> {
    let need = match which {
        "_rebuild_tensor" => 4,
        "_rebuild_tensor_v2" => 6,
        _ => 7,
    };
    if args.len() < need {
        return Err(format!(
            "{which} called with {} arguments, expected {need}",
            args.len()
        ));
    }
    let Value::PersistentId(pid) = p.get(args[0]) else {
        return Err(format!("{which}: the storage is not a persistent id"));
    };
    let pid = seq_of(p, *pid).ok_or("the storage persistent id is not a tuple")?;
    if pid.len() < 5 || str_of(p, pid[0]) != Some("storage") {
        return Err("the persistent id is not a ('storage', ...) tuple".into());
    }
    let (_, storage_class) = global_of(p, pid[1]).ok_or("the storage type is not a class")?;
    let key = match p.get(pid[2]) {
        Value::Str(s) => s.clone(),
        Value::Int(i) => i.to_string(),
        _ => return Err("the storage key is not a string".into()),
    };
    let dtype = if storage_class == "UntypedStorage" {
        if which != "_rebuild_tensor_v3" {
            return Err("an untyped storage without a dtype".into());
        }
        let d = args[6];
        dtype_of(p, d).ok_or_else(|| match global_of(p, d) {
            Some((m, n)) => format!("unsupported dtype {m}.{n}"),
            None => "the dtype argument is not a dtype".into(),
        })?
    } else {
        DType::from_storage_class(storage_class).ok_or_else(|| {
            if storage_class.starts_with("Complex") {
                "complex tensors are not supported (no Hugging Face model stores complex weights); save the real and imaginary parts as separate tensors".to_string()
            } else if storage_class.starts_with("Q") {
                format!(
                    "quantized storage {storage_class} is not supported; dequantize before saving"
                )
            } else {
                format!("unsupported storage type {storage_class}")
            }
        })?
    };
    let mut offset = int_of(p, args[1])
        .and_then(|i| u64::try_from(i).ok())
        .ok_or("the storage offset is not a non-negative int")?;
    // Very old legacy files: ('storage', T, root_key, loc, numel, (view_key, offset, size)).
    if let Some(&view) = pid.get(5) {
        if let Some(v) = seq_of(p, view) {
            let extra = v
                .get(1)
                .and_then(|&o| int_of(p, o))
                .and_then(|o| u64::try_from(o).ok());
            offset = offset
                .checked_add(extra.ok_or("bad legacy view metadata")?)
                .ok_or("storage offset overflows")?;
        }
    }
    let shape = dims_of(p, args[2]).ok_or("the size is not a tuple of non-negative ints")?;
    let strides = dims_of(p, args[3]).ok_or("the stride is not a tuple of non-negative ints")?;
    if shape.len() != strides.len() {
        return Err(format!(
            "size {shape:?} and stride {strides:?} differ in length"
        ));
    }
    let meta = match which {
        "_rebuild_tensor_v2" => args.get(6),
        "_rebuild_tensor_v3" => args.get(7),
        _ => None,
    };
    if let Some(&m) = meta {
        if let Some(items) = dict_of(p, m) {
            for (k, v) in items {
                let on = matches!(p.get(*v), Value::Bool(true));
                if on {
                    let k = str_of(p, *k).unwrap_or("?");
                    return Err(format!("the tensor has the lazy '{k}' bit set; save tensor.resolve_conj().resolve_neg() instead"));
                }
            }
        }
    }
    Ok(TensorRef {
        key,
        dtype,
        offset,
        shape,
        strides,
    })
}

/// The local tensor of a DTensor (`_local_tensor` in its slots state).
pub fn subclass_local(p: &Pickle, s: &SubclassRef) -> Option<TensorRef> {
    let state = s.state?;
    let dicts: Vec<NodeId> = match p.get(state) {
        Value::Tuple(parts) => parts.clone(),
        Value::Dict(_) => vec![state],
        _ => vec![],
    };
    for d in dicts {
        if let Some(local) = dict_get(p, d, "_local_tensor") {
            if let Ok(Some(Leaf::Tensor(t))) = leaf(p, local) {
                return Some(t);
            }
        }
    }
    None
}

/// Every `('storage', type, key, ...)` persistent id in the pickle, with its dtype
/// and element count (legacy files need them to walk their storage records).
pub fn storage_table(p: &Pickle) -> std::result::Result<Vec<(String, DType, u64)>, String> {
    let mut out: Vec<(String, DType, u64)> = Vec::new();
    let mut seen = std::collections::HashSet::new();
    for i in 0..p.len() {
        let Value::PersistentId(pid) = p.get(NodeId(i as u32)) else {
            continue;
        };
        let Some(t) = seq_of(p, *pid) else { continue };
        if t.len() < 5 || str_of(p, t[0]) != Some("storage") {
            if t.first().and_then(|&x| str_of(p, x)) == Some("module") {
                return Err("the file pickles a whole nn.Module (with its source code), not a state dict; in Python, load it and save model.state_dict()".into());
            }
            continue;
        }
        let key = match p.get(t[2]) {
            Value::Str(s) => s.clone(),
            Value::Int(i) => i.to_string(),
            _ => return Err("a storage key is not a string".into()),
        };
        let class = global_of(p, t[1]).map(|g| g.1).unwrap_or("?");
        // An untyped storage counts bytes; the tensor's dtype comes from its rebuild call.
        let dtype = if class == "UntypedStorage" {
            DType::U8
        } else {
            DType::from_storage_class(class)
                .ok_or_else(|| format!("unsupported storage type {class}"))?
        };
        let numel = int_of(p, t[4])
            .and_then(|n| u64::try_from(n).ok())
            .ok_or("a storage size is not a non-negative int")?;
        if seen.insert(key.clone()) {
            out.push((key, dtype, numel));
        }
    }
    Ok(out)
}
