//! The streaming reader against the full one, on what torch writes.

#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};

use super::*;

/// Every DCP `.metadata` fixture written by torch.
fn metadata_files() -> Vec<PathBuf> {
    let f = crate::fixtures();
    [
        "sharded/llama_w2_dcp",
        "sharded/llama_w3_dcp",
        "sharded/llama_w8_dcp",
        "sharded/wide_metadata",
        "sharded/wide_metadata_batches",
        "sharded/llama_hsdp_2x2_dcp",
        "sharded/llama_w2_dcp_with_optim",
        "sharded/llama_w2_dcp_zstd",
        "sharded/qwen2_w2_dcp",
        "sharded/accelerate_dcp/pytorch_model_fsdp_0",
        "sharded/accelerate_dcp/optimizer_0",
        "placements/dcp",
        "lora/train/llama_dora_fsdp2/checkpoint",
    ]
    .iter()
    .map(|d| f.join(d).join(".metadata"))
    .collect()
}

/// An entry with everything resolved: offsets, sizes and byte ranges by file name.
type Resolved = (String, Vec<String>, String);

fn resolved(md: &Metadata) -> Vec<Resolved> {
    let item = |i: &Option<Item>| {
        i.map(|i| {
            (
                md.file(&i).to_string(),
                i.offset,
                i.length,
                md.transforms(&i).to_vec(),
            )
        })
    };
    md.entries
        .iter()
        .map(|e| {
            let kind = match &e.kind {
                EntryKind::Bytes { item: i } => format!("bytes {:?}", item(i)),
                EntryKind::Tensor {
                    dtype,
                    shape,
                    chunks,
                    dropped,
                } => {
                    let chunks: Vec<_> = chunks
                        .list
                        .iter()
                        .map(|c| (chunks.offsets(c), chunks.sizes(c), item(&c.item)))
                        .collect();
                    format!("{dtype:?} {shape:?} dropped={dropped} {chunks:?}")
                }
            };
            (e.fqn.clone(), e.path.clone(), kind)
        })
        .collect()
}

fn both(path: &Path, keep: Keep<'_>) -> (Option<Metadata>, Metadata) {
    let blob = crate::bytes::fs::open(path).unwrap();
    let streamed = stream::read(&blob, keep).unwrap();
    let raw = std::fs::read(path).unwrap();
    (streamed, full::parse(path, &raw, keep).unwrap())
}

/// The one-pass reader takes every fixture torch wrote and gives exactly what the
/// full reader gives, with every chunk kept and with optimizer chunks dropped.
#[test]
fn streaming_reads_what_torch_writes_as_the_full_reader_does() {
    let model = Keep::Model {
        key: None,
        optimizer_keys: &["optim", "optimizer"],
    };
    for path in metadata_files() {
        for keep in [Keep::All, model] {
            let (streamed, full) = both(&path, keep);
            let streamed =
                streamed.unwrap_or_else(|| panic!("{} was not streamed", path.display()));
            assert!(full.unsafe_calls.is_empty(), "{}", path.display());
            assert!(streamed.unsafe_calls.is_empty());
            let (a, b) = (resolved(&streamed), resolved(&full));
            assert_eq!(a.len(), b.len(), "{}", path.display());
            for (x, y) in a.iter().zip(&b) {
                assert_eq!(x, y, "{}", path.display());
            }
        }
    }
}

/// A pickle cut in two and read on two threads gives what one thread reads, with
/// every chunk kept and with optimizer chunks dropped: the second half is taken over
/// whenever the cut falls before a batch boundary of `storage_data`, which is
/// everywhere in this file but its last batch.
#[test]
fn a_pickle_read_in_two_halves_reads_as_in_one() {
    let path = crate::fixtures().join("sharded/wide_metadata_batches/.metadata");
    let blob = crate::bytes::fs::open(&path).unwrap();
    let model = Keep::Model {
        key: None,
        optimizer_keys: &["optim", "optimizer"],
    };
    for keep in [Keep::All, model] {
        let (whole, took) = stream::read_cut(&blob, keep, None).unwrap().unwrap();
        assert!(!took);
        let whole = resolved(&whole);
        let mut taken = 0;
        let cuts = 16;
        for i in 0..cuts {
            let at = blob.len() * i / cuts;
            let at = stream::CutAt::Offset(at);
            let (md, took) = stream::read_cut(&blob, keep, Some(at)).unwrap().unwrap();
            let md = resolved(&md);
            assert_eq!(md.len(), whole.len(), "cut at {at:?}");
            for (x, y) in md.iter().zip(&whole) {
                assert_eq!(x, y, "cut at {at:?}");
            }
            taken += usize::from(took);
        }
        assert_eq!(taken, cuts as usize, "halves taken over");
        // Where the halves hold about as many opcodes: a boundary is found and taken.
        let (md, took) = stream::read_cut(&blob, keep, Some(stream::CutAt::Balanced))
            .unwrap()
            .unwrap();
        assert!(took);
        assert_eq!(resolved(&md), whole);
    }
}

/// Whatever the bytes, one thread and two give the same answer: the file with one
/// byte changed, at places on both sides of the cut, is read alike (or left to the
/// full reader alike), and neither panics.
#[test]
fn one_thread_and_two_agree_on_changed_bytes() {
    let path = crate::fixtures().join("sharded/wide_metadata_batches/.metadata");
    let raw = std::fs::read(&path).unwrap();
    let len = raw.len() as u64;
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let (mut same, mut read) = (0, 0);
    for _ in 0..48 {
        let mut bytes = raw.clone();
        let at = (next() % len) as usize;
        // A small change to the byte (an integer's digit, an opcode, a length).
        bytes[at] = bytes[at].wrapping_add(1 + (next() % 3) as u8);
        let blob = crate::source::Blob::owned(PathBuf::from(".metadata"), bytes);
        let one = stream::read_cut(&blob, Keep::All, None).unwrap();
        let cut = stream::CutAt::Offset(len / 2);
        let two = stream::read_cut(&blob, Keep::All, Some(cut)).unwrap();
        match (one, two) {
            (None, None) => {}
            (Some((a, _)), Some((b, _))) => {
                assert_eq!(resolved(&a), resolved(&b), "byte {at} changed");
                read += 1;
            }
            (a, b) => panic!(
                "byte {at} changed: one thread {}, two {}",
                a.is_some(),
                b.is_some()
            ),
        }
        same += 1;
    }
    assert_eq!(same, 48);
    // Some changes leave a readable file (another integer), and those were compared.
    assert!(read > 0, "no changed file was read");
}

/// Chunks of optimizer state are not kept, and the tensors' storage entries still
/// land on the right chunks.
#[test]
fn optimizer_chunks_are_dropped_and_model_chunks_keep_their_items() {
    let path = crate::fixtures().join("sharded/llama_w2_dcp_with_optim/.metadata");
    let keep = Keep::Model {
        key: None,
        optimizer_keys: &["optim"],
    };
    let (streamed, _) = both(&path, keep);
    let md = streamed.unwrap();
    let mut dropped = 0;
    for e in &md.entries {
        if let EntryKind::Tensor {
            chunks, dropped: d, ..
        } = &e.kind
        {
            if *d {
                dropped += 1;
                assert!(e.fqn.starts_with("optim."), "{}", e.fqn);
                assert!(chunks.list.is_empty());
            } else {
                assert!(e.fqn.starts_with("model."), "{}", e.fqn);
                assert!(!chunks.list.is_empty());
                assert!(chunks.list.iter().all(|c| c.item.is_some()), "{}", e.fqn);
            }
        }
    }
    assert!(dropped > 0);
}

/// Anything beyond DCP's own classes is left to the full reader, which audits it:
/// a discarded `posix.system` call put before torch's own metadata (the way
/// fickling injects one) is reported, not skipped.
#[test]
fn a_pickle_with_other_calls_is_left_to_the_full_reader() {
    let good = crate::fixtures().join("sharded/llama_w2_dcp/.metadata");
    let raw = std::fs::read(&good).unwrap();
    // PROTO 4, FRAME n: then the injected call, then the rest of the pickle.
    assert_eq!(&raw[..3], b"\x80\x04\x95");
    let mut evil = raw[..11].to_vec();
    evil.extend_from_slice(b"cposix\nsystem\nX\x04\x00\x00\x00true\x85R0");
    evil.extend_from_slice(&raw[11..]);
    let dir = std::env::temp_dir().join(format!("unshard-dcp-evil-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(".metadata");
    std::fs::write(&path, &evil).unwrap();
    let blob = crate::bytes::fs::open(&path).unwrap();
    assert!(stream::read(&blob, Keep::All).unwrap().is_none());
    let md = parse_metadata(&path, Keep::All).unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    assert!(
        md.unsafe_calls
            .iter()
            .any(|c| c.callable.contains("system")),
        "{:?}",
        md.unsafe_calls
    );
    // The same bytes without the call are streamed.
    let blob = crate::bytes::fs::open(&good).unwrap();
    assert!(stream::read(&blob, Keep::All).unwrap().is_some());
}

fn stream_bytes(data: Vec<u8>) -> Option<Metadata> {
    let blob = crate::source::Blob::owned(PathBuf::from(".metadata"), data);
    stream::read(&blob, Keep::All).unwrap()
}

/// Values are trees in the streaming reader: nesting beyond its bound, which would
/// make dropping them recurse without end, leaves the pickle to the full reader.
#[test]
fn deep_nesting_is_left_to_the_full_reader() {
    let mut deep = b"\x80\x04)".to_vec();
    deep.extend(std::iter::repeat_n(0x85u8, 1_000_000)); // TUPLE1
    deep.push(b'.');
    assert!(stream_bytes(deep).is_none());
    let mut lists = b"\x80\x04".to_vec();
    for _ in 0..1_000_000 {
        lists.extend_from_slice(b"](");
    }
    lists.extend(std::iter::repeat_n(b'e', 1_000_000)); // APPENDS
    lists.push(b'.');
    assert!(stream_bytes(lists).is_none());
}
