//! `adapter_config.json`: what peft wrote about an adapter, reduced to what changes
//! the fused weights (rank, alpha, rsLoRA, per-module patterns, layout, DoRA, which
//! modules are targeted or replaced).
//!
//! Matching follows peft 0.21 (`peft/utils/other.py`, `tuners/tuners_utils.py`):
//! - `rank_pattern` / `alpha_pattern` keys are regular expressions tried in the
//!   file's order against the module's full name as `(.*\.)?(KEY)$`; the first
//!   that matches wins, else `r` / `lora_alpha`.
//! - `target_modules` as a string is a regex that must match the whole name; as a
//!   list, an entry matches the name itself or a `.`-suffix of it. `exclude_modules`
//!   the same way, and wins.
//!
//! Fields of other peft variants that change the math (`lora_bias`, QA-LoRA,
//! layer replication, ...) are refused by name: an adapter is fused completely or
//! not at all. Initialisation-only fields (LoftQ, EVA, CorDA, dropout) are ignored.

use std::path::{Path, PathBuf};

use regex::Regex;
use serde_json::{Map, Value};

use super::{adapter_error, remedy_error, AdapterRemedy};
use crate::error::{Error, Result};

/// The file name peft writes.
pub const CONFIG_FILE: &str = "adapter_config.json";

/// Which modules an adapter is injected into.
#[derive(Clone, Debug)]
pub enum ModuleSelector {
    /// A regex matched against the whole module name (`re.fullmatch`).
    Regex(Regex),
    /// Names matched exactly or as a `.`-separated suffix.
    Names(Vec<String>),
}

impl ModuleSelector {
    fn parse(path: &Path, field: &str, v: &Value) -> Result<Option<ModuleSelector>> {
        match v {
            Value::Null => Ok(None),
            Value::String(s) => Ok(Some(ModuleSelector::Regex(full_regex(path, field, s)?))),
            Value::Array(items) => {
                let mut names = Vec::with_capacity(items.len());
                for item in items {
                    match item.as_str() {
                        Some(s) => names.push(s.to_string()),
                        None => return Err(bad_field(path, field, "a list of module names")),
                    }
                }
                Ok(Some(ModuleSelector::Names(names)))
            }
            _ => Err(bad_field(path, field, "a string or a list of module names")),
        }
    }

    /// Whether `module` (a full module name, e.g. `model.layers.0.self_attn.q_proj`) is selected.
    pub fn matches(&self, module: &str) -> bool {
        match self {
            ModuleSelector::Regex(re) => re.is_match(module),
            ModuleSelector::Names(names) => names.iter().any(|n| {
                module == n
                    || module
                        .strip_suffix(n.as_str())
                        .is_some_and(|head| head.ends_with('.'))
            }),
        }
    }
}

/// A per-module override of `r` or `lora_alpha`.
#[derive(Clone, Debug)]
pub struct Pattern {
    /// The key as written in the config.
    #[cfg_attr(not(feature = "internals"), allow(dead_code))] // for the tests and fuzz targets
    pub key: String,
    re: Regex,
    /// The rank or alpha it gives.
    pub value: f64,
}

/// The parts of an `adapter_config.json` that decide the fused weights.
#[derive(Clone, Debug)]
pub struct AdapterConfig {
    /// The file it was read from.
    pub path: PathBuf,
    /// The whole JSON object, written back unchanged by `--no-fuse`.
    pub raw: Map<String, Value>,
    /// The rank of every module without a `rank_pattern` match.
    pub r: u64,
    /// The alpha of every module without an `alpha_pattern` match.
    pub lora_alpha: f64,
    /// Scale `alpha / sqrt(r)` instead of `alpha / r`.
    pub use_rslora: bool,
    /// Per-module ranks, in the file's order.
    pub rank_pattern: Vec<Pattern>,
    /// Per-module alphas, in the file's order.
    pub alpha_pattern: Vec<Pattern>,
    /// Weights are stored `[in, out]` (GPT-2 `Conv1D`).
    pub fan_in_fan_out: bool,
    /// DoRA: each output channel rescaled to its trained magnitude.
    pub use_dora: bool,
    /// The modules peft injects LoRA layers into.
    pub target_modules: Option<ModuleSelector>,
    /// Modules excluded even when `target_modules` selects them.
    pub exclude_modules: Option<ModuleSelector>,
    /// Modules trained in full; the adapter's copy replaces the base's.
    #[cfg_attr(not(feature = "internals"), allow(dead_code))] // for the tests and fuzz targets
    pub modules_to_save: Vec<String>,
    /// `modules_to_save` as peft matches them: `(^|.*\.)NAME($|\..*)`, NAME a regex.
    saved_modules: Vec<Regex>,
}

/// Fields that change the merged weights in ways unshard does not compute. Each is
/// refused when set to anything but its default (null, false, empty).
const UNSUPPORTED: &[(&str, &str)] = &[
    ("lora_bias", "a trained bias on lora_B"),
    ("use_qalora", "QA-LoRA pooling"),
    ("use_bdlora", "block-diagonal LoRA"),
    ("layer_replication", "replicated layers"),
    ("target_parameters", "LoRA on nn.Parameter targets"),
    ("trainable_token_indices", "trainable token rows"),
    ("layers_to_transform", "a layer filter"),
    ("arrow_config", "Arrow routing"),
    ("velora_config", "VeLoRA"),
    ("monteclora_config", "MonteCLoRA"),
    ("kasa_config", "KaSA"),
    ("alora_invocation_tokens", "activated LoRA"),
    ("mica", "MiCA"),
];

impl AdapterConfig {
    /// Reads and checks `path` (an `adapter_config.json`).
    pub fn read(path: &Path) -> Result<AdapterConfig> {
        // Local or in object storage; the reason is the system's (or the store's).
        let text = match crate::bytes::fs::read(path) {
            Ok(b) => String::from_utf8(b).map_err(|e| e.to_string()),
            Err(Error::Io { source, .. }) => Err(source.to_string()),
            Err(e) => Err(e.to_string()),
        };
        let text = text.map_err(|e| {
            remedy_error(
                path,
                format!("cannot read the adapter config ({e})"),
                AdapterRemedy::ConfigUnreadable,
            )
        })?;
        let value: Value = serde_json::from_str(&text).map_err(|e| {
            adapter_error(
                path,
                format!("not valid JSON ({e})"),
                "the file must be the adapter_config.json peft's save_pretrained writes",
            )
        })?;
        let Value::Object(raw) = value else {
            return Err(adapter_error(
                path,
                "not a JSON object",
                "the file must be the adapter_config.json peft's save_pretrained writes",
            ));
        };
        AdapterConfig::from_map(path, raw)
    }

    /// Checks and interprets an already parsed config.
    pub fn from_map(path: &Path, raw: Map<String, Value>) -> Result<AdapterConfig> {
        match raw.get("peft_type").and_then(Value::as_str) {
            Some("LORA") => {}
            Some(other) => {
                return Err(adapter_error(
                    path,
                    format!(
                    "peft_type is {other:?}; only LoRA (and DoRA, use_dora) adapters can be fused"
                ),
                    "merge this adapter with peft's merge_and_unload, or convert it to LoRA",
                ))
            }
            None => {
                return Err(adapter_error(
                    path,
                    "peft_type is missing: not a peft adapter config",
                    "pass the adapter_config.json peft wrote for this adapter",
                ))
            }
        }
        for (field, what) in UNSUPPORTED {
            if raw.get(*field).is_some_and(is_set) {
                return Err(adapter_error(
                    path,
                    format!("field '{field}' is set ({what}); unshard cannot fuse it, and nothing was written"),
                    "merge this adapter with peft's merge_and_unload",
                ));
            }
        }
        let r = match raw.get("r").and_then(Value::as_u64) {
            Some(r) if r > 0 => r,
            _ => return Err(bad_field(path, "r", "a positive integer (the LoRA rank)")),
        };
        // alpha 0 is accepted: it is what verl writes, and the merge then warns that
        // the output equals the base.
        let lora_alpha = match raw.get("lora_alpha").and_then(Value::as_f64) {
            Some(a) if a.is_finite() => a,
            _ => {
                return Err(adapter_error(
                    path,
                    "field 'lora_alpha' is missing or not a number",
                    "the scale of the update is lora_alpha / r: it cannot be guessed; pass the config the adapter was trained with",
                ))
            }
        };
        let flag = |field: &str| -> Result<bool> {
            match raw.get(field) {
                None | Some(Value::Null) => Ok(false),
                Some(Value::Bool(b)) => Ok(*b),
                Some(_) => Err(bad_field(path, field, "true or false")),
            }
        };
        let use_rslora = flag("use_rslora")?;
        let fan_in_fan_out = flag("fan_in_fan_out")?;
        let use_dora = flag("use_dora")?;
        let rank_pattern = patterns(path, &raw, "rank_pattern", true)?;
        let alpha_pattern = patterns(path, &raw, "alpha_pattern", false)?;
        let target_modules = ModuleSelector::parse(
            path,
            "target_modules",
            raw.get("target_modules").unwrap_or(&Value::Null),
        )?;
        let exclude_modules = ModuleSelector::parse(
            path,
            "exclude_modules",
            raw.get("exclude_modules").unwrap_or(&Value::Null),
        )?;
        let modules_to_save = match raw.get("modules_to_save") {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::Array(items)) => items
                .iter()
                .map(|v| v.as_str().map(str::to_string))
                .collect::<Option<Vec<_>>>()
                .ok_or_else(|| bad_field(path, "modules_to_save", "a list of module names"))?,
            Some(_) => return Err(bad_field(path, "modules_to_save", "a list of module names")),
        };
        let saved_modules = modules_to_save
            .iter()
            .map(|m| {
                full_regex(
                    path,
                    "modules_to_save",
                    &format!("(?:.*\\.)?(?:{m})(?:\\..*)?"),
                )
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(AdapterConfig {
            saved_modules,
            path: path.to_path_buf(),
            raw,
            r,
            lora_alpha,
            use_rslora,
            rank_pattern,
            alpha_pattern,
            fan_in_fan_out,
            use_dora,
            target_modules,
            exclude_modules,
            modules_to_save,
        })
    }

    /// The rank peft gives `module`: the first matching `rank_pattern` key, else `r`.
    pub fn rank_for(&self, module: &str) -> u64 {
        first_match(&self.rank_pattern, module)
            .map(|v| v as u64)
            .unwrap_or(self.r)
    }

    /// The alpha peft gives `module`: the first matching `alpha_pattern` key, else `lora_alpha`.
    pub fn alpha_for(&self, module: &str) -> f64 {
        first_match(&self.alpha_pattern, module).unwrap_or(self.lora_alpha)
    }

    /// The scale of `module`'s update, as peft's `update_layer` computes it (in Python
    /// floats): `alpha / sqrt(r)` with rsLoRA, else `alpha / r`.
    pub fn scale_for(&self, module: &str) -> f64 {
        let r = self.rank_for(module) as f64;
        let alpha = self.alpha_for(module);
        if self.use_rslora {
            alpha / r.sqrt()
        } else {
            alpha / r
        }
    }

    /// Whether peft injects a LoRA layer into `module`.
    pub fn targets(&self, module: &str) -> bool {
        if self
            .exclude_modules
            .as_ref()
            .is_some_and(|s| s.matches(module))
        {
            return false;
        }
        if self.saves(module) {
            return false;
        }
        self.target_modules
            .as_ref()
            .is_some_and(|s| s.matches(module))
    }

    /// Whether `module` (or a module it is inside) is in `modules_to_save`.
    pub fn saves(&self, module: &str) -> bool {
        self.saved_modules.iter().any(|re| re.is_match(module))
    }
}

fn first_match(patterns: &[Pattern], module: &str) -> Option<f64> {
    patterns
        .iter()
        .find(|p| p.re.is_match(module))
        .map(|p| p.value)
}

fn patterns(
    path: &Path,
    raw: &Map<String, Value>,
    field: &str,
    integer: bool,
) -> Result<Vec<Pattern>> {
    let map = match raw.get(field) {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Object(m)) => m,
        Some(_) => {
            return Err(bad_field(
                path,
                field,
                "an object of module pattern -> number",
            ))
        }
    };
    let want = if integer {
        "a positive integer rank"
    } else {
        "a number"
    };
    let mut out = Vec::with_capacity(map.len());
    // serde_json keeps the file's key order, and peft takes the first match in it.
    for (key, v) in map {
        let value = if integer {
            v.as_u64().filter(|&r| r > 0).map(|r| r as f64)
        } else {
            v.as_f64().filter(|a| a.is_finite())
        };
        let value = value.ok_or_else(|| bad_field(path, &format!("{field}.{key}"), want))?;
        let re = Regex::new(&format!("^(?:.*\\.)?(?:{key})$")).map_err(|e| {
            adapter_error(
                path,
                format!("{field} key {key:?} is not a regular expression unshard can read ({e})"),
                "rewrite the key as a plain module name or a simpler pattern",
            )
        })?;
        out.push(Pattern {
            key: key.clone(),
            re,
            value,
        });
    }
    Ok(out)
}

fn full_regex(path: &Path, field: &str, s: &str) -> Result<Regex> {
    Regex::new(&format!("^(?:{s})$")).map_err(|e| {
        adapter_error(
            path,
            format!("{field} {s:?} is not a regular expression unshard can read ({e})"),
            "list the module names instead",
        )
    })
}

fn bad_field(path: &Path, field: &str, want: &str) -> crate::error::Error {
    adapter_error(
        path,
        format!("field '{field}' must be {want}"),
        "pass the adapter_config.json peft wrote for this adapter",
    )
}

/// Whether a config value differs from peft's "off" defaults.
fn is_set(v: &Value) -> bool {
    match v {
        Value::Null => false,
        Value::Bool(b) => *b,
        Value::Array(a) => !a.is_empty(),
        Value::Object(o) => !o.is_empty(),
        Value::String(s) => !s.is_empty(),
        Value::Number(_) => true,
    }
}

/// A LoRA config of the fields of `layers`, each laid over the ones before it, as
/// `adapter_config.json` would hold them (tests).
#[cfg(test)]
#[allow(clippy::unwrap_used)]
pub(crate) fn from_layers(layers: &[Value]) -> Result<AdapterConfig> {
    let mut map = serde_json::Map::new();
    map.insert("peft_type".into(), "LORA".into());
    for layer in layers {
        for (k, v) in layer.as_object().unwrap() {
            map.insert(k.clone(), v.clone());
        }
    }
    AdapterConfig::from_map(Path::new("adapter_config.json"), map)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn config(extra: Value) -> Result<AdapterConfig> {
        from_layers(&[serde_json::json!({"r": 8, "lora_alpha": 16}), extra])
    }

    #[test]
    fn patterns_take_the_first_key_matching_a_suffix_of_whole_components() {
        let c = config(serde_json::json!({
            "rank_pattern": {"model.layers.0.self_attn.k_proj": 2, "q_proj": 4},
            "alpha_pattern": {"v_proj": 32, "layers\\.1\\.mlp\\.gate_proj": 3},
        }))
        .unwrap();
        assert_eq!(c.rank_for("model.layers.0.self_attn.k_proj"), 2);
        assert_eq!(c.rank_for("model.layers.1.self_attn.k_proj"), 8);
        assert_eq!(c.rank_for("model.layers.1.self_attn.q_proj"), 4);
        // "q_proj" must match whole trailing components, not a substring.
        assert_eq!(c.rank_for("model.layers.1.self_attn.xq_proj"), 8);
        assert_eq!(c.alpha_for("model.layers.1.mlp.gate_proj"), 3.0);
        assert_eq!(c.alpha_for("model.layers.0.mlp.gate_proj"), 16.0);
        assert_eq!(c.scale_for("model.layers.0.self_attn.v_proj"), 32.0 / 8.0);
    }

    #[test]
    fn rslora_scales_by_the_square_root_of_the_rank() {
        let c = config(serde_json::json!({"use_rslora": true})).unwrap();
        assert_eq!(c.scale_for("x"), 16.0 / 8f64.sqrt());
    }

    #[test]
    fn target_modules_match_names_suffixes_or_a_full_regex() {
        let c = config(
            serde_json::json!({"target_modules": ["q_proj", "model.layers.1.mlp.up_proj"],
                                          "exclude_modules": ["layers.1.self_attn.q_proj"]}),
        )
        .unwrap();
        assert!(c.targets("model.layers.0.self_attn.q_proj"));
        assert!(!c.targets("model.layers.1.self_attn.q_proj"));
        assert!(!c.targets("model.layers.0.self_attn.xq_proj"));
        assert!(c.targets("model.layers.1.mlp.up_proj"));
        let c = config(serde_json::json!({"target_modules": ".*\\.(q|v)_proj"})).unwrap();
        assert!(c.targets("model.layers.0.self_attn.v_proj"));
        assert!(!c.targets("model.layers.0.self_attn.v_proj.x"));
    }

    #[test]
    fn modules_to_save_exclude_their_modules_from_lora() {
        let c = config(serde_json::json!({"target_modules": ["lm_head", "q_proj"], "modules_to_save": ["lm_head"]}))
            .unwrap();
        assert!(c.saves("lm_head"));
        assert!(c.saves("model.lm_head.inner"));
        assert!(!c.saves("xlm_head"));
        assert!(!c.saves("lm_headx"));
        // Names are any UTF-8: matching never slices inside a character.
        assert!(!c.saves("é.lm_heé"));
        assert!(!c.targets("lm_head"));
    }

    #[test]
    fn refuses_variants_by_field_name() {
        let e = config(serde_json::json!({"lora_bias": true})).unwrap_err();
        assert!(e.to_string().contains("'lora_bias'"), "{e}");
        assert!(config(serde_json::json!({"lora_bias": false})).is_ok());
        let e = config(serde_json::json!({"peft_type": "VERA"})).unwrap_err();
        assert!(e.to_string().contains("peft_type"), "{e}");
        let e = config(serde_json::json!({"lora_alpha": null})).unwrap_err();
        assert!(e.to_string().contains("lora_alpha"), "{e}");
    }

    #[test]
    fn variant_fields_are_refused_only_when_set() {
        use serde_json::json;
        // peft writes them at their defaults: null, false, empty.
        for (field, default, set) in [
            ("layer_replication", json!([]), json!([[0, 2]])),
            (
                "trainable_token_indices",
                json!({}),
                json!({"embed_tokens": [0]}),
            ),
            ("target_parameters", json!(""), json!("experts")),
            ("layers_to_transform", json!(null), json!(0)),
        ] {
            let quote = format!("'{field}'");
            assert!(config(json!({ field: default })).is_ok(), "{field}");
            let e = config(json!({ field: set })).unwrap_err();
            assert!(e.to_string().contains(&quote), "{e}");
        }
    }

    #[test]
    fn ranks_are_positive_integers() {
        use serde_json::json;
        for extra in [json!({"r": 0}), json!({"rank_pattern": {"q_proj": 0}})] {
            let e = config(extra.clone()).unwrap_err();
            assert!(e.to_string().contains("positive integer"), "{extra}: {e}");
        }
        let c = config(json!({"r": 1, "rank_pattern": {"q_proj": 1}})).unwrap();
        assert_eq!((c.r, c.rank_for("q_proj")), (1, 1));
    }
}
