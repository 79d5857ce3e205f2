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
    if a_rank != Some(rank) || b_rank != Some(rank) {
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
mod tests;
