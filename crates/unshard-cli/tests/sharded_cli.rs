//! The `unshard` binary on sharded checkpoints: a DCP directory, a verl rank
//! directory and an accelerate `checkpoint-N/` are taken as they are; a missing
//! rank is a clear failure that leaves nothing behind.
#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures")
}

fn unshard(args: &[&std::ffi::OsStr]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_unshard"))
        .args(args)
        .output()
        .unwrap()
}

fn merge(checkpoint: &Path, base: &Path, out: &Path) -> Output {
    unshard(&[
        "merge".as_ref(),
        checkpoint.as_os_str(),
        "--base".as_ref(),
        base.as_os_str(),
        "--output".as_ref(),
        out.as_os_str(),
        "--quiet".as_ref(),
    ])
}

#[test]
fn inspect_json_describes_global_tensors_and_their_sharding() {
    let out = unshard(&[
        "inspect".as_ref(),
        "--json".as_ref(),
        fixtures().join("sharded/llama_w3_dcp").as_os_str(),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["format"], "dcp");
    let tensors = v["tensors"].as_array().unwrap();
    assert_eq!(tensors.len(), 21);
    let embed = tensors
        .iter()
        .find(|t| t["name"] == "model.embed_tokens.weight")
        .unwrap();
    assert_eq!(embed["shape"], serde_json::json!([251, 64]));
    assert!(
        embed["layout"].as_str().unwrap().contains("3 chunks"),
        "{embed}"
    );

    let out = unshard(&[
        "inspect".as_ref(),
        fixtures().join("sharded/llama_hsdp_2x2_ranks").as_os_str(),
    ]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success());
    assert!(text.contains("per-rank"), "{text}");
    assert!(
        text.contains("DTensor (Replicate(), Shard(0)) on mesh [2, 2]"),
        "{text}"
    );
}

#[test]
fn merges_a_verl_rank_directory_and_an_accelerate_checkpoint_dir() {
    let tmp = tempfile::tempdir().unwrap();
    let expected = fixtures().join("expected/llama_policy_into_llama-bf16/model.safetensors");
    for input in ["sharded/llama_w2_ranks", "sharded/accelerate_dcp"] {
        let out = tmp.path().join(input.replace('/', "_"));
        let r = merge(
            &fixtures().join(input),
            &fixtures().join("models/llama-bf16"),
            &out,
        );
        assert!(
            r.status.success(),
            "{input}: {}",
            String::from_utf8_lossy(&r.stderr)
        );
        assert!(
            std::fs::read(out.join("model.safetensors")).unwrap()
                == std::fs::read(&expected).unwrap(),
            "{input}: model.safetensors differs from transformers' output"
        );
    }
}

#[test]
fn a_missing_rank_fails_naming_the_file_and_leaves_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    let r = merge(
        &fixtures().join("sharded/llama_w2_ranks_missing_rank"),
        &fixtures().join("models/llama-bf16"),
        &out,
    );
    assert_eq!(r.status.code(), Some(1));
    let err = String::from_utf8_lossy(&r.stderr);
    assert!(
        err.contains("error:") && err.contains("model_world_size_2_rank_1.pt"),
        "{err}"
    );
    assert!(err.contains("hint:"), "{err}");
    assert_eq!(
        std::fs::read_dir(tmp.path()).unwrap().count(),
        0,
        "left files behind"
    );
}

/// Runs `unshard merge` with the open-files limit set to `soft` and `hard`.
fn merge_with_file_limit(
    checkpoint: &Path,
    base: &Path,
    out: &Path,
    soft: u64,
    hard: u64,
) -> Output {
    use std::os::unix::process::CommandExt;
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_unshard"));
    cmd.arg("merge")
        .arg(checkpoint)
        .arg("--base")
        .arg(base)
        .arg("--output")
        .arg(out)
        .arg("--quiet");
    // SAFETY: fcntl and setrlimit are async-signal-safe; fcntl only sets a flag of
    // descriptors this child holds, setrlimit only reads the struct it is given.
    unsafe {
        cmd.pre_exec(move || {
            // Descriptors this process inherited (from a test harness, a build tool)
            // would count against the limit and leave the merge fewer than the test
            // means to give it (3 and 4 taken: the loader itself fails, EMFILE).
            // They are closed at the exec; the merge starts with stdin, stdout and
            // stderr alone.
            for fd in 3..1024 {
                libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC);
            }
            let lim = libc::rlimit {
                rlim_cur: soft,
                rlim_max: hard,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &lim) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    cmd.output().unwrap()
}

#[test]
fn a_checkpoint_of_more_files_than_the_open_file_limit_merges() {
    // Three rank files, kept open, beside stdin, stdout and stderr: 6 descriptors.
    let dcp = fixtures().join("sharded/llama_w3_dcp");
    let base = fixtures().join("models/llama-bf16");
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    let r = merge_with_file_limit(&dcp, &base, &out, 5, 256);
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    assert!(out.join("model.safetensors").is_file());

    let whole = std::fs::read(out.join("model.safetensors")).unwrap();

    // A hard limit that leaves fewer descriptors for inputs than there are rank
    // files (17 leaves one): they are opened on demand, and the output is the same.
    let out = tmp.path().join("out_pooled");
    let r = merge_with_file_limit(&dcp, &base, &out, 17, 17);
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    assert_eq!(std::fs::read(out.join("model.safetensors")).unwrap(), whole);

    // A hard limit too low for even that: an error that says what to raise, and
    // nothing written.
    let out = tmp.path().join("out2");
    let r = merge_with_file_limit(&dcp, &base, &out, 5, 5);
    assert_eq!(r.status.code(), Some(1));
    let err = String::from_utf8_lossy(&r.stderr);
    assert!(err.contains("__") && err.contains(".distcp"), "{err}");
    assert!(err.contains("ulimit -n"), "{err}");
    assert!(!out.exists());
    let left: Vec<_> = std::fs::read_dir(tmp.path()).unwrap().collect();
    assert_eq!(left.len(), 2, "only the first outputs: {left:?}");
}

/// Eight ranks of FSDP2 (`fixtures/gen_dcp_wide.py`): chunk archives of several
/// structures (1-D and 2-D, shapes on both sides of 256) in every rank file merge
/// bit-exactly to what transformers saves for the same weights.
#[test]
fn a_dcp_checkpoint_of_archives_of_several_structures_merges_bit_exactly() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    let r = merge_with_file_limit(
        &fixtures().join("sharded/llama_w8_dcp"),
        &fixtures().join("models/llama-bf16"),
        &out,
        1024,
        1024,
    );
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    let expected = fixtures().join("expected/llama_policy_into_llama-bf16/model.safetensors");
    assert_eq!(
        std::fs::read(out.join("model.safetensors")).unwrap(),
        std::fs::read(expected).unwrap()
    );
}

/// A copy of `llama_w8_dcp` in a new temporary directory, to change.
fn copy_of_w8_dcp() -> (tempfile::TempDir, PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let dcp = tmp.path().join("dcp");
    std::fs::create_dir(&dcp).unwrap();
    for e in std::fs::read_dir(fixtures().join("sharded/llama_w8_dcp")).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), dcp.join(e.file_name())).unwrap();
    }
    (tmp, dcp)
}

/// One chunk archive, in the middle of a rank file, laid out unlike the others of
/// its structure but holding the same tensor (its records renamed): the merge
/// parses it in full instead of taking it from the template of its structure, and
/// writes the same bytes as transformers.
#[test]
fn an_archive_unlike_the_others_of_its_structure_merges_bit_exactly() {
    let (tmp, dcp) = copy_of_w8_dcp();
    let rank = dcp.join("__3_0.distcp");
    let mut bytes = std::fs::read(&rank).unwrap();
    let names: Vec<usize> = bytes
        .windows(16)
        .enumerate()
        .filter(|(_, w)| w == b"archive/data.pkl")
        .map(|(i, _)| i)
        .collect();
    // Local header and central directory name each pickle: the middle archive's
    // records run from its local header to the next archive's.
    let starts: Vec<usize> = names
        .iter()
        .filter(|&&i| i >= 30 && bytes[i - 30..].starts_with(b"PK\x03\x04"))
        .map(|&i| i - 30)
        .collect();
    let k = starts.len() / 2;
    let archive = &mut bytes[starts[k]..starts[k + 1]];
    let mut renamed = 0;
    for i in 0..archive.len() - 8 {
        if &archive[i..i + 8] == b"archive/" {
            archive[i + 6] = b'X';
            renamed += 1;
        }
    }
    assert!(renamed >= 8, "{renamed}");
    std::fs::write(&rank, &bytes).unwrap();
    let out = tmp.path().join("out");
    let r = Command::new(env!("CARGO_BIN_EXE_unshard"))
        .arg("merge")
        .arg(&dcp)
        .arg("--base")
        .arg(fixtures().join("models/llama-bf16"))
        .arg("--output")
        .arg(&out)
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&r.stderr);
    assert!(r.status.success(), "{said}");
    let expected = fixtures().join("expected/llama_policy_into_llama-bf16/model.safetensors");
    assert_eq!(
        std::fs::read(out.join("model.safetensors")).unwrap(),
        std::fs::read(expected).unwrap()
    );
    let left: Vec<_> = std::fs::read_dir(tmp.path()).unwrap().collect();
    assert_eq!(left.len(), 2, "no staging left behind: {left:?}");
}

/// One chunk archive damaged in the middle of a rank file, between archives of the
/// same structure: the merge fails naming the file, and writes nothing.
#[test]
fn a_damaged_archive_among_many_alike_is_caught() {
    let (tmp, dcp) = copy_of_w8_dcp();
    let rank = dcp.join("__3_0.distcp");
    let mut bytes = std::fs::read(&rank).unwrap();
    let pickles: Vec<usize> = bytes
        .windows(8)
        .enumerate()
        .filter(|(_, w)| w == b"data.pkl")
        .map(|(i, _)| i)
        .collect();
    // Local header and central directory name each pickle: take the middle archive's.
    assert!(pickles.len() > 20, "{}", pickles.len());
    let name = pickles[pickles.len() / 2];
    let start = name
        + bytes[name..]
            .windows(2)
            .position(|w| w == b"\x80\x02")
            .unwrap();
    bytes[start + 12] ^= 0x20;
    std::fs::write(&rank, &bytes).unwrap();
    let out = tmp.path().join("out");
    let r = merge_with_file_limit(
        &dcp,
        &fixtures().join("models/llama-bf16"),
        &out,
        1024,
        1024,
    );
    let err = String::from_utf8_lossy(&r.stderr);
    assert_eq!(r.status.code(), Some(1), "{err}");
    assert!(err.contains("__3_0.distcp"), "{err}");
    assert!(!out.exists());
}
