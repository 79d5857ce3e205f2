//! The fuse against peft's own merge, tensor by tensor.
//!
//! `fixtures/lora/` (written by `fixtures/gen_lora.py` with peft 0.21.2) holds
//! adapters and training checkpoints of peft-wrapped models, and for each the
//! directory peft's `merge_and_unload()` gives on a float32 copy of the base, cast
//! once to the base's dtype. Each adapted weight computed by unshard's float32 fuse
//! must be within one ulp of peft's in the output dtype, and so must verify's
//! float64 reference evaluation. Expected bytes are read with the `safetensors` crate.
#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};

use unshard::lora::eval::{fused_f32, read_f32};
use unshard::lora::reference::{evaluate, Operands};
use unshard::lora::{input, AdapterInput, AdapterOptions};
use unshard::merge::Base;
use unshard::source::{self, OpenOptions};
use unshard::DType;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures")
}

fn cases() -> serde_json::Value {
    let text = std::fs::read_to_string(fixtures().join("lora/cases.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn arg(case: &serde_json::Value, flag: &str) -> Option<String> {
    let args: Vec<String> = case["extra_args"]
        .as_array()
        .map(|a| a.iter().map(|v| v.as_str().unwrap().to_string()).collect())
        .unwrap_or_default();
    args.iter()
        .position(|a| a == flag)
        .map(|i| args[i + 1].clone())
}

fn open_adapter(case: &serde_json::Value, base: &Path) -> unshard::Result<AdapterInput> {
    let path = fixtures().join(case["adapter"].as_str().unwrap());
    let opts = AdapterOptions {
        name: arg(case, "--adapter"),
        config: arg(case, "--adapter-config").map(|p| fixtures().join(p)),
        ..AdapterOptions::default()
    };
    if unshard::lora::locate::is_adapter_dir(&path) {
        input::open_dir(&path, &opts, &OpenOptions::default())
    } else {
        let ckpt = source::open(&path, &OpenOptions::default())?;
        input::from_checkpoint(ckpt, Some(base), &opts)
    }
}

fn st_dtype(d: safetensors::Dtype) -> DType {
    match d {
        safetensors::Dtype::BF16 => DType::BF16,
        safetensors::Dtype::F16 => DType::F16,
        safetensors::Dtype::F32 => DType::F32,
        other => panic!("unexpected dtype {other:?}"),
    }
}

fn decode(bytes: &[u8], dtype: DType) -> Vec<f64> {
    let size = dtype.size();
    bytes
        .chunks_exact(size)
        .map(|c| unshard::stats::element_f64(c, dtype))
        .collect()
}

/// The value `x` takes in `dtype` (round to nearest even, as torch's cast).
fn cast(x: &[f32], dtype: DType) -> Vec<f64> {
    let src: Vec<u8> = x.iter().flat_map(|v| v.to_le_bytes()).collect();
    let mut dst = vec![0u8; x.len() * dtype.size()];
    unshard::dtype::convert(&src, DType::F32, &mut dst, dtype);
    decode(&dst, dtype)
}

/// Distance in representable values of `dtype` between two values of it.
fn ulps(a: f64, b: f64, dtype: DType) -> u64 {
    let step = unshard::lora::reference::ulp(dtype, a.abs().min(b.abs()));
    ((a - b).abs() / step).round() as u64
}

#[test]
fn every_case_fuses_within_one_ulp_of_peft() {
    let all = cases();
    let mut checked = 0;
    for case in all["cases"].as_array().unwrap() {
        let name = case["name"].as_str().unwrap();
        let base_dir = fixtures().join(case["base"].as_str().unwrap());
        let base = Base::open(&base_dir).unwrap();
        let base_w = base.weights.as_ref().unwrap();
        let adapter = open_adapter(case, &base_dir).unwrap_or_else(|e| panic!("{name}: {e}"));
        let expected_dir = fixtures().join(case["expected_dir"].as_str().unwrap());
        let bytes = std::fs::read(expected_dir.join("model.safetensors")).unwrap();
        let expected = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        assert!(!adapter.resolved.fuses.is_empty(), "{name}");
        for fuse in &adapter.resolved.fuses {
            // The weight: the checkpoint's frozen copy if it has one, else the base's.
            let (files, w) = match adapter
                .resolved
                .tensors
                .iter()
                .find(|t| t.name == fuse.target)
            {
                Some(t) if !adapter.from_dir => (&adapter.checkpoint.files, t),
                _ => (
                    &base_w.files,
                    base_w
                        .tensors
                        .iter()
                        .find(|t| t.name == fuse.target)
                        .unwrap(),
                ),
            };
            let fused = fused_f32(fuse, files, w, &adapter.checkpoint.files).unwrap();
            let view = expected.tensor(&fuse.target).unwrap();
            let dtype = st_dtype(view.dtype());
            let peft = decode(view.data(), dtype);
            let ours = cast(&fused, dtype);
            let worst = ours
                .iter()
                .zip(&peft)
                .map(|(&a, &b)| ulps(a, b, dtype))
                .max()
                .unwrap();
            assert!(
                worst <= 1,
                "{name}: {} is {worst} ulp from peft",
                fuse.target
            );

            // verify's own float64 evaluation, with its tolerance.
            let to64 = |v: Vec<f32>| v.into_iter().map(f64::from).collect::<Vec<_>>();
            let wv = to64(read_f32(files, w).unwrap());
            let a = to64(read_f32(&adapter.checkpoint.files, &fuse.a).unwrap());
            let b = to64(read_f32(&adapter.checkpoint.files, &fuse.b).unwrap());
            let m = fuse
                .magnitude
                .as_ref()
                .map(|m| to64(read_f32(&adapter.checkpoint.files, m).unwrap()));
            let reference = evaluate(&Operands {
                layout: fuse.layout_for(&w.shape).unwrap(),
                w: &wv,
                rows: w.shape[0] as usize,
                cols: w.shape[1] as usize,
                a: &a,
                b: &b,
                rank: fuse.rank as usize,
                scale: fuse.scale,
                dora_magnitude: m.as_deref(),
            });
            for (i, &p) in peft.iter().enumerate() {
                assert!(
                    reference.allows(i, p, dtype),
                    "{name}: {}[{i}]: peft {p}, reference {}",
                    fuse.target,
                    reference.values[i]
                );
            }
            checked += 1;
        }
    }
    assert!(checked >= 60, "only {checked} fused weights checked");
}

#[test]
fn error_cases_name_what_is_wrong() {
    let all = cases();
    for case in all["error_cases"].as_array().unwrap() {
        let name = case["name"].as_str().unwrap();
        let base_dir = fixtures().join(case["base"].as_str().unwrap());
        let err = open_adapter(case, &base_dir).unwrap_err().to_string();
        let want = case["error"].as_str().unwrap();
        assert!(
            err.contains(want),
            "{name}: {err:?} does not mention {want:?}"
        );
    }
}

/// The library's errors about adapters speak of its options, never of flags.
#[test]
fn adapter_error_hints_name_library_options() {
    let all = cases();
    let mut with_options = 0;
    for case in all["error_cases"].as_array().unwrap() {
        let base_dir = fixtures().join(case["base"].as_str().unwrap());
        let err = open_adapter(case, &base_dir).unwrap_err();
        let text = format!("{err} {}", err.hint().unwrap_or_default());
        assert!(!text.contains("--"), "{}: {text}", case["name"]);
        with_options +=
            usize::from(text.contains("`config` option") || text.contains("`name` option"));
    }
    assert!(with_options >= 2, "{with_options}");
}

/// `--no-fuse` from a training checkpoint writes what peft's own `save_pretrained`
/// wrote for the same adapter: the same names, the same bytes, the same config.
#[test]
fn exported_adapter_equals_what_peft_saved() {
    for (train, saved) in [
        (
            "lora/train/llama_modules_to_save_pt/policy.pt",
            "lora/adapters/llama_modules_to_save",
        ),
        (
            "lora/train/llama_dora_pt/policy.pt",
            "lora/adapters/llama_dora",
        ),
        (
            "lora/train/llama_lora_pt/policy.pt",
            "lora/adapters/llama_lora",
        ),
    ] {
        let ckpt = source::open(&fixtures().join(train), &OpenOptions::default()).unwrap();
        let input = input::from_checkpoint(ckpt, None, &AdapterOptions::default()).unwrap();
        let dir = tempfile::tempdir().unwrap();
        unshard::lora::export::write_adapter_dir(
            dir.path(),
            &input.resolved,
            &input.checkpoint.files,
        )
        .unwrap();
        let ours = std::fs::read(dir.path().join("adapter_model.safetensors")).unwrap();
        let ours = safetensors::SafeTensors::deserialize(&ours).unwrap();
        let peft = std::fs::read(fixtures().join(saved).join("adapter_model.safetensors")).unwrap();
        let peft = safetensors::SafeTensors::deserialize(&peft).unwrap();
        let mut names = ours.names();
        names.sort();
        let mut want = peft.names();
        want.sort();
        assert_eq!(names, want, "{train}");
        for n in names {
            let (a, b) = (ours.tensor(n).unwrap(), peft.tensor(n).unwrap());
            assert_eq!(
                (a.dtype(), a.shape(), a.data()),
                (b.dtype(), b.shape(), b.data()),
                "{train}: {n}"
            );
        }
        let cfg = |p: &Path| -> serde_json::Value {
            serde_json::from_slice(&std::fs::read(p).unwrap()).unwrap()
        };
        let ours = cfg(&dir.path().join("adapter_config.json"));
        let theirs = cfg(&fixtures()
            .join(train)
            .parent()
            .unwrap()
            .join("adapter_config.json"));
        assert_eq!(ours, theirs, "{train}");
        assert_ne!(ours["lora_alpha"], serde_json::json!(0));
    }
}
