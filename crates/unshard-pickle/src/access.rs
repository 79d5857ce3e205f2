//! Typed read access to a parsed [`Pickle`].
//!
//! Every accessor looks at one node (and, for `dict_get` and `describe`, the nodes it
//! refers to directly): none walks the graph, so none can loop on a cyclic pickle.
//! Callers that walk further must bound their own depth.

use std::fmt::Write;

use crate::{NodeId, ObjectKind, Pickle, Value};

/// A view of a [`Value::Object`] node: what was called, with which arguments, and what
/// `BUILD`, `APPEND(S)` and `SETITEM(S)` added to it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ObjectRef<'a> {
    /// The object's node.
    pub id: NodeId,
    /// How the object was produced.
    pub kind: ObjectKind,
    /// The node that was called.
    pub callable: NodeId,
    /// `(module, name)` of the callable, when it is a global (almost always).
    pub global: Option<(&'a str, &'a str)>,
    /// The positional arguments.
    pub args: &'a [NodeId],
    /// The `BUILD` state, if any.
    pub state: Option<NodeId>,
    /// Items appended by `APPEND(S)`.
    pub list_items: &'a [NodeId],
    /// Pairs set by `SETITEM(S)`.
    pub dict_items: &'a [(NodeId, NodeId)],
}

impl ObjectRef<'_> {
    /// Whether the callable is the global `module.name`.
    pub fn is(&self, module: &str, name: &str) -> bool {
        self.global == Some((module, name))
    }

    /// The positional argument at `index`.
    pub fn arg(&self, index: usize) -> Option<NodeId> {
        self.args.get(index).copied()
    }
}

/// Characters of a string shown by [`Pickle::describe`].
const DESCRIBE_STR_CHARS: usize = 40;
/// Characters of a global's module or name shown by [`Pickle::describe`].
const DESCRIBE_NAME_CHARS: usize = 100;

impl Pickle {
    /// Every node id of the arena, in creation order.
    pub fn ids(&self) -> impl Iterator<Item = NodeId> {
        // The parser keeps the arena within u32 ids.
        (0..u32::try_from(self.nodes.len()).unwrap_or(u32::MAX)).map(NodeId)
    }

    /// The text of a `Str` node.
    pub fn as_str(&self, id: NodeId) -> Option<&str> {
        match self.get(id) {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }

    /// The value of an `Int` node (not `Bool`, not `BigInt`).
    pub fn as_int(&self, id: NodeId) -> Option<i64> {
        match self.get(id) {
            Value::Int(i) => Some(*i),
            _ => None,
        }
    }

    /// The value of a `Bool` node.
    pub fn as_bool(&self, id: NodeId) -> Option<bool> {
        match self.get(id) {
            Value::Bool(b) => Some(*b),
            _ => None,
        }
    }

    /// The value of a `Float` node (not `Int`).
    pub fn as_float(&self, id: NodeId) -> Option<f64> {
        match self.get(id) {
            Value::Float(f) => Some(*f),
            _ => None,
        }
    }

    /// The content of a `Bytes` node.
    pub fn as_bytes(&self, id: NodeId) -> Option<&[u8]> {
        match self.get(id) {
            Value::Bytes(b) => Some(b),
            _ => None,
        }
    }

    /// The items of a `Tuple` or `List` node.
    pub fn items(&self, id: NodeId) -> Option<&[NodeId]> {
        match self.get(id) {
            Value::Tuple(items) | Value::List(items) => Some(items),
            _ => None,
        }
    }

    /// The `(key, value)` pairs of a `Dict` node, in insertion order.
    pub fn dict_items(&self, id: NodeId) -> Option<&[(NodeId, NodeId)]> {
        match self.get(id) {
            Value::Dict(pairs) => Some(pairs),
            _ => None,
        }
    }

    /// The value stored under the string key `key` in a `Dict` node.
    pub fn dict_get(&self, id: NodeId, key: &str) -> Option<NodeId> {
        self.dict_items(id)?
            .iter()
            .find(|(k, _)| self.as_str(*k) == Some(key))
            .map(|&(_, v)| v)
    }

    /// `(module, name)` of a `Global` node.
    pub fn global(&self, id: NodeId) -> Option<(&str, &str)> {
        match self.get(id) {
            Value::Global(g) => Some((&g.module, &g.name)),
            _ => None,
        }
    }

    /// The value a `PersistentId` node wraps (for torch, the storage tuple).
    pub fn persistent_id(&self, id: NodeId) -> Option<NodeId> {
        match self.get(id) {
            Value::PersistentId(pid) => Some(*pid),
            _ => None,
        }
    }

    /// A view of an `Object` node. Its `args` are empty if the argument node is not a
    /// tuple (the parser only builds objects with tuple arguments).
    pub fn object(&self, id: NodeId) -> Option<ObjectRef<'_>> {
        match self.get(id) {
            Value::Object {
                kind,
                callable,
                args,
                state,
                items,
            } => Some(ObjectRef {
                id,
                kind: *kind,
                callable: *callable,
                global: self.global(*callable),
                args: self.items(*args).unwrap_or_default(),
                state: *state,
                list_items: items.as_ref().map_or(&[], |i| &i.list),
                dict_items: items.as_ref().map_or(&[], |i| &i.dict),
            }),
            _ => None,
        }
    }

    /// A short one-line summary of a node for messages: `dict(3 items)`, `str 'abc'`,
    /// `int 5`, `object torch._utils._rebuild_tensor_v2(...)`. Its length is bounded
    /// whatever the node holds, and it never looks more than one node deep.
    pub fn describe(&self, id: NodeId) -> String {
        let mut out = String::new();
        self.describe_into(&mut out, id, true);
        out
    }

    fn describe_into(&self, out: &mut String, id: NodeId, look_inside: bool) {
        // Writing into a String cannot fail.
        let _ = match self.get(id) {
            Value::None => write!(out, "None"),
            Value::Bool(b) => write!(out, "bool {}", if *b { "True" } else { "False" }),
            Value::Int(i) => write!(out, "int {i}"),
            Value::BigInt(bytes) => write!(out, "int ({}-byte big integer)", bytes.len()),
            Value::Float(f) => write!(out, "float {f:?}"),
            Value::Str(s) => {
                out.push_str("str ");
                push_quoted(out, s, DESCRIBE_STR_CHARS);
                Ok(())
            }
            Value::Bytes(b) => write!(out, "bytes({})", count(b.len(), "byte")),
            Value::Tuple(items) => write!(out, "tuple({})", count(items.len(), "item")),
            Value::List(items) => write!(out, "list({})", count(items.len(), "item")),
            Value::Dict(pairs) => write!(out, "dict({})", count(pairs.len(), "item")),
            Value::Set(items) => write!(out, "set({})", count(items.len(), "item")),
            Value::FrozenSet(items) => write!(out, "frozenset({})", count(items.len(), "item")),
            Value::Global(g) => {
                out.push_str("global ");
                push_dotted(out, &g.module, &g.name);
                Ok(())
            }
            Value::Object { callable, args, .. } => {
                out.push_str("object ");
                match self.get(*callable) {
                    Value::Global(g) => push_dotted(out, &g.module, &g.name),
                    other => {
                        let _ = write!(out, "<{}>", other.type_name());
                    }
                }
                let empty = self.items(*args).is_some_and(<[NodeId]>::is_empty);
                out.push_str(if empty { "()" } else { "(...)" });
                Ok(())
            }
            Value::PersistentId(pid) => {
                out.push_str("persistent id ");
                if look_inside {
                    self.describe_into(out, *pid, false);
                } else {
                    out.push_str("(...)");
                }
                Ok(())
            }
        };
    }
}

fn count(n: usize, unit: &str) -> String {
    if n == 1 {
        format!("1 {unit}")
    } else {
        format!("{n} {unit}s")
    }
}

/// `'text'` with quotes and control characters escaped, cut at `max` characters.
fn push_quoted(out: &mut String, text: &str, max: usize) {
    out.push('\'');
    for (i, c) in text.chars().enumerate() {
        if i == max {
            out.push('…');
            break;
        }
        match c {
            '\'' => out.push_str("\\'"),
            '\\' => out.push_str("\\\\"),
            c if c.is_control() => out.extend(c.escape_default()),
            c => out.push(c),
        }
    }
    out.push('\'');
}

/// `module.name`, each part cut to a bounded length.
fn push_dotted(out: &mut String, module: &str, name: &str) {
    push_cut(out, module, DESCRIBE_NAME_CHARS);
    out.push('.');
    push_cut(out, name, DESCRIBE_NAME_CHARS);
}

fn push_cut(out: &mut String, text: &str, max: usize) {
    for (i, c) in text.chars().enumerate() {
        if i == max {
            out.push('…');
            return;
        }
        out.push(if c.is_control() { '?' } else { c });
    }
}
