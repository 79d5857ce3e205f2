//! The pure builtins whose results are plain data, recognised by name.
//!
//! Picklers write some ordinary values as calls: `OrderedDict()` for every torch state
//! dict, `set([..])` and `frozenset([..])` before protocol 4, `_codecs.encode(text,
//! 'latin1')` for `bytes` and `bytearray(..)` before protocols 3 and 5, and `getattr(cls,
//! 'Inner')` for a nested class before protocol 4. Leaving those as opaque objects
//! would make every caller re-implement them, so they are turned into the value the
//! call returns. Both Python 3 (`builtins`) and Python 2 (`__builtin__`) module names
//! are accepted. The answer depends only on the global's name and on the argument
//! values already parsed; nothing is imported or run.
//!
//! The recogniser only *plans* the result ([`Builtin`]); the parser carries it out so
//! that copies are charged to the same [`crate::Limits`] as everything else.

use crate::{NodeId, ObjectKind, Value};

/// The plain value a recognised call produces.
#[derive(Debug, PartialEq)]
pub(crate) enum Builtin {
    /// `OrderedDict()`, `defaultdict(factory)`, `Counter()`, or `__new__` of those.
    EmptyDict,
    /// `Counter(mapping)`: a dict with the pairs of the `Dict` node.
    DictFrom(NodeId),
    /// `set(..)` / `frozenset(..)`: the items of a list, tuple or set node, if any.
    Set { frozen: bool, from: Option<NodeId> },
    /// `bytearray()` / `bytes()`.
    EmptyBytes,
    /// `bytearray(b)` / `bytes(b)`: a copy of the `Bytes` node.
    BytesOf(NodeId),
    /// `_codecs.encode(s, 'latin1')` or Python 2's `bytearray(s, 'latin-1')`: the code
    /// points of the `Str` node as bytes. If one is 256 or more, Python would raise, and
    /// the call stays an object. (The parser checks, after charging the scan.)
    Latin1(NodeId),
    /// `getattr(<global m.n>, 'attr')`: the global `m` / `n.attr`.
    Attribute { owner: NodeId, attr: NodeId },
}

/// What applying `callable` to `args` as `kind` returns, if it is a recognised builtin.
pub(crate) fn recognize(
    nodes: &[Value],
    kind: ObjectKind,
    callable: NodeId,
    args: &[NodeId],
) -> Option<Builtin> {
    let Some(Value::Global(g)) = nodes.get(callable.0 as usize) else {
        return None;
    };
    let (module, name) = (&g.module, &g.name);
    let value = |id: &NodeId| nodes.get(id.0 as usize);
    // `NEWOBJ` calls `cls.__new__(cls, *args)`, which for most builtins ignores `args`.
    let new_only = kind == ObjectKind::NewObj;
    let builtin = module == "builtins" || module == "__builtin__";
    match (module.as_str(), name.as_str(), args) {
        ("collections", "OrderedDict", []) => Some(Builtin::EmptyDict),
        ("collections", "defaultdict", [] | [_]) => Some(Builtin::EmptyDict),
        ("collections", "Counter", []) => Some(Builtin::EmptyDict),
        ("collections", "OrderedDict" | "defaultdict" | "Counter", _) if new_only => {
            Some(Builtin::EmptyDict)
        }
        ("collections", "Counter", [mapping]) => {
            matches!(value(mapping), Some(Value::Dict(_))).then_some(Builtin::DictFrom(*mapping))
        }
        (_, "set", _) if builtin && new_only => Some(Builtin::Set {
            frozen: false,
            from: None,
        }),
        (_, "set" | "frozenset", []) if builtin => Some(Builtin::Set {
            frozen: name == "frozenset",
            from: None,
        }),
        (_, "set" | "frozenset", [items]) if builtin => match value(items) {
            Some(Value::List(_) | Value::Tuple(_) | Value::Set(_) | Value::FrozenSet(_)) => {
                Some(Builtin::Set {
                    frozen: name == "frozenset",
                    from: Some(*items),
                })
            }
            _ => None,
        },
        (_, "bytearray", _) if builtin && new_only => Some(Builtin::EmptyBytes),
        (_, "bytearray" | "bytes", []) if builtin => Some(Builtin::EmptyBytes),
        (_, "bytearray" | "bytes", [data]) if builtin => {
            matches!(value(data), Some(Value::Bytes(_))).then_some(Builtin::BytesOf(*data))
        }
        (_, "bytearray" | "bytes", [text, encoding]) if builtin => latin1(nodes, text, encoding),
        ("_codecs", "encode", [text, encoding]) if !new_only => latin1(nodes, text, encoding),
        (_, "getattr", [owner, attr]) if builtin && !new_only => {
            match (value(owner), value(attr)) {
                (Some(Value::Global(_)), Some(Value::Str(_))) => Some(Builtin::Attribute {
                    owner: *owner,
                    attr: *attr,
                }),
                _ => None,
            }
        }
        _ => None,
    }
}

/// `Latin1(text)` if `text` is a string and `encoding` names latin-1.
fn latin1(nodes: &[Value], text: &NodeId, encoding: &NodeId) -> Option<Builtin> {
    let Some(Value::Str(_)) = nodes.get(text.0 as usize) else {
        return None;
    };
    let Some(Value::Str(encoding)) = nodes.get(encoding.0 as usize) else {
        return None;
    };
    let is_latin1 = [
        "latin1",
        "latin-1",
        "latin_1",
        "iso-8859-1",
        "iso8859-1",
        "l1",
    ]
    .iter()
    .any(|name| encoding.eq_ignore_ascii_case(name));
    is_latin1.then_some(Builtin::Latin1(*text))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn global(module: &str, name: &str) -> Value {
        Value::global(module, name)
    }

    #[test]
    fn recognises_only_the_listed_builtins() {
        let nodes = vec![
            global("collections", "OrderedDict"), // 0
            global("builtins", "set"),            // 1
            global("__builtin__", "frozenset"),   // 2
            Value::List(vec![]),                  // 3
            global("_codecs", "encode"),          // 4
            Value::Str("\u{ff}a".into()),         // 5
            Value::Str("latin1".into()),          // 6
            Value::Str("€".into()),               // 7
            global("posix", "system"),            // 8
            global("builtins", "getattr"),        // 9
            Value::Str("Inner".into()),           // 10
            global("os", "set"),                  // 11
        ];
        let r = |callable: u32, args: &[u32]| {
            let args: Vec<NodeId> = args.iter().map(|&i| NodeId(i)).collect();
            recognize(&nodes, ObjectKind::Reduce, NodeId(callable), &args)
        };
        assert_eq!(r(0, &[]), Some(Builtin::EmptyDict));
        assert_eq!(r(0, &[3]), None);
        assert_eq!(
            r(1, &[3]),
            Some(Builtin::Set {
                frozen: false,
                from: Some(NodeId(3))
            })
        );
        assert_eq!(
            r(2, &[]),
            Some(Builtin::Set {
                frozen: true,
                from: None
            })
        );
        assert_eq!(r(1, &[5]), None);
        assert_eq!(r(4, &[5, 6]), Some(Builtin::Latin1(NodeId(5))));
        assert_eq!(r(4, &[7, 6]), Some(Builtin::Latin1(NodeId(7))));
        assert_eq!(r(4, &[5]), None);
        assert_eq!(r(8, &[5]), None);
        assert_eq!(
            r(9, &[0, 10]),
            Some(Builtin::Attribute {
                owner: NodeId(0),
                attr: NodeId(10)
            })
        );
        assert_eq!(r(9, &[5, 10]), None);
        assert_eq!(r(11, &[3]), None);
    }
}
