//! Hostile pickles: every route to os.system, subprocess, eval, exec and
//! `__import__` (REDUCE, NEWOBJ, NEWOBJ_EX, BUILD, INST, OBJ, STACK_GLOBAL) and
//! memo tricks, hand-assembled by `fixtures/gen_edge_cases.py` inside torch-style
//! archives (`fixtures/edge/hostile/manifest.json`). Under `torch.load(weights_only=
//! False)` most of them create a marker file; unshard must read the real tensor,
//! list the payload as an inert object, and create nothing.
#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::process::Command;

fn hostile_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/edge/hostile")
}

#[test]
fn no_payload_runs_and_the_real_tensor_is_read() {
    let manifest: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(hostile_dir().join("manifest.json")).unwrap(),
    )
    .unwrap();
    let files = manifest["files"].as_array().unwrap();
    assert!(files.len() >= 15);
    assert!(
        files
            .iter()
            .filter(|f| f["runs_under_torch_load"].as_bool().unwrap())
            .count()
            >= 10
    );
    let want: Vec<u8> = [1.0f32, 2.0, 3.0, 4.0]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    for f in files {
        let name = f["file"].as_str().unwrap();
        let marker = f["marker"].as_str().unwrap();
        let cwd = tempfile::tempdir().unwrap();
        let input = hostile_dir().join(name);
        let inspect = Command::new(env!("CARGO_BIN_EXE_unshard"))
            .args(["inspect", input.to_str().unwrap(), "--json"])
            .current_dir(cwd.path())
            .output()
            .unwrap();
        assert!(
            inspect.status.success(),
            "{name}: {}",
            String::from_utf8_lossy(&inspect.stderr)
        );
        let json: serde_json::Value = serde_json::from_slice(&inspect.stdout).unwrap();
        assert_eq!(json["tensors"][0]["name"], "w", "{name}");
        assert_eq!(json["non_tensor"][0]["name"], "evil", "{name}");

        let out = cwd.path().join("out");
        let merge = Command::new(env!("CARGO_BIN_EXE_unshard"))
            .args([
                "merge",
                input.to_str().unwrap(),
                "-o",
                out.to_str().unwrap(),
                "--weights-only",
                "-q",
            ])
            .current_dir(cwd.path())
            .output()
            .unwrap();
        assert!(
            merge.status.success(),
            "{name}: {}",
            String::from_utf8_lossy(&merge.stderr)
        );
        let bytes = std::fs::read(out.join("model.safetensors")).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        assert_eq!(st.names(), vec!["w"], "{name}");
        assert_eq!(st.tensor("w").unwrap().data(), &want[..], "{name}");

        assert!(!cwd.path().join(marker).exists(), "{name}: the payload ran");
        assert!(!Path::new(marker).exists(), "{name}: the payload ran");
    }
}

/// The bare pickles (without torch's container) are refused as "not torch.save",
/// never executed.
#[test]
fn bare_pickles_are_refused_without_running() {
    let cwd = tempfile::tempdir().unwrap();
    for e in std::fs::read_dir(hostile_dir()).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_none_or(|x| x != "pkl") {
            continue;
        }
        let o = Command::new(env!("CARGO_BIN_EXE_unshard"))
            .args(["inspect", p.to_str().unwrap()])
            .current_dir(cwd.path())
            .output()
            .unwrap();
        assert_eq!(o.status.code(), Some(1), "{}", p.display());
        assert!(String::from_utf8_lossy(&o.stderr).contains("pickle.dump, not torch.save"));
    }
    assert_eq!(std::fs::read_dir(cwd.path()).unwrap().count(), 0);
}
