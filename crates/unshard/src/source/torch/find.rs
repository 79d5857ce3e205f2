//! Where the state dict is inside a pickle: at `--key`, at the top level, under the
//! usual wrapper keys, or the only nested dict holding tensors; and the plain tensors
//! of a single file.

use std::collections::{HashMap, HashSet};
use std::path::Path;

use unshard_pickle::{NodeId, Pickle, Value};

use super::rebuild::{is_tensor_like, leaf, subclass_local, Leaf};
use super::values::{describe, dict_get, dict_of, str_of};
use super::TorchPayload;
use crate::error::{Error, Result};
use crate::source::{Extra, FileId, TensorSource};

/// How deep value walks may go before the structure is called hostile. Real state
/// dicts are 2-4 levels deep; a cycle or a bomb hits this quickly.
const MAX_DEPTH: usize = 64;

/// Where the tensors are inside a payload.
#[derive(Debug)]
pub struct Found {
    /// Dotted path of the tensor dict (`None` = the top level).
    pub key: Option<String>,
    /// `(name, node)` of every tensor-like entry, in file order.
    pub tensors: Vec<(String, NodeId)>,
    /// Non-tensor entries of the dict and of the wrappers around it.
    pub extras: Vec<Extra>,
}

/// How `inspect` describes one rank's local shard of a distributed tensor read from
/// a single file; merging such a file alone is refused.
pub const LOCAL_SHARD: &str = "local shard of global shape";

/// Keys under which trainers nest the state dict, in the order they are tried.
pub const WRAPPER_KEYS: &[&str] = &["state", "state_dict", "model", "module", "model_state_dict"];

/// Finds the tensor dict: at `key` when given, else at the top level, else under the
/// usual wrapper keys, else the only nested dict that holds tensors.
pub fn find_tensors(p: &Pickle, path: &Path, key: Option<&str>) -> Result<Found> {
    let root = p.root();
    let mut extras = Vec::new();
    let (dict, at) = match key {
        Some(k) if !k.is_empty() => (
            navigate(p, path, root, k, &mut extras)?,
            Some(k.to_string()),
        ),
        _ => match auto_find(p, root, "", 0, &mut extras, &mut Search::default())? {
            Some((d, k)) => (d, k),
            None => {
                let mut candidates = Vec::new();
                any_tensor_dicts(p, root, "", 0, &mut candidates, &mut Search::default());
                return Err(match candidates.len() {
                    0 | 1 => Error::NoTensors {
                        path: path.to_path_buf(),
                        at: None,
                        hint: Some(format!(
                            "the file holds {}; it is not a state dict",
                            describe(p, root)
                        )),
                    },
                    _ => Error::AmbiguousTensors {
                        path: path.to_path_buf(),
                        candidates,
                    },
                });
            }
        },
    };
    let Some(items) = dict_of(p, dict) else {
        return Err(Error::NoTensors {
            path: path.to_path_buf(),
            at,
            hint: Some(format!(
                "that key holds {}, not a dict of tensors",
                describe(p, dict)
            )),
        });
    };
    let prefix = at.as_ref().map(|k| format!("{k}.")).unwrap_or_default();
    let mut tensors = Vec::new();
    for (k, v) in items {
        let name = match p.get(*k) {
            Value::Str(s) => s.clone(),
            Value::Int(i) => i.to_string(),
            _ => continue,
        };
        if is_tensor_like(p, *v) {
            tensors.push((name, *v));
        } else {
            extras.push(Extra {
                name: format!("{prefix}{name}"),
                kind: describe(p, *v),
            });
        }
    }
    if tensors.is_empty() {
        return Err(Error::NoTensors {
            path: path.to_path_buf(),
            at,
            hint: None,
        });
    }
    Ok(Found {
        key: at,
        tensors,
        extras,
    })
}

fn dict_has_tensors(p: &Pickle, id: NodeId) -> bool {
    dict_of(p, id).is_some_and(|items| items.iter().any(|(_, v)| is_tensor_like(p, *v)))
}

fn join(prefix: &str, key: &str) -> String {
    if prefix.is_empty() {
        key.to_string()
    } else {
        format!("{prefix}.{key}")
    }
}

/// Dict entries a search for the tensor dict may look at in all. Real checkpoints
/// hold a few thousand entries around their tensors; a hostile nest of shared dicts
/// stops here instead of running for days.
const SEARCH_BUDGET: usize = 4_000_000;

/// The state of one search for the tensor dict: the dict nodes already visited (a
/// node shared through the memo is looked at once, not once per path to it: 16 keys
/// pointing at the same next layer, 8 layers deep, would be 16^8 paths) and the work
/// left.
#[derive(Default)]
struct Search {
    visited: HashSet<NodeId>,
    /// Whether a dict holds tensors, for dicts already looked at (a dict many
    /// entries point at is scanned once).
    holds_tensors: HashMap<NodeId, bool>,
    spent: usize,
}

impl Search {
    /// Marks a dict of `len` entries as visited; false if it was already, or if the
    /// budget is spent.
    fn visit(&mut self, id: NodeId, len: usize) -> bool {
        self.spent = self.spent.saturating_add(len);
        self.spent <= SEARCH_BUDGET && self.visited.insert(id)
    }

    /// [`dict_has_tensors`], scanned once per dict and charged to the budget.
    fn has_tensors(&mut self, p: &Pickle, id: NodeId) -> bool {
        if let Some(&known) = self.holds_tensors.get(&id) {
            return known;
        }
        self.spent = self
            .spent
            .saturating_add(dict_of(p, id).map_or(0, <[_]>::len));
        let known = self.spent <= SEARCH_BUDGET && dict_has_tensors(p, id);
        self.holds_tensors.insert(id, known);
        known
    }
}

/// Top level, then wrapper keys (recursively), then a unique nested tensor dict.
fn auto_find(
    p: &Pickle,
    id: NodeId,
    at: &str,
    depth: usize,
    extras: &mut Vec<Extra>,
    search: &mut Search,
) -> Result<Option<(NodeId, Option<String>)>> {
    if depth > 6 || !search.visit(id, dict_of(p, id).map_or(0, <[_]>::len)) {
        return Ok(None);
    }
    if search.has_tensors(p, id) {
        return Ok(Some((id, (!at.is_empty()).then(|| at.to_string()))));
    }
    let Some(items) = dict_of(p, id) else {
        return Ok(None);
    };
    for wk in WRAPPER_KEYS {
        if let Some(child) = dict_get(p, id, wk) {
            let mut inner = Vec::new();
            if let Some(found) = auto_find(p, child, &join(at, wk), depth + 1, &mut inner, search)?
            {
                push_siblings(p, items, wk, at, extras);
                extras.extend(inner);
                return Ok(Some(found));
            }
        }
    }
    let mut candidates = Vec::new();
    // A search of its own: dicts the wrapper-key walk visited may hold tensors.
    let mut nested = Search {
        spent: search.spent,
        ..Search::default()
    };
    any_tensor_dicts(p, id, at, depth, &mut candidates, &mut nested);
    search.spent = nested.spent;
    if candidates.len() == 1 {
        let key = candidates.remove(0);
        let mut node = id;
        let rel = key
            .strip_prefix(&format!("{at}."))
            .unwrap_or(&key)
            .to_string();
        for part in rel.split('.') {
            match dict_get(p, node, part) {
                Some(n) => node = n,
                None => return Ok(None),
            }
        }
        let first = rel.split('.').next().unwrap_or("");
        push_siblings(p, items, first, at, extras);
        return Ok(Some((node, Some(key))));
    }
    Ok(None)
}

fn push_siblings(
    p: &Pickle,
    items: &[(NodeId, NodeId)],
    taken: &str,
    at: &str,
    extras: &mut Vec<Extra>,
) {
    for (k, v) in items {
        if let Some(name) = str_of(p, *k) {
            if name != taken {
                extras.push(Extra {
                    name: join(at, name),
                    kind: describe(p, *v),
                });
            }
        }
    }
}

/// Dotted paths of every nested dict holding tensors directly (each dict node once,
/// under the first path that reaches it).
fn any_tensor_dicts(
    p: &Pickle,
    id: NodeId,
    at: &str,
    depth: usize,
    out: &mut Vec<String>,
    search: &mut Search,
) {
    if depth > 6 || out.len() > 16 {
        return;
    }
    let Some(items) = dict_of(p, id) else { return };
    if !search.visit(id, items.len()) {
        return;
    }
    for (k, v) in items {
        let Some(name) = str_of(p, *k) else { continue };
        let path = join(at, name);
        if search.has_tensors(p, *v) {
            out.push(path);
        } else {
            any_tensor_dicts(p, *v, &path, depth + 1, out, search);
        }
    }
}

/// Follows a dotted `--key` path. A key that itself contains dots is tried whole first.
fn navigate(
    p: &Pickle,
    path: &Path,
    root: NodeId,
    key: &str,
    extras: &mut Vec<Extra>,
) -> Result<NodeId> {
    let mut node = root;
    let mut rest = key;
    let mut at = String::new();
    let mut depth = 0;
    while !rest.is_empty() {
        depth += 1;
        if depth > MAX_DEPTH {
            break;
        }
        let items = dict_of(p, node).ok_or_else(|| Error::KeyNotFound {
            path: path.to_path_buf(),
            key: key.to_string(),
            available: vec![],
        })?;
        let (part, tail) = if dict_get(p, node, rest).is_some() {
            (rest, "")
        } else {
            rest.split_once('.').unwrap_or((rest, ""))
        };
        let Some(next) = dict_get(p, node, part) else {
            return Err(Error::KeyNotFound {
                path: path.to_path_buf(),
                key: key.to_string(),
                available: items
                    .iter()
                    .filter_map(|(k, _)| str_of(p, *k).map(str::to_string))
                    .collect(),
            });
        };
        push_siblings(p, items, part, &at, extras);
        at = join(&at, part);
        node = next;
        rest = tail;
    }
    Ok(node)
}

/// Reads the tensors of a payload found by [`find_tensors`] as plain tensors.
/// Subclass tensors (DTensor, ShardedTensor) in a single file are described by their
/// local data and flagged: merging them needs every rank (see `sharded.rs`).
pub fn plain_sources(
    payload: &TorchPayload,
    file: FileId,
    found: &Found,
) -> Result<Vec<TensorSource>> {
    let p = &payload.pickle;
    let mut out = Vec::with_capacity(found.tensors.len());
    for (name, id) in &found.tensors {
        match leaf(p, *id).map_err(|m| Error::bad_tensor(&payload.path, name, m))? {
            Some(Leaf::Tensor(t)) => out.push(payload.source(file, name, &t)?),
            Some(Leaf::Subclass(s)) => {
                let local = subclass_local(p, &s);
                match local {
                    Some(t) => {
                        let mut src = payload.source(file, name, &t)?;
                        src.layout = Some(format!("{} {LOCAL_SHARD} {:?}", s.class, s.shape));
                        out.push(src);
                    }
                    None => {
                        return Err(Error::bad_tensor(
                            &payload.path,
                            name,
                            format!("a {}.{} without readable local data", s.module, s.class),
                        ))
                    }
                }
            }
            None => {}
        }
    }
    Ok(out)
}
