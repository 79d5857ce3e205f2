//! The command line itself: help texts, exit codes, the panic message, shell
//! completions, the man page, argument spellings and the progress output.
#![allow(clippy::unwrap_used)]

mod common;

use std::process::{Command, Output};

use common::fixtures;

fn unshard(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_unshard"))
        .args(args)
        .current_dir(fixtures())
        .output()
        .unwrap()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// A panic prints a short request for a bug report naming the version and the
/// place, not Rust's raw message and backtrace note.
#[test]
fn a_panic_asks_for_a_bug_report() {
    let o = Command::new(env!("CARGO_BIN_EXE_unshard"))
        .args(["inspect", "ckpt/llama_policy.pt"])
        .current_dir(fixtures())
        .env("UNSHARD_TEST_PANIC", "1")
        .env_remove("RUST_BACKTRACE")
        .output()
        .unwrap();
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(101), "{err}");
    assert!(err.contains("this is a bug"), "{err}");
    assert!(
        err.contains(&format!("unshard {}", env!("CARGO_PKG_VERSION"))),
        "{err}"
    );
    assert!(err.contains("src/main.rs:"), "no location: {err}");
    assert!(err.contains("hint: please report it at https://"), "{err}");
    assert!(!err.contains("RUST_BACKTRACE"), "{err}");
    assert!(err.lines().count() <= 4, "{err}");
}

/// Every command maps its outcome the same way: 0 done or identical, 1 failed or
/// different, 2 a wrong command line (ours or clap's).
#[test]
fn exit_codes_are_0_1_2_across_commands() {
    let same = unshard(&["diff", "ckpt/llama_policy.pt", "ckpt/llama_policy.pt"]);
    assert_eq!(same.status.code(), Some(0), "{}", stderr(&same));
    let differ = unshard(&["diff", "ckpt/llama_policy.pt", "ckpt/llama_nan.pt"]);
    assert_eq!(differ.status.code(), Some(1), "{}", stderr(&differ));
    assert!(stdout(&differ).contains("A and B differ"));
    let missing = unshard(&["inspect", "no/such/file.pt"]);
    assert_eq!(missing.status.code(), Some(1));
    assert!(
        stderr(&missing).starts_with("error: "),
        "{}",
        stderr(&missing)
    );
    let bad_flag = unshard(&["inspect", "--no-such-flag", "ckpt/llama_policy.pt"]);
    assert_eq!(bad_flag.status.code(), Some(2));
    let bad_value = unshard(&[
        "verify",
        "x",
        "--against",
        "ckpt/llama_policy.pt",
        "--max-shard-size",
        "lots",
    ]);
    assert_eq!(bad_value.status.code(), Some(2), "{}", stderr(&bad_value));
    assert!(stderr(&bad_value).contains("--max-shard-size 'lots'"));
}
