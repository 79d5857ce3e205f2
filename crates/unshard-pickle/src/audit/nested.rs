//! Pickles inside a pickle: bytes handed to `pickle.loads`, to `numpy.load` (an
//! `.npy` of objects, which holds a pickle) and the like are unpickled in turn under
//! `torch.load`, so what they would run is part of what the outer file runs. The
//! loader itself is reported as dangerous anyway; this names the payload it carries.
//!
//! Bounded: each bytes node is looked into once, three levels deep at most, and its
//! pickle is parsed under the default limits (the bytes are already in the arena,
//! paid for by the input).

use std::collections::HashSet;

use crate::{parse_partial, Limits, NodeId, Pickle, Value};

/// Levels of pickles inside pickles looked into.
pub(super) const MAX_NESTING: usize = 3;

/// Functions that unpickle the bytes (or file object over bytes) they are given.
const LOADERS: &[(&str, &str)] = &[
    ("pickle", "loads"),
    ("pickle", "load"),
    ("pickle", "_loads"),
    ("_pickle", "loads"),
    ("_pickle", "load"),
    ("dill", "loads"),
    ("cloudpickle", "loads"),
    ("numpy", "load"),
    ("numpy.lib.npyio", "load"),
    ("torch", "load"),
    ("torch.serialization", "load"),
    ("joblib", "load"),
];

/// The loader a callable is, directly or as `functools.partial(loader, ...)`.
pub(super) fn loader(p: &Pickle, callable: NodeId) -> Option<String> {
    let head = match p.get(callable) {
        Value::Object { callable, args, .. } => match p.get(*callable) {
            Value::Global(g) if g.module == "functools" && g.name == "partial" => {
                *p.items(*args)?.first()?
            }
            _ => return None,
        },
        _ => callable,
    };
    match p.get(head) {
        Value::Global(g) if LOADERS.contains(&(g.module.as_str(), g.name.as_str())) => {
            Some(format!("{}.{}", g.module, g.name))
        }
        _ => None,
    }
}

/// The pickles in the arguments of a loader call, each with its bytes node (once
/// per node, tracked in `seen`).
pub(super) fn pickles_in_args(p: &Pickle, args: NodeId, seen: &mut HashSet<NodeId>) -> Vec<Pickle> {
    let mut out = Vec::new();
    for &arg in p.items(args).unwrap_or_default() {
        let Some(node) = bytes_node(p, arg) else {
            continue;
        };
        if !seen.insert(node) {
            continue;
        }
        let Some(data) = p.as_bytes(node).and_then(pickle_in) else {
            continue;
        };
        out.push(parse_partial(data, &Limits::default()).pickle);
    }
    out
}

/// A bytes node given directly or wrapped as `io.BytesIO(bytes)`.
fn bytes_node(p: &Pickle, id: NodeId) -> Option<NodeId> {
    match p.get(id) {
        Value::Bytes(_) => Some(id),
        Value::Object { callable, args, .. } => match p.get(*callable) {
            Value::Global(g)
                if matches!(g.module.as_str(), "_io" | "io") && g.name == "BytesIO" =>
            {
                let first = *p.items(*args)?.first()?;
                matches!(p.get(first), Value::Bytes(_)).then_some(first)
            }
            _ => None,
        },
        _ => None,
    }
}

/// The pickle in some bytes: the bytes themselves when they start with `PROTO`, or
/// the data of an `.npy` file (whose object arrays are a pickle after the header).
fn pickle_in(data: &[u8]) -> Option<&[u8]> {
    if data.first() == Some(&0x80) {
        return Some(data);
    }
    let rest = data.strip_prefix(b"\x93NUMPY")?;
    let (&major, rest) = rest.split_first()?;
    let rest = rest.get(1..)?;
    let (len, header) = match major {
        1 => (
            usize::from(u16::from_le_bytes([*rest.first()?, *rest.get(1)?])),
            2,
        ),
        _ => {
            let b: [u8; 4] = rest.get(..4)?.try_into().ok()?;
            (usize::try_from(u32::from_le_bytes(b)).ok()?, 4)
        }
    };
    let body = rest.get(header + len..)?;
    (body.first() == Some(&0x80)).then_some(body)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn npy_headers_are_skipped() {
        let mut npy = b"\x93NUMPY\x01\x00\x04\x00abcd".to_vec();
        npy.extend(b"\x80\x02N.");
        assert_eq!(pickle_in(&npy), Some(&b"\x80\x02N."[..]));
        assert_eq!(pickle_in(b"\x93NUMPY\x01\x00\xff\xff"), None);
        assert_eq!(pickle_in(b"plain bytes"), None);
    }
}
