//! The conversion table: how transformers 5 rearranges a model's tensors between
//! the layout of its files ("original": `save_pretrained`'s names, e.g. one
//! `mlp.experts.N.gate_proj.weight` per expert) and the layout it holds in memory
//! ("packed": `model.state_dict()`'s names, e.g. one `mlp.experts.gate_up_proj`
//! [E, 2I, H] per layer), read from `conversions.json`, which
//! `fixtures/gen_conversion_table.py` writes from transformers' own conversion
//! mapping and checks against it.
//!
//! This module owns the table and its meaning for names and boxes: which rules a
//! `model_type` has ([`Ruleset::for_model_type`]), and what the save side
//! (packed -> original, as `save_pretrained` applies it) makes of one packed
//! tensor ([`Ruleset::save`]): the original names and, for each, the box of the
//! packed tensor it is. It never sees tensor bytes; `plan::conversion` turns the
//! boxes into pieces.
//!
//! The table's regexes are Python's, with `(?!\w)` after a source pattern; they
//! are translated for the `regex` crate by consuming the non-word character (or
//! the end) after the source's group instead, and the match is taken as the text
//! up to the group's end, which is what Python matches. A regex with any other
//! lookaround is kept as unusable: a rule that needs it is refused by name when it
//! would apply.

use std::collections::BTreeMap;
use std::sync::OnceLock;

use regex::Regex;
use serde::Deserialize;

const TABLE_JSON: &str = include_str!("conversions.json");

/// The whole table, as the generator writes it (fields this module does not read
/// are skipped).
#[derive(Debug, Deserialize)]
struct Table {
    models: BTreeMap<String, ModelEntry>,
    rulesets: BTreeMap<String, Vec<RawRule>>,
}

#[derive(Debug, Deserialize)]
struct ModelEntry {
    rules: String,
}

#[derive(Debug, Deserialize)]
struct RawRule {
    #[serde(rename = "type")]
    kind: String,
    scope: Option<String>,
    save: RawSide,
    #[serde(default)]
    load: Option<RawSide>,
    #[serde(default)]
    index_offset: Option<i64>,
}

#[derive(Debug, Default, Deserialize)]
struct RawSide {
    #[serde(default)]
    sources: Vec<String>,
    #[serde(default)]
    targets: Vec<String>,
    #[serde(default)]
    regex: Option<String>,
    #[serde(default)]
    ops: Vec<Op>,
    #[serde(default)]
    identity: bool,
}

/// One op of a convert rule's side, as the table lists it.
#[derive(Clone, Debug, Deserialize, PartialEq)]
pub struct Op {
    /// `merge_module_list`, `split_module_list`, `concatenate`, `chunk`, ...
    pub op: String,
    /// The dimension it works on, where it has one.
    #[serde(default)]
    pub dim: Option<i64>,
    /// `chunk`/`concatenate`: a config field giving the number of pieces.
    #[serde(default)]
    pub num_shards_attribute: Option<String>,
}

fn table() -> Option<&'static Table> {
    static T: OnceLock<Option<Table>> = OnceLock::new();
    T.get_or_init(|| serde_json::from_str(TABLE_JSON).ok())
        .as_ref()
}

/// The model types the table lists, for tests and reports.
#[cfg_attr(not(feature = "internals"), allow(dead_code))] // for the tests
pub fn model_types() -> Vec<&'static str> {
    table()
        .map(|t| t.models.keys().map(String::as_str).collect())
        .unwrap_or_default()
}

/// What kind of rule a table entry is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// A name rewrite.
    Rename,
    /// A rewrite of names and tensors (stack experts, concatenate...).
    Convert,
    /// A model prefix added or removed: left to the plan's prefix alignment.
    PrefixChange,
    /// A rename that shifts a captured index.
    IndexOffsetRename,
    /// Identity on save.
    LayerPairCollapse,
}

/// One rule's save side, compiled.
#[derive(Debug)]
pub struct Rule {
    /// Its position in the ruleset (as the table lists it).
    pub index: usize,
    /// Its kind.
    pub kind: Kind,
    scope: Option<String>,
    /// The save side's source patterns (packed names).
    pub sources: Vec<String>,
    /// The save side's target patterns (original names).
    pub targets: Vec<String>,
    /// The save side's ops, in order (convert rules).
    pub ops: Vec<Op>,
    regex: Result<Regex, String>,
    /// Per source pattern with a `*`: the pattern as a whole-text regex whose
    /// group captures the index the `*` stands for.
    indexed: Vec<Option<Regex>>,
    offset: i64,
    identity: bool,
}

impl Rule {
    /// `sources -> targets`, for messages.
    pub fn describe(&self) -> String {
        format!(
            "rule {} ({} -> {})",
            self.index,
            self.sources.join(" + "),
            self.targets.join(" + ")
        )
    }
}

/// A model type's rules, save side, compiled.
#[derive(Debug)]
pub struct Ruleset {
    /// The ruleset's name in the table (`qwen2_moe` for qwen3_moe...).
    pub name: String,
    /// Its rules, in the table's order.
    pub rules: Vec<Rule>,
    /// The same rules' load side (original -> packed, as `from_pretrained`
    /// applies it), in the same order.
    load: Vec<Rule>,
}

/// A box of a packed tensor: `start` and `len` along each of its dimensions;
/// `kept` lists the dimensions the original tensor has, in order (the others have
/// length 1 and are dropped).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Region {
    /// First index along each dimension of the packed tensor.
    pub start: Vec<u64>,
    /// Extent along each dimension.
    pub len: Vec<u64>,
    /// The packed tensor's dimensions the output keeps.
    pub kept: Vec<usize>,
}

impl Region {
    /// The output tensor's shape.
    pub fn shape(&self) -> Vec<u64> {
        self.kept.iter().map(|&d| self.len[d]).collect()
    }
}

/// What the save side makes of one packed name.
#[derive(Debug, PartialEq, Eq)]
pub enum Saved {
    /// No rule applies: the name stays.
    Same,
    /// Only renames apply.
    Renamed(String),
    /// A convert rule splits it into these tensors (original name, box).
    Split {
        /// The convert rule's index.
        rule: usize,
        /// Every output tensor.
        parts: Vec<(String, Region)>,
    },
}

/// Why a packed tensor cannot be written as boxes of itself.
#[derive(Debug, PartialEq, Eq)]
pub struct Refused {
    /// The rule's description.
    pub rule: String,
    /// Why.
    pub why: String,
}

/// What the load side makes of one name of the files' layout.
#[derive(Debug, PartialEq, Eq)]
pub enum Loaded {
    /// No rule applies: the name stays.
    Same,
    /// Only renames apply.
    Renamed(String),
    /// A convert rule gathers it into the in-memory tensor `packed`, with the
    /// other tensors of its group.
    Part {
        /// The convert rule's index.
        rule: usize,
        /// The in-memory tensor's name.
        packed: String,
        /// Which of the rule's source patterns it matched (gate, up...).
        source: usize,
        /// Its expert index, where the pattern has one (`*`).
        expert: Option<u64>,
    },
}

impl Ruleset {
    /// The rules of `model_type`, if the table converts it.
    pub fn for_model_type(model_type: &str) -> Option<Ruleset> {
        let t = table()?;
        let name = &t.models.get(model_type)?.rules;
        Some(Ruleset::compiled(name, t.rulesets.get(name)?))
    }

    /// Every rule set of the table, each once (several model types share one).
    pub fn all() -> Vec<Ruleset> {
        table()
            .map(|t| {
                t.rulesets
                    .iter()
                    .map(|(name, raw)| Ruleset::compiled(name, raw))
                    .collect()
            })
            .unwrap_or_default()
    }

    fn compiled(name: &str, raw: &[RawRule]) -> Ruleset {
        let none = RawSide::default();
        Ruleset {
            name: name.to_string(),
            rules: raw
                .iter()
                .enumerate()
                .map(|(index, r)| compile(index, r, &r.save, r.index_offset.unwrap_or(0)))
                .collect(),
            load: raw
                .iter()
                .enumerate()
                .map(|(index, r)| {
                    let side = r.load.as_ref().unwrap_or(&none);
                    compile(index, r, side, -r.index_offset.unwrap_or(0))
                })
                .collect(),
        }
    }

    /// Whether any rule's save side applies to `name`: the name is a packed one.
    pub fn is_packed(&self, name: &str) -> bool {
        self.rules.iter().any(|r| {
            !matches!(r.kind, Kind::PrefixChange | Kind::LayerPairCollapse)
                && matches!(find(r, name), Ok(Some(_)))
        })
    }

    /// Whether a rule that rewrites tensors (not only names) applies to `name`:
    /// the tensor packs several of the files' tensors (experts stacked, gate and up
    /// concatenated).
    pub fn is_stacked(&self, name: &str) -> bool {
        self.rules
            .iter()
            .any(|r| r.kind == Kind::Convert && matches!(find(r, name), Ok(Some(_))))
    }

    /// The save side applied to one tensor `name` of `shape`, as transformers'
    /// `revert_weight_conversion` applies it: the first convert rule (in reverse
    /// list order) whose save regex matches, else every rename in reverse list
    /// order, chained; the names a convert rule makes are renamed the same way.
    pub fn save(&self, name: &str, shape: &[u64]) -> Result<Saved, Refused> {
        for r in self.rules.iter().rev().filter(|r| r.kind == Kind::Convert) {
            let Some(m) = find(r, name).map_err(|why| refused(r, why))? else {
                continue;
            };
            let parts = run_ops(r, m.source, &m.key, shape)?;
            let parts = parts
                .into_iter()
                .map(|(n, reg)| Ok((self.renamed(&n)?, reg)))
                .collect::<Result<Vec<_>, Refused>>()?;
            return Ok(Saved::Split {
                rule: r.index,
                parts,
            });
        }
        let n = self.renamed(name)?;
        Ok(if n == name {
            Saved::Same
        } else {
            Saved::Renamed(n)
        })
    }

    /// The load side applied to one name, as transformers' loading applies it:
    /// every rename in list order, chained, then the first convert rule (in list
    /// order) whose load regex matches the renamed key.
    pub fn load(&self, name: &str) -> Result<Loaded, Refused> {
        let key = renames(&self.load, name)?;
        for r in self.load.iter().filter(|r| r.kind == Kind::Convert) {
            let Some(m) = find(r, &key).map_err(|why| refused(r, why))? else {
                continue;
            };
            let pattern = r
                .sources
                .get(m.source)
                .ok_or_else(|| refused(r, "its match names no source".into()))?;
            let expert = match r.indexed.get(m.source).and_then(Option::as_ref) {
                None if !pattern.contains('*') => None,
                found => {
                    let i = found
                        .and_then(|rx| rx.captures(&m.text))
                        .and_then(|c| c.get(1)?.as_str().parse::<u64>().ok());
                    Some(i.ok_or_else(|| {
                        refused(
                            r,
                            format!("'{}' has no expert index where {pattern} has '*'", m.text),
                        )
                    })?)
                }
            };
            return Ok(Loaded::Part {
                rule: r.index,
                packed: m.key,
                source: m.source,
                expert,
            });
        }
        Ok(if key == name {
            Loaded::Same
        } else {
            Loaded::Renamed(key)
        })
    }

    /// A convert rule's load ops, if they stack experts and concatenate sources
    /// as a box layout allows: `merge_module_list` on dimension 0 (experts
    /// stacked on a new first dimension), then optionally one `concatenate`
    /// (the sources joined along that dimension of the stacked tensor). The
    /// concatenation's dimension, or `None` without one.
    pub fn load_stacking(&self, rule: usize) -> Result<Option<usize>, Refused> {
        let r = self.load.get(rule).ok_or_else(|| Refused {
            rule: format!("rule {rule}"),
            why: "it is not in the table".into(),
        })?;
        let ops: Vec<(&str, Option<i64>)> = r.ops.iter().map(|o| (o.op.as_str(), o.dim)).collect();
        match ops[..] {
            [("merge_module_list", Some(0))] => Ok(None),
            [("merge_module_list", Some(0)), ("concatenate", Some(d))] if d > 0 => {
                Ok(Some(d as usize))
            }
            _ => Err(refused(
                r,
                format!(
                    "its load ops ({}) do not stack experts and concatenate: only those are packed",
                    r.ops
                        .iter()
                        .map(|o| o.op.as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            )),
        }
    }

    /// Every non-convert rule's save side, in reverse list order, chained.
    fn renamed(&self, name: &str) -> Result<String, Refused> {
        renames(self.rules.iter().rev(), name)
    }
}

/// The rename rules of `rules` (in the order given) applied to `name`, chained:
/// the save side in reverse list order, the load side in list order.
fn renames<'a>(rules: impl IntoIterator<Item = &'a Rule>, name: &str) -> Result<String, Refused> {
    let mut key = name.to_string();
    for r in rules {
        match r.kind {
            Kind::Convert | Kind::PrefixChange | Kind::LayerPairCollapse => continue,
            Kind::Rename | Kind::IndexOffsetRename => {}
        }
        if r.identity {
            continue;
        }
        if let Some(m) = find(r, &key).map_err(|why| refused(r, why))? {
            key = m.key;
        }
    }
    Ok(key)
}

fn refused(r: &Rule, why: String) -> Refused {
    Refused {
        rule: r.describe(),
        why,
    }
}

fn compile(index: usize, r: &RawRule, side: &RawSide, offset: i64) -> Rule {
    let kind = match r.kind.as_str() {
        "rename" => Ok(Kind::Rename),
        "convert" => Ok(Kind::Convert),
        "prefix_change" => Ok(Kind::PrefixChange),
        "index_offset_rename" => Ok(Kind::IndexOffsetRename),
        "layer_pair_collapse" => Ok(Kind::LayerPairCollapse),
        other => Err(format!("its type '{other}' is unknown to this version")),
    };
    let regex = match (&kind, &side.regex) {
        (Err(e), _) => Err(e.clone()),
        (Ok(_), Some(rx)) => translate(rx),
        (Ok(_), None) => Err("it has no pattern on this side".into()),
    };
    Rule {
        index,
        kind: kind.unwrap_or(Kind::Rename),
        scope: r.scope.clone(),
        sources: side.sources.clone(),
        targets: side.targets.clone(),
        ops: side.ops.clone(),
        regex,
        indexed: side
            .sources
            .iter()
            .map(|p| {
                p.contains('*')
                    .then(|| Regex::new(&format!("^{}$", p.replacen('*', r"(\d+)", 1))).ok())
                    .flatten()
            })
            .collect(),
        offset,
        identity: side.identity,
    }
}

/// Python's `X(?!\w))` at the end of a named group, as `X)(?:\W|$)`: the same
/// matches, with the character after the group consumed. Any other lookaround
/// makes the regex unusable here.
fn translate(rx: &str) -> Result<Regex, String> {
    let t = rx.replace("(?!\\w))", ")(?:\\W|$)");
    if t.replace("(?P<", "").replace("(?:", "").contains("(?") {
        return Err(format!(
            "its pattern {rx} uses a lookaround this reader does not translate"
        ));
    }
    Regex::new(&t).map_err(|e| format!("its pattern {rx} does not compile: {e}"))
}

/// A match of a rule's save side in a name.
struct Match {
    /// The key with the first occurrence of the matched text replaced by
    /// `targets[0]` (`\1` filled in).
    key: String,
    /// The index of the source pattern that matched.
    source: usize,
    /// The text the source pattern matched.
    text: String,
}

/// Transformers' `rename_source_key` for one rule's save side: the scope, the
/// first match, the replacement.
fn find(r: &Rule, key: &str) -> Result<Option<Match>, String> {
    let (prefix, rest) = match r.scope.as_deref() {
        None => ("", key),
        Some(scope) => {
            let sp = if scope.is_empty() {
                String::new()
            } else {
                format!("{scope}.")
            };
            let bp = format!("model.{sp}");
            if let Some(rest) = key.strip_prefix(&bp) {
                (&key[..bp.len()], rest)
            } else if let Some(rest) = key.strip_prefix(&sp) {
                (&key[..sp.len()], rest)
            } else {
                return Ok(None);
            }
        }
    };
    let rx = r.regex.as_ref().map_err(Clone::clone)?;
    let Some(caps) = rx.captures(rest) else {
        return Ok(None);
    };
    let Some(whole) = caps.get(0) else {
        return Ok(None);
    };
    // The branch that matched: the named group `g<i>` that took part.
    let mut branch = None;
    for (gi, name) in rx.capture_names().enumerate() {
        let Some(source) = name.and_then(|n| n.strip_prefix('g')?.parse::<usize>().ok()) else {
            continue;
        };
        if let Some(g) = caps.get(gi) {
            branch = Some((gi, source, g.end()));
            break;
        }
    }
    let Some((gi, source, end)) = branch else {
        return Err(format!(
            "its pattern has no source group for the match in '{key}'"
        ));
    };
    let text = rest[whole.start()..end].to_string();
    let target = r
        .targets
        .first()
        .ok_or_else(|| "it has no target pattern".to_string())?;
    let mut replacement = target.clone();
    if target.contains("\\1") {
        let val = caps
            .get(gi + 1)
            .map(|g| g.as_str().to_string())
            .ok_or_else(|| format!("its pattern captures no index in '{key}'"))?;
        let val = if r.kind == Kind::IndexOffsetRename {
            let i: i64 = val
                .parse()
                .map_err(|_| format!("'{val}' in '{key}' is not an index"))?;
            (i - r.offset).to_string()
        } else {
            val
        };
        replacement = replacement.replace("\\1", &val);
    }
    let key = format!("{prefix}{}", replace_first(rest, &text, &replacement));
    Ok(Some(Match { key, source, text }))
}

/// Python's `s.replace(old, new, 1)`.
fn replace_first(s: &str, old: &str, new: &str) -> String {
    s.replacen(old, new, 1)
}

/// A view of the packed tensor during the ops: a named box.
#[derive(Clone, Debug)]
struct View {
    pattern: String,
    region: Region,
}

/// Runs a convert rule's save ops on the packed tensor `shape` (which matched
/// source `source`), naming the outputs as transformers does: each op output is a
/// pattern, made a full name with the prefix and suffix around the first pattern
/// found in `layer` (the packed name with the match replaced, `*.` read as `0.`).
fn run_ops(
    r: &Rule,
    source: usize,
    layer: &str,
    shape: &[u64],
) -> Result<Vec<(String, Region)>, Refused> {
    if r.sources.len() != 1 {
        return Err(refused(
            r,
            format!(
                "it joins {} in-memory tensors into one file tensor; only splits of one tensor are supported",
                r.sources.len()
            ),
        ));
    }
    let src = r
        .sources
        .get(source)
        .ok_or_else(|| refused(r, "its match names no source".into()))?;
    let ndim = shape.len();
    let mut cur = vec![View {
        pattern: src.clone(),
        region: Region {
            start: vec![0; ndim],
            len: shape.to_vec(),
            kept: (0..ndim).collect(),
        },
    }];
    for op in &r.ops {
        let dim = |v: &View| -> Result<usize, Refused> {
            let d = op
                .dim
                .ok_or_else(|| refused(r, format!("its op {} has no dim", op.op)))?;
            let n = v.region.kept.len() as i64;
            let d = if d < 0 { d + n } else { d };
            if d < 0 || d >= n {
                return Err(refused(
                    r,
                    format!(
                        "its op {} works on dimension {d} of a {n}-dimensional tensor",
                        op.op
                    ),
                ));
            }
            Ok(d as usize)
        };
        match op.op.as_str() {
            "merge_module_list" | "concatenate" if cur.len() == 1 => {
                // One input: nothing to stack or join, only a new name.
                if let (Some(v), Some(t)) = (cur.first_mut(), r.targets.first()) {
                    v.pattern = t.clone();
                }
            }
            "split_module_list" => {
                let single = cur.len() == 1;
                let mut out = Vec::new();
                for v in &cur {
                    let d = dim(v)?;
                    let pat = if single {
                        r.targets.first().unwrap_or(&v.pattern).clone()
                    } else {
                        v.pattern.clone()
                    };
                    let od = v.region.kept[d];
                    for i in 0..v.region.len[od] {
                        let mut reg = v.region.clone();
                        reg.start[od] += i;
                        reg.len[od] = 1;
                        reg.kept.remove(d);
                        out.push(View {
                            pattern: pat.replace('*', &i.to_string()),
                            region: reg,
                        });
                    }
                }
                cur = out;
            }
            "chunk" if op.num_shards_attribute.is_none() && cur.len() == 1 => {
                let v = &cur[0];
                let d = dim(v)?;
                let od = v.region.kept[d];
                let n = v.region.len[od];
                let k = r.targets.len() as u64;
                if k == 0 || n % k != 0 {
                    return Err(refused(
                        r,
                        format!("dimension {d} of size {n} does not split into {k} equal parts"),
                    ));
                }
                let c = n / k;
                let mut out = Vec::new();
                for (i, t) in r.targets.iter().enumerate() {
                    let mut reg = v.region.clone();
                    reg.start[od] += i as u64 * c;
                    reg.len[od] = c;
                    out.push(View {
                        pattern: t.clone(),
                        region: reg,
                    });
                }
                cur = out;
            }
            other => {
                let what = match other {
                    "interleave" => {
                        "it interleaves rows, which is not a box of the tensor".to_string()
                    }
                    "transpose" => {
                        "it transposes the tensor, which this mapping does not write".to_string()
                    }
                    _ => format!("its op '{other}' is not a box of one tensor"),
                };
                return Err(refused(r, what));
            }
        }
    }
    let full = if layer.contains("*.") {
        layer.replace("*.", "0.")
    } else {
        layer.to_string()
    };
    let (prefix, suffix) = match cur.iter().find(|v| full.contains(&v.pattern)) {
        Some(v) => {
            let at = full.find(&v.pattern).unwrap_or(0);
            (
                full[..at].to_string(),
                full[at + v.pattern.len()..].to_string(),
            )
        }
        None => (String::new(), String::new()),
    };
    Ok(cur
        .into_iter()
        .map(|v| (format!("{prefix}{}{suffix}", v.pattern), v.region))
        .collect())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn split(rs: &Ruleset, name: &str, shape: &[u64]) -> Vec<(String, Region)> {
        match rs.save(name, shape).unwrap() {
            Saved::Split { parts, .. } => parts,
            other => panic!("{name}: {other:?}"),
        }
    }

    #[test]
    fn the_table_parses() {
        assert!(table().is_some());
        assert!(model_types().len() > 50);
    }

    #[test]
    fn qwen3_moe_gate_up_splits_into_gate_then_up_per_expert() {
        let rs = Ruleset::for_model_type("qwen3_moe").unwrap();
        assert_eq!(rs.name, "qwen2_moe");
        let parts = split(&rs, "model.layers.3.mlp.experts.gate_up_proj", &[5, 48, 16]);
        assert_eq!(parts.len(), 10);
        let (n, r) = &parts[0];
        assert_eq!(n, "model.layers.3.mlp.experts.0.gate_proj.weight");
        assert_eq!(
            (r.start.clone(), r.len.clone()),
            (vec![0, 0, 0], vec![1, 24, 16])
        );
        assert_eq!(r.shape(), [24, 16]);
        let (n, r) = &parts[7];
        assert_eq!(n, "model.layers.3.mlp.experts.2.up_proj.weight");
        assert_eq!(
            (r.start.clone(), r.len.clone()),
            (vec![2, 24, 0], vec![1, 24, 16])
        );
        let parts = split(&rs, "model.layers.3.mlp.experts.down_proj", &[5, 16, 24]);
        assert_eq!(parts[4].0, "model.layers.3.mlp.experts.4.down_proj.weight");
        assert_eq!(parts[4].1.start, [4, 0, 0]);
        assert_eq!(parts[4].1.shape(), [16, 24]);
    }

    #[test]
    fn mixtral_renames_the_block_and_names_w1_w3() {
        let rs = Ruleset::for_model_type("mixtral").unwrap();
        let parts = split(&rs, "model.layers.0.mlp.experts.gate_up_proj", &[4, 80, 16]);
        assert_eq!(
            parts[0].0,
            "model.layers.0.block_sparse_moe.experts.0.w1.weight"
        );
        assert_eq!(
            parts[4].0,
            "model.layers.0.block_sparse_moe.experts.0.w3.weight"
        );
        assert_eq!(parts[4].1.start, [0, 40, 0]);
        assert_eq!(
            rs.save("model.layers.0.mlp.gate.weight", &[4, 16]).unwrap(),
            Saved::Renamed("model.layers.0.block_sparse_moe.gate.weight".into())
        );
        assert_eq!(
            rs.save("model.layers.0.self_attn.q_proj.weight", &[4, 16])
                .unwrap(),
            Saved::Same
        );
        // Original names are left alone.
        assert!(!rs.is_packed("model.layers.0.block_sparse_moe.experts.0.w1.weight"));
        assert!(rs.is_packed("model.layers.0.mlp.experts.down_proj"));
    }

    #[test]
    fn mixtral_loads_per_expert_names_into_the_packed_ones() {
        let rs = Ruleset::for_model_type("mixtral").unwrap();
        assert_eq!(
            rs.load("model.layers.1.block_sparse_moe.experts.3.w3.weight")
                .unwrap(),
            Loaded::Part {
                rule: 1,
                packed: "model.layers.1.mlp.experts.gate_up_proj".into(),
                source: 1,
                expert: Some(3),
            }
        );
        assert_eq!(
            rs.load("model.layers.1.block_sparse_moe.experts.12.w2.weight")
                .unwrap(),
            Loaded::Part {
                rule: 2,
                packed: "model.layers.1.mlp.experts.down_proj".into(),
                source: 0,
                expert: Some(12),
            }
        );
        assert_eq!(
            rs.load("model.layers.1.block_sparse_moe.gate.weight")
                .unwrap(),
            Loaded::Renamed("model.layers.1.mlp.gate.weight".into())
        );
        assert_eq!(
            rs.load("model.layers.1.self_attn.q_proj.weight").unwrap(),
            Loaded::Same
        );
        assert_eq!(rs.load_stacking(1).unwrap(), Some(1));
        assert_eq!(rs.load_stacking(2).unwrap(), None);
    }

    /// Every model type of the table, against transformers' own tiny instance: the
    /// load side applied to the names `save_pretrained` wrote gives the names
    /// `model.state_dict()` holds (a packed tensor for each group), or is refused
    /// by a rule this reader cannot apply.
    #[test]
    fn every_model_type_loads_the_files_names_as_transformers_holds_them() {
        let json: serde_json::Value = serde_json::from_str(TABLE_JSON).unwrap();
        let models = json["models"].as_object().unwrap();
        let mut checked = 0;
        for (mt, entry) in models {
            let Some(tiny) = entry.get("tiny") else {
                continue;
            };
            let rs = Ruleset::for_model_type(mt).unwrap();
            let packed = tiny["packed"].as_object().unwrap();
            let mut refused = false;
            for name in tiny["original"].as_object().unwrap().keys() {
                let got = match rs.load(name) {
                    Ok(Loaded::Part { packed, .. }) => packed,
                    Ok(Loaded::Renamed(n)) => n,
                    Ok(Loaded::Same) => name.clone(),
                    Err(e) => {
                        assert!(e.why.contains("lookaround"), "{mt}: {name}: {e:?}");
                        refused = true;
                        break;
                    }
                };
                // The table keeps one differing layer of each layout: a name of
                // another layer is checked only for being a layer name.
                let layer = |n: &str| {
                    let i = n.find(".layers.")? + 8;
                    let j = n[i..].find('.')? + i;
                    Some(n[..j].to_string())
                };
                let kept = layer(&got).is_none_or(|l| packed.keys().any(|k| k.starts_with(&l)));
                assert!(packed.contains_key(&got) || !kept, "{mt}: {name} -> {got}");
            }
            checked += usize::from(!refused);
        }
        assert!(checked >= 40, "{checked} checked");
    }

    #[test]
    fn a_word_character_after_the_pattern_is_no_match() {
        let rs = Ruleset::for_model_type("qwen3_moe").unwrap();
        assert_eq!(
            rs.save("model.layers.0.mlp.experts.down_proj2", &[4, 16, 24])
                .unwrap(),
            Saved::Same
        );
        assert!(!rs.is_packed("model.layers.0.mlp.experts.gate_up_projx"));
    }

    #[test]
    fn phimoe_renames_chain_in_reverse_order() {
        let rs = Ruleset::for_model_type("phimoe").unwrap();
        assert_eq!(
            rs.save("model.layers.2.mlp.router.weight", &[4, 16])
                .unwrap(),
            Saved::Renamed("model.layers.2.block_sparse_moe.gate.weight".into())
        );
    }

    #[test]
    fn an_odd_gate_up_is_refused_with_the_rule() {
        let rs = Ruleset::for_model_type("qwen3_moe").unwrap();
        let e = rs
            .save("model.layers.0.mlp.experts.gate_up_proj", &[4, 47, 16])
            .unwrap_err();
        assert!(e.rule.contains("gate_up_proj"), "{e:?}");
        assert!(e.why.contains("size 47"), "{e:?}");
    }

    /// Every model type of the table, against transformers' own tiny instance: the
    /// save side applied to its packed names and shapes gives exactly the names and
    /// shapes `save_pretrained` wrote, or is refused by a rule whose op is not a box
    /// of one tensor (listed here, so a new kind of refusal fails the test).
    #[test]
    fn every_model_type_unpacks_as_transformers_saves_or_is_knowingly_refused() {
        let json: serde_json::Value = serde_json::from_str(TABLE_JSON).unwrap();
        let models = json["models"].as_object().unwrap();
        let (mut checked, mut refused_types) = (0, Vec::new());
        for (mt, entry) in models {
            let rs = Ruleset::for_model_type(mt).unwrap();
            for r in &rs.rules {
                let usable = r.regex.is_ok()
                    || matches!(r.kind, Kind::PrefixChange | Kind::LayerPairCollapse);
                assert!(usable, "{mt}: {} {:?}", r.describe(), r.regex);
            }
            let Some(tiny) = entry.get("tiny") else {
                continue;
            };
            let shape = |v: &serde_json::Value| -> Vec<u64> {
                v.as_array()
                    .unwrap()
                    .iter()
                    .map(|x| x.as_u64().unwrap())
                    .collect()
            };
            let mut got = BTreeMap::new();
            let mut refusal = None;
            for (name, s) in tiny["packed"].as_object().unwrap() {
                match rs.save(name, &shape(s)) {
                    Ok(Saved::Same) => {
                        got.insert(name.clone(), shape(s));
                    }
                    Ok(Saved::Renamed(n)) => {
                        got.insert(n, shape(s));
                    }
                    Ok(Saved::Split { parts, .. }) => {
                        for (n, reg) in parts {
                            got.insert(n, reg.shape());
                        }
                    }
                    Err(e) => refusal = Some(e),
                }
            }
            if let Some(e) = refusal {
                let known = [
                    "interleaves rows",
                    "transposes",
                    "joins",
                    "'unpad_vocab'",
                    "'dequantize_experts'",
                    "'merge_message_queries'",
                ];
                assert!(known.iter().any(|k| e.why.contains(k)), "{mt}: {e:?}");
                refused_types.push(mt.clone());
                continue;
            }
            let want: BTreeMap<String, Vec<u64>> = tiny["original"]
                .as_object()
                .unwrap()
                .iter()
                .map(|(n, s)| (n.clone(), shape(s)))
                .collect();
            // A packed name the save side leaves alone is not in `original`.
            got.retain(|n, _| !tiny["packed"].as_object().unwrap().contains_key(n));
            // The table keeps the first differing `.layers.N.` of each layout (and
            // every name outside `.layers.`): the names made must be the names
            // transformers wrote, with their shapes, and every layer name of those.
            for (n, s) in &got {
                assert_eq!(want.get(n), Some(s), "{mt}: {n}");
            }
            for n in want.keys().filter(|n| n.contains(".layers.")) {
                assert!(got.contains_key(n), "{mt}: {n} is not made");
            }
            checked += 1;
        }
        assert!(
            checked >= 40,
            "{checked} checked, refused: {refused_types:?}"
        );
        for mt in [
            "mixtral",
            "qwen3_moe",
            "deepseek_v3",
            "olmoe",
            "phimoe",
            "granitemoe",
            "glm4_moe",
            "qwen2_moe",
        ] {
            assert!(!refused_types.iter().any(|r| r == mt), "{mt}");
        }
    }
}
