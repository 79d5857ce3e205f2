//! Helpers shared by the CLI integration tests.
#![allow(dead_code, clippy::unwrap_used)]

pub mod peft;
pub mod s3;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// Runs the `unshard` binary with `args` in `dir`.
pub fn unshard_in<S: AsRef<std::ffi::OsStr>>(dir: &Path, args: &[S]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_unshard"))
        .args(args)
        .current_dir(dir)
        .output()
        .unwrap()
}

/// What a run printed, stdout then stderr.
pub fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// The committed fixtures directory.
pub fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures")
}

/// A directory's file names, sorted.
pub fn names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

/// The files of a merged directory that transformers writes too: `names` without
/// unshard's own record of the merge (`unshard.json`), which must be there.
pub fn model_names(dir: &Path) -> Vec<String> {
    let v = names(dir);
    assert!(
        v.iter().any(|n| n == "unshard.json"),
        "no unshard.json in {}",
        dir.display()
    );
    v.into_iter().filter(|n| n != "unshard.json").collect()
}

/// A tmpfs mounted at `dir` (with `opts` such as `size=64k` or `ro,size=64k`),
/// unmounted on drop. `None` where mounting is not permitted (not root).
pub struct Tmpfs(PathBuf);

impl Tmpfs {
    pub fn mount(dir: &Path, opts: &str) -> Option<Tmpfs> {
        std::fs::create_dir_all(dir).unwrap();
        let ok = Command::new("mount")
            .args(["-t", "tmpfs", "-o", opts, "tmpfs", dir.to_str().unwrap()])
            .status()
            .map(|s| s.success())
            .unwrap_or(false);
        ok.then(|| Tmpfs(dir.to_path_buf()))
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
    }
}

/// What an ignored test needs from the machine (root to mount, a tool). Such tests
/// are `#[ignore]`d with the reason, so that `cargo test` counts them as not run;
/// run with `--ignored` (as `.ci/run` does), a missing requirement is a failure.
/// docs/testing.md lists these tests.
pub fn require<T>(got: Option<T>, what: &str) -> T {
    match got {
        Some(v) => v,
        None => {
            let test = std::thread::current()
                .name()
                .unwrap_or("this test")
                .to_string();
            panic!("{test}: cannot {what} here (docs/testing.md says what this test needs)")
        }
    }
}

/// A float32 safetensors checkpoint of `n` tensors of 1 Mi elements (4 MiB each),
/// so that merging it to bfloat16 takes `n` windows.
pub fn big_checkpoint(dir: &Path, n: usize) -> PathBuf {
    let data: Vec<u8> = (0..(1u32 << 20))
        .flat_map(|i| (i as f32 * 0.001).to_le_bytes())
        .collect();
    let names: Vec<String> = (0..n).map(|i| format!("layers.{i}.weight")).collect();
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = names
        .iter()
        .map(|name| {
            (
                name.clone(),
                safetensors::tensor::TensorView::new(
                    safetensors::Dtype::F32,
                    vec![1024, 1024],
                    &data,
                )
                .unwrap(),
            )
        })
        .collect();
    let path = dir.join("big.safetensors");
    safetensors::serialize_to_file(views, None, &path).unwrap();
    path
}

/// A float32 safetensors file of the given tensors (name, values), each 1-D.
pub fn f32_safetensors(path: &Path, tensors: &[(&str, &[f32])]) {
    let bytes: Vec<Vec<u8>> = tensors
        .iter()
        .map(|(_, v)| v.iter().flat_map(|x| x.to_le_bytes()).collect())
        .collect();
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
        .iter()
        .zip(&bytes)
        .map(|((name, v), b)| {
            (
                name.to_string(),
                safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![v.len()], b)
                    .unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, path).unwrap();
}
