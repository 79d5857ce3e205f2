//! Errors a caller can match on carry their data, and their hints speak of the
//! library's options, not of command-line flags.
#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};

use unshard::{Error, MergeOptions, NoProgress, PlanOptions};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures")
}

fn options(out: &Path) -> MergeOptions {
    MergeOptions {
        checkpoint: fixtures().join("ckpt/llama_policy.pt"),
        base: Some(fixtures().join("models/llama-bf16")),
        output: out.to_path_buf(),
        ..MergeOptions::default()
    }
}

fn no_flags(e: &Error) {
    let hint = e.hint().unwrap_or_default();
    assert!(!hint.contains("--"), "a flag in the library's hint: {hint}");
}

#[test]
fn a_non_empty_output_is_output_exists_with_its_path() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    std::fs::create_dir(&out).unwrap();
    std::fs::write(out.join("keep.txt"), "mine").unwrap();
    let e = unshard::merge(&options(&out), &NoProgress).unwrap_err();
    match &e {
        Error::OutputExists { path } => assert_eq!(path, &out),
        other => panic!("{other:?}"),
    }
    assert!(e.hint().unwrap().contains("`force`"));
    no_flags(&e);
    assert_eq!(
        std::fs::read_to_string(out.join("keep.txt")).unwrap(),
        "mine"
    );
}

#[test]
fn other_shapes_and_unknown_names_are_typed_with_the_tensors() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let opts = MergeOptions {
        checkpoint: fixtures().join("ckpt/llama_shape_mismatch.pt"),
        ..options(&out)
    };
    let e = unshard::merge(&opts, &NoProgress).unwrap_err();
    let Error::ShapeMismatch { tensors } = &e else {
        panic!("{e:?}")
    };
    assert!(!tensors.is_empty() && tensors.iter().all(|t| t.checkpoint != t.base));
    no_flags(&e);
    assert!(!out.exists());

    let opts = MergeOptions {
        plan: PlanOptions {
            strict: true,
            renames: vec![(regex::Regex::new("^model\\.norm\\.").unwrap(), "x.".into())],
            ..PlanOptions::default()
        },
        ..options(&out)
    };
    // Renaming the norm away makes it unknown to the base: typed, with the name.
    let e = unshard::merge(&opts, &NoProgress).unwrap_err();
    let Error::UnknownTensors { names, .. } = &e else {
        panic!("{e:?}")
    };
    assert_eq!(names, &["x.weight"]);
    no_flags(&e);
    assert!(!out.exists());
}
