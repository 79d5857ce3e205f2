//! `verify`: prove that an output directory holds what merging the checkpoint
//! should have written.
//!
//! Two kinds of check, both against the plan re-derived from the inputs:
//! - **Structure.** Every shard header is valid safetensors (the strict reader of
//!   `source::safetensors`, plus no duplicate names). The index and the shards agree:
//!   every tensor is listed once, in the shard that holds it; `total_size` is right;
//!   no shard is missing, none is left over. The tensor names, shapes and dtypes are
//!   the plan's (a silently widened dtype is caught here), and config.json declares
//!   the dtype the tensors have.
//! - **Content.** Each tensor's bytes equal the checkpoint's (or, for base-filled
//!   tensors, the base's) values after the plan's conversion. Bytes must be
//!   identical, except that NaNs match by class: any NaN equals any NaN, because
//!   tools disagree on NaN payloads (see `dtype`). Tensors are compared in windows,
//!   so memory stays bounded whatever the model size.
//!
//! The expected values are gathered here with a deliberately plain algorithm (output
//! row by output row, asking each piece for the columns it holds) rather than with
//! the writer's run merging, so that a placement bug in the engine shows up as a
//! mismatch instead of being reproduced. Conversions share the `dtype` kernels,
//! which are tested bit for bit against torch.
//!
//! Problems with the output are findings, collected in a [`VerifyReport`]; only
//! problems with the inputs (which make the check itself impossible) are errors.
//!
//! The module also holds the cheaper content checks a merge runs: whether the
//! checkpoint equals the base (nothing was trained) and `--fail-on-nonfinite`.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::Arc;

use rayon::prelude::*;
use serde::de::{Deserialize, Deserializer, IgnoredAny, MapAccess, Visitor};

use crate::dtype::{self, ConvertStats};
use crate::merge::{self, MergeOptions};
use crate::plan::{Origin, Plan, PlannedTensor};
use crate::report::{human_bytes, list_some};
use crate::source::{safetensors, Blob, TensorSource};
use crate::stats::element_f64;
use crate::write::{read_tensor_range, Inputs, Progress, INTERRUPTED, WINDOW_BYTES};
use crate::{DType, Error, Result};

const INDEX: &str = "model.safetensors.index.json";
const SINGLE: &str = "model.safetensors";

/// Values `__metadata__.format` may take for transformers to load a shard.
const LOADABLE_FORMATS: &[&str] = &["pt", "tf", "flax", "mlx"];

/// A structural finding: something about the files, not the values.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Problem {
    /// The file at fault, relative to the output directory.
    pub file: Option<String>,
    pub tensor: Option<String>,
    pub msg: String,
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(file) = &self.file {
            write!(f, "{file}: ")?;
        }
        if let Some(t) = &self.tensor {
            write!(f, "tensor '{t}': ")?;
        }
        f.write_str(&self.msg)
    }
}

fn problem(file: Option<&str>, tensor: Option<&str>, msg: impl Into<String>) -> Problem {
    Problem {
        file: file.map(str::to_string),
        tensor: tensor.map(str::to_string),
        msg: msg.into(),
    }
}

/// The first element that differs.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FirstDiff {
    /// Flat (C-order) index.
    pub index: u64,
    pub expected: f64,
    pub found: f64,
}

/// A tensor whose values are not what the merge should have written.
#[derive(Clone, Debug, PartialEq)]
pub struct Mismatch {
    pub file: String,
    pub name: String,
    pub shape: Vec<u64>,
    pub dtype: DType,
    /// Elements whose bytes differ (NaN against NaN does not count).
    pub differing: u64,
    /// Of those, how many are NaN on one side and a number on the other.
    pub nan_mismatch: u64,
    /// Largest |expected − found| over the differing elements that are numbers on
    /// both sides (0 when only signed zeros or NaNs differ).
    pub max_abs_diff: f64,
    pub first: Option<FirstDiff>,
}

impl fmt::Display for Mismatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let numel: u64 = self.shape.iter().product();
        write!(
            f,
            "{}: tensor '{}': {} of {numel} element(s) differ, max abs diff {}",
            self.file,
            self.name,
            self.differing,
            num(self.max_abs_diff)
        )?;
        if self.nan_mismatch > 0 {
            write!(f, ", {} NaN against a number", self.nan_mismatch)?;
        }
        if let Some(d) = &self.first {
            write!(
                f,
                "; first at {:?}: expected {}, found {}",
                unravel(d.index, &self.shape),
                num(d.expected),
                num(d.found)
            )?;
        }
        Ok(())
    }
}

/// What `verify` found.
#[derive(Clone, Debug, Default)]
pub struct VerifyReport {
    pub dir: PathBuf,
    /// Shard files read.
    pub files: Vec<String>,
    pub problems: Vec<Problem>,
    pub mismatches: Vec<Mismatch>,
    /// Tensors whose values were compared.
    pub tensors_compared: usize,
    pub bytes_compared: u64,
}

impl VerifyReport {
    /// Whether the output is exactly what the merge should write.
    pub fn is_ok(&self) -> bool {
        self.problems.is_empty() && self.mismatches.is_empty()
    }

    /// One line: what matched, or how much did not.
    pub fn summary(&self) -> String {
        if self.is_ok() {
            format!(
                "{} tensor(s) in {} file(s) match the checkpoint ({} compared); headers, index and config are consistent",
                self.tensors_compared,
                self.files.len(),
                human_bytes(self.bytes_compared)
            )
        } else {
            let mut parts = Vec::new();
            if !self.mismatches.is_empty() {
                parts.push(format!(
                    "{} tensor(s) hold other values than the checkpoint",
                    self.mismatches.len()
                ));
            }
            if !self.problems.is_empty() {
                parts.push(format!("{} structural problem(s)", self.problems.len()));
            }
            format!("{} in {}", parts.join(" and "), self.dir.display())
        }
    }

    /// Every finding, one per line: structural problems first, then mismatches.
    pub fn findings(&self) -> Vec<String> {
        self.problems
            .iter()
            .map(ToString::to_string)
            .chain(self.mismatches.iter().map(ToString::to_string))
            .collect()
    }

    /// The failure as an error (for `merge --verify`), listing the first findings.
    pub fn to_error(&self) -> Error {
        let findings = self.findings();
        let mut msg = format!("verification failed: {}", self.summary());
        for f in findings.iter().take(10) {
            msg.push_str("\n  ");
            msg.push_str(f);
        }
        if findings.len() > 10 {
            msg.push_str(&format!("\n  and {} more", findings.len() - 10));
        }
        Error::Check {
            msg,
            hint: Some(
                "the output was not moved into place; check the disk, then run the merge again"
                    .into(),
            ),
        }
    }
}

/// Re-derives the plan from `opts` (checkpoint, base, dtype, renames...) and checks
/// the directory `opts.output` against it.
pub fn verify_against(opts: &MergeOptions, progress: &dyn Progress) -> Result<VerifyReport> {
    if !opts.output.is_dir() {
        return Err(Error::Usage(format!(
            "{} is not a directory; pass the model directory a merge wrote",
            opts.output.display()
        )));
    }
    let (ckpt, base, plan) = merge::prepare(opts)?;
    let inputs = Inputs {
        checkpoint: &ckpt,
        base: base.as_ref().and_then(|b| b.weights.as_ref()),
    };
    verify_dir(&opts.output, &plan, inputs, progress)
}

/// Checks the model directory `dir` against `plan`, whose tensors point into `inputs`.
pub fn verify_dir(
    dir: &Path,
    plan: &Plan,
    inputs: Inputs<'_>,
    progress: &dyn Progress,
) -> Result<VerifyReport> {
    let mut problems = Vec::new();
    let written = Written::read(dir, &mut problems)?;
    check_config(dir, plan, &written, &mut problems);

    // Names, shapes and dtypes against the plan.
    let mut checks: Vec<(usize, &Located)> = Vec::new();
    for (i, t) in plan.tensors.iter().enumerate() {
        let Some(loc) = written.tensors.get(&t.name) else {
            if !written.in_unreadable.contains(&t.name) {
                problems.push(problem(
                    None,
                    Some(&t.name),
                    "missing: the merge writes it, the output does not hold it",
                ));
            }
            continue;
        };
        let file = written.shards[loc.shard].name.as_str();
        if loc.shape != t.source.shape {
            problems.push(problem(
                Some(file),
                Some(&t.name),
                format!(
                    "shape {:?}, but the checkpoint's is {:?}",
                    loc.shape, t.source.shape
                ),
            ));
        } else if loc.dtype != t.dtype {
            problems.push(problem(
                Some(file),
                Some(&t.name),
                format!(
                    "stored as {}, but the merge writes {} ({} in the {})",
                    loc.dtype,
                    t.dtype,
                    t.source.dtype,
                    origin_name(t.origin)
                ),
            ));
        } else {
            checks.push((i, loc));
        }
    }
    let planned: HashSet<&str> = plan.tensors.iter().map(|t| t.name.as_str()).collect();
    let mut extra: Vec<(&String, &Located)> = written
        .tensors
        .iter()
        .filter(|(n, _)| !planned.contains(n.as_str()))
        .collect();
    extra.sort_by(|a, b| crate::plan::natural_cmp(a.0, b.0));
    for (n, loc) in extra {
        problems.push(problem(
            Some(&written.shards[loc.shard].name),
            Some(n),
            "extra: the merge does not write this tensor",
        ));
    }

    // Content, window by window, in parallel, in file order so that reading streams.
    checks.sort_by_key(|(_, loc)| (loc.shard, loc.offset));
    let mut items: Vec<(usize, u64, u64)> = Vec::new();
    for (ci, &(ti, _)) in checks.iter().enumerate() {
        let t = &plan.tensors[ti];
        let n = t.source.numel();
        let per = (WINDOW_BYTES / t.dtype.size() as u64).max(1);
        let mut e0 = 0;
        while e0 < n {
            let e1 = (e0 + per).min(n);
            items.push((ci, e0, e1));
            e0 = e1;
        }
    }
    let total: u64 = checks
        .iter()
        .map(|&(ti, _)| plan.tensors[ti].nbytes())
        .sum();
    progress.start(total);
    let results: Vec<(usize, Window)> = items
        .par_iter()
        .map_init(
            || (Vec::new(), Vec::new(), GatherBufs::default()),
            |(expected, found, bufs), &(ci, e0, e1)| {
                if INTERRUPTED.load(Ordering::Relaxed) {
                    return Err(Error::Interrupted);
                }
                let (ti, loc) = checks[ci];
                let t = &plan.tensors[ti];
                let size = t.dtype.size() as u64;
                let len = ((e1 - e0) * size) as usize;
                expected.resize(len, 0);
                gather(
                    &t.source,
                    files_of(inputs, t.origin),
                    t.dtype,
                    e0,
                    e1,
                    expected,
                    bufs,
                )?;
                found.resize(len, 0);
                let window = match &written.shards[loc.shard].file {
                    Some(file) => match read_output(file, loc.offset + e0 * size, found) {
                        Ok(()) => Window::Compared(compare(expected, found, t.dtype, e0)),
                        Err(e) => Window::Unreadable(format!(
                            "cannot read its data (the file changed during the check?): {e}"
                        )),
                    },
                    None => Window::Unreadable("the shard could not be read".into()),
                };
                progress.advance(len as u64);
                Ok((ci, window))
            },
        )
        .collect::<Result<_>>()?;
    progress.finish();

    let mut diffs = vec![Diffs::default(); checks.len()];
    let mut unreadable: Vec<Option<String>> = vec![None; checks.len()];
    for (ci, w) in results {
        match w {
            Window::Compared(d) => diffs[ci].add(d),
            Window::Unreadable(e) => unreadable[ci] = Some(e),
        }
    }
    let mut mismatches = Vec::new();
    let mut bytes_compared = 0;
    // Report in the plan's (natural name) order.
    let mut order: Vec<usize> = (0..checks.len()).collect();
    order.sort_by_key(|&ci| checks[ci].0);
    for ci in order {
        let (ti, loc) = checks[ci];
        let t = &plan.tensors[ti];
        let file = &written.shards[loc.shard].name;
        if let Some(e) = &unreadable[ci] {
            problems.push(problem(Some(file), Some(&t.name), e.clone()));
            continue;
        }
        bytes_compared += t.nbytes();
        let d = &diffs[ci];
        if d.differing > 0 {
            mismatches.push(Mismatch {
                file: file.clone(),
                name: t.name.clone(),
                shape: t.source.shape.clone(),
                dtype: t.dtype,
                differing: d.differing,
                nan_mismatch: d.nan_mismatch,
                max_abs_diff: d.max_abs,
                first: d.first,
            });
        }
    }
    Ok(VerifyReport {
        dir: dir.to_path_buf(),
        files: written.shards.iter().map(|s| s.name.clone()).collect(),
        problems,
        mismatches,
        tensors_compared: checks.len(),
        bytes_compared,
    })
}

fn origin_name(o: Origin) -> &'static str {
    match o {
        Origin::Checkpoint => "checkpoint",
        Origin::Base => "base",
    }
}

fn files_of<'a>(inputs: Inputs<'a>, origin: Origin) -> &'a [Arc<Blob>] {
    match (origin, inputs.base) {
        (Origin::Checkpoint, _) => &inputs.checkpoint.files,
        (Origin::Base, Some(b)) => &b.files,
        (Origin::Base, None) => &[],
    }
}

enum Window {
    Compared(Diffs),
    Unreadable(String),
}

/// The weights of an output directory as they are on disk.
struct Written {
    shards: Vec<Shard>,
    tensors: HashMap<String, Located>,
    /// Tensors the index places in a shard that could not be read (reported once,
    /// with the shard, rather than one by one as missing).
    in_unreadable: HashSet<String>,
}

struct Shard {
    name: String,
    /// Open for reading; `None` when the file is missing or its header is invalid.
    file: Option<File>,
}

#[derive(Debug)]
struct Located {
    shard: usize,
    dtype: DType,
    shape: Vec<u64>,
    /// Byte offset of the tensor's data in its file.
    offset: u64,
}

/// `model.safetensors.index.json`, as far as it could be parsed.
struct Index {
    /// `(tensor, file)` in file order.
    weight_map: Vec<(String, String)>,
    total_size: Option<u64>,
}

impl Written {
    fn read(dir: &Path, problems: &mut Vec<Problem>) -> Result<Written> {
        let mut written = Written {
            shards: Vec::new(),
            tensors: HashMap::new(),
            in_unreadable: HashSet::new(),
        };
        let has_single = dir.join(SINGLE).is_file();
        let index = if dir.join(INDEX).is_file() {
            Some(read_index(&dir.join(INDEX), problems)?)
        } else {
            None
        };
        let mut names: Vec<String> = match &index {
            Some(ix) => {
                let mut v: Vec<String> = ix.weight_map.iter().map(|(_, f)| f.clone()).collect();
                v.sort();
                v.dedup();
                if has_single && !v.iter().any(|f| f == SINGLE) {
                    problems.push(problem(
                        Some(SINGLE),
                        None,
                        format!("present beside {INDEX}, which does not list it; loaders read {SINGLE} and ignore the index"),
                    ));
                }
                v
            }
            None if has_single => vec![SINGLE.to_string()],
            None => {
                problems.push(problem(
                    None,
                    None,
                    format!(
                        "no {SINGLE} and no {INDEX}: the directory holds no safetensors weights"
                    ),
                ));
                return Ok(written);
            }
        };
        names.retain(|n| !n.is_empty());

        // Left-over shards of another write confuse loaders and users alike.
        let mut stale: Vec<String> = std::fs::read_dir(dir)
            .map_err(|e| Error::io("list", dir, e))?
            .filter_map(|e| e.ok())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with("model") && n.ends_with(".safetensors"))
            .filter(|n| !names.contains(n))
            .collect();
        stale.sort();
        for s in stale {
            let why = if index.is_some() {
                format!("not listed in {INDEX} (left over from another write?)")
            } else {
                format!("beside {SINGLE} (left over from another write?)")
            };
            problems.push(problem(Some(&s), None, why));
        }

        for name in names {
            let path = dir.join(&name);
            let file = if !path.is_file() {
                problems.push(problem(
                    Some(INDEX),
                    None,
                    format!("lists {name}, which does not exist"),
                ));
                None
            } else {
                match read_shard(&path, &name, problems) {
                    Ok((file, header)) => {
                        let shard = written.shards.len();
                        for (t, dtype, shape, begin, _) in header.tensors {
                            if let Some(prev) = written.tensors.get(&t) {
                                problems.push(problem(
                                    Some(&name),
                                    Some(&t),
                                    format!(
                                        "stored twice: also in {}",
                                        written.shards[prev.shard].name
                                    ),
                                ));
                                continue;
                            }
                            written.tensors.insert(
                                t,
                                Located {
                                    shard,
                                    dtype,
                                    shape,
                                    offset: header.data_start + begin,
                                },
                            );
                        }
                        Some(file)
                    }
                    Err(e) => {
                        problems.push(problem(None, None, e.to_string()));
                        None
                    }
                }
            };
            written.shards.push(Shard { name, file });
        }

        if let Some(ix) = &index {
            written.check_index(ix, problems);
        }
        Ok(written)
    }

    /// The index and the shards must agree entry for entry.
    fn check_index(&mut self, ix: &Index, problems: &mut Vec<Problem>) {
        let shard_of: HashMap<&str, usize> = self
            .shards
            .iter()
            .enumerate()
            .map(|(i, s)| (s.name.as_str(), i))
            .collect();
        let mut listed: HashMap<&str, &str> = HashMap::new();
        for (t, f) in &ix.weight_map {
            listed.insert(t, f);
            let Some(&si) = shard_of.get(f.as_str()) else {
                continue;
            };
            if self.shards[si].file.is_none() {
                self.in_unreadable.insert(t.clone());
                continue;
            }
            match self.tensors.get(t) {
                None => problems.push(problem(
                    Some(INDEX),
                    Some(t),
                    format!("listed in {f}, which does not hold it"),
                )),
                Some(loc) if loc.shard != si => problems.push(problem(
                    Some(INDEX),
                    Some(t),
                    format!(
                        "listed in {f}, but it is stored in {}",
                        self.shards[loc.shard].name
                    ),
                )),
                Some(_) => {}
            }
        }
        let mut unlisted: Vec<(&String, &Located)> = self
            .tensors
            .iter()
            .filter(|(n, _)| !listed.contains_key(n.as_str()))
            .collect();
        unlisted.sort_by(|a, b| crate::plan::natural_cmp(a.0, b.0));
        for (n, loc) in unlisted {
            problems.push(problem(
                Some(INDEX),
                Some(n),
                format!(
                    "stored in {} but missing from the weight_map, so loaders never read it",
                    self.shards[loc.shard].name
                ),
            ));
        }
        for s in self.shards.iter().filter(|s| s.file.is_none()) {
            let mut lost: Vec<&str> = ix
                .weight_map
                .iter()
                .filter(|(_, f)| *f == s.name)
                .map(|(t, _)| t.as_str())
                .collect();
            if !lost.is_empty() {
                lost.sort_by(|a, b| crate::plan::natural_cmp(a, b));
                problems.push(problem(
                    Some(&s.name),
                    None,
                    format!(
                        "unreadable, so the {} tensor(s) the index puts in it were not checked: {}",
                        lost.len(),
                        list_some(&lost, 6)
                    ),
                ));
            }
        }
        let all_read = self.shards.iter().all(|s| s.file.is_some());
        match ix.total_size {
            Some(declared) if all_read => {
                let actual: u64 = self
                    .tensors
                    .values()
                    .map(|l| l.shape.iter().product::<u64>() * l.dtype.size() as u64)
                    .sum();
                if declared != actual {
                    problems.push(problem(
                        Some(INDEX),
                        None,
                        format!("metadata.total_size is {declared}, but the shards hold {actual} bytes of tensor data"),
                    ));
                }
            }
            _ => {}
        }
    }
}

/// Opens a shard and validates its header, beyond the reader's checks: no name twice
/// (JSON parsers silently keep the last one) and a `format` loaders accept.
fn read_shard(
    path: &Path,
    name: &str,
    problems: &mut Vec<Problem>,
) -> Result<(File, safetensors::Header)> {
    let blob = Blob::open(path)?;
    let header = safetensors::read_header(path, blob.bytes())?;
    let text = blob
        .bytes()
        .get(8..header.data_start as usize)
        .and_then(|b| std::str::from_utf8(b).ok())
        .unwrap_or("{}");
    if let Ok(KeyList(keys)) = serde_json::from_str::<KeyList>(text.trim_end()) {
        for d in duplicates(&keys) {
            problems.push(problem(
                Some(name),
                Some(&d),
                "named twice in the header (readers keep only the last entry)",
            ));
        }
    }
    if let Some((_, f)) = header.metadata.iter().find(|(k, _)| k == "format") {
        if !LOADABLE_FORMATS.contains(&f.as_str()) {
            problems.push(problem(
                Some(name),
                None,
                format!(
                    "__metadata__.format is '{f}'; transformers loads only 'pt' (or tf, flax, mlx)"
                ),
            ));
        }
    }
    let file = File::open(path).map_err(|e| Error::io("open", path, e))?;
    Ok((file, header))
}

/// Reads output bytes at `offset`, first asking the kernel to start reading the
/// bytes that follow, so that the disk works while this window is compared.
fn read_output(f: &File, offset: u64, buf: &mut [u8]) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    let len = buf.len() as i64;
    if let Ok(next) = i64::try_from(offset + buf.len() as u64) {
        // SAFETY: fadvise only reads the descriptor, which is open for the call.
        let _ =
            unsafe { libc::posix_fadvise(f.as_raw_fd(), next, 2 * len, libc::POSIX_FADV_WILLNEED) };
    }
    f.read_exact_at(buf, offset)
}

fn read_index(path: &Path, problems: &mut Vec<Problem>) -> Result<Index> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::io("read", path, e))?;
    let mut ix = Index {
        weight_map: Vec::new(),
        total_size: None,
    };
    let json: serde_json::Value = match serde_json::from_str(&text) {
        Ok(v) => v,
        Err(e) => {
            problems.push(problem(Some(INDEX), None, format!("not valid JSON: {e}")));
            return Ok(ix);
        }
    };
    match json.get("metadata").and_then(|m| m.get("total_size")) {
        Some(v) => match v.as_u64() {
            Some(n) => ix.total_size = Some(n),
            None => problems.push(problem(
                Some(INDEX),
                None,
                format!("metadata.total_size is {v}, not a byte count"),
            )),
        },
        None => problems.push(problem(Some(INDEX), None, "no metadata.total_size")),
    }
    let Some(map) = json.get("weight_map").and_then(|m| m.as_object()) else {
        problems.push(problem(Some(INDEX), None, "no weight_map object"));
        return Ok(ix);
    };
    #[derive(serde::Deserialize)]
    struct MapKeys {
        weight_map: KeyList,
    }
    if let Ok(m) = serde_json::from_str::<MapKeys>(&text) {
        for d in duplicates(&m.weight_map.0) {
            problems.push(problem(
                Some(INDEX),
                Some(&d),
                "listed twice in the weight_map (readers keep only the last entry)",
            ));
        }
    }
    for (t, f) in map {
        match f.as_str() {
            Some(f) if !f.is_empty() && !f.contains(['/', '\\']) && f != ".." => {
                ix.weight_map.push((t.clone(), f.to_string()))
            }
            _ => problems.push(problem(
                Some(INDEX),
                Some(t),
                format!("weight_map entry {f} is not a file name in the directory"),
            )),
        }
    }
    Ok(ix)
}

/// The keys of a JSON object, in order and with repeats (which `serde_json::Map`
/// would fold away).
struct KeyList(Vec<String>);

impl<'de> Deserialize<'de> for KeyList {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct Keys;
        impl<'de> Visitor<'de> for Keys {
            type Value = KeyList;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: MapAccess<'de>>(
                self,
                mut m: A,
            ) -> std::result::Result<KeyList, A::Error> {
                let mut keys = Vec::new();
                while let Some((k, IgnoredAny)) = m.next_entry::<String, IgnoredAny>()? {
                    keys.push(k);
                }
                Ok(KeyList(keys))
            }
        }
        d.deserialize_map(Keys)
    }
}

fn duplicates(keys: &[String]) -> Vec<String> {
    let mut seen = HashSet::new();
    let mut dup: Vec<String> = keys
        .iter()
        .filter(|k| !seen.insert(k.as_str()))
        .cloned()
        .collect();
    dup.dedup();
    dup
}

/// config.json must be there when the merge writes one, and must declare the
/// dtype of the floating tensors (transformers loads with `dtype="auto"` from it).
fn check_config(dir: &Path, plan: &Plan, written: &Written, problems: &mut Vec<Problem>) {
    let path = dir.join("config.json");
    let text = match std::fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            if plan.config.is_some() {
                problems.push(problem(
                    Some("config.json"),
                    None,
                    "missing: the merge writes the base's config",
                ));
            }
            return;
        }
        Err(e) => {
            problems.push(problem(
                Some("config.json"),
                None,
                format!("cannot be read: {e}"),
            ));
            return;
        }
    };
    let config: serde_json::Map<String, serde_json::Value> = match serde_json::from_str(&text) {
        Ok(c) => c,
        Err(e) => {
            problems.push(problem(
                Some("config.json"),
                None,
                format!("not a JSON object: {e}"),
            ));
            return;
        }
    };
    let mut stored: Vec<DType> = written
        .tensors
        .values()
        .map(|l| l.dtype)
        .filter(|d| d.is_float())
        .collect();
    stored.sort();
    stored.dedup();
    let stored_names: Vec<&str> = stored.iter().map(|d| d.torch_name()).collect();
    for key in ["dtype", "torch_dtype"] {
        let Some(v) = config.get(key) else {
            continue;
        };
        let Some(s) = v.as_str() else {
            if !v.is_null() {
                problems.push(problem(
                    Some("config.json"),
                    None,
                    format!("\"{key}\" is {v}, not a dtype name"),
                ));
            }
            continue;
        };
        let Some(declared) = DType::from_torch_name(s) else {
            problems.push(problem(
                Some("config.json"),
                None,
                format!("\"{key}\": \"{s}\" is not a dtype torch knows"),
            ));
            continue;
        };
        let tensors_disagree = !stored.is_empty() && !stored.contains(&declared);
        let planned = plan.dtype.filter(|&d| d != declared);
        let msg = if tensors_disagree {
            format!(
                "declares \"{key}\": \"{s}\", but the tensors are {}",
                stored_names.join(", ")
            )
        } else if let Some(d) = planned {
            format!("declares \"{key}\": \"{s}\", but the merge writes {d}")
        } else {
            continue;
        };
        problems.push(problem(Some("config.json"), None, msg));
    }
}

/// Differences found in one window or one tensor.
#[derive(Clone, Copy, Debug, Default)]
struct Diffs {
    differing: u64,
    nan_mismatch: u64,
    max_abs: f64,
    first: Option<FirstDiff>,
}

impl Diffs {
    fn add(&mut self, o: Diffs) {
        self.differing += o.differing;
        self.nan_mismatch += o.nan_mismatch;
        self.max_abs = self.max_abs.max(o.max_abs);
        self.first = match (self.first, o.first) {
            (Some(a), Some(b)) => Some(if b.index < a.index { b } else { a }),
            (a, b) => a.or(b),
        };
    }
}

/// Compares two windows of `dtype` elements byte for byte, NaN matching NaN.
fn compare(expected: &[u8], found: &[u8], dtype: DType, e0: u64) -> Diffs {
    let mut d = Diffs::default();
    if expected == found {
        return d;
    }
    let size = dtype.size();
    for (i, (e, f)) in expected
        .chunks_exact(size)
        .zip(found.chunks_exact(size))
        .enumerate()
    {
        if e == f {
            continue;
        }
        let (ve, vf) = (element_f64(e, dtype), element_f64(f, dtype));
        if ve.is_nan() && vf.is_nan() {
            continue;
        }
        d.differing += 1;
        if ve.is_nan() || vf.is_nan() {
            d.nan_mismatch += 1;
        } else {
            let diff = (ve - vf).abs();
            // inf against inf of the other sign, or against a number.
            d.max_abs = d
                .max_abs
                .max(if diff.is_nan() { f64::INFINITY } else { diff });
        }
        if d.first.is_none() {
            d.first = Some(FirstDiff {
                index: e0 + i as u64,
                expected: ve,
                found: vf,
            });
        }
    }
    d
}

/// Whether two windows hold the same values (bytes equal, NaN matching NaN).
fn same_values(a: &[u8], b: &[u8], dtype: DType) -> bool {
    a == b || compare(a, b, dtype, 0).differing == 0
}

/// A piece seen with at least one dimension, so that a 0-d tensor is a single row
/// of one column.
struct PieceBox<'a> {
    blob: &'a Blob,
    byte_offset: u64,
    dtype: DType,
    big_endian: bool,
    shape: Vec<u64>,
    strides: Vec<u64>,
    offset: Vec<u64>,
}

/// Fills `out` with elements `[e0, e1)` (C order) of `t`, converted to `to`.
///
/// Walks the output rows (the last dimension) that the window touches; for each,
/// every piece whose box contains the row's leading index contributes the columns
/// it holds. Each element is placed by its own coordinates, independently of the
/// writer's run merging. An element no piece holds is an error.
fn gather(
    t: &TensorSource,
    files: &[Arc<Blob>],
    to: DType,
    e0: u64,
    e1: u64,
    out: &mut [u8],
    bufs: &mut GatherBufs,
) -> Result<()> {
    if e0 >= e1 {
        return Ok(());
    }
    let one = [1u64];
    let shape: &[u64] = if t.shape.is_empty() { &one } else { &t.shape };
    let nd = shape.len();
    let cols = shape[nd - 1];
    let lead = &shape[..nd - 1];
    let bad = |path: &Path, msg: String| Error::bad_tensor(path, &t.name, msg);
    let mut boxes = Vec::with_capacity(t.pieces.len());
    for p in &t.pieces {
        let blob = files
            .get(p.file)
            .ok_or_else(|| bad(Path::new("?"), "a piece refers to a missing file".into()))?;
        let (pshape, pstrides, poff) = if p.shape.is_empty() && t.shape.is_empty() {
            (vec![1], vec![1], vec![0])
        } else {
            (p.shape.clone(), p.strides.clone(), p.global_offset.clone())
        };
        if pshape.len() != nd || pstrides.len() != nd || poff.len() != nd {
            return Err(bad(
                &blob.path,
                format!(
                    "a piece of shape {:?} at {:?} does not fit a tensor of shape {:?}",
                    p.shape, p.global_offset, t.shape
                ),
            ));
        }
        if pshape.contains(&0) {
            continue;
        }
        boxes.push(PieceBox {
            blob,
            byte_offset: p.byte_offset,
            dtype: p.dtype,
            big_endian: p.big_endian,
            shape: pshape,
            strides: pstrides,
            offset: poff,
        });
    }
    // Read ahead a share of a window per piece: few reads, bounded memory.
    bufs.ahead.resize_with(boxes.len(), ReadAhead::default);
    let chunk = (2 * WINDOW_BYTES / boxes.len().max(1) as u64).clamp(64 << 10, 4 << 20);
    let osize = to.size() as u64;
    let first_row = e0 / cols;
    let last_row = (e1 - 1) / cols;
    // Leading index of the first row, then counted up row by row.
    let mut idx = vec![0u64; lead.len()];
    let mut r = first_row;
    for d in (0..lead.len()).rev() {
        idx[d] = r % lead[d].max(1);
        r /= lead[d].max(1);
    }
    let mut covered = 0u64;
    for row in first_row..=last_row {
        let row_start = row * cols;
        let c0 = e0.max(row_start) - row_start;
        let c1 = e1.min(row_start + cols) - row_start;
        for (bi, b) in boxes.iter().enumerate() {
            let holds_row =
                (0..nd - 1).all(|d| idx[d] >= b.offset[d] && idx[d] - b.offset[d] < b.shape[d]);
            if !holds_row {
                continue;
            }
            let (lo, hi) = (
                b.offset[nd - 1],
                b.offset[nd - 1].saturating_add(b.shape[nd - 1]),
            );
            let (a, z) = (c0.max(lo), c1.min(hi));
            if a >= z {
                continue;
            }
            // `idx` has the leading dimensions only; zip stops there.
            let src = (a - lo) * b.strides[nd - 1]
                + idx
                    .iter()
                    .zip(&b.offset)
                    .zip(&b.strides)
                    .map(|((i, o), s)| (i - o) * s)
                    .sum::<u64>();
            let count = z - a;
            let dst_at = (row_start + a - e0) * osize;
            let dst = &mut out[dst_at as usize..(dst_at + count * osize) as usize];
            let bytes = source_bytes(
                b,
                src,
                b.strides[nd - 1],
                count,
                chunk,
                &mut bufs.ahead[bi],
                &mut bufs.scratch,
            )
            .map_err(|msg| bad(&b.blob.path, msg))?;
            dtype::convert(bytes, b.dtype, dst, to);
            covered += count;
        }
        for d in (0..lead.len()).rev() {
            idx[d] += 1;
            if idx[d] < lead[d] {
                break;
            }
            idx[d] = 0;
        }
    }
    if covered < e1 - e0 {
        return Err(Error::bad_tensor(
            t.pieces
                .first()
                .and_then(|p| files.get(p.file))
                .map(|b| b.path.clone())
                .unwrap_or_default(),
            &t.name,
            format!(
                "its pieces leave {} of elements [{e0}, {e1}) uncovered",
                e1 - e0 - covered
            ),
        ));
    }
    Ok(())
}

/// Source bytes read ahead for one piece, so that gathering row by row costs one
/// positioned read per chunk rather than one per row.
#[derive(Default)]
struct ReadAhead {
    /// Which file the bytes are from (the blob's address; 0 = nothing yet).
    blob: usize,
    start: u64,
    data: Vec<u8>,
}

/// Buffers reused across the windows a thread gathers.
#[derive(Default)]
struct GatherBufs {
    scratch: Vec<u8>,
    ahead: Vec<ReadAhead>,
}

/// The little-endian bytes of `count` elements of a piece, `stride` apart,
/// starting `first` elements in: a slice of the read-ahead buffer when they are
/// contiguous, else gathered into `scratch`.
fn source_bytes<'a>(
    b: &PieceBox<'_>,
    first: u64,
    stride: u64,
    count: u64,
    chunk: u64,
    ahead: &'a mut ReadAhead,
    scratch: &'a mut Vec<u8>,
) -> std::result::Result<&'a [u8], String> {
    let size = b.dtype.size() as u64;
    let past_end = || "its data lies past the end of the file".to_string();
    let start = first
        .checked_mul(size)
        .and_then(|x| x.checked_add(b.byte_offset))
        .ok_or_else(past_end)?;
    let len = count.checked_mul(size).ok_or_else(past_end)?;
    let end = start.checked_add(len).ok_or_else(past_end)?;
    if stride == 1 && !b.big_endian {
        let key = b.blob as *const Blob as usize;
        let held = ahead.blob == key
            && start >= ahead.start
            && end <= ahead.start + ahead.data.len() as u64;
        if !held {
            let until = start
                .saturating_add(chunk.max(len))
                .min(b.blob.len())
                .max(end);
            let n = usize::try_from(until - start).map_err(|_| past_end())?;
            ahead.blob = 0;
            ahead.data.resize(n, 0);
            b.blob
                .read_at(start, &mut ahead.data)
                .map_err(|e| e.to_string())?;
            (ahead.blob, ahead.start) = (key, start);
        }
        let at = (start - ahead.start) as usize;
        return Ok(&ahead.data[at..at + len as usize]);
    }
    scratch.resize(usize::try_from(len).map_err(|_| past_end())?, 0);
    if stride == 1 {
        b.blob.read_at(start, scratch).map_err(|e| e.to_string())?;
    } else {
        let data = b.blob.bytes();
        for (j, dst) in scratch.chunks_exact_mut(size as usize).enumerate() {
            let at = (j as u64)
                .checked_mul(stride * size)
                .and_then(|x| x.checked_add(start))
                .and_then(|x| usize::try_from(x).ok())
                .ok_or_else(past_end)?;
            let src = data.get(at..at + size as usize).ok_or_else(past_end)?;
            dst.copy_from_slice(src);
        }
    }
    if b.big_endian {
        dtype::byteswap(scratch, size as usize);
    }
    Ok(scratch)
}

/// Whether every checkpoint tensor equals the base's after conversion to the output
/// dtype, i.e. the merge would write the base again (an adapter-only export, a
/// checkpoint saved before the first step). Returns how many tensors were compared
/// when they all match.
///
/// Cheap when training changed something: the first window of each tensor is
/// compared first, and the rest is read only if all of those match.
pub fn unchanged_from_base(plan: &Plan, inputs: Inputs<'_>) -> Result<Option<usize>> {
    const FIRST_BYTES: u64 = 64 << 10;
    let Some(base) = inputs.base else {
        return Ok(None);
    };
    let by_name: HashMap<&str, &TensorSource> =
        base.tensors.iter().map(|t| (t.name.as_str(), t)).collect();
    let mut pairs: Vec<(&PlannedTensor, &TensorSource)> = Vec::new();
    for t in plan
        .tensors
        .iter()
        .filter(|t| t.origin == Origin::Checkpoint)
    {
        match by_name.get(t.name.as_str()) {
            Some(b) if b.shape == t.source.shape && dtype::can_convert(b.dtype, t.dtype) => {
                pairs.push((t, b))
            }
            _ => return Ok(None),
        }
    }
    if pairs.is_empty() {
        return Ok(None);
    }
    let window_equal = |t: &PlannedTensor,
                        b: &TensorSource,
                        e0: u64,
                        e1: u64,
                        bufs: &mut (Vec<u8>, Vec<u8>)|
     -> Result<bool> {
        let len = ((e1 - e0) * t.dtype.size() as u64) as usize;
        bufs.0.resize(len, 0);
        bufs.1.resize(len, 0);
        read_tensor_range(
            &inputs.checkpoint.files,
            &t.source,
            t.dtype,
            e0,
            e1,
            &mut bufs.0,
        )?;
        read_tensor_range(&base.files, b, t.dtype, e0, e1, &mut bufs.1)?;
        Ok(same_values(&bufs.0, &bufs.1, t.dtype))
    };
    let mut bufs = (Vec::new(), Vec::new());
    let mut rest: Vec<(usize, u64, u64)> = Vec::new();
    for (i, (t, b)) in pairs.iter().enumerate() {
        let n = t.source.numel();
        let head = (FIRST_BYTES / t.dtype.size() as u64)
            .clamp(1, n.max(1))
            .min(n);
        if !window_equal(t, b, 0, head, &mut bufs)? {
            return Ok(None);
        }
        let per = (WINDOW_BYTES / t.dtype.size() as u64).max(1);
        let mut e0 = head;
        while e0 < n {
            let e1 = (e0 + per).min(n);
            rest.push((i, e0, e1));
            e0 = e1;
        }
    }
    let differs = rest
        .par_iter()
        .map_init(
            || (Vec::new(), Vec::new()),
            |bufs, &(i, e0, e1)| window_equal(pairs[i].0, pairs[i].1, e0, e1, bufs),
        )
        .find_any(|r| !matches!(r, Ok(true)));
    match differs {
        Some(Err(e)) => Err(e),
        Some(_) => Ok(None),
        None => Ok(Some(pairs.len())),
    }
}

/// `--fail-on-nonfinite`: an error naming every tensor that holds NaN or inf in
/// the checkpoint or that overflowed to inf in the cast.
pub fn check_finite(plan: &Plan, stats: &[ConvertStats]) -> Result<()> {
    let bad: Vec<String> = plan
        .tensors
        .iter()
        .zip(stats)
        .filter(|(_, s)| s.nan + s.inf + s.overflow > 0)
        .map(|(t, s)| {
            let mut what = format!("'{}' ({} NaN, {} inf", t.name, s.nan, s.inf);
            if s.overflow > 0 {
                what.push_str(&format!(
                    ", {} overflowed to inf in {}",
                    s.overflow, t.dtype
                ));
            }
            what.push(')');
            what
        })
        .collect();
    if bad.is_empty() {
        return Ok(());
    }
    Err(Error::Check {
        msg: format!(
            "{} tensor(s) hold non-finite values: {}",
            bad.len(),
            list_some(&bad, 6)
        ),
        hint: Some(
            "the output was not written; the run may have diverged. Drop --fail-on-nonfinite to write it anyway"
                .into(),
        ),
    })
}

/// Asks the kernel to drop the cached pages of the planned shard files (fsynced, so
/// clean), so that a verification right after writing reads them back from the disk
/// rather than from memory. A hint: failures are ignored.
pub fn drop_cached(dir: &Path, plan: &Plan) {
    use std::os::fd::AsRawFd;
    for s in &plan.shards {
        if let Ok(f) = std::fs::File::open(dir.join(&s.file_name)) {
            // SAFETY: fadvise only reads the descriptor, which is open for the call.
            let _ = unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
        }
    }
}

/// A C-order flat index as coordinates.
pub fn unravel(mut i: u64, shape: &[u64]) -> Vec<u64> {
    let mut idx = vec![0; shape.len()];
    for (x, &n) in idx.iter_mut().zip(shape).rev() {
        let n = n.max(1);
        *x = i % n;
        i /= n;
    }
    idx
}

/// A number in a short readable form.
pub(crate) fn num(v: f64) -> String {
    let a = v.abs();
    if v.is_nan() || v.is_infinite() || a == 0.0 || (1e-4..1e7).contains(&a) {
        format!("{v}")
    } else {
        format!("{v:e}")
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::source::Piece;

    fn f32_blob(values: &[f32]) -> Arc<Blob> {
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        Arc::new(Blob::owned(PathBuf::from("mem"), bytes))
    }

    fn piece(shape: &[u64], strides: &[u64], off: &[u64], byte_offset: u64) -> Piece {
        Piece {
            file: 0,
            byte_offset,
            dtype: DType::F32,
            shape: shape.to_vec(),
            strides: strides.to_vec(),
            global_offset: off.to_vec(),
            big_endian: false,
        }
    }

    fn tensor(shape: &[u64], pieces: Vec<Piece>) -> TensorSource {
        TensorSource {
            name: "t".into(),
            dtype: DType::F32,
            shape: shape.to_vec(),
            pieces,
            storage: None,
            layout: None,
        }
    }

    fn gathered(t: &TensorSource, files: &[Arc<Blob>], e0: u64, e1: u64) -> Result<Vec<f32>> {
        let mut out = vec![0u8; ((e1 - e0) * 4) as usize];
        gather(
            t,
            files,
            DType::F32,
            e0,
            e1,
            &mut out,
            &mut GatherBufs::default(),
        )?;
        Ok(out
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect())
    }

    #[test]
    fn gathers_column_shards_and_transposed_views_by_coordinates() {
        // A 2x3 tensor [[0,1,2],[3,4,5]] as two column shards: cols 0..1 and 1..3,
        // the second stored transposed (3x... strides (1, 2)).
        let files = vec![f32_blob(&[0.0, 3.0, 1.0, 4.0, 2.0, 5.0])];
        let t = tensor(
            &[2, 3],
            vec![
                piece(&[2, 1], &[1, 1], &[0, 0], 0),
                piece(&[2, 2], &[1, 2], &[0, 1], 8),
            ],
        );
        assert_eq!(
            gathered(&t, &files, 0, 6).unwrap(),
            [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
        );
        // A window that starts and ends mid-row.
        assert_eq!(gathered(&t, &files, 2, 5).unwrap(), [2.0, 3.0, 4.0]);
    }

    #[test]
    fn an_element_no_piece_holds_is_an_error_naming_the_tensor() {
        let files = vec![f32_blob(&[0.0, 1.0])];
        let t = tensor(&[4], vec![piece(&[2], &[1], &[0], 0)]);
        let e = gathered(&t, &files, 0, 4).unwrap_err().to_string();
        assert!(e.contains("'t'") && e.contains("uncovered"), "{e}");
    }

    #[test]
    fn narrow_rows_share_one_read_and_big_endian_pieces_are_swapped() {
        // [1000, 3], rows 0..600 in one piece, rows 600..1000 in another stored
        // big-endian; read as windows that cut rows.
        let values: Vec<f32> = (0..3000).map(|i| i as f32).collect();
        let mut bytes: Vec<u8> = values[..1800]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        bytes.extend(values[1800..].iter().flat_map(|v| v.to_be_bytes()));
        let files = vec![Arc::new(Blob::owned(PathBuf::from("mem"), bytes))];
        let mut big = piece(&[400, 3], &[3, 1], &[600, 0], 1800 * 4);
        big.big_endian = true;
        let t = tensor(&[1000, 3], vec![piece(&[600, 3], &[3, 1], &[0, 0], 0), big]);
        let mut bufs = GatherBufs::default();
        for (e0, e1) in [(0, 1000), (1000, 2001), (2001, 3000)] {
            let mut out = vec![0u8; ((e1 - e0) * 4) as usize];
            gather(&t, &files, DType::F32, e0, e1, &mut out, &mut bufs).unwrap();
            let got: Vec<f32> = out
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect();
            assert_eq!(got, values[e0 as usize..e1 as usize]);
        }
    }

    #[test]
    fn a_scalar_is_one_element() {
        let files = vec![f32_blob(&[7.0])];
        let t = tensor(&[], vec![piece(&[], &[], &[], 0)]);
        assert_eq!(gathered(&t, &files, 0, 1).unwrap(), [7.0]);
    }

    #[test]
    fn nan_matches_nan_but_signed_zeros_do_not_match() {
        let bf = |v: &[u16]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
        // 0x7fc0 and 0xffff are both NaN; 0x0000 and 0x8000 are +0 and -0.
        let d = compare(
            &bf(&[0x7fc0, 0x0000]),
            &bf(&[0xffff, 0x0000]),
            DType::BF16,
            0,
        );
        assert_eq!(d.differing, 0);
        let d = compare(
            &bf(&[0x3f80, 0x0000]),
            &bf(&[0x3f80, 0x8000]),
            DType::BF16,
            10,
        );
        assert_eq!((d.differing, d.max_abs), (1, 0.0));
        assert_eq!(d.first.map(|f| f.index), Some(11));
        let d = compare(
            &bf(&[0x3f80, 0x7fc0]),
            &bf(&[0x4000, 0x3f80]),
            DType::BF16,
            0,
        );
        assert_eq!((d.differing, d.nan_mismatch, d.max_abs), (2, 1, 1.0));
    }

    #[test]
    fn finds_duplicate_keys_that_json_maps_fold_away() {
        let KeyList(keys) = serde_json::from_str(r#"{"a": 1, "b": {"x": 2}, "a": 3}"#).unwrap();
        assert_eq!(duplicates(&keys), ["a"]);
    }

    #[test]
    fn unravels_flat_indices() {
        assert_eq!(unravel(5, &[2, 3]), [1, 2]);
        assert_eq!(unravel(0, &[]), Vec::<u64>::new());
    }
}
