//! The frames of a pickle of protocol 4 or later, found by hopping from one frame's
//! header to the next without reading the opcodes in between: `PROTO` (2 bytes),
//! then `FRAME` and an 8-byte length, the frame's opcodes, the next `FRAME`, and so
//! on. Python's pickler ends a frame only between opcodes, so a frame's start is
//! where an opcode starts; nothing here trusts that (the walk from the start checks
//! that it reaches the frame).

use unshard_pickle::opcode::{FRAME, PROTO};

use crate::source::Blob;

/// The offsets of the `FRAME` opcodes, in order, as long as one frame is followed by
/// another (a large string that Python writes outside any frame ends the list).
/// None in a pickle that is not framed.
pub(super) fn starts(blob: &Blob) -> impl Iterator<Item = u64> + '_ {
    let mut head = [0u8; 2];
    let framed = blob.read_at(0, &mut head).is_ok() && head[0] == PROTO && head[1] >= 4;
    let mut at = framed.then_some(2u64);
    std::iter::from_fn(move || {
        let here = at.take()?;
        let mut header = [0u8; 9];
        blob.read_at(here, &mut header).ok()?;
        let [op, len @ ..] = header;
        if op != FRAME {
            return None;
        }
        at = here
            .checked_add(9)
            .and_then(|end| end.checked_add(u64::from_le_bytes(len)))
            .filter(|&end| end < blob.len());
        Some(here)
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn blob(bytes: &[u8]) -> Blob {
        Blob::owned(std::path::PathBuf::from(".metadata"), bytes.to_vec())
    }

    #[test]
    fn frames_are_found_from_header_to_header() {
        let frame = |body: &[u8]| [&[FRAME][..], &(body.len() as u64).to_le_bytes(), body].concat();
        let one = frame(b"K\x01");
        let two = frame(b"K\x02.");
        let bytes = [&b"\x80\x04"[..], &one, &two].concat();
        let found: Vec<u64> = starts(&blob(&bytes)).collect();
        assert_eq!(found, [2, 2 + one.len() as u64]);
        // A length past the end, a protocol without frames, a stray byte: no more.
        let mut long = bytes.clone();
        long[3] = 0xff;
        assert_eq!(starts(&blob(&long)).collect::<Vec<_>>(), [2]);
        assert_eq!(starts(&blob(b"\x80\x02K\x01.")).count(), 0);
        let mut stray = bytes.clone();
        stray[2 + one.len()] = b'K';
        assert_eq!(starts(&blob(&stray)).collect::<Vec<_>>(), [2]);
        assert_eq!(starts(&blob(b"\x80")).count(), 0);
    }
}
