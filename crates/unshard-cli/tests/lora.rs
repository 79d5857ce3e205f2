//! `unshard merge ADAPTER --base BASE`: LoRA / DoRA adapters fused into the base,
//! against what peft's own `merge_and_unload()` gives (fixtures/lora, written by
//! `fixtures/gen_lora.py` with peft 0.21.2; expected bytes read with the
//! `safetensors` crate). A fused weight must be within one ulp of peft's in the
//! output dtype; every other tensor byte-identical; `unshard verify` must accept
//! the output and reject a fused weight that is off.
#![allow(clippy::unwrap_used)]

mod common;

use std::process::{Command, Output};

use common::{f32_safetensors, fixtures, peft};

fn unshard(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_unshard"))
        .args(args)
        .output()
        .unwrap()
}

/// The cases of `fixtures/lora/cases.json` and of the adapters on
/// mixture-of-experts bases, `fixtures/lora_moe/cases.json`.
fn cases() -> serde_json::Value {
    let read = |f: &str| -> serde_json::Value {
        serde_json::from_slice(&std::fs::read(fixtures().join(f)).unwrap()).unwrap()
    };
    let (mut all, moe) = (read("lora/cases.json"), read("lora_moe/cases.json"));
    for key in ["cases", "error_cases"] {
        let more = moe[key].as_array().unwrap().clone();
        assert!(!more.is_empty(), "lora_moe/cases.json: no {key}");
        all[key].as_array_mut().unwrap().extend(more);
    }
    all
}

fn fx(rel: &str) -> String {
    fixtures().join(rel).to_string_lossy().into_owned()
}

/// The case's extra arguments, paths made absolute.
fn extra(case: &serde_json::Value) -> Vec<String> {
    case["extra_args"]
        .as_array()
        .map(|a| {
            a.iter()
                .map(|v| v.as_str().unwrap())
                .map(|s| {
                    if s.starts_with("lora/") {
                        fx(s)
                    } else {
                        s.to_string()
                    }
                })
                .collect()
        })
        .unwrap_or_default()
}

#[test]
fn every_case_merges_within_one_ulp_of_peft_and_verifies() {
    let all = cases();
    let mut inexact = 0;
    for case in all["cases"].as_array().unwrap() {
        let name = case["name"].as_str().unwrap();
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("out");
        let (adapter, base) = (
            fx(case["adapter"].as_str().unwrap()),
            fx(case["base"].as_str().unwrap()),
        );
        let mut args = vec![
            "merge",
            &adapter,
            "--base",
            &base,
            "--output",
            out.to_str().unwrap(),
        ];
        let extra = extra(case);
        args.extend(extra.iter().map(String::as_str));
        let r = unshard(&args);
        let stderr = String::from_utf8_lossy(&r.stderr);
        assert!(r.status.success(), "{name}: {stderr}");
        assert!(stderr.contains("note: adapter '"), "{name}: {stderr}");
        // The mixture-of-experts bases carry no tokenizer, which is said.
        assert!(
            !stderr
                .lines()
                .any(|l| l.contains("warning:") && !l.contains("has no tokenizer files")),
            "{name}: {stderr}"
        );
        // Which tensors the fuse computed: the adapter's modules (lora_A names).
        let expected = fixtures().join(case["expected_dir"].as_str().unwrap());
        let fused = peft::changed(&expected, &fixtures().join(case["base"].as_str().unwrap()));
        inexact += peft::compare(&out, &expected, &fused, name);

        let mut vargs = vec![
            "verify",
            out.to_str().unwrap(),
            "--against",
            &adapter,
            "--base",
            &base,
        ];
        vargs.extend(extra.iter().map(String::as_str));
        let v = unshard(&vargs);
        assert!(
            v.status.success(),
            "{name}: verify: {}",
            String::from_utf8_lossy(&v.stdout)
        );
    }
    // On x86-64 (torch 2.15's CPU matmul, matrixmultiply's kernel) every fused
    // tensor of these fixtures comes out bit-identical to peft's; another
    // summation order may round an element the other way, which the 1-ulp bound allows.
    eprintln!("fused tensors not bit-identical to peft's: {inexact}");
}

#[test]
fn errors_name_the_field_the_adapter_or_the_missing_config() {
    let all = cases();
    for case in all["error_cases"].as_array().unwrap() {
        let name = case["name"].as_str().unwrap();
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("out");
        let (adapter, base) = (
            fx(case["adapter"].as_str().unwrap()),
            fx(case["base"].as_str().unwrap()),
        );
        let r = unshard(&[
            "merge",
            &adapter,
            "--base",
            &base,
            "--output",
            out.to_str().unwrap(),
        ]);
        let stderr = String::from_utf8_lossy(&r.stderr);
        assert!(!r.status.success(), "{name}");
        assert!(
            stderr.contains(case["error"].as_str().unwrap()),
            "{name}: {stderr}"
        );
        assert!(!out.exists(), "{name}: an output was left behind");
    }
    // An adapter name that is not there lists those that are.
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let r = unshard(&[
        "merge",
        &fx("lora/adapters/llama_two_adapters"),
        "--base",
        &fx("models/llama-bf16"),
        "--adapter",
        "third",
        "--output",
        out.to_str().unwrap(),
    ]);
    let stderr = String::from_utf8_lossy(&r.stderr);
    assert!(
        !r.status.success() && stderr.contains("'third'") && stderr.contains("default, second"),
        "{stderr}"
    );
    // Adapter flags on a checkpoint without an adapter are refused, not ignored.
    let r = unshard(&[
        "merge",
        &fx("ckpt/llama_policy.pt"),
        "--base",
        &fx("models/llama-bf16"),
        "--no-fuse",
        "--output",
        out.to_str().unwrap(),
    ]);
    assert!(String::from_utf8_lossy(&r.stderr).contains("--no-fuse applies to LoRA adapters"));
}

/// The library's hints name its options; the command line shows its flags, in the
/// message as in the hint.
#[test]
fn adapter_errors_show_the_flags_to_pass() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let o = out.to_str().unwrap();
    let two = fx("lora/adapters/llama_two_adapters");
    let base = fx("models/llama-bf16");
    let (policy, lora) = (fx("ckpt/llama_policy.pt"), fx("lora/adapters/llama_lora"));
    let trained = fx("lora/train/llama_lora_pt/policy.pt");
    let cases: [(Vec<&str>, &[&str]); 5] = [
        (
            vec!["merge", &two, "--base", &base, "--output", o],
            &["hint: choose one with --adapter NAME"],
        ),
        (
            vec![
                "merge",
                &two,
                "--base",
                &base,
                "--adapter",
                "third",
                "--output",
                o,
            ],
            &["hint: pass one of those names with --adapter"],
        ),
        (
            vec![
                "merge",
                &trained,
                "--base",
                &base,
                "--adapter-config",
                &base,
                "--output",
                o,
            ],
            &[
                "--adapter-config: no adapter_config.json here",
                "hint: pass the adapter_config.json",
            ],
        ),
        (
            vec![
                "merge",
                &policy,
                "--base",
                &base,
                "--no-fuse",
                "--output",
                o,
            ],
            &[
                "error: ",
                "--no-fuse applies to LoRA adapters",
                "or drop the flag",
            ],
        ),
        (vec!["merge", &lora, "--output", o], &["--base"]),
    ];
    for (args, says) in cases {
        let r = unshard(&args);
        let stderr = String::from_utf8_lossy(&r.stderr);
        assert!(!r.status.success(), "{args:?}");
        for s in says {
            assert!(stderr.contains(s), "{args:?}: {s:?} not in {stderr}");
        }
        assert!(
            !stderr.contains('`'),
            "{args:?}: a library option name in {stderr}"
        );
    }
}

/// A copy of the fixture adapter `name` in a new folder, its config changed by `edit`
/// and its weights by `weights` (given each tensor's name and bytes).
fn edited_adapter(
    dir: &std::path::Path,
    name: &str,
    edit: impl FnOnce(&mut serde_json::Value),
    weights: impl Fn(&str, &mut Vec<u8>),
) -> std::path::PathBuf {
    let src = fixtures().join("lora/adapters").join(name);
    let adapter = dir.join(name);
    std::fs::create_dir(&adapter).unwrap();
    let bytes = std::fs::read(src.join("adapter_model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let data: Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)> = st
        .tensors()
        .into_iter()
        .map(|(n, v)| {
            let mut b = v.data().to_vec();
            weights(&n, &mut b);
            (n, v.dtype(), v.shape().to_vec(), b)
        })
        .collect();
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = data
        .iter()
        .map(|(n, d, s, b)| {
            let v = safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap();
            (n.clone(), v)
        })
        .collect();
    safetensors::serialize_to_file(views, None, &adapter.join("adapter_model.safetensors"))
        .unwrap();
    let mut cfg: serde_json::Value =
        serde_json::from_slice(&std::fs::read(src.join("adapter_config.json")).unwrap()).unwrap();
    edit(&mut cfg);
    std::fs::write(adapter.join("adapter_config.json"), cfg.to_string()).unwrap();
    adapter
}

/// Merges `adapter` onto the bf16 Llama fixture into `out`, asserts it succeeded,
/// and gives what it printed on stderr.
fn merge_onto_llama(adapter: &str, out: &std::path::Path, quiet: bool) -> String {
    let base = fx("models/llama-bf16");
    let mut args = vec![
        "merge",
        adapter,
        "--base",
        &base,
        "--output",
        out.to_str().unwrap(),
    ];
    if quiet {
        args.push("--quiet");
    }
    let r = unshard(&args);
    let stderr = String::from_utf8_lossy(&r.stderr).into_owned();
    assert!(r.status.success(), "{stderr}");
    stderr
}

/// An adapter saved before training holds `lora_B` all zero (peft initialises it
/// so): with a non-zero `lora_alpha` and `lora_A` the fuse still changes nothing,
/// and that is said as loudly as a zero alpha.
#[test]
fn an_untrained_adapter_warns_that_the_output_is_the_base() {
    let dir = tempfile::tempdir().unwrap();
    let adapter = edited_adapter(
        dir.path(),
        "llama_lora",
        |_| {},
        |n, b| {
            if n.contains("lora_B") {
                b.fill(0);
            }
        },
    );
    let out = dir.path().join("out");
    let stderr = merge_onto_llama(adapter.to_str().unwrap(), &out, true);
    assert!(
        stderr.contains("warning: THE OUTPUT IS THE BASE MODEL UNCHANGED"),
        "{stderr}"
    );
    // The unchanged fixture adapter, trained, gives no such warning.
    let out2 = dir.path().join("out2");
    let stderr = merge_onto_llama(&fx("lora/adapters/llama_lora"), &out2, true);
    assert!(!stderr.contains("UNCHANGED"), "{stderr}");
}

/// The adapter's note counts its rank and alpha patterns when only one kind is
/// set (peft accepts a `rank_pattern` without an `alpha_pattern`).
#[test]
fn the_note_counts_rank_patterns_without_alpha_patterns() {
    let dir = tempfile::tempdir().unwrap();
    let adapter = edited_adapter(
        dir.path(),
        "llama_patterns",
        |cfg| cfg["alpha_pattern"] = serde_json::json!({}),
        |_, _| {},
    );
    let out = dir.path().join("out");
    let stderr = merge_onto_llama(adapter.to_str().unwrap(), &out, false);
    assert!(
        stderr.contains(", 2 rank and 0 alpha pattern(s);"),
        "{stderr}"
    );
}

/// verl's merger writes `lora_alpha: 0`: fusing with that config gives the base
/// again, and unshard says so loudly.
#[test]
fn alpha_zero_warns_that_the_output_is_the_base() {
    let dir = tempfile::tempdir().unwrap();
    let adapter = edited_adapter(
        dir.path(),
        "llama_lora",
        |cfg| cfg["lora_alpha"] = serde_json::json!(0),
        |_, _| {},
    );
    let out = dir.path().join("out");
    let stderr = merge_onto_llama(adapter.to_str().unwrap(), &out, true);
    assert!(
        stderr.contains("warning: THE OUTPUT IS THE BASE MODEL UNCHANGED"),
        "{stderr}"
    );
    // And it is: every tensor equals the base's.
    let ours = std::fs::read(out.join("model.safetensors")).unwrap();
    let ours = safetensors::SafeTensors::deserialize(&ours).unwrap();
    let base = std::fs::read(fixtures().join("models/llama-bf16/model.safetensors")).unwrap();
    let base = safetensors::SafeTensors::deserialize(&base).unwrap();
    for n in base.names() {
        assert!(
            ours.tensor(n).unwrap().data() == base.tensor(n).unwrap().data(),
            "{n}"
        );
    }
}

/// `--no-fuse`: the base's tensors unchanged, the adapter in OUT/adapter/ with the
/// config it was trained with (the real alpha), loadable by peft (interop.py).
#[test]
fn no_fuse_writes_the_base_unchanged_and_the_adapter_beside_it() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let r = unshard(&[
        "merge",
        &fx("lora/train/llama_modules_to_save_pt/policy.pt"),
        "--base",
        &fx("models/llama-bf16"),
        "--no-fuse",
        "--output",
        out.to_str().unwrap(),
    ]);
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    let ours = std::fs::read(out.join("model.safetensors")).unwrap();
    let ours = safetensors::SafeTensors::deserialize(&ours).unwrap();
    let base = std::fs::read(fixtures().join("models/llama-bf16/model.safetensors")).unwrap();
    let base = safetensors::SafeTensors::deserialize(&base).unwrap();
    assert_eq!(ours.names().len(), base.names().len());
    for n in base.names() {
        assert!(
            ours.tensor(n).unwrap().data() == base.tensor(n).unwrap().data(),
            "{n}"
        );
    }
    let saved = fixtures().join("lora/adapters/llama_modules_to_save/adapter_model.safetensors");
    let peft = std::fs::read(saved).unwrap();
    let peft = safetensors::SafeTensors::deserialize(&peft).unwrap();
    let written = std::fs::read(out.join("adapter/adapter_model.safetensors")).unwrap();
    let written = safetensors::SafeTensors::deserialize(&written).unwrap();
    let mut a: Vec<_> = written.names();
    let mut b: Vec<_> = peft.names();
    a.sort();
    b.sort();
    assert_eq!(a, b);
    for n in b {
        assert!(
            written.tensor(n).unwrap().data() == peft.tensor(n).unwrap().data(),
            "{n}"
        );
    }
    let cfg: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("adapter/adapter_config.json")).unwrap())
            .unwrap();
    assert_eq!(cfg["lora_alpha"], serde_json::json!(8));
}

/// A fused weight written off by more than the tolerance is a verify mismatch.
#[test]
fn verify_rejects_a_fused_weight_that_is_off() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let adapter = fx("lora/adapters/llama_dora");
    let base = fx("models/llama-bf16");
    let r = unshard(&[
        "merge",
        &adapter,
        "--base",
        &base,
        "--output",
        out.to_str().unwrap(),
    ]);
    assert!(r.status.success());
    let file = out.join("model.safetensors");
    let bytes = std::fs::read(&file).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let t = st.tensor("model.layers.0.self_attn.q_proj.weight").unwrap();
    // The element of largest magnitude, two bfloat16 ulps up (a bump of an
    // element near zero could hide inside the tolerance, which is taken at the
    // magnitude of W and of the update).
    let big = t
        .data()
        .chunks_exact(2)
        .map(|c| f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16).abs())
        .enumerate()
        .max_by(|a, b| a.1.total_cmp(&b.1))
        .unwrap()
        .0;
    let offset = t.data().as_ptr() as usize - bytes.as_ptr() as usize + 2 * big;
    let mut bytes = bytes.clone();
    let v = u16::from_le_bytes([bytes[offset], bytes[offset + 1]]) + 2;
    bytes[offset..offset + 2].copy_from_slice(&v.to_le_bytes());
    std::fs::write(&file, bytes).unwrap();
    let v = unshard(&[
        "verify",
        out.to_str().unwrap(),
        "--against",
        &adapter,
        "--base",
        &base,
    ]);
    let stdout = String::from_utf8_lossy(&v.stdout);
    assert!(!v.status.success(), "{stdout}");
    assert!(
        stdout.contains("model.layers.0.self_attn.q_proj.weight"),
        "{stdout}"
    );
}

/// An adapter directory alone has no weights to fuse into: the error says to pass
/// --base, and nothing is written.
#[test]
fn an_adapter_without_a_base_asks_for_one() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let r = unshard(&[
        "merge",
        &fx("lora/adapters/llama_lora"),
        "--output",
        out.to_str().unwrap(),
    ]);
    let stderr = String::from_utf8_lossy(&r.stderr);
    assert!(!r.status.success());
    assert!(
        stderr.contains("no base model to fuse it into") && stderr.contains("--base"),
        "{stderr}"
    );
    assert!(!out.exists());
}

/// One stray `lora_A` tensor makes a checkpoint an adapter input; the refusal for
/// the missing adapter config names that tensor.
#[test]
fn a_lone_lora_a_tensor_is_named_in_the_refusal() {
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = tmp.path().join("run").join("model.safetensors");
    std::fs::create_dir(ckpt.parent().unwrap()).unwrap();
    let stray = "model.layers.0.self_attn.q_proj.lora_A.weight";
    f32_safetensors(
        &ckpt,
        &[
            ("model.embed_tokens.weight", &[1.0, 2.0]),
            (stray, &[0.5, 0.5]),
        ],
    );
    let out = tmp.path().join("out");
    let o = unshard(&[
        "merge",
        ckpt.to_str().unwrap(),
        out.to_str().unwrap(),
        "--weights-only",
    ]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("no adapter_config.json"), "{err}");
    assert!(
        err.contains(&format!("because of tensor '{stray}'")),
        "{err}"
    );
    assert!(!out.exists());
}
