//! Step 1 of planning: output names. Wrapper components are stripped, the user's
//! renames applied, a constant prefix difference with the base aligned, and two
//! tensors that end up with one name refused.

use std::collections::{HashMap, HashSet};

use regex::Regex;

use super::{Candidate, Report};
use crate::error::{Error, Result};

/// Wrapper components that FSDP, activation checkpointing and torch.compile insert.
const WRAPPER_PARTS: &[&str] = &[
    "_fsdp_wrapped_module",
    "_checkpoint_wrapped_module",
    "_orig_mod",
];

/// Strips wrapper components anywhere and a leading `module.` (DDP, DeepSpeed).
pub fn strip_wrappers(name: &str) -> String {
    let parts: Vec<&str> = name
        .split('.')
        .filter(|p| !WRAPPER_PARTS.contains(p))
        .collect();
    let parts = match parts.first() {
        Some(&"module") if parts.len() > 1 => &parts[1..],
        _ => &parts[..],
    };
    parts.join(".")
}

/// Strips wrappers from each candidate's name, then applies the user's renames in
/// order: the simplest mapping.
pub(crate) fn rename(cands: &mut [Candidate], renames: &[(Regex, String)]) {
    for c in cands {
        let mut n = strip_wrappers(&c.name);
        for (re, rep) in renames {
            n = re.replace_all(&n, rep.as_str()).into_owned();
        }
        c.name = n;
    }
}

/// Replaces a constant leading difference between the names and the base's (a
/// `model.` too many or too few), and says so in the report.
pub(crate) fn align_with_base(
    names: &mut [String],
    base: &HashSet<&str>,
    target: &str,
    report: &mut Report,
) {
    let Some((strip, add)) = align_prefix(names, base) else {
        return;
    };
    for n in names.iter_mut() {
        if let Some(rest) = n.strip_prefix(strip.as_str()) {
            *n = format!("{add}{rest}");
        } else if strip.is_empty() {
            *n = format!("{add}{n}");
        }
    }
    report.notes.push(match (strip.is_empty(), add.is_empty()) {
        (false, true) => format!("stripped the prefix '{strip}' to match {target}"),
        (true, false) => format!("added the prefix '{add}' to match {target}"),
        _ => format!("replaced the prefix '{strip}' with '{add}' to match {target}"),
    });
}

/// Lists every tensor whose output name differs from its checkpoint name. The
/// parts of a split tensor (packed experts unpacked, a fused QKV split: parts that
/// follow one another with one source) are no renames: the mapping that split them
/// notes what it did, and at DeepSeek-V3's size they are 44,544 pairs of names.
pub(crate) fn record_renames(cands: &[Candidate], names: &[String], report: &mut Report) {
    let split = |i: usize| {
        let same = |j: usize| {
            cands
                .get(j)
                .is_some_and(|o| o.source_name == cands[i].source_name)
        };
        (i > 0 && same(i - 1)) || same(i + 1)
    };
    for (i, (c, n)) in cands.iter().zip(names).enumerate() {
        if &c.source_name != n && !split(i) {
            report.renamed.push((c.source_name.clone(), n.clone()));
        }
    }
}

/// Two checkpoint tensors that end up with one output name are an error naming both.
pub(crate) fn check_duplicates(cands: &[Candidate], names: &[String]) -> Result<()> {
    let mut first_of: HashMap<&str, usize> = HashMap::new();
    for (i, n) in names.iter().enumerate() {
        if let Some(&j) = first_of.get(n.as_str()) {
            return Err(Error::DuplicateName {
                first: cands[j].source_name.clone(),
                second: cands[i].source_name.clone(),
                name: n.clone(),
            });
        }
        first_of.insert(n, i);
    }
    Ok(())
}

/// Finds `(strip, add)` such that replacing a leading `strip` with `add` makes more
/// checkpoint names match the base, or `None` if names already match best.
fn align_prefix(names: &[String], base: &HashSet<&str>) -> Option<(String, String)> {
    let matched = |strip: &str, add: &str| -> usize {
        names
            .iter()
            .filter(|n| match n.strip_prefix(strip) {
                Some(rest) => base.contains(format!("{add}{rest}").as_str()),
                None => false,
            })
            .count()
    };
    let now = names.iter().filter(|n| base.contains(n.as_str())).count();
    if now == names.len() {
        return None;
    }
    let mut candidates: Vec<(String, String)> = Vec::new();
    for n in names.iter().filter(|n| !base.contains(n.as_str())).take(4) {
        // Strip leading components of the checkpoint name.
        let mut at = 0;
        while let Some(dot) = n[at..].find('.') {
            at += dot + 1;
            if base.contains(&n[at..]) {
                candidates.push((n[..at].to_string(), String::new()));
            }
        }
        // Add leading components from a base name that ends with this name.
        for b in base.iter() {
            if let Some(p) = b.strip_suffix(n.as_str()) {
                if p.ends_with('.') {
                    candidates.push((String::new(), p.to_string()));
                }
            }
        }
    }
    let mut best: Option<((String, String), usize)> = None;
    for (s, a) in candidates {
        let m = matched(&s, &a);
        if m > now && best.as_ref().is_none_or(|(_, bm)| m > *bm) {
            best = Some(((s, a), m));
        }
    }
    best.map(|(c, _)| c)
}

/// transformers' `dot_natural_key` order: components split on `.`; all-digit
/// components sort first and numerically; others by text, then by trailing number.
pub fn natural_cmp(a: &str, b: &str) -> std::cmp::Ordering {
    use std::cmp::Ordering;
    fn num_cmp(x: &str, y: &str) -> Ordering {
        let (x, y) = (x.trim_start_matches('0'), y.trim_start_matches('0'));
        x.len().cmp(&y.len()).then_with(|| x.cmp(y))
    }
    fn is_num(s: &str) -> bool {
        !s.is_empty() && s.bytes().all(|c| c.is_ascii_digit())
    }
    // Components both names share byte for byte compare equal: start at the first
    // component that differs (names of one model share long prefixes, and a sort
    // compares each name some 16 times at DeepSeek-V3's tensor count).
    let same = a.bytes().zip(b.bytes()).take_while(|(x, y)| x == y).count();
    let from = a.as_bytes()[..same]
        .iter()
        .rposition(|&c| c == b'.')
        .map_or(0, |dot| dot + 1);
    let mut xa = a[from..].split('.');
    let mut xb = b[from..].split('.');
    loop {
        let (pa, pb) = match (xa.next(), xb.next()) {
            (None, None) => return Ordering::Equal,
            (None, Some(_)) => return Ordering::Less,
            (Some(_), None) => return Ordering::Greater,
            (Some(pa), Some(pb)) => (pa, pb),
        };
        let ord = match (is_num(pa), is_num(pb)) {
            (true, true) => num_cmp(pa, pb),
            (true, false) => Ordering::Less,
            (false, true) => Ordering::Greater,
            (false, false) => {
                let ta = pa.trim_end_matches(|c: char| c.is_ascii_digit());
                let tb = pb.trim_end_matches(|c: char| c.is_ascii_digit());
                let (da, db) = (&pa[ta.len()..], &pb[tb.len()..]);
                ta.cmp(tb)
                    .then_with(|| match (da.is_empty(), db.is_empty()) {
                        (true, true) => Ordering::Equal,
                        (true, false) => Ordering::Less,
                        (false, true) => Ordering::Greater,
                        (false, false) => num_cmp(da, db),
                    })
            }
        };
        if ord != Ordering::Equal {
            return ord;
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::plan::mapping::candidates;
    use crate::plan::testing::{checkpoint, f32s};

    fn renamed(ckpt: &crate::source::Checkpoint, renames: &[(Regex, String)]) -> Vec<Candidate> {
        let mut c = candidates(ckpt);
        rename(&mut c, renames);
        c
    }

    fn names(c: &[Candidate]) -> Vec<String> {
        c.iter().map(|c| c.name.clone()).collect()
    }

    #[test]
    fn strips_fsdp_compile_and_ddp_wrappers() {
        assert_eq!(
            strip_wrappers(
                "module._fsdp_wrapped_module.model.layers.0._checkpoint_wrapped_module.mlp.weight"
            ),
            "model.layers.0.mlp.weight"
        );
        assert_eq!(strip_wrappers("_orig_mod.lm_head.weight"), "lm_head.weight");
        // Only a leading `module.` is a wrapper; inner ones are real module names.
        assert_eq!(strip_wrappers("model.module.weight"), "model.module.weight");
    }

    #[test]
    fn a_lone_module_component_is_a_name_not_a_wrapper() {
        // DDP's wrapper is a `module.` before a name: a tensor called `module`
        // keeps its name, also once other wrappers around it are gone.
        assert_eq!(strip_wrappers("module"), "module");
        assert_eq!(strip_wrappers("_orig_mod.module"), "module");
    }

    #[test]
    fn an_empty_component_is_text_and_sorts_after_numbers() {
        use std::cmp::Ordering;
        // All-digit components sort first; an empty one is not all digits.
        assert_eq!(natural_cmp("a.0", "a."), Ordering::Less);
        assert_eq!(natural_cmp("a..x", "a.7.x"), Ordering::Greater);
    }

    /// transformers' `dot_natural_key` as a sort key, component by component from
    /// the start: the order the shortcut past a shared prefix must keep.
    fn dot_natural_key(s: &str) -> Vec<(u8, String, Option<u128>)> {
        s.split('.')
            .map(|p| {
                if !p.is_empty() && p.bytes().all(|c| c.is_ascii_digit()) {
                    return (0, String::new(), p.parse().ok());
                }
                let text = p.trim_end_matches(|c: char| c.is_ascii_digit());
                (1, text.to_string(), p[text.len()..].parse().ok())
            })
            .collect()
    }

    #[test]
    fn natural_order_past_a_shared_prefix_is_the_order_from_the_start() {
        let names = [
            "m.layers.1",
            "m.layers.1.x",
            "m.layers.10.x",
            "m.layers.9.x",
            "m.experts.12.w",
            "m.experts.123.w",
            "m.experts.129.w",
            "m.experts.13.w",
            "m.w1x",
            "m.w12",
            "m.w1",
            "m.w",
            "m.ab1",
            "m.ab10",
            "m.abc10",
            "m.abd9",
            "m.",
            "m",
            "m.layers.1.mlp.gate_up_proj",
            "m.layers.1.mlp.gate",
            "m.layers.1.mlp.gate2",
        ];
        for a in names {
            for b in names {
                assert_eq!(
                    natural_cmp(a, b),
                    dot_natural_key(a).cmp(&dot_natural_key(b)),
                    "{a} vs {b}"
                );
            }
        }
    }

    #[test]
    fn natural_order_compares_numbers_numerically() {
        let mut v = vec![
            "model.layers.10.w",
            "model.layers.2.w",
            "lm_head.weight",
            "model.norm.weight",
            "model.embed_tokens.weight",
            "a.shard_11",
            "a.shard_2",
            "a.shard",
        ];
        v.sort_by(|a, b| natural_cmp(a, b));
        assert_eq!(
            v,
            vec![
                "a.shard",
                "a.shard_2",
                "a.shard_11",
                "lm_head.weight",
                "model.embed_tokens.weight",
                "model.layers.2.w",
                "model.layers.10.w",
                "model.norm.weight"
            ]
        );
    }

    #[test]
    fn aligns_a_constant_prefix_both_ways() {
        let base: HashSet<&str> = ["model.x.weight", "lm_head.weight"].into_iter().collect();
        let names = vec![
            "model.model.x.weight".to_string(),
            "model.lm_head.weight".to_string(),
        ];
        assert_eq!(
            align_prefix(&names, &base),
            Some(("model.".into(), String::new()))
        );
        let base: HashSet<&str> = ["model.x.weight", "model.y.weight"].into_iter().collect();
        let names = vec!["x.weight".to_string(), "y.weight".to_string()];
        assert_eq!(
            align_prefix(&names, &base),
            Some((String::new(), "model.".into()))
        );
    }

    #[test]
    fn the_prefix_matching_most_names_wins_and_one_that_gains_nothing_is_not_taken() {
        // Stripping `a.` matches one name, stripping `a.b.` two: the later wins.
        let base: HashSet<&str> = ["x", "y", "z"].into_iter().collect();
        let names: Vec<String> = ["a.x", "a.b.y", "a.b.z"].map(String::from).to_vec();
        assert_eq!(
            align_prefix(&names, &base),
            Some(("a.b.".into(), String::new()))
        );
        // Stripping `a.` would match `a.x` and lose `x`: no gain, no alignment.
        let base: HashSet<&str> = ["x"].into_iter().collect();
        let names: Vec<String> = ["a.x", "x"].map(String::from).to_vec();
        assert_eq!(align_prefix(&names, &base), None);
    }

    #[test]
    fn stripping_a_prefix_is_noted_as_a_strip() {
        let base: HashSet<&str> = ["a", "b"].into_iter().collect();
        let mut names = vec!["model.a".to_string(), "model.b".to_string()];
        let mut report = Report::default();
        align_with_base(&mut names, &base, "the base's names", &mut report);
        assert_eq!(names, ["a", "b"]);
        assert_eq!(
            report.notes,
            ["stripped the prefix 'model.' to match the base's names"]
        );
    }

    #[test]
    fn renames_apply_in_order_after_wrappers_are_stripped() {
        let ckpt = checkpoint("c", f32s(&[("module.layers.0.attn.w", &[1])]));
        let renames = vec![
            (
                Regex::new(r"^layers\.").unwrap(),
                "model.layers.".to_string(),
            ),
            (Regex::new(r"\.attn\.").unwrap(), ".self_attn.".to_string()),
        ];
        assert_eq!(
            names(&renamed(&ckpt, &renames)),
            ["model.layers.0.self_attn.w"]
        );
    }

    #[test]
    fn aligning_rewrites_every_name_and_notes_it() {
        let base: HashSet<&str> = ["model.a", "model.b"].into_iter().collect();
        let mut names = vec!["a".to_string(), "b".to_string()];
        let mut report = Report::default();
        align_with_base(&mut names, &base, "the base's names", &mut report);
        assert_eq!(names, ["model.a", "model.b"]);
        assert_eq!(
            report.notes,
            ["added the prefix 'model.' to match the base's names"]
        );
        // Names that already match are left alone, without a note.
        let mut report = Report::default();
        align_with_base(&mut names, &base, "the base's names", &mut report);
        assert!(report.notes.is_empty());
    }

    #[test]
    fn two_tensors_with_one_output_name_are_refused_by_name() {
        let ckpt = checkpoint("c", f32s(&[("module.w", &[1]), ("w", &[1])]));
        let c = renamed(&ckpt, &[]);
        let e = check_duplicates(&c, &names(&c)).unwrap_err().to_string();
        assert!(e.contains("'module.w' and 'w' both become 'w'"), "{e}");
        let mut report = Report::default();
        record_renames(&c, &names(&c), &mut report);
        assert_eq!(report.renamed, [("module.w".to_string(), "w".to_string())]);
    }

    #[test]
    fn the_parts_of_a_split_tensor_are_not_listed_as_renames() {
        let ckpt = checkpoint("c", f32s(&[("packed", &[2]), ("module.v", &[1])]));
        let mut c = renamed(&ckpt, &[]);
        // "packed" unpacked into two parts that follow one another, as a mapping
        // that splits a tensor writes them; "module.v" renamed on its own.
        let mut second = c[0].clone();
        c[0].name = "e.0".into();
        second.name = "e.1".into();
        c.insert(1, second);
        c[2].name = "v".into();
        let mut report = Report::default();
        record_renames(&c, &names(&c), &mut report);
        assert_eq!(report.renamed, [("module.v".to_string(), "v".to_string())]);
    }
}
