//! From a config.json to the tensors its model holds: picks the table's family,
//! resolves each field (config value, transformers' alias, or the class's
//! default), and expands the templates over layers and experts.

use serde_json::{Map, Value};

use super::table::{table, Entry, Family, Formula};

/// One tensor the config calls for.
#[derive(Clone, Debug, PartialEq)]
pub struct ExpectedTensor {
    pub name: String,
    pub shape: Vec<u64>,
    /// The formula of each dimension, for messages.
    pub dims: Vec<String>,
}

/// What a config calls for.
#[derive(Clone, Debug)]
pub struct Expected {
    pub family: &'static Family,
    /// Number of decoder layers and the field that says so.
    pub layers: u64,
    pub layers_field: String,
    /// What `save_pretrained` writes.
    pub tensors: Vec<ExpectedTensor>,
    /// What `state_dict()` holds, when named differently (fused MoE experts).
    pub state_dict: Option<Vec<ExpectedTensor>>,
    config: Map<String, Value>,
}

/// Why a config's layout cannot be computed.
#[derive(Clone, Debug, PartialEq)]
pub enum Unknown {
    /// The table has no such architecture.
    Architecture(String),
    /// A field the layout needs is neither in config.json nor defaulted.
    Field { class: String, field: String },
    /// A field's value asks for more tensors than any model has.
    Implausible { class: String, field: String },
}

impl std::fmt::Display for Unknown {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Unknown::Architecture(a) => write!(
                f,
                "the architecture {a} is not one unshard knows the layout of"
            ),
            Unknown::Implausible { class, field } => write!(
                f,
                "config.json's '{field}' asks for more tensors than any {class} has"
            ),
            Unknown::Field { class, field } => write!(
                f,
                "config.json lacks '{field}', which the {class} layout needs"
            ),
        }
    }
}

/// The family a config describes: its `architectures[0]` if it has one, else its
/// `model_type` (a config without `architectures` loads as the causal LM).
pub fn family_for(config: &Map<String, Value>) -> Result<&'static Family, Unknown> {
    let t = table().ok_or_else(|| Unknown::Architecture("(table unavailable)".into()))?;
    let arch = config
        .get("architectures")
        .and_then(Value::as_array)
        .and_then(|a| a.first())
        .and_then(Value::as_str);
    let model_type = config.get("model_type").and_then(Value::as_str);
    match (arch, model_type) {
        (Some(a), _) => t
            .families
            .values()
            .find(|f| f.class == a)
            .ok_or_else(|| Unknown::Architecture(format!("'{a}'"))),
        (None, Some(m)) => t
            .families
            .get(m)
            .ok_or_else(|| Unknown::Architecture(format!("model_type '{m}'"))),
        (None, None) => Err(Unknown::Architecture(
            "(config.json names neither architectures nor model_type)".into(),
        )),
    }
}

/// Field lookup over a config, with the family's aliases and defaults.
pub struct Fields<'a> {
    pub config: &'a Map<String, Value>,
    pub family: &'a Family,
}

impl Fields<'_> {
    /// The raw JSON value of a field, by its name or an alias.
    pub fn raw(&self, f: &str) -> Option<&Value> {
        let direct = self.config.get(f).filter(|v| !v.is_null());
        direct
            .or_else(|| {
                // `num_experts` written for a class whose field is `num_local_experts`.
                self.family
                    .aliases
                    .iter()
                    .filter(|(_, target)| target.as_str() == f)
                    .find_map(|(alias, _)| self.config.get(alias).filter(|v| !v.is_null()))
            })
            .or_else(|| {
                let target = self.family.aliases.get(f)?;
                self.config.get(target).filter(|v| !v.is_null())
            })
    }

    /// A field's integer value: config.json, else the class default.
    pub fn int(&self, f: &str) -> Option<u64> {
        self.int_at(f, 0)
    }

    fn int_at(&self, f: &str, depth: u32) -> Option<u64> {
        if let Some(v) = self.raw(f) {
            return v.as_u64();
        }
        if depth > 8 {
            return None;
        }
        let d = self.family.defaults.get(f)?.as_ref()?;
        Formula::parse(d)?.eval(&mut |g| self.int_at(g, depth + 1))
    }

    /// A flag's value: config.json (an explicit null included: DeepSeek-V2-Lite's
    /// `"q_lora_rank": null` is not the class default), else the class default,
    /// else null.
    pub fn flag(&self, f: &str) -> Value {
        let explicit = self.config.get(f).or_else(|| {
            self.family
                .aliases
                .iter()
                .filter(|(_, target)| target.as_str() == f)
                .find_map(|(alias, _)| self.config.get(alias))
        });
        explicit
            .or_else(|| self.raw(f))
            .cloned()
            .or_else(|| self.family.flag_defaults.get(f).cloned())
            .unwrap_or(Value::Null)
    }

    /// Whether a table condition (`[field, "==", v]`, `[field, "null"]`,
    /// `[field, "set"]`) holds for this config.
    pub fn holds(&self, cond: &[Value]) -> bool {
        let Some(field) = cond.first().and_then(Value::as_str) else {
            return false;
        };
        let v = self.flag(field);
        match (cond.get(1).and_then(Value::as_str), cond.get(2)) {
            (Some("=="), Some(want)) => &v == want,
            (Some("null"), _) => v.is_null(),
            (Some("set"), _) => !v.is_null(),
            _ => false,
        }
    }

    /// Whether decoder layer `i` is a sparse (MoE) layer; mirrors the generator.
    fn sparse(&self, i: u64) -> bool {
        match self.family.sparse_rule.as_deref() {
            Some("deepseek") => {
                if self.raw("n_routed_experts").is_none() {
                    return false;
                }
                let k = self.int("first_k_dense_replace").unwrap_or(0);
                let freq = self.int("moe_layer_freq").unwrap_or(1).max(1);
                i >= k && i % freq == 0
            }
            Some("qwen_moe") => {
                let only: Vec<u64> = self
                    .raw("mlp_only_layers")
                    .and_then(Value::as_array)
                    .map(|a| a.iter().filter_map(Value::as_u64).collect())
                    .unwrap_or_default();
                let n = self.int("num_experts").unwrap_or(0);
                let step = self.int("decoder_sparse_step").unwrap_or(1).max(1);
                !only.contains(&i) && n > 0 && (i + 1) % step == 0
            }
            _ => true,
        }
    }

    /// Evaluates a formula, naming the first field without a value.
    pub fn eval(&self, formula: &str) -> Result<u64, String> {
        let f = Formula::parse(formula).ok_or_else(|| formula.to_string())?;
        if let Some(v) = f.eval(&mut |g| self.int(g)) {
            return Ok(v);
        }
        Err(f
            .fields()
            .into_iter()
            .find(|g| self.int(g).is_none())
            .unwrap_or(formula)
            .to_string())
    }

    /// `num_attention_heads*head_dim = 64 (num_attention_heads = 4, head_dim = 16)`.
    pub fn explain(&self, formula: &str) -> String {
        let Some(f) = Formula::parse(formula) else {
            return formula.to_string();
        };
        let value = f
            .eval(&mut |g| self.int(g))
            .map(|v| v.to_string())
            .unwrap_or_else(|| "?".into());
        if let Some(single) = f.single_field() {
            return format!("{single} = {value}");
        }
        let fields = f.fields();
        if fields.is_empty() {
            return value;
        }
        let parts: Vec<String> = fields
            .iter()
            .map(|g| {
                let v = self.int(g).map(|v| v.to_string()).unwrap_or("?".into());
                format!("{g} = {v}")
            })
            .collect();
        format!("{formula} = {value} ({})", parts.join(", "))
    }

    fn expand(&self, entries: &[Entry], layers: u64) -> Result<Vec<ExpectedTensor>, Unknown> {
        let missing = |field: String| Unknown::Field {
            class: self.family.class.clone(),
            field,
        };
        let implausible = |field: String| Unknown::Implausible {
            class: self.family.class.clone(),
            field,
        };
        let mut out = Vec::new();
        for e in entries {
            if !e.when.iter().all(|c| self.holds(c)) {
                continue;
            }
            let shape = e
                .shape
                .iter()
                .map(|d| self.eval(d))
                .collect::<Result<Vec<u64>, String>>()
                .map_err(missing)?;
            if layers > MAX_TENSORS {
                return Err(implausible(self.family.layers.clone()));
            }
            let layer_ids: Vec<Option<u64>> = if e.name.contains("{layer}") {
                (0..layers)
                    .filter(|&i| match e.layers.as_deref() {
                        Some("sparse") => self.sparse(i),
                        Some("dense") => !self.sparse(i),
                        _ => true,
                    })
                    .map(Some)
                    .collect()
            } else {
                vec![None]
            };
            let experts = match &e.experts {
                Some(x) => Some(self.eval(x).map_err(missing)?),
                None => None,
            };
            // A config's numbers are input too: no model has more than a few
            // hundred thousand tensors, so a config asking for more is not expanded.
            let count = (layer_ids.len() as u64).saturating_mul(experts.unwrap_or(1));
            if count.saturating_add(out.len() as u64) > MAX_TENSORS {
                return Err(implausible(
                    e.experts
                        .clone()
                        .unwrap_or_else(|| self.family.layers.clone()),
                ));
            }
            for l in layer_ids {
                let name = match l {
                    Some(l) => e.name.replace("{layer}", &l.to_string()),
                    None => e.name.clone(),
                };
                match experts {
                    Some(n) => {
                        for x in 0..n {
                            out.push(ExpectedTensor {
                                name: name.replace("{expert}", &x.to_string()),
                                shape: shape.clone(),
                                dims: e.shape.clone(),
                            });
                        }
                    }
                    None => out.push(ExpectedTensor {
                        name,
                        shape: shape.clone(),
                        dims: e.shape.clone(),
                    }),
                }
            }
        }
        Ok(out)
    }
}

/// More tensors than any model has: a config asking for more is not believed.
const MAX_TENSORS: u64 = 2_000_000;

/// The tensors `config` calls for, or why that cannot be known.
pub fn expected(config: &Map<String, Value>) -> Result<Expected, Unknown> {
    let family = family_for(config)?;
    let fields = Fields { config, family };
    let missing = |field: String| Unknown::Field {
        class: family.class.clone(),
        field,
    };
    let layers = fields.eval(&family.layers).map_err(missing)?;
    let tensors = fields.expand(&family.tensors, layers)?;
    let state_dict = match &family.state_dict_tensors {
        Some(e) => Some(fields.expand(e, layers)?),
        None => None,
    };
    Ok(Expected {
        family,
        layers,
        layers_field: family.layers.clone(),
        tensors,
        state_dict,
        config: config.clone(),
    })
}

impl Expected {
    /// Field lookup over the config this was computed from.
    pub fn fields(&self) -> Fields<'_> {
        Fields {
            config: &self.config,
            family: self.family,
        }
    }
}
