//! The config-layout table: `layouts.json`, written by `fixtures/gen_arch_table.py`
//! from transformers' own models, compiled into the binary.
//!
//! The table is data so that a new transformers family is a regenerated file, not
//! code. This module only parses it and evaluates its formulas; what a layout
//! means for a checkpoint is `eval.rs` and `check.rs`.

use std::collections::BTreeMap;
use std::sync::OnceLock;

use serde::Deserialize;
use serde_json::Value;

/// The whole table.
#[derive(Debug, Deserialize)]
pub struct Table {
    pub families: BTreeMap<String, Family>,
}

/// One architecture (a `model_type` and its causal-LM class).
#[derive(Debug, Deserialize)]
pub struct Family {
    pub model_type: String,
    /// The class `architectures` names (`LlamaForCausalLM`).
    pub class: String,
    /// Formula of the number of decoder layers.
    pub layers: String,
    /// What the config class fills in for a field config.json lacks (a formula),
    /// or `null` when it has no default the layout can use.
    pub defaults: BTreeMap<String, Option<String>>,
    /// The class's default value of every flag a `when` condition reads.
    pub flag_defaults: BTreeMap<String, Value>,
    /// transformers' `attribute_map`: another name of a field -> the field.
    #[serde(default)]
    pub aliases: BTreeMap<String, String>,
    /// How sparse (MoE) layers are chosen: `deepseek`, `qwen_moe`, or none.
    pub sparse_rule: Option<String>,
    /// What `save_pretrained` writes.
    pub tensors: Vec<Entry>,
    /// What `model.state_dict()` holds, when it names tensors differently
    /// (transformers 5 keeps MoE experts fused in 3-D tensors).
    #[serde(default)]
    pub state_dict_tensors: Option<Vec<Entry>>,
}

/// One tensor template.
#[derive(Clone, Debug, Deserialize)]
pub struct Entry {
    /// With `{layer}` and `{expert}` placeholders.
    pub name: String,
    /// One formula per dimension.
    pub shape: Vec<String>,
    /// `all`, `sparse` or `dense`, for names with `{layer}`.
    #[serde(default)]
    pub layers: Option<String>,
    /// Formula of the number of experts, for names with `{expert}`.
    #[serde(default)]
    pub experts: Option<String>,
    /// Conditions on config flags, all of which must hold:
    /// `[field, "==", value]`, `[field, "null"]`, `[field, "set"]`.
    #[serde(default)]
    pub when: Vec<Vec<Value>>,
}

const TABLE_JSON: &str = include_str!("layouts.json");

/// The compiled-in table. A table that does not parse is a build defect caught by
/// the tests; at run time it degrades to "architecture unknown".
pub fn table() -> Option<&'static Table> {
    static T: OnceLock<Option<Table>> = OnceLock::new();
    T.get_or_init(|| serde_json::from_str(TABLE_JSON).ok())
        .as_ref()
}

/// A formula: a sum of terms `c * f1 * f2 / d` (as the generator writes them).
#[derive(Clone, Debug, PartialEq)]
pub struct Formula {
    terms: Vec<Term>,
}

#[derive(Clone, Debug, PartialEq)]
struct Term {
    sign: i64,
    coef: u64,
    fields: Vec<String>,
    div: Option<String>,
}

impl Formula {
    /// Parses `hidden_size + 2*hidden_size*num_key_value_heads/num_attention_heads`.
    pub fn parse(s: &str) -> Option<Formula> {
        let mut terms = Vec::new();
        for raw in s.replace("- ", "+ -").split('+') {
            let raw = raw.trim();
            let (sign, body) = match raw.strip_prefix('-') {
                Some(b) => (-1, b.trim()),
                None => (1, raw),
            };
            let (num, div) = match body.split_once('/') {
                Some((n, d)) => (n, Some(d.trim().to_string())),
                None => (body, None),
            };
            let mut coef = 1u64;
            let mut fields = Vec::new();
            for f in num.split('*') {
                let f = f.trim();
                if f.is_empty() {
                    return None;
                }
                if let Ok(n) = f.parse::<u64>() {
                    coef = coef.checked_mul(n)?;
                } else {
                    fields.push(f.to_string());
                }
            }
            terms.push(Term {
                sign,
                coef,
                fields,
                div,
            });
        }
        (!terms.is_empty()).then_some(Formula { terms })
    }

    /// The fields it reads.
    pub fn fields(&self) -> Vec<&str> {
        let mut v: Vec<&str> = Vec::new();
        for t in &self.terms {
            for f in t.fields.iter().chain(&t.div) {
                if !v.contains(&f.as_str()) {
                    v.push(f);
                }
            }
        }
        v
    }

    /// Whether it is one bare field (`vocab_size`).
    pub fn single_field(&self) -> Option<&str> {
        match self.terms.as_slice() {
            [t] if t.sign == 1 && t.coef == 1 && t.fields.len() == 1 && t.div.is_none() => {
                Some(&t.fields[0])
            }
            _ => None,
        }
    }

    /// Evaluates with `get` giving each field's value; `None` if a field has no
    /// value, a division is inexact, or the result is negative or overflows.
    pub fn eval(&self, get: &mut dyn FnMut(&str) -> Option<u64>) -> Option<u64> {
        let mut total: i128 = 0;
        for t in &self.terms {
            let mut v = t.coef as i128;
            for f in &t.fields {
                v = v.checked_mul(get(f)? as i128)?;
            }
            if let Some(d) = &t.div {
                let d = get(d)? as i128;
                if d == 0 || v % d != 0 {
                    return None;
                }
                v /= d;
            }
            total = total.checked_add(t.sign as i128 * v)?;
        }
        u64::try_from(total).ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_parses_and_every_formula_too() {
        let t = table().expect("layouts.json parses");
        assert!(t.families.len() >= 16);
        for (name, f) in &t.families {
            let all = f
                .tensors
                .iter()
                .chain(f.state_dict_tensors.iter().flatten());
            for e in all {
                for d in e.shape.iter().chain(&e.experts) {
                    assert!(Formula::parse(d).is_some(), "{name}: {}: '{d}'", e.name);
                }
            }
            assert!(Formula::parse(&f.layers).is_some(), "{name}");
        }
    }

    #[test]
    fn formulas_evaluate_sums_products_and_exact_quotients() {
        let f =
            Formula::parse("hidden_size + 2*hidden_size*num_key_value_heads/num_attention_heads")
                .expect("parses");
        let mut get = |k: &str| match k {
            "hidden_size" => Some(3072),
            "num_key_value_heads" => Some(32),
            "num_attention_heads" => Some(32),
            _ => None,
        };
        assert_eq!(f.eval(&mut get), Some(9216));
        let q = Formula::parse("hidden_size/num_attention_heads").expect("parses");
        assert_eq!(
            q.eval(&mut |k| Some(if k == "hidden_size" { 10 } else { 4 })),
            None,
            "inexact division is no value"
        );
        assert_eq!(
            Formula::parse("vocab_size").and_then(|f| f.single_field().map(String::from)),
            Some("vocab_size".into())
        );
        assert_eq!(
            Formula::parse("7").map(|f| f.eval(&mut |_| None)),
            Some(Some(7))
        );
    }
}
