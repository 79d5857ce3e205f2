//! The checkpoint against what its config calls for: names and shapes exactly.
//!
//! A merge onto a config-only base has nothing else to compare with, and the
//! mistakes it must catch (a checkpoint of another size, of another family whose
//! shapes happen to fit, a partitioned checkpoint's empty placeholders) all load
//! later with a warning nobody reads. Each error names the tensor, the config
//! field and both values.

use std::collections::{BTreeSet, HashMap};

use super::eval::{Expected, ExpectedTensor};
use super::table::Entry;
use crate::error::Error;
use crate::text::list_some;

/// The hint of every placeholder error.
pub const PLACEHOLDER_HINT: &str = "placeholders of a partitioned checkpoint (DeepSpeed ZeRO-3 saves empty tensors in each rank's model states): pass the folder that holds all ranks";

/// The shape a name is expected to have, and who expects it (`config`, `base`).
pub type WantShape<'a> = &'a dyn Fn(&str) -> Option<(Vec<u64>, &'static str)>;

/// An error for the first tensor with zero elements where `want` (the config's or
/// the base's shape) has more, if any.
pub fn placeholders<'a>(
    tensors: impl Iterator<Item = (&'a str, &'a [u64])>,
    want: WantShape<'_>,
) -> Option<Error> {
    let mut empty = Vec::new();
    let mut first: Option<String> = None;
    for (name, shape) in tensors {
        if shape.iter().product::<u64>() != 0 {
            continue;
        }
        if let Some((w, by)) = want(name) {
            if w.iter().product::<u64>() > 0 {
                if first.is_none() {
                    // An empty `w` is "no shape known, but not empty either".
                    first = Some(if w.is_empty() {
                        format!("'{name}' has shape {shape:?}, a {by} with no elements")
                    } else {
                        format!("'{name}' has shape {shape:?} where the {by} expects {w:?}")
                    });
                }
                empty.push(name.to_string());
            }
        }
    }
    let first = first?;
    Some(Error::plan(
        format!(
            "{} tensor(s) have no elements: {first} ({})",
            empty.len(),
            list_some(&empty, 4)
        ),
        Some(PLACEHOLDER_HINT.into()),
    ))
}

/// Checks output names and shapes against the config's layout. `shape_hint` is
/// what to say when shapes do not fit, if the input knows better than "another
/// model size" (rank files whose full shapes are inferred from the pieces present).
pub fn check(
    exp: &Expected,
    tensors: &[(&str, &[u64])],
    shape_hint: Option<String>,
) -> Result<(), Error> {
    let layout = pick_layout(exp, tensors);
    let want: HashMap<&str, &ExpectedTensor> =
        layout.iter().map(|t| (t.name.as_str(), t)).collect();
    let have: HashMap<&str, &[u64]> = tensors.iter().copied().collect();
    let class = &exp.family.class;
    let fields = exp.fields();

    if let Some(e) = placeholders(tensors.iter().copied(), &|n| {
        want.get(n).map(|t| (t.shape.clone(), "config"))
    }) {
        return Err(e);
    }

    // Layer count: the most common mistake, said as such.
    if let Some(prefix) = layer_prefix(layout) {
        let ids: BTreeSet<u64> = tensors
            .iter()
            .filter_map(|(n, _)| n.strip_prefix(prefix.as_str()))
            .filter_map(|rest| rest.split('.').next()?.parse().ok())
            .collect();
        if let Some(&max) = ids.last() {
            let found = max + 1;
            if found != exp.layers {
                let field = fields.explain(&exp.layers_field);
                let (at, what) = if found > exp.layers {
                    (exp.layers, format!("{found} layers"))
                } else {
                    (found, format!("only {found} layers"))
                };
                return Err(Error::plan(
                    format!("{prefix}{at}.* : the config has {field} but the checkpoint has {what}"),
                    Some("pass the config (--base) of the model that was trained: same size and family".into()),
                ));
            }
        }
    }

    let mut mismatched = Vec::new();
    for (name, shape) in tensors {
        let Some(t) = want.get(name) else { continue };
        if t.shape.as_slice() == *shape {
            continue;
        }
        let why: Vec<String> = if t.shape.len() == shape.len() {
            t.shape
                .iter()
                .zip(shape.iter())
                .zip(&t.dims)
                .enumerate()
                .filter(|(_, ((w, h), _))| w != h)
                .map(|(i, ((_, h), d))| {
                    format!(
                        "dim {i}: the config has {}, the checkpoint {h}",
                        fields.explain(d)
                    )
                })
                .collect()
        } else {
            vec![format!(
                "{} dimensions where the config has {}",
                shape.len(),
                t.shape.len()
            )]
        };
        mismatched.push(format!(
            "'{name}' is {shape:?} but the config gives {:?} ({})",
            t.shape,
            why.join("; ")
        ));
    }
    if !mismatched.is_empty() {
        return Err(Error::plan(
            format!(
                "{} tensor(s) do not have the shape the {class} config gives: {}",
                mismatched.len(),
                list_some(&mismatched, 4)
            ),
            Some(shape_hint.unwrap_or_else(|| "the checkpoint was trained from a different model size than this config: pass the config (--base) of the model that was trained".into())),
        ));
    }

    let missing: Vec<String> = layout
        .iter()
        .filter(|t| !have.contains_key(t.name.as_str()))
        .map(|t| t.name.clone())
        .collect();
    let unexpected: Vec<String> = tensors
        .iter()
        .filter(|(n, _)| !want.contains_key(n))
        .map(|(n, _)| n.to_string())
        .collect();
    if missing.is_empty() && unexpected.is_empty() {
        return Ok(());
    }
    let mut parts = Vec::new();
    if !missing.is_empty() {
        parts.push(format!(
            "the config calls for {} tensor(s) the checkpoint lacks: {}",
            missing.len(),
            list_some(&missing, 6)
        ));
    }
    if !unexpected.is_empty() {
        parts.push(format!(
            "{} checkpoint tensor(s) are not part of this {class} model: {}",
            unexpected.len(),
            list_some(&unexpected, 6)
        ));
    }
    let flags = flag_notes(exp, &unexpected, &missing);
    Err(Error::plan(
        format!(
            "the checkpoint does not fit the {class} config (model_type '{}'): {}{flags}",
            exp.family.model_type,
            parts.join("; ")
        ),
        Some("the checkpoint is of another family or variant: pass the config (--base) of the model that was trained, or map names with --rename REGEX=REPLACEMENT".into()),
    ))
}

/// The layout the checkpoint follows: what `save_pretrained` writes, or the
/// state dict's names where they differ (fused MoE experts), whichever matches
/// more names.
fn pick_layout<'a>(exp: &'a Expected, tensors: &[(&str, &[u64])]) -> &'a [ExpectedTensor] {
    let score = |l: &[ExpectedTensor]| {
        let names: std::collections::HashSet<&str> = l.iter().map(|t| t.name.as_str()).collect();
        tensors.iter().filter(|(n, _)| names.contains(n)).count()
    };
    match &exp.state_dict {
        Some(sd) if score(sd) > score(&exp.tensors) => sd,
        _ => &exp.tensors,
    }
}

/// `model.layers.` for a layout whose layer tensors are `model.layers.{layer}.*`.
fn layer_prefix(layout: &[ExpectedTensor]) -> Option<String> {
    // The expanded names lost the template; layer 0's names show the prefix.
    layout.iter().find_map(|t| {
        let parts: Vec<&str> = t.name.split('.').collect();
        let at = parts.iter().position(|p| *p == "0")?;
        Some(format!("{}.", parts[..at].join(".")))
    })
}

/// Says which config flag decides that the names that do not fit exist, e.g.
/// biases a checkpoint has and a config with `attention_bias = false` lacks. A
/// name the checkpoint has beyond the layout points at the conditions that keep
/// it out; a name it lacks, at the flags (`==` conditions) it exists under.
/// Conditions that only pick between two shapes of a name say nothing here.
fn flag_notes(exp: &Expected, unexpected: &[String], missing: &[String]) -> String {
    let fields = exp.fields();
    let entries: Vec<&Entry> = exp
        .family
        .tensors
        .iter()
        .chain(exp.family.state_dict_tensors.iter().flatten())
        .collect();
    let holds = |c: &[serde_json::Value]| fields.holds(c);
    let mut flags: Vec<String> = Vec::new();
    let mut note = |field: &str| {
        if !flags.iter().any(|f| f == field) {
            flags.push(field.to_string());
        }
    };
    for n in unexpected {
        let matching: Vec<&&Entry> = entries
            .iter()
            .filter(|e| template_matches(&e.name, n))
            .collect();
        if matching.is_empty() || matching.iter().any(|e| e.when.iter().all(|c| holds(c))) {
            continue;
        }
        for e in matching {
            for c in e.when.iter().filter(|c| !holds(c)) {
                if let Some(f) = c.first().and_then(|v| v.as_str()) {
                    note(f);
                }
            }
        }
    }
    for n in missing {
        let matching: Vec<&&Entry> = entries
            .iter()
            .filter(|e| template_matches(&e.name, n))
            .collect();
        let flag_of = |e: &Entry| -> Option<String> {
            e.when
                .iter()
                .find(|c| c.get(1).and_then(|v| v.as_str()) == Some("=="))
                .and_then(|c| c.first()?.as_str().map(String::from))
        };
        if let Some(f) = matching.first().and_then(|e| flag_of(e)) {
            if matching
                .iter()
                .all(|e| flag_of(e).as_deref() == Some(f.as_str()))
            {
                note(&f);
            }
        }
    }
    if flags.is_empty() {
        return String::new();
    }
    let said: Vec<String> = flags
        .iter()
        .map(|f| format!("{f} = {}", fields.flag(f)))
        .collect();
    format!(
        " (the config has {}, which decides whether such tensors exist)",
        said.join(", ")
    )
}

/// Whether `name` is an instance of `template` (`{layer}`/`{expert}` = digits).
fn template_matches(template: &str, name: &str) -> bool {
    let t: Vec<&str> = template.split('.').collect();
    let n: Vec<&str> = name.split('.').collect();
    t.len() == n.len()
        && t.iter().zip(&n).all(|(a, b)| {
            a == b
                || ((*a == "{layer}" || *a == "{expert}") && b.bytes().all(|c| c.is_ascii_digit()))
        })
}
