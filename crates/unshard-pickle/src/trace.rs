//! What a pickle names and what it asks to call, in file order, on every path.
//!
//! The arena keeps every value a pickle builds, including results it discards with
//! `POP`, values that only live in the memo and states that `BUILD` drops on plain
//! values. Walking from the root would miss those, and they run under `pickle.load`
//! all the same (fickling's default injection is a discarded call before the real
//! data). So the machine logs, as it executes, each opcode that names a global and
//! each opcode that would call something, with its byte offset. [`crate::audit()`]
//! classifies the log; callers that want their own policy can read it directly.

use crate::NodeId;

/// An opcode that names a global: `GLOBAL`, `STACK_GLOBAL`, `INST`, `EXT1/2/4`, or a
/// `REDUCE` of `getattr(<global>, 'name')` (which the reader turns into a global).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GlobalRef {
    /// Byte offset of the opcode in the pickle.
    pub offset: usize,
    /// The opcode byte (see [`opcode_name`]).
    pub opcode: u8,
    /// The `Global` node it created.
    pub node: NodeId,
    /// For `EXT1/2/4`: the extension code, registered earlier in the same pickle by a
    /// `copyreg.add_extension` call.
    pub ext_code: Option<i64>,
}

/// An opcode that would call something under `pickle.load`: `REDUCE`, `NEWOBJ`,
/// `NEWOBJ_EX`, `INST`, `OBJ`, or a `BUILD` whose target was given a `__setstate__`
/// by an earlier `BUILD`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CallSite {
    /// Byte offset of the opcode in the pickle.
    pub offset: usize,
    /// The opcode byte (see [`opcode_name`]).
    pub opcode: u8,
    /// What would be called: usually a `Global` node, but any node (an object made by
    /// an earlier call, such as `functools.partial(...)`) can be called.
    pub callable: NodeId,
    /// The argument tuple (for `BUILD`: the state passed to `__setstate__`).
    pub args: NodeId,
}

/// The log of one parse.
#[derive(Clone, Debug, Default)]
pub struct Trace {
    /// Every opcode that named a global, in file order.
    pub globals: Vec<GlobalRef>,
    /// Every opcode that would call something, in file order.
    pub calls: Vec<CallSite>,
}

/// The `pickletools` name of an opcode byte (`"REDUCE"`), or `"?"`.
pub fn opcode_name(code: u8) -> &'static str {
    crate::opcode::name(code).unwrap_or("?")
}
