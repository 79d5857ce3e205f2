//! DeepSpeed ZeRO checkpoints (stages 1, 2 and 3, and `BF16_Optimizer`).
//!
//! `engine.save_checkpoint(dir)` writes `dir/latest` (the tag's name) and a tag
//! folder, `dir/global_stepN/` (accelerate uses the tag `pytorch_model`), holding:
//! - ZeRO-1/2: one `mp_rank_00_model_states.pt` (the module in 16 bits plus the
//!   layout) and one `{bf16_,}zero_pp_rank_R_mp_rank_00_optim_states.pt` per rank;
//! - ZeRO-3: one `zero_pp_rank_R_mp_rank_00_model_states.pt` per rank (placeholders
//!   for the module; each rank's share of frozen parameters) and the optim files.
//!
//! The weights are the fp32 masters in the optim files: each rank holds one flat
//! partition per parameter group. Under ZeRO-1/2 (and `BF16_Optimizer`) a group's
//! partitions concatenated in rank order are the group's parameters flattened one
//! after the other in `param_shapes` order (with `param_alignment_paddings` after
//! each, when recorded), padded at the end; a parameter can straddle ranks. Under
//! ZeRO-3 every parameter is cut on its own: rank `r` holds elements
//! `[r*ceil(n/W), (r+1)*ceil(n/W))` of it (the last share padded), and a rank's
//! groups concatenated hold its shares in `param_shapes` order. Either way a
//! parameter is a few contiguous runs in the files, which [`runs`] turns into
//! pieces. Frozen parameters, buffers and tied aliases come from the model states.
//! The 16-bit module copy and the optimizer's moments are never read.

mod files;
mod layout;
mod partitions;
pub mod runs;

use std::path::{Path, PathBuf};

use regex::Regex;

use super::{Checkpoint, OpenOptions};
use crate::bytes::fs;
use crate::error::{Error, Result};

pub use files::{is_model_states, is_optim_states};

/// A DeepSpeed checkpoint found on disk.
#[derive(Clone, Debug)]
pub struct Found {
    /// The path the user gave.
    pub path: PathBuf,
    /// The tag folder holding the rank files.
    pub tag_dir: PathBuf,
    /// How the tag folder was chosen, for `inspect`.
    pub how: String,
}

/// The rank files of a tag folder, from their names.
#[derive(Debug, Default)]
pub(crate) struct Names {
    /// `mp_rank_00_model_states.pt` (ZeRO-1/2).
    pub model: Option<String>,
    /// `(rank, name)` of `zero_pp_rank_R_mp_rank_00_model_states.pt` (ZeRO-3), sorted.
    pub model_ranks: Vec<(usize, String)>,
    /// `(rank, name)` of the optim files, sorted.
    pub optim: Vec<(usize, String)>,
    /// Other files (not weights).
    pub other: Vec<String>,
    /// Files of model-parallel ranks other than 0.
    pub model_parallel: Vec<String>,
}

const MAX_RANKS: usize = 1 << 20;

pub(crate) fn names(dir: &Path) -> Result<Names> {
    let re =
        Regex::new(r"^(?:(bf16_)?zero_pp_rank_(\d+)_)?mp_rank_(\d+)_(model|optim)_states\.pt$")
            .map_err(|e| Error::corrupt(dir, e.to_string()))?;
    let mut out = Names::default();
    let list: Vec<String> = fs::list(dir)?.into_iter().map(|e| e.name).collect();
    for name in list {
        let Some(c) = re.captures(&name) else {
            out.other.push(name);
            continue;
        };
        let num = |i: usize| {
            c.get(i)
                .and_then(|m| m.as_str().parse::<usize>().ok())
                .filter(|&r| r < MAX_RANKS)
        };
        if num(3) != Some(0) {
            out.model_parallel.push(name);
            continue;
        }
        match (c.get(4).map(|m| m.as_str()), num(2)) {
            (Some("model"), None) => out.model = Some(name),
            (Some("model"), Some(r)) => out.model_ranks.push((r, name)),
            (Some("optim"), Some(r)) => out.optim.push((r, name)),
            _ => out.other.push(name),
        }
    }
    out.model_ranks.sort();
    out.optim.sort();
    Ok(out)
}

/// Whether a folder holds a DeepSpeed model-states file.
fn is_tag_dir(dir: &Path) -> bool {
    names(dir)
        .map(|n| n.model.is_some() || !n.model_ranks.is_empty())
        .unwrap_or(false)
}

/// Sub-folders that are tag folders, for hints.
fn tags_in(dir: &Path) -> Vec<String> {
    fs::list(dir)
        .map(|entries| {
            entries
                .into_iter()
                .filter(|e| e.is_dir && is_tag_dir(&e.path))
                .map(|e| e.name)
                .collect()
        })
        .unwrap_or_default()
}

/// Reads a `latest` file: one line naming the tag.
fn read_latest(path: &Path) -> Result<String> {
    let bytes = fs::read(path)?;
    if bytes.len() > 4096 {
        return Err(Error::corrupt(
            path,
            "a 'latest' file names one tag; this one is too long",
        ));
    }
    let text = String::from_utf8(bytes)
        .map_err(|_| Error::corrupt(path, "a 'latest' file names one tag; this one is not text"))?;
    Ok(text.trim().to_string())
}

/// Finds a DeepSpeed checkpoint in a folder: the tag folder itself, the folder
/// holding `latest` (the tag it names, or `opts.tag`), or an HF Trainer
/// `checkpoint-N/` (which is such a folder). `Ok(None)` when it is none of these.
pub fn find(path: &Path, opts: &OpenOptions) -> Result<Option<Found>> {
    if is_tag_dir(path) {
        if let Some(tag) = &opts.tag {
            return Err(Error::Usage(format!(
                "{} is a DeepSpeed tag folder itself; --tag {tag} picks a tag folder inside the folder holding 'latest' (pass {} instead, or drop --tag)",
                path.display(),
                path.parent().unwrap_or(path).display()
            )));
        }
        return Ok(Some(Found {
            path: path.to_path_buf(),
            tag_dir: path.to_path_buf(),
            how: "the tag folder".into(),
        }));
    }
    let latest = path.join("latest");
    let (tag, how) = match (&opts.tag, fs::is_file(&latest)) {
        (Some(t), _) => (t.clone(), format!("tag {t} (--tag)")),
        (None, true) => {
            let t = read_latest(&latest)?;
            let how = format!("tag {t} (named by 'latest')");
            (t, how)
        }
        (None, false) => return Ok(None),
    };
    let tags = tags_in(path);
    if tags.is_empty()
        && !fs::is_dir(&path.join(&tag))
        && (opts.tag.is_none() || !fs::is_file(&latest))
    {
        // No tag folder, and a `latest` of something else (or none): not DeepSpeed.
        return Ok(None);
    }
    let hint = || {
        if tags.is_empty() {
            "the folder holds no tag folder with *_model_states.pt files; copy the tag folder into it".to_string()
        } else if tags.len() == 1 {
            format!("pass --tag {} (the one tag folder here)", tags[0])
        } else {
            format!("pass --tag with one of: {}", tags.join(", "))
        }
    };
    let bad_name = tag.is_empty() || tag.contains('/') || tag == "." || tag == "..";
    let tag_dir = path.join(&tag);
    if bad_name || !fs::is_dir(&tag_dir) {
        let msg = if opts.tag.is_some() {
            format!("there is no tag folder '{tag}'")
        } else {
            format!("'latest' names the tag '{tag}', but there is no such folder")
        };
        return Err(Error::Incomplete {
            path: if bad_name { latest } else { tag_dir },
            msg,
            hint: Some(hint()),
        });
    }
    if !is_tag_dir(&tag_dir) {
        return Err(Error::Incomplete {
            path: tag_dir,
            msg: "the tag folder holds no *_model_states.pt file".into(),
            hint: Some(hint()),
        });
    }
    Ok(Some(Found {
        path: path.to_path_buf(),
        tag_dir,
        how,
    }))
}

/// Reads a DeepSpeed checkpoint found by [`find`].
pub fn open(found: &Found) -> Result<Checkpoint> {
    layout::open(found)
}

/// The folder whose `config.json` describes a DeepSpeed checkpoint when no base is
/// given: an HF Trainer `checkpoint-N/` holds it beside `latest` and the tag folder.
pub fn config_dir_for(checkpoint: &Path) -> Option<PathBuf> {
    let dir = if fs::is_dir(checkpoint) {
        checkpoint
    } else {
        checkpoint.parent()?
    };
    let with_config =
        |d: &Path| fs::is_file(&d.join("config.json")) && fs::is_file(&d.join("latest"));
    if with_config(dir) {
        return Some(dir.to_path_buf());
    }
    let parent = dir.parent()?;
    (is_tag_dir(dir) && with_config(parent)).then(|| parent.to_path_buf())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn touch(dir: &Path, names: &[&str]) {
        std::fs::create_dir_all(dir).unwrap();
        for n in names {
            std::fs::write(dir.join(n), b"").unwrap();
        }
    }

    fn fixture(case: &str) -> PathBuf {
        crate::fixtures().join("deepspeed").join(case)
    }

    #[test]
    fn rank_files_are_sorted_by_rank_and_the_rest_set_aside() {
        let tmp = tempfile::tempdir().unwrap();
        touch(
            tmp.path(),
            &[
                "latest",
                "mp_rank_00_model_states.pt",
                "mp_rank_01_model_states.pt",
                "mp_rank_00_optim_states.pt",
                "zero_pp_rank_10_mp_rank_00_optim_states.pt",
                "zero_pp_rank_2_mp_rank_00_optim_states.pt",
                "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt",
                "zero_pp_rank_1_mp_rank_00_model_states.pt",
                // The largest rank believed, and the first one past it.
                "zero_pp_rank_1048575_mp_rank_00_optim_states.pt",
                "zero_pp_rank_1048576_mp_rank_00_optim_states.pt",
            ],
        );
        let n = names(tmp.path()).unwrap();
        assert_eq!(n.model.as_deref(), Some("mp_rank_00_model_states.pt"));
        let ranks = |v: &[(usize, String)]| v.iter().map(|(r, _)| *r).collect::<Vec<_>>();
        assert_eq!(ranks(&n.model_ranks), [1]);
        assert_eq!(ranks(&n.optim), [0, 2, 10, 1_048_575]);
        assert_eq!(
            n.other,
            [
                "latest",
                "mp_rank_00_optim_states.pt",
                "zero_pp_rank_1048576_mp_rank_00_optim_states.pt"
            ]
        );
        assert_eq!(n.model_parallel, ["mp_rank_01_model_states.pt"]);
    }

    #[test]
    fn a_latest_file_is_one_short_line() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("latest");
        // 4096 bytes are taken (the tag, trimmed), one more is refused.
        let mut text = b"global_step1\n".to_vec();
        text.resize(4096, b' ');
        std::fs::write(&path, &text).unwrap();
        assert_eq!(read_latest(&path).unwrap(), "global_step1");
        text.push(b' ');
        std::fs::write(&path, &text).unwrap();
        let e = read_latest(&path).unwrap_err().to_string();
        assert!(e.contains("too long"), "{e}");
    }

    /// A folder with `latest` and a tag folder holding a model-states file.
    fn checkpoint_dir(latest: &str) -> tempfile::TempDir {
        let tmp = tempfile::tempdir().unwrap();
        std::fs::write(tmp.path().join("latest"), latest).unwrap();
        touch(
            &tmp.path().join("global_step1"),
            &["mp_rank_00_model_states.pt"],
        );
        tmp
    }

    fn incomplete(r: Result<Option<Found>>) -> (PathBuf, String, String) {
        match r {
            Err(Error::Incomplete { path, msg, hint }) => (path, msg, hint.unwrap_or_default()),
            other => panic!("not an Incomplete error: {other:?}"),
        }
    }

    #[test]
    fn a_latest_naming_no_folder_of_its_own_is_refused_by_name() {
        let d = OpenOptions::default();
        for tag in [
            "",
            "global_step1/",
            "global_step1/.",
            ".",
            "..",
            "global_step7",
        ] {
            let tmp = checkpoint_dir(tag);
            let (path, msg, hint) = incomplete(find(tmp.path(), &d));
            assert!(
                msg.contains(&format!(
                    "'latest' names the tag '{tag}', but there is no such folder"
                )),
                "{tag:?}: {msg}"
            );
            let want = if tag == "global_step7" {
                tmp.path().join(tag)
            } else {
                tmp.path().join("latest")
            };
            assert_eq!(path, want, "{tag:?}");
            assert!(hint.contains("pass --tag global_step1 (the one"), "{hint}");
        }
        let tmp = checkpoint_dir("global_step1");
        let found = find(tmp.path(), &d).unwrap().unwrap();
        assert_eq!(found.tag_dir, tmp.path().join("global_step1"));
    }

    #[test]
    fn a_tag_folder_without_model_states_is_refused() {
        let tmp = tempfile::tempdir().unwrap();
        std::fs::write(tmp.path().join("latest"), "global_step1").unwrap();
        touch(
            &tmp.path().join("global_step1"),
            &["zero_pp_rank_0_mp_rank_00_optim_states.pt"],
        );
        let (path, msg, hint) = incomplete(find(tmp.path(), &OpenOptions::default()));
        assert_eq!(path, tmp.path().join("global_step1"));
        assert!(msg.contains("holds no *_model_states.pt"), "{msg}");
        assert!(hint.contains("holds no tag folder"), "{hint}");
        // With other tag folders, the hint names them.
        for tag in ["global_step2", "global_step3"] {
            touch(&tmp.path().join(tag), &["mp_rank_00_model_states.pt"]);
        }
        let (path, msg, hint) = incomplete(find(tmp.path(), &OpenOptions::default()));
        assert_eq!(path, tmp.path().join("global_step1"));
        assert!(msg.contains("holds no *_model_states.pt"), "{msg}");
        assert_eq!(hint, "pass --tag with one of: global_step2, global_step3");
    }

    #[test]
    fn a_latest_of_something_else_is_not_deepspeed() {
        let d = OpenOptions::default();
        let tagged = OpenOptions {
            tag: Some("global_step1".into()),
            ..OpenOptions::default()
        };
        // `latest` and no tag folder: another tool's file.
        let tmp = tempfile::tempdir().unwrap();
        std::fs::write(tmp.path().join("latest"), "global_step1").unwrap();
        touch(&tmp.path().join("other"), &["weights.bin"]);
        assert!(find(tmp.path(), &d).unwrap().is_none());
        // The same with --tag: DeepSpeed's `latest`, its tag folder missing.
        let (_, msg, hint) = incomplete(find(tmp.path(), &tagged));
        assert!(
            msg.contains("there is no tag folder 'global_step1'"),
            "{msg}"
        );
        assert!(hint.contains("holds no tag folder"), "{hint}");
        // Neither `latest` nor a tag folder, with --tag.
        let tmp = tempfile::tempdir().unwrap();
        touch(&tmp.path().join("other"), &["weights.bin"]);
        assert!(find(tmp.path(), &tagged).unwrap().is_none());
    }

    #[test]
    fn a_trainer_checkpoint_holds_the_config() {
        let trainer = fixture("llama_trainer_z3_w2");
        let tag = trainer.join("global_step1");
        assert_eq!(config_dir_for(&trainer), Some(trainer.clone()));
        assert_eq!(config_dir_for(&tag), Some(trainer.clone()));
        let file = tag.join("zero_pp_rank_0_mp_rank_00_model_states.pt");
        assert_eq!(config_dir_for(&file), Some(trainer.clone()));
        // A tag folder without a config beside it.
        assert_eq!(
            config_dir_for(&fixture("llama_z3_bf16_w2/global_step1")),
            None
        );
        // config.json alone, or beside `latest` with a folder that is no tag folder.
        let tmp = tempfile::tempdir().unwrap();
        touch(tmp.path(), &["config.json"]);
        touch(&tmp.path().join("global_step1"), &["weights.bin"]);
        assert_eq!(config_dir_for(tmp.path()), None);
        touch(tmp.path(), &["latest"]);
        assert_eq!(config_dir_for(tmp.path()), Some(tmp.path().to_path_buf()));
        assert_eq!(config_dir_for(&tmp.path().join("global_step1")), None);
        let tmp = tempfile::tempdir().unwrap();
        touch(tmp.path(), &["latest"]);
        assert_eq!(config_dir_for(tmp.path()), None);
    }
}
