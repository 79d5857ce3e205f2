//! The `ArchConversion` mapping: expert tensors between transformers' in-memory
//! layout (packed expert tensors, `model.state_dict()`'s names) and the layout of
//! the model's files (`save_pretrained`'s names), by the base's `model_type` rules
//! in `arch/conversions.rs`.
//!
//! It owns the decision of which way to go and the pieces of each output tensor.
//! The output's layout is the one asked for ([`ExpertLayout`]), by default the
//! base's files': packed when the base holds packed names, else per expert (also
//! without base weights). The base's own tensors are first read in that layout
//! ([`ArchConversion::read_base`]), so the overlay sees the output's names; then
//! the checkpoint's tensors are unpacked or packed to it, or left alone when they
//! are in it already.
//!
//! Unpacking: each unpacked tensor is a box of a packed one, so it stays a
//! [`Content::Copy`]: its pieces are the packed tensor's pieces narrowed to the
//! box (byte offset, shape and place change, strides stay). Packing: each packed
//! tensor is a Copy of the pieces of every tensor of its group (every expert of
//! every source, by the load side's rules), each placed at the box the save side
//! cuts that tensor out of the packed one (the experts stacked, gate and up
//! concatenated), as a sharded tensor's pieces are placed. Either way the engine
//! and verify treat it as any other copy, bit-exact for every dtype. A rule whose
//! result is not a box (an interleave, a transpose) is refused naming the tensor
//! and the rule.

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;

use serde_json::{Map, Value};

use super::{Candidate, Content, ExpertLayout, MapInputs, Mapping, Origin, Report};
use crate::arch::conversions::{Loaded, Region, Ruleset, Saved};
use crate::error::{Error, Result};
use crate::source::{Checkpoint, Piece, TensorSource};

/// See the module documentation.
#[derive(Debug)]
pub struct ArchConversion {
    model_type: String,
    rules: Ruleset,
    layout: ExpertLayout,
    /// What the last `map` did, for the report.
    done: Mutex<Option<Applied>>,
    /// What reading the base in the asked layout did, for the report.
    base_done: Mutex<Option<Applied>>,
}

/// What a run of the mapping did.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Applied {
    /// Packed tensors written as this many tensors of the files' layout.
    Unpacked {
        packed: usize,
        written: usize,
        renamed: usize,
    },
    /// Tensors of the files' layout gathered into this many packed tensors.
    Packed {
        from: usize,
        written: usize,
        renamed: usize,
    },
    /// The checkpoint holds the packed layout, as the output does: nothing changed.
    BasePacked,
}

/// Counts of a packing.
#[derive(Clone, Copy, Debug, Default)]
struct Packing {
    from: usize,
    written: usize,
    renamed: usize,
}

impl ArchConversion {
    /// The mapping for a base whose config.json names a `model_type` the table
    /// converts, writing expert tensors in `layout`; `None` otherwise.
    pub fn for_config(
        config: Option<&Map<String, Value>>,
        layout: ExpertLayout,
    ) -> Option<ArchConversion> {
        let mt = config?.get("model_type")?.as_str()?;
        let rules = Ruleset::for_model_type(mt)?;
        Some(ArchConversion {
            model_type: mt.to_string(),
            rules,
            layout,
            done: Mutex::new(None),
            base_done: Mutex::new(None),
        })
    }

    /// Adds a note on what the mapping did (nothing when it changed nothing).
    pub fn note(&self, report: &mut Report) {
        let rules = format!(
            "transformers' '{}' conversion rules (model_type {})",
            self.rules.name, self.model_type
        );
        let asked = match self.layout {
            ExpertLayout::Base => "",
            ExpertLayout::Packed => " (layout packed)",
            ExpertLayout::Original => " (layout original)",
        };
        let base_done = self.base_done.lock().map(|d| d.clone()).unwrap_or(None);
        match base_done {
            Some(Applied::Packed { from, written, renamed }) => report.notes.push(format!(
                "layout: the base's files hold the per-expert layout; read packed{asked}: {from} tensor(s) as {written} packed tensor(s) and {renamed} renamed, by {rules}"
            )),
            Some(Applied::Unpacked { packed, written, renamed }) => report.notes.push(format!(
                "layout: the base's files hold the in-memory (packed) layout; read per expert{asked}: {packed} packed tensor(s) as {written} tensor(s) and {renamed} renamed, by {rules}"
            )),
            _ => {}
        }
        let done = self.done.lock().map(|d| d.clone()).unwrap_or(None);
        let target = match self.layout {
            ExpertLayout::Base => "the base's file layout",
            _ => "the files' per-expert layout",
        };
        match done {
            Some(Applied::Unpacked {
                packed,
                written,
                renamed,
            }) => report.notes.push(format!(
                "layout: the checkpoint holds transformers' in-memory (packed) names; {packed} packed tensor(s) written as {written} tensor(s) and {renamed} renamed, in {target}{asked}, by {rules}"
            )),
            Some(Applied::Packed {
                from,
                written,
                renamed,
            }) => report.notes.push(format!(
                "layout: the checkpoint holds the files' per-expert names; {from} tensor(s) packed into {written} tensor(s) and {renamed} renamed, in transformers' in-memory layout{asked}, by {rules}"
            )),
            Some(Applied::BasePacked) if self.layout == ExpertLayout::Base => report.notes.push(format!(
                "layout: the base holds the in-memory (packed) names too; tensors kept as they are ({rules} not applied)"
            )),
            Some(Applied::BasePacked) => report.notes.push(format!(
                "layout: the checkpoint holds the in-memory (packed) names; tensors kept as they are{asked}"
            )),
            None => {}
        }
    }

    /// Reads the base's tensors in the layout asked for, when it is not the one
    /// its files hold: the base's per-expert tensors packed for
    /// [`ExpertLayout::Packed`], its packed tensors cut per expert for
    /// [`ExpertLayout::Original`]. Pieces still point into the base's files.
    pub fn read_base(&self, base: &mut Checkpoint) -> Result<()> {
        // Built only for a layout that rearranges the base: a base of DeepSeek-V3's
        // size has tens of thousands of tensors.
        let cands = |base: &Checkpoint| -> Vec<Candidate> {
            base.tensors
                .iter()
                .map(|t| Candidate::copy(Origin::Base, t))
                .collect()
        };
        let (out, applied) = match self.layout {
            ExpertLayout::Base => return Ok(()),
            ExpertLayout::Packed => {
                let (out, p) = self.pack(cands(base), "base")?;
                if p.from == 0 && p.renamed == 0 {
                    return Ok(());
                }
                (
                    out,
                    Applied::Packed {
                        from: p.from,
                        written: p.written,
                        renamed: p.renamed,
                    },
                )
            }
            ExpertLayout::Original => {
                if !base.tensors.iter().any(|t| self.rules.is_packed(&t.name)) {
                    return Ok(());
                }
                let (out, _, applied) = self.unpack(cands(base), "base")?;
                (out, applied)
            }
        };
        let mut tensors = Vec::with_capacity(out.len());
        for c in out {
            let Content::Copy(mut t) = c.content else {
                return Err(Error::plan(
                    format!("base tensor '{}' is not a copy", c.source_name),
                    None,
                ));
            };
            t.name = c.name;
            tensors.push(t);
        }
        base.tensors = tensors;
        if let Ok(mut d) = self.base_done.lock() {
            *d = Some(applied);
        }
        Ok(())
    }
}

impl Mapping for ArchConversion {
    fn map(&self, candidates: Vec<Candidate>, inputs: MapInputs<'_>) -> Result<Vec<Candidate>> {
        let base_packed = inputs
            .base
            .is_some_and(|b| b.tensors.iter().any(|t| self.rules.is_packed(&t.name)));
        let packed = match self.layout {
            ExpertLayout::Packed => true,
            ExpertLayout::Original => false,
            ExpertLayout::Base => base_packed,
        };
        if packed {
            let had_packed = candidates.iter().any(|c| self.rules.is_packed(&c.name));
            let (out, p) = self.pack(candidates, "checkpoint")?;
            if p.from > 0 || p.renamed > 0 {
                self.record(Applied::Packed {
                    from: p.from,
                    written: p.written,
                    renamed: p.renamed,
                });
            } else if had_packed {
                self.record(Applied::BasePacked);
            }
            return Ok(out);
        }
        if !candidates.iter().any(|c| self.rules.is_packed(&c.name)) {
            return Ok(candidates);
        }
        let (out, unexplained, applied) = self.unpack(candidates, "checkpoint")?;
        if let Some(base) = inputs.base {
            self.check_explained(&out, &unexplained, base)?;
        }
        self.record(applied);
        Ok(out)
    }
}

impl ArchConversion {
    /// Every packed tensor of `candidates` cut into the tensors of the files'
    /// layout, and the in-memory names renamed; with the positions of the expert
    /// tensors no rule rewrote. `whose` names the input in errors.
    fn unpack(
        &self,
        candidates: Vec<Candidate>,
        whose: &str,
    ) -> Result<(Vec<Candidate>, Vec<usize>, Applied)> {
        let before: HashSet<String> = candidates.iter().map(|c| c.name.clone()).collect();
        let mut out = Vec::with_capacity(candidates.len());
        let (mut packed, mut written, mut renamed) = (0, 0, 0);
        // Expert tensors no rule rewrote: checked against the base by the caller.
        let mut unexplained = Vec::new();
        for c in candidates {
            let saved = self.rules.save(&c.name, &c.shape).map_err(|r| {
                Error::plan(
                    format!(
                        "{whose} tensor '{}' {:?}: transformers' '{}' {} cannot be written as boxes of it: {}",
                        c.source_name, c.shape, self.rules.name, r.rule, r.why
                    ),
                    Some("convert the checkpoint to the model's file layout with transformers (from_pretrained, load_state_dict, save_pretrained), or pass a base that holds the in-memory layout".into()),
                )
            })?;
            match saved {
                Saved::Same => {
                    if c.name.contains("expert") {
                        unexplained.push(out.len());
                    }
                    out.push(c);
                }
                Saved::Renamed(n) => {
                    renamed += 1;
                    out.push(Candidate { name: n, ..c });
                }
                Saved::Split { rule, parts } => {
                    packed += 1;
                    let Content::Copy(src) = &c.content else {
                        return Err(Error::plan(
                            format!(
                                "{whose} tensor '{}' is computed (a fused adapter), and transformers' '{}' rule {rule} would split it: only copied tensors are unpacked",
                                c.source_name, self.rules.name
                            ),
                            None,
                        ));
                    };
                    for (name, region) in parts {
                        if before.contains(&name) {
                            return Err(Error::plan(
                                format!(
                                    "the {whose} holds both '{}' (packed) and '{name}', which transformers' '{}' rule {rule} makes of it: a mix of the in-memory and the file layout",
                                    c.source_name, self.rules.name
                                ),
                                Some("keep one layout in the checkpoint".into()),
                            ));
                        }
                        let t = narrow(src, &region, &name).map_err(|why| {
                            Error::plan(format!("{whose} tensor '{}': {why}", c.source_name), None)
                        })?;
                        written += 1;
                        out.push(c.part(name, t));
                    }
                }
            }
        }
        Ok((
            out,
            unexplained,
            Applied::Unpacked {
                packed,
                written,
                renamed,
            },
        ))
    }

    /// The tensors of `candidates` in transformers' in-memory layout: the names
    /// the load side renames renamed, and each group a convert rule gathers (every
    /// expert of every source) made one packed tensor whose pieces are the group's
    /// pieces placed at their boxes. The boxes are the save side's (what
    /// `save_pretrained` would cut the packed tensor into), so that a packed
    /// tensor is exactly the one transformers would load from these files.
    fn pack(&self, candidates: Vec<Candidate>, whose: &str) -> Result<(Vec<Candidate>, Packing)> {
        enum Slot {
            One(Box<Candidate>),
            Group(usize),
        }
        struct Group {
            rule: usize,
            packed: String,
            members: Vec<(usize, Option<u64>, Candidate)>,
        }
        let refusal = |c: &Candidate, rule: &str, why: &str| {
            Error::plan(
                format!(
                    "{whose} tensor '{}' {:?}: transformers' '{}' {rule} cannot pack it: {why}",
                    c.source_name, c.shape, self.rules.name
                ),
                Some("write the files' layout (layout original), or convert the checkpoint with transformers".into()),
            )
        };
        let mut stats = Packing::default();
        let mut slots = Vec::with_capacity(candidates.len());
        let mut groups: Vec<Group> = Vec::new();
        let mut by_name: HashMap<(usize, String), usize> = HashMap::new();
        for c in candidates {
            match self
                .rules
                .load(&c.name)
                .map_err(|r| refusal(&c, &r.rule, &r.why))?
            {
                Loaded::Same => slots.push(Slot::One(Box::new(c))),
                Loaded::Renamed(n) => {
                    stats.renamed += 1;
                    slots.push(Slot::One(Box::new(Candidate { name: n, ..c })));
                }
                Loaded::Part {
                    rule,
                    packed,
                    source,
                    expert,
                } => {
                    let gi = *by_name.entry((rule, packed.clone())).or_insert_with(|| {
                        slots.push(Slot::Group(groups.len()));
                        groups.push(Group {
                            rule,
                            packed,
                            members: Vec::new(),
                        });
                        groups.len() - 1
                    });
                    stats.from += 1;
                    groups[gi].members.push((source, expert, c));
                }
            }
        }
        let kept: HashSet<String> = slots
            .iter()
            .filter_map(|s| match s {
                Slot::One(c) => Some(c.name.clone()),
                Slot::Group(_) => None,
            })
            .collect();
        let mut made = Vec::with_capacity(groups.len());
        for g in groups {
            if kept.contains(&g.packed) {
                let c = &g.members[0].2;
                return Err(Error::plan(
                    format!(
                        "the {whose} holds both '{}' (packed) and '{}', which transformers' '{}' rule {} packs into it: a mix of the in-memory and the file layout",
                        g.packed, c.source_name, self.rules.name, g.rule
                    ),
                    Some("keep one layout in the checkpoint".into()),
                ));
            }
            made.push(Some(self.packed(g.rule, &g.packed, g.members, whose)?));
        }
        stats.written = made.len();
        let mut out = Vec::with_capacity(slots.len());
        for s in slots {
            match s {
                Slot::One(c) => out.push(*c),
                Slot::Group(i) => {
                    if let Some(c) = made.get_mut(i).and_then(Option::take) {
                        out.push(c);
                    }
                }
            }
        }
        Ok((out, stats))
    }

    /// One packed tensor `packed` of rule `rule` from its group's tensors
    /// (source pattern, expert, candidate).
    fn packed(
        &self,
        rule: usize,
        packed: &str,
        mut members: Vec<(usize, Option<u64>, Candidate)>,
        whose: &str,
    ) -> Result<Candidate> {
        members.sort_by_key(|(s, e, _)| (*s, *e));
        let first = &members[0].2;
        let fail = |why: String| {
            Error::plan(
                format!(
                    "{whose} tensors of '{packed}' (transformers' '{}' rule {rule}, from '{}' on): {why}",
                    self.rules.name, first.source_name
                ),
                Some("write the files' layout (layout original), or check that the checkpoint holds every expert".into()),
            )
        };
        let concat = self
            .rules
            .load_stacking(rule)
            .map_err(|r| fail(format!("{} {}", r.rule, r.why)))?;
        // Experts per source, each 0..E in order, every one of one shape.
        let mut sources: Vec<(usize, Vec<u64>, u64)> = Vec::new(); // (source, shape, experts)
        for (s, e, c) in &members {
            if c.dtype != first.dtype || c.origin != first.origin {
                return Err(fail(format!(
                    "'{}' is {} and '{}' is {}: a packed tensor has one dtype",
                    first.source_name, first.dtype, c.source_name, c.dtype
                )));
            }
            let Some(e) = *e else {
                return Err(fail(format!("'{}' has no expert index", c.source_name)));
            };
            match sources.last_mut() {
                Some((ls, shape, n)) if ls == s => {
                    if *n != e {
                        return Err(fail(format!(
                            "expert {n} is missing before '{}' (expert {e})",
                            c.source_name
                        )));
                    }
                    if *shape != c.shape {
                        return Err(fail(format!(
                            "'{}' is {:?}, expert 0 of its kind {shape:?}",
                            c.source_name, c.shape
                        )));
                    }
                    *n += 1;
                }
                _ => {
                    if e != 0 {
                        return Err(fail(format!(
                            "expert 0 is missing before '{}' (expert {e})",
                            c.source_name
                        )));
                    }
                    sources.push((*s, c.shape.clone(), 1));
                }
            }
        }
        let experts = sources[0].2;
        let mut shape = Vec::with_capacity(first.shape.len() + 1);
        shape.push(experts);
        shape.extend_from_slice(&sources[0].1);
        for (_, s, n) in &sources[1..] {
            let Some(d) = concat else {
                return Err(fail("the rule joins no sources".into()));
            };
            let fits = *n == experts
                && s.len() + 1 == shape.len()
                && (1..shape.len()).all(|k| k == d || s[k - 1] == shape[k]);
            if !fits || d >= shape.len() {
                return Err(fail(format!(
                    "{n} experts of {s:?} do not join {experts} experts of {:?} along dimension {d}",
                    sources[0].1
                )));
            }
            shape[d] += s[d - 1];
        }
        // The save side's boxes of that tensor name exactly these tensors.
        let parts = match self.rules.save(packed, &shape) {
            Ok(Saved::Split { parts, .. }) => parts,
            Ok(_) => return Err(fail(format!("transformers would not split {shape:?}"))),
            Err(r) => return Err(fail(format!("{} {}", r.rule, r.why))),
        };
        if parts.len() != members.len() {
            return Err(fail(format!(
                "transformers writes {} tensors of a {shape:?} tensor, and {} are here",
                parts.len(),
                members.len()
            )));
        }
        let index: HashMap<&str, &Candidate> = members
            .iter()
            .map(|(_, _, c)| (c.name.as_str(), c))
            .collect();
        let mut pieces = Vec::new();
        for (name, region) in &parts {
            let Some(c) = index.get(name.as_str()) else {
                return Err(fail(format!(
                    "transformers writes '{name}' of a {shape:?} tensor, which is not here"
                )));
            };
            let Content::Copy(t) = &c.content else {
                return Err(fail(format!(
                    "'{}' is computed (a fused adapter): only copied tensors are packed",
                    c.source_name
                )));
            };
            if region.shape() != t.shape {
                return Err(fail(format!(
                    "'{}' is {:?}, its box {:?}",
                    c.source_name,
                    t.shape,
                    region.shape()
                )));
            }
            for p in &t.pieces {
                pieces.push(
                    placed(p, region).map_err(|why| fail(format!("'{}': {why}", c.source_name)))?,
                );
            }
        }
        let Content::Copy(t0) = &first.content else {
            return Err(fail("not a copy".into()));
        };
        let t = TensorSource {
            name: packed.to_string(),
            dtype: t0.dtype,
            shape,
            pieces: pieces.into(),
            storage: None,
            layout: t0.layout.clone(),
        };
        Ok(first.part(packed.to_string(), t))
    }

    /// An expert tensor of a packed checkpoint that no rule rewrote and the base
    /// does not hold (compared from `layers.`, so that a prefix the plan aligns
    /// later does not count) is an error naming it and the rule nearest to it.
    fn check_explained(
        &self,
        out: &[Candidate],
        unexplained: &[usize],
        base: &crate::source::Checkpoint,
    ) -> Result<()> {
        if unexplained.is_empty() {
            return Ok(());
        }
        let key = |n: &str| n.find("layers.").map_or(n, |i| &n[i..]).to_string();
        let held: HashSet<String> = base.tensors.iter().map(|t| key(&t.name)).collect();
        let Some(c) = unexplained
            .iter()
            .filter_map(|&i| out.get(i))
            .find(|c| !held.contains(&key(&c.name)))
        else {
            return Ok(());
        };
        let nearest = self
            .rules
            .rules
            .iter()
            .filter(|r| !r.sources.is_empty())
            .max_by_key(|r| {
                r.sources
                    .iter()
                    .map(|s| common_run(&c.name, s))
                    .max()
                    .unwrap_or(0)
            })
            .map(|r| format!("; the nearest rule is {}", r.describe()))
            .unwrap_or_default();
        Err(Error::plan(
            format!(
                "checkpoint tensor '{}' {:?} is not in the base, and no rule of transformers' '{}' conversion (model_type {}) explains it{nearest}",
                c.source_name, c.shape, self.rules.name, self.model_type
            ),
            Some("the checkpoint may be of another architecture or transformers version; rename it with --rename, or convert it with transformers".into()),
        ))
    }

    fn record(&self, a: Applied) {
        if let Ok(mut d) = self.done.lock() {
            *d = Some(a);
        }
    }
}

/// A piece of a tensor that is `region` of a larger one, placed in the larger
/// one: the region's dropped dimensions (length 1) put back, its start added to
/// the piece's place. The bytes read are the same.
fn placed(p: &Piece, region: &Region) -> std::result::Result<Piece, String> {
    let ndim = region.start.len();
    let k = region.kept.len();
    if p.shape.len() != k || p.strides.len() != k || p.global_offset.len() != k {
        return Err(format!(
            "a piece of shape {:?} does not have its {k} dimension(s)",
            p.shape
        ));
    }
    let mut shape = region.len.clone();
    let mut strides = vec![0; ndim];
    let mut at = region.start.clone();
    for (i, &d) in region.kept.iter().enumerate() {
        shape[d] = p.shape[i];
        strides[d] = p.strides[i];
        at[d] = region.start[d]
            .checked_add(p.global_offset[i])
            .ok_or_else(|| format!("a piece at {:?} overflows", p.global_offset))?;
    }
    // A dropped dimension has one index: its stride is never used; it is given
    // the one a contiguous layout would have.
    for d in (0..ndim).rev() {
        if !region.kept.contains(&d) {
            if region.len[d] != 1 {
                return Err(format!(
                    "its box drops dimension {d} of length {}",
                    region.len[d]
                ));
            }
            strides[d] = match (shape.get(d + 1), strides.get(d + 1)) {
                (Some(&n), Some(&s)) => n.saturating_mul(s).max(1),
                _ => 1,
            };
        }
    }
    Ok(Piece {
        file: p.file,
        byte_offset: p.byte_offset,
        dtype: p.dtype,
        shape,
        strides,
        global_offset: at,
        big_endian: p.big_endian,
    })
}

/// The length of the longest run of characters `a` and `b` share.
fn common_run(a: &str, b: &str) -> usize {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    let mut best = 0;
    let mut prev = vec![0usize; b.len() + 1];
    for &x in a {
        let mut cur = vec![0usize; b.len() + 1];
        for (j, &y) in b.iter().enumerate() {
            if x == y {
                cur[j + 1] = prev[j] + 1;
                best = best.max(cur[j + 1]);
            }
        }
        prev = cur;
    }
    best
}

/// The tensor that is `region` of `t`: each piece cut to the box (the pieces that
/// miss it are dropped), placed relative to the box, the dropped dimensions
/// (length 1) removed. Strides stay: a cut piece reads the same bytes.
pub(crate) fn narrow(
    t: &TensorSource,
    region: &Region,
    name: &str,
) -> std::result::Result<TensorSource, String> {
    let ndim = t.shape.len();
    if region.start.len() != ndim || region.len.len() != ndim {
        return Err(format!(
            "a box of {} dimension(s) does not fit its shape {:?}",
            region.start.len(),
            t.shape
        ));
    }
    for d in 0..ndim {
        let end = region.start[d].checked_add(region.len[d]);
        if end.is_none_or(|e| e > t.shape[d]) {
            return Err(format!(
                "the box {:?}+{:?} reaches past its shape {:?}",
                region.start, region.len, t.shape
            ));
        }
    }
    let mut pieces = Vec::new();
    'pieces: for p in &t.pieces {
        if p.shape.len() != ndim || p.strides.len() != ndim || p.global_offset.len() != ndim {
            return Err(format!(
                "a piece of shape {:?} does not have its {ndim} dimension(s)",
                p.shape
            ));
        }
        let mut skip: u64 = 0;
        let mut shape = Vec::with_capacity(ndim);
        let mut at = Vec::with_capacity(ndim);
        for d in 0..ndim {
            let lo = p.global_offset[d].max(region.start[d]);
            let hi = (p.global_offset[d].saturating_add(p.shape[d]))
                .min(region.start[d] + region.len[d]);
            if lo >= hi {
                continue 'pieces;
            }
            skip = (lo - p.global_offset[d])
                .checked_mul(p.strides[d])
                .and_then(|x| x.checked_add(skip))
                .ok_or_else(|| format!("a piece's strides {:?} overflow", p.strides))?;
            shape.push(hi - lo);
            at.push(lo - region.start[d]);
        }
        let byte_offset = skip
            .checked_mul(p.dtype.size() as u64)
            .and_then(|x| x.checked_add(p.byte_offset))
            .ok_or_else(|| format!("a piece at byte {} overflows", p.byte_offset))?;
        pieces.push(Piece {
            file: p.file,
            byte_offset,
            dtype: p.dtype,
            shape: region.kept.iter().map(|&d| shape[d]).collect(),
            strides: region.kept.iter().map(|&d| p.strides[d]).collect(),
            global_offset: region.kept.iter().map(|&d| at[d]).collect(),
            big_endian: p.big_endian,
        });
    }
    Ok(TensorSource {
        name: name.to_string(),
        dtype: t.dtype,
        shape: region.shape(),
        pieces: pieces.into(),
        storage: None,
        layout: t.layout.clone(),
    })
}

/// Rows a tensor gives an output tensor: `count` rows from source row `from`,
/// every `step`-th, written from output row `to` on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Run {
    pub(crate) from: u64,
    pub(crate) step: u64,
    pub(crate) count: u64,
    pub(crate) to: u64,
}

/// The tensor of `rows` rows that `runs` take from `t` (each run's rows of each
/// piece, the piece's row stride times the run's step), named `name`. A piece
/// holding part of a run's rows gives the part it holds.
pub(crate) fn select_rows(
    t: &TensorSource,
    runs: &[Run],
    rows: u64,
    name: &str,
) -> std::result::Result<TensorSource, String> {
    let Some((&src_rows, rest)) = t.shape.split_first() else {
        return Err("a scalar has no rows to select".into());
    };
    let mut covered: u64 = 0;
    for r in runs {
        let last = r
            .count
            .checked_sub(1)
            .and_then(|k| k.checked_mul(r.step))
            .and_then(|x| x.checked_add(r.from));
        let end = r.to.checked_add(r.count);
        if r.step == 0 || last.is_none_or(|l| l >= src_rows) || end.is_none_or(|e| e > rows) {
            return Err(format!(
                "rows {} + {} x {} (to {}) do not fit its {src_rows} rows",
                r.from, r.step, r.count, r.to
            ));
        }
        covered = covered.saturating_add(r.count);
    }
    if covered != rows {
        return Err(format!("{covered} rows selected for {rows}"));
    }
    let ndim = t.shape.len();
    let mut pieces = Vec::new();
    for p in &t.pieces {
        if p.shape.len() != ndim || p.strides.len() != ndim || p.global_offset.len() != ndim {
            return Err(format!(
                "a piece of shape {:?} does not have its {ndim} dimension(s)",
                p.shape
            ));
        }
        let (g0, s0) = (p.global_offset[0], p.strides[0]);
        let end = g0.saturating_add(p.shape[0]);
        for r in runs {
            // The run's rows `from + step * k` inside [g0, end): k in [lo, hi).
            let lo = g0.saturating_sub(r.from).div_ceil(r.step);
            let hi = end.saturating_sub(r.from).div_ceil(r.step).min(r.count);
            if lo >= hi {
                continue;
            }
            let first = r.from + r.step * lo;
            let overflow = || format!("a piece at byte {} overflows", p.byte_offset);
            let byte_offset = (first - g0)
                .checked_mul(s0)
                .and_then(|x| x.checked_mul(p.dtype.size() as u64))
                .and_then(|x| x.checked_add(p.byte_offset))
                .ok_or_else(overflow)?;
            let mut shape = p.shape.clone();
            shape[0] = hi - lo;
            let mut strides = p.strides.clone();
            strides[0] = s0.checked_mul(r.step).ok_or_else(overflow)?;
            let mut at = p.global_offset.clone();
            at[0] = r.to + lo;
            pieces.push(Piece {
                file: p.file,
                byte_offset,
                dtype: p.dtype,
                shape,
                strides,
                global_offset: at,
                big_endian: p.big_endian,
            });
        }
    }
    let mut shape = Vec::with_capacity(ndim);
    shape.push(rows);
    shape.extend_from_slice(rest);
    Ok(TensorSource {
        name: name.to_string(),
        dtype: t.dtype,
        shape,
        pieces: pieces.into(),
        storage: None,
        layout: t.layout.clone(),
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::dtype::DType;
    use crate::plan::testing::{checkpoint, tensor};
    use crate::plan::Origin;

    fn piece(off: u64, shape: &[u64], strides: &[u64], at: &[u64]) -> Piece {
        Piece {
            file: 0,
            byte_offset: off,
            dtype: DType::BF16,
            shape: shape.to_vec(),
            strides: strides.to_vec(),
            global_offset: at.to_vec(),
            big_endian: false,
        }
    }

    #[test]
    fn a_piece_sharded_on_the_expert_dim_is_cut_or_dropped() {
        // [4, 6, 3] bf16 in two Shard(0) pieces of two experts each.
        let mut t = tensor("w", DType::BF16, &[4, 6, 3]);
        t.pieces = vec![
            piece(100, &[2, 6, 3], &[18, 3, 1], &[0, 0, 0]),
            piece(1000, &[2, 6, 3], &[18, 3, 1], &[2, 0, 0]),
        ]
        .into();
        // Expert 3, rows 3..6.
        let r = Region {
            start: vec![3, 3, 0],
            len: vec![1, 3, 3],
            kept: vec![1, 2],
        };
        let n = narrow(&t, &r, "e3.up").unwrap();
        assert_eq!(n.shape, [3, 3]);
        assert_eq!(n.pieces.len(), 1);
        let p = &n.pieces[0];
        // Element [1, 3, 0] of the second piece: (18 + 9) elements of 2 bytes in.
        assert_eq!(p.byte_offset, 1000 + 27 * 2);
        assert_eq!(
            (p.shape.clone(), p.strides.clone()),
            (vec![3, 3], vec![3, 1])
        );
        assert_eq!(p.global_offset, [0, 0]);
    }

    #[test]
    fn a_piece_sharded_on_another_dim_keeps_its_place_in_the_box() {
        // [2, 4, 2] in two column pieces (dim 2), each strided in its own file.
        let mut t = tensor("w", DType::BF16, &[2, 4, 2]);
        t.pieces = vec![
            piece(0, &[2, 4, 1], &[4, 1, 1], &[0, 0, 0]),
            piece(64, &[2, 4, 1], &[4, 1, 1], &[0, 0, 1]),
        ]
        .into();
        let r = Region {
            start: vec![1, 2, 0],
            len: vec![1, 2, 2],
            kept: vec![1, 2],
        };
        let n = narrow(&t, &r, "x").unwrap();
        let got: Vec<(u64, Vec<u64>)> = n
            .pieces
            .iter()
            .map(|p| (p.byte_offset, p.global_offset.clone()))
            .collect();
        assert_eq!(got, [(12, vec![0, 0]), (64 + 12, vec![0, 1])]);
    }

    #[test]
    fn a_box_past_the_tensor_is_an_error_not_a_panic() {
        let t = tensor("w", DType::BF16, &[2, 2]);
        let r = Region {
            start: vec![1, 0],
            len: vec![2, 2],
            kept: vec![1],
        };
        assert!(narrow(&t, &r, "x").unwrap_err().contains("reaches past"));
    }

    fn cfg(mt: &str) -> Map<String, Value> {
        serde_json::from_str(&format!(r#"{{"model_type": "{mt}"}}"#)).unwrap()
    }

    #[test]
    fn packed_names_are_unpacked_unless_the_base_is_packed_too() {
        let m = ArchConversion::for_config(Some(&cfg("qwen3_moe")), ExpertLayout::Base).unwrap();
        let ck = checkpoint(
            "c",
            vec![
                tensor(
                    "model.layers.0.mlp.experts.down_proj",
                    DType::F32,
                    &[2, 4, 3],
                ),
                tensor("model.norm.weight", DType::F32, &[4]),
            ],
        );
        let cands = crate::plan::mapping::candidates(&ck);
        let out = m.map(cands.clone(), MapInputs::default()).unwrap();
        let names: Vec<&str> = out.iter().map(|c| c.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "model.layers.0.mlp.experts.0.down_proj.weight",
                "model.layers.0.mlp.experts.1.down_proj.weight",
                "model.norm.weight"
            ]
        );
        assert!(out.iter().all(|c| matches!(c.content, Content::Copy(_))));
        assert_eq!(out[1].shape, [4, 3]);
        assert_eq!(out[1].origin, Origin::Checkpoint);
        let mut r = Report::default();
        m.note(&mut r);
        assert!(
            r.notes[0].contains("1 packed tensor(s) written as 2"),
            "{r:?}"
        );

        let base = checkpoint("b", ck.tensors.clone());
        let inputs = MapInputs {
            base: Some(&base),
            ..MapInputs::default()
        };
        let kept = m.map(cands, inputs).unwrap();
        assert_eq!(kept[0].name, "model.layers.0.mlp.experts.down_proj");
    }

    /// One expert tensor of `shape`, contiguous at byte `off` of file 0.
    fn expert(name: &str, shape: &[u64], off: u64) -> TensorSource {
        let mut t = tensor(name, DType::BF16, shape);
        t.pieces = vec![piece(off, shape, &[shape[1], 1], &[0, 0])].into();
        t
    }

    #[test]
    fn per_expert_tensors_are_packed_at_their_boxes() {
        let m = ArchConversion::for_config(Some(&cfg("qwen3_moe")), ExpertLayout::Packed).unwrap();
        // 2 experts, intermediate 3, hidden 4: gate_up_proj [2, 6, 4], down_proj [2, 4, 3].
        let p = "model.layers.0.mlp.experts";
        let mut ts = Vec::new();
        for e in 0..2u64 {
            for (k, proj) in ["gate_proj", "up_proj"].iter().enumerate() {
                ts.push(expert(
                    &format!("{p}.{e}.{proj}.weight"),
                    &[3, 4],
                    1000 * (2 * e + k as u64),
                ));
            }
            ts.push(expert(
                &format!("{p}.{e}.down_proj.weight"),
                &[4, 3],
                5000 + 100 * e,
            ));
        }
        ts.push(tensor("model.norm.weight", DType::BF16, &[4]));
        let ck = checkpoint("c", ts);
        let out = m
            .map(crate::plan::mapping::candidates(&ck), MapInputs::default())
            .unwrap();
        let names: Vec<&str> = out.iter().map(|c| c.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "model.layers.0.mlp.experts.gate_up_proj",
                "model.layers.0.mlp.experts.down_proj",
                "model.norm.weight"
            ]
        );
        assert_eq!(out[0].shape, [2, 6, 4]);
        assert_eq!(out[1].shape, [2, 4, 3]);
        let Content::Copy(t) = &out[0].content else {
            panic!("not a copy")
        };
        // (byte offset, place) of each piece: gate of expert e at rows 0..3 of
        // [e], up at rows 3..6 (transformers' concatenation of gate then up).
        let mut got: Vec<(u64, Vec<u64>)> = t
            .pieces
            .iter()
            .map(|p| (p.byte_offset, p.global_offset.clone()))
            .collect();
        got.sort();
        assert_eq!(
            got,
            [
                (0, vec![0, 0, 0]),
                (1000, vec![0, 3, 0]),
                (2000, vec![1, 0, 0]),
                (3000, vec![1, 3, 0])
            ]
        );
        assert!(t
            .pieces
            .iter()
            .all(|p| p.shape == [1, 3, 4] && p.strides[1..] == [4, 1]));
        let mut r = Report::default();
        m.note(&mut r);
        assert!(
            r.notes[0].contains("6 tensor(s) packed into 2 tensor(s)"),
            "{r:?}"
        );
    }

    #[test]
    fn experts_of_two_dtypes_are_not_packed() {
        let m = ArchConversion::for_config(Some(&cfg("qwen3_moe")), ExpertLayout::Packed).unwrap();
        let p = "model.layers.0.mlp.experts";
        let a = expert(&format!("{p}.0.down_proj.weight"), &[4, 3], 0);
        let mut b = expert(&format!("{p}.1.down_proj.weight"), &[4, 3], 100);
        b.dtype = DType::F32;
        let e = m
            .map(
                crate::plan::mapping::candidates(&checkpoint("c", vec![a, b])),
                MapInputs::default(),
            )
            .unwrap_err()
            .to_string();
        assert!(e.contains("'model.layers.0.mlp.experts.down_proj'"), "{e}");
        assert!(e.contains("a packed tensor has one dtype"), "{e}");
    }

    #[test]
    fn a_mix_of_layouts_names_both_tensors() {
        let m = ArchConversion::for_config(Some(&cfg("qwen3_moe")), ExpertLayout::Base).unwrap();
        let ck = checkpoint(
            "c",
            vec![
                tensor(
                    "model.layers.0.mlp.experts.down_proj",
                    DType::F32,
                    &[2, 4, 3],
                ),
                tensor(
                    "model.layers.0.mlp.experts.1.down_proj.weight",
                    DType::F32,
                    &[4, 3],
                ),
            ],
        );
        let e = m
            .map(crate::plan::mapping::candidates(&ck), MapInputs::default())
            .unwrap_err()
            .to_string();
        assert!(e.contains("model.layers.0.mlp.experts.down_proj"), "{e}");
        assert!(
            e.contains("model.layers.0.mlp.experts.1.down_proj.weight"),
            "{e}"
        );
    }

    #[test]
    fn an_interleaving_rule_is_refused_naming_tensor_and_rule() {
        // inkling2_text's files hold gate and up interleaved row by row.
        let m =
            ArchConversion::for_config(Some(&cfg("inkling2_text")), ExpertLayout::Base).unwrap();
        let ck = checkpoint(
            "c",
            vec![tensor(
                "model.layers.0.mlp.experts.gate_up_proj",
                DType::BF16,
                &[2, 8, 4],
            )],
        );
        let e = m
            .map(crate::plan::mapping::candidates(&ck), MapInputs::default())
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("'model.layers.0.mlp.experts.gate_up_proj' [2, 8, 4]"),
            "{e}"
        );
        assert!(
            e.contains("mlp.experts.gate_up_proj -> mlp.experts.w13_weight"),
            "{e}"
        );
        assert!(e.contains("interleaves rows"), "{e}");
    }

    #[test]
    fn an_expert_tensor_no_rule_explains_names_the_nearest_rule() {
        let m = ArchConversion::for_config(Some(&cfg("qwen3_moe")), ExpertLayout::Base).unwrap();
        let ck = checkpoint(
            "c",
            vec![
                tensor(
                    "model.layers.0.mlp.experts.down_proj",
                    DType::F32,
                    &[2, 4, 3],
                ),
                tensor(
                    "model.layers.0.mlp.experts.gate_up_proj_bias",
                    DType::F32,
                    &[2, 6],
                ),
            ],
        );
        let base = checkpoint(
            "b",
            vec![
                tensor(
                    "model.layers.0.mlp.experts.0.down_proj.weight",
                    DType::BF16,
                    &[4, 3],
                ),
                tensor(
                    "model.layers.0.mlp.experts.1.down_proj.weight",
                    DType::BF16,
                    &[4, 3],
                ),
            ],
        );
        let inputs = MapInputs {
            base: Some(&base),
            ..MapInputs::default()
        };
        let e = m
            .map(crate::plan::mapping::candidates(&ck), inputs)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("'model.layers.0.mlp.experts.gate_up_proj_bias' [2, 6] is not in the base"),
            "{e}"
        );
        assert!(
            e.contains("nearest rule is rule 0 (mlp.experts.gate_up_proj ->"),
            "{e}"
        );
        // Without the stray tensor the same checkpoint maps.
        let ok = checkpoint("c", ck.tensors[..1].to_vec());
        assert_eq!(
            m.map(crate::plan::mapping::candidates(&ok), inputs)
                .unwrap()
                .len(),
            2
        );
    }
}
