//! An inert pickle reader.
//!
//! `unshard-pickle` turns the bytes of a Python pickle (protocols 0 to 5) into a tree
//! of [`Value`]s held in an arena ([`Pickle`]). It never imports, calls or executes
//! anything: a `GLOBAL` becomes a [`Value::Global`] naming the class, and applying it
//! (`REDUCE`, `NEWOBJ`, `INST`, `OBJ`, `BUILD`) builds an opaque [`Value::Object`]
//! that records what *would* have been called. Interpreting those objects (torch's
//! `_rebuild_tensor_v2`, DCP dataclasses, ...) is the caller's job.
//!
//! The parser knows nothing about torch. The only calls it interprets are a handful of
//! pure Python builtins whose result is plain data: `collections.OrderedDict()`
//! (also `defaultdict(..)` and `Counter(..)`), `set`/`frozenset`, `bytes`/`bytearray`,
//! `_codecs.encode(str, 'latin1')` and `getattr(<global>, name)` (which yields a
//! nested global name). Both `builtins` and Python 2's `__builtin__` are accepted; other
//! global names are kept exactly as written (`copy_reg` is not renamed `copyreg`).
//!
//! Every global a pickle names and every call it asks for is logged with its byte
//! offset ([`Pickle::trace`]), on every path: results discarded by `POP`, values only
//! in the memo, `BUILD` states, persistent ids. [`audit()`] classifies that log against
//! an allowlist of what torch, DeepSpeed and the checkpoint formats legitimately use
//! (the one place in the crate that names them) and reports everything else as code
//! that would run under `torch.load`.
//!
//! Values live in an arena and refer to each other by [`NodeId`]. The memo stores ids,
//! so `BINGET` shares a node instead of copying it, and mutation of a memoised list or
//! dict (`APPENDS`/`SETITEMS` after `BINPUT`) is seen through every reference, as in
//! Python. Because of that, the graph may contain cycles (a list that contains itself):
//! code that walks it must bound its depth.
//!
//! Every resource a hostile file could inflate is bounded by [`Limits`]: node count,
//! container length, total container items, total string/bytes payload, memo size and
//! mark-stack depth. Length fields are checked against the input before anything is
//! allocated, and no opcode does work that earlier input did not pay for (re-using a
//! memoised multi-megabyte key is as cheap as re-using a small one), so parsing time is
//! linear in the input. Errors carry the byte offset and opcode at which parsing stopped.
//!
//! # Using it
//!
//! ```
//! // pickle.dumps({'w': [1, 2]}, protocol=2)
//! let data = b"\x80\x02}q\x00X\x01\x00\x00\x00wq\x01]q\x02(K\x01K\x02es.";
//! let pickle = unshard_pickle::parse(data)?;
//! let w = pickle.dict_get(pickle.root(), "w").expect("key w");
//! let items: Vec<i64> = pickle
//!     .items(w)
//!     .unwrap_or_default()
//!     .iter()
//!     .filter_map(|&id| pickle.as_int(id))
//!     .collect();
//! assert_eq!(items, [1, 2]);
//! assert_eq!(pickle.describe(w), "list(2 items)");
//! # Ok::<(), unshard_pickle::Error>(())
//! ```
//!
//! # Decisions
//!
//! * **Python semantics where they are data.** Dict keys that Python would find equal
//!   (`1`, `True`, `1.0`; equal strings) are merged as `SETITEM` does in Python, so the
//!   reader sees the same dict as `pickle.load`. Python 2 `str` (`STRING`, `BINSTRING`,
//!   `SHORT_BINSTRING`) is read as latin-1 text, like `encoding='latin1'`, so byte
//!   values survive. Integers that fit in an i64 are [`Value::Int`] whatever opcode
//!   carried them; `INT 01`/`INT 00` are booleans.
//! * **Mark stack, not sentinels.** `MARK` records the stack height, and pops may not
//!   cross the innermost mark, as in CPython's `_pickle.c`.
//! * **Inert calls.** `REDUCE`, `NEWOBJ`, `NEWOBJ_EX`, `INST` and `OBJ` make
//!   [`Value::Object`]s, except for the pure builtins listed above. `BUILD` stores its
//!   state on an object and is ignored on plain values (every torch state dict is an
//!   `OrderedDict` with a `_metadata` attribute set by `BUILD`).
//! * **Extensions.** `EXT1/2/4` look a code up in `copyreg`'s extension registry,
//!   which is empty in a fresh Python process (torch registers nothing). A pickle can
//!   only use one after registering it itself with a `copyreg.add_extension` call,
//!   which the reader notes (without calling anything) so that the `EXT` opcode
//!   yields the global it names, and the audit sees it. An unregistered code is an
//!   error, as under `pickle.load`.
//! * **Unsupported.** `NEXT_BUFFER`/`READONLY_BUFFER` need out-of-band buffers; they
//!   are errors, as is a `PROTO` above 5.
//! * **Bounded copies.** Builtin calls that copy an earlier value (`set(list)`,
//!   `_codecs.encode(text)`, `getattr` lengthening a name) are charged to a budget of
//!   twice the input plus 1 MiB, global names are at most 1 KiB, and allocations whose
//!   size comes from the input use `try_reserve`, so a hostile pickle gets an error,
//!   never an abort.
//! * **No recursion.** Parsing is a loop over opcodes, dropping a [`Pickle`] drops one
//!   flat vector, and [`Pickle::describe`] looks one level deep. 100 000 nested tuples
//!   are fine.
//! * **End of input.** A pickle ends at `STOP`; bytes after it are not looked at
//!   ([`parse_prefix`] returns where they start, for the legacy torch format that puts
//!   several pickles back to back).
//! * **Templates.** Many files written by the same code for the ranks of one job
//!   hold pickles that differ only in a few integers. [`Template::parse`] keeps a
//!   parsed pickle with where each opcode starts; [`Template::changes`] checks another
//!   pickle against it opcode by opcode without building anything, and when only
//!   integers differ (none of them compared as a dict key or set member)
//!   [`Pickle::apply`] turns a copy of the template's arena into that pickle's.

mod access;
pub mod audit;
mod builtins;
mod error;
mod keys;
mod literal;
mod machine;
pub mod opcode;
mod template;
pub mod trace;

pub use access::ObjectRef;
pub use audit::{audit, Audit, Finding, Verdict};
pub use error::{Error, ErrorKind};
pub use template::{Changes, Template};
pub use trace::Trace;

/// Parses one pickle with the default [`Limits`]. The input must hold a whole pickle,
/// ending at `STOP`; bytes after `STOP` are ignored.
pub fn parse(data: &[u8]) -> Result<Pickle, Error> {
    parse_prefix(data, &Limits::default()).map(|(pickle, _)| pickle)
}

/// Parses one pickle with the given limits. Bytes after `STOP` are ignored.
pub fn parse_with_limits(data: &[u8], limits: &Limits) -> Result<Pickle, Error> {
    parse_prefix(data, limits).map(|(pickle, _)| pickle)
}

/// Parses the pickle at the start of `data` and returns it with the offset just after
/// its `STOP`, where the next pickle (or raw data) begins.
pub fn parse_prefix(data: &[u8], limits: &Limits) -> Result<(Pickle, usize), Error> {
    let outcome = machine::Machine::new(data, limits).run();
    match outcome.error {
        Some(error) => Err(error),
        None => Ok((outcome.pickle, outcome.end)),
    }
}

/// A pickle parsed as far as it goes: what a scanner needs, since `pickle.load` runs
/// every call a pickle makes before the point where it breaks.
#[derive(Debug)]
pub struct Partial {
    /// The arena and trace up to `STOP`, or up to the opcode that failed. After a
    /// failure the root is the value that was on top of the stack (or node 0).
    pub pickle: Pickle,
    /// Offset just after `STOP`, or of the byte after the failing opcode.
    pub end: usize,
    /// Why parsing stopped before `STOP`, if it did.
    pub error: Option<Error>,
}

/// Parses the pickle at the start of `data` like [`parse_prefix`], but keeps what was
/// parsed when it fails.
pub fn parse_partial(data: &[u8], limits: &Limits) -> Partial {
    let outcome = machine::Machine::new(data, limits).run();
    Partial {
        pickle: outcome.pickle,
        end: outcome.end,
        error: outcome.error,
    }
}

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
    /// Boxed, as globals are few and every node is as large as the largest variant.
    Global(Box<GlobalName>),
    /// The result of applying a callable that is not one of the interpreted builtins.
    Object {
        kind: ObjectKind,
        /// The node that was called: usually a `Global`.
        callable: NodeId,
        /// The argument tuple (a `Tuple` node).
        args: NodeId,
        /// The `BUILD` state, if any (the last one wins).
        state: Option<NodeId>,
        /// Items added by `APPEND(S)` or `SETITEM(S)` (e.g. a list subclass or a
        /// `defaultdict`); `None` until the first one, which few objects get.
        items: Option<Box<ObjectItems>>,
    },
    /// `PERSID`/`BINPERSID`: the persistent id value (torch's storage tuples).
    PersistentId(NodeId),
}

/// The module and name of a [`Value::Global`].
#[derive(Clone, Debug, PartialEq)]
pub struct GlobalName {
    pub module: String,
    pub name: String,
}

/// Items added to an opaque [`Value::Object`] as if it were a list or a dict.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ObjectItems {
    /// Items added by `APPEND(S)`.
    pub list: Vec<NodeId>,
    /// Items added by `SETITEM(S)`, in order.
    pub dict: Vec<(NodeId, NodeId)>,
}

impl Value {
    /// A `Global` value.
    pub fn global(module: impl Into<String>, name: impl Into<String>) -> Value {
        Value::Global(Box::new(GlobalName {
            module: module.into(),
            name: name.into(),
        }))
    }

    /// The Python type name of the value, for messages: `"dict"`, `"str"`, `"object"`, ...
    pub fn type_name(&self) -> &'static str {
        match self {
            Value::None => "None",
            Value::Bool(_) => "bool",
            Value::Int(_) | Value::BigInt(_) => "int",
            Value::Float(_) => "float",
            Value::Str(_) => "str",
            Value::Bytes(_) => "bytes",
            Value::Tuple(_) => "tuple",
            Value::List(_) => "list",
            Value::Dict(_) => "dict",
            Value::Set(_) => "set",
            Value::FrozenSet(_) => "frozenset",
            Value::Global(_) => "global",
            Value::Object { .. } => "object",
            Value::PersistentId(_) => "persistent id",
        }
    }
}

/// Resource bounds for one parse. The defaults comfortably hold real checkpoints
/// (a 1T-parameter state dict has well under a million nodes) while keeping a
/// hostile file from allocating more than a few hundred MB or running for long.
///
/// Every opcode creates at most a few nodes and items, so memory also grows at most
/// linearly with the input: roughly 50 bytes per input byte in the worst case (a node
/// is 32 bytes). A caller that reads untrusted pickles of tens of megabytes and
/// wants a tighter memory bound than `max_nodes` gives should lower it; one that reads
/// pickles legitimately larger than the defaults allow (the `.metadata` of a
/// checkpoint of thousands of ranks) can raise them with [`Limits::scaled_to`].
#[derive(Clone, Debug)]
pub struct Limits {
    /// Maximum number of nodes in the arena. Also bounds the value stack and the total
    /// number of entries over all containers (so that copies such as `set(list)`
    /// repeated many times cannot multiply memory). Clamped to `u32::MAX`.
    pub max_nodes: usize,
    /// Maximum number of items in one container (tuple, list, dict, set, args).
    /// Clamped to `u32::MAX`.
    pub max_container_len: usize,
    /// Maximum total bytes of all `Str`/`Bytes`/`BigInt` payloads together (global
    /// names included).
    pub max_payload_bytes: usize,
    /// Maximum number of memo entries.
    pub max_memo: usize,
    /// Maximum depth of the mark stack (nested `MARK`s).
    pub max_marks: usize,
}

impl Limits {
    /// These limits, raised where needed so that a pickle of `input_len` bytes may
    /// hold one node (and one memo entry) per two bytes and all of its bytes as
    /// payload. Real pickles of plain data use about one node per five bytes (a DCP
    /// `.metadata` of 1.75 M chunks: 247 MB, 48 M nodes), so they fit with room to
    /// spare, while memory stays linear in the input: at most about 16 bytes of nodes
    /// per input byte, beyond what the limits allowed already.
    pub fn scaled_to(mut self, input_len: usize) -> Limits {
        let half = input_len / 2;
        self.max_nodes = self.max_nodes.max(half);
        self.max_memo = self.max_memo.max(half);
        self.max_container_len = self.max_container_len.max(half);
        self.max_payload_bytes = self.max_payload_bytes.max(input_len);
        self
    }

    /// What is left of these limits once `used` has been parsed under them: readers
    /// of files that hold several pickles (the legacy torch format has five) parse
    /// each with what the earlier ones left, so that the bounds hold per file.
    pub fn remaining_after(&self, used: &Pickle) -> Limits {
        let usage = used.usage();
        Limits {
            max_nodes: self.max_nodes.saturating_sub(usage.nodes),
            max_container_len: self.max_container_len,
            max_payload_bytes: self.max_payload_bytes.saturating_sub(usage.payload_bytes),
            max_memo: self.max_memo,
            max_marks: self.max_marks,
        }
    }
}

/// What a parse used of its [`Limits`] (see [`Limits::remaining_after`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    /// Nodes in the arena.
    pub nodes: usize,
    /// Bytes of `Str`, `Bytes`, `BigInt` and global-name payload.
    pub payload_bytes: usize,
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
    trace: Trace,
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

    /// Every global the pickle named and every call it asked for, in file order.
    pub fn trace(&self) -> &Trace {
        &self.trace
    }

    /// What parsing this pickle used of its limits.
    pub fn usage(&self) -> Usage {
        let payload_bytes = self
            .nodes
            .iter()
            .map(|v| match v {
                Value::Str(s) => s.len(),
                Value::Bytes(b) | Value::BigInt(b) => b.len(),
                Value::Global(g) => g.module.len() + g.name.len(),
                _ => 0,
            })
            .sum();
        Usage {
            nodes: self.nodes.len(),
            payload_bytes,
        }
    }

    /// Whether the arena is empty (never true for a parsed pickle).
    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_node_stays_small() {
        // `Limits` docs promise about 72 bytes per node; a larger `Value` would need
        // new defaults.
        assert!(
            std::mem::size_of::<Value>() <= 72,
            "{}",
            std::mem::size_of::<Value>()
        );
    }
}
