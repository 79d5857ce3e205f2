//! `unshard verify`, `merge --verify`, the content checks of a merge, `inspect
//! --stats` and `unshard diff`, run through the binary on the committed fixtures.
//!
//! Verification must pass on every good merge and on what transformers itself wrote,
//! and must name the file and tensor of every kind of damage: a flipped byte,
//! shuffled rows, a removed or extra tensor, a widened dtype, an index entry pointing
//! at the wrong shard, a config dtype that disagrees, a truncated shard.
#![allow(clippy::unwrap_used)]

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};

fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_unshard")
}

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures")
}

fn fx(rel: &str) -> String {
    fixtures().join(rel).to_string_lossy().into_owned()
}

fn run<S: AsRef<std::ffi::OsStr>>(args: &[S]) -> Output {
    Command::new(bin()).args(args).output().unwrap()
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn all_output(o: &Output) -> String {
    format!("{}{}", stdout(o), stderr(o))
}

/// One good merge from a `cases.json`.
struct Case {
    name: String,
    checkpoint: String,
    base: String,
    dtype: String,
    max_shard_size: String,
    expected_dir: String,
    extra_args: Vec<String>,
}

fn cases(rel: &str) -> Vec<Case> {
    let text = std::fs::read_to_string(fixtures().join(rel)).unwrap();
    let json: serde_json::Value = serde_json::from_str(&text).unwrap();
    let s = |c: &serde_json::Value, k: &str| c[k].as_str().unwrap().to_string();
    json["cases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| Case {
            name: s(c, "name"),
            checkpoint: fx(&s(c, "checkpoint")),
            base: fx(&s(c, "base")),
            dtype: s(c, "dtype"),
            max_shard_size: s(c, "max_shard_size"),
            expected_dir: fx(&s(c, "expected_dir")),
            extra_args: c["extra_args"]
                .as_array()
                .map(|a| a.iter().map(|x| x.as_str().unwrap().to_string()).collect())
                .unwrap_or_default(),
        })
        .collect()
}

/// `--base B --dtype D --max-shard-size S`, as both merge and verify take them.
fn plan_args(c: &Case) -> Vec<String> {
    vec![
        "--base".into(),
        c.base.clone(),
        "--dtype".into(),
        c.dtype.clone(),
        "--max-shard-size".into(),
        c.max_shard_size.clone(),
    ]
}

fn merge(c: &Case, out: &Path, extra: &[&str]) -> Output {
    let mut args = vec!["merge".to_string(), c.checkpoint.clone()];
    args.extend(plan_args(c));
    args.extend(["-o".to_string(), out.to_string_lossy().into_owned()]);
    args.extend(c.extra_args.iter().cloned());
    args.extend(extra.iter().map(|s| s.to_string()));
    run(&args)
}

fn verify(c: &Case, dir: &Path) -> Output {
    let mut args = vec![
        "verify".to_string(),
        dir.to_string_lossy().into_owned(),
        "--against".into(),
        c.checkpoint.clone(),
    ];
    args.extend(plan_args(c));
    args.push("-q".into());
    run(&args)
}

fn case(name: &str) -> Case {
    cases("expected/cases.json")
        .into_iter()
        .find(|c| c.name == name)
        .unwrap()
}

fn assert_verifies(c: &Case, dir: &Path) {
    let o = verify(c, dir);
    assert!(
        o.status.success() && stdout(&o).starts_with("ok: "),
        "{}: verify failed on {}:\n{}",
        c.name,
        dir.display(),
        all_output(&o)
    );
}

/// Runs verify on `dir` and returns its output, requiring exit code 1.
fn assert_fails(c: &Case, dir: &Path) -> String {
    let o = verify(c, dir);
    let text = all_output(&o);
    assert_eq!(o.status.code(), Some(1), "{text}");
    assert!(text.contains("error: verification failed"), "{text}");
    text
}

/// A writable copy of a fixture directory.
fn copy_dir(src: &str, tmp: &tempfile::TempDir) -> PathBuf {
    let dst = tmp.path().join("out");
    std::fs::create_dir_all(&dst).unwrap();
    for e in std::fs::read_dir(src).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), dst.join(e.file_name())).unwrap();
    }
    dst
}

/// The shard that holds `tensor` (by the index, or the single file).
fn shard_of(dir: &Path, tensor: &str) -> PathBuf {
    match std::fs::read_to_string(dir.join("model.safetensors.index.json")) {
        Ok(text) => {
            let ix: serde_json::Value = serde_json::from_str(&text).unwrap();
            dir.join(ix["weight_map"][tensor].as_str().unwrap())
        }
        Err(_) => dir.join("model.safetensors"),
    }
}

/// Byte offset of `tensor`'s data in its shard file.
fn data_offset(file: &Path, tensor: &str) -> u64 {
    let bytes = std::fs::read(file).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap());
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n as usize]).unwrap();
    8 + n + header[tensor]["data_offsets"][0].as_u64().unwrap()
}

/// Rewrites a safetensors file through `edit`, which gets every tensor as
/// `name -> (dtype, shape, bytes)`.
fn rewrite(file: &Path, edit: impl FnOnce(&mut HashMap<String, (Dtype, Vec<usize>, Vec<u8>)>)) {
    let bytes = std::fs::read(file).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors: HashMap<String, (Dtype, Vec<usize>, Vec<u8>)> = st
        .tensors()
        .into_iter()
        .map(|(n, v)| (n, (v.dtype(), v.shape().to_vec(), v.data().to_vec())))
        .collect();
    edit(&mut tensors);
    let views: Vec<(String, TensorView<'_>)> = tensors
        .iter()
        .map(|(n, (d, s, b))| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    let meta = HashMap::from([("format".to_string(), "pt".to_string())]);
    safetensors::serialize_to_file(views, Some(meta), file).unwrap();
}

#[test]
fn verify_passes_on_every_good_merge() {
    for c in cases("expected/cases.json") {
        let tmp = tempfile::tempdir().unwrap();
        let out = tmp.path().join("out");
        let o = merge(&c, &out, &["--verify", "-q"]);
        assert!(o.status.success(), "{}: {}", c.name, all_output(&o));
        assert_verifies(&c, &out);
    }
}

#[test]
fn verify_passes_on_what_transformers_wrote() {
    // The expected directories come from `save_pretrained`, NaN case included.
    for c in cases("expected/cases.json") {
        assert_verifies(&c, Path::new(&c.expected_dir));
    }
}

#[test]
fn merge_verify_passes_on_sharded_checkpoints() {
    // DCP and per-rank checkpoints: the expected values are gathered from the
    // pieces by coordinates, independently of the writer.
    for c in cases("sharded/cases.json") {
        let tmp = tempfile::tempdir().unwrap();
        let out = tmp.path().join("out");
        let o = merge(&c, &out, &["--verify", "-q"]);
        assert!(o.status.success(), "{}: {}", c.name, all_output(&o));
    }
}

#[test]
fn verify_passes_on_tensors_materialised_by_torch() {
    // views.pt holds transposed, sliced, expanded and offset views; torch wrote their
    // contiguous values to views.expected.safetensors.
    let tmp = tempfile::tempdir().unwrap();
    std::fs::copy(
        fx("torch/views.expected.safetensors"),
        tmp.path().join("model.safetensors"),
    )
    .unwrap();
    let o = run(&[
        "verify",
        tmp.path().to_str().unwrap(),
        "--against",
        &fx("torch/views.pt"),
    ]);
    assert!(o.status.success(), "{}", all_output(&o));
    assert!(stdout(&o).contains("11 tensor(s) in 1 file(s) match"));
}

/// Flips one bit of element [2, 5] of the [64, 173] bf16 tensor
/// `model.layers.1.mlp.down_proj.weight` in `dir` (its high byte: sign and exponent);
/// returns the shard that holds it.
fn flip_down_proj_2_5(dir: &Path) -> PathBuf {
    let t = "model.layers.1.mlp.down_proj.weight";
    let file = shard_of(dir, t);
    let mut bytes = std::fs::read(&file).unwrap();
    let at = (data_offset(&file, t) + (2 * 173 + 5) * 2 + 1) as usize;
    bytes[at] ^= 0x01;
    std::fs::write(&file, bytes).unwrap();
    file
}

#[test]
fn verify_names_one_flipped_byte_in_a_shard() {
    let c = case("llama_policy_into_llama-bf16-sharded");
    let tmp = tempfile::tempdir().unwrap();
    let dir = copy_dir(&c.expected_dir, &tmp);
    let t = "model.layers.1.mlp.down_proj.weight";
    let file = flip_down_proj_2_5(&dir);
    let text = assert_fails(&c, &dir);
    let shard = file.file_name().unwrap().to_str().unwrap();
    assert!(
        text.contains(&format!(
            "{shard}: tensor '{t}': 1 of 11072 element(s) differ"
        )),
        "{text}"
    );
    assert!(text.contains("first at [2, 5]"), "{text}");
    assert_eq!(text.matches("element(s) differ").count(), 1, "{text}");
}

#[test]
fn verify_names_shuffled_rows() {
    let c = case("llama_policy_into_llama-bf16");
    let tmp = tempfile::tempdir().unwrap();
    let dir = copy_dir(&c.expected_dir, &tmp);
    let t = "model.layers.0.self_attn.k_proj.weight"; // [32, 64] bf16
    rewrite(&dir.join("model.safetensors"), |m| {
        let data = &mut m.get_mut(t).unwrap().2;
        let (r0, r1) = data.split_at_mut(128);
        r0.swap_with_slice(&mut r1[..128]);
    });
    let text = assert_fails(&c, &dir);
    assert!(
        text.contains(&format!(
            "model.safetensors: tensor '{t}': 128 of 2048 element(s) differ"
        )),
        "{text}"
    );
    assert!(text.contains("first at [0, 0]"), "{text}");
}

#[test]
fn verify_names_a_removed_tensor() {
    let c = case("llama_policy_into_llama-bf16");
    let tmp = tempfile::tempdir().unwrap();
    let dir = copy_dir(&c.expected_dir, &tmp);
    rewrite(&dir.join("model.safetensors"), |m| {
        m.remove("model.norm.weight");
    });
    let text = assert_fails(&c, &dir);
    assert!(
        text.contains("tensor 'model.norm.weight': missing: the merge writes it"),
        "{text}"
    );
    assert!(text.contains("1 structural problem(s)"), "{text}");
}

#[test]
fn verify_names_an_extra_tensor_and_a_stale_shard() {
    let c = case("llama_policy_into_llama-bf16");
    let tmp = tempfile::tempdir().unwrap();
    let dir = copy_dir(&c.expected_dir, &tmp);
    rewrite(&dir.join("model.safetensors"), |m| {
        m.insert(
            "model.extra.weight".into(),
            (Dtype::BF16, vec![2], vec![0; 4]),
        );
    });
    std::fs::copy(
        dir.join("model.safetensors"),
        dir.join("model-00001-of-00002.safetensors"),
    )
    .unwrap();
    let text = assert_fails(&c, &dir);
    assert!(
        text.contains("model.safetensors: tensor 'model.extra.weight': extra"),
        "{text}"
    );
    assert!(
        text.contains("model-00001-of-00002.safetensors: beside model.safetensors"),
        "{text}"
    );
}

#[test]
fn verify_names_a_tensor_stored_in_two_shards() {
    let c = case("llama_policy_into_llama-bf16-sharded");
    let tmp = tempfile::tempdir().unwrap();
    let dir = copy_dir(&c.expected_dir, &tmp);
    let t = "model.norm.weight";
    let home = shard_of(&dir, t);
    let other = dir.join("model-00001-of-00003.safetensors");
    assert_ne!(home, other);
    let bytes = std::fs::read(&home).unwrap();
    let copy = {
        let st = SafeTensors::deserialize(&bytes).unwrap();
        let v = st.tensor(t).unwrap();
        (v.dtype(), v.shape().to_vec(), v.data().to_vec())
    };
    rewrite(&other, |m| {
        m.insert(t.into(), copy);
    });
    let text = assert_fails(&c, &dir);
    assert!(
        text.contains(&format!("tensor '{t}': stored twice")),
        "{text}"
    );
}

#[test]
fn verify_names_a_dtype_that_silently_widened() {
    let c = case("llama_policy_into_llama-bf16");
    let tmp = tempfile::tempdir().unwrap();
    let dir = copy_dir(&c.expected_dir, &tmp);
    let t = "model.layers.1.input_layernorm.weight";
    rewrite(&dir.join("model.safetensors"), |m| {
        let e = m.get_mut(t).unwrap();
        // bf16 -> f32 is exact: the values are right, the dtype is not.
        e.2 =
            e.2.chunks_exact(2)
                .flat_map(|b| [0, 0, b[0], b[1]])
                .collect();
        e.0 = Dtype::F32;
    });
    let text = assert_fails(&c, &dir);
    assert!(
        text.contains(&format!(
            "tensor '{t}': stored as float32, but the merge writes bfloat16"
        )),
        "{text}"
    );
}

#[test]
fn verify_names_an_index_entry_pointing_at_the_wrong_shard() {
    let c = case("qwen2_policy_into_qwen2-fp16-sharded");
    let tmp = tempfile::tempdir().unwrap();
    let dir = copy_dir(&c.expected_dir, &tmp);
    let t = "model.norm.weight";
    let home = shard_of(&dir, t);
    let wrong = if home.ends_with("model-00001-of-00003.safetensors") {
        "model-00002-of-00003.safetensors"
    } else {
        "model-00001-of-00003.safetensors"
    };
    let path = dir.join("model.safetensors.index.json");
    let mut ix: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    ix["weight_map"][t] = wrong.into();
    std::fs::write(&path, serde_json::to_string_pretty(&ix).unwrap()).unwrap();
    let text = assert_fails(&c, &dir);
    assert!(
        text.contains(&format!(
            "model.safetensors.index.json: tensor '{t}': listed in {wrong}, but it is stored in {}",
            home.file_name().unwrap().to_str().unwrap()
        )),
        "{text}"
    );
}

#[test]
fn verify_names_a_config_dtype_that_disagrees_with_the_tensors() {
    let c = case("llama_policy_into_llama-bf16");
    let tmp = tempfile::tempdir().unwrap();
    let dir = copy_dir(&c.expected_dir, &tmp);
    let path = dir.join("config.json");
    let text = std::fs::read_to_string(&path).unwrap();
    assert!(text.contains("\"dtype\": \"bfloat16\""));
    std::fs::write(
        &path,
        text.replace("\"dtype\": \"bfloat16\"", "\"dtype\": \"float16\""),
    )
    .unwrap();
    let text = assert_fails(&c, &dir);
    assert!(
        text.contains("config.json: declares \"dtype\": \"float16\", but the tensors are bfloat16"),
        "{text}"
    );
}

#[test]
fn verify_names_a_truncated_shard_and_the_tensors_it_held() {
    let c = case("llama_policy_into_llama-bf16-sharded");
    let tmp = tempfile::tempdir().unwrap();
    let dir = copy_dir(&c.expected_dir, &tmp);
    let file = dir.join("model-00002-of-00003.safetensors");
    let len = std::fs::metadata(&file).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&file)
        .unwrap()
        .set_len(len - 1000)
        .unwrap();
    let text = assert_fails(&c, &dir);
    assert!(
        text.contains("model-00002-of-00003.safetensors: tensor data ends at byte"),
        "{text}"
    );
    assert!(
        text.contains("model-00002-of-00003.safetensors: unreadable, so the"),
        "{text}"
    );
}

#[test]
fn verify_with_other_merge_options_says_which_dtype_to_pass() {
    // The bf16 output is not what `--dtype float16` would write: one line says
    // what to pass, rather than one line per tensor.
    let mut c = case("llama_policy_into_llama-bf16");
    c.dtype = "float16".into();
    let text = assert_fails(
        &c,
        Path::new(&case("llama_policy_into_llama-bf16").expected_dir),
    );
    assert_eq!(text.matches("stored as bfloat16").count(), 1, "{text}");
    assert!(
        text.contains("all 21 floating tensors are stored as bfloat16, but with the options given the merge writes float16")
            && text.contains("pass --dtype bfloat16, or the --base it was given"),
        "{text}"
    );
    assert!(
        text.contains(
            "config.json: declares \"dtype\": \"bfloat16\", but the merge writes float16"
        ),
        "{text}"
    );
}

#[test]
fn merge_fail_on_nonfinite_names_the_tensor_and_writes_nothing() {
    let c = case("llama_nan_into_llama-bf16");
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    let o = merge(&c, &out, &["--fail-on-nonfinite"]);
    let text = all_output(&o);
    assert_eq!(o.status.code(), Some(1), "{text}");
    assert!(
        text.contains("'model.layers.1.self_attn.v_proj.weight' (2 NaN, 2 inf)"),
        "{text}"
    );
    assert_eq!(std::fs::read_dir(tmp.path()).unwrap().count(), 0);
    // Without the flag, the same values are a warning.
    let o = merge(&c, &out, &[]);
    assert!(o.status.success());
    assert!(stderr(&o).contains(
        "warning: tensor 'model.layers.1.self_attn.v_proj.weight' holds 2 NaN and 2 inf"
    ));
}

#[test]
fn merge_warns_when_every_checkpoint_tensor_equals_the_base() {
    // The base's own fp32 weights, exported as if they were a trained checkpoint.
    let tmp = tempfile::tempdir().unwrap();
    let o = run(&[
        "merge",
        &fx("models/llama-fp32-bin"),
        "--base",
        &fx("models/llama-bf16"),
        "-o",
        tmp.path().join("out").to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", all_output(&o));
    assert!(
        stderr(&o).contains("warning: all 21 checkpoint tensor(s) equal the base's"),
        "{}",
        stderr(&o)
    );
}

#[test]
fn merge_does_not_warn_about_a_trained_checkpoint() {
    let c = case("llama_policy_into_llama-bf16");
    let tmp = tempfile::tempdir().unwrap();
    let o = merge(&c, &tmp.path().join("out"), &["--verify"]);
    assert!(o.status.success(), "{}", all_output(&o));
    let err = stderr(&o);
    assert!(!err.contains("equal the base"), "{err}");
    assert!(
        err.contains("verified: 21 tensor(s) in 1 file(s) match"),
        "{err}"
    );
}

#[test]
fn inspect_stats_prints_mean_std_min_max_and_nonfinite_counts() {
    let o = run(&["inspect", "--stats", &fx("torch/dtypes.pt")]);
    assert!(o.status.success(), "{}", all_output(&o));
    let text = stdout(&o);
    let line = |name: &str| {
        text.lines()
            .rfind(|l| l.split_whitespace().next() == Some(name))
            .unwrap()
            .to_string()
    };
    let int8: Vec<String> = line("int8").split_whitespace().map(String::from).collect();
    assert_eq!(int8[3..5], ["-1.28000e2", "1.27000e2"], "{text}");
    assert!(line("float32").ends_with("2 NaN, 2 inf"), "{text}");

    let o = run(&["inspect", "--stats", "--json", &fx("torch/dtypes.pt")]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let t = v["tensors"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["name"] == "uint8")
        .unwrap();
    assert_eq!(t["stats"]["min"], 0.0);
    assert_eq!(t["stats"]["max"], 255.0);
}

#[test]
fn diff_says_a_merge_equals_what_transformers_wrote() {
    let c = case("qwen2_policy_into_qwen2-fp16-sharded");
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    assert!(merge(&c, &out, &["-q"]).status.success());
    let o = run(&["diff", out.to_str().unwrap(), &c.expected_dir]);
    assert!(o.status.success(), "{}", all_output(&o));
    assert!(stdout(&o).contains("26 of 26 common tensor(s) identical"));
}

#[test]
fn diff_names_tensors_that_differ_and_names_on_one_side() {
    let c = case("qwen2_policy_into_qwen2-fp16");
    let o = run(&["diff", &c.checkpoint, &c.expected_dir]);
    let text = stdout(&o);
    assert_eq!(o.status.code(), Some(1), "{}", all_output(&o));
    // The checkpoint is fp32, the output fp16: every value rounds a little.
    assert!(
        text.lines()
            .any(|l| l.contains("model.norm.weight") && l.contains("F32/F16")),
        "{text}"
    );
    // The tied head is written once.
    assert!(text.contains("only in A (1): lm_head.weight"), "{text}");
    assert!(
        text.contains("0 of 26 common tensor(s) identical"),
        "{text}"
    );
}

#[test]
fn verify_json_reports_the_pass_and_the_flipped_byte_as_data() {
    let c = case("llama_policy_into_llama-bf16-sharded");
    let tmp = tempfile::tempdir().unwrap();
    let dir = copy_dir(&c.expected_dir, &tmp);
    let json = |dir: &Path| {
        let mut args = vec![
            "verify".to_string(),
            dir.to_string_lossy().into_owned(),
            "--against".into(),
            c.checkpoint.clone(),
        ];
        args.extend(plan_args(&c));
        args.extend(["-q".into(), "--json".into()]);
        let o = run(&args);
        let v: serde_json::Value =
            serde_json::from_slice(&o.stdout).unwrap_or_else(|e| panic!("{e}: {}", all_output(&o)));
        (o.status.code(), v)
    };

    let (code, v) = json(&dir);
    assert_eq!(code, Some(0), "{v}");
    assert_eq!(v["ok"], true);
    assert_eq!(v["tensors_compared"], 21);
    assert!(v["files"].as_array().unwrap().len() > 1, "{v}");
    assert!(v["problems"].as_array().unwrap().is_empty());
    assert!(v["mismatches"].as_array().unwrap().is_empty());

    let t = "model.layers.1.mlp.down_proj.weight";
    let file = flip_down_proj_2_5(&dir);
    let (code, v) = json(&dir);
    assert_eq!(code, Some(1), "{v}");
    assert_eq!(v["ok"], false);
    let m = v["mismatches"].as_array().unwrap();
    assert_eq!(m.len(), 1, "{v}");
    assert_eq!(m[0]["tensor"], t);
    assert_eq!(m[0]["file"], file.file_name().unwrap().to_str().unwrap());
    assert_eq!(m[0]["dtype"], "BF16");
    assert_eq!(m[0]["shape"], serde_json::json!([64, 173]));
    assert_eq!(m[0]["differing"], 1);
    assert_eq!(m[0]["first"]["index"], serde_json::json!([2, 5]));
    let (e, f) = (
        m[0]["first"]["expected"].as_f64().unwrap(),
        m[0]["first"]["found"].as_f64().unwrap(),
    );
    assert!(e != f && e.is_finite() && f.is_finite(), "{v}");
}

#[test]
fn diff_json_lists_every_tensor_and_the_names_on_one_side() {
    let c = case("qwen2_policy_into_qwen2-fp16");
    let o = run(&["diff", &c.checkpoint, &c.expected_dir, "--json"]);
    assert_eq!(o.status.code(), Some(1), "{}", all_output(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["identical"], false);
    assert_eq!(v["a"]["format"], "torch-zip");
    assert_eq!(v["b"]["format"], "hf-dir");
    assert_eq!(v["only_a"], serde_json::json!(["lm_head.weight"]));
    assert_eq!(v["only_b"], serde_json::json!([]));
    let tensors = v["tensors"].as_array().unwrap();
    assert_eq!(tensors.len(), 26);
    let norm = tensors
        .iter()
        .find(|t| t["name"] == "model.norm.weight")
        .unwrap();
    assert_eq!(norm["identical"], false);
    assert_eq!(
        (&norm["dtype_a"], &norm["dtype_b"]),
        (&"F32".into(), &"F16".into())
    );
    assert_eq!(norm["shape_a"], norm["shape_b"]);
    let rel = norm["values"]["rel_l2"].as_f64().unwrap();
    // float16 rounding of weights near 1: a relative error of a few 1e-4 at most.
    assert!(rel > 0.0 && rel < 1e-3, "{norm}");

    // The same directory against itself: identical, exit 0.
    let o = run(&["diff", &c.expected_dir, &c.expected_dir, "--json"]);
    assert!(o.status.success(), "{}", all_output(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["identical"], true);
    assert!(v["tensors"]
        .as_array()
        .unwrap()
        .iter()
        .all(|t| t["identical"] == true && t["values"]["differing"] == 0));
}
