//! Parse errors.
//!
//! An [`Error`] says where parsing stopped (byte offset of the opcode and the opcode
//! itself) and why ([`ErrorKind`]). The kinds are typed rather than strings so a caller
//! can tell a truncated download ([`ErrorKind::Truncated`]) from a hostile or corrupt
//! file ([`ErrorKind::LimitExceeded`], [`ErrorKind::UnknownOpcode`], ...).

use std::fmt;

use crate::opcode;

/// Why a pickle could not be read, and where.
///
/// Displays as `pickle error at byte 1234 (opcode BINPUT 'q'): memo key 7 is not defined`.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("pickle error at byte {offset}{}: {kind}", OpcodeSuffix(*.opcode))]
pub struct Error {
    /// Byte offset of the opcode that failed (or of the end of input for
    /// [`ErrorKind::NoStop`]), counted from the start of the slice given to the parser.
    pub offset: usize,
    /// The opcode byte that failed, if the failure belongs to one.
    pub opcode: Option<u8>,
    /// What went wrong.
    pub kind: ErrorKind,
}

/// What went wrong. New kinds may be added.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ErrorKind {
    /// The input ends inside an opcode's argument, or a length field claims more bytes
    /// than the input holds.
    #[error("the input ends before the end of this opcode's argument (truncated file?)")]
    Truncated,
    /// The input ends between opcodes without a `STOP`.
    #[error("the input ends without a STOP opcode (truncated file?)")]
    NoStop,
    /// A byte that is not an opcode of protocols 0 to 5.
    #[error("unknown opcode byte 0x{0:02x}: not a pickle, or a corrupt one")]
    UnknownOpcode(u8),
    /// A real opcode that an inert reader cannot honour (`EXT1`, `NEXT_BUFFER`, ...).
    #[error("opcode {0} is not supported: it needs state outside the pickle (extension registry or out-of-band buffers)")]
    UnsupportedOpcode(&'static str),
    /// `PROTO` announces a protocol newer than 5.
    #[error("pickle protocol {0} is not supported (protocols 0 to 5 are)")]
    UnsupportedProtocol(u8),
    /// The opcode needs more values than the stack holds above the last `MARK`.
    #[error("stack underflow: the opcode needs more values than the stack holds")]
    StackUnderflow,
    /// The opcode needs a `MARK` and there is none.
    #[error("the opcode needs a MARK on the stack and there is none")]
    MarkMissing,
    /// `GET` of a memo key no `PUT` defined.
    #[error("memo key {0} is not defined")]
    MemoMissing(u64),
    /// A bound of [`crate::Limits`] (or a fixed internal bound) was reached.
    #[error("limit exceeded: more than {limit} {what}")]
    LimitExceeded {
        /// What was counted, e.g. `"nodes"`.
        what: &'static str,
        /// The bound that was reached.
        limit: usize,
    },
    /// A unicode string or a global name is not valid UTF-8.
    #[error("invalid UTF-8 in a unicode string or global name")]
    InvalidUtf8,
    /// A text argument of a protocol-0 opcode could not be read.
    #[error("bad literal: {0}")]
    BadLiteral(String),
    /// A binary length or memo index is negative.
    #[error("negative argument {0}")]
    NegativeArgument(i64),
    /// The opcode adds items to a value that cannot hold them.
    #[error("{op} cannot add items to a {found}")]
    NotAContainer {
        /// The opcode's name.
        op: &'static str,
        /// The type of the value found (see [`crate::Value::type_name`]).
        found: &'static str,
    },
    /// An operand has the wrong type (e.g. `REDUCE` arguments that are not a tuple).
    #[error("expected {expected}, found {found}")]
    WrongType {
        /// What the opcode needs.
        expected: &'static str,
        /// The type of the value found (see [`crate::Value::type_name`]).
        found: &'static str,
    },
    /// `EXT1/2/4` with a code that no `copyreg.add_extension` call in the pickle
    /// registered (`pickle.load` fails there too).
    #[error(
        "extension code {0} is not registered (no copyreg.add_extension call for it precedes it)"
    )]
    UnregisteredExtension(i64),
    /// Memory for a value the input asks for could not be allocated.
    #[error("out of memory allocating {0} bytes or items for a value of the pickle")]
    OutOfMemory(usize),
    /// `DICT` or `SETITEMS` with a key that has no value.
    #[error("odd number of values ({0}) after MARK: keys and values must pair up")]
    OddItemCount(usize),
}

/// Renders ` (opcode BINPUT 'q')` for the error message, or nothing.
struct OpcodeSuffix(Option<u8>);

impl fmt::Display for OpcodeSuffix {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let Some(op) = self.0 else {
            return Ok(());
        };
        // An unknown byte is already named by `ErrorKind::UnknownOpcode`.
        let Some(name) = opcode::name(op) else {
            return Ok(());
        };
        if op.is_ascii_graphic() {
            write!(f, " (opcode {name} '{}')", op as char)
        } else {
            write!(f, " (opcode {name} 0x{op:02x})")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn message_names_offset_opcode_and_cause() {
        let e = Error {
            offset: 1234,
            opcode: Some(b'q'),
            kind: ErrorKind::MemoMissing(7),
        };
        assert_eq!(
            e.to_string(),
            "pickle error at byte 1234 (opcode BINPUT 'q'): memo key 7 is not defined"
        );
        let e = Error {
            offset: 0,
            opcode: Some(0x80),
            kind: ErrorKind::UnsupportedProtocol(9),
        };
        assert_eq!(
            e.to_string(),
            "pickle error at byte 0 (opcode PROTO 0x80): pickle protocol 9 is not supported (protocols 0 to 5 are)"
        );
        let e = Error {
            offset: 10,
            opcode: None,
            kind: ErrorKind::NoStop,
        };
        assert!(e
            .to_string()
            .starts_with("pickle error at byte 10: the input ends"));
    }
}
