//! Finding a set of per-rank files in a directory: `{prefix}{rank}{suffix}` names,
//! the model's set among optimizer and trainer state, and the world size the names
//! state.

use std::path::{Path, PathBuf};

use regex::Regex;

use crate::error::{Error, Result};

/// Rank numbers above this are not believed (a name like `rank_99999999999.pt`).
pub(super) const MAX_RANKS: usize = 1 << 20;

/// A set of per-rank files found in a directory: `{prefix}{rank}{suffix}`.
#[derive(Clone, Debug)]
pub struct RankSet {
    /// The directory holding the files.
    pub dir: PathBuf,
    /// What comes before the rank number (`model_world_size_2_rank_`).
    pub prefix: String,
    /// What comes after it (`.pt`).
    pub suffix: String,
    /// `(rank, file name)`, sorted by rank.
    pub ranks: Vec<(usize, String)>,
    /// Width of zero-padded rank numbers (`rank_003`), 0 when not padded.
    pub pad: usize,
    /// The world size the names state (`model_world_size_N_rank_R.pt`).
    pub world_size: Option<usize>,
    /// Other per-rank sets in the directory that are not model weights.
    pub skipped: Vec<String>,
}

impl RankSet {
    /// The file name rank `r` has (or would have).
    pub fn name_of(&self, r: usize) -> String {
        format!("{}{r:0w$}{}", self.prefix, self.suffix, w = self.pad)
    }

    pub(super) fn pattern(&self) -> String {
        format!("{}*{}", self.prefix, self.suffix)
    }
}

fn rank_regex() -> Option<Regex> {
    Regex::new(r"^(.*rank[_-]?)(\d+)(\.(?:pt|pth|bin|ckpt))$").ok()
}

/// Whether a per-rank set holds something other than model weights.
fn is_not_model(prefix: &str) -> bool {
    let p = prefix.to_ascii_lowercase();
    ["optim", "extra_state", "rng", "scheduler", "lr_"]
        .iter()
        .any(|w| p.contains(w))
}

/// `(prefix, suffix)` of a set's file names.
type NamePattern = (String, String);

/// Looks for per-rank files in `dir`. `None` when there are none.
pub fn find_rank_files(dir: &Path) -> Result<Option<RankSet>> {
    let Some(re) = rank_regex() else {
        return Ok(None);
    };
    let mut groups: Vec<(NamePattern, Vec<(usize, String)>)> = Vec::new();
    for entry in crate::bytes::fs::list(dir)? {
        let name = entry.name;
        let Some(c) = re.captures(&name) else {
            continue;
        };
        if entry.is_dir {
            continue;
        }
        let (Some(pre), Some(num), Some(suf)) = (c.get(1), c.get(2), c.get(3)) else {
            continue;
        };
        let Some(rank) = num
            .as_str()
            .parse::<usize>()
            .ok()
            .filter(|&r| r < MAX_RANKS)
        else {
            continue;
        };
        let key = (pre.as_str().to_string(), suf.as_str().to_string());
        match groups.iter_mut().find(|(k, _)| *k == key) {
            Some((_, v)) => v.push((rank, name)),
            None => groups.push((key, vec![(rank, name)])),
        }
    }
    groups.sort();
    let (model, other): (Vec<_>, Vec<_>) =
        groups.into_iter().partition(|((p, _), _)| !is_not_model(p));
    let skipped: Vec<String> = other.iter().map(|((p, s), _)| format!("{p}*{s}")).collect();
    let mut model = model;
    if model.len() > 1 {
        // verl and accelerate name the model's files first; prefer those.
        let preferred: Vec<_> = model
            .iter()
            .filter(|((p, _), _)| p.starts_with("model") || p.starts_with("pytorch_model"))
            .cloned()
            .collect();
        if preferred.len() == 1 {
            model = preferred;
        }
    }
    let ((prefix, suffix), mut ranks) = match model.len() {
        0 => return Ok(None),
        1 => model.remove(0),
        _ => {
            return Err(Error::Unsupported {
                path: dir.to_path_buf(),
                what: format!(
                    "a directory holding several sets of per-rank files ({})",
                    model
                        .iter()
                        .map(|((p, s), _)| format!("{p}*{s}"))
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
                hint: Some("move the set to merge into a directory of its own".into()),
            })
        }
    };
    ranks.sort();
    for w in ranks.windows(2) {
        if w[0].0 == w[1].0 {
            return Err(Error::corrupt(
                dir,
                format!("{} and {} are both rank {}", w[0].1, w[1].1, w[0].0),
            ));
        }
    }
    let pad = ranks
        .iter()
        .filter_map(|(_, n)| {
            let digits = n
                .strip_prefix(prefix.as_str())?
                .strip_suffix(suffix.as_str())?;
            (digits.len() > 1 && digits.starts_with('0')).then_some(digits.len())
        })
        .max()
        .unwrap_or(0);
    let world_size = Regex::new(r"world_size_(\d+)")
        .ok()
        .and_then(|r| r.captures(&prefix))
        .and_then(|c| c.get(1))
        .and_then(|m| m.as_str().parse::<usize>().ok());
    Ok(Some(RankSet {
        dir: dir.to_path_buf(),
        prefix,
        suffix,
        ranks,
        pad,
        world_size,
        skipped,
    }))
}
