//! Key equality for dicts and sets, as far as it can be known without running code.
//!
//! Python replaces the value when `SETITEM` stores a key equal to one already in the
//! dict, and a set keeps one of equal items. Checkpoint writers rarely repeat a key, but
//! a reader that kept both copies would let a crafted file show one value to `pickle`
//! and another to us. So equal *primitive* keys are merged as Python would: `None`,
//! ints (with `True == 1` and `1.0 == 1`), other floats, `str` and `bytes`. Any other
//! value (tuples, objects, globals) is compared by identity, which is always right for
//! the same node and never merges what Python would keep apart.
//!
//! Small containers are scanned; a container that grows past [`LINEAR_MAX`] entries
//! gets a hash table, so a state dict of a million keys costs O(n) and not O(n²). The
//! hasher is randomly seeded per parse, so a file cannot be built to collide.

use std::collections::HashMap;
use std::hash::{BuildHasher, Hash, RandomState};

use crate::{NodeId, Value};

/// Containers up to this many entries are scanned rather than indexed.
const LINEAR_MAX: usize = 16;

/// What Python's `==` and `hash` see of a key.
#[derive(Debug, PartialEq, Eq, Hash)]
enum Key<'a> {
    None,
    /// Ints, bools and floats with an integral value that fits in an i64.
    Int(i64),
    BigInt(&'a [u8]),
    /// Other floats, except NaN, by bit pattern.
    Float(u64),
    Str(&'a str),
    Bytes(&'a [u8]),
    /// Anything else, by identity.
    Node(NodeId),
}

impl<'a> Key<'a> {
    fn of(nodes: &'a [Value], id: NodeId) -> Key<'a> {
        match nodes.get(id.0 as usize) {
            Some(Value::None) => Key::None,
            Some(Value::Bool(b)) => Key::Int(i64::from(*b)),
            Some(Value::Int(i)) => Key::Int(*i),
            Some(Value::BigInt(b)) => Key::BigInt(b),
            Some(Value::Float(f)) => float_key(*f).unwrap_or(Key::Node(id)),
            Some(Value::Str(s)) => Key::Str(s),
            Some(Value::Bytes(b)) => Key::Bytes(b),
            _ => Key::Node(id),
        }
    }
}

/// The key of a float, or `None` for NaN (which equals nothing but itself).
fn float_key(f: f64) -> Option<Key<'static>> {
    if f.is_nan() {
        return None;
    }
    // 2^63 is exactly representable; every integral float in [-2^63, 2^63) fits in i64.
    const LIMIT: f64 = 9_223_372_036_854_775_808.0;
    if f.fract() == 0.0 && (-LIMIT..LIMIT).contains(&f) {
        return Some(Key::Int(f as i64));
    }
    Some(Key::Float(f.to_bits()))
}

/// Positions that share a hash.
enum Slots {
    One(u32),
    Many(Vec<u32>),
}

/// Lazily built hash indexes over the keys of large dicts and sets.
pub(crate) struct KeyIndex {
    hasher: RandomState,
    tables: HashMap<NodeId, HashMap<u64, Slots>>,
}

impl KeyIndex {
    pub fn new() -> Self {
        KeyIndex {
            hasher: RandomState::new(),
            tables: HashMap::new(),
        }
    }

    /// Position of an entry of `container` whose key equals `key`, where `key_at(i)`
    /// gives the key of entry `i` of the `len` entries.
    pub fn find(
        &mut self,
        nodes: &[Value],
        container: NodeId,
        len: usize,
        key_at: impl Fn(usize) -> Option<NodeId>,
        key: NodeId,
    ) -> Option<usize> {
        let wanted = Key::of(nodes, key);
        let same = |i: usize| key_at(i).is_some_and(|k| Key::of(nodes, k) == wanted);
        if len <= LINEAR_MAX {
            return (0..len).find(|&i| same(i));
        }
        let hasher = &self.hasher;
        let table = self.tables.entry(container).or_insert_with(|| {
            let mut table = HashMap::with_capacity(len);
            for i in 0..len {
                if let Some(k) = key_at(i) {
                    add_slot(&mut table, hasher.hash_one(Key::of(nodes, k)), i);
                }
            }
            table
        });
        match table.get(&hasher.hash_one(&wanted))? {
            Slots::One(i) => Some(*i as usize).filter(|&i| same(i)),
            Slots::Many(list) => list.iter().map(|&i| i as usize).find(|&i| same(i)),
        }
    }

    /// Records that entry `pos` of `container` now has key `key` (after a push).
    pub fn added(&mut self, nodes: &[Value], container: NodeId, pos: usize, key: NodeId) {
        if let Some(table) = self.tables.get_mut(&container) {
            add_slot(table, self.hasher.hash_one(Key::of(nodes, key)), pos);
        }
    }
}

fn add_slot(table: &mut HashMap<u64, Slots>, hash: u64, pos: usize) {
    // Containers are bounded by `Limits::max_container_len`, which the parser clamps
    // to u32, so positions fit.
    let pos = u32::try_from(pos).unwrap_or(u32::MAX);
    match table.get_mut(&hash) {
        None => {
            table.insert(hash, Slots::One(pos));
        }
        Some(Slots::One(first)) => {
            let first = *first;
            table.insert(hash, Slots::Many(vec![first, pos]));
        }
        Some(Slots::Many(list)) => list.push(pos),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn python_equal_primitives_share_a_key() {
        let nodes = vec![
            Value::Int(1),
            Value::Bool(true),
            Value::Float(1.0),
            Value::Float(1.5),
            Value::Float(f64::NAN),
            Value::Str("a".into()),
            Value::Bytes(b"a".to_vec()),
            Value::Tuple(vec![]),
            Value::Float(-0.0),
            Value::Int(0),
        ];
        let key = |i: u32| Key::of(&nodes, NodeId(i));
        assert_eq!(key(0), key(1));
        assert_eq!(key(0), key(2));
        assert_ne!(key(0), key(3));
        // NaN equals only itself: it is keyed by identity.
        assert_eq!(key(4), Key::Node(NodeId(4)));
        assert_ne!(key(5), key(6));
        assert_eq!(key(7), Key::Node(NodeId(7)));
        assert_eq!(key(8), key(9));
    }

    #[test]
    fn large_containers_find_keys_through_the_index() {
        let mut nodes: Vec<Value> = (0..100).map(|i| Value::Str(format!("k{i}"))).collect();
        nodes.push(Value::Str("k57".into()));
        let keys: Vec<NodeId> = (0..100).map(NodeId).collect();
        let mut index = KeyIndex::new();
        let container = NodeId(1000);
        let key_at = |i: usize| keys.get(i).copied();
        assert_eq!(
            index.find(&nodes, container, 100, key_at, NodeId(100)),
            Some(57)
        );
        nodes.push(Value::Str("new".into()));
        assert_eq!(
            index.find(&nodes, container, 100, key_at, NodeId(101)),
            None
        );
    }
}
