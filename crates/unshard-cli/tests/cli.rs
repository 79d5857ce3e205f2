//! The command line itself: help texts, exit codes, the panic message, shell
//! completions, the man page, argument spellings and the progress output.
#![allow(clippy::unwrap_used)]

mod common;

use std::path::Path;
use std::process::{Command, Output, Stdio};

use common::{big_checkpoint, f32_safetensors, fixtures, names, require};

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
    assert!(
        err.contains("unshard-cli/src/lib.rs:"),
        "no location: {err}"
    );
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

/// The dtype of `tensor` in the single-shard output `dir`.
fn written_dtype(dir: &Path, tensor: &str) -> String {
    let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    format!("{:?}", st.tensor(tensor).unwrap().dtype())
}

#[test]
fn quiet_keeps_warnings_and_drops_the_summary() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("q");
    let o = unshard(&[
        "merge",
        "ckpt/llama_nan.pt",
        out.to_str().unwrap(),
        "--weights-only",
        "-q",
    ]);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(0), "{err}");
    assert!(
        err.contains(
            "warning: tensor 'model.layers.1.self_attn.v_proj.weight' holds 2 NaN and 2 inf value(s)"
        ),
        "{err}"
    );
    assert!(err.contains("warning: no config.json"), "{err}");
    assert!(!err.contains("wrote "), "{err}");
    assert!(!err.contains("tensors: "), "{err}");
    // Without -q the same warnings, plus the summary.
    let loud = unshard(&[
        "merge",
        "ckpt/llama_nan.pt",
        tmp.path().join("l").to_str().unwrap(),
        "--weights-only",
    ]);
    let loud = stderr(&loud);
    assert!(loud.contains("wrote "), "{loud}");
    for line in err.lines() {
        assert!(loud.contains(line), "{line} missing from {loud}");
    }
}

#[test]
fn dtype_accepts_the_usual_spellings_in_any_case() {
    let tmp = tempfile::tempdir().unwrap();
    let name = "model.layers.0.mlp.up_proj.weight";
    for (i, (spelling, want)) in [
        ("bf16", "BF16"),
        ("BF16", "BF16"),
        ("torch.bfloat16", "BF16"),
        ("BFloat16", "BF16"),
        ("fp16", "F16"),
        ("half", "F16"),
        ("torch.float16", "F16"),
        ("FLOAT16", "F16"),
        ("fp32", "F32"),
        ("float", "F32"),
        ("Float32", "F32"),
        ("torch.float32", "F32"),
    ]
    .iter()
    .enumerate()
    {
        let out = tmp.path().join(i.to_string());
        let o = unshard(&[
            "merge",
            "ckpt/llama_policy.pt",
            out.to_str().unwrap(),
            "--weights-only",
            "--dtype",
            spelling,
            "-q",
        ]);
        assert_eq!(o.status.code(), Some(0), "{spelling}: {}", stderr(&o));
        assert_eq!(written_dtype(&out, name), *want, "{spelling}");
    }
    let o = unshard(&["merge", "ckpt/llama_policy.pt", "x", "--dtype", "fp8"]);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("invalid value 'fp8' for '--dtype"), "{err}");
    // Listed are the canonical names, not every alias.
    assert!(
        err.contains("[possible values: auto, float16, bfloat16, float32]"),
        "{err}"
    );
    assert!(!Path::new(&fixtures()).join("x").exists());
}

#[test]
fn the_output_may_follow_the_checkpoint() {
    let tmp = tempfile::tempdir().unwrap();
    let (pos, flag) = (tmp.path().join("pos"), tmp.path().join("flag"));
    let o = unshard(&[
        "merge",
        "ckpt/llama_policy.pt",
        pos.to_str().unwrap(),
        "--weights-only",
        "-q",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let o = unshard(&[
        "merge",
        "ckpt/llama_policy.pt",
        "-o",
        flag.to_str().unwrap(),
        "--weights-only",
        "-q",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert_eq!(names(&pos), names(&flag));
    for n in names(&pos) {
        assert_eq!(
            std::fs::read(pos.join(&n)).unwrap(),
            std::fs::read(flag.join(&n)).unwrap(),
            "{n}"
        );
    }
    // The same directory twice is fine.
    let same = tmp.path().join("same");
    let s = same.to_str().unwrap();
    let o = unshard(&[
        "merge",
        "ckpt/llama_policy.pt",
        s,
        "--output",
        s,
        "--weights-only",
        "-q",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(same.join("model.safetensors").is_file());

    // Two different ones: a usage error naming both, nothing written.
    let (a, b) = (tmp.path().join("a"), tmp.path().join("b"));
    let o = unshard(&[
        "merge",
        "ckpt/llama_policy.pt",
        a.to_str().unwrap(),
        "-o",
        b.to_str().unwrap(),
    ]);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("error: two outputs given"), "{err}");
    assert!(err.contains(a.to_str().unwrap()) && err.contains(b.to_str().unwrap()));
    assert!(
        err.contains("hint: give the output directory once: `unshard merge CHECKPOINT OUT`"),
        "{err}"
    );
    assert!(!a.exists() && !b.exists());

    // None: clap's usage error, naming what is missing.
    let o = unshard(&["merge", "ckpt/llama_policy.pt"]);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("required arguments were not provided"),
        "{err}"
    );
    assert!(err.contains("<OUT>"), "{err}");
}

#[test]
fn help_says_what_the_tool_does_and_what_inspect_reads() {
    let o = unshard(&["--help"]);
    assert_eq!(o.status.code(), Some(0));
    let text = stdout(&o);
    let intro: Vec<&str> = text.lines().take_while(|l| !l.is_empty()).collect();
    assert_eq!(intro.len(), 2, "{text}");
    assert!(intro[0].contains("checkpoints"), "{text}");
    for input in ["FSDP", "DCP", "DeepSpeed", "torch.save", "LoRA"] {
        assert!(text.contains(input), "{input} not named: {text}");
    }
    assert!(
        intro[1].contains("Hugging Face model directories"),
        "{text}"
    );
    for c in ["merge", "inspect", "verify", "diff", "completions", "man"] {
        assert!(text.contains(&format!("\n  {c} ")), "{c}: {text}");
    }
    let o = unshard(&["inspect", "--help"]);
    let text = stdout(&o)
        .replace('\n', " ")
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ");
    assert!(
        text.contains("torch.distributed.checkpoint (DCP) directory"),
        "{text}"
    );
    assert!(text.contains("a directory of per-rank files"), "{text}");
    assert!(text.contains(".safetensors file"), "{text}");
}

#[test]
fn completions_for_bash_zsh_and_fish() {
    for (shell, marker) in [
        ("bash", "complete -F _unshard"),
        ("zsh", "#compdef unshard"),
        ("fish", "complete -c unshard"),
    ] {
        let o = unshard(&["completions", shell]);
        assert_eq!(o.status.code(), Some(0), "{shell}: {}", stderr(&o));
        let script = stdout(&o);
        assert!(script.contains(marker), "{shell}: {script}");
        for word in ["merge", "inspect", "verify", "max-shard-size"] {
            assert!(script.contains(word), "{shell} lacks {word}");
        }
    }
    let o = unshard(&["completions", "tcsh"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(
        stderr(&o).contains("invalid value 'tcsh'"),
        "{}",
        stderr(&o)
    );
}

#[test]
fn man_pages_come_from_the_same_definitions() {
    let o = unshard(&["man"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let page = stdout(&o);
    assert!(page.contains(".TH unshard 1"), "{page}");
    assert!(page.contains("unshard\\-merge(1)"), "{page}");
    assert!(page.contains("Hugging Face"), "{page}");
    let o = unshard(&["man", "merge"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let page = stdout(&o);
    assert!(page.contains(".TH unshard-merge 1"), "{page}");
    assert!(page.contains("\\-\\-max\\-shard\\-size"), "{page}");
    assert!(page.contains("\\-\\-fail\\-on\\-nonfinite"), "{page}");
    let o = unshard(&["man", "mrege"]);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("error: no command 'mrege'"), "{err}");
    assert!(err.contains("hint: one of: merge, inspect"), "{err}");
}

/// A slow merge with stderr not a terminal: a plain line every interval.
fn slow_merge(interval: Option<&str>, quiet: bool) -> Output {
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = big_checkpoint(tmp.path(), 6);
    let out = tmp.path().join("out");
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_unshard"));
    cmd.args([
        "merge",
        ckpt.to_str().unwrap(),
        out.to_str().unwrap(),
        "--weights-only",
        "--dtype",
        "bf16",
    ])
    .env("UNSHARD_TEST_WINDOW_DELAY_MS", "300")
    .env("UNSHARD_TEST_STAGE_DELAY_MS", "300")
    .env_remove("UNSHARD_PROGRESS_INTERVAL");
    if let Some(i) = interval {
        cmd.env("UNSHARD_PROGRESS_INTERVAL", i);
    }
    if quiet {
        cmd.arg("-q");
    }
    let o = cmd.output().unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    o
}

#[test]
fn without_a_terminal_progress_is_a_plain_line_every_interval() {
    let o = slow_merge(Some("0.1"), false);
    let err = stderr(&o);
    let lines: Vec<&str> = err
        .lines()
        .filter(|l| l.starts_with("progress: "))
        .collect();
    assert!(
        lines.iter().any(|l| l.starts_with("progress: reading ")),
        "{err}"
    );
    let counting: Vec<&&str> = lines.iter().filter(|l| l.contains(" written (")).collect();
    assert!(counting.len() >= 2, "{err}");
    assert!(
        counting.iter().all(|l| l.contains("/12.0 MiB written (")),
        "the bytes written to the output (6 x 2 MiB of bfloat16): {err}"
    );
    assert!(!err.contains("0 B/0 B"), "{err}");
    assert!(!err.contains('\r') && !err.contains('\x1b'), "{err:?}");
    assert!(err.contains("wrote 12.0 MiB"), "{err}");

    // The default interval is 10 s: a short run prints no progress line.
    let err = stderr(&slow_merge(None, false));
    assert!(!err.contains("progress: "), "{err}");
    // --quiet: none either.
    let err = stderr(&slow_merge(Some("0.1"), true));
    assert!(!err.contains("progress: "), "{err}");
}

/// On a terminal (a pseudo-terminal from `script`): a bar that says what it
/// counts, never a full bar of 0 B/0 B before the total is known.
#[test]
#[ignore = "needs script (util-linux) for a pseudo-terminal (see docs/testing.md)"]
fn on_a_terminal_the_bar_counts_written_bytes_and_starts_empty() {
    let has_script = Command::new("script").arg("--version").output().is_ok();
    require(has_script.then_some(()), "run `script` (util-linux)");
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = big_checkpoint(tmp.path(), 6);
    let out = tmp.path().join("out");
    let line = format!(
        "UNSHARD_TEST_WINDOW_DELAY_MS=300 '{}' merge '{}' '{}' --weights-only --dtype bf16",
        env!("CARGO_BIN_EXE_unshard"),
        ckpt.display(),
        out.display()
    );
    let o = Command::new("script")
        .args(["-qec", &line, "/dev/null"])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let text = stdout(&o);
    assert_eq!(o.status.code(), Some(0), "{text}");
    assert!(text.contains("/12.00 MiB written"), "{text:?}");
    assert!(!text.contains("0 B/0 B"), "{text:?}");
}

const EVIL: &str = "evil\x1b]0;pwned\x07.weight";
const SHOWN: &str = "evil\\x1b]0;pwned\\x07.weight";

#[test]
fn names_from_files_are_escaped_in_text_and_exact_in_json() {
    let tmp = tempfile::tempdir().unwrap();
    let a = tmp.path().join("a.safetensors");
    let b = tmp.path().join("b.safetensors");
    f32_safetensors(&a, &[(EVIL, &[1.0, 2.0]), ("ok.weight", &[3.0])]);
    f32_safetensors(&b, &[(EVIL, &[1.0, 2.5]), ("ok.weight", &[3.0])]);
    let (a_s, b_s) = (a.to_str().unwrap(), b.to_str().unwrap());

    let o = unshard(&["inspect", a_s]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let text = stdout(&o);
    assert!(text.contains(SHOWN), "{text:?}");
    assert!(!text.contains('\x1b') && !text.contains('\x07'), "{text:?}");
    let o = unshard(&["inspect", a_s, "--stats"]);
    assert!(stdout(&o).matches(SHOWN).count() == 2, "{}", stdout(&o));
    assert!(!stdout(&o).contains('\x1b'));

    let o = unshard(&["inspect", a_s, "--json"]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let json_names: Vec<&str> = v["tensors"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["name"].as_str().unwrap())
        .collect();
    assert!(json_names.contains(&EVIL), "{json_names:?}");

    let o = unshard(&["diff", a_s, b_s]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let text = stdout(&o);
    assert!(text.contains(SHOWN), "{text:?}");
    assert!(!text.contains('\x1b'), "{text:?}");
    let o = unshard(&["diff", a_s, b_s, "--json"]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert!(
        v["tensors"]
            .as_array()
            .unwrap()
            .iter()
            .any(|t| t["name"] == EVIL),
        "{v}"
    );

    // verify: merge A, check it against B; the finding names the tensor.
    let out = tmp.path().join("out");
    let o = unshard(&["merge", a_s, out.to_str().unwrap(), "--weights-only", "-q"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let o = unshard(&["verify", out.to_str().unwrap(), "--against", b_s, "-q"]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let text = stdout(&o);
    assert!(text.contains(SHOWN), "{text:?}");
    assert!(!text.contains('\x1b'), "{text:?}");

    // An error message quoting a file name.
    let o = unshard(&["inspect", "no-such-\x1b[2J-file.pt"]);
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("no-such-\\x1b[2J-file.pt"), "{err:?}");
    assert!(!err.contains('\x1b'), "{err:?}");
}

/// `inspect -q` keeps the format and totals and drops the per-tensor table.
#[test]
fn inspect_quiet_drops_the_table() {
    let full = stdout(&unshard(&["inspect", "ckpt/llama_policy.pt"]));
    let o = unshard(&["inspect", "ckpt/llama_policy.pt", "-q"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let quiet = stdout(&o);
    assert!(full.contains("model.embed_tokens.weight"), "{full}");
    assert!(!quiet.contains("model.embed_tokens.weight"), "{quiet}");
    let totals = full.lines().find(|l| l.contains(" parameters, ")).unwrap();
    assert!(quiet.contains(totals), "{quiet}");
    assert_eq!(quiet.lines().next(), full.lines().next());
}

/// `merge -v` lists every renamed tensor, where the summary shows the first.
#[test]
fn merge_verbose_lists_every_rename() {
    let tmp = tempfile::tempdir().unwrap();
    let args = |out: &str, extra: &[&str]| -> Output {
        let out = tmp.path().join(out);
        let mut a = vec![
            "merge",
            "ckpt/llama_fsdp_prefixed.pt",
            out.to_str().unwrap(),
            "--base",
            "models/llama-bf16",
        ];
        a.extend(extra);
        unshard(&a)
    };
    let json = args("j", &["--json"]);
    assert!(json.status.success(), "{}", stderr(&json));
    let report: serde_json::Value = serde_json::from_slice(&json.stdout).unwrap();
    let renamed = report["renamed"].as_array().unwrap();
    assert!(renamed.len() > 1);
    let v = args("v", &["-v"]);
    let err = stderr(&v);
    assert!(v.status.success(), "{err}");
    for pair in renamed {
        let line = format!(
            "renamed: {} -> {}",
            pair[0].as_str().unwrap(),
            pair[1].as_str().unwrap()
        );
        assert!(err.lines().any(|l| l == line), "{line} missing from {err}");
    }
    let short = stderr(&args("s", &[]));
    assert_eq!(
        short.lines().filter(|l| l.starts_with("renamed: ")).count(),
        1,
        "{short}"
    );
}

/// Where to put the completion script: `unshard completions --help` and the README
/// give the same commands, for bash, zsh and fish.
#[test]
fn completion_advice_is_the_same_in_help_and_readme() {
    let help = stdout(&unshard(&["completions", "--help"]));
    let readme =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../../README.md"))
            .unwrap();
    let advice: Vec<&str> = help
        .lines()
        .map(str::trim)
        .filter(|l| {
            ["bash:", "zsh:", "fish:"]
                .iter()
                .any(|s| l.starts_with(s) && l.contains("unshard completions "))
        })
        .collect();
    for shell in ["bash", "zsh", "fish"] {
        assert!(
            advice.iter().any(|l| l.starts_with(&format!("{shell}:"))),
            "{shell}: {help}"
        );
    }
    for line in advice {
        assert!(
            readme.lines().any(|l| l.trim() == line),
            "README lacks: {line}"
        );
    }
}
