//! Reading commands on the hostile corpus (`fixtures/hostile/`, see
//! `fixtures/gen_hostile.py`): `merge` warns, naming the file and each callable, and
//! writes the tensor torch.load returns (even with `--quiet`); `--refuse-unsafe` and
//! `--strict` refuse and write nothing; `inspect` lists the calls in a section of
//! their own and in the `unsafe` array of `--json`; archive ambiguities are errors;
//! deflated records are read; nothing runs and nothing stalls.
#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn hostile_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/hostile")
}

fn cases() -> Vec<serde_json::Value> {
    let text = std::fs::read_to_string(hostile_dir().join("manifest.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    v["cases"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c["file"].as_str().unwrap().ends_with(".pt"))
        .cloned()
        .collect()
}

fn unshard(args: &[&str], cwd: &Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_unshard"))
        .args(args)
        .current_dir(cwd)
        .output()
        .unwrap()
}

fn f32s(values: &serde_json::Value) -> Vec<u8> {
    values
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|v| (v.as_f64().unwrap() as f32).to_le_bytes())
        .collect()
}

#[test]
fn merge_warns_about_every_payload_writes_the_weights_and_refuses_when_asked() {
    let mut warned = 0;
    for c in cases() {
        let (file, expect) = (c["file"].as_str().unwrap(), c["expect"].as_str().unwrap());
        // The tensor torch.load returns for 'w', where it loads the file.
        let Some(w) = c["torch_load"]["w"]
            .as_array()
            .map(|_| &c["torch_load"]["w"])
        else {
            continue;
        };
        if expect != "unsafe" {
            continue;
        }
        let input = hostile_dir().join(file);
        let input = input.to_str().unwrap();
        let cwd = tempfile::tempdir().unwrap();
        let out = cwd.path().join("out");
        let o = unshard(
            &[
                "merge",
                input,
                "-o",
                out.to_str().unwrap(),
                "--weights-only",
                "-q",
            ],
            cwd.path(),
        );
        let stderr = String::from_utf8_lossy(&o.stderr);
        assert!(o.status.success(), "{file}: {stderr}");
        // Named, despite --quiet.
        assert!(
            stderr.contains("warning: ") && stderr.contains(input),
            "{file}: {stderr}"
        );
        for want in c["callables"].as_array().unwrap() {
            assert!(
                stderr.contains(want.as_str().unwrap()),
                "{file}: {want}: {stderr}"
            );
        }
        let bytes = std::fs::read(out.join("model.safetensors")).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        assert_eq!(st.tensor("w").unwrap().data(), &f32s(w)[..], "{file}");
        // Recorded in the output's unshard.json, each call with its file.
        let manifest: serde_json::Value =
            serde_json::from_slice(&std::fs::read(out.join("unshard.json")).unwrap()).unwrap();
        let recorded = manifest["unsafe_calls"].as_array().unwrap();
        let abs = std::fs::canonicalize(input).unwrap();
        for want in c["callables"].as_array().unwrap() {
            assert!(
                recorded.iter().any(|r| {
                    r["callable"]
                        .as_str()
                        .unwrap()
                        .contains(want.as_str().unwrap())
                        && Path::new(r["file"].as_str().unwrap()) == abs
                }),
                "{file}: {want}: {recorded:?}"
            );
        }
        // And in `--json`'s warnings, as data naming the file.
        let o = unshard(
            &[
                "merge",
                input,
                "-o",
                cwd.path().join("json").to_str().unwrap(),
                "--weights-only",
                "--json",
            ],
            cwd.path(),
        );
        assert!(o.status.success(), "{file}");
        let report: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        let unsafe_warning = report["warnings"]
            .as_array()
            .unwrap()
            .iter()
            .find(|w| w["kind"] == "unsafe_pickle")
            .unwrap_or_else(|| panic!("{file}: {}", report["warnings"]));
        assert_eq!(unsafe_warning["file"], input, "{file}");
        for want in c["callables"].as_array().unwrap() {
            let want = want.as_str().unwrap();
            assert!(
                unsafe_warning["message"].as_str().unwrap().contains(want),
                "{file}: {want}: {unsafe_warning}"
            );
        }
        std::fs::remove_dir_all(cwd.path().join("json")).unwrap();

        for flag in ["--refuse-unsafe", "--strict"] {
            let refused = cwd.path().join("refused");
            let o = unshard(
                &[
                    "merge",
                    input,
                    "-o",
                    refused.to_str().unwrap(),
                    "--weights-only",
                    "-q",
                    flag,
                ],
                cwd.path(),
            );
            let stderr = String::from_utf8_lossy(&o.stderr);
            assert_eq!(o.status.code(), Some(1), "{file} {flag}: {stderr}");
            assert!(stderr.contains("refusing"), "{file} {flag}: {stderr}");
            assert!(!refused.exists(), "{file} {flag}: output written");
        }
        let marker = c["marker"].as_str().unwrap();
        let mut left: Vec<_> = std::fs::read_dir(cwd.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        left.sort();
        assert_eq!(left, ["out"], "{file}: {marker}");
        warned += 1;
    }
    // Every payload route whose file torch.load reads: discarded results, metrics,
    // keys, BUILD _metadata, backward hooks, chains, nested loads, legacy pickles,
    // EXT chains, BUILD __setstate__.
    assert!(warned >= 18, "{warned}");
}

#[test]
fn inspect_lists_the_calls_in_text_and_json() {
    let mut seen = 0;
    for c in cases() {
        let (file, expect) = (c["file"].as_str().unwrap(), c["expect"].as_str().unwrap());
        if expect != "unsafe" || c["torch_load"]["w"].is_null() {
            continue;
        }
        let input = hostile_dir().join(file);
        let cwd = tempfile::tempdir().unwrap();
        let text = unshard(&["inspect", input.to_str().unwrap()], cwd.path());
        let json = unshard(&["inspect", input.to_str().unwrap(), "--json"], cwd.path());
        assert!(text.status.success() && json.status.success(), "{file}");
        assert!(
            !text.stdout.contains(&0x1b),
            "{file}: raw ESC in the output"
        );
        let text = String::from_utf8_lossy(&text.stdout);
        let section = text
            .split_once("would run under torch.load")
            .map(|(_, s)| s)
            .unwrap_or_else(|| panic!("{file}: no section: {text}"));
        let v: serde_json::Value = serde_json::from_slice(&json.stdout).unwrap();
        let calls = v["unsafe"].as_array().unwrap();
        for want in c["callables"].as_array().unwrap() {
            let want = want.as_str().unwrap();
            assert!(section.contains(want), "{file}: {want}: {section}");
            assert!(
                calls
                    .iter()
                    .any(|u| u["callable"].as_str().unwrap().contains(want)),
                "{file}: {want}: {calls:?}"
            );
        }
        for u in calls {
            assert!(
                u["offset"].as_u64().is_some() && u["route"].is_string() && u["entry"].is_string()
            );
        }
        seen += 1;
    }
    assert!(seen >= 18, "{seen}");
}

#[test]
fn a_clean_file_gets_no_warning_and_an_empty_unsafe_array() {
    let cwd = tempfile::tempdir().unwrap();
    let clean = hostile_dir().join("clean.pt");
    let out = cwd.path().join("out");
    let o = unshard(
        &[
            "merge",
            clean.to_str().unwrap(),
            "-o",
            out.to_str().unwrap(),
            "--weights-only",
            "--refuse-unsafe",
        ],
        cwd.path(),
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(!String::from_utf8_lossy(&o.stderr).contains("torch.load"));
    let j = unshard(&["inspect", clean.to_str().unwrap(), "--json"], cwd.path());
    let v: serde_json::Value = serde_json::from_slice(&j.stdout).unwrap();
    assert_eq!(v["unsafe"], serde_json::json!([]));
}

#[test]
fn archive_ambiguities_are_errors_and_deflated_records_are_read() {
    let cwd = tempfile::tempdir().unwrap();
    for c in cases() {
        let file = c["file"].as_str().unwrap();
        let input = hostile_dir().join(file);
        let out = cwd.path().join("out");
        let o = unshard(
            &[
                "merge",
                input.to_str().unwrap(),
                "-o",
                out.to_str().unwrap(),
                "--weights-only",
                "-q",
            ],
            cwd.path(),
        );
        let stderr = String::from_utf8_lossy(&o.stderr);
        match c["expect"].as_str().unwrap() {
            "error" => {
                assert_eq!(o.status.code(), Some(1), "{file}: {stderr}");
                assert!(stderr.contains(file), "{file}: {stderr}");
                assert!(!out.exists(), "{file}");
            }
            "clean" => {
                assert!(o.status.success(), "{file}: {stderr}");
                let bytes = std::fs::read(out.join("model.safetensors")).unwrap();
                let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
                let w = &c["torch_load"]["w"];
                let name = st.names().into_iter().find(|n| n.ends_with('w')).unwrap();
                assert_eq!(st.tensor(name).unwrap().data(), &f32s(w)[..], "{file}");
                std::fs::remove_dir_all(&out).unwrap();
            }
            _ => {
                let _ = std::fs::remove_dir_all(&out);
            }
        }
    }
}

#[test]
fn the_memo_dag_and_getattr_chains_do_not_stall() {
    let cwd = tempfile::tempdir().unwrap();
    for file in [
        "memo_dag.pt",
        "getattr_chain.pt",
        "legacy_getattr_chains.pt",
    ] {
        let input = hostile_dir().join(file);
        let start = std::time::Instant::now();
        let o = unshard(&["inspect", input.to_str().unwrap()], cwd.path());
        // Milliseconds now; the DAG took 19 s (debug build) when the search walked
        // every path, and days at 4.5 KB.
        assert!(
            start.elapsed().as_secs() < 5,
            "{file}: {:?}",
            start.elapsed()
        );
        assert!(o.status.code().is_some(), "{file}: killed by a signal");
    }
}

#[test]
fn a_file_unshard_cannot_merge_still_names_its_payload() {
    // Files torch.load fails on after running the payload (persistent id,
    // _rebuild_from_type_v2, getattr chains): whatever merge makes of them, the
    // calls are named.
    let mut seen = 0;
    for c in cases() {
        let file = c["file"].as_str().unwrap();
        if c["expect"] != "unsafe" || !c["torch_load"]["w"].is_null() {
            continue;
        }
        let input = hostile_dir().join(file);
        let cwd = tempfile::tempdir().unwrap();
        let out = cwd.path().join("out");
        let o = unshard(
            &[
                "merge",
                input.to_str().unwrap(),
                "-o",
                out.to_str().unwrap(),
                "--weights-only",
                "-q",
            ],
            cwd.path(),
        );
        let stderr = String::from_utf8_lossy(&o.stderr);
        for want in c["callables"].as_array().unwrap() {
            assert!(
                stderr.contains(want.as_str().unwrap()),
                "{file}: {want}: {stderr}"
            );
        }
        assert!(!cwd.path().join(c["marker"].as_str().unwrap()).exists());
        seen += 1;
    }
    assert!(seen >= 4, "{seen}");
}

#[test]
fn payloads_in_dcp_items_and_base_weights_are_named() {
    let cwd = tempfile::tempdir().unwrap();
    // A DCP checkpoint whose non-tensor item is a payload.
    let dcp = hostile_dir().join("dcp_payload");
    let o = unshard(&["inspect", dcp.to_str().unwrap(), "--json"], cwd.path());
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let calls = v["unsafe"].as_array().unwrap();
    assert!(
        calls.iter().any(|u| u["callable"] == "posix.system"),
        "{calls:?}"
    );
    // A base directory whose pytorch_model.bin carries one: merge names it.
    let base = cwd.path().join("base");
    std::fs::create_dir(&base).unwrap();
    std::fs::copy(
        hostile_dir().join("metrics_os_system.pt"),
        base.join("pytorch_model.bin"),
    )
    .unwrap();
    let out = cwd.path().join("out");
    let clean = hostile_dir().join("clean.pt");
    let o = unshard(
        &[
            "merge",
            clean.to_str().unwrap(),
            "--base",
            base.to_str().unwrap(),
            "-o",
            out.to_str().unwrap(),
            "-q",
            "--refuse-unsafe",
        ],
        cwd.path(),
    );
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("pytorch_model.bin") && stderr.contains("posix.system"),
        "{stderr}"
    );
    assert!(!out.exists());
}

#[test]
fn a_payload_entry_is_an_inert_object_naming_its_callable() {
    let cwd = tempfile::tempdir().unwrap();
    for (file, key, want) in [
        (
            "escape_key.pt",
            "evil",
            "object posix.system (not executed)",
        ),
        (
            "partial.pt",
            "cb",
            "object functools.partial(posix.system)(...) (not executed)",
        ),
    ] {
        let input = hostile_dir().join(file);
        let o = unshard(&["inspect", input.to_str().unwrap(), "--json"], cwd.path());
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        let entry = v["non_tensor"]
            .as_array()
            .unwrap()
            .iter()
            .find(|e| e["name"] == key)
            .unwrap_or_else(|| panic!("{file}: {v}"));
        assert_eq!(entry["kind"], want, "{file}");
    }
}
