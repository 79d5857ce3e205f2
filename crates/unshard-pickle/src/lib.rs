//! An inert pickle reader.
//!
//! `unshard-pickle` turns the bytes of a Python pickle (protocols 0 to 5) into a tree
//! of [`Value`]s held in an arena ([`Pickle`]). It never imports, calls or executes
//! anything: a `GLOBAL` becomes a [`Value::Global`] naming the class, and applying it
//! (`REDUCE`, `NEWOBJ`, `INST`, `OBJ`, `BUILD`) builds an opaque [`Value::Object`]
//! that records what *would* have been called. Interpreting those objects (torch's
//! `_rebuild_tensor_v2`, DCP dataclasses, ...) is the caller's job.
//!
//! The crate knows nothing about torch. The only calls it interprets are a handful of
//! pure Python builtins whose result is plain data: `collections.OrderedDict()`,
//! `set`/`frozenset`, `bytearray`, `_codecs.encode(str, 'latin1')` and
//! `getattr(<global>, name)` (which yields a nested global name).
//!
//! Values live in an arena and refer to each other by [`NodeId`]. The memo stores ids,
//! so `BINGET` shares a node instead of copying it, and mutation of a memoised list or
//! dict (`APPENDS`/`SETITEMS` after `BINPUT`) is seen through every reference, as in
//! Python. Because of that, the graph may contain cycles (a list that contains itself):
//! code that walks it must bound its depth.
//!
//! Every resource a hostile file could inflate is bounded by [`Limits`]: node count,
//! container length, total string/bytes payload, memo size and mark-stack depth.
//! Errors carry the byte offset and opcode at which parsing stopped.

/// Index of a node in a [`Pickle`] arena.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NodeId(pub u32);

/// How an opaque object was produced.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ObjectKind {
    /// `callable(*args)` through `REDUCE`.
    Reduce,
    /// `cls.__new__(cls, *args)` through `NEWOBJ` / `NEWOBJ_EX` (kwargs dropped).
    NewObj,
    /// Protocol-0 `INST` / `OBJ`.
    Inst,
}

/// One value of the pickle graph.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    None,
    Bool(bool),
    /// Any integer that fits in an i64.
    Int(i64),
    /// An integer too large for i64: two's-complement little-endian bytes as in `LONG1`.
    BigInt(Vec<u8>),
    Float(f64),
    Str(String),
    Bytes(Vec<u8>),
    Tuple(Vec<NodeId>),
    List(Vec<NodeId>),
    /// Insertion order is kept; keys may be any value (DCP uses dataclasses as keys).
    Dict(Vec<(NodeId, NodeId)>),
    Set(Vec<NodeId>),
    FrozenSet(Vec<NodeId>),
    /// A class or function reference from `GLOBAL`/`STACK_GLOBAL`. Never resolved.
    Global { module: String, name: String },
    /// The result of applying a callable that is not one of the interpreted builtins.
    Object {
        kind: ObjectKind,
        /// The node that was called: usually a `Global`.
        callable: NodeId,
        /// The argument tuple (a `Tuple` node).
        args: NodeId,
        /// The `BUILD` state, if any (the last one wins).
        state: Option<NodeId>,
        /// Items added by `APPEND(S)` to this object (e.g. a list subclass).
        list_items: Vec<NodeId>,
        /// Items added by `SETITEM(S)` to this object (e.g. a `defaultdict`).
        dict_items: Vec<(NodeId, NodeId)>,
    },
    /// `PERSID`/`BINPERSID`: the persistent id value (torch's storage tuples).
    PersistentId(NodeId),
}

/// Resource bounds for one parse. The defaults comfortably hold real checkpoints
/// (a 1T-parameter state dict has well under a million nodes) while keeping a
/// hostile file from allocating more than a few hundred MB or running for long.
#[derive(Clone, Debug)]
pub struct Limits {
    /// Maximum number of nodes in the arena.
    pub max_nodes: usize,
    /// Maximum number of items in one container (tuple, list, dict, set, args).
    pub max_container_len: usize,
    /// Maximum total bytes of all `Str`/`Bytes`/`BigInt` payloads together.
    pub max_payload_bytes: usize,
    /// Maximum number of memo entries.
    pub max_memo: usize,
    /// Maximum depth of the mark stack (nested `MARK`s).
    pub max_marks: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_nodes: 50_000_000,
            max_container_len: 50_000_000,
            max_payload_bytes: 1 << 30,
            max_memo: 50_000_000,
            max_marks: 100_000,
        }
    }
}

/// A parsed pickle: an arena of values and the root (the value `STOP` returned).
#[derive(Clone, Debug)]
pub struct Pickle {
    nodes: Vec<Value>,
    root: NodeId,
}

impl Pickle {
    /// The value the pickle returned.
    pub fn root(&self) -> NodeId {
        self.root
    }

    /// The value of a node. Ids come from this arena, so this never fails for them;
    /// an id from another arena that is out of range yields `Value::None`.
    pub fn get(&self, id: NodeId) -> &Value {
        self.nodes.get(id.0 as usize).unwrap_or(&Value::None)
    }

    /// Number of nodes in the arena.
    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    /// Whether the arena is empty (never true for a parsed pickle).
    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }
}
