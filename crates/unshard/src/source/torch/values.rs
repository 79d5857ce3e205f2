//! Soft accessors over pickle values: each returns `None` when the value is not of
//! the expected kind, so that readers turn a surprise into an error naming the tensor.

use unshard_pickle::{NodeId, Pickle, Value};

use crate::dtype::DType;

/// Accessors over pickle values that fail softly.
pub(crate) fn str_of(p: &Pickle, id: NodeId) -> Option<&str> {
    match p.get(id) {
        Value::Str(s) => Some(s),
        _ => None,
    }
}

pub(crate) fn int_of(p: &Pickle, id: NodeId) -> Option<i64> {
    match p.get(id) {
        Value::Int(i) => Some(*i),
        Value::Bool(b) => Some(*b as i64),
        _ => None,
    }
}

pub(crate) fn seq_of(p: &Pickle, id: NodeId) -> Option<&[NodeId]> {
    match p.get(id) {
        Value::Tuple(v) | Value::List(v) => Some(v),
        _ => None,
    }
}

pub(crate) fn global_of(p: &Pickle, id: NodeId) -> Option<(&str, &str)> {
    match p.get(id) {
        Value::Global(g) => Some((&g.module, &g.name)),
        _ => None,
    }
}

/// The dict items of a dict node.
pub(crate) fn dict_of(p: &Pickle, id: NodeId) -> Option<&[(NodeId, NodeId)]> {
    match p.get(id) {
        Value::Dict(items) => Some(items),
        _ => None,
    }
}

/// Looks up a string key in a dict node.
pub(crate) fn dict_get(p: &Pickle, id: NodeId, key: &str) -> Option<NodeId> {
    dict_of(p, id)?
        .iter()
        .rev()
        .find(|(k, _)| str_of(p, *k) == Some(key))
        .map(|(_, v)| *v)
}

/// An applied object: `(callable global, args, BUILD state)`.
pub(crate) type Call<'a> = ((&'a str, &'a str), &'a [NodeId], Option<NodeId>);

pub(crate) fn call_of(p: &Pickle, id: NodeId) -> Option<Call<'_>> {
    match p.get(id) {
        Value::Object {
            callable,
            args,
            state,
            ..
        } => Some((
            global_of(p, *callable)?,
            seq_of(p, *args).unwrap_or(&[]),
            *state,
        )),
        _ => None,
    }
}

/// A tuple of non-negative ints (a shape or strides); `torch.Size(t)` is unwrapped.
pub(crate) fn dims_of(p: &Pickle, id: NodeId) -> Option<Vec<u64>> {
    let id = match call_of(p, id) {
        Some((("torch", "Size"), args, _)) => *args.first()?,
        _ => id,
    };
    seq_of(p, id)?
        .iter()
        .map(|&d| int_of(p, d).and_then(|i| u64::try_from(i).ok()))
        .collect()
}

/// A dtype token: `GLOBAL 'torch float32'`.
pub(crate) fn dtype_of(p: &Pickle, id: NodeId) -> Option<DType> {
    match global_of(p, id)? {
        ("torch", name) => DType::from_torch_name(name),
        _ => None,
    }
}

/// The class an object was made from (`NEWOBJ`/`REDUCE` on a global).
pub(crate) fn class_of(p: &Pickle, id: NodeId) -> Option<(&str, &str)> {
    call_of(p, id).map(|(class, _, _)| class)
}

/// A field of an object's `BUILD` state. Dataclasses and plain classes build from
/// their `__dict__`; classes with `__slots__` build from `(dict or None, {slots})`.
pub(crate) fn field_of(p: &Pickle, id: NodeId, name: &str) -> Option<NodeId> {
    let Value::Object { state: Some(s), .. } = p.get(id) else {
        return None;
    };
    match p.get(*s) {
        Value::Dict(_) => dict_get(p, *s, name),
        Value::Tuple(parts) => parts.iter().rev().find_map(|&d| dict_get(p, d, name)),
        _ => None,
    }
}

/// A short human description of a value, for `inspect`.
pub fn describe(p: &Pickle, id: NodeId) -> String {
    match p.get(id) {
        Value::None => "None".into(),
        Value::Bool(b) => format!("bool {}", if *b { "True" } else { "False" }),
        Value::Int(i) => format!("int {i}"),
        Value::BigInt(_) => "int (large)".into(),
        Value::Float(f) => format!("float {f}"),
        Value::Str(s) if s.chars().count() > 40 => {
            format!("str '{}…'", s.chars().take(40).collect::<String>())
        }
        Value::Str(s) => format!("str '{s}'"),
        Value::Bytes(b) => format!("bytes ({} bytes)", b.len()),
        Value::Tuple(v) => format!("tuple ({} items)", v.len()),
        Value::List(v) => format!("list ({} items)", v.len()),
        Value::Dict(v) => format!("dict ({} items)", v.len()),
        Value::Set(v) | Value::FrozenSet(v) => format!("set ({} items)", v.len()),
        Value::Global(g) => format!("class {}.{}", g.module, g.name),
        Value::Object { callable, .. } => match global_of(p, *callable) {
            Some((m, n)) => format!("object {m}.{n} (not executed)"),
            // A callable made by calls: `functools.partial(posix.system)`.
            None => format!(
                "object {}(...) (not executed)",
                unshard_pickle::audit::chain(p, *callable)
            ),
        },
        Value::PersistentId(_) => "persistent id".into(),
    }
}
