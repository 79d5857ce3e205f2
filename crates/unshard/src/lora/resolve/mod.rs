//! From an adapter's tensors and config to what the merge writes: tensors under
//! base names, and one [`Fuse`] per adapted weight.
//!
//! Every check that can fail is made here, before anything is planned or written:
//! unsupported tensors, an adapter name that is not there (or several with none
//! chosen), factors without their partner, ranks that disagree with the config,
//! modules the config does not target (peft would ignore their weights, so fusing
//! them would give a model peft never produced), DoRA magnitudes without `use_dora`
//! or the reverse.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::Path;

use super::config::AdapterConfig;
use super::math::Layout;
use super::names::{self, Adapted, PeftName};
use super::{adapter_error, remedy_error, AdapterRemedy};
use crate::error::Result;
use crate::plan::strip_wrappers;
use crate::source::{Checkpoint, TensorSource};

/// One adapted weight: how its content is computed.
#[derive(Clone, Debug)]
pub struct Fuse {
    /// The weight's base name (`model.layers.0.self_attn.q_proj.weight`).
    pub target: String,
    /// The module, as peft and the config name it.
    pub module: String,
    /// Whether the factors are an embedding's (`lora_embedding_A/B`).
    pub embedding: bool,
    /// The module stores `[in, out]` (GPT-2 `Conv1D`): the config's flag, or the
    /// layer's class once the base's model type is known
    /// ([`Resolved::use_layer_classes`]).
    pub fan_in_fan_out: bool,
    /// Whether `fan_in_fan_out` comes from the layer's class (then it is the only
    /// layout the factors may take) rather than the config.
    pub class_known: bool,
    /// lora_A (or lora_embedding_A).
    pub a: TensorSource,
    /// lora_B (or lora_embedding_B).
    pub b: TensorSource,
    /// DoRA's magnitude, one per output channel.
    pub magnitude: Option<TensorSource>,
    /// `r` for this module (rank_pattern applied).
    pub rank: u64,
    /// `alpha / r` (or `alpha / sqrt(r)` with rsLoRA), as peft computes it.
    pub scale: f64,
}

impl Fuse {
    /// The layout of the update over a stored weight of `shape`, or an error naming
    /// the weight when the factors cannot fit it. peft decides `fan_in_fan_out` from
    /// the layer's class (it corrects the flag for `nn.Linear` and `Conv1D`, and
    /// writes the last correction into the config); where the class is known it is
    /// followed, else a weight that fits one orientation alone takes it, and a
    /// square one follows the config.
    pub fn layout_for(&self, shape: &[u64]) -> Result<Layout> {
        let bad = |why: String| crate::error::Error::Adapter {
            msg: format!(
                "adapter weights of '{}' do not fit '{}' {shape:?}: {why}",
                self.module, self.target
            ),
            remedy: AdapterRemedy::CheckBase,
        };
        let [rows, cols] = shape else {
            return Err(bad("LoRA can only be fused into a 2-D weight".into()));
        };
        let (a, b) = (&self.a.shape, &self.b.shape);
        let fits = |layout: Layout| {
            let (sa, sb) = layout.factor_shapes(*rows, *cols, self.rank);
            a.as_slice() == sa && b.as_slice() == sb
        };
        let candidates: &[Layout] = if self.embedding {
            &[Layout::Embedding]
        } else if self.class_known {
            if self.fan_in_fan_out {
                &[Layout::FanInFanOut]
            } else {
                &[Layout::Linear]
            }
        } else if self.fan_in_fan_out {
            &[Layout::FanInFanOut, Layout::Linear]
        } else {
            &[Layout::Linear, Layout::FanInFanOut]
        };
        match candidates.iter().copied().find(|&l| fits(l)) {
            Some(l) => {
                if let Some(m) = &self.magnitude {
                    let want = l.out_channels(*rows, *cols);
                    if m.shape != [want] {
                        return Err(bad(format!(
                            "DoRA magnitude has shape {:?}, expected [{want}]",
                            m.shape
                        )));
                    }
                }
                Ok(l)
            }
            None => Err(bad(format!(
                "lora_A is {a:?} and lora_B is {b:?} (rank {})",
                self.rank
            ))),
        }
    }
}

/// An adapter made ready to merge.
#[derive(Debug)]
pub struct Resolved {
    /// The adapter's name (`default`, or the one chosen).
    pub adapter: String,
    /// The config it was resolved with.
    pub config: AdapterConfig,
    /// Tensors under base names that replace (or, for a training checkpoint, give)
    /// the base's values.
    pub tensors: Vec<TensorSource>,
    /// The input's name of each of `tensors` -> its base name. Every other tensor
    /// of the input (factors, other adapters', a saved module's frozen original) is
    /// not written as it is.
    pub kept: HashMap<String, String>,
    /// One per adapted weight.
    pub fuses: Vec<Fuse>,
    /// What was left out and why (other adapters' tensors).
    pub notes: Vec<String>,
}

impl Resolved {
    /// Whether a tensor (by base name) belongs to the adapter rather than the base:
    /// the tensors of a module in `modules_to_save`.
    pub fn owns(&self, name: &str) -> bool {
        let module = name.rsplit_once('.').map_or(name, |(m, _)| m);
        self.config.saves(module)
    }

    /// Sets each adapted weight's orientation from its layer's class in the base's
    /// architecture (`model_type`), as peft does when it wraps the layer: `Conv1D`
    /// (weights `[in, out]`) for the modules of [`CONV1D_MODULES`], `nn.Linear` for
    /// every other one of those models. The config's `fan_in_fan_out` cannot be
    /// trusted there: peft overwrites it for each layer it wraps, so an adapter on
    /// both kinds keeps the value of the last one. Other model types are left to
    /// the shapes and the config.
    pub fn use_layer_classes(&mut self, model_type: Option<&str>) {
        let Some(conv) = model_type.and_then(|mt| {
            CONV1D_MODULES
                .iter()
                .find(|(t, _)| *t == mt)
                .map(|(_, m)| *m)
        }) else {
            return;
        };
        for f in self.fuses.iter_mut().filter(|f| !f.embedding) {
            let leaf = f.module.rsplit('.').next().unwrap_or(&f.module);
            f.fan_in_fan_out = conv.contains(&leaf);
            f.class_known = true;
        }
    }
}

/// The model types of transformers whose layers include `Conv1D` (weights stored
/// `[in, out]`), and the module names that are one; their other 2-D layers are
/// `nn.Linear`.
pub const CONV1D_MODULES: &[(&str, &[&str])] = &[
    ("gpt2", &["c_attn", "q_attn", "c_proj", "c_fc"]),
    (
        "decision_transformer",
        &["c_attn", "q_attn", "c_proj", "c_fc"],
    ),
    ("imagegpt", &["c_attn", "q_attn", "c_proj", "c_fc"]),
    ("openai-gpt", &["c_attn", "c_proj", "c_fc"]),
    // The decoder's MLP only; its attention is nn.Linear.
    ("clvp", &["c_fc", "c_proj"]),
];

#[derive(Default)]
struct Factors {
    a: Option<TensorSource>,
    b: Option<TensorSource>,
    magnitude: Option<TensorSource>,
    embedding: bool,
}

/// Resolves the tensors of `ckpt` (an adapter file or a training checkpoint) with
/// `config`. `implied` is the adapter's name when the names carry none (an adapter
/// directory); `wanted` is `--adapter`.
pub fn resolve(
    ckpt: &Checkpoint,
    config: AdapterConfig,
    implied: Option<&str>,
    wanted: Option<&str>,
) -> Result<Resolved> {
    let path = ckpt.path.as_path();
    let mut classified = Vec::with_capacity(ckpt.tensors.len());
    let mut adapters = BTreeSet::new();
    for t in &ckpt.tensors {
        let stripped = strip_wrappers(&t.name);
        let kind = names::classify(names::strip_peft_prefix(&stripped));
        match &kind {
            PeftName::Unsupported { what } => {
                return Err(adapter_error(
                    path,
                    format!(
                        "tensor '{}' is {what}; unshard cannot fuse it, and nothing was written",
                        t.name
                    ),
                    "merge this adapter with peft's merge_and_unload",
                ))
            }
            PeftName::SavedCopy { adapter, .. } => {
                adapters.insert(adapter.clone());
            }
            PeftName::LoraA(a)
            | PeftName::LoraB(a)
            | PeftName::Magnitude(a)
            | PeftName::EmbeddingA(a)
            | PeftName::EmbeddingB(a) => {
                adapters.extend(a.adapter.clone());
            }
            PeftName::Base(_) => {}
        }
        classified.push((t, kind));
    }
    let adapter = choose(path, &adapters, implied, wanted)?;
    let mine = |a: &Adapted| a.adapter.as_deref().is_none_or(|n| n == adapter);

    let mut factors: BTreeMap<String, Factors> = BTreeMap::new();
    // Base name -> (the input's name, the tensor under its base name).
    let mut base: BTreeMap<String, (String, TensorSource)> = BTreeMap::new();
    let mut saved: BTreeMap<String, (String, TensorSource)> = BTreeMap::new();
    let mut skipped = 0usize;
    for (t, kind) in classified {
        let renamed = |name: &str| {
            let t2 = TensorSource {
                name: name.to_string(),
                ..t.clone()
            };
            (t.name.clone(), t2)
        };
        match kind {
            PeftName::Base(name) => {
                base.insert(name.clone(), renamed(&name));
            }
            PeftName::SavedCopy { name, adapter: a } => {
                if a == adapter {
                    saved.insert(name.clone(), renamed(&name));
                } else {
                    skipped += 1;
                }
            }
            PeftName::LoraA(a) | PeftName::EmbeddingA(a) if !mine(&a) => skipped += 1,
            PeftName::LoraB(a) | PeftName::EmbeddingB(a) | PeftName::Magnitude(a) if !mine(&a) => {
                skipped += 1
            }
            PeftName::LoraA(a) => put(path, &mut factors, &a.module, "lora_A", t, |f| &mut f.a)?,
            PeftName::LoraB(a) => put(path, &mut factors, &a.module, "lora_B", t, |f| &mut f.b)?,
            PeftName::EmbeddingA(a) => {
                put(path, &mut factors, &a.module, "lora_embedding_A", t, |f| {
                    &mut f.a
                })?;
                factors.entry(a.module).or_default().embedding = true;
            }
            PeftName::EmbeddingB(a) => {
                put(path, &mut factors, &a.module, "lora_embedding_B", t, |f| {
                    &mut f.b
                })?;
                factors.entry(a.module).or_default().embedding = true;
            }
            PeftName::Magnitude(a) => put(
                path,
                &mut factors,
                &a.module,
                "lora_magnitude_vector",
                t,
                |f| &mut f.magnitude,
            )?,
            PeftName::Unsupported { .. } => {}
        }
    }
    if factors.is_empty() && saved.is_empty() {
        return Err(adapter_error(
            path,
            format!("no LoRA weights of adapter '{adapter}' found (lora_A / lora_B)"),
            "pass the adapter directory or the checkpoint of the peft-wrapped model",
        ));
    }
    let mut fuses = Vec::with_capacity(factors.len());
    for (module, f) in factors {
        fuses.push(fuse_of(path, &config, module, f)?);
    }
    // A saved module's trained copy replaces the frozen original.
    for (name, t) in saved {
        base.insert(name, t);
    }
    let mut notes = Vec::new();
    if skipped > 0 {
        notes.push(format!(
            "{skipped} tensor(s) of other adapters left out (adapter '{adapter}' fused)"
        ));
    }
    let kept = base
        .iter()
        .map(|(name, (orig, _))| (orig.clone(), name.clone()))
        .collect();
    Ok(Resolved {
        adapter,
        config,
        kept,
        tensors: base.into_values().map(|(_, t)| t).collect(),
        fuses,
        notes,
    })
}

fn put(
    path: &Path,
    factors: &mut BTreeMap<String, Factors>,
    module: &str,
    what: &str,
    t: &TensorSource,
    field: impl Fn(&mut Factors) -> &mut Option<TensorSource>,
) -> Result<()> {
    let slot = field(factors.entry(module.to_string()).or_default());
    if slot.is_some() {
        return Err(adapter_error(
            path,
            format!(
                "module '{module}' has two {what} tensors (the second is '{}')",
                t.name
            ),
            "the checkpoint mixes two adapters' names; check what wrote it",
        ));
    }
    *slot = Some(t.clone());
    Ok(())
}

fn choose(
    path: &Path,
    found: &BTreeSet<String>,
    implied: Option<&str>,
    wanted: Option<&str>,
) -> Result<String> {
    let list = || found.iter().cloned().collect::<Vec<_>>().join(", ");
    match (wanted, implied) {
        (Some(w), _) if found.is_empty() || found.contains(w) => Ok(w.to_string()),
        (Some(w), _) => Err(remedy_error(
            path,
            format!("no adapter named '{w}' (adapters here: {})", list()),
            AdapterRemedy::PickListed,
        )),
        (None, _) if found.len() > 1 => Err(remedy_error(
            path,
            format!("holds several adapters: {}", list()),
            AdapterRemedy::NameOne,
        )),
        (None, _) if found.len() == 1 => Ok(found.iter().next().cloned().unwrap_or_default()),
        (None, Some(i)) => Ok(i.to_string()),
        (None, None) => Ok(super::locate::DEFAULT_ADAPTER.to_string()),
    }
}

fn fuse_of(path: &Path, config: &AdapterConfig, module: String, f: Factors) -> Result<Fuse> {
    let err =
        |msg: String, hint: &str| adapter_error(path, format!("module '{module}': {msg}"), hint);
    let (a, b) = match (f.a, f.b) {
        (Some(a), Some(b)) => (a, b),
        (a, _) => {
            let missing = if a.is_some() { "lora_B" } else { "lora_A" };
            return Err(err(
                format!("{missing} is missing"),
                "the adapter is incomplete; save it again with peft's save_pretrained",
            ));
        }
    };
    if !config.targets(&module) {
        return Err(err(
            format!(
                "has LoRA weights, but target_modules in {} does not select it (peft would ignore them)",
                config.path.display()
            ),
            "pass the adapter_config.json this adapter was trained with",
        ));
    }
    if a.shape.len() != 2 || b.shape.len() != 2 {
        return Err(err(
            format!(
                "lora_A is {:?} and lora_B is {:?}: LoRA on a convolution or another layer than a linear or an embedding cannot be fused by unshard",
                a.shape, b.shape
            ),
            "merge this adapter with peft's merge_and_unload",
        ));
    }
    let rank = config.rank_for(&module);
    let a_rank = a.shape.first().copied();
    let b_rank = b.shape.get(1).copied();
    if a.shape.len() != 2 || b.shape.len() != 2 || a_rank != Some(rank) || b_rank != Some(rank) {
        return Err(err(
            format!(
                "the config gives rank {rank}, but lora_A is {:?} and lora_B is {:?}",
                a.shape, b.shape
            ),
            "pass the adapter_config.json this adapter was trained with (r, rank_pattern)",
        ));
    }
    match (config.use_dora, &f.magnitude) {
        (true, None) => {
            return Err(err(
                "use_dora is set but there is no lora_magnitude_vector".into(),
                "pass the adapter_config.json this adapter was trained with",
            ))
        }
        (false, Some(_)) => {
            return Err(err(
                "has a DoRA lora_magnitude_vector, but use_dora is not set in the config".into(),
                "pass the adapter_config.json this adapter was trained with",
            ))
        }
        (true, Some(_)) if f.embedding => {
            return Err(err(
                "DoRA on an embedding cannot be fused by unshard".into(),
                "merge this adapter with peft's merge_and_unload",
            ))
        }
        _ => {}
    }
    Ok(Fuse {
        target: format!("{module}.weight"),
        scale: config.scale_for(&module),
        embedding: f.embedding,
        fan_in_fan_out: config.fan_in_fan_out,
        class_known: false,
        magnitude: f.magnitude,
        module,
        a,
        b,
        rank,
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use serde_json::{json, Value};

    use super::*;
    use crate::dtype::DType;
    use crate::lora::config::from_layers;
    use crate::plan::testing::{checkpoint, tensor};

    /// A config of rank 2 with `extra`.
    fn config(extra: Value) -> AdapterConfig {
        from_layers(&[json!({"r": 2, "lora_alpha": 4}), extra]).unwrap()
    }

    /// A fuse of rank 2 whose layout comes from the layer's class: `nn.Linear`.
    fn linear(a: &[u64], b: &[u64]) -> Fuse {
        Fuse {
            target: "m.weight".into(),
            module: "m".into(),
            embedding: false,
            fan_in_fan_out: false,
            class_known: true,
            a: tensor("m.lora_A.weight", DType::F32, a),
            b: tensor("m.lora_B.weight", DType::F32, b),
            magnitude: None,
            rank: 2,
            scale: 1.0,
        }
    }

    #[test]
    fn both_factors_must_fit_the_weight() {
        // W [out 4, in 6], rank 2: A [2, 6], B [4, 2].
        assert_eq!(
            linear(&[2, 6], &[4, 2]).layout_for(&[4, 6]).unwrap(),
            Layout::Linear
        );
        let e = linear(&[2, 6], &[5, 2]).layout_for(&[4, 6]).unwrap_err();
        assert!(e.to_string().contains("lora_B is [5, 2]"), "{e}");
        let e = linear(&[2, 7], &[4, 2]).layout_for(&[4, 6]).unwrap_err();
        assert!(e.to_string().contains("lora_A is [2, 7]"), "{e}");
    }

    /// A training checkpoint of a wrapped model: the frozen base under
    /// `base_layer`, one module saved whole, and a second adapter's factors.
    fn wrapped() -> Checkpoint {
        let p = "base_model.model.";
        let q = "model.layers.0.self_attn.q_proj";
        checkpoint(
            "policy.pt",
            vec![
                tensor(&format!("{p}{q}.base_layer.weight"), DType::F32, &[4, 6]),
                tensor(
                    &format!("{p}{q}.lora_A.default.weight"),
                    DType::F32,
                    &[2, 6],
                ),
                tensor(
                    &format!("{p}{q}.lora_B.default.weight"),
                    DType::F32,
                    &[4, 2],
                ),
                tensor(&format!("{p}{q}.lora_A.other.weight"), DType::F32, &[2, 6]),
                tensor(&format!("{p}{q}.lora_B.other.weight"), DType::F32, &[4, 2]),
                tensor(
                    &format!("{p}lm_head.original_module.weight"),
                    DType::F32,
                    &[10, 6],
                ),
                tensor(
                    &format!("{p}lm_head.modules_to_save.default.weight"),
                    DType::F32,
                    &[10, 6],
                ),
                tensor(
                    &format!("{p}lm_head.modules_to_save.other.weight"),
                    DType::F32,
                    &[10, 6],
                ),
            ],
        )
    }

    #[test]
    fn a_wrapped_model_gives_its_tensors_under_base_names() {
        let c = config(json!({"target_modules": ["q_proj"], "modules_to_save": ["lm_head"]}));
        let r = resolve(&wrapped(), c, None, Some("default")).unwrap();
        let q = "model.layers.0.self_attn.q_proj";
        let names: Vec<&str> = r.tensors.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(names, ["lm_head.weight", &format!("{q}.weight")]);
        assert_eq!(
            r.kept["base_model.model.lm_head.modules_to_save.default.weight"],
            "lm_head.weight"
        );
        assert_eq!(r.fuses.len(), 1);
        assert_eq!(r.fuses[0].target, format!("{q}.weight"));
        // The saved module's tensors are the adapter's; the frozen weight is the base's.
        assert!(r.owns("lm_head.weight"));
        assert!(!r.owns(&format!("{q}.weight")));
        assert_eq!(
            r.notes,
            ["3 tensor(s) of other adapters left out (adapter 'default' fused)"]
        );
    }

    #[test]
    fn an_adapter_name_that_is_not_there_is_refused() {
        let c = config(json!({"target_modules": ["q_proj"], "modules_to_save": ["lm_head"]}));
        let e = resolve(&wrapped(), c, None, Some("third")).unwrap_err();
        assert!(
            e.to_string()
                .contains("no adapter named 'third' (adapters here: default, other)"),
            "{e}"
        );
    }

    /// An adapter file of one module, `q` (`[4, 6]`), with these factors and, if
    /// asked, a DoRA magnitude.
    fn one_module(a: &[u64], b: &[u64], magnitude: bool) -> Checkpoint {
        let mut t = vec![
            tensor("base_model.model.q.lora_A.weight", DType::F32, a),
            tensor("base_model.model.q.lora_B.weight", DType::F32, b),
        ];
        if magnitude {
            t.push(tensor(
                "base_model.model.q.lora_magnitude_vector",
                DType::F32,
                &[4],
            ));
        }
        checkpoint("adapter_model.safetensors", t)
    }

    /// [`config`] on `q` and `emb`, with `extra`.
    fn on_q(extra: Value) -> AdapterConfig {
        let on = json!({"target_modules": ["q", "emb"]});
        from_layers(&[json!({"r": 2, "lora_alpha": 4}), on, extra]).unwrap()
    }

    fn refusal(ckpt: &Checkpoint, extra: Value) -> String {
        resolve(ckpt, on_q(extra), Some("default"), None)
            .unwrap_err()
            .to_string()
    }

    #[test]
    fn factors_that_disagree_with_the_config_are_refused() {
        let fine = one_module(&[2, 6], &[4, 2], false);
        assert!(resolve(&fine, on_q(json!({})), Some("default"), None).is_ok());
        for (a, b) in [([3, 6], [4, 2]), ([2, 6], [4, 3])] {
            let e = refusal(&one_module(&a, &b, false), json!({}));
            assert!(e.contains("the config gives rank 2"), "{e}");
        }
        let e = refusal(&one_module(&[2, 6, 1, 1], &[4, 2], false), json!({}));
        assert!(e.contains("LoRA on a convolution"), "{e}");
        let e = refusal(&fine, json!({"use_dora": true}));
        assert!(
            e.contains("use_dora is set but there is no lora_magnitude_vector"),
            "{e}"
        );
        let dora = one_module(&[2, 6], &[4, 2], true);
        assert!(resolve(&dora, on_q(json!({"use_dora": true})), None, None).is_ok());
        let e = refusal(&dora, json!({}));
        assert!(e.contains("use_dora is not set"), "{e}");
        let dora_embedding = checkpoint(
            "adapter_model.safetensors",
            vec![
                tensor(
                    "base_model.model.emb.lora_embedding_A",
                    DType::F32,
                    &[2, 10],
                ),
                tensor("base_model.model.emb.lora_embedding_B", DType::F32, &[6, 2]),
                tensor(
                    "base_model.model.emb.lora_magnitude_vector",
                    DType::F32,
                    &[6],
                ),
            ],
        );
        let e = refusal(&dora_embedding, json!({"use_dora": true}));
        assert!(e.contains("DoRA on an embedding cannot be fused"), "{e}");
    }

    #[test]
    fn the_adapter_is_the_one_named_the_only_one_or_the_implied_one() {
        let c = || config(json!({"target_modules": ["q_proj"], "modules_to_save": ["lm_head"]}));
        let e = resolve(&wrapped(), c(), None, None).unwrap_err();
        assert!(
            e.to_string()
                .contains("holds several adapters: default, other"),
            "{e}"
        );
        // Names without an adapter's (an adapter file): the directory's, else peft's default.
        let file = one_module(&[2, 6], &[4, 2], false);
        let adapter = |implied| {
            resolve(&file, on_q(json!({})), implied, None)
                .unwrap()
                .adapter
        };
        assert_eq!(adapter(Some("second")), "second");
        assert_eq!(adapter(None), "default");
        // One adapter in the names: that one.
        let only_other = checkpoint(
            "policy.pt",
            vec![
                tensor(
                    "base_model.model.q.lora_A.other.weight",
                    DType::F32,
                    &[2, 6],
                ),
                tensor(
                    "base_model.model.q.lora_B.other.weight",
                    DType::F32,
                    &[4, 2],
                ),
            ],
        );
        let r = resolve(&only_other, on_q(json!({})), None, None).unwrap();
        assert_eq!((r.adapter.as_str(), r.fuses.len()), ("other", 1));
        // Nothing was left out: no note says so.
        assert!(r.notes.is_empty(), "{:?}", r.notes);
    }

    /// An adapter on GPT-2's `c_attn` (a `Conv1D`), on a module of another class
    /// and on the token embedding, with the config's `fan_in_fan_out` as given.
    fn on_three_layers(fan_in_fan_out: bool) -> Resolved {
        let c = config(json!({
            "target_modules": ["c_attn", "score", "wte"],
            "fan_in_fan_out": fan_in_fan_out,
        }));
        let ckpt = checkpoint(
            "adapter_model.safetensors",
            vec![
                tensor(
                    "transformer.h.0.attn.c_attn.lora_A.weight",
                    DType::F32,
                    &[2, 6],
                ),
                tensor(
                    "transformer.h.0.attn.c_attn.lora_B.weight",
                    DType::F32,
                    &[18, 2],
                ),
                tensor("score.lora_A.weight", DType::F32, &[2, 6]),
                tensor("score.lora_B.weight", DType::F32, &[3, 2]),
                tensor("transformer.wte.lora_embedding_A", DType::F32, &[2, 10]),
                tensor("transformer.wte.lora_embedding_B", DType::F32, &[6, 2]),
            ],
        );
        resolve(&ckpt, c, Some("default"), None).unwrap()
    }

    /// `(module, fan_in_fan_out, class_known)` of each fuse.
    fn orientations(r: &Resolved) -> Vec<(&str, bool, bool)> {
        r.fuses
            .iter()
            .map(|f| (f.module.as_str(), f.fan_in_fan_out, f.class_known))
            .collect()
    }

    #[test]
    fn the_layer_class_of_a_known_model_type_overrides_the_config() {
        let mut r = on_three_layers(false);
        r.use_layer_classes(Some("gpt2"));
        assert_eq!(
            orientations(&r),
            [
                ("score", false, true),
                ("transformer.h.0.attn.c_attn", true, true),
                // An embedding has one layout: its flags are left alone.
                ("transformer.wte", false, false),
            ]
        );
        let mut r = on_three_layers(true);
        r.use_layer_classes(Some("gpt2"));
        assert_eq!(orientations(&r)[0], ("score", false, true));
    }

    #[test]
    fn other_model_types_keep_the_config_flag() {
        for model_type in [Some("llama"), None] {
            let mut r = on_three_layers(true);
            r.use_layer_classes(model_type);
            assert_eq!(
                orientations(&r),
                [
                    ("score", true, false),
                    ("transformer.h.0.attn.c_attn", true, false),
                    ("transformer.wte", true, false),
                ],
                "{model_type:?}"
            );
        }
    }
}
