//! LoRA options together: `unshard merge ADAPTER --base BASE` for every
//! combination of use_rslora, rank_pattern/alpha_pattern, fan_in_fan_out,
//! use_dora and modules_to_save that peft 0.21.2 accepts, on a Conv1D base
//! (GPT-2) and an nn.Linear one (Llama), and with both layer kinds in one
//! adapter (`fixtures/lora_combos/`, written by `fixtures/gen_lora_combos.py`).
//! Each output against peft's own `merge_and_unload()` of the same adapter: a
//! weight peft changed within one ulp in the output dtype, every other tensor
//! byte-identical; and `unshard verify` accepts it.
//!
//! A DoRA weight in float32 is allowed a few ulp more: peft's column norm
//! (`torch.linalg.norm` in float32) is at times one ulp off the correctly rounded
//! norm unshard computes (summed in float64), and the factor `m / norm` carries that
//! into every element of the channel. Two norms one ulp apart (2^-23 relative),
//! then the quotient and the product each rounded on both sides (2^-24 relative,
//! twice each), differ by at most 3 * 2^-23 relative, which is at most 6 ulp of
//! the result. A wrong scale, transpose or norm axis is off by far more.
#![allow(clippy::unwrap_used)]

mod common;

use std::process::Command;

use common::{fixtures, peft, text};

fn fx(rel: &str) -> String {
    fixtures().join(rel).to_string_lossy().into_owned()
}

/// How far a DoRA weight in float32 may be from peft's (see the module doc).
const DORA_F32_ULPS: i64 = 6;

#[test]
fn every_option_combination_merges_like_peft() {
    let all: serde_json::Value =
        serde_json::from_slice(&std::fs::read(fixtures().join("lora_combos/cases.json")).unwrap())
            .unwrap();
    let cases = all["cases"].as_array().unwrap();
    // 2 bases x 2^5 options, and the adapters mixing Conv1D and nn.Linear;
    // peft 0.21.2 refuses none of them.
    assert_eq!(cases.len(), 67);
    assert!(all["skipped"].as_array().unwrap().is_empty());
    let tmp = tempfile::tempdir().unwrap();
    let (mut inexact, mut failures) = (0, Vec::new());
    for case in cases {
        let name = case["name"].as_str().unwrap();
        let out = tmp.path().join(name);
        let (adapter, base) = (
            fx(case["adapter"].as_str().unwrap()),
            fx(case["base"].as_str().unwrap()),
        );
        let r = Command::new(env!("CARGO_BIN_EXE_unshard"))
            .args(["merge", &adapter, "--base", &base, "--output"])
            .arg(&out)
            .output()
            .unwrap();
        if !r.status.success() {
            failures.push(format!("{name}: {}", text(&r)));
            continue;
        }
        let expected = fixtures().join(case["expected_dir"].as_str().unwrap());
        let changed = peft::changed(&expected, &fixtures().join(case["base"].as_str().unwrap()));
        let dora = case["options"]["use_dora"].as_bool().unwrap();
        let ulps = |_: &str, dtype| match dtype {
            safetensors::Dtype::F32 if dora => DORA_F32_ULPS,
            _ => 1,
        };
        let compared = std::panic::catch_unwind(|| {
            peft::compare_within(&out, &expected, &changed, name, ulps)
        });
        match compared {
            Ok(n) => inexact += n,
            Err(e) => {
                let msg = e
                    .downcast_ref::<String>()
                    .cloned()
                    .unwrap_or_else(|| "panicked".into());
                failures.push(msg);
                continue;
            }
        }
        let v = Command::new(env!("CARGO_BIN_EXE_unshard"))
            .args(["verify"])
            .arg(&out)
            .args(["--against", &adapter, "--base", &base])
            .output()
            .unwrap();
        if !v.status.success() {
            failures.push(format!("{name}: verify: {}", text(&v)));
        }
        std::fs::remove_dir_all(&out).unwrap();
    }
    assert!(
        failures.is_empty(),
        "{} of {} cases differ from peft:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
    eprintln!("fused tensors not bit-identical to peft's: {inexact}");
}
