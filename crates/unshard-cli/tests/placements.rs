//! DTensor placements beyond FSDP's row shards, from a real 4-process run
//! (`fixtures/gen_placements.py`): column shards, empty shards, a replicated 0-d
//! tensor, 2-D blocks, one dim split by two mesh dims, and shard-plus-replicate.
//! Merged without a base, per-rank files and the DCP directory must both give back
//! exactly the full tensors torch reported (`full.safetensors`).
#![allow(clippy::unwrap_used)]

use std::path::Path;
use std::process::Command;

#[test]
fn every_placement_reassembles_to_the_full_tensor() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/placements");
    let want_bytes = std::fs::read(dir.join("full.safetensors")).unwrap();
    let want = safetensors::SafeTensors::deserialize(&want_bytes).unwrap();
    for input in ["ranks", "dcp"] {
        let tmp = tempfile::tempdir().unwrap();
        let out = tmp.path().join("out");
        let o = Command::new(env!("CARGO_BIN_EXE_unshard"))
            .args([
                "merge",
                dir.join(input).to_str().unwrap(),
                "-o",
                out.to_str().unwrap(),
                "--weights-only",
                "-q",
            ])
            .output()
            .unwrap();
        assert!(
            o.status.success(),
            "{input}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        let got_bytes = std::fs::read(out.join("model.safetensors")).unwrap();
        let got = safetensors::SafeTensors::deserialize(&got_bytes).unwrap();
        let mut names = got.names();
        names.sort();
        let mut want_names = want.names();
        want_names.sort();
        assert_eq!(names, want_names, "{input}");
        for n in want_names {
            let (a, b) = (got.tensor(n).unwrap(), want.tensor(n).unwrap());
            assert_eq!(a.dtype(), b.dtype(), "{input}: {n}");
            assert_eq!(a.shape(), b.shape(), "{input}: {n}");
            assert_eq!(a.data(), b.data(), "{input}: {n}");
        }
    }
}
