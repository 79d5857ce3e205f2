//! `unshard scan` on the hostile corpus (`fixtures/hostile/`, written by
//! `fixtures/gen_hostile.py` with torch.save, fickling, picklescan's own list and
//! CPython's pickletester data): nothing runs, every payload is named in text and
//! JSON, every file picklescan flags is flagged, and so are the ones it misses.
//! Expected names and picklescan's verdicts come from the generator, never from
//! unshard.
#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn hostile_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/hostile")
}

fn manifest() -> serde_json::Value {
    let text = std::fs::read_to_string(hostile_dir().join("manifest.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn unshard(args: &[&str], cwd: &Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_unshard"))
        .args(args)
        .current_dir(cwd)
        .output()
        .unwrap()
}

/// Peak resident set of the children run so far, in bytes.
fn children_max_rss() -> u64 {
    let mut usage = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: getrusage fills the struct it is given.
    let usage = unsafe {
        libc::getrusage(libc::RUSAGE_CHILDREN, usage.as_mut_ptr());
        usage.assume_init()
    };
    u64::try_from(usage.ru_maxrss).unwrap_or(0) * 1024
}

#[test]
fn every_payload_is_named_and_none_runs() {
    let manifest = manifest();
    let cases = manifest["cases"].as_array().unwrap();
    let mut counts = std::collections::BTreeMap::<&str, usize>::new();
    let (mut flagged_by_picklescan, mut missed_by_picklescan) = (0, 0);
    for c in cases {
        let file = c["file"].as_str().unwrap();
        let expect = c["expect"].as_str().unwrap();
        let path = hostile_dir().join(file);
        let path = path.to_str().unwrap();
        let cwd = tempfile::tempdir().unwrap();
        let start = std::time::Instant::now();
        let json = unshard(&["scan", path, "--json"], cwd.path());
        let text = unshard(&["scan", path], cwd.path());
        // Generous: the slowest file takes milliseconds; a walk of every path of the
        // memo DAG would take days.
        assert!(
            start.elapsed().as_secs() < 10,
            "{file}: {:?}",
            start.elapsed()
        );
        let v: serde_json::Value = serde_json::from_slice(&json.stdout).unwrap();
        // A case is a file, or a directory (a DCP checkpoint) of several.
        let calls: Vec<&serde_json::Value> = v["files"]
            .as_array()
            .unwrap()
            .iter()
            .flat_map(|f| f["unsafe"].as_array().unwrap())
            .collect();
        let names: Vec<&str> = calls
            .iter()
            .map(|u| u["callable"].as_str().unwrap())
            .collect();
        let stdout = String::from_utf8_lossy(&text.stdout);
        for want in c["callables"].as_array().unwrap() {
            let want = want.as_str().unwrap();
            assert!(
                names.iter().any(|n| n.contains(want)),
                "{file}: {want} not in {names:?}"
            );
            assert!(stdout.contains(want), "{file}: {want} not in {stdout}");
        }
        for u in &calls {
            for field in ["callable", "route", "offset", "entry", "verdict"] {
                assert!(!u[field].is_null(), "{file}: {u} lacks {field}");
            }
        }
        let flagged = json.status.code() == Some(1);
        assert_eq!(json.status.code(), text.status.code(), "{file}");
        match expect {
            "unsafe" | "unknown" => assert!(flagged, "{file}: not flagged"),
            "clean" => assert_eq!(json.status.code(), Some(0), "{file}: {stdout}"),
            _ => {}
        }
        if c["picklescan"]["verdict"] == "dangerous" {
            assert!(flagged, "{file}: picklescan flags it, unshard does not");
            flagged_by_picklescan += 1;
        } else if flagged {
            missed_by_picklescan += 1;
        }
        // The payload did not run.
        let marker = c["marker"].as_str().unwrap();
        assert!(!cwd.path().join(marker).exists(), "{file}: the payload ran");
        assert_eq!(std::fs::read_dir(cwd.path()).unwrap().count(), 0, "{file}");
        *counts.entry(expect).or_default() += 1;
    }
    // The corpus as generated: a change in it must be looked at.
    assert!(cases.len() >= 120, "{}", cases.len());
    assert!(counts["unsafe"] >= 100, "{counts:?}");
    assert!(flagged_by_picklescan >= 80, "{flagged_by_picklescan}");
    // EXT1/2/4 chains (archives and bare pickles), marshal + FunctionType, nested
    // numpy.load, duplicate data.pkl and data/0 records, CPython's test classes.
    assert!(missed_by_picklescan >= 20, "{missed_by_picklescan}");
    // No file took more than 100 MB.
    let rss = children_max_rss();
    assert!(rss < 100 << 20, "peak RSS {rss}");
}

#[test]
fn a_directory_is_scanned_recursively_and_clean_files_pass() {
    let cwd = tempfile::tempdir().unwrap();
    let dir = hostile_dir();
    let o = unshard(&["scan", dir.to_str().unwrap(), "--json"], cwd.path());
    assert_eq!(o.status.code(), Some(1));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    // Every file under the directory, the manifest included.
    fn count(dir: &Path) -> u64 {
        std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .map(|p| if p.is_dir() { count(&p) } else { 1 })
            .sum()
    }
    assert_eq!(v["scanned"].as_u64(), Some(count(&dir)));
    let cases = manifest()["cases"].as_array().unwrap().len() as u64;
    assert!(count(&dir) > cases);
    assert_eq!(v["clean"], false);

    let clean = dir.join("clean.pt");
    let deflated = dir.join("deflated.pt");
    let o = unshard(
        &["scan", clean.to_str().unwrap(), deflated.to_str().unwrap()],
        cwd.path(),
    );
    assert_eq!(
        o.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&o.stdout)
    );
    assert!(String::from_utf8_lossy(&o.stdout).contains("2 file(s), 2 pickle(s)"));

    // -q: nothing when clean; only the unsafe files otherwise, with no summary.
    let (c, d) = (clean.to_str().unwrap(), deflated.to_str().unwrap());
    let o = unshard(&["scan", "-q", c, d], cwd.path());
    assert_eq!(o.status.code(), Some(0));
    assert_eq!(String::from_utf8_lossy(&o.stdout), "");
    let bad = dir.join("metrics_os_system.pt");
    let o = unshard(&["scan", "-q", c, bad.to_str().unwrap()], cwd.path());
    assert_eq!(o.status.code(), Some(1));
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(
        text.contains("metrics_os_system.pt: ") && text.contains("unsafe: "),
        "{text}"
    );
    assert!(
        !text.contains("clean.pt") && !text.contains("scanned "),
        "{text}"
    );
}

#[test]
fn every_real_checkpoint_in_the_fixtures_scans_clean() {
    // What torch, DCP and transformers wrote: the allowlist must cover all of it.
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures");
    let cwd = tempfile::tempdir().unwrap();
    let dirs: Vec<String> = ["ckpt", "sharded", "placements", "models"]
        .iter()
        .map(|d| root.join(d).to_str().unwrap().to_string())
        .collect();
    let mut args = vec!["scan", "--json"];
    args.extend(dirs.iter().map(String::as_str));
    let o = unshard(&args, cwd.path());
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let dirty: Vec<&serde_json::Value> = v["files"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|f| {
            !f["unsafe"].as_array().unwrap().is_empty()
                // A deliberately corrupt .metadata is a read problem, not a payload.
                || (!f["problems"].as_array().unwrap().is_empty()
                    && !f["path"].as_str().unwrap().contains("bad_metadata"))
        })
        .collect();
    assert!(dirty.is_empty(), "{dirty:#?}");
    let pickles: u64 = v["files"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f["pickles"].as_u64().unwrap())
        .sum();
    assert!(pickles >= 500, "{pickles}");
}

#[test]
fn control_characters_in_names_are_escaped_in_text() {
    // A global whose name holds ESC[1A ESC[2K (cursor up, erase line).
    let dir = tempfile::tempdir().unwrap();
    let evil = dir.path().join("evil.pkl");
    std::fs::write(&evil, b"\x80\x02cposix\nsystem\x1b[1A\x1b[2K\n0N.").unwrap();
    let o = unshard(&["scan", evil.to_str().unwrap()], dir.path());
    assert_eq!(o.status.code(), Some(1));
    assert!(!o.stdout.contains(&0x1b));
    assert!(String::from_utf8_lossy(&o.stdout).contains("posix.system\\u{1b}[1A"));
}

#[test]
fn a_trainers_arguments_are_recognised_and_a_constructor_call_is_not() {
    // training_args.bin as transformers' Trainer and TRL's trainers save it
    // (fixtures/gen_trainer_args.py): the expected globals and which file must be
    // flagged come from the generator's manifest (pickletools' reading of the bytes).
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/trainer_args");
    let text = std::fs::read_to_string(root.join("manifest.json")).unwrap();
    let manifest: serde_json::Value = serde_json::from_str(&text).unwrap();
    let cwd = tempfile::tempdir().unwrap();
    let mut cases = 0;
    for (name, case) in manifest["files"].as_object().unwrap() {
        let file = root.join(name).join("training_args.bin");
        let o = unshard(&["scan", "--json", file.to_str().unwrap()], cwd.path());
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        let f = &v["files"][0];
        let listed = |key: &str| -> Vec<String> {
            f[key]
                .as_array()
                .unwrap()
                .iter()
                .map(|c| c["callable"].as_str().unwrap().to_string())
                .collect()
        };
        let (unsafe_calls, recognised) = (listed("unsafe"), listed("recognised"));
        let class = case["class"].as_str().unwrap().to_string();
        if case["flagged"].as_bool().unwrap() {
            assert_eq!(o.status.code(), Some(1), "{name}");
            assert!(unsafe_calls.contains(&class), "{name}: {unsafe_calls:?}");
            assert!(!recognised.contains(&class), "{name}: {recognised:?}");
        } else {
            assert_eq!(o.status.code(), Some(0), "{name}: {unsafe_calls:?}");
            assert!(unsafe_calls.is_empty(), "{name}: {unsafe_calls:?}");
            assert!(recognised.contains(&class), "{name}: {recognised:?}");
            // Every global the file names other than torch's own is accounted for.
            for g in case["globals"].as_array().unwrap() {
                let g = g.as_str().unwrap();
                assert!(
                    g.starts_with("torch.") || recognised.iter().any(|r| r == g),
                    "{name}: {g} not listed"
                );
            }
            let text = unshard(&["scan", file.to_str().unwrap()], cwd.path());
            let out = String::from_utf8_lossy(&text.stdout);
            assert!(out.contains("recognised: a Trainer's arguments"), "{out}");
            assert!(out.contains(&class), "{out}");
        }
        cases += 1;
    }
    assert_eq!(cases, 8);
}

#[test]
fn a_trainer_checkpoint_folder_scans_clean() {
    // A Trainer's checkpoint-N/ (fixtures/arch_cases: weights, configs, trainer state
    // and training_args.bin) passes as a pre-upload check.
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/arch_cases/run");
    let cwd = tempfile::tempdir().unwrap();
    let o = unshard(&["scan", dir.to_str().unwrap()], cwd.path());
    let out = String::from_utf8_lossy(&o.stdout);
    assert_eq!(o.status.code(), Some(0), "{out}");
    assert!(out.contains("; clean"), "{out}");
    assert!(out.contains("checkpoint-2/training_args.bin"), "{out}");
}
