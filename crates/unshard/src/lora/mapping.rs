//! The `LoraFuse` mapping: the adapter input's candidates become base-model
//! tensors, and every adapted weight a computed [`Expr::Fuse`].
//!
//! The adapter (an adapter file, or the training checkpoint) is the merge's
//! checkpoint, so its factors are `Origin::Checkpoint` leaves. The weight an update
//! is fused into is the checkpoint's own frozen copy when it has one (a training
//! checkpoint: `<module>.base_layer.weight`), else the base's (`Origin::Base`).
//! The fused candidate takes the weight's name, so the overlay writes it in place
//! of the base's; every other base tensor is copied as it is.

use std::collections::HashSet;

use super::resolve::Resolved;
use super::AdapterRemedy;
use crate::error::{Error, Result};
use crate::plan::{Candidate, Content, Expr, MapInputs, Mapping, Origin};

/// See the module documentation.
#[derive(Debug)]
pub struct LoraFuse {
    resolved: Resolved,
    /// `--no-fuse`: base tensors only; the adapter is written beside them.
    no_fuse: bool,
}

impl LoraFuse {
    /// The mapping of `resolved`; with `no_fuse`, base tensors only.
    pub fn new(resolved: Resolved, no_fuse: bool) -> LoraFuse {
        LoraFuse { resolved, no_fuse }
    }

    /// The resolved adapter.
    pub fn resolved(&self) -> &Resolved {
        &self.resolved
    }

    /// Whether the adapter is kept apart (`--no-fuse`).
    pub fn no_fuse(&self) -> bool {
        self.no_fuse
    }
}

impl Mapping for LoraFuse {
    fn map(&self, candidates: Vec<Candidate>, inputs: MapInputs<'_>) -> Result<Vec<Candidate>> {
        let r = &self.resolved;
        let mut out = Vec::with_capacity(candidates.len());
        for mut c in candidates {
            let Some(name) = r.kept.get(&c.source_name) else {
                continue;
            };
            // Without fusing, a saved module's trained copy belongs to the adapter.
            if self.no_fuse && r.owns(name) {
                continue;
            }
            c.name = name.clone();
            out.push(c);
        }
        if self.no_fuse {
            return Ok(out);
        }
        let fused: HashSet<&str> = r.fuses.iter().map(|f| f.target.as_str()).collect();
        if let Some(c) = out
            .iter()
            .find(|c| fused.contains(c.name.as_str()) && r.owns(&c.name))
        {
            return Err(Error::plan(
                format!("'{}' is both a saved module and a LoRA target", c.name),
                Some("peft never writes both; check the adapter's modules_to_save".into()),
            ));
        }
        for f in &r.fuses {
            let at = out.iter().position(|c| c.name == f.target);
            let base = match at {
                Some(i) => match &out[i].content {
                    Content::Copy(t) => Expr::leaf(out[i].origin, t.clone()),
                    Content::Computed(e) => e.clone(),
                },
                None => {
                    if inputs.base.is_none() {
                        return Err(Error::Adapter {
                            msg: format!(
                                "the adapter changes '{}' and {} other weight(s), and there is no base model to fuse it into",
                                f.target,
                                r.fuses.len() - 1
                            ),
                            remedy: AdapterRemedy::NoBase,
                        });
                    }
                    let t = inputs
                        .base
                        .and_then(|b| b.tensors.iter().find(|t| t.name == f.target))
                        .ok_or_else(|| {
                            Error::Adapter {
                                msg: format!(
                                    "the adapter changes '{}', but neither it nor the base model has that weight",
                                    f.target
                                ),
                                remedy: AdapterRemedy::BaseLacksWeight,
                            }
                        })?;
                    Expr::leaf(Origin::Base, t.clone())
                }
            };
            let shape = base.shape(&f.target)?;
            // Reports quote the tensor the weight came from: the checkpoint's frozen
            // copy (a rename), or the base's (none).
            let source_name = at.map_or_else(|| f.target.clone(), |i| out[i].source_name.clone());
            let expr = Expr::Fuse {
                layout: f.layout_for(&shape)?,
                base: Box::new(base),
                a: Box::new(Expr::leaf(Origin::Checkpoint, f.a.clone())),
                b: Box::new(Expr::leaf(Origin::Checkpoint, f.b.clone())),
                magnitude: f
                    .magnitude
                    .as_ref()
                    .map(|m| Box::new(Expr::leaf(Origin::Checkpoint, m.clone()))),
                scale: f.scale,
            };
            let mut cand =
                Candidate::computed(f.target.clone(), source_name, Origin::Checkpoint, expr)?;
            match at {
                Some(i) => {
                    // A tied embedding is still tied once fused: keep what it views.
                    cand.storage = out[i].storage.take();
                    out[i] = cand;
                }
                None => out.push(cand),
            }
        }
        Ok(out)
    }
}
