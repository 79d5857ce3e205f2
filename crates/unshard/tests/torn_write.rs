//! `merge --verify` against a disk that does not store what it is given: an output
//! sink whose shard files write one byte other than the one handed to them (a torn
//! or corrupted write). The checksums the writer took from its buffers must name
//! the file and the block, and nothing may be committed.
#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};

use unshard::merge::{self, MergeOptions};
use unshard::write::{NoProgress, ShardFile, Sink, StagingDir};
use unshard::Result;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures")
}

/// Shard files that store byte `at` of every file xor `mask`.
struct Torn {
    inner: StagingDir,
    at: u64,
    mask: u8,
}

struct TornFile {
    inner: Box<dyn ShardFile>,
    at: u64,
    mask: u8,
}

impl ShardFile for TornFile {
    fn write_block(&self, buf: &[u8], offset: u64) -> Result<()> {
        let end = offset + buf.len() as u64;
        if (offset..end).contains(&self.at) {
            let mut bad = buf.to_vec();
            bad[(self.at - offset) as usize] ^= self.mask;
            return self.inner.write_at(&bad, offset);
        }
        self.inner.write_block(buf, offset)
    }

    fn write_at(&self, buf: &[u8], offset: u64) -> Result<()> {
        self.inner.write_at(buf, offset)
    }

    fn finish(&self) -> Result<()> {
        self.inner.finish()
    }

    fn local_path(&self) -> Option<&Path> {
        self.inner.local_path()
    }
}

impl Sink for Torn {
    fn create_shard(&self, name: &str, size: u64) -> Result<Box<dyn ShardFile>> {
        Ok(Box::new(TornFile {
            inner: self.inner.create_shard(name, size)?,
            at: self.at,
            mask: self.mask,
        }))
    }

    fn write_file(&self, name: &str, bytes: &[u8]) -> Result<()> {
        self.inner.write_file(name, bytes)
    }

    fn copy_file(&self, name: &str, from: &Path) -> Result<bool> {
        self.inner.copy_file(name, from)
    }

    fn staged_dir(&self) -> Option<&Path> {
        self.inner.staged_dir()
    }

    fn commit(self: Box<Self>) -> Result<()> {
        Box::new(self.inner).commit()
    }
}

fn options(out: &Path) -> MergeOptions {
    MergeOptions {
        checkpoint: fixtures().join("ckpt/llama_policy.pt"),
        base: Some(fixtures().join("models/llama-bf16")),
        output: out.to_path_buf(),
        verify: true,
        ..MergeOptions::default()
    }
}

/// Merges through a sink that flips byte `at` with `mask`.
fn merge_torn(out: &Path, at: u64, mask: u8) -> Result<merge::MergeReport> {
    let open = || -> Result<Box<dyn Sink>> {
        Ok(Box::new(Torn {
            inner: StagingDir::create(out)?,
            at,
            mask,
        }))
    };
    merge::merge_into(&options(out), &NoProgress, &open)
}

#[test]
fn a_block_stored_other_than_written_fails_the_verify_and_names_the_file() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    // A sink that stores what it is given verifies, checksums included.
    let ok = merge_torn(&out, u64::MAX, 0).unwrap();
    let report = ok.verified.unwrap();
    assert!(report.files_checksummed >= 3, "{}", report.summary());
    std::fs::remove_dir_all(&out).unwrap();

    // A byte of the header's padding: JSON whitespace, so the header still parses
    // to the same tensors and every value still compares equal; only the checksum
    // sees it. (transformers pads the header with spaces to a multiple of 8.)
    let header_len = {
        let good = tmp.path().join("good");
        merge::merge(
            &MergeOptions {
                verify: false,
                ..options(&good)
            },
            &NoProgress,
        )
        .unwrap();
        let bytes = std::fs::read(good.join("model.safetensors")).unwrap();
        let n = u64::from_le_bytes(bytes[..8].try_into().unwrap());
        assert_eq!(bytes[8 + n as usize - 1], b' ', "no padding to change");
        n
    };
    // ' ' ^ ('\t' ^ ' ') = '\t'
    let err = merge_torn(&out, 8 + header_len - 1, b' ' ^ b'\t').unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("model.safetensors: 1 block(s) read back differ from what was written, the first at bytes 0..")
            && msg.contains("a torn or corrupted write"),
        "{msg}"
    );
    assert!(!out.exists(), "a failed verify committed the output");
    assert_eq!(
        std::fs::read_dir(tmp.path()).unwrap().count(),
        1,
        "left behind"
    );

    // A byte of tensor data: the values differ too, and both are said.
    let err = merge_torn(&out, 8 + header_len + 5, 0x40).unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("read back differ from what was written"),
        "{msg}"
    );
    assert!(
        msg.contains("hold other values than the checkpoint"),
        "{msg}"
    );
    assert!(!out.exists());
}

/// The defined checksum, computed here from the file as written in one go: its
/// BLAKE3 hash.
/// Lower-case hexadecimal, as checksums are recorded.
fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn checksum_of(path: &Path) -> [u8; 32] {
    blake3::hash(&std::fs::read(path).unwrap()).into()
}

/// Hashing costs about a core-second per GB written, so a merge hashes only when
/// something uses the checksums: `unshard.json` or `--verify`.
#[test]
fn blocks_are_hashed_only_when_a_manifest_or_verify_uses_them() {
    let tmp = tempfile::tempdir().unwrap();
    for (no_manifest, verify, hashed) in [
        (false, false, true),
        (true, true, true),
        (true, false, false),
    ] {
        let out = tmp.path().join(format!("out-{no_manifest}-{verify}"));
        let o = merge::merge(
            &MergeOptions {
                no_manifest,
                verify,
                ..options(&out)
            },
            &NoProgress,
        )
        .unwrap();
        let i = o
            .files
            .iter()
            .position(|f| f == "model.safetensors")
            .unwrap();
        let tree = o.checksums[i].clone();
        if hashed {
            assert_eq!(
                tree,
                Some(hex(&checksum_of(&out.join("model.safetensors")))),
                "no_manifest {no_manifest}, verify {verify}"
            );
        } else {
            assert_eq!(tree, None, "hashed without a use for it");
        }
    }
}
