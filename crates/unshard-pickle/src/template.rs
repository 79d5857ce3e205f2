//! Pickles checked against a parsed one of the same structure instead of parsed.
//!
//! Files written by the same code for different ranks of one job (one `torch.save`
//! of the state dict per rank) hold pickles that are opcode for opcode the same but
//! for a few integers and strings: a shard's row count, a mesh coordinate, a hash,
//! the names of a rank's process groups. A [`Template`] is such a pickle parsed
//! once, with where each of its opcodes starts and which node each integer or
//! string opcode made. [`Template::changes`] walks another pickle beside it:
//! wherever the bytes differ, both opcodes must be integer opcodes (`BININT`,
//! `BININT1`, `BININT2`, `LONG1` of at most 8 bytes) or both string opcodes
//! (`SHORT_BINUNICODE`, `BINUNICODE`, `BINUNICODE8`, valid UTF-8), and the
//! template's value must be free (see below); anything else is `None`, and the
//! caller parses the other pickle in full. When it matches, the other pickle parses
//! to the same arena with those values changed ([`Pickle::apply`]).
//!
//! Why that holds: the machine's work is fixed by the opcodes and their arguments,
//! and an integer's or a string's value changes nothing but its own node, except
//! where it is looked at while parsing: as a dict key or set member (Python merges
//! equal keys), as the code of a `copyreg.add_extension` call, as the module or
//! name of `STACK_GLOBAL`, and (strings) as an argument of any call, where a
//! recognised builtin reads it (`getattr`'s attribute, an encoding) and so does the
//! audit. Values used there are pinned while the template is parsed, and a
//! difference at a pinned value is `None`. The trace (globals and calls) is the
//! template's: the same globals and calls, at offsets that may have moved.

use crate::{Error, Limits, NodeId, Pickle, Value};

/// No node: an opcode whose bytes must match exactly.
pub(crate) const FIXED: u32 = u32::MAX;

/// A parsed pickle kept to recognise pickles of the same structure.
#[derive(Clone, Debug)]
pub struct Template {
    /// The template's bytes, up to and including `STOP`.
    data: Vec<u8>,
    /// `(offset, node, is a string)` of every opcode in order: the integer or
    /// string node it made when it is a free literal opcode, else [`FIXED`].
    ops: Vec<(u32, u32, bool)>,
}

/// Integer and string nodes to change in a template's arena to get another
/// pickle's.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Changes(Vec<(NodeId, Literal)>);

/// A value [`Changes`] sets.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Literal {
    Int(i64),
    Str(String),
}

impl Changes {
    /// How many values differ.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether the pickles are the same.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// What parsing a template recorded: the offset of every opcode, the node each
/// integer or string opcode made, and the values that are looked at.
#[derive(Default)]
pub(crate) struct Record {
    pub ops: Vec<(u32, u32)>,
    pub pinned: Vec<NodeId>,
    /// Set when the pickle is too large for `u32` offsets: no template.
    pub too_large: bool,
}

impl Template {
    /// Parses `data` (one pickle, as [`crate::parse_with_limits`] does) and keeps it as a
    /// template. `None` in place of the template when the pickle cannot be one (larger
    /// than 4 GiB).
    pub fn parse(data: &[u8], limits: &Limits) -> Result<(Pickle, Option<Template>), Error> {
        let too_large = u32::try_from(data.len()).is_err();
        let mut machine = crate::machine::Machine::new(data, limits);
        if !too_large {
            machine.record(Record::default());
        }
        let (outcome, record) = machine.run_recorded();
        if let Some(error) = outcome.error {
            return Err(error);
        }
        let nodes = &outcome.pickle.nodes;
        let template = record.filter(|r| !r.too_large).map(|r| {
            let mut pinned = r.pinned;
            pinned.sort_unstable();
            let ops = r
                .ops
                .into_iter()
                .map(|(at, node)| {
                    let kind = nodes.get(node as usize);
                    let free = node != FIXED && pinned.binary_search(&NodeId(node)).is_err();
                    match kind {
                        Some(Value::Int(_)) if free => (at, node, false),
                        Some(Value::Str(_)) if free => (at, node, true),
                        _ => (at, FIXED, false),
                    }
                })
                .collect();
            Template {
                data: data.get(..outcome.end).unwrap_or(data).to_vec(),
                ops,
            }
        });
        Ok((outcome.pickle, template))
    }

    /// The integers to change in the template's arena to get the arena `other`
    /// parses to, if `other` has the template's structure; `None` when it must be
    /// parsed. Bytes after `STOP` are not looked at, as [`crate::parse`] does not.
    pub fn changes(&self, other: &[u8]) -> Option<Changes> {
        let t = &self.data[..];
        let mut changes = Vec::new();
        let mut k = 0; // next template opcode
        let mut q = 0; // where it is in `other`
        while k < self.ops.len() {
            let at = self.ops[k].0 as usize;
            // The bytes from here that both share are whole equal opcodes.
            let same = common_prefix(&t[at..], other.get(q..)?);
            let end = at + same;
            while k < self.ops.len() && self.op_end(k) <= end {
                k += 1;
            }
            if k == self.ops.len() {
                return Some(Changes(changes));
            }
            // Opcode k differs (it starts at or before `end`, and did not end by it).
            let (op_at, node, is_str) = self.ops[k];
            let op_at = op_at as usize;
            q += op_at - at;
            if node == FIXED {
                return None;
            }
            let rest = other.get(q..)?;
            let (value, len) = if is_str {
                let (s, len) = str_op(rest)?;
                (Literal::Str(s.to_owned()), len)
            } else {
                let (v, len) = int_op(rest)?;
                (Literal::Int(v), len)
            };
            changes.push((NodeId(node), value));
            q += len;
            k += 1;
        }
        Some(Changes(changes))
    }

    /// Offset just past opcode `k`.
    fn op_end(&self, k: usize) -> usize {
        match self.ops.get(k + 1) {
            Some(&(next, _, _)) => next as usize,
            None => self.data.len(),
        }
    }
}

impl Pickle {
    /// Sets the integer and string nodes `changes` names (from
    /// [`Template::changes`] of the template this arena was parsed as, or a clone
    /// of it) and returns the changes that undo it. A node that is not of the
    /// value's kind is left alone.
    pub fn apply(&mut self, changes: &Changes) -> Changes {
        let mut undo = Vec::with_capacity(changes.0.len());
        for (id, value) in &changes.0 {
            match (self.nodes.get_mut(id.0 as usize), value) {
                (Some(Value::Int(v)), Literal::Int(new)) => {
                    undo.push((*id, Literal::Int(*v)));
                    *v = *new;
                }
                (Some(Value::Str(s)), Literal::Str(new)) => {
                    let old = std::mem::replace(s, new.clone());
                    undo.push((*id, Literal::Str(old)));
                }
                _ => {}
            }
        }
        undo.reverse();
        Changes(undo)
    }
}

fn common_prefix(a: &[u8], b: &[u8]) -> usize {
    let n = a.len().min(b.len());
    // Compare in blocks, then bytes in the first block that differs.
    const BLOCK: usize = 64;
    let mut i = 0;
    while i + BLOCK <= n && a[i..i + BLOCK] == b[i..i + BLOCK] {
        i += BLOCK;
    }
    while i < n && a[i] == b[i] {
        i += 1;
    }
    i
}

/// The value and length of the integer opcode at the start of `data`, if it is one
/// whose value fits in an `i64`.
fn int_op(data: &[u8]) -> Option<(i64, usize)> {
    use crate::opcode as op;
    let (&code, rest) = data.split_first()?;
    match code {
        op::BININT1 => Some((i64::from(*rest.first()?), 2)),
        op::BININT2 => Some((
            i64::from(u16::from_le_bytes(rest.get(..2)?.try_into().ok()?)),
            3,
        )),
        op::BININT => Some((
            i64::from(i32::from_le_bytes(rest.get(..4)?.try_into().ok()?)),
            5,
        )),
        op::LONG1 => {
            let (&n, rest) = rest.split_first()?;
            let bytes = rest.get(..usize::from(n))?;
            match crate::literal::int_from_le(bytes) {
                Value::Int(v) => Some((v, 2 + usize::from(n))),
                _ => None,
            }
        }
        _ => None,
    }
}

/// The text and length of the binary string opcode at the start of `data`, if it
/// is one holding valid UTF-8.
fn str_op(data: &[u8]) -> Option<(&str, usize)> {
    use crate::opcode as op;
    let (&code, rest) = data.split_first()?;
    let (head, len): (usize, usize) = match code {
        op::SHORT_BINUNICODE => (1, usize::from(*rest.first()?)),
        op::BINUNICODE => (
            4,
            usize::try_from(u32::from_le_bytes(rest.get(..4)?.try_into().ok()?)).ok()?,
        ),
        op::BINUNICODE8 => (
            8,
            usize::try_from(u64::from_le_bytes(rest.get(..8)?.try_into().ok()?)).ok()?,
        ),
        _ => return None,
    };
    let text = rest.get(head..head.checked_add(len)?)?;
    Some((std::str::from_utf8(text).ok()?, 1 + head + len))
}

/// Whether `code` is an opcode whose node [`Template::changes`] may change.
pub(crate) fn is_literal_op(code: u8) -> bool {
    use crate::opcode as op;
    matches!(
        code,
        op::BININT1
            | op::BININT2
            | op::BININT
            | op::LONG1
            | op::SHORT_BINUNICODE
            | op::BINUNICODE
            | op::BINUNICODE8
    )
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn template(data: &[u8]) -> (Pickle, Template) {
        let (p, t) = Template::parse(data, &Limits::default()).unwrap();
        (p, t.unwrap())
    }

    /// `other` through the template, or `None`; when it matches, the patched arena
    /// must equal `other`'s own parse.
    fn through(data: &[u8], other: &[u8]) -> Option<usize> {
        let (mut p, t) = template(data);
        let changes = t.changes(other)?;
        let before = format!("{:?}", p.nodes);
        let undo = p.apply(&changes);
        let want = crate::parse(other).unwrap();
        assert_eq!(p.nodes, want.nodes, "the patched arena is other's");
        assert_eq!(p.root, want.root);
        p.apply(&undo);
        assert_eq!(
            format!("{:?}", p.nodes),
            before,
            "undo restores the template"
        );
        Some(changes.len())
    }

    // pickle.dumps({'a': (1, 300, 2**40), 'b': [7]}, protocol=2)
    fn dict_of(a: [&[u8]; 3], b: &[u8]) -> Vec<u8> {
        [
            b"\x80\x02}q\x00(X\x01\x00\x00\x00aq\x01",
            a[0],
            a[1],
            a[2],
            b"\x87q\x02X\x01\x00\x00\x00bq\x03]q\x04",
            b,
            b"au.",
        ]
        .concat()
    }

    #[test]
    fn integers_that_differ_are_changed_in_place() {
        let base = dict_of(
            [b"K\x01", b"M\x2c\x01", b"\x8a\x06\x00\x00\x00\x00\x00\x01"],
            b"K\x07",
        );
        assert_eq!(through(&base, &base), Some(0));
        // Same widths, other values.
        let other = dict_of(
            [b"K\x02", b"M\x2d\x01", b"\x8a\x06\x00\x00\x00\x00\x00\x02"],
            b"K\x08",
        );
        assert_eq!(through(&base, &other), Some(4));
        // Other widths: a BININT2 where the template has a BININT1, a negative LONG1.
        let other = dict_of(
            [b"M\x00\x01", b"K\x00", b"\x8a\x01\xff"],
            b"J\x00\x00\x00\x80",
        );
        assert_eq!(through(&base, &other), Some(4));
        // Bytes after STOP are ignored.
        let mut tail = other.clone();
        tail.extend_from_slice(b"junk");
        assert_eq!(through(&base, &tail), Some(4));
    }

    #[test]
    fn anything_but_an_integer_differing_is_refused() {
        let base = dict_of([b"K\x01", b"M\x2c\x01", b"K\x03"], b"K\x07");
        // A key that differs.
        let mut other = base.clone();
        let at = other.iter().position(|&b| b == b'b').unwrap();
        other[at] = b'c';
        assert_eq!(through(&base, &other), None);
        // An integer where the template has a string, and the other way round.
        let other = dict_of([b"K\x01", b"X\x01\x00\x00\x00z", b"K\x03"], b"K\x07");
        assert_eq!(through(&base, &other), None);
        let str_base = dict_of([b"K\x01", b"X\x01\x00\x00\x00z", b"K\x03"], b"K\x07");
        assert_eq!(through(&str_base, &base), None);
        // A big integer (more than 8 bytes).
        let other = dict_of(
            [
                b"K\x01",
                b"\x8a\x09\x00\x00\x00\x00\x00\x00\x00\x00\x01",
                b"K\x03",
            ],
            b"K\x07",
        );
        assert_eq!(through(&base, &other), None);
        // Cut short, or an extra opcode.
        assert_eq!(through(&base, &base[..base.len() - 1]), None);
        let other = dict_of([b"K\x01", b"M\x2c\x01", b"K\x03"], b"K\x07K\x08");
        assert_eq!(through(&base, &other), None);
        // A memo index that differs.
        let mut other = base.clone();
        let at = other.windows(2).position(|w| w == b"q\x04").unwrap();
        other[at + 1] = 5;
        assert_eq!(through(&base, &other), None);
    }

    #[test]
    fn strings_that_differ_are_changed_in_place() {
        // pickle.dumps({'g': ['1', '3'], 'n': 'cpu'}, protocol=4)-like, with
        // SHORT_BINUNICODE, BINUNICODE and BINUNICODE8 values.
        let of = |a: &[u8], b: &[u8], c: &[u8]| {
            [b"\x80\x04}(\x8c\x01g]q\x00(", a, b, b"e\x8c\x01n", c, b"u."].concat()
        };
        let base = of(
            b"\x8c\x011",
            b"X\x01\x00\x00\x003",
            b"\x8d\x03\x00\x00\x00\x00\x00\x00\x00cpu",
        );
        assert_eq!(through(&base, &base), Some(0));
        // Other values and other lengths, in each opcode; a string where the
        // template has another string opcode.
        let other = of(b"\x8c\x0212", b"\x8c\x00", b"X\x04\x00\x00\x00cuda");
        assert_eq!(through(&base, &other), Some(3));
        // An integer where the template has a string, invalid UTF-8, cut short.
        assert_eq!(
            through(&base, &of(b"K\x01", b"\x8c\x013", b"\x8c\x01x")),
            None
        );
        assert_eq!(
            through(&base, &of(b"\x8c\x01\xff", b"\x8c\x013", b"\x8c\x01x")),
            None
        );
        assert_eq!(through(&base, &base[..base.len() - 6]), None);
    }

    #[test]
    fn strings_looked_at_while_parsing_are_pinned() {
        // A dict key: {'a': 1} against {'b': 1}.
        let key = |k: u8| [&b"\x80\x04}\x8c\x01"[..], &[k], b"K\x01s."].concat();
        assert_eq!(through(&key(b'a'), &key(b'a')), Some(0));
        assert_eq!(through(&key(b'a'), &key(b'b')), None);
        // STACK_GLOBAL's module and name: collections.OrderedDict() against
        // collections.Counter(), both recognised builtins.
        let global = |name: &[u8]| {
            let len = [name.len() as u8];
            [
                &b"\x80\x04\x8c\x0bcollections\x8c"[..],
                &len,
                name,
                b"\x93)R.",
            ]
            .concat()
        };
        assert_eq!(
            through(&global(b"OrderedDict"), &global(b"OrderedDict")),
            Some(0)
        );
        assert_eq!(
            through(&global(b"OrderedDict"), &global(b"Counter\x00\x00\x00\x00")),
            None
        );
        assert_eq!(through(&global(b"OrderedDict"), &global(b"Counter")), None);
        // A call's argument: getattr(torch.Tensor, 'x') names another global.
        let getattr = |attr: u8| {
            let call = b"\x80\x04\x8c\x08builtins\x8c\x07getattr\x93\x8c\x05torch\x8c\x06Tensor\x93\x8c\x01";
            [&call[..], &[attr], b"\x86R."].concat()
        };
        assert_eq!(through(&getattr(b'a'), &getattr(b'a')), Some(0));
        assert_eq!(through(&getattr(b'a'), &getattr(b'b')), None);
    }

    #[test]
    fn integers_compared_as_keys_are_pinned() {
        // {1: 'x', 2: 'y'}: changing key 2 to 1 would merge the two entries.
        let keys = |a: u8, b: u8| {
            [
                &b"\x80\x02}q\x00(K"[..],
                &[a],
                b"X\x01\x00\x00\x00xK",
                &[b],
                b"X\x01\x00\x00\x00yu.",
            ]
            .concat()
        };
        assert_eq!(through(&keys(1, 2), &keys(1, 2)), Some(0));
        assert_eq!(through(&keys(1, 2), &keys(1, 1)), None);
        assert_eq!(through(&keys(1, 2), &keys(3, 2)), None);
        // A key merged away in the template is pinned too.
        assert_eq!(through(&keys(1, 1), &keys(1, 2)), None);
        // frozenset((1, 2)) members: pickle.dumps(frozenset((1, 2)), protocol=4)-like.
        let set = |a: u8| {
            let head = b"\x80\x04\x95\x00\x00\x00\x00\x00\x00\x00\x00(K";
            [&head[..], &[a], b"K\x02\x91."].concat()
        };
        assert_eq!(through(&set(1), &set(1)), Some(0));
        assert_eq!(through(&set(1), &set(2)), None);
    }
}
