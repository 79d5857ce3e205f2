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
//! Cost. A memoised key can be a multi-megabyte string and be stored again and again
//! by five-byte opcodes, so comparing contents per store would let a small file run for
//! hours. Instead each string, bytes or big-int node is *interned* the first time it is
//! used as a key: hashed once and compared once against the earlier node with the same
//! hash, and from then on stands for a canonical node id. Every later comparison is an
//! integer compare, and the content work is bounded by the payload the file paid for.
//! Small containers are scanned; one that grows past [`LINEAR_MAX`] entries gets a hash
//! table, so a state dict of a million keys costs O(n), not O(n²). The hasher is seeded
//! randomly per parse, so a file cannot be built to collide.

use std::collections::HashMap;
use std::hash::{BuildHasher, RandomState};

use crate::{NodeId, Value};

/// Containers up to this many entries are scanned rather than indexed.
const LINEAR_MAX: usize = 16;

/// What Python's `==` and `hash` see of a key, reduced to a small value.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Key {
    None,
    /// Ints, bools and floats with an integral value that fits in an i64.
    Int(i64),
    /// Other floats, except NaN, by bit pattern.
    Float(u64),
    /// A `Str`, `Bytes` or `BigInt`, by the first node seen with the same content.
    Content(NodeId),
    /// Anything else (and NaN), by identity.
    Node(NodeId),
}

/// Lazily built key identities and hash indexes over large dicts and sets.
pub(crate) struct KeyIndex {
    hasher: RandomState,
    /// Canonical node of every content node interned so far.
    canonical: HashMap<NodeId, NodeId>,
    /// Canonical content nodes by content hash.
    by_hash: HashMap<u64, Vec<NodeId>>,
    /// Per large container: key -> position.
    tables: HashMap<NodeId, HashMap<Key, u32>>,
}

impl KeyIndex {
    pub fn new() -> Self {
        KeyIndex {
            hasher: RandomState::new(),
            canonical: HashMap::new(),
            by_hash: HashMap::new(),
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
        let wanted = self.key(nodes, key);
        if len <= LINEAR_MAX {
            return (0..len).find(|&i| key_at(i).is_some_and(|k| self.key(nodes, k) == wanted));
        }
        if !self.tables.contains_key(&container) {
            let mut table = HashMap::with_capacity(len);
            for i in 0..len {
                if let Some(k) = key_at(i) {
                    let k = self.key(nodes, k);
                    // The first entry with a key wins, as lookups must find it.
                    table.entry(k).or_insert(position(i));
                }
            }
            self.tables.insert(container, table);
        }
        let table = self.tables.get(&container)?;
        table.get(&wanted).map(|&i| i as usize)
    }

    /// Records that entry `pos` of `container` now has key `key` (after a push).
    pub fn added(&mut self, nodes: &[Value], container: NodeId, pos: usize, key: NodeId) {
        if self.tables.contains_key(&container) {
            let k = self.key(nodes, key);
            if let Some(table) = self.tables.get_mut(&container) {
                table.entry(k).or_insert(position(pos));
            }
        }
    }

    fn key(&mut self, nodes: &[Value], id: NodeId) -> Key {
        match nodes.get(id.0 as usize) {
            Some(Value::None) => Key::None,
            Some(Value::Bool(b)) => Key::Int(i64::from(*b)),
            Some(Value::Int(i)) => Key::Int(*i),
            Some(Value::Float(f)) => float_key(*f).unwrap_or(Key::Node(id)),
            Some(Value::Str(_) | Value::Bytes(_) | Value::BigInt(_)) => {
                Key::Content(self.intern(nodes, id))
            }
            _ => Key::Node(id),
        }
    }

    /// The first node seen with the same type and content as `id`.
    fn intern(&mut self, nodes: &[Value], id: NodeId) -> NodeId {
        if let Some(&canonical) = self.canonical.get(&id) {
            return canonical;
        }
        let content = content_of(nodes, id);
        let hash = self.hasher.hash_one(content);
        let candidates = self.by_hash.entry(hash).or_default();
        let canonical = match candidates
            .iter()
            .copied()
            .find(|&c| content_of(nodes, c) == content)
        {
            Some(c) => c,
            None => {
                candidates.push(id);
                id
            }
        };
        self.canonical.insert(id, canonical);
        canonical
    }
}

/// The type tag and bytes of a content node.
fn content_of(nodes: &[Value], id: NodeId) -> (u8, &[u8]) {
    match nodes.get(id.0 as usize) {
        Some(Value::Str(s)) => (0, s.as_bytes()),
        Some(Value::Bytes(b)) => (1, b),
        // Minimal two's-complement bytes: equal numbers have equal bytes.
        Some(Value::BigInt(b)) => (2, b),
        _ => (3, &[]),
    }
}

/// The key of a float, or `None` for NaN (which equals nothing but itself).
fn float_key(f: f64) -> Option<Key> {
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

/// Containers are bounded by `Limits::max_container_len`, which the parser clamps to
/// u32, so positions fit.
fn position(i: usize) -> u32 {
    u32::try_from(i).unwrap_or(u32::MAX)
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
            Value::Str("a".into()),
        ];
        let mut index = KeyIndex::new();
        let mut key = |i: u32| index.key(&nodes, NodeId(i));
        assert_eq!(key(0), key(1));
        assert_eq!(key(0), key(2));
        assert_ne!(key(0), key(3));
        // NaN equals only itself: it is keyed by identity.
        assert_eq!(key(4), Key::Node(NodeId(4)));
        assert_ne!(key(5), key(6), "str and bytes differ");
        assert_eq!(key(5), key(10), "equal strings in two nodes");
        assert_eq!(key(7), Key::Node(NodeId(7)));
        assert_eq!(key(8), key(9));
    }

    #[test]
    fn large_containers_find_keys_through_the_index() {
        let mut nodes: Vec<Value> = (0..100).map(|i| Value::Str(format!("k{i}"))).collect();
        nodes.push(Value::Str("k57".into()));
        nodes.push(Value::Str("new".into()));
        let keys: Vec<NodeId> = (0..100).map(NodeId).collect();
        let mut index = KeyIndex::new();
        let container = NodeId(1000);
        let key_at = |i: usize| keys.get(i).copied();
        assert_eq!(
            index.find(&nodes, container, 100, key_at, NodeId(100)),
            Some(57)
        );
        assert_eq!(
            index.find(&nodes, container, 100, key_at, NodeId(101)),
            None
        );
        index.added(&nodes, container, 100, NodeId(101));
        assert_eq!(
            index.find(&nodes, container, 101, key_at, NodeId(101)),
            Some(100)
        );
    }
}
