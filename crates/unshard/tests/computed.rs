//! Computed tensors: a mapping that turns tensors of a real checkpoint into
//! concatenated, row-permuted and narrowed outputs. The values written are checked
//! against the fixture's own bytes rearranged here by hand (read with the
//! `safetensors` crate, not unshard's reader), and `verify` must catch a computed
//! tensor that holds other values than its expression gives.
#![allow(clippy::unwrap_used)]

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use unshard::merge::{self, MergeOptions};
use unshard::plan::{Candidate, DtypeChoice, Expr, MapInputs, Mapping, Origin, PlanOptions};
use unshard::write::NoProgress;
use unshard::{DType, VerifyOptions};

const Q: &str = "model.layers.0.self_attn.q_proj.weight";
const K: &str = "model.layers.0.self_attn.k_proj.weight";
const V: &str = "model.layers.0.self_attn.v_proj.weight";
const QKV: &str = "model.layers.0.self_attn.qkv_proj.weight";
const GATE: &str = "model.layers.0.mlp.gate_proj.weight";
const UP: &str = "model.layers.0.mlp.up_proj.weight";

fn model() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/models/llama-bf16")
}

/// Joins q, k and v of layer 0 into one tensor, reverses the rows of its gate
/// projection (or rotates them by `shift`), and keeps columns 1..4 of its up
/// projection.
#[derive(Debug)]
struct Remap {
    shift: u64,
}

impl Mapping for Remap {
    fn map(
        &self,
        candidates: Vec<Candidate>,
        _inputs: MapInputs<'_>,
    ) -> unshard::Result<Vec<Candidate>> {
        let mut by_name: HashMap<String, Candidate> = candidates
            .iter()
            .map(|c| (c.name.clone(), c.clone()))
            .collect();
        let mut leaf = |n: &str| {
            let c = by_name.remove(n).unwrap();
            match c.content {
                unshard::plan::Content::Copy(s) => Expr::leaf(Origin::Checkpoint, s),
                unshard::plan::Content::Computed(e) => e,
            }
        };
        let qkv = Expr::Concat {
            dim: 0,
            parts: vec![leaf(Q), leaf(K), leaf(V)],
        };
        let gate = leaf(GATE);
        let rows = 173u64;
        let order: Vec<u64> = (0..rows)
            .map(|i| (rows - 1 - i + self.shift) % rows)
            .collect();
        let gate = Expr::PermuteRows {
            rows: order,
            input: Box::new(gate),
        };
        let up = Expr::Slice {
            dim: 1,
            start: 1,
            len: 3,
            input: Box::new(leaf(UP)),
        };
        let mut out: Vec<Candidate> = candidates
            .into_iter()
            .filter(|c| by_name.contains_key(&c.name))
            .collect();
        out.push(Candidate::computed(QKV, Q, Origin::Checkpoint, qkv)?);
        out.push(Candidate::computed(GATE, GATE, Origin::Checkpoint, gate)?);
        out.push(Candidate::computed(UP, UP, Origin::Checkpoint, up)?);
        Ok(out)
    }
}

fn options(out: &Path, shift: u64) -> MergeOptions {
    MergeOptions {
        // The weights file alone: the directory's config.json would be used as the
        // config, and the remapped tensors are no Llama the config describes.
        checkpoint: model().join("model.safetensors"),
        output: out.to_path_buf(),
        plan: PlanOptions {
            dtype: DtypeChoice::Fixed(DType::BF16),
            mappings: vec![Arc::new(Remap { shift })],
            ..PlanOptions::default()
        },
        weights_only: true,
        ..MergeOptions::default()
    }
}

/// A tensor of a safetensors file: shape and bytes.
fn tensor(file: &Path, name: &str) -> (Vec<usize>, Vec<u8>) {
    let bytes = std::fs::read(file).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let t = st.tensor(name).unwrap();
    (t.shape().to_vec(), t.data().to_vec())
}

/// The expected bytes, rearranged from the fixture's bf16 bytes (bf16 -> float32
/// -> bf16 is exact, so the output holds the same bytes in the new places).
fn expected(name: &str) -> (Vec<usize>, Vec<u8>) {
    let src = model().join("model.safetensors");
    match name {
        QKV => {
            let (mut data, mut rows) = (Vec::new(), 0);
            for n in [Q, K, V] {
                let (s, d) = tensor(&src, n);
                rows += s[0];
                data.extend(d);
            }
            (vec![rows, 64], data)
        }
        GATE => {
            let (s, d) = tensor(&src, GATE);
            let row = s[1] * 2;
            let data = (0..s[0])
                .rev()
                .flat_map(|r| d[r * row..(r + 1) * row].to_vec())
                .collect();
            (s, data)
        }
        UP => {
            let (s, d) = tensor(&src, UP);
            let data = (0..s[0])
                .flat_map(|r| d[r * s[1] * 2 + 2..r * s[1] * 2 + 8].to_vec())
                .collect();
            (vec![s[0], 3], data)
        }
        _ => tensor(&src, name),
    }
}

#[test]
fn concat_permute_and_slice_are_written_with_the_values_they_compute() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let outcome = merge::merge(&options(&out, 0), &NoProgress).unwrap();
    let file = out.join("model.safetensors");
    let bytes = std::fs::read(&file).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut names: Vec<String> = st.names().into_iter().map(str::to_string).collect();
    names.sort();
    assert!(names.contains(&QKV.to_string()));
    assert!(!names.contains(&Q.to_string()) && !names.contains(&K.to_string()));
    for n in &names {
        let t = st.tensor(n).unwrap();
        assert_eq!(t.dtype(), safetensors::Dtype::BF16, "{n}");
        let (shape, data) = expected(n);
        assert_eq!(t.shape(), shape.as_slice(), "{n}");
        assert!(t.data() == data.as_slice(), "{n}: values differ");
    }
    assert_eq!(outcome.tensors_written, names.len());
    // The outcome's JSON says what was written.
    let json = serde_json::to_value(&outcome).unwrap();
    assert_eq!(json["tensors_written"], names.len());
    assert_eq!(json["files"][0], "model.safetensors");
    assert_eq!(json["checkpoint_format"], "safetensors");

    // verify re-derives the same plan and finds every value in place.
    let report = unshard::verify(
        &VerifyOptions::of_merge(&options(&out, 0), &out),
        &NoProgress,
    )
    .unwrap();
    assert!(report.is_ok(), "{:?}", report.findings());
    assert_eq!(report.tensors_compared, names.len());
    // Every tensor's bytes were compared: the data of each, as the file holds it.
    let data: usize = names
        .iter()
        .map(|n| st.tensor(n).unwrap().data().len())
        .sum();
    assert_eq!(report.bytes_compared, data as u64);
}

#[test]
fn verify_catches_a_computed_tensor_with_other_values() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    merge::merge(&options(&out, 0), &NoProgress).unwrap();
    // The same merge with the gate's rows rotated by one is not what was written.
    let report = unshard::verify(
        &VerifyOptions::of_merge(&options(&out, 1), &out),
        &NoProgress,
    )
    .unwrap();
    let bad: Vec<&str> = report.mismatches.iter().map(|m| m.name.as_str()).collect();
    assert_eq!(bad, [GATE], "{:?}", report.findings());
    assert!(report.problems.is_empty());

    // And a byte changed inside the concatenation, where k begins.
    let file = out.join("model.safetensors");
    let mut bytes = std::fs::read(&file).unwrap();
    let (start, _) = {
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let t = st.tensor(QKV).unwrap();
        let at = t.data().as_ptr() as usize - bytes.as_ptr() as usize;
        (at + 64 * 64 * 2, ())
    };
    bytes[start + 1] ^= 0x40;
    std::fs::write(&file, &bytes).unwrap();
    let report = unshard::verify(
        &VerifyOptions::of_merge(&options(&out, 0), &out),
        &NoProgress,
    )
    .unwrap();
    assert_eq!(report.mismatches.len(), 1, "{:?}", report.findings());
    let m = &report.mismatches[0];
    assert_eq!((m.name.as_str(), m.differing), (QKV, 1));
    assert_eq!(m.first.map(|f| f.index), Some(64 * 64));
}
