//! The pickle virtual machine: reads opcodes and builds the arena, one opcode at a time.
//!
//! The machine follows CPython's `_pickle.c` unpickler, with three differences that
//! make it inert and bounded:
//!
//! * Globals are never imported and calls are never made (see [`crate::builtins`] for
//!   the few that are interpreted as data). Everything else becomes an `Object` node.
//! * The memo is a vector indexed by key for the keys writers use (0, 1, 2, ... in
//!   order, as CPython's pickler and `MEMOIZE` assign them) and a `HashMap` for any
//!   other key, so a `LONG_BINPUT 4000000000` costs one entry, not a four-billion-slot
//!   vector.
//! * Every allocation is charged to [`Limits`] *before* it is made, and every length
//!   field is checked against the bytes left in the input before anything is copied.
//!   Each opcode does work proportional to its own argument or to the values it takes
//!   off the stack (which earlier opcodes paid for), so parsing is linear in the input.
//!
//! Marks are kept CPython-style: the mark stack records stack heights, and the height
//! of the topmost mark is a fence that ordinary pops may not cross.

use std::collections::HashMap;

use crate::builtins::{self, Builtin};
use crate::keys::KeyIndex;
use crate::literal;
use crate::opcode::{self as op, name as op_name};
use crate::template::{is_literal_op, Record, FIXED};
use crate::trace::{CallSite, GlobalRef, Trace};
use crate::{Error, ErrorKind, Limits, NodeId, ObjectKind, Pickle, Value};

/// Longest module or name of a global, in bytes. Real ones are well under 200 bytes;
/// without a bound, `STACK_GLOBAL` of a memoised megabyte string (or a chain of
/// `getattr` calls that each lengthen a name) copies megabytes per opcode.
pub(crate) const MAX_GLOBAL_NAME: usize = 1024;

/// Bytes and items that builtin calls may copy from values parsed earlier, per input
/// byte, on top of [`COPY_ALLOWANCE`]. A legitimate pickle copies each value at most
/// once (`set([...])`, `_codecs.encode(text)`), so this is never reached by one; a
/// hostile one that converts the same memoised value over and over is stopped in time
/// and memory linear in its size.
const COPY_PER_INPUT_BYTE: usize = 2;
/// See [`COPY_PER_INPUT_BYTE`].
const COPY_ALLOWANCE: usize = 1 << 20;

type Result<T> = std::result::Result<T, ErrorKind>;

/// The memo: keys `0..dense.len()` in a vector (every slot filled), any other key in
/// `sparse`. A key is moved to the vector when the vector grows to reach it, so each
/// key lives in exactly one of the two.
#[derive(Default)]
struct Memo {
    dense: Vec<NodeId>,
    sparse: HashMap<u64, NodeId>,
}

impl Memo {
    fn len(&self) -> usize {
        self.dense.len() + self.sparse.len()
    }

    fn get(&self, key: u64) -> Option<NodeId> {
        match usize::try_from(key) {
            Ok(k) if k < self.dense.len() => self.dense.get(k).copied(),
            _ => self.sparse.get(&key).copied(),
        }
    }

    fn insert(&mut self, key: u64, id: NodeId) {
        let n = self.dense.len();
        match usize::try_from(key) {
            Ok(k) if k < n => self.dense[k] = id,
            Ok(k) if k == n => {
                self.dense.push(id);
                if !self.sparse.is_empty() {
                    self.sparse.remove(&key);
                    // Keys stored out of order earlier join the vector once it reaches them.
                    while let Some(next) = self.sparse.remove(&(self.dense.len() as u64)) {
                        self.dense.push(next);
                    }
                }
            }
            _ => {
                self.sparse.insert(key, id);
            }
        }
    }
}

/// The unpickler state while one pickle is read.
pub(crate) struct Machine<'a> {
    data: &'a [u8],
    /// Offset of the next unread byte.
    pos: usize,
    limits: Limits,
    /// The opcode being executed, for error messages.
    op: u8,
    nodes: Vec<Value>,
    stack: Vec<NodeId>,
    /// Stack heights at each open `MARK`, innermost last.
    marks: Vec<usize>,
    memo: Memo,
    keys: KeyIndex,
    /// Bytes of string, bytes and big-integer payload allocated so far.
    payload: usize,
    /// Container entries allocated so far, over all containers.
    items: usize,
    /// Bytes and items copied by builtin calls so far, and the bound.
    copied: usize,
    copy_limit: usize,
    /// Offset of the opcode being executed, for the trace.
    at: usize,
    trace: Trace,
    /// Calls of a global already logged, by (callable, opcode, first argument if it
    /// is a global): a state dict calls `_rebuild_tensor_v2` once per tensor and a DCP
    /// `.metadata` a dataclass millions of times; the audit needs each once.
    logged_calls: std::collections::HashSet<(u32, u8, u32)>,
    /// `copyreg.add_extension(module, name, code)` calls made so far: code -> name.
    extensions: HashMap<i64, (String, String)>,
    /// What a template parse records (see [`crate::template`]).
    record: Option<Record>,
}

/// The result of running the machine: the arena (complete, or as far as parsing got)
/// and how it ended.
pub(crate) struct Outcome {
    pub pickle: Pickle,
    /// Offset just after `STOP`, or where parsing stopped.
    pub end: usize,
    pub error: Option<Error>,
}

impl<'a> Machine<'a> {
    pub fn new(data: &'a [u8], limits: &Limits) -> Self {
        let mut limits = limits.clone();
        // Node ids and indexed positions are u32.
        let max_u32 = u32::MAX as usize;
        limits.max_nodes = limits.max_nodes.min(max_u32);
        limits.max_container_len = limits.max_container_len.min(max_u32);
        Machine {
            data,
            pos: 0,
            limits,
            op: 0,
            nodes: Vec::new(),
            stack: Vec::new(),
            marks: Vec::new(),
            memo: Memo::default(),
            keys: KeyIndex::new(),
            payload: 0,
            items: 0,
            copied: 0,
            copy_limit: data
                .len()
                .saturating_mul(COPY_PER_INPUT_BYTE)
                .saturating_add(COPY_ALLOWANCE),
            at: 0,
            trace: Trace::default(),
            logged_calls: std::collections::HashSet::new(),
            extensions: HashMap::new(),
            record: None,
        }
    }

    /// Records what a [`crate::Template`] needs while running.
    pub fn record(&mut self, record: Record) {
        self.record = Some(record);
    }

    /// [`Machine::run`], and what was recorded.
    pub fn run_recorded(self) -> (Outcome, Option<Record>) {
        let mut record = None;
        let outcome = self.run_with(&mut record);
        (outcome, record)
    }

    /// Runs up to and including `STOP`, or until an error; returns the arena either way
    /// (a scanner wants what a broken pickle did before it broke: `pickle.load` ran it).
    pub fn run(self) -> Outcome {
        self.run_with(&mut None)
    }

    fn run_with(mut self, record_out: &mut Option<Record>) -> Outcome {
        let (root, error) = loop {
            let offset = self.pos;
            let Some(&op) = self.data.get(offset) else {
                let error = Error {
                    offset,
                    opcode: None,
                    kind: ErrorKind::NoStop,
                };
                break (None, Some(error));
            };
            self.pos += 1;
            self.op = op;
            self.at = offset;
            let nodes_before = self.nodes.len();
            if let Some(r) = &mut self.record {
                // The data fits u32 offsets (checked before recording).
                r.ops.push((offset as u32, FIXED));
            }
            let stepped = self.step(op);
            if let (Some(r), true) = (&mut self.record, is_literal_op(op)) {
                let made = self
                    .nodes
                    .len()
                    .checked_sub(1)
                    .filter(|&n| n == nodes_before);
                if let (Some(n), Some(last)) = (made, r.ops.last_mut()) {
                    if matches!(self.nodes.get(n), Some(Value::Int(_) | Value::Str(_))) {
                        last.1 = n as u32;
                    }
                }
            }
            match stepped {
                Ok(None) => {}
                Ok(Some(root)) => break (Some(root), None),
                Err(kind) => {
                    let error = Error {
                        offset,
                        opcode: Some(op),
                        kind,
                    };
                    break (None, Some(error));
                }
            }
        };
        *record_out = self.record.take();
        // A broken pickle's root is whatever was on top of the stack.
        let root = root
            .or_else(|| self.stack.last().copied())
            .unwrap_or(NodeId(0));
        Outcome {
            pickle: Pickle {
                nodes: self.nodes,
                root,
                trace: self.trace,
            },
            end: self.pos,
            error,
        }
    }

    /// Executes one opcode; returns the root at `STOP`.
    fn step(&mut self, code: u8) -> Result<Option<NodeId>> {
        match code {
            op::PROTO => {
                let [version] = self.take_array()?;
                if version > op::HIGHEST_PROTOCOL {
                    return Err(ErrorKind::UnsupportedProtocol(version));
                }
            }
            op::FRAME => {
                // Frames only group opcodes for buffered readers; the whole input is
                // already in memory. The length must still be honest.
                self.take_len_u64()?;
            }
            op::STOP => return self.pop().map(Some),

            op::MARK => self.mark()?,
            op::POP => self.pop_or_unmark()?,
            op::POP_MARK => {
                self.pop_mark()?;
            }
            op::DUP => self.push(self.peek()?)?,

            op::NONE => self.push_value(Value::None)?,
            op::NEWTRUE => self.push_value(Value::Bool(true))?,
            op::NEWFALSE => self.push_value(Value::Bool(false))?,
            op::INT => self.text_int()?,
            op::LONG => self.text_long()?,
            op::BININT => {
                let v = i32::from_le_bytes(self.take_array()?);
                self.push_value(Value::Int(v.into()))?;
            }
            op::BININT1 => {
                let [v] = self.take_array()?;
                self.push_value(Value::Int(v.into()))?;
            }
            op::BININT2 => {
                let v = u16::from_le_bytes(self.take_array()?);
                self.push_value(Value::Int(v.into()))?;
            }
            op::LONG1 => {
                let [len] = self.take_array()?;
                self.binary_long(len.into())?;
            }
            op::LONG4 => {
                let len = self.take_len_i32()?;
                self.binary_long(len)?;
            }
            op::FLOAT => {
                let line = self.take_line()?;
                let v = literal::parse_float(line).map_err(ErrorKind::BadLiteral)?;
                self.push_value(Value::Float(v))?;
            }
            op::BINFLOAT => {
                let v = f64::from_be_bytes(self.take_array()?);
                self.push_value(Value::Float(v))?;
            }

            op::STRING => {
                let line = self.take_line()?;
                let bytes = literal::parse_quoted_string(line).map_err(ErrorKind::BadLiteral)?;
                self.push_latin1(&bytes)?;
            }
            op::BINSTRING => {
                let len = self.take_len_i32()?;
                let bytes = self.take(len)?;
                self.push_latin1(bytes)?;
            }
            op::SHORT_BINSTRING => {
                let [len] = self.take_array()?;
                let bytes = self.take(len.into())?;
                self.push_latin1(bytes)?;
            }
            op::UNICODE => {
                let line = self.take_line()?;
                self.charge_payload(line.len())?;
                let text =
                    literal::parse_raw_unicode_escape(line).map_err(ErrorKind::BadLiteral)?;
                self.push_value(Value::Str(text))?;
            }
            op::SHORT_BINUNICODE => {
                let [len] = self.take_array()?;
                self.binary_str(len.into())?;
            }
            op::BINUNICODE => {
                let len = self.take_len_u32()?;
                self.binary_str(len)?;
            }
            op::BINUNICODE8 => {
                let len = self.take_len_u64()?;
                self.binary_str(len)?;
            }
            op::SHORT_BINBYTES => {
                let [len] = self.take_array()?;
                self.binary_bytes(len.into())?;
            }
            op::BINBYTES => {
                let len = self.take_len_u32()?;
                self.binary_bytes(len)?;
            }
            op::BINBYTES8 | op::BYTEARRAY8 => {
                let len = self.take_len_u64()?;
                self.binary_bytes(len)?;
            }

            op::EMPTY_TUPLE => self.push_value(Value::Tuple(Vec::new()))?,
            op::TUPLE => {
                let items = self.pop_mark()?;
                self.push_container(Value::Tuple, items)?;
            }
            op::TUPLE1 => self.tuple_of(1)?,
            op::TUPLE2 => self.tuple_of(2)?,
            op::TUPLE3 => self.tuple_of(3)?,
            op::EMPTY_LIST => self.push_value(Value::List(Vec::new()))?,
            op::LIST => {
                let items = self.pop_mark()?;
                self.push_container(Value::List, items)?;
            }
            op::APPEND => {
                let item = self.pop()?;
                let target = self.peek()?;
                self.append(target, vec![item])?;
            }
            op::APPENDS => {
                let items = self.pop_mark()?;
                let target = self.peek()?;
                // An empty batch is a no-op on any target, as in CPython.
                if !items.is_empty() {
                    self.append(target, items)?;
                }
            }
            op::EMPTY_DICT => self.push_value(Value::Dict(Vec::new()))?,
            op::DICT => {
                let flat = self.pop_mark()?;
                let pairs = pairs_of(&flat)?;
                let dict = self.new_node(Value::Dict(Vec::new()))?;
                self.set_items(dict, pairs)?;
                self.push(dict)?;
            }
            op::SETITEM => {
                let value = self.pop()?;
                let key = self.pop()?;
                let target = self.peek()?;
                self.set_items(target, vec![(key, value)])?;
            }
            op::SETITEMS => {
                let flat = self.pop_mark()?;
                let pairs = pairs_of(&flat)?;
                let target = self.peek()?;
                if !pairs.is_empty() {
                    self.set_items(target, pairs)?;
                }
            }
            op::EMPTY_SET => self.push_value(Value::Set(Vec::new()))?,
            op::ADDITEMS => {
                let items = self.pop_mark()?;
                let target = self.peek()?;
                if !items.is_empty() {
                    self.add_items(target, &items)?;
                }
            }
            op::FROZENSET => {
                let items = self.pop_mark()?;
                let set = self.new_node(Value::FrozenSet(Vec::new()))?;
                self.add_items(set, &items)?;
                self.push(set)?;
            }

            op::PUT => {
                let line = self.take_line()?;
                let key = literal::parse_memo_key(line).map_err(ErrorKind::BadLiteral)?;
                self.memo_put(key)?;
            }
            op::BINPUT => {
                let [key] = self.take_array()?;
                self.memo_put(key.into())?;
            }
            op::LONG_BINPUT => {
                let key = u32::from_le_bytes(self.take_array()?);
                self.memo_put(key.into())?;
            }
            op::MEMOIZE => self.memo_put(self.memo.len() as u64)?,
            op::GET => {
                let line = self.take_line()?;
                let key = literal::parse_memo_key(line).map_err(ErrorKind::BadLiteral)?;
                self.memo_get(key)?;
            }
            op::BINGET => {
                let [key] = self.take_array()?;
                self.memo_get(key.into())?;
            }
            op::LONG_BINGET => {
                let key = u32::from_le_bytes(self.take_array()?);
                self.memo_get(key.into())?;
            }

            op::GLOBAL => {
                let global = self.text_global()?;
                self.log_global(global, None)?;
                self.push(global)?;
            }
            op::STACK_GLOBAL => self.stack_global()?,
            op::REDUCE => {
                let args = self.pop()?;
                let callable = self.pop()?;
                self.apply(ObjectKind::Reduce, callable, args)?;
            }
            op::NEWOBJ => {
                let args = self.pop()?;
                let class = self.pop()?;
                self.apply(ObjectKind::NewObj, class, args)?;
            }
            op::NEWOBJ_EX => {
                let kwargs = self.pop()?;
                let args = self.pop()?;
                let class = self.pop()?;
                // Keyword arguments are dropped (see `ObjectKind::NewObj`), but must
                // still be what Python requires.
                match self.node(kwargs) {
                    Some(Value::Dict(_)) => {}
                    other => {
                        return Err(ErrorKind::WrongType {
                            expected: "a dict of keyword arguments",
                            found: type_name(other),
                        })
                    }
                }
                self.apply(ObjectKind::NewObj, class, args)?;
            }
            op::INST => {
                let class = self.text_global()?;
                self.log_global(class, None)?;
                let items = self.pop_mark()?;
                let args = self.new_container(Value::Tuple, items)?;
                self.apply(ObjectKind::Inst, class, args)?;
            }
            op::OBJ => {
                let mut items = self.pop_mark()?;
                if items.is_empty() {
                    return Err(ErrorKind::StackUnderflow);
                }
                let class = items.remove(0);
                let args = self.new_container(Value::Tuple, items)?;
                self.apply(ObjectKind::Inst, class, args)?;
            }
            op::BUILD => {
                let state = self.pop()?;
                let target = self.peek()?;
                // Only opaque objects keep their state. For plain values BUILD sets
                // Python attributes (e.g. `_metadata` on a torch state dict), which a
                // data reader has no use for.
                // An earlier BUILD may have set `__setstate__` on the object (as an
                // attribute through the slot-state half of its state): Python then
                // calls it with this state.
                if let Some(Value::Object {
                    state: Some(previous),
                    ..
                }) = self.node(target)
                {
                    if let Some(setstate) = self.setstate_in(*previous) {
                        self.log_call(setstate, state)?;
                    }
                }
                if let Some(Value::Object { state: slot, .. }) = self.node_mut(target) {
                    *slot = Some(state);
                }
            }
            op::PERSID => {
                let line = self.take_line()?;
                if !line.is_ascii() {
                    return Err(ErrorKind::BadLiteral(format!(
                        "persistent id {} is not ASCII",
                        literal::preview(line)
                    )));
                }
                self.charge_payload(line.len())?;
                let pid = self.new_node(Value::Str(literal::latin1(line)))?;
                self.push_value(Value::PersistentId(pid))?;
            }
            op::BINPERSID => {
                let pid = self.pop()?;
                self.push_value(Value::PersistentId(pid))?;
            }

            op::EXT1 => {
                let [code] = self.take_array()?;
                self.extension(code.into())?;
            }
            op::EXT2 => {
                let code = u16::from_le_bytes(self.take_array()?);
                self.extension(code.into())?;
            }
            op::EXT4 => {
                let code = i32::from_le_bytes(self.take_array()?);
                self.extension(code.into())?;
            }
            op::NEXT_BUFFER | op::READONLY_BUFFER => {
                return Err(ErrorKind::UnsupportedOpcode(op_name(code).unwrap_or("?")));
            }
            other => return Err(ErrorKind::UnknownOpcode(other)),
        }
        Ok(None)
    }

    // ---- reading the input ----

    fn remaining(&self) -> usize {
        self.data.len().saturating_sub(self.pos)
    }

    /// The next `len` bytes; `Truncated` if the input is shorter.
    fn take(&mut self, len: usize) -> Result<&'a [u8]> {
        if len > self.remaining() {
            return Err(ErrorKind::Truncated);
        }
        let data: &'a [u8] = self.data;
        let end = self.pos + len;
        let bytes = data.get(self.pos..end).ok_or(ErrorKind::Truncated)?;
        self.pos = end;
        Ok(bytes)
    }

    fn take_array<const N: usize>(&mut self) -> Result<[u8; N]> {
        self.take(N)?.try_into().map_err(|_| ErrorKind::Truncated)
    }

    /// A 4-byte unsigned length, checked against the input left.
    fn take_len_u32(&mut self) -> Result<usize> {
        let len = u32::from_le_bytes(self.take_array()?);
        self.checked_len(len.into())
    }

    /// A 4-byte signed length (`BINSTRING`, `LONG4`), checked against the input left.
    fn take_len_i32(&mut self) -> Result<usize> {
        let len = i32::from_le_bytes(self.take_array()?);
        let len = u64::try_from(len).map_err(|_| ErrorKind::NegativeArgument(len.into()))?;
        self.checked_len(len)
    }

    /// An 8-byte length, checked against the input left.
    fn take_len_u64(&mut self) -> Result<usize> {
        let len = u64::from_le_bytes(self.take_array()?);
        self.checked_len(len)
    }

    /// A length that must not exceed the bytes left: no allocation is ever sized by a
    /// length the input cannot back.
    fn checked_len(&self, len: u64) -> Result<usize> {
        usize::try_from(len)
            .ok()
            .filter(|&len| len <= self.remaining())
            .ok_or(ErrorKind::Truncated)
    }

    /// A protocol-0 argument: the bytes up to the next newline, which is consumed.
    fn take_line(&mut self) -> Result<&'a [u8]> {
        let data: &'a [u8] = self.data;
        let rest = data.get(self.pos..).unwrap_or_default();
        let len = rest
            .iter()
            .position(|&b| b == b'\n')
            .ok_or(ErrorKind::Truncated)?;
        self.pos += len + 1;
        Ok(rest.get(..len).unwrap_or_default())
    }

    // ---- budgets ----

    fn charge_payload(&mut self, bytes: usize) -> Result<()> {
        let limit = self.limits.max_payload_bytes;
        self.payload = self
            .payload
            .checked_add(bytes)
            .filter(|&total| total <= limit)
            .ok_or(ErrorKind::LimitExceeded {
                what: "bytes of string and bytes payload",
                limit,
            })?;
        Ok(())
    }

    /// Charges bytes or items that a builtin call copies from earlier values.
    fn charge_copy(&mut self, amount: usize) -> Result<()> {
        let limit = self.copy_limit;
        self.copied = self
            .copied
            .checked_add(amount)
            .filter(|&total| total <= limit)
            .ok_or(ErrorKind::LimitExceeded {
                what: "bytes and items copied by builtin calls (twice the input, plus 1 MiB)",
                limit,
            })?;
        Ok(())
    }

    /// Charges `count` new container entries against the arena-wide bound
    /// (`max_nodes`), which keeps copies such as `set(list)` from multiplying memory.
    fn charge_items(&mut self, count: usize) -> Result<()> {
        let limit = self.limits.max_nodes;
        self.items = self
            .items
            .checked_add(count)
            .filter(|&total| total <= limit)
            .ok_or(ErrorKind::LimitExceeded {
                what: "container items in total",
                limit,
            })?;
        Ok(())
    }

    // ---- the arena and the stack ----

    fn node(&self, id: NodeId) -> Option<&Value> {
        self.nodes.get(id.0 as usize)
    }

    fn node_mut(&mut self, id: NodeId) -> Option<&mut Value> {
        self.nodes.get_mut(id.0 as usize)
    }

    fn new_node(&mut self, value: Value) -> Result<NodeId> {
        let limit = self.limits.max_nodes;
        let id = u32::try_from(self.nodes.len())
            .ok()
            .filter(|&n| (n as usize) < limit)
            .ok_or(ErrorKind::LimitExceeded {
                what: "nodes",
                limit,
            })?;
        try_grow(&mut self.nodes)?;
        self.nodes.push(value);
        Ok(NodeId(id))
    }

    /// A new container node holding `items`, charged to the limits.
    fn new_container(
        &mut self,
        make: fn(Vec<NodeId>) -> Value,
        items: Vec<NodeId>,
    ) -> Result<NodeId> {
        check_len(0, items.len(), self.limits.max_container_len)?;
        self.charge_items(items.len())?;
        self.new_node(make(items))
    }

    fn push(&mut self, id: NodeId) -> Result<()> {
        let limit = self.limits.max_nodes;
        if self.stack.len() >= limit {
            return Err(ErrorKind::LimitExceeded {
                what: "stack entries",
                limit,
            });
        }
        try_grow(&mut self.stack)?;
        self.stack.push(id);
        Ok(())
    }

    fn push_value(&mut self, value: Value) -> Result<()> {
        let id = self.new_node(value)?;
        self.push(id)
    }

    fn push_container(&mut self, make: fn(Vec<NodeId>) -> Value, items: Vec<NodeId>) -> Result<()> {
        let id = self.new_container(make, items)?;
        self.push(id)
    }

    /// Height below which ordinary pops may not reach: the innermost mark.
    fn fence(&self) -> usize {
        self.marks.last().copied().unwrap_or(0)
    }

    fn pop(&mut self) -> Result<NodeId> {
        if self.stack.len() <= self.fence() {
            return Err(ErrorKind::StackUnderflow);
        }
        self.stack.pop().ok_or(ErrorKind::StackUnderflow)
    }

    fn peek(&self) -> Result<NodeId> {
        if self.stack.len() <= self.fence() {
            return Err(ErrorKind::StackUnderflow);
        }
        self.stack.last().copied().ok_or(ErrorKind::StackUnderflow)
    }

    fn mark(&mut self) -> Result<()> {
        let limit = self.limits.max_marks;
        if self.marks.len() >= limit {
            return Err(ErrorKind::LimitExceeded {
                what: "nested marks",
                limit,
            });
        }
        self.marks.push(self.stack.len());
        Ok(())
    }

    /// Removes the innermost mark and returns the values above it.
    fn pop_mark(&mut self) -> Result<Vec<NodeId>> {
        let height = self.marks.pop().ok_or(ErrorKind::MarkMissing)?;
        if height > self.stack.len() {
            return Err(ErrorKind::StackUnderflow);
        }
        Ok(self.stack.split_off(height))
    }

    /// `POP`: like CPython, a `POP` right after a `MARK` discards the mark.
    fn pop_or_unmark(&mut self) -> Result<()> {
        if self.marks.last() == Some(&self.stack.len()) {
            self.marks.pop();
            return Ok(());
        }
        self.pop().map(drop)
    }

    // ---- scalar opcodes ----

    fn text_int(&mut self) -> Result<()> {
        let line = self.take_line()?;
        // Protocol 0 of Python 2.2 and later spells booleans as INT 01 / INT 00.
        let value = match line {
            b"01" => Value::Bool(true),
            b"00" => Value::Bool(false),
            _ => literal::parse_int(line).map_err(ErrorKind::BadLiteral)?,
        };
        self.push_int(value)
    }

    fn text_long(&mut self) -> Result<()> {
        let line = self.take_line()?;
        let digits = line.strip_suffix(b"L").unwrap_or(line);
        let value = literal::parse_int(digits).map_err(ErrorKind::BadLiteral)?;
        self.push_int(value)
    }

    fn binary_long(&mut self, len: usize) -> Result<()> {
        let bytes = self.take(len)?;
        if len > 8 {
            self.charge_payload(len)?;
        }
        self.push_int(literal::int_from_le(bytes))
    }

    fn push_int(&mut self, value: Value) -> Result<()> {
        if let Value::BigInt(bytes) = &value {
            self.charge_payload(bytes.len())?;
        }
        self.push_value(value)
    }

    fn binary_str(&mut self, len: usize) -> Result<()> {
        let bytes = self.take(len)?;
        self.charge_payload(len)?;
        let text = std::str::from_utf8(bytes).map_err(|_| ErrorKind::InvalidUtf8)?;
        let mut owned = String::new();
        try_reserve_str(&mut owned, text.len())?;
        owned.push_str(text);
        self.push_value(Value::Str(owned))
    }

    fn binary_bytes(&mut self, len: usize) -> Result<()> {
        let bytes = self.take(len)?;
        self.charge_payload(len)?;
        let mut owned = Vec::new();
        try_reserve(&mut owned, len)?;
        owned.extend_from_slice(bytes);
        self.push_value(Value::Bytes(owned))
    }

    /// A Python 2 `str`, read as latin-1 text.
    fn push_latin1(&mut self, bytes: &[u8]) -> Result<()> {
        self.charge_payload(bytes.len())?;
        self.push_value(Value::Str(literal::latin1(bytes)))
    }

    // ---- containers ----

    fn tuple_of(&mut self, count: usize) -> Result<()> {
        let above_fence = self.stack.len().saturating_sub(self.fence());
        if above_fence < count {
            return Err(ErrorKind::StackUnderflow);
        }
        let items = self.stack.split_off(self.stack.len() - count);
        self.push_container(Value::Tuple, items)
    }

    fn append(&mut self, target: NodeId, items: Vec<NodeId>) -> Result<()> {
        let name = self.op_name();
        let limit = self.limits.max_container_len;
        self.charge_items(items.len())?;
        let list = match self.node_mut(target) {
            Some(Value::List(list)) => list,
            Some(Value::Object { items: extra, .. }) => &mut extra.get_or_insert_default().list,
            other => {
                return Err(ErrorKind::NotAContainer {
                    op: name,
                    found: type_name(other.map(|v| &*v)),
                })
            }
        };
        check_len(list.len(), items.len(), limit)?;
        list.extend(items);
        Ok(())
    }

    /// `SETITEM(S)` and `DICT`: into a dict with Python's key replacement, or onto an
    /// object's `dict_items` in order.
    fn set_items(&mut self, target: NodeId, pairs: Vec<(NodeId, NodeId)>) -> Result<()> {
        let name = self.op_name();
        let limit = self.limits.max_container_len;
        match self.node_mut(target) {
            Some(Value::Dict(_)) => {
                for (key, value) in pairs {
                    self.dict_insert(target, key, value)?;
                }
                Ok(())
            }
            Some(Value::Object { items, .. }) => {
                let dict = &mut items.get_or_insert_default().dict;
                check_len(dict.len(), pairs.len(), limit)?;
                dict.extend(pairs.iter().copied());
                self.charge_items(pairs.len())
            }
            other => Err(ErrorKind::NotAContainer {
                op: name,
                found: type_name(other.map(|v| &*v)),
            }),
        }
    }

    fn dict_insert(&mut self, dict: NodeId, key: NodeId, value: NodeId) -> Result<()> {
        self.pin(key);
        let Some(Value::Dict(pairs)) = self.nodes.get(dict.0 as usize) else {
            return Err(ErrorKind::NotAContainer {
                op: self.op_name(),
                found: type_name(self.node(dict)),
            });
        };
        let len = pairs.len();
        let existing = self
            .keys
            .find(&self.nodes, dict, len, |i| pairs.get(i).map(|p| p.0), key);
        if let Some(i) = existing {
            if let Some(Value::Dict(pairs)) = self.node_mut(dict) {
                if let Some(pair) = pairs.get_mut(i) {
                    pair.1 = value;
                }
            }
            return Ok(());
        }
        check_len(len, 1, self.limits.max_container_len)?;
        self.charge_items(1)?;
        if let Some(Value::Dict(pairs)) = self.node_mut(dict) {
            pairs.push((key, value));
        }
        self.keys.added(&self.nodes, dict, len, key);
        Ok(())
    }

    /// `ADDITEMS` (onto a set) and `FROZENSET` / `set(..)` (into a new set): adds the
    /// items that are not already present.
    fn add_items(&mut self, set: NodeId, items: &[NodeId]) -> Result<()> {
        for &item in items {
            self.pin(item);
            let members = match self.nodes.get(set.0 as usize) {
                Some(Value::Set(members)) => members,
                Some(Value::FrozenSet(members)) if self.op != op::ADDITEMS => members,
                other => {
                    return Err(ErrorKind::NotAContainer {
                        op: self.op_name(),
                        found: type_name(other),
                    })
                }
            };
            let len = members.len();
            let existing = self
                .keys
                .find(&self.nodes, set, len, |i| members.get(i).copied(), item);
            if existing.is_some() {
                continue;
            }
            check_len(len, 1, self.limits.max_container_len)?;
            self.charge_items(1)?;
            if let Some(Value::Set(members) | Value::FrozenSet(members)) = self.node_mut(set) {
                members.push(item);
            }
            self.keys.added(&self.nodes, set, len, item);
        }
        Ok(())
    }

    // ---- memo ----

    fn memo_put(&mut self, key: u64) -> Result<()> {
        let top = self.peek()?;
        let limit = self.limits.max_memo;
        if self.memo.len() >= limit && self.memo.get(key).is_none() {
            return Err(ErrorKind::LimitExceeded {
                what: "memo entries",
                limit,
            });
        }
        self.memo.insert(key, top);
        Ok(())
    }

    fn memo_get(&mut self, key: u64) -> Result<()> {
        let id = self.memo.get(key).ok_or(ErrorKind::MemoMissing(key))?;
        self.push(id)
    }

    // ---- globals and calls ----

    /// `GLOBAL` / `INST` argument: module and name on two lines, as a new global node.
    fn text_global(&mut self) -> Result<NodeId> {
        let module = self.take_line()?;
        let name = self.take_line()?;
        check_name_len(module.len().max(name.len()))?;
        self.charge_payload(module.len() + name.len())?;
        let module = std::str::from_utf8(module).map_err(|_| ErrorKind::InvalidUtf8)?;
        let name = std::str::from_utf8(name).map_err(|_| ErrorKind::InvalidUtf8)?;
        self.new_node(Value::global(module, name))
    }

    fn stack_global(&mut self) -> Result<()> {
        let name = self.pop()?;
        let module = self.pop()?;
        self.pin(module);
        self.pin(name);
        let (Some(Value::Str(module)), Some(Value::Str(name))) =
            (self.node(module), self.node(name))
        else {
            let found = match self.node(module) {
                Some(Value::Str(_)) => type_name(self.node(name)),
                other => type_name(other),
            };
            return Err(ErrorKind::WrongType {
                expected: "str module and name",
                found,
            });
        };
        check_name_len(module.len().max(name.len()))?;
        let global = Value::global(module.clone(), name.clone());
        self.charge_payload(module.len() + name.len())?;
        let id = self.new_node(global)?;
        self.log_global(id, None)?;
        self.push(id)
    }

    /// `EXT1/2/4`: the global that `copyreg.add_extension` registered under `code`
    /// earlier in this pickle. CPython's registry starts empty and nothing torch
    /// imports fills it, so a code the pickle did not register itself is an error here
    /// as it is under `pickle.load`.
    fn extension(&mut self, code: i64) -> Result<()> {
        if code <= 0 {
            return Err(ErrorKind::NegativeArgument(code));
        }
        let Some((module, name)) = self.extensions.get(&code) else {
            return Err(ErrorKind::UnregisteredExtension(code));
        };
        let global = Value::global(module.clone(), name.clone());
        self.charge_payload(module.len() + name.len())?;
        let id = self.new_node(global)?;
        self.log_global(id, Some(code))?;
        self.push(id)
    }

    /// Records that the opcode being executed names the global `node`.
    fn log_global(&mut self, node: NodeId, ext_code: Option<i64>) -> Result<()> {
        self.charge_items(1)?;
        try_grow(&mut self.trace.globals)?;
        self.trace.globals.push(GlobalRef {
            offset: self.at,
            opcode: self.op,
            node,
            ext_code,
        });
        Ok(())
    }

    /// Records that the opcode being executed would call `callable` with `args`.
    fn log_call(&mut self, callable: NodeId, args: NodeId) -> Result<()> {
        if let Some(Value::Global(_)) = self.node(callable) {
            let first = match self.node(args) {
                Some(Value::Tuple(items)) => items.first().copied(),
                _ => None,
            };
            let first_global = match first.and_then(|f| self.node(f)) {
                Some(Value::Global(_)) => first.map_or(u32::MAX, |f| f.0),
                _ => u32::MAX,
            };
            if !self
                .logged_calls
                .insert((callable.0, self.op, first_global))
            {
                return Ok(());
            }
        }
        self.charge_items(1)?;
        try_grow(&mut self.trace.calls)?;
        self.trace.calls.push(CallSite {
            offset: self.at,
            opcode: self.op,
            callable,
            args,
        });
        Ok(())
    }

    /// The `__setstate__` entry of a `BUILD` state: `{..}` or `(dict, {slots})`.
    fn setstate_in(&self, state: NodeId) -> Option<NodeId> {
        let in_dict = |id: NodeId| match self.node(id) {
            Some(Value::Dict(pairs)) => pairs
                .iter()
                .find(|(k, _)| matches!(self.node(*k), Some(Value::Str(s)) if s == "__setstate__"))
                .map(|&(_, v)| v),
            _ => None,
        };
        match self.node(state) {
            Some(Value::Tuple(parts)) => parts.iter().rev().find_map(|&d| in_dict(d)),
            _ => in_dict(state),
        }
    }

    /// Notes a `copyreg.add_extension(module, name, code)` call, so that a later
    /// `EXT` opcode resolves to the global it registered (as it would under
    /// `pickle.load`, which makes the call).
    fn register_extension(&mut self, callable: NodeId, args: &[NodeId]) -> Result<()> {
        let Some(Value::Global(g)) = self.node(callable) else {
            return Ok(());
        };
        if !matches!(g.module.as_str(), "copyreg" | "copy_reg") || g.name != "add_extension" {
            return Ok(());
        }
        let [module, name, code] = args else {
            return Ok(());
        };
        let (Some(Value::Str(module)), Some(Value::Str(name)), Some(Value::Int(code))) =
            (self.node(*module), self.node(*name), self.node(*code))
        else {
            return Ok(());
        };
        if module.len().max(name.len()) > MAX_GLOBAL_NAME {
            return Ok(());
        }
        let entry = (module.clone(), name.clone());
        let code = *code;
        if let [_, _, code_node] = args {
            self.pin(*code_node);
        }
        self.charge_payload(entry.0.len() + entry.1.len())?;
        self.extensions.insert(code, entry);
        Ok(())
    }

    /// `REDUCE`, `NEWOBJ(_EX)`, `INST`, `OBJ`: the value of a recognised builtin, or an
    /// opaque object recording the call.
    fn apply(&mut self, kind: ObjectKind, callable: NodeId, args: NodeId) -> Result<()> {
        let items = match self.node(args) {
            Some(Value::Tuple(items)) => items.clone(),
            other => {
                return Err(ErrorKind::WrongType {
                    expected: "a tuple of arguments",
                    found: type_name(other),
                })
            }
        };
        // A string passed to a call may be read by a recognised builtin (an
        // attribute name, an encoding) or by the audit; integers only by
        // `add_extension` (pinned there).
        if self.record.is_some() {
            for &item in &items {
                if matches!(self.node(item), Some(Value::Str(_))) {
                    self.pin(item);
                }
            }
        }
        let plain = match builtins::recognize(&self.nodes, kind, callable, &items) {
            Some(builtin) => self.builtin(builtin)?,
            None => None,
        };
        self.register_extension(callable, &items)?;
        self.log_call(callable, args)?;
        let id = match plain {
            Some(id) => id,
            None => self.new_node(Value::Object {
                kind,
                callable,
                args,
                state: None,
                items: None,
            })?,
        };
        self.push(id)
    }

    /// Carries out a recognised builtin call, charging its copies and scans, or returns
    /// `None` if the arguments turn out to be ones Python would reject.
    fn builtin(&mut self, builtin: Builtin) -> Result<Option<NodeId>> {
        let id = match builtin {
            Builtin::EmptyDict => self.new_node(Value::Dict(Vec::new()))?,
            Builtin::DictFrom(source) => {
                let len = self.dict_items_len(source);
                self.charge_copy(len)?;
                self.charge_items(len)?;
                let pairs = match self.node(source) {
                    Some(Value::Dict(pairs)) => pairs.clone(),
                    _ => Vec::new(),
                };
                // The source is already deduplicated, so its pairs move over as they are.
                self.new_node(Value::Dict(pairs))?
            }
            Builtin::Set { frozen, from } => {
                let items = match from.and_then(|id| self.node(id)) {
                    Some(
                        Value::List(items)
                        | Value::Tuple(items)
                        | Value::Set(items)
                        | Value::FrozenSet(items),
                    ) => items.len(),
                    _ => 0,
                };
                // Charge the whole scan: duplicates are not stored but still cost work,
                // and the same memoised list can be passed to set() again and again.
                self.charge_copy(items)?;
                self.charge_items(items)?;
                let items = match from.and_then(|id| self.node(id)) {
                    Some(
                        Value::List(items)
                        | Value::Tuple(items)
                        | Value::Set(items)
                        | Value::FrozenSet(items),
                    ) => items.clone(),
                    _ => Vec::new(),
                };
                let set = self.new_node(if frozen {
                    Value::FrozenSet(Vec::new())
                } else {
                    Value::Set(Vec::new())
                })?;
                self.add_items(set, &items)?;
                set
            }
            Builtin::EmptyBytes => self.new_node(Value::Bytes(Vec::new()))?,
            // Nothing mutates a value once parsed, so the copy can be the same node.
            Builtin::BytesOf(source) => source,
            Builtin::Latin1(source) => {
                let len = self.node(source).map_or(0, payload_len);
                self.charge_copy(len)?;
                self.charge_payload(len)?;
                let text = match self.node(source) {
                    Some(Value::Str(s)) => s.as_str(),
                    _ => "",
                };
                // In UTF-8, a byte of 0xc4 or more starts a code point of 256 or more.
                if text.bytes().any(|b| b >= 0xc4) {
                    // Python raises UnicodeEncodeError: keep the call as an object.
                    return Ok(None);
                }
                let mut bytes = Vec::new();
                try_reserve(&mut bytes, text.len())?;
                bytes.extend(text.chars().map(|c| u32::from(c) as u8));
                self.new_node(Value::Bytes(bytes))?
            }
            Builtin::Attribute { owner, attr } => {
                let (Some(Value::Global(g)), Some(Value::Str(attr))) =
                    (self.node(owner), self.node(attr))
                else {
                    return Ok(None);
                };
                // A chain of getattr calls lengthens the name at each step; past the
                // bound the call stays an opaque object instead of a copied name.
                let name_len = g.name.len() + 1 + attr.len();
                if name_len > MAX_GLOBAL_NAME {
                    return Ok(None);
                }
                let len = g.module.len() + name_len;
                let global = Value::global(g.module.clone(), format!("{}.{attr}", g.name));
                self.charge_copy(len)?;
                self.charge_payload(len)?;
                let id = self.new_node(global)?;
                self.log_global(id, None)?;
                id
            }
        };
        Ok(Some(id))
    }

    /// Notes, when recording a template, that an integer's or a string's value is
    /// looked at while parsing (compared, or turned into something else).
    fn pin(&mut self, id: NodeId) {
        if let Some(r) = &mut self.record {
            if matches!(
                self.nodes.get(id.0 as usize),
                Some(Value::Int(_) | Value::Str(_))
            ) {
                r.pinned.push(id);
            }
        }
    }

    fn dict_items_len(&self, id: NodeId) -> usize {
        match self.node(id) {
            Some(Value::Dict(pairs)) => pairs.len(),
            _ => 0,
        }
    }

    fn op_name(&self) -> &'static str {
        op_name(self.op).unwrap_or("?")
    }
}

/// Splits the flat `k, v, k, v` values of `DICT` / `SETITEMS` into pairs.
fn pairs_of(flat: &[NodeId]) -> Result<Vec<(NodeId, NodeId)>> {
    if flat.len() % 2 != 0 {
        return Err(ErrorKind::OddItemCount(flat.len()));
    }
    Ok(flat
        .chunks_exact(2)
        .filter_map(|pair| match pair {
            [k, v] => Some((*k, *v)),
            _ => None,
        })
        .collect())
}

/// Whether a container of `len` entries may take `more`.
fn check_len(len: usize, more: usize, limit: usize) -> Result<()> {
    match len.checked_add(more) {
        Some(total) if total <= limit => Ok(()),
        _ => Err(ErrorKind::LimitExceeded {
            what: "items in one container",
            limit,
        }),
    }
}

/// A global's module or name must be at most [`MAX_GLOBAL_NAME`] bytes.
fn check_name_len(len: usize) -> Result<()> {
    if len > MAX_GLOBAL_NAME {
        return Err(ErrorKind::LimitExceeded {
            what: "bytes in a global's module or name",
            limit: MAX_GLOBAL_NAME,
        });
    }
    Ok(())
}

/// Makes room for one more element, reporting an allocation failure as an error
/// instead of aborting the process. Sizes here are driven by the input.
fn try_grow<T>(v: &mut Vec<T>) -> Result<()> {
    if v.len() == v.capacity() {
        v.try_reserve(1).map_err(|_| out_of_memory(v.capacity()))?;
    }
    Ok(())
}

/// Reserves exactly `len` more bytes, or fails with an error.
fn try_reserve(v: &mut Vec<u8>, len: usize) -> Result<()> {
    v.try_reserve_exact(len).map_err(|_| out_of_memory(len))
}

/// Reserves exactly `len` more bytes of text, or fails with an error.
fn try_reserve_str(s: &mut String, len: usize) -> Result<()> {
    s.try_reserve_exact(len).map_err(|_| out_of_memory(len))
}

fn out_of_memory(len: usize) -> ErrorKind {
    ErrorKind::OutOfMemory(len)
}

/// Bytes of text a value holds (for charging copies of it).
fn payload_len(value: &Value) -> usize {
    match value {
        Value::Str(s) => s.len(),
        Value::Bytes(b) | Value::BigInt(b) => b.len(),
        Value::Global(g) => g.module.len() + g.name.len(),
        _ => 0,
    }
}

fn type_name(value: Option<&Value>) -> &'static str {
    value.map_or("missing value", Value::type_name)
}
