//! `--base org/name[@revision]`: a model in the local Hugging Face cache.
//!
//! People name base models by their Hub id. unshard never goes to the network on
//! its own, so the id is looked up where `huggingface_hub` keeps downloads:
//! `$HF_HUB_CACHE`, else `$HF_HOME/hub`, else `$XDG_CACHE_HOME/huggingface/hub`,
//! else `~/.cache/huggingface/hub`. There, `models--org--name/refs/<revision>`
//! holds a commit hash and `snapshots/<hash>/` the files (symlinks into `blobs/`).
//! A local directory of the same name always wins.

use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

/// The cache directory `huggingface_hub` uses, from the environment.
pub fn cache_dir() -> Option<PathBuf> {
    let env = |k: &str| {
        std::env::var_os(k)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    if let Some(d) = env("HF_HUB_CACHE").or_else(|| env("HUGGINGFACE_HUB_CACHE")) {
        return Some(d);
    }
    if let Some(h) = env("HF_HOME") {
        return Some(h.join("hub"));
    }
    if let Some(x) = env("XDG_CACHE_HOME") {
        return Some(x.join("huggingface").join("hub"));
    }
    env("HOME").map(|h| h.join(".cache").join("huggingface").join("hub"))
}

/// `("org/name", Some("rev"))` if `s` has the shape of a Hub model id.
pub fn parse_model_id(s: &str) -> Option<(&str, Option<&str>)> {
    let (repo, rev) = match s.split_once('@') {
        Some((r, v)) if !v.is_empty() => (r, Some(v)),
        Some(_) => return None,
        None => (s, None),
    };
    let (org, name) = repo.split_once('/')?;
    let ok = |p: &str| {
        !p.is_empty()
            && !p.starts_with('.')
            && p.bytes()
                .all(|c| c.is_ascii_alphanumeric() || b"-_.".contains(&c))
    };
    (ok(org) && ok(name)).then_some((repo, rev))
}

/// Resolves `--base`: the path itself when it exists, else a cached Hub model's
/// snapshot directory; `Ok(None)` when it is neither a path nor an id (the caller
/// reports the missing directory).
pub fn resolve_base(base: &Path) -> Result<Option<PathBuf>> {
    if base.exists() {
        return Ok(Some(base.to_path_buf()));
    }
    let Some(s) = base.to_str() else {
        return Ok(None);
    };
    let Some((repo, rev)) = parse_model_id(s) else {
        return Ok(None);
    };
    let Some(cache) = cache_dir() else {
        return Err(not_cached(
            repo,
            rev,
            "no cache directory (HF_HUB_CACHE, HF_HOME and HOME are unset)",
        ));
    };
    resolve_in(&cache, repo, rev).map(Some)
}

/// Looks `repo` (at `rev`, default `main`) up in `cache`.
pub fn resolve_in(cache: &Path, repo: &str, rev: Option<&str>) -> Result<PathBuf> {
    let dir = cache.join(format!("models--{}", repo.replace('/', "--")));
    if !dir.is_dir() {
        let mut e = not_cached(
            repo,
            rev,
            &format!("it is not in the Hugging Face cache {}", cache.display()),
        );
        if let (Some(near), Error::Plan { hint: Some(h), .. }) =
            (closest_cached(cache, repo), &mut e)
        {
            *h = format!("did you mean {near} (in the cache)? Otherwise, {h}");
        }
        return Err(e);
    }
    let want = rev.unwrap_or("main");
    let commit = match std::fs::read_to_string(dir.join("refs").join(want)) {
        Ok(h) => h.trim().to_string(),
        // A commit hash names its snapshot directly.
        Err(_) if want.len() == 40 && want.bytes().all(|c| c.is_ascii_hexdigit()) => {
            want.to_string()
        }
        Err(_) => {
            let refs = list(&dir.join("refs"));
            return Err(not_cached(
                repo,
                rev,
                &format!(
                    "the cache has it but not at revision '{want}' (cached refs: {})",
                    if refs.is_empty() {
                        "none".into()
                    } else {
                        refs.join(", ")
                    }
                ),
            ));
        }
    };
    let snap = dir.join("snapshots").join(&commit);
    if !snap.is_dir() {
        return Err(not_cached(
            repo,
            rev,
            &format!("refs/{want} points to {commit}, whose snapshot is not in the cache"),
        ));
    }
    Ok(snap)
}

fn list(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .map(|r| {
            r.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

/// The cached model id nearest `repo` (a typo: a few letters off, or another
/// case), if one is near enough.
fn closest_cached(cache: &Path, repo: &str) -> Option<String> {
    let want = repo.to_lowercase();
    let limit = (want.chars().count() / 5).clamp(1, 3);
    list(cache)
        .iter()
        .filter_map(|d| d.strip_prefix("models--"))
        .filter_map(|d| d.split_once("--").map(|(o, n)| format!("{o}/{n}")))
        .map(|id| (edit_distance(&want, &id.to_lowercase()), id))
        .filter(|(d, _)| *d <= limit)
        .min()
        .map(|(_, id)| id)
}

/// Levenshtein distance, by characters.
fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut prev = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let cur = row[j + 1];
            row[j + 1] = if ca == *cb {
                prev
            } else {
                1 + prev.min(cur).min(row[j])
            };
            prev = cur;
        }
    }
    row[b.len()]
}

fn not_cached(repo: &str, rev: Option<&str>, why: &str) -> Error {
    let at = rev.map(|r| format!(" --revision {r}")).unwrap_or_default();
    Error::plan(
        format!("--base {repo}{}: no such directory, and {why}", rev.map(|r| format!("@{r}")).unwrap_or_default()),
        Some(format!(
            "unshard does not download: fetch it first with `hf download {repo}{at}` (or `huggingface-cli download {repo}{at}`), or pass the model's directory"
        )),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_typo_gets_the_nearest_cached_id() {
        let cache = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        for d in [
            "models--Qwen--Qwen2.5-0.5B",
            "models--meta-llama--Llama-3.2-1B",
            "datasets--a--b",
        ] {
            std::fs::create_dir(cache.path().join(d)).unwrap_or_else(|e| panic!("{e}"));
        }
        let hint = |repo: &str| {
            resolve_in(cache.path(), repo, None)
                .err()
                .and_then(|e| e.hint())
                .unwrap_or_default()
        };
        assert!(
            hint("Qwen/Qwen2.5-05B").starts_with("did you mean Qwen/Qwen2.5-0.5B (in the cache)?"),
            "{}",
            hint("Qwen/Qwen2.5-05B")
        );
        assert!(hint("meta-llama/llama-3.2-1b").starts_with("did you mean meta-llama/Llama-3.2-1B"));
        // Nothing near: the download advice alone.
        assert!(hint("google/gemma-2b").starts_with("unshard does not download"));
        assert_eq!(edit_distance("kitten", "sitting"), 3);
    }

    #[test]
    fn model_ids_are_org_slash_name_with_an_optional_revision() {
        assert_eq!(
            parse_model_id("meta-llama/Llama-3.2-1B"),
            Some(("meta-llama/Llama-3.2-1B", None))
        );
        assert_eq!(
            parse_model_id("Qwen/Qwen2.5-0.5B@v1.0"),
            Some(("Qwen/Qwen2.5-0.5B", Some("v1.0")))
        );
        assert_eq!(parse_model_id("gpt2"), None);
        assert_eq!(parse_model_id("./models/x"), None);
        assert_eq!(parse_model_id("/abs/path"), None);
        assert_eq!(parse_model_id("a/b/c"), None);
        assert_eq!(parse_model_id("org/name@"), None);
    }

    #[test]
    #[allow(clippy::unwrap_used)]
    fn refs_commits_and_missing_snapshots() {
        let cache = tempfile::tempdir().unwrap();
        let repo = cache.path().join("models--org--m");
        let commit = "0123456789abcdef0123456789abcdef01234567";
        std::fs::create_dir_all(repo.join("snapshots").join(commit)).unwrap();
        std::fs::create_dir_all(repo.join("refs").join("pr")).unwrap();
        std::fs::write(repo.join("refs/main"), format!("{commit}\n")).unwrap();
        std::fs::write(repo.join("refs/pr/1"), "f".repeat(40)).unwrap();
        let snap = repo.join("snapshots").join(commit);
        assert_eq!(resolve_in(cache.path(), "org/m", None).unwrap(), snap);
        assert_eq!(
            resolve_in(cache.path(), "org/m", Some(commit)).unwrap(),
            snap
        );
        let e = resolve_in(cache.path(), "org/m", Some("pr/1")).unwrap_err();
        assert!(
            e.to_string().contains("whose snapshot is not in the cache"),
            "{e}"
        );
        let e = resolve_in(cache.path(), "org/other", None).unwrap_err();
        assert!(e.hint().unwrap().contains("hf download org/other"), "{e}");
    }
}
