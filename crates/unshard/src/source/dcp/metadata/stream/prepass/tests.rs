//! The pre-pass on two threads against the pre-pass on one: with the tail started
//! at every frame, on what torch writes, on those bytes changed, and on a pickle
//! whose memo keys are written out (`BINPUT`), which torch's pickler does not do.

#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};

use super::*;

/// What a pre-pass found, comparable: the keys fetched, and the cut with its
/// imports; `None` when it gave up.
type Found = Option<(Vec<u32>, Option<(u64, u32, Vec<(u32, Import)>)>)>;

fn found(pass: R<Pass>) -> Found {
    let pass = pass.ok()?;
    let cut = pass.cut.map(|c| (c.offset, c.memo_len, c.imports));
    Some((pass.used.keys().collect(), cut))
}

fn blob(bytes: Vec<u8>) -> Blob {
    Blob::owned(PathBuf::from(".metadata"), bytes)
}

/// Where to cut: as the reading pass asks, and at offsets through the file.
fn cuts(len: u64) -> Vec<CutAt> {
    let mut cuts = vec![CutAt::Balanced];
    cuts.extend((1..4).map(|i| CutAt::Offset(len * i / 4)));
    cuts
}

/// Where to cut in the tests that change bytes (the debug walks are slow).
fn few_cuts(len: u64) -> [CutAt; 2] {
    [CutAt::Balanced, CutAt::Offset(len * 3 / 4)]
}

/// With the tail started at every frame and at each cut in `cuts`, the two walks
/// find what one walk finds. Returns how many of them stopped to take the tail's
/// keys.
fn split_everywhere_agrees(blob: &Blob, cuts: &[CutAt], what: &str) -> usize {
    let mut met = 0;
    let starts: Vec<u64> = frames::starts(blob).collect();
    for &cut_at in cuts {
        let one = found(pre_pass_split(blob, Some(cut_at), None).map(|(p, _)| p));
        for &from in &starts {
            let two = pre_pass_split(blob, Some(cut_at), Some(from));
            met += usize::from(two.as_ref().is_ok_and(|(_, part)| part.is_some()));
            let two = found(two.map(|(p, _)| p));
            assert_eq!(one, two, "{what}: {cut_at:?}, tail from {from}");
        }
    }
    met
}

/// Every `.metadata` among the fixtures.
fn metadata_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            metadata_files(&path, out);
        } else if path.file_name().is_some_and(|n| n == ".metadata") {
            out.push(path);
        }
    }
}

/// On every `.metadata` fixture, the pre-pass split at any frame finds what one walk
/// finds; on the one with batches (a cut), the walk from the start hands over to
/// the tail at most frames.
#[test]
fn the_pre_pass_split_at_any_frame_finds_what_one_walk_finds() {
    let mut files = Vec::new();
    metadata_files(&crate::fixtures(), &mut files);
    assert!(files.len() >= 10, "{files:?}");
    for path in files {
        let blob = crate::bytes::fs::open(&path).unwrap();
        let met = split_everywhere_agrees(&blob, &cuts(blob.len()), &path.display().to_string());
        if path.ends_with("wide_metadata_batches/.metadata") {
            let frames = frames::starts(&blob).count();
            assert!(frames >= 8, "{frames} frames");
            assert!(met >= frames * 2, "the tail was taken {met} times");
            // The cut is found, with imports (fqns and classes from before it).
            let pass = pre_pass_split(&blob, Some(CutAt::Balanced), None)
                .ok()
                .unwrap();
            assert!(!pass.0.cut.unwrap().imports.is_empty());
        }
    }
}

/// The torch-written pickle with one byte changed (frame lengths, memo fetches,
/// anything): the split finds what one walk finds, or both give up, at every frame.
#[test]
fn the_pre_pass_split_agrees_on_changed_bytes() {
    let path = crate::fixtures().join("sharded/wide_metadata_batches/.metadata");
    let raw = std::fs::read(&path).unwrap();
    let frames: Vec<u64> = frames::starts(&blob(raw.clone())).collect();
    let mut changes: Vec<(usize, u8)> = Vec::new();
    // A frame's length one more or less, or far off.
    for &f in &frames[1..] {
        let f = f as usize;
        changes.extend([
            (f + 1, raw[f + 1] ^ 1),
            (f + 2, raw[f + 2] ^ 0x80),
            (f, b'K'),
        ]);
    }
    // Memo fetches of other keys, through the file (some `h` bytes are in strings).
    let gets: Vec<usize> = (1..raw.len()).filter(|&i| raw[i - 1] == b'h').collect();
    for i in (0..gets.len()).step_by(gets.len() / 12 + 1) {
        let at = gets[i];
        changes.extend([(at, raw[at] ^ 1), (at, 0xff)]);
    }
    // Anything else.
    let mut state = 0x2545_f491_4f6c_dd1du64;
    for _ in 0..12 {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        let at = (state % raw.len() as u64) as usize;
        changes.push((at, raw[at].wrapping_add(1 + (state >> 40) as u8 % 3)));
    }
    let (mut read, mut gave_up) = (0, 0);
    for (at, byte) in changes {
        let mut bytes = raw.clone();
        bytes[at] = byte;
        let blob = blob(bytes);
        let what = format!("byte {at} set to {byte}");
        split_everywhere_agrees(&blob, &few_cuts(blob.len()), &what);
        match pre_pass_split(&blob, Some(CutAt::Balanced), None) {
            Ok(_) => read += 1,
            Err(_) => gave_up += 1,
        }
    }
    assert!(read > 0 && gave_up > 0, "read {read}, gave up {gave_up}");
}

/// A framed pickle of a dict written in batches, its memo keys given (`BINPUT`,
/// `LONG_BINPUT`, `MEMOIZE`) and fetched (`BINGET`, `LONG_BINGET`), each frame
/// ending with a `MEMOIZE`; and the offsets of each `LONG_BINPUT` and `LONG_BINGET`
/// key.
fn pickle_with_keys() -> (Vec<u8>, Vec<usize>, Vec<usize>) {
    let mut ops: Vec<Vec<u8>> = vec![b"}q\x00".to_vec()];
    // A global from two strings: fetched in every batch.
    ops.extend([
        b"\x8c\x03modq\x01".to_vec(),
        b"\x8c\x04nameq\x02".to_vec(),
        b"\x93q\x03".to_vec(),
    ]);
    let mut next = 4u32;
    for batch in 0..40 {
        ops.push(b"(".to_vec());
        for item in 0..5 {
            let key = format!("k{batch}.{item}");
            let mut op = vec![0x8c, key.len() as u8];
            op.extend(key.as_bytes());
            op.push(b'r');
            op.extend(next.to_le_bytes());
            ops.push(op);
            // The string before, then the global.
            let mut op = vec![b'j'];
            op.extend((next - 2).to_le_bytes());
            ops.push(op);
            ops.push(b"h\x03".to_vec());
            // The pair, memoized (without a key written out, as torch does).
            ops.push(b"\x86".to_vec());
            ops.push(vec![MEMOIZE]);
            next += 2;
        }
        ops.push(b"u".to_vec());
    }
    ops.push(b".".to_vec());
    // Frames of about 200 bytes, ended between opcodes.
    let mut bytes = b"\x80\x04".to_vec();
    let (mut puts, mut gets) = (Vec::new(), Vec::new());
    let mut ops = ops.into_iter().peekable();
    while ops.peek().is_some() {
        let mut frame = Vec::new();
        // Ended after a `MEMOIZE`, so that a frame starts with the memo's size at a
        // count no key written in it gives.
        while frame.len() < 200 || frame.last() != Some(&MEMOIZE) {
            let Some(op) = ops.next() else { break };
            let at = bytes.len() + 9 + frame.len() + 1;
            match op[0] {
                b'j' => gets.push(at),
                0x8c if op[op.len() - 5] == LONG_BINPUT => puts.push(at + op.len() - 5),
                _ => {}
            }
            frame.extend(op);
        }
        bytes.push(FRAME);
        bytes.extend((frame.len() as u64).to_le_bytes());
        bytes.extend(frame);
    }
    (bytes, puts, gets)
}

/// With memo keys written out, a key out of order or fetched before it is given
/// makes both walks give up, whichever side of the tail's start it is on.
#[test]
fn the_pre_pass_split_checks_memo_keys_in_the_tail() {
    let (bytes, puts, gets) = pickle_with_keys();
    assert_eq!(bytes[puts[0] - 1], LONG_BINPUT);
    assert_eq!(bytes[gets[0] - 1], LONG_BINGET);
    let whole = blob(bytes.clone());
    assert!(frames::starts(&whole).count() > 10);
    let cuts = cuts(whole.len());
    assert!(split_everywhere_agrees(&whole, &cuts, "as written") > 10);
    let pass = pre_pass_split(&whole, Some(CutAt::Offset(whole.len() / 2)), None)
        .ok()
        .unwrap()
        .0;
    let cut = pass.cut.unwrap();
    let global = (3, Import::Global(b"mod".to_vec(), b"name".to_vec()));
    assert!(cut.imports.contains(&global), "{:?}", cut.imports);
    let changed = |at: usize, key: u32| {
        let mut b = bytes.clone();
        b[at..at + 4].copy_from_slice(&key.to_le_bytes());
        blob(b)
    };
    for i in (0..puts.len()).step_by(7) {
        let key = u32::from_le_bytes(bytes[puts[i]..puts[i] + 4].try_into().unwrap());
        // Out of order: one too many (all later keys then disagree too) or too few.
        for wrong in [key + 1, key - 1] {
            let b = changed(puts[i], wrong);
            assert!(pre_pass_split(&b, None, None).is_err());
            split_everywhere_agrees(&b, &cuts, &format!("put {i} as {wrong}"));
        }
        // Fetched before it is given: the key being given next.
        // (Each item gives two keys: its string's, then its pair's.)
        let b = changed(gets[i], key + 1);
        assert!(pre_pass_split(&b, None, None).is_err());
        split_everywhere_agrees(&b, &cuts, &format!("get {i} as {}", key + 1));
    }
}

/// Times the pre-pass on one thread and on two on the `.metadata` named by
/// `UNSHARD_PREPASS_FILE` (run with `--ignored --nocapture` in a release build), and
/// checks that both find the same.
#[test]
#[ignore = "a measurement, on a file given by UNSHARD_PREPASS_FILE"]
fn pre_pass_times_on_one_thread_and_two() {
    let Some(path) = std::env::var_os("UNSHARD_PREPASS_FILE") else {
        return;
    };
    let blob = crate::bytes::fs::open(Path::new(&path)).unwrap();
    let from = tail::split_at(&blob);
    let cut_at = Some(CutAt::Balanced);
    for _ in 0..5 {
        let t = std::time::Instant::now();
        let one = found(pre_pass_split(&blob, cut_at, None).map(|(p, _)| p));
        let t1 = t.elapsed();
        let t = std::time::Instant::now();
        let two = pre_pass_split(&blob, cut_at, from);
        let t2 = t.elapsed();
        let part = two.as_ref().ok().and_then(|(_, part)| *part);
        let two = found(two.map(|(p, _)| p));
        let cut = one.as_ref().and_then(|(_, c)| c.as_ref().map(|c| c.0));
        println!(
            "one {t1:?}, two {t2:?}: tail from {from:?}, cut at {cut:?}, stopped at part {part:?}"
        );
        assert_eq!(one, two);
    }
}

/// A frame that starts with another memo size than the walk from the start has (a
/// `MEMOIZE` just before it taken away): the keys written in the tail agree among
/// themselves, and not with the memo's size, so both walks give up.
#[test]
fn the_pre_pass_split_checks_the_tails_keys_against_the_memo_size() {
    let (bytes, _, _) = pickle_with_keys();
    let starts: Vec<u64> = frames::starts(&blob(bytes.clone())).collect();
    let cut_at = Some(CutAt::Offset(bytes.len() as u64 / 4));
    let mut checked = 0;
    for &from in &starts[starts.len() / 2..] {
        let mut changed = bytes.clone();
        let memoize = from as usize - 1;
        assert_eq!(changed[memoize], MEMOIZE);
        changed[memoize] = NONE;
        let b = blob(changed);
        assert!(pre_pass_split(&b, cut_at, None).is_err());
        let two = pre_pass_split(&b, cut_at, Some(from));
        assert!(two.is_err(), "tail from {from}");
        checked += 1;
    }
    assert!(checked > 5);
}

/// A tail that does not start where an opcode starts (a frame header that lies) is
/// not taken: wherever it starts, the split finds what one walk finds.
#[test]
fn a_tail_inside_an_opcode_is_not_taken() {
    let (bytes, _, _) = pickle_with_keys();
    let b = blob(bytes);
    let cuts = cuts(b.len());
    for cut_at in cuts {
        let one = found(pre_pass_split(&b, Some(cut_at), None).map(|(p, _)| p));
        assert!(one.is_some());
        for from in 0..b.len() + 2 {
            let two = found(pre_pass_split(&b, Some(cut_at), Some(from)).map(|(p, _)| p));
            assert_eq!(one, two, "{cut_at:?}, tail from {from}");
        }
    }
    // The same in what torch writes, a byte or a few after each frame's start.
    let path = crate::fixtures().join("sharded/wide_metadata_batches/.metadata");
    let b = crate::bytes::fs::open(&path).unwrap();
    let one = found(pre_pass_split(&b, Some(CutAt::Balanced), None).map(|(p, _)| p));
    for from in frames::starts(&b).skip(1) {
        for from in [from + 1, from + 9, from + 12] {
            let two = pre_pass_split(&b, Some(CutAt::Balanced), Some(from));
            assert_eq!(one, found(two.map(|(p, _)| p)), "tail from {from}");
        }
    }
}
