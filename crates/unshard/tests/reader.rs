//! Reading real torch.save files: every tensor's bytes must equal what torch holds.
//!
//! The fixtures in `fixtures/torch/` were written by torch itself
//! (`fixtures/gen_torch_files.py`). Next to each `X.pt`, `X.expected.safetensors`
//! holds the tensors as torch sees them (`.contiguous()`, saved by the safetensors
//! package) and `X.expected.json` the names, dtypes, shapes, the key the state dict
//! sits under, the non-tensor entries and the groups of names sharing a storage.
//! The expected bytes are read with the `safetensors` crate, not with unshard.
#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::sync::Arc;

use unshard::source::{self, Blob, OpenOptions};
use unshard::write::read_tensor;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures")
}

fn expected_cases() -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(fixtures().join("torch"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.to_string_lossy().ends_with(".expected.json"))
        .collect();
    v.sort();
    assert!(v.len() >= 10, "fixtures missing: {v:?}");
    v
}

fn checkpoint_for(json: &Path) -> PathBuf {
    let s = json.to_string_lossy().replace(".expected.json", ".pt");
    PathBuf::from(s)
}

#[test]
fn every_fixture_reads_as_torch_sees_it() {
    for json_path in expected_cases() {
        let pt = checkpoint_for(&json_path);
        let expected: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&json_path).unwrap()).unwrap();
        let local = source::open(&pt, &OpenOptions::default())
            .unwrap_or_else(|e| panic!("{}: {e}", pt.display()));
        // The same file held in memory goes through the same readers, by the
        // byte-source seam, and must read the same.
        let held = Arc::new(Blob::owned(pt.clone(), std::fs::read(&pt).unwrap()));
        let in_memory = source::open_blob(held, &OpenOptions::default())
            .unwrap_or_else(|e| panic!("{} in memory: {e}", pt.display()));
        for ckpt in [local, in_memory] {
            check_as_torch_sees_it(&ckpt, &expected, &pt, &json_path);
        }
    }
}

/// Checks a checkpoint read from `pt` against what torch saw (`expected`).
fn check_as_torch_sees_it(
    ckpt: &source::Checkpoint,
    expected: &serde_json::Value,
    pt: &Path,
    json_path: &Path,
) {
    {
        // Where the tensors were found.
        assert_eq!(
            ckpt.key.as_deref(),
            expected["key"].as_str(),
            "{}: key",
            pt.display()
        );

        // Exactly the tensors torch sees, in its order, with its dtypes and shapes.
        let want: Vec<(String, String, Vec<u64>)> = expected["tensors"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| {
                (
                    t["name"].as_str().unwrap().to_string(),
                    t["dtype"].as_str().unwrap().to_string(),
                    t["shape"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .map(|d| d.as_u64().unwrap())
                        .collect(),
                )
            })
            .collect();
        let got: Vec<(String, String, Vec<u64>)> = ckpt
            .tensors
            .iter()
            .map(|t| {
                (
                    t.name.clone(),
                    t.dtype.safetensors_name().to_string(),
                    t.shape.clone(),
                )
            })
            .collect();
        assert_eq!(got, want, "{}: tensor list", pt.display());

        // Non-tensor entries are listed, not dropped silently.
        for extra in expected["non_tensor"].as_array().unwrap() {
            let name = extra.as_str().unwrap();
            assert!(
                ckpt.extras.iter().any(|e| e.name == name),
                "{}: non-tensor entry {name} not listed in {:?}",
                pt.display(),
                ckpt.extras
            );
        }

        // Tensors viewing one storage are known to share it.
        if let Some(groups) = expected["shared"].as_array() {
            for g in groups {
                let ids: Vec<_> = g
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|n| {
                        let n = n.as_str().unwrap();
                        ckpt.tensors
                            .iter()
                            .find(|t| t.name == n)
                            .unwrap()
                            .storage
                            .clone()
                    })
                    .collect();
                assert!(ids[0].is_some(), "{}: no storage id", pt.display());
                assert!(
                    ids.iter().all(|i| *i == ids[0]),
                    "{}: {g} should share a storage",
                    pt.display()
                );
            }
        }

        // The bytes unshard reads equal torch's, tensor by tensor.
        let st_path = json_path
            .to_string_lossy()
            .replace(".expected.json", ".expected.safetensors");
        let st_bytes = std::fs::read(&st_path).unwrap();
        let st = safetensors::SafeTensors::deserialize(&st_bytes).unwrap();
        for t in &ckpt.tensors {
            let view = st.tensor(&t.name).unwrap();
            let (bytes, _) = read_tensor(&ckpt.files, t, t.dtype).unwrap();
            assert_eq!(
                bytes,
                view.data(),
                "{}: bytes of '{}'",
                pt.display(),
                t.name
            );
        }
    }
}

#[test]
fn picks_the_state_dict_named_by_key() {
    let ckpt = source::open(
        &fixtures().join("torch/nested.pt"),
        &OpenOptions {
            key: Some("model.module".into()),
        },
    )
    .unwrap();
    assert_eq!(ckpt.key.as_deref(), Some("model.module"));
    let e = source::open(
        &fixtures().join("torch/dpo_policy.pt"),
        &OpenOptions {
            key: Some("nope".into()),
        },
    )
    .unwrap_err();
    let msg = e.to_string();
    assert!(
        msg.contains("nope") && msg.contains("dpo_policy.pt"),
        "{msg}"
    );
    assert!(e.hint().unwrap().contains("state"), "{:?}", e.hint());
}

#[test]
fn safetensors_and_model_directories_read_too() {
    let st = source::open(
        &fixtures().join("torch/dpo_policy.safetensors"),
        &OpenOptions::default(),
    )
    .unwrap();
    assert_eq!(st.format, source::Format::Safetensors);
    let pt = source::open(
        &fixtures().join("torch/dpo_policy.pt"),
        &OpenOptions::default(),
    )
    .unwrap();
    for t in &pt.tensors {
        let s = st.tensors.iter().find(|x| x.name == t.name).unwrap();
        assert_eq!(
            read_tensor(&st.files, s, s.dtype).unwrap().0,
            read_tensor(&pt.files, t, t.dtype).unwrap().0
        );
    }
    for dir in [
        "llama-bf16",
        "llama-bf16-sharded",
        "llama-fp32-bin",
        "qwen2-fp16-sharded",
    ] {
        let c = source::open(
            &fixtures().join("models").join(dir),
            &OpenOptions::default(),
        )
        .unwrap();
        assert_eq!(c.format, source::Format::HfDir, "{dir}");
        assert!(
            c.tensors
                .iter()
                .any(|t| t.name == "model.embed_tokens.weight"),
            "{dir}"
        );
    }
}

/// Every prefix of a real file is an error, never a panic.
#[test]
fn truncated_files_are_errors_at_every_length() {
    let dir = tempfile::tempdir().unwrap();
    for name in [
        "dpo_policy.pt",
        "dtypes_legacy.pt",
        "dpo_policy.safetensors",
    ] {
        let bytes = std::fs::read(fixtures().join("torch").join(name)).unwrap();
        let step = (bytes.len() / 300).max(1);
        for n in (0..bytes.len()).step_by(step) {
            let p = dir.path().join(format!("cut-{n}-{name}"));
            std::fs::write(&p, &bytes[..n]).unwrap();
            match source::open(&p, &OpenOptions::default()) {
                Ok(c) => {
                    // A cut that leaves a parsable prefix must still not read out of bounds.
                    for t in &c.tensors {
                        let _ = read_tensor(&c.files, t, t.dtype);
                    }
                }
                Err(e) => assert!(e.to_string().contains(&format!("cut-{n}-")), "{e}"),
            }
            std::fs::remove_file(&p).unwrap();
        }
    }
}

/// Flipping bytes anywhere in a real file never panics or reads out of bounds.
#[test]
fn corrupted_bytes_never_panic() {
    let dir = tempfile::tempdir().unwrap();
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    for name in [
        "dpo_policy.pt",
        "views_legacy.pt",
        "dtypes.pt",
        "dpo_policy.safetensors",
    ] {
        let orig = std::fs::read(fixtures().join("torch").join(name)).unwrap();
        for i in 0..300 {
            let mut bytes = orig.clone();
            for _ in 0..1 + i % 4 {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let at = (x % bytes.len() as u64) as usize;
                bytes[at] = (x >> 32) as u8;
            }
            let p = dir.path().join(name);
            std::fs::write(&p, &bytes).unwrap();
            if let Ok(c) = source::open(&p, &OpenOptions::default()) {
                for t in &c.tensors {
                    let _ = read_tensor(&c.files, t, t.dtype);
                }
            }
        }
    }
}

/// torch on a big-endian machine writes `byteorder = big` and byte-swapped storages;
/// the values read must be the same numbers.
#[test]
fn big_endian_archives_are_byte_swapped() {
    let ckpt = source::open(
        &fixtures().join("edge/bigendian.pt"),
        &OpenOptions::default(),
    )
    .unwrap();
    let bytes = std::fs::read(fixtures().join("edge/bigendian.expected.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    assert_eq!(ckpt.tensors.len(), st.len());
    for t in &ckpt.tensors {
        let (got, _) = read_tensor(&ckpt.files, t, t.dtype).unwrap();
        assert_eq!(got, st.tensor(&t.name).unwrap().data(), "{}", t.name);
    }
}

/// Tensors unshard cannot represent are refused with an error naming the key.
#[test]
fn unsupported_tensor_kinds_name_the_key() {
    for (kind, says) in [
        ("quantized", "quantized"),
        ("sparse", "sparse"),
        ("nested", "nested"),
        ("meta", "meta"),
        ("neg", "neg"),
        ("complex", "complex"),
    ] {
        let p = fixtures().join(format!("edge/unsupported_{kind}.pt"));
        let e = source::open(&p, &OpenOptions::default())
            .unwrap_err()
            .to_string();
        assert!(e.contains("'bad'") && e.contains(says), "{kind}: {e}");
        assert!(e.contains(&format!("unsupported_{kind}.pt")), "{e}");
    }
    let e = source::open(
        &fixtures().join("edge/torchscript.pt"),
        &OpenOptions::default(),
    )
    .unwrap_err();
    assert!(e.to_string().contains("TorchScript"), "{e}");
    assert!(e.hint().unwrap().contains("state_dict"));
}
