//! Helpers shared by the integration tests: loading committed pickles and rendering a
//! parsed tree as a compact Python-like string, so expectations read like the value.
#![allow(dead_code)]

use std::path::PathBuf;

use unshard_pickle::{NodeId, ObjectKind, Pickle, Value};

pub fn data_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data")
}

pub fn read(name: &str) -> Vec<u8> {
    let path = data_dir().join(name);
    std::fs::read(&path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
}

pub fn load(name: &str) -> Pickle {
    unshard_pickle::parse(&read(name)).unwrap_or_else(|e| panic!("{name}: {e}"))
}

/// The whole tree under the root, Python-style. Sets render as `set([..])`, objects as
/// `Kind<callable(args) state=.. items=[..] pairs={..}>`, a node that contains itself
/// as `<cycle>`.
pub fn render(p: &Pickle) -> String {
    render_node(p, p.root())
}

pub fn render_node(p: &Pickle, id: NodeId) -> String {
    let mut out = String::new();
    let mut path = Vec::new();
    write_node(p, id, &mut path, &mut out);
    out
}

fn write_node(p: &Pickle, id: NodeId, path: &mut Vec<NodeId>, out: &mut String) {
    if path.contains(&id) {
        out.push_str("<cycle>");
        return;
    }
    assert!(path.len() < 64, "render: tree deeper than 64");
    path.push(id);
    match p.get(id) {
        Value::None => out.push_str("None"),
        Value::Bool(b) => out.push_str(if *b { "True" } else { "False" }),
        Value::Int(i) => out.push_str(&i.to_string()),
        Value::BigInt(bytes) => out.push_str(&big_to_decimal(bytes)),
        Value::Float(f) => out.push_str(&format!("{f:?}")),
        Value::Str(s) => {
            out.push('\'');
            for c in s.chars() {
                match c {
                    '\'' => out.push_str("\\'"),
                    '\\' => out.push_str("\\\\"),
                    c if c.is_control() => out.extend(c.escape_default()),
                    c => out.push(c),
                }
            }
            out.push('\'');
        }
        Value::Bytes(b) => out.push_str(&format!("b'{}'", b.escape_ascii())),
        Value::Tuple(items) => {
            out.push('(');
            write_list(p, items, path, out);
            if items.len() == 1 {
                out.push(',');
            }
            out.push(')');
        }
        Value::List(items) => {
            out.push('[');
            write_list(p, items, path, out);
            out.push(']');
        }
        Value::Set(items) => {
            out.push_str("set([");
            write_list(p, items, path, out);
            out.push_str("])");
        }
        Value::FrozenSet(items) => {
            out.push_str("frozenset([");
            write_list(p, items, path, out);
            out.push_str("])");
        }
        Value::Dict(pairs) => {
            out.push('{');
            write_pairs(p, pairs, path, out);
            out.push('}');
        }
        Value::Global(g) => out.push_str(&format!("{}.{}", g.module, g.name)),
        Value::Object {
            kind,
            callable,
            args,
            state,
            items,
        } => {
            let list_items: &[NodeId] = items.as_ref().map_or(&[], |i| &i.list);
            let dict_items: &[(NodeId, NodeId)] = items.as_ref().map_or(&[], |i| &i.dict);
            out.push_str(match kind {
                ObjectKind::Reduce => "Reduce<",
                ObjectKind::NewObj => "NewObj<",
                ObjectKind::Inst => "Inst<",
            });
            write_node(p, *callable, path, out);
            write_node(p, *args, path, out);
            if let Some(state) = state {
                out.push_str(" state=");
                write_node(p, *state, path, out);
            }
            if !list_items.is_empty() {
                out.push_str(" items=[");
                write_list(p, list_items, path, out);
                out.push(']');
            }
            if !dict_items.is_empty() {
                out.push_str(" pairs={");
                write_pairs(p, dict_items, path, out);
                out.push('}');
            }
            out.push('>');
        }
        Value::PersistentId(pid) => {
            out.push_str("pid");
            let tuple = matches!(p.get(*pid), Value::Tuple(_));
            if !tuple {
                out.push('(');
            }
            write_node(p, *pid, path, out);
            if !tuple {
                out.push(')');
            }
        }
    }
    path.pop();
}

fn write_list(p: &Pickle, items: &[NodeId], path: &mut Vec<NodeId>, out: &mut String) {
    for (i, item) in items.iter().enumerate() {
        if i > 0 {
            out.push_str(", ");
        }
        write_node(p, *item, path, out);
    }
}

fn write_pairs(p: &Pickle, pairs: &[(NodeId, NodeId)], path: &mut Vec<NodeId>, out: &mut String) {
    for (i, (k, v)) in pairs.iter().enumerate() {
        if i > 0 {
            out.push_str(", ");
        }
        write_node(p, *k, path, out);
        out.push_str(": ");
        write_node(p, *v, path, out);
    }
}

/// Decimal text of a little-endian two's-complement integer.
pub fn big_to_decimal(le: &[u8]) -> String {
    let negative = le.last().is_some_and(|b| b & 0x80 != 0);
    let mut magnitude: Vec<u8> = le.to_vec();
    if negative {
        let mut carry = true;
        for b in magnitude.iter_mut() {
            let (sum, overflow) = (!*b).overflowing_add(u8::from(carry));
            *b = sum;
            carry = overflow;
        }
    }
    // Repeated division by 10 of the big-endian magnitude.
    let mut be: Vec<u8> = magnitude.into_iter().rev().collect();
    let mut digits = Vec::new();
    while be.iter().any(|&b| b != 0) {
        let mut rem = 0u32;
        for b in be.iter_mut() {
            let cur = rem * 256 + u32::from(*b);
            *b = (cur / 10) as u8;
            rem = cur % 10;
        }
        digits.push(b'0' + rem as u8);
    }
    if digits.is_empty() {
        digits.push(b'0');
    }
    if negative {
        digits.push(b'-');
    }
    digits.reverse();
    String::from_utf8(digits).expect("ascii digits")
}
