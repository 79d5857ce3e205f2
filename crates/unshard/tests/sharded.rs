//! Sharded checkpoints: DCP directories and per-rank DTensor / ShardedTensor files.
//!
//! The fixtures in `fixtures/sharded/` were written by real FSDP1, FSDP2 and HSDP runs
//! on CPU (`fixtures/gen_sharded.py`) from the weights of `fixtures/ckpt/*_policy.pt`.
//! Every good fixture must therefore hold exactly those weights, and merging it must
//! give exactly what transformers' `save_pretrained` wrote from the full state dict
//! (`fixtures/sharded/cases.json` names the expected directory of each case).
#![allow(clippy::unwrap_used)]

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use unshard::merge::{self, MergeOptions};
use unshard::plan::{DtypeChoice, PlanOptions};
use unshard::source::{self, check_coverage, Format, OpenOptions, Piece, TensorSource};
use unshard::write::{read_tensor, NoProgress};
use unshard::{DType, Error};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures")
}

fn sharded(name: &str) -> PathBuf {
    fixtures().join("sharded").join(name)
}

fn open(path: &Path) -> unshard::Result<source::Checkpoint> {
    source::open(path, &OpenOptions::default())
}

/// Every tensor of a checkpoint, read whole in its own dtype.
fn contents(ckpt: &source::Checkpoint) -> HashMap<String, (DType, Vec<u64>, Vec<u8>)> {
    ckpt.tensors
        .iter()
        .map(|t| {
            let (bytes, _) =
                read_tensor(&ckpt.files, t, t.dtype).unwrap_or_else(|e| panic!("{}: {e}", t.name));
            (t.name.clone(), (t.dtype, t.shape.clone(), bytes))
        })
        .collect()
}

/// The full state dict the sharded fixtures were made from.
fn full_state(kind: &str) -> HashMap<String, (DType, Vec<u64>, Vec<u8>)> {
    let ckpt = open(&fixtures().join(format!("ckpt/{kind}_policy.pt"))).unwrap();
    contents(&ckpt)
}

/// `(fixture, model kind, format, key the model sits under)` of every good fixture.
const GOOD: &[(&str, &str, Format, Option<&str>)] = &[
    ("llama_w1_ranks", "llama", Format::Ranks, None),
    ("llama_w2_ranks", "llama", Format::Ranks, None),
    ("llama_w3_ranks", "llama", Format::Ranks, None),
    ("llama_hsdp_2x2_ranks", "llama", Format::Ranks, None),
    ("fsdp1_sharded_w2_ranks", "llama", Format::Ranks, None),
    ("llama_w2_dcp", "llama", Format::Dcp, None),
    ("llama_w3_dcp", "llama", Format::Dcp, None),
    ("llama_hsdp_2x2_dcp", "llama", Format::Dcp, None),
    ("llama_w2_dcp_zstd", "llama", Format::Dcp, None),
    (
        "llama_w2_dcp_with_optim",
        "llama",
        Format::Dcp,
        Some("model"),
    ),
    (
        "accelerate_dcp/pytorch_model_fsdp_0",
        "llama",
        Format::Dcp,
        Some("model"),
    ),
    ("accelerate_dcp", "llama", Format::Dcp, Some("model")),
    ("qwen2_w2_dcp", "qwen2", Format::Dcp, None),
    // Rank 1's pickle parsed, not read from rank 0's (gen_swapped_ranks.py).
    ("llama_w2_ranks_long_memo", "llama", Format::Ranks, None),
];

/// Rank files are read against rank 0's pickle where they share its structure
/// (`fixtures/gen_swapped_ranks.py`): in `llama_w2_ranks_swapped`, rank 1's pickle
/// names the storages of layer 0's q_proj and o_proj the other way round (two
/// storage-key strings differ; the file is read from rank 0's with those strings
/// changed). The merge must follow rank 1's own pickle: rows of
/// rank 1 of each come from the other's local shard, every other tensor is as in
/// the full state dict.
#[test]
fn a_rank_file_unlike_rank_0s_is_read_as_its_own_pickle_says() {
    let full = full_state("llama");
    let ckpt = open(&sharded("llama_w2_ranks_swapped")).unwrap();
    let got = contents(&ckpt);
    let q = "model.layers.0.self_attn.q_proj.weight";
    let o = "model.layers.0.self_attn.o_proj.weight";
    let (_, shape, fq) = &full[q];
    let fo = &full[o].2;
    assert_eq!(full[o].1, *shape);
    // Shard(0) over 2 ranks: rank 0 holds the first ceil(rows / 2) rows.
    let rows = shape[0] as usize;
    let cut = rows.div_ceil(2) * (fq.len() / rows);
    let want_q = [&fq[..cut], &fo[cut..]].concat();
    let want_o = [&fo[..cut], &fq[cut..]].concat();
    assert!(got[q].2 == want_q, "q_proj's rank-1 rows are o_proj's");
    assert!(got[o].2 == want_o, "o_proj's rank-1 rows are q_proj's");
    assert_eq!(got.len(), full.len());
    for (t, w) in &full {
        if t != q && t != o {
            assert!(got[t] == *w, "{t} differs");
        }
    }
}

#[test]
fn every_sharded_fixture_holds_the_full_state_dict_bit_for_bit() {
    let mut full = HashMap::new();
    for &(name, kind, format, key) in GOOD {
        let want = full.entry(kind).or_insert_with(|| full_state(kind));
        let ckpt = open(&sharded(name)).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(ckpt.format, format, "{name}");
        assert_eq!(ckpt.key.as_deref(), key, "{name}");
        let got = contents(&ckpt);
        let mut missing: Vec<&String> = want.keys().filter(|k| !got.contains_key(*k)).collect();
        missing.sort();
        assert!(missing.is_empty(), "{name}: missing {missing:?}");
        assert_eq!(got.len(), want.len(), "{name}: extra tensors");
        for (t, w) in want.iter() {
            let g = &got[t];
            assert_eq!((g.0, &g.1), (w.0, &w.1), "{name}: {t} dtype/shape");
            assert!(g.2 == w.2, "{name}: bytes of {t} differ");
        }
        if name != "llama_w1_ranks" {
            assert!(
                ckpt.tensors.iter().all(|t| t.layout.is_some()),
                "{name}: every tensor says how it was sharded"
            );
        }
    }
}

fn str_of<'a>(v: &'a serde_json::Value, k: &str) -> &'a str {
    v[k].as_str().unwrap_or_else(|| panic!("{k} in {v}"))
}

fn merge_options(case: &serde_json::Value, out: &Path) -> MergeOptions {
    let dtype = match str_of(case, "dtype") {
        "auto" => DtypeChoice::Auto,
        d => DtypeChoice::Fixed(DType::from_torch_name(d).unwrap()),
    };
    MergeOptions {
        checkpoint: fixtures().join(str_of(case, "checkpoint")),
        base: Some(fixtures().join(str_of(case, "base"))),
        output: out.to_path_buf(),
        plan: PlanOptions {
            dtype,
            max_shard_size: case["max_shard_size"]
                .as_str()
                .map(|s| merge::parse_size(s).unwrap())
                .unwrap_or(5_000_000_000),
            ..PlanOptions::default()
        },
        ..MergeOptions::default()
    }
}

fn cases() -> serde_json::Value {
    let text = std::fs::read_to_string(sharded("cases.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

/// The files of `dir` that transformers writes too: unshard's own record of the
/// merge (`unshard.json`, required here, checked in tests/manifest.rs) aside.
fn files_of(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n != unshard::manifest::MANIFEST)
        .collect();
    v.sort();
    v
}

#[test]
fn every_sharded_case_merges_to_what_transformers_writes() {
    let cases = cases();
    let list = cases["cases"].as_array().unwrap();
    assert!(list.len() >= 15, "cases missing");
    let tmp = tempfile::tempdir().unwrap();
    for case in list {
        let name = str_of(case, "name");
        assert!(
            case["extra_args"]
                .as_array()
                .map(Vec::is_empty)
                .unwrap_or(true),
            "{name}: extra_args not handled here"
        );
        let out = tmp.path().join(name);
        merge::merge(&merge_options(case, &out), &NoProgress)
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        let expected = fixtures().join(str_of(case, "expected_dir"));
        assert!(out.join(unshard::manifest::MANIFEST).is_file(), "{name}");
        assert_eq!(files_of(&out), files_of(&expected), "{name}: file list");
        for f in files_of(&expected) {
            let a = std::fs::read(out.join(&f)).unwrap();
            let b = std::fs::read(expected.join(&f)).unwrap();
            assert!(a == b, "{name}: {f} differs from transformers' output");
        }
    }
}

#[test]
fn a_verl_directory_merges_without_base_using_its_huggingface_config() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    let opts = MergeOptions {
        checkpoint: sharded("llama_w3_ranks"),
        output: out.clone(),
        ..MergeOptions::default()
    };
    let outcome = merge::merge(&opts, &NoProgress).unwrap();
    assert!(outcome.config_from.is_some());
    // The huggingface/ directory is llama-bf16's config and tokenizer: the result is
    // the same as merging onto that base.
    let expected = fixtures().join("expected/llama_policy_into_llama-bf16");
    assert_eq!(files_of(&out), files_of(&expected));
    for f in files_of(&expected) {
        assert!(
            std::fs::read(out.join(&f)).unwrap() == std::fs::read(expected.join(&f)).unwrap(),
            "{f} differs"
        );
    }
}

/// Runs a merge that must fail, checks that it left nothing behind, and returns
/// the error.
fn failing_merge(case: &serde_json::Value) -> Error {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    let e = merge::merge(&merge_options(case, &out), &NoProgress)
        .err()
        .unwrap_or_else(|| panic!("{}: merged", str_of(case, "name")));
    assert!(
        files_of(tmp.path()).is_empty(),
        "{}: left {:?} behind",
        str_of(case, "name"),
        files_of(tmp.path())
    );
    e
}

#[test]
fn every_error_case_fails_naming_the_culprit_and_leaves_nothing() {
    let cases = cases();
    let mut seen = 0;
    for case in cases["error_cases"].as_array().unwrap() {
        let name = str_of(case, "name");
        let e = failing_merge(case);
        let msg = e.to_string();
        let hint = e.hint().unwrap_or_default();
        match name {
            "llama_w2_ranks_missing_rank" => {
                assert!(matches!(e, Error::Incomplete { .. }), "{name}: {e:?}");
                assert!(msg.contains("model_world_size_2_rank_1.pt"), "{msg}");
                assert!(hint.contains("every rank"), "{hint}");
            }
            "llama_w2_dcp_truncated" => {
                assert!(matches!(e, Error::Corrupt { .. }), "{name}: {e:?}");
                assert!(
                    msg.contains("__1_0.distcp") && msg.contains("truncated"),
                    "{msg}"
                );
                assert!(msg.contains("tensor 'model."), "{msg}");
            }
            "llama_w2_dcp_bad_metadata" => {
                assert!(matches!(e, Error::Pickle { .. }), "{name}: {e:?}");
                assert!(msg.contains(".metadata"), "{msg}");
            }
            "partial_w2_ranks" => {
                assert!(matches!(e, Error::Unsupported { .. }), "{name}: {e:?}");
                assert!(
                    msg.contains("'model.norm.weight'") && msg.contains("Partial placement"),
                    "{msg}"
                );
                assert!(hint.contains("Replicate()"), "{hint}");
            }
            "fsdp1_local_w2_ranks" => {
                assert!(matches!(e, Error::Unsupported { .. }), "{name}: {e:?}");
                assert!(
                    msg.contains("flat parameters") && msg.contains("_flat_param"),
                    "{msg}"
                );
                assert!(hint.contains("SHARDED_STATE_DICT"), "{hint}");
            }
            "accelerate_optimizer_only" => {
                assert!(matches!(e, Error::NoTensors { .. }), "{name}: {e:?}");
                assert!(
                    hint.contains("no model tensors") && hint.contains("optimizer"),
                    "{hint}"
                );
            }
            other => panic!("unknown error case {other}: {msg}"),
        }
        seen += 1;
    }
    assert_eq!(seen, 6);
}

#[test]
fn inspect_shows_how_each_tensor_is_sharded() {
    let hsdp = open(&sharded("llama_hsdp_2x2_ranks")).unwrap();
    let embed = hsdp
        .tensors
        .iter()
        .find(|t| t.name == "model.embed_tokens.weight")
        .unwrap();
    assert_eq!(embed.shape, [251, 64]);
    // Replicas are read once: two chunks from four ranks.
    assert_eq!(embed.pieces.len(), 2);
    let layout = embed.layout.as_deref().unwrap();
    assert!(
        layout.contains("(Replicate(), Shard(0))")
            && layout.contains("[2, 2]")
            && layout.contains("4 rank"),
        "{layout}"
    );

    let w3 = open(&sharded("llama_w3_dcp")).unwrap();
    let up = w3
        .tensors
        .iter()
        .find(|t| t.name == "model.layers.0.mlp.up_proj.weight")
        .unwrap();
    // 173 rows over 3 ranks: 58 + 58 + 57.
    let rows: Vec<u64> = up.pieces.iter().map(|p| p.shape[0]).collect();
    assert_eq!(rows, [58, 58, 57]);
    assert!(up
        .layout
        .as_deref()
        .unwrap()
        .contains("3 chunks split on dim 0"));

    let fsdp1 = open(&sharded("fsdp1_sharded_w2_ranks")).unwrap();
    assert!(fsdp1.tensors[0]
        .layout
        .as_deref()
        .unwrap()
        .starts_with("ShardedTensor"));
}

#[test]
fn dcp_byte_entries_and_optimizer_state_are_listed_not_merged() {
    let c = open(&sharded("llama_w2_dcp_with_optim")).unwrap();
    assert_eq!(c.tensors.len(), 21);
    let step = c.extras.iter().find(|e| e.name == "step").unwrap();
    assert_eq!(step.kind, "int 7");
    assert!(c.extras.iter().any(|e| e.name == "optim.param_groups.0.lr"));
    assert!(
        c.notes
            .iter()
            .any(|n| n.contains("optimizer state under 'optim'")),
        "{:?}",
        c.notes
    );

    let acc = open(&sharded("accelerate_dcp")).unwrap();
    assert!(
        acc.notes.iter().any(|n| n.contains("pytorch_model_fsdp_0")),
        "{:?}",
        acc.notes
    );
    assert!(
        acc.notes.iter().any(|n| n.contains("optimizer_0")),
        "{:?}",
        acc.notes
    );
}

/// Copies a fixture directory's files into `dst`, renaming with `rename`.
fn copy_dir(src: &Path, dst: &Path, rename: impl Fn(&str) -> Option<String>) {
    std::fs::create_dir_all(dst).unwrap();
    for f in files_of(src) {
        let from = src.join(&f);
        if from.is_file() {
            if let Some(to) = rename(&f) {
                std::fs::copy(&from, dst.join(to)).unwrap();
            }
        }
    }
}

#[test]
fn any_set_of_rank_files_merges_and_a_missing_one_is_named() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ckpt");
    copy_dir(&sharded("llama_w2_ranks"), &dir, |f| {
        f.strip_prefix("model_world_size_2_rank_")
            .map(|r| format!("policy_rank{r}"))
    });
    let c = open(&dir).unwrap();
    assert_eq!(c.format, Format::Ranks);
    assert_eq!(contents(&c), full_state("llama"));

    // Without a world size in the names, the mesh recorded in rank 0's file says
    // that rank 1 is missing.
    std::fs::remove_file(dir.join("policy_rank1.pt")).unwrap();
    let e = open(&dir).unwrap_err();
    assert!(matches!(e, Error::Incomplete { .. }), "{e:?}");
    assert!(e.to_string().contains("policy_rank1.pt"), "{e}");

    // ShardedTensors say which rank holds each shard.
    let fsdp1 = tmp.path().join("fsdp1");
    copy_dir(&sharded("fsdp1_sharded_w2_ranks"), &fsdp1, |f| {
        f.strip_prefix("model_world_size_2_")
            .filter(|r| *r == "rank_0.pt")
            .map(|r| format!("shard_{r}"))
    });
    let e = open(&fsdp1).unwrap_err();
    assert!(matches!(e, Error::Incomplete { .. }), "{e:?}");
    assert!(e.to_string().contains("shard_rank_1.pt"), "{e}");
}

#[test]
fn zero_padded_rank_numbers_are_read_and_missing_ones_named_alike() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ckpt");
    copy_dir(&sharded("llama_w3_ranks"), &dir, |f| {
        f.strip_prefix("model_world_size_3_rank_")
            .and_then(|r| r.strip_suffix(".pt"))
            .map(|r| format!("part_rank_{:03}.pt", r.parse::<u32>().unwrap()))
    });
    assert_eq!(contents(&open(&dir).unwrap()), full_state("llama"));

    std::fs::remove_file(dir.join("part_rank_002.pt")).unwrap();
    let e = open(&dir).unwrap_err();
    assert!(e.to_string().contains("part_rank_002.pt"), "{e}");

    // A gap in the middle is found from the names alone.
    std::fs::rename(dir.join("part_rank_001.pt"), dir.join("part_rank_002.pt")).unwrap();
    let e = open(&dir).unwrap_err();
    assert!(matches!(e, Error::Incomplete { .. }), "{e:?}");
    assert!(e.to_string().contains("part_rank_001.pt"), "{e}");
}

/// Renames storage record `key` of a `torch.save` zip in place (its name in the
/// local header and in the central directory), so the pickle's storage `key` is no
/// longer in the archive.
fn hide_storage(file: &Path, key: &str) {
    let mut bytes = std::fs::read(file).unwrap();
    let from = format!("/data/{key}");
    let to = format!("/data/{}", "Z".repeat(key.len()));
    let (from, to) = (from.as_bytes(), to.as_bytes());
    let mut hits = 0;
    let mut i = 0;
    while i + from.len() <= bytes.len() {
        // The name ends there: the next byte is not another digit of a longer key.
        let end = bytes
            .get(i + from.len())
            .is_none_or(|b| !b.is_ascii_digit());
        if &bytes[i..i + from.len()] == from && end {
            bytes[i..i + from.len()].copy_from_slice(to);
            hits += 1;
        }
        i += 1;
    }
    assert_eq!(hits, 2, "{}: record {key}", file.display());
    std::fs::write(file, bytes).unwrap();
}

#[test]
fn a_replica_whose_bytes_cannot_be_read_is_never_read() {
    // HSDP over a 2x2 mesh, (Replicate, Shard(0)): ranks 2 and 3 hold the same boxes
    // as ranks 0 and 1. Each rank's file is read and dropped before the next, its
    // local tensors kept as records; one whose storage record is missing is an error
    // only if its box is the one the merge reads.
    let tmp = tempfile::tempdir().unwrap();
    for (rank, fails) in [(2, false), (0, true)] {
        let dir = tmp.path().join(format!("hidden_in_{rank}"));
        copy_dir(&sharded("llama_hsdp_2x2_ranks"), &dir, |f| {
            f.ends_with(".pt").then(|| f.to_string())
        });
        hide_storage(&dir.join(format!("model_world_size_4_rank_{rank}.pt")), "0");
        match open(&dir) {
            Ok(c) => {
                assert!(!fails, "rank {rank}: opened");
                assert_eq!(contents(&c), full_state("llama"));
            }
            Err(e) => {
                assert!(fails, "rank {rank}: {e}");
                let msg = e.to_string();
                assert!(matches!(e, Error::BadTensor { .. }), "{e:?}");
                assert!(
                    msg.contains("model_world_size_4_rank_0.pt")
                        && msg.contains("storage '0' is missing"),
                    "{msg}"
                );
            }
        }
    }
}

#[test]
fn a_rank_file_from_another_run_is_named() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ckpt");
    copy_dir(&sharded("llama_w2_ranks"), &dir, |f| {
        (f == "model_world_size_2_rank_0.pt").then(|| f.to_string())
    });
    std::fs::copy(
        sharded("llama_w3_ranks/model_world_size_3_rank_1.pt"),
        dir.join("model_world_size_2_rank_1.pt"),
    )
    .unwrap();
    let e = open(&dir).unwrap_err();
    let msg = e.to_string();
    assert!(matches!(e, Error::BadTensor { .. }), "{e:?}");
    assert!(
        msg.contains("model_world_size_2_rank_1.pt") && msg.contains("local tensor"),
        "{msg}"
    );
}

#[test]
fn an_unknown_dcp_transform_is_named() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ckpt");
    copy_dir(&sharded("llama_w2_dcp_zstd"), &dir, |f| Some(f.to_string()));
    let meta = dir.join(".metadata");
    let bytes = std::fs::read(&meta).unwrap();
    let from = b"stream.zstd/1";
    let to = b"stream.lz4x/1";
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i..].starts_with(from) {
            out.extend_from_slice(to);
            i += from.len();
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    assert_ne!(out, bytes);
    std::fs::write(&meta, out).unwrap();
    let e = open(&dir).unwrap_err();
    assert!(matches!(e, Error::Unsupported { .. }), "{e:?}");
    let msg = e.to_string();
    assert!(
        msg.contains("stream.lz4x/1") && msg.contains(".distcp"),
        "{msg}"
    );
}

#[test]
fn damaged_sharded_checkpoints_never_panic() {
    let tmp = tempfile::tempdir().unwrap();
    // DCP: cut or scramble .metadata and a .distcp file at many places.
    for (fixture, file) in [
        ("llama_w2_dcp", ".metadata"),
        ("llama_w2_dcp", "__1_0.distcp"),
        ("llama_w2_dcp_zstd", "__0_0.distcp"),
        ("llama_hsdp_2x2_ranks", "model_world_size_4_rank_2.pt"),
        ("fsdp1_sharded_w2_ranks", "model_world_size_2_rank_1.pt"),
    ] {
        let dir = tmp.path().join(fixture);
        copy_dir(&sharded(fixture), &dir, |f| Some(f.to_string()));
        let original = std::fs::read(dir.join(file)).unwrap();
        let len = original.len();
        let step = (len / 40).max(1);
        let mut refused = 0;
        for cut in (0..len).step_by(step) {
            std::fs::write(dir.join(file), &original[..cut]).unwrap();
            refused += !opens_and_reads_or_names(&dir, fixture) as usize;
        }
        // A rank file cut short loses tensors the metadata lists: refused at open
        // or at read, never accepted whole.
        assert_eq!(
            refused,
            len.div_ceil(step),
            "{fixture}/{file}: some cut was accepted"
        );
        let mut seed: u64 = 0x9e37_79b9_7f4a_7c15;
        for _ in 0..60 {
            let mut damaged = original.clone();
            for _ in 0..4 {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                let at = (seed % len as u64) as usize;
                damaged[at] ^= (seed >> 32) as u8 | 1;
            }
            std::fs::write(dir.join(file), &damaged).unwrap();
            opens_and_reads_or_names(&dir, fixture);
        }
        std::fs::write(dir.join(file), &original).unwrap();
    }
}

/// Opens `dir` and reads every tensor: true when all of it reads (each tensor as
/// many bytes as its shape says), false when opening or a read fails with an error
/// that names the checkpoint (`fixture` is part of its path).
fn opens_and_reads_or_names(dir: &Path, fixture: &str) -> bool {
    let c = match open(dir) {
        Ok(c) => c,
        Err(e) => {
            assert!(e.to_string().contains(fixture), "{e}");
            return false;
        }
    };
    let mut all = true;
    for t in &c.tensors {
        match read_tensor(&c.files, t, t.dtype) {
            Ok((bytes, _)) => assert_eq!(bytes.len() as u64, t.nbytes(), "{}", t.name),
            Err(e) => {
                assert!(e.to_string().contains(fixture), "{}: {e}", t.name);
                all = false;
            }
        }
    }
    all
}

fn piece(offset: &[u64], shape: &[u64]) -> Piece {
    Piece {
        file: 0,
        byte_offset: 0,
        dtype: DType::F32,
        shape: shape.to_vec(),
        strides: vec![1; shape.len()],
        global_offset: offset.to_vec(),
        big_endian: false,
    }
}

fn tensor(shape: &[u64], pieces: Vec<Piece>) -> TensorSource {
    TensorSource {
        name: "w".into(),
        dtype: DType::F32,
        shape: shape.to_vec(),
        pieces: pieces.into(),
        storage: None,
        layout: None,
    }
}

fn coverage(shape: &[u64], pieces: Vec<Piece>) -> Result<(), String> {
    check_coverage(Path::new("ckpt"), &tensor(shape, pieces)).map_err(|e| e.to_string())
}

#[test]
fn coverage_accepts_exact_tilings_including_empty_shards() {
    // Uneven rows with an empty last shard (torch.chunk of 5 over 4).
    let rows = vec![
        piece(&[0, 0], &[2, 3]),
        piece(&[2, 0], &[2, 3]),
        piece(&[4, 0], &[1, 3]),
        piece(&[5, 0], &[0, 3]),
    ];
    assert_eq!(coverage(&[5, 3], rows), Ok(()));
    // A 2-D grid of blocks.
    let grid = vec![
        piece(&[0, 0], &[2, 2]),
        piece(&[0, 2], &[2, 1]),
        piece(&[2, 0], &[1, 2]),
        piece(&[2, 2], &[1, 1]),
    ];
    assert_eq!(coverage(&[3, 3], grid), Ok(()));
    assert_eq!(coverage(&[], vec![piece(&[], &[])]), Ok(()));
    assert_eq!(coverage(&[0, 4], vec![]), Ok(()));
}

#[test]
fn coverage_rejects_gaps_overlaps_and_chunks_out_of_bounds() {
    let gap = coverage(
        &[5, 3],
        vec![piece(&[0, 0], &[2, 3]), piece(&[3, 0], &[2, 3])],
    )
    .unwrap_err();
    assert!(
        gap.contains("'w'") && gap.contains("cover 12 of its 15"),
        "{gap}"
    );

    // Same volume as the tensor, but two chunks share row 2 and row 4 is missing.
    let overlap = coverage(
        &[5, 3],
        vec![
            piece(&[0, 0], &[3, 3]),
            piece(&[2, 0], &[1, 3]),
            piece(&[3, 0], &[1, 3]),
        ],
    )
    .unwrap_err();
    assert!(
        overlap.contains("overlap") && overlap.contains("2..3, 0..3"),
        "{overlap}"
    );

    let past = coverage(
        &[5, 3],
        vec![piece(&[0, 0], &[4, 3]), piece(&[4, 0], &[2, 3])],
    )
    .unwrap_err();
    assert!(past.contains("past the end of dimension 0"), "{past}");

    let huge = coverage(&[5], vec![piece(&[u64::MAX], &[2])]).unwrap_err();
    assert!(huge.contains("past the end"), "{huge}");

    let dims = coverage(&[5, 3], vec![piece(&[0], &[15])]).unwrap_err();
    assert!(dims.contains("2 dimension"), "{dims}");

    let twice = coverage(&[], vec![piece(&[], &[]), piece(&[], &[])]).unwrap_err();
    assert!(twice.contains("overlap"), "{twice}");
}
