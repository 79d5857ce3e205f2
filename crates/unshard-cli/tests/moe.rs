//! Mixture-of-experts checkpoints in transformers' in-memory layout, merged onto
//! bases in the layout of transformers' files, against what transformers itself
//! writes.
//!
//! `fixtures/moe/cases.json` (`fixtures/gen_moe.py`, transformers 5.25) lists per
//! family a DPO-style `policy.pt` of `model.state_dict()` (packed expert tensors),
//! FSDP2 DCP directories whose packed tensors are sharded on the expert dimension,
//! and a DeepSpeed ZeRO-3 save; the expected directory is transformers' own
//! `from_pretrained` -> `load_state_dict` -> `save_pretrained`. Every case must
//! reproduce it file for file and byte for byte, and `unshard verify` must pass on
//! it and name a flipped byte in an expert tensor.
#![allow(clippy::unwrap_used)]

mod common;

use std::path::{Path, PathBuf};
use std::process::Output;

use common::{fixtures, model_names, names, text};

fn unshard<S: AsRef<std::ffi::OsStr>>(args: &[S]) -> Output {
    common::unshard_in(&fixtures(), args)
}

/// A safetensors file of one float32 tensor of `shape`, every element `value`.
fn one_f32_tensor(path: &Path, name: &str, shape: &[usize], value: f32) {
    let n: usize = shape.iter().product();
    let bytes: Vec<u8> = std::iter::repeat_n(value.to_le_bytes(), n)
        .flatten()
        .collect();
    let view =
        safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape.to_vec(), &bytes)
            .unwrap();
    safetensors::serialize_to_file([(name, view)], None, path).unwrap();
}

struct Case {
    name: String,
    checkpoint: String,
    base: String,
    expected_dir: PathBuf,
    /// `--layout packed|original`, for the cases of the packed layout.
    extra_args: Vec<String>,
}

impl Case {
    /// A case of the packed layout: an option, or a base whose files are packed.
    fn packed_layout(&self) -> bool {
        !self.extra_args.is_empty() || self.base.contains("base_packed")
    }
}

fn cases() -> Vec<Case> {
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixtures().join("moe/cases.json")).unwrap())
            .unwrap();
    json["cases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| Case {
            name: c["name"].as_str().unwrap().into(),
            checkpoint: c["checkpoint"].as_str().unwrap().into(),
            base: c["base"].as_str().unwrap().into(),
            expected_dir: fixtures().join(c["expected_dir"].as_str().unwrap()),
            extra_args: c["extra_args"]
                .as_array()
                .map(|a| a.iter().map(|x| x.as_str().unwrap().to_string()).collect())
                .unwrap_or_default(),
        })
        .collect()
}

fn merge(c: &Case, out: &Path) -> Output {
    let mut args = vec![
        "merge",
        &c.checkpoint,
        "--base",
        &c.base,
        "--output",
        out.to_str().unwrap(),
    ];
    args.extend(c.extra_args.iter().map(String::as_str));
    unshard(&args)
}

/// The merge succeeds and writes exactly transformers' files.
fn assert_matches_transformers(c: &Case, out: &Path) -> String {
    let o = merge(c, out);
    assert!(o.status.success(), "{}: {}", c.name, text(&o));
    assert_eq!(
        model_names(out),
        names(&c.expected_dir),
        "{}: files",
        c.name
    );
    for f in names(&c.expected_dir) {
        let a = std::fs::read(out.join(&f)).unwrap();
        let b = std::fs::read(c.expected_dir.join(&f)).unwrap();
        assert!(a == b, "{}: {f} differs from transformers' output", c.name);
    }
    text(&o)
}

fn verify(c: &Case, dir: &Path) -> Output {
    let mut args = vec![
        "verify",
        dir.to_str().unwrap(),
        "--against",
        &c.checkpoint,
        "--base",
        &c.base,
    ];
    args.extend(c.extra_args.iter().map(String::as_str));
    unshard(&args)
}

#[test]
fn every_policy_and_dcp_case_matches_transformers_byte_for_byte() {
    let cases: Vec<Case> = cases()
        .into_iter()
        .filter(|c| !c.name.contains("zero3") && !c.packed_layout())
        .collect();
    // Nine families' policy.pt, two FSDP2 DCP directories.
    assert_eq!(cases.len(), 11);
    let tmp = tempfile::tempdir().unwrap();
    for c in &cases {
        let out = tmp.path().join(&c.name);
        let said = assert_matches_transformers(c, &out);
        // Every family but GPT-OSS (whose files hold the packed names) is unpacked,
        // and says so.
        if !c.name.starts_with("gpt_oss") {
            assert!(
                said.contains(
                    "layout: the checkpoint holds transformers' in-memory (packed) names"
                ),
                "{}: {said}",
                c.name
            );
        }
        let o = verify(c, &out);
        assert!(o.status.success(), "{}: verify: {}", c.name, text(&o));
    }
}

#[test]
fn the_deepspeed_zero3_case_matches_transformers_byte_for_byte() {
    let c = cases()
        .into_iter()
        .find(|c| c.name.contains("zero3"))
        .unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    assert_matches_transformers(&c, &out);
    let o = verify(&c, &out);
    assert!(o.status.success(), "verify: {}", text(&o));
}

/// The packed layout (`fixtures/gen_moe.py`'s `expected_packed/` and
/// `base_packed/`: `model.state_dict()` of transformers' model written with
/// safetensors) for Mixtral, Qwen3-MoE and DeepSeek-V3: the packed checkpoint and
/// transformers' own per-expert files written packed with `--layout packed`, a
/// per-expert checkpoint onto a base whose files are packed (packed by default),
/// and a packed base written per expert with `--layout original`. Each matches
/// transformers' file byte for byte, verify passes, and the report says which
/// way the mapping went.
#[test]
fn every_packed_layout_case_matches_transformers_byte_for_byte() {
    let cases: Vec<Case> = cases().into_iter().filter(Case::packed_layout).collect();
    assert_eq!(cases.len(), 12);
    let tmp = tempfile::tempdir().unwrap();
    for c in &cases {
        let out = tmp.path().join(&c.name);
        let said = assert_matches_transformers(c, &out);
        let want = if c.name.ends_with("per_expert_onto_packed_base") {
            "tensor(s) packed into 4 tensor(s)"
        } else if c.name.ends_with("per_expert_layout_packed") {
            "in transformers' in-memory layout (layout packed)"
        } else if c.name.ends_with("policy_layout_packed") {
            "the base's files hold the per-expert layout; read packed (layout packed)"
        } else {
            "the base's files hold the in-memory (packed) layout; read per expert (layout original)"
        };
        let want = if c.name.starts_with("deepseek") {
            want.replace("4 tensor(s)", "2 tensor(s)")
        } else {
            want.to_string()
        };
        assert!(said.contains(&want), "{}: {said}", c.name);
        let o = verify(c, &out);
        assert!(o.status.success(), "{}: verify: {}", c.name, text(&o));
    }
}

/// The bytes of `tensor` in a safetensors file.
fn tensor_bytes(file: &Path, tensor: &str) -> Vec<u8> {
    let bytes = std::fs::read(file).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let [a, b] = [0, 1].map(|i| header[tensor]["data_offsets"][i].as_u64().unwrap() as usize);
    bytes[8 + n + a..8 + n + b].to_vec()
}

/// The names of the tensors of a safetensors file.
fn tensor_names(file: &Path) -> Vec<String> {
    let bytes = std::fs::read(file).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    header
        .as_object()
        .unwrap()
        .keys()
        .filter(|k| *k != "__metadata__")
        .cloned()
        .collect()
}

/// Experts the checkpoint lacks come from the base, in the layout written: the
/// base's per-expert tensors packed (`--layout packed`), or its packed tensors cut
/// per expert (`--layout original`), equal to transformers' own tensors of the base.
#[test]
fn experts_the_checkpoint_lacks_come_from_the_base_in_the_layout_written() {
    let tmp = tempfile::tempdir().unwrap();
    // A checkpoint of the final norm alone.
    let ckpt = tmp.path().join("norm.safetensors");
    one_f32_tensor(&ckpt, "model.norm.weight", &[16], 1.5);
    for (base, layout, like) in [
        ("moe/qwen3_moe/base", "packed", "moe/qwen3_moe/base_packed"),
        (
            "moe/qwen3_moe/base_packed",
            "original",
            "moe/qwen3_moe/base",
        ),
        ("moe/mixtral/base", "packed", "moe/mixtral/base_packed"),
    ] {
        let out = tmp
            .path()
            .join(format!("{}-{layout}", base.replace('/', "_")));
        let o = unshard(&[
            "merge",
            ckpt.to_str().unwrap(),
            "--base",
            base,
            "--output",
            out.to_str().unwrap(),
            "--layout",
            layout,
        ]);
        assert!(o.status.success(), "{base} {layout}: {}", text(&o));
        let got = out.join("model.safetensors");
        let want = fixtures().join(like).join("model.safetensors");
        let mut names = tensor_names(&got);
        names.sort();
        let mut want_names = tensor_names(&want);
        want_names.sort();
        assert_eq!(names, want_names, "{base} {layout}");
        let experts: Vec<&String> = names.iter().filter(|n| n.contains("experts")).collect();
        assert!(experts.len() >= 4, "{base} {layout}: {experts:?}");
        for n in experts {
            assert!(
                tensor_bytes(&got, n) == tensor_bytes(&want, n),
                "{base} {layout}: {n} differs from transformers' tensor"
            );
        }
    }
}

/// A packed output records its layout in unshard.json: `verify OUT` alone
/// re-derives the packed merge, and names a flipped byte of a packed expert
/// tensor with its index in the packed tensor.
#[test]
fn verify_of_a_packed_output_takes_the_layout_and_names_a_flipped_byte() {
    let c = cases()
        .into_iter()
        .find(|c| c.name == "qwen3_moe_per_expert_layout_packed")
        .unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    let o = merge(&c, &out);
    assert!(o.status.success(), "{}", text(&o));
    let o = unshard(&["verify", out.to_str().unwrap()]);
    let said = text(&o);
    assert!(o.status.success(), "{said}");
    assert!(said.contains("--layout packed"), "{said}");
    // Expert 3's up projection (rows 24..48 of gate_up_proj[3]), element [1, 2].
    let t = "model.layers.1.mlp.experts.gate_up_proj";
    let file = out.join("model.safetensors");
    let mut bytes = std::fs::read(&file).unwrap();
    let (rows, cols) = (48, 16);
    bytes[data_offset(&file, t) + ((3 * rows + 24 + 1) * cols + 2) * 2 + 1] ^= 0x01;
    std::fs::write(&file, bytes).unwrap();
    let o = unshard(&["verify", out.to_str().unwrap()]);
    let said = text(&o);
    assert_eq!(o.status.code(), Some(1), "{said}");
    assert!(said.contains(&format!("tensor '{t}': 1 of")), "{said}");
    assert!(said.contains("first at [3, 25, 2]"), "{said}");
}

/// A per-expert checkpoint that lacks an expert cannot be packed: the error names
/// the packed tensor and the missing expert.
#[test]
fn packing_a_checkpoint_that_lacks_an_expert_is_refused_by_name() {
    let tmp = tempfile::tempdir().unwrap();
    // Expert 2's gate projection of layer 0, alone: experts 0 and 1 are missing.
    let ckpt = tmp.path().join("one.safetensors");
    one_f32_tensor(
        &ckpt,
        "model.layers.0.mlp.experts.2.gate_proj.weight",
        &[24, 16],
        0.5,
    );
    let out = tmp.path().join("out");
    let o = unshard(&[
        "merge",
        ckpt.to_str().unwrap(),
        "--base",
        "moe/qwen3_moe/base",
        "--output",
        out.to_str().unwrap(),
        "--layout",
        "packed",
    ]);
    let said = text(&o);
    assert_eq!(o.status.code(), Some(1), "{said}");
    assert!(
        said.contains("'model.layers.0.mlp.experts.gate_up_proj'"),
        "{said}"
    );
    assert!(said.contains("expert 0 is missing"), "{said}");
    assert!(!out.exists());
}

/// The header length and the data offset of `tensor` in a safetensors file.
fn data_offset(file: &Path, tensor: &str) -> usize {
    let bytes = std::fs::read(file).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    8 + n + header[tensor]["data_offsets"][0].as_u64().unwrap() as usize
}

#[test]
fn verify_names_a_flipped_byte_in_an_unpacked_expert() {
    for name in ["qwen3_moe_policy", "mixtral_fsdp2_w2_dcp"] {
        let c = cases().into_iter().find(|c| c.name == name).unwrap();
        let tmp = tempfile::tempdir().unwrap();
        let out = tmp.path().join("out");
        let o = merge(&c, &out);
        assert!(o.status.success(), "{}", text(&o));
        // Expert 3's up projection (the second half of gate_up_proj[3]), element [1, 2].
        let t = if name.starts_with("mixtral") {
            "model.layers.1.block_sparse_moe.experts.3.w3.weight"
        } else {
            "model.layers.1.mlp.experts.3.up_proj.weight"
        };
        let file = out.join("model.safetensors");
        let mut bytes = std::fs::read(&file).unwrap();
        let cols = 16; // hidden size of the tiny configs
        bytes[data_offset(&file, t) + (cols + 2) * 2 + 1] ^= 0x01;
        std::fs::write(&file, bytes).unwrap();
        let o = verify(&c, &out);
        let said = text(&o);
        assert_eq!(o.status.code(), Some(1), "{name}: {said}");
        assert!(
            said.contains(&format!("tensor '{t}': 1 of")),
            "{name}: {said}"
        );
        assert!(said.contains("first at [1, 2]"), "{name}: {said}");
    }
}

#[test]
fn a_packed_checkpoint_onto_a_packed_base_is_kept_as_it_is() {
    let c = cases()
        .into_iter()
        .find(|c| c.name == "qwen3_moe_policy")
        .unwrap();
    let tmp = tempfile::tempdir().unwrap();
    // A base in the in-memory layout: the checkpoint written alone (no config, so
    // no rules), with the model's config beside it.
    let packed = tmp.path().join("packed");
    let o = unshard(&[
        "merge",
        &c.checkpoint,
        "--output",
        packed.to_str().unwrap(),
        "--weights-only",
    ]);
    assert!(o.status.success(), "{}", text(&o));
    std::fs::remove_file(packed.join("unshard.json")).unwrap();
    std::fs::copy(
        fixtures().join(&c.base).join("config.json"),
        packed.join("config.json"),
    )
    .unwrap();
    let out = tmp.path().join("out");
    let o = unshard(&[
        "merge",
        &c.checkpoint,
        "--base",
        packed.to_str().unwrap(),
        "--output",
        out.to_str().unwrap(),
    ]);
    let said = text(&o);
    assert!(o.status.success(), "{said}");
    assert!(
        said.contains("layout: the base holds the in-memory (packed) names too"),
        "{said}"
    );
    let file = std::fs::read(out.join("model.safetensors")).unwrap();
    let header = String::from_utf8_lossy(&file[..4096.min(file.len())]).into_owned();
    assert!(
        header.contains("\"model.layers.0.mlp.experts.gate_up_proj\""),
        "{header}"
    );
    assert!(!header.contains("experts.0.gate_proj"), "{header}");
}

#[test]
fn a_packed_tensor_that_is_not_a_box_of_the_rule_is_refused_by_name() {
    // gate_up_proj's rows must split into gate and up halves: 47 rows do not.
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = tmp.path().join("odd.safetensors");
    one_f32_tensor(
        &ckpt,
        "model.layers.0.mlp.experts.gate_up_proj",
        &[2, 47, 4],
        0.5,
    );
    let out = tmp.path().join("out");
    let o = unshard(&[
        "merge",
        ckpt.to_str().unwrap(),
        "--base",
        "moe/qwen3_moe/base",
        "--output",
        out.to_str().unwrap(),
    ]);
    let said = text(&o);
    assert_eq!(o.status.code(), Some(1), "{said}");
    assert!(
        said.contains("'model.layers.0.mlp.experts.gate_up_proj' [2, 47, 4]"),
        "{said}"
    );
    assert!(said.contains("mlp.experts.gate_up_proj -> mlp.experts.*.gate_proj.weight + mlp.experts.*.up_proj.weight"), "{said}");
    assert!(said.contains("does not split into 2 equal parts"), "{said}");
    assert!(!out.exists());
}

/// `inspect` says when a checkpoint holds experts packed as transformers keeps them
/// in memory: the packed tensors are the 3-D ones under `experts` (one per
/// projection, all experts stacked), and a dense checkpoint gets no such line.
#[test]
fn inspect_names_the_packed_expert_tensors() {
    for c in cases()
        .iter()
        .filter(|c| c.checkpoint.ends_with("policy.pt"))
    {
        let o = unshard(&["inspect", "--json", &c.checkpoint]);
        assert!(o.status.success(), "{}: {}", c.name, text(&o));
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        let packed: Vec<&str> = v["tensors"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|t| t["shape"].as_array().unwrap().len() == 3)
            .map(|t| t["name"].as_str().unwrap())
            .filter(|n| n.split('.').any(|p| p == "experts"))
            .collect();
        assert!(!packed.is_empty(), "{}", c.name);
        let notes = v["notes"].to_string();
        assert!(
            notes.contains(&format!(
                "layout: {} tensor(s) hold experts packed",
                packed.len()
            )) && notes.contains(packed[0]),
            "{}: {packed:?} {notes}",
            c.name
        );
    }
    let o = unshard(&["inspect", "ckpt/llama_policy.pt"]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(!text(&o).contains("packed"), "{}", text(&o));
}

/// Without base weights (a config-only base), `--layout packed` packs by the
/// config's model_type alone: transformers' per-expert files and the packed
/// checkpoint both give `model.state_dict()`'s tensors.
#[test]
fn layout_packed_needs_only_the_config() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = tmp.path().join("cfg");
    std::fs::create_dir(&cfg).unwrap();
    std::fs::copy(
        fixtures().join("moe/qwen3_moe/base/config.json"),
        cfg.join("config.json"),
    )
    .unwrap();
    let want = fixtures().join("moe/qwen3_moe/expected_packed/model.safetensors");
    for ckpt in ["moe/qwen3_moe/expected", "moe/qwen3_moe/policy.pt"] {
        let out = tmp.path().join(ckpt.replace('/', "_"));
        let o = unshard(&[
            "merge",
            ckpt,
            "--base",
            cfg.to_str().unwrap(),
            "--output",
            out.to_str().unwrap(),
            "--layout",
            "packed",
        ]);
        assert!(o.status.success(), "{ckpt}: {}", text(&o));
        let got = std::fs::read(out.join("model.safetensors")).unwrap();
        assert!(got == std::fs::read(&want).unwrap(), "{ckpt}: differs");
    }
}
