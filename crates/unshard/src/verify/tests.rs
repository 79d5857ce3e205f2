//! `verify_dir` over output directories written by the `safetensors` crate (or by
//! hand where it cannot write the layout), against plans built by hand.
#![allow(clippy::unwrap_used)]

use ::safetensors::tensor::{serialize, Dtype, TensorView};

use super::*;
use crate::plan::{Content, Expr, PlannedTensor};
use crate::source::test_input::MemInput as Input;
use crate::source::{Checkpoint, TensorSource};
use crate::write::WINDOW_BYTES;

fn planned(source: TensorSource, origin: Origin, dtype: DType) -> PlannedTensor {
    PlannedTensor {
        name: source.name.clone(),
        origin,
        shape: source.shape.clone(),
        source_dtype: source.dtype,
        dtype,
        content: Content::Copy(source),
    }
}

/// A plan of `tensors` and no shards (verify reads the shards from the output).
pub(super) fn plan(tensors: Vec<PlannedTensor>) -> Plan {
    Plan {
        tensors,
        shards: Vec::new(),
        dtype: None,
        config: None,
        index: None,
        total_size: 0,
        report: Default::default(),
    }
}

fn le(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// model.safetensors of `(name, dtype, shape, bytes)`, by the `safetensors` crate.
fn write_model(dir: &Path, tensors: &[(&str, Dtype, Vec<usize>, Vec<u8>)]) -> Vec<u8> {
    let views = tensors
        .iter()
        .map(|(n, d, s, b)| (*n, TensorView::new(*d, s.clone(), b).unwrap()));
    let bytes = serialize(views, None).unwrap();
    std::fs::write(dir.join("model.safetensors"), &bytes).unwrap();
    bytes
}

/// The bytes `start` announced and the sum of the `advance`s.
#[derive(Default)]
struct Counted {
    total: std::sync::atomic::AtomicU64,
    done: std::sync::atomic::AtomicU64,
}

impl Progress for Counted {
    fn start(&self, total: u64) {
        self.total
            .store(total, std::sync::atomic::Ordering::Relaxed);
    }
    fn advance(&self, n: u64) {
        self.done.fetch_add(n, std::sync::atomic::Ordering::Relaxed);
    }
}

fn check(dir: &Path, plan: &Plan, ckpt: &Checkpoint, expected: &[Expected]) -> VerifyReport {
    let inputs = Inputs {
        checkpoint: ckpt,
        base: Some(ckpt),
        extra: &[ckpt],
    };
    let progress = Counted::default();
    let r = verify_dir(dir, plan, inputs, expected, &progress, &Cancel::new()).unwrap();
    // The progress counts every byte of the shards read, once.
    let shards: u64 = r
        .files
        .iter()
        .filter_map(|f| std::fs::metadata(dir.join(f)).ok())
        .map(|m| m.len())
        .sum();
    let (total, done) = (progress.total.into_inner(), progress.done.into_inner());
    assert_eq!((total, done), (shards, shards));
    r
}

fn lines(r: &VerifyReport) -> Vec<String> {
    r.problems.iter().map(|p| p.to_string()).collect()
}

/// float32 bits of a NaN with payload `p`.
fn nan(p: u32) -> f32 {
    f32::from_bits(0x7fc0_0000 | p)
}

#[test]
fn values_shapes_dtypes_and_names_are_checked_against_the_plan() {
    // `a` is 8.8 MB, more than one block of the read.
    let n = 2_200_000usize;
    let a: Vec<f32> = (0..n).map(|i| (i % 1000) as f32).collect();
    let mut input = Input::default();
    let tensors = vec![
        planned(
            input.tensor("a", &a, &[n as u64]),
            Origin::Checkpoint,
            DType::F32,
        ),
        planned(
            input.tensor("b", &[nan(1), 2.0, -0.0, 4.0], &[4]),
            Origin::Checkpoint,
            DType::F32,
        ),
        planned(
            input.tensor("c", &[1.0, 2.0], &[2]),
            Origin::Checkpoint,
            DType::F32,
        ),
        planned(
            input.tensor("d", &[5.0], &[1]),
            Origin::Checkpoint,
            DType::F32,
        ),
        planned(
            input.tensor("e", &[1.0, 2.0], &[2]),
            Origin::Checkpoint,
            DType::F32,
        ),
    ];
    let plan = plan(tensors);
    let ckpt = input.checkpoint();

    let tmp = tempfile::tempdir().unwrap();
    // Two values of `a` off, by 1 (element 5, the first block) and by 8 (element
    // 2,150,000, the second); `b` equal but for its NaN's payload.
    let mut written = a.clone();
    written[5] += 1.0;
    written[2_150_000] += 8.0;
    let model = |a: &[f32]| {
        write_model(
            tmp.path(),
            &[
                ("a", Dtype::F32, vec![n], le(a)),
                ("b", Dtype::F32, vec![4], le(&[nan(2), 2.0, -0.0, 4.0])),
                // bfloat16 1.0 and 2.0.
                ("c", Dtype::BF16, vec![2], vec![0x80, 0x3f, 0x00, 0x40]),
                ("e", Dtype::F32, vec![1, 2], le(&[1.0, 2.0])),
                ("x", Dtype::F32, vec![1], le(&[0.0])),
            ],
        )
    };
    // And the first element of `a` in the second block, where the safetensors
    // crate says `a`'s data is, off by 2.
    let bytes = model(&written);
    let (len, meta) = ::safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    let a_start = (8 + len + meta.info("a").unwrap().data_offsets.0) as u64;
    let second = (WINDOW_BYTES - a_start).div_ceil(4) as usize;
    written[second] += 2.0;
    model(&written);
    let r = check(tmp.path(), &plan, &ckpt, &[]);
    assert_eq!(
        lines(&r),
        [
            "tensor 'd': missing: the merge writes it, the output does not hold it",
            "model.safetensors: tensor 'e': shape [1, 2], but the checkpoint's is [2]",
            "model.safetensors: tensor 'c': stored as bfloat16, but the merge writes float32 (float32 in the checkpoint)",
            "model.safetensors: tensor 'x': extra: the merge does not write this tensor",
        ]
    );
    assert_eq!(r.files, ["model.safetensors"]);
    assert_eq!(r.tensors_compared, 2);
    assert_eq!(r.bytes_compared, 4 * n as u64 + 16);
    assert_eq!(r.files_checksummed, 0);
    assert_eq!(
        r.mismatches,
        [Mismatch {
            file: "model.safetensors".into(),
            name: "a".into(),
            shape: vec![n as u64],
            dtype: DType::F32,
            differing: 3,
            nan_mismatch: 0,
            max_abs_diff: 8.0,
            first: Some(FirstDiff {
                index: 5,
                expected: 5.0,
                found: 6.0,
            }),
        }]
    );

    // The same output with every value right: no mismatch; a NaN where a number
    // should be counts as one.
    let mut written = a.clone();
    written[n - 1] = nan(0);
    write_model(
        tmp.path(),
        &[
            ("a", Dtype::F32, vec![n], le(&written)),
            ("b", Dtype::F32, vec![4], le(&[nan(1), 2.0, -0.0, 4.0])),
        ],
    );
    let r = check(tmp.path(), &plan, &ckpt, &[]);
    assert_eq!(r.tensors_compared, 2);
    assert_eq!(r.mismatches.len(), 1);
    let m = &r.mismatches[0];
    assert_eq!((m.name.as_str(), m.differing, m.nan_mismatch), ("a", 1, 1));
    assert_eq!(m.first.map(|f| f.index), Some(n as u64 - 1));
}

#[test]
fn an_element_cut_by_a_block_edge_is_compared_whole() {
    // A header of 2 mod 4 bytes after the length puts every float32 of `a` across
    // a 4-byte boundary, and one element across the 8 MiB block edge.
    let n = 2_200_000usize;
    let a: Vec<f32> = (0..n).map(|i| i as f32).collect();
    let mut input = Input::default();
    let plan = plan(vec![planned(
        input.tensor("a", &a, &[n as u64]),
        Origin::Checkpoint,
        DType::F32,
    )]);
    let ckpt = input.checkpoint();
    let mut header = format!(
        r#"{{"a":{{"dtype":"F32","shape":[{n}],"data_offsets":[0,{}]}}}}"#,
        4 * n
    );
    while (8 + header.len()) % 4 != 2 {
        header.push(' ');
    }
    let data_start = 8 + header.len() as u64;
    let cut = (WINDOW_BYTES - data_start) / 4;
    assert!(data_start + 4 * cut < WINDOW_BYTES && data_start + 4 * cut + 4 > WINDOW_BYTES);
    let mut written = a.clone();
    written[cut as usize - 1] += 1.0;
    written[cut as usize] += 2.0;
    written[cut as usize + 1] += 4.0;
    let mut file = (header.len() as u64).to_le_bytes().to_vec();
    file.extend(header.as_bytes());
    file.extend(le(&written));
    let tmp = tempfile::tempdir().unwrap();
    std::fs::write(tmp.path().join("model.safetensors"), &file).unwrap();
    let r = check(tmp.path(), &plan, &ckpt, &[]);
    assert!(r.problems.is_empty(), "{:?}", r.problems);
    assert_eq!(r.mismatches.len(), 1);
    let m = &r.mismatches[0];
    assert_eq!((m.differing, m.max_abs_diff), (3, 4.0));
    assert_eq!(m.first.map(|f| f.index), Some(cut - 1));

    // Only the element across the edge off.
    let mut written = a.clone();
    written[cut as usize] = -1.0;
    file.truncate(data_start as usize);
    file.extend(le(&written));
    std::fs::write(tmp.path().join("model.safetensors"), &file).unwrap();
    let r = check(tmp.path(), &plan, &ckpt, &[]);
    let m = &r.mismatches[0];
    assert_eq!((m.differing, m.max_abs_diff), (1, cut as f64 + 1.0));
    assert_eq!(
        m.first,
        Some(FirstDiff {
            index: cut,
            expected: cut as f64,
            found: -1.0
        })
    );
}

/// Tensors `p`, `q` (and `r`) of float32 and an int64 `i` planned; written in
/// the dtypes given.
fn casts(stored: &[Dtype], expected: &[Expected], origins: [Origin; 3]) -> Vec<String> {
    let mut input = Input::default();
    let mut tensors: Vec<PlannedTensor> = ["p", "q", "r"]
        .iter()
        .zip(origins)
        .take(stored.len())
        .map(|(n, o)| planned(input.tensor(n, &[1.0], &[1]), o, DType::F32))
        .collect();
    // Eight zero bytes: int64 0.
    let mut i = input.tensor("i", &[0.0, 0.0], &[1]);
    i.dtype = DType::I64;
    i.pieces[0].dtype = DType::I64;
    tensors.insert(0, planned(i, Origin::Checkpoint, DType::I64));
    let plan = plan(tensors);
    let ckpt = input.checkpoint();
    let tmp = tempfile::tempdir().unwrap();
    let values: Vec<(&str, Dtype, Vec<usize>, Vec<u8>)> = ["p", "q", "r"]
        .iter()
        .zip(stored)
        .map(|(n, &d)| {
            let b = match d {
                Dtype::F32 => le(&[1.0]),
                _ => vec![0x80, 0x3f], // 1.0 in bfloat16 and 1.875 in float16
            };
            (*n, d, vec![1], b)
        })
        .chain([("i", Dtype::I64, vec![1], vec![0; 8])])
        .collect();
    write_model(tmp.path(), &values);
    lines(&check(tmp.path(), &plan, &ckpt, expected))
}

#[test]
fn every_floating_tensor_in_one_other_dtype_is_one_line_naming_the_option() {
    let ck = [Origin::Checkpoint; 3];
    assert_eq!(
        casts(&[Dtype::BF16, Dtype::BF16], &[], ck),
        ["all 2 floating tensors are stored as bfloat16, but with the options given the merge writes float32 (first: 'p' in model.safetensors): the merge ran with other options; pass --dtype bfloat16, or the --base it was given (whose config sets the dtype)"]
    );
    let each = |names: &[&str]| -> Vec<String> {
        names
            .iter()
            .map(|n| format!("model.safetensors: tensor '{n}': stored as bfloat16, but the merge writes float32 (float32 in the checkpoint)"))
            .collect()
    };
    // One tensor of one: a line for it.
    assert_eq!(casts(&[Dtype::BF16], &[], ck), each(&["p"]));
    // Not all of them: a line each.
    assert_eq!(
        casts(&[Dtype::BF16, Dtype::BF16, Dtype::F32], &[], ck),
        each(&["p", "q"])
    );
    // Not all in the same dtype.
    assert_eq!(
        casts(&[Dtype::BF16, Dtype::F16], &[], ck),
        [
            each(&["p"])[0].clone(),
            "model.safetensors: tensor 'q': stored as float16, but the merge writes float32 (float32 in the checkpoint)".to_string(),
        ]
    );
    // Checksums given (a merge's own options): a line each, naming the inputs.
    let expected = [Expected {
        name: "absent.json".into(),
        size: 0,
        digest: ExpectedDigest::Recorded([0; 32]),
    }];
    let from = [Origin::Base, Origin::Input(0), Origin::Checkpoint];
    assert_eq!(
        casts(&[Dtype::BF16, Dtype::BF16], &expected, from),
        [
            "model.safetensors: tensor 'p': stored as bfloat16, but the merge writes float32 (float32 in the base)",
            "model.safetensors: tensor 'q': stored as bfloat16, but the merge writes float32 (float32 in the input 0)",
            "absent.json: missing: the merge wrote it (it is in unshard.json)",
        ]
    );
}

/// The digest of each block of `bytes` (its BLAKE3 subtree chaining value, or
/// the file's hash when one block is the whole file), and the file's BLAKE3
/// hash, taken here in one go with the `blake3` crate.
fn digests(bytes: &[u8]) -> (Vec<Option<[u8; 32]>>, [u8; 32]) {
    use blake3::hazmat::HasherExt;
    let whole: [u8; 32] = blake3::hash(bytes).into();
    let w = WINDOW_BYTES as usize;
    let blocks: Vec<Option<[u8; 32]>> = if bytes.len() <= w {
        vec![Some(whole)]
    } else {
        bytes
            .chunks(w)
            .enumerate()
            .map(|(k, b)| {
                Some(
                    blake3::Hasher::new()
                        .set_input_offset((k * w) as u64)
                        .update(b)
                        .finalize_non_root(),
                )
            })
            .collect()
    };
    (blocks, whole)
}

#[test]
fn the_files_are_held_to_the_checksums_written_or_recorded() {
    let n = 2_100_000usize;
    let a: Vec<f32> = (0..n).map(|i| (i % 77) as f32).collect();
    let mut input = Input::default();
    let plan = plan(vec![planned(
        input.tensor("a", &a, &[n as u64]),
        Origin::Checkpoint,
        DType::F32,
    )]);
    let ckpt = input.checkpoint();
    let tmp = tempfile::tempdir().unwrap();
    let bytes = write_model(tmp.path(), &[("a", Dtype::F32, vec![n], le(&a))]);
    std::fs::write(tmp.path().join("tokenizer.json"), b"{}").unwrap();
    let (blocks, tree) = digests(&bytes);
    let (_, tok_tree) = digests(b"{}");
    let size = bytes.len() as u64;
    let shard = |digest| Expected {
        name: "model.safetensors".into(),
        size,
        digest,
    };
    let tokenizer = |digest| Expected {
        name: "tokenizer.json".into(),
        size: 2,
        digest,
    };
    let good = [
        shard(ExpectedDigest::Written(blocks.clone())),
        tokenizer(ExpectedDigest::Recorded(tok_tree)),
    ];
    let r = check(tmp.path(), &plan, &ckpt, &good);
    assert!(r.problems.is_empty(), "{:?}", r.problems);
    assert_eq!(r.files_checksummed, 2);
    let r = check(
        tmp.path(),
        &plan,
        &ckpt,
        &[shard(ExpectedDigest::Recorded(tree))],
    );
    assert!(r.problems.is_empty(), "{:?}", r.problems);
    assert_eq!(r.files_checksummed, 1);

    // A block the writer did not hash is not held to anything.
    let mut partial = blocks.clone();
    partial[0] = None;
    let r = check(
        tmp.path(),
        &plan,
        &ckpt,
        &[shard(ExpectedDigest::Written(partial))],
    );
    assert_eq!(r.files_checksummed, 1);

    // One byte of the second block changed, and the tokenizer.
    let mut torn = bytes.clone();
    torn[WINDOW_BYTES as usize + 1] ^= 0x40;
    std::fs::write(tmp.path().join("model.safetensors"), &torn).unwrap();
    std::fs::write(tmp.path().join("tokenizer.json"), b"[]").unwrap();
    let r = check(tmp.path(), &plan, &ckpt, &good);
    let (_, found) = digests(b"[]");
    let hex = |s: [u8; 32]| s.iter().map(|b| format!("{b:02x}")).collect::<String>();
    assert_eq!(
        lines(&r),
        [
            format!("model.safetensors: 1 block(s) read back differ from what was written, the first at bytes {WINDOW_BYTES}..{size} (BLAKE3 of each 8 MiB block): a torn or corrupted write; check the disk and run the merge again"),
            format!("tokenizer.json: its checksum is {}, but unshard.json records {}: the file changed since the merge wrote it", hex(found), hex(tok_tree)),
        ]
    );
    assert_eq!(r.files_checksummed, 0);
    assert_eq!(r.mismatches.len(), 1);
    let r = check(
        tmp.path(),
        &plan,
        &ckpt,
        &[shard(ExpectedDigest::Recorded(tree))],
    );
    assert_eq!(r.files_checksummed, 0);
    assert_eq!(r.problems.len(), 1);
    assert!(lines(&r)[0].ends_with(&format!(
        "but unshard.json records {}: the file changed since the merge wrote it",
        hex(tree)
    )));
    // A byte of the first block changed too: two blocks, the first at 0.
    torn[1000] ^= 0x40;
    std::fs::write(tmp.path().join("model.safetensors"), &torn).unwrap();
    let r = check(tmp.path(), &plan, &ckpt, &good[..1]);
    assert_eq!(
        lines(&r),
        [format!("model.safetensors: 2 block(s) read back differ from what was written, the first at bytes 0..{WINDOW_BYTES} (BLAKE3 of each 8 MiB block): a torn or corrupted write; check the disk and run the merge again")]
    );

    // A shorter file.
    std::fs::write(tmp.path().join("tokenizer.json"), b"{").unwrap();
    let r = check(
        tmp.path(),
        &plan,
        &ckpt,
        &[tokenizer(ExpectedDigest::Written(vec![None]))],
    );
    assert_eq!(
        lines(&r),
        ["tokenizer.json: 1 bytes, but the merge wrote 2 (a short or torn write)"]
    );
    let r = check(
        tmp.path(),
        &plan,
        &ckpt,
        &[tokenizer(ExpectedDigest::Recorded(tok_tree))],
    );
    assert_eq!(lines(&r), ["tokenizer.json: 1 bytes, but the merge wrote 2: the file changed since the merge wrote it"]);
}

#[test]
fn a_one_byte_tensor_and_an_empty_one_are_compared() {
    let mut input = Input::default();
    let plan = plan(vec![
        planned(input.tensor("e", &[], &[0]), Origin::Checkpoint, DType::F32),
        planned(
            input.raw("u", &[7], DType::U8, &[1]),
            Origin::Checkpoint,
            DType::U8,
        ),
    ]);
    let ckpt = input.checkpoint();
    let tmp = tempfile::tempdir().unwrap();
    for (u, differing) in [(7u8, 0), (8, 1)] {
        write_model(
            tmp.path(),
            &[
                ("e", Dtype::F32, vec![0], Vec::new()),
                ("u", Dtype::U8, vec![1], vec![u]),
            ],
        );
        let r = check(tmp.path(), &plan, &ckpt, &[]);
        assert!(r.problems.is_empty(), "{:?}", r.problems);
        assert_eq!((r.tensors_compared, r.bytes_compared), (2, 1));
        let found: Vec<(&str, u64)> = r
            .mismatches
            .iter()
            .map(|m| (m.name.as_str(), m.differing))
            .collect();
        if differing == 0 {
            assert!(found.is_empty(), "{found:?}");
        } else {
            assert_eq!(found, [("u", 1)]);
        }
    }
}

#[test]
fn computed_tensors_are_compared_with_their_reference() {
    let mut input = Input::default();
    let leaf = |input: &mut Input, name: &str, v: &[f32], shape: &[u64]| {
        Expr::leaf(Origin::Checkpoint, input.tensor(name, v, shape))
    };
    // [1, 2] and [3, 4] joined.
    let concat = Expr::Concat {
        dim: 0,
        parts: vec![
            leaf(&mut input, "x", &[1.0, 2.0], &[2]),
            leaf(&mut input, "y", &[3.0, 4.0], &[2]),
        ],
    };
    // Ones + 0.5 * B @ A, B @ A = [[1, 2, 1], [3, 4, 3]].
    let fuse = Expr::Fuse {
        base: Box::new(leaf(&mut input, "w", &[1.0; 6], &[2, 3])),
        a: Box::new(leaf(
            &mut input,
            "a",
            &[1.0, 0.0, 1.0, 0.0, 1.0, 0.0],
            &[2, 3],
        )),
        b: Box::new(leaf(&mut input, "b", &[1.0, 2.0, 3.0, 4.0], &[2, 2])),
        magnitude: None,
        scale: 0.5,
        layout: crate::dtype::fuse::Layout::Linear,
    };
    let computed = |name: &str, shape: &[u64], e: Expr| PlannedTensor {
        name: name.into(),
        origin: Origin::Checkpoint,
        shape: shape.to_vec(),
        source_dtype: DType::F32,
        dtype: DType::F32,
        content: Content::Computed(e),
    };
    let plan = plan(vec![
        computed("c", &[4], concat),
        computed("f", &[2, 3], fuse),
    ]);
    let ckpt = input.checkpoint();
    let tmp = tempfile::tempdir().unwrap();
    let fused = [1.5, 2.0, 1.5, 2.5, 3.0, 2.5];
    let mut off = fused;
    off[1] = 2.5;
    for (c, f, want) in [
        ([1.0, 2.0, 3.0, 4.0], fused, vec![]),
        (
            [1.0, 2.0, 3.0, 5.0],
            off,
            vec![("c", 1, 3, 1.0), ("f", 1, 1, 0.5)],
        ),
    ] {
        write_model(
            tmp.path(),
            &[
                ("c", Dtype::F32, vec![4], le(&c)),
                ("f", Dtype::F32, vec![2, 3], le(&f)),
            ],
        );
        let r = check(tmp.path(), &plan, &ckpt, &[]);
        assert!(r.problems.is_empty(), "{:?}", r.problems);
        assert_eq!(r.tensors_compared, 2);
        let found: Vec<(&str, u64, u64, f64)> = r
            .mismatches
            .iter()
            .map(|m| {
                let i = m.first.unwrap().index;
                (m.name.as_str(), m.differing, i, m.max_abs_diff)
            })
            .collect();
        assert_eq!(found, want);
    }
}

#[test]
fn each_shard_is_held_to_its_own_block_digests() {
    let mut input = Input::default();
    let plan = plan(vec![
        planned(
            input.tensor("a", &[1.0, 2.0], &[2]),
            Origin::Checkpoint,
            DType::F32,
        ),
        planned(
            input.tensor("b", &[3.0], &[1]),
            Origin::Checkpoint,
            DType::F32,
        ),
    ]);
    let ckpt = input.checkpoint();
    let tmp = tempfile::tempdir().unwrap();
    let shard = |name: &str, t: &str, v: &[f32]| {
        let data = le(v);
        let view = TensorView::new(Dtype::F32, vec![v.len()], &data).unwrap();
        let bytes = serialize([(t, view)], None).unwrap();
        std::fs::write(tmp.path().join(name), &bytes).unwrap();
        let (blocks, _) = digests(&bytes);
        Expected {
            name: name.into(),
            size: bytes.len() as u64,
            digest: ExpectedDigest::Written(blocks),
        }
    };
    let (s1, s2) = (
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    );
    let expected = [shard(s1, "a", &[1.0, 2.0]), shard(s2, "b", &[3.0])];
    let index = serde_json::json!({
        "metadata": {"total_size": 12},
        "weight_map": {"a": s1, "b": s2},
    });
    std::fs::write(
        tmp.path().join("model.safetensors.index.json"),
        index.to_string(),
    )
    .unwrap();
    let r = check(tmp.path(), &plan, &ckpt, &expected);
    assert!(r.problems.is_empty(), "{:?}", r.problems);
    assert!(r.mismatches.is_empty(), "{:?}", r.mismatches);
    assert_eq!((r.tensors_compared, r.files_checksummed), (2, 2));
}

/// A computed tensor over two blocks: the second block's elements are compared
/// with the reference's elements at their own indices (not the first block's).
#[test]
fn a_computed_tensor_over_two_blocks_is_compared_at_each_elements_index() {
    let n = 1_500_000usize;
    let x: Vec<f32> = (0..n).map(|i| i as f32).collect();
    let y: Vec<f32> = (n..2 * n).map(|i| i as f32).collect();
    let mut input = Input::default();
    let concat = Expr::Concat {
        dim: 0,
        parts: vec![
            Expr::leaf(Origin::Checkpoint, input.tensor("x", &x, &[n as u64])),
            Expr::leaf(Origin::Checkpoint, input.tensor("y", &y, &[n as u64])),
        ],
    };
    let plan = plan(vec![PlannedTensor {
        name: "c".into(),
        origin: Origin::Checkpoint,
        shape: vec![2 * n as u64],
        source_dtype: DType::F32,
        dtype: DType::F32,
        content: Content::Computed(concat),
    }]);
    let ckpt = input.checkpoint();
    let tmp = tempfile::tempdir().unwrap();
    let mut all: Vec<f32> = (0..2 * n).map(|i| i as f32).collect();
    assert!(4 * all.len() as u64 > WINDOW_BYTES, "two blocks");
    write_model(tmp.path(), &[("c", Dtype::F32, vec![2 * n], le(&all))]);
    let r = check(tmp.path(), &plan, &ckpt, &[]);
    assert!(r.problems.is_empty(), "{:?}", r.problems);
    assert!(r.mismatches.is_empty(), "{:?}", r.mismatches.len());
    // One element of the second block off by 3.
    let at = 2_900_000;
    all[at] += 3.0;
    write_model(tmp.path(), &[("c", Dtype::F32, vec![2 * n], le(&all))]);
    let r = check(tmp.path(), &plan, &ckpt, &[]);
    let found: Vec<(u64, u64, f64)> = r
        .mismatches
        .iter()
        .map(|m| (m.differing, m.first.unwrap().index, m.max_abs_diff))
        .collect();
    assert_eq!(found, [(1, at as u64, 3.0)]);
}
