//! Step 3 of planning: the checkpoint's tensors over the base's tensor set. With a
//! base, every kept checkpoint tensor must be one of the base's, with its shape;
//! base tensors the checkpoint lacks are copied from the base (or refused with
//! `strict`). Without a base, the checkpoint's tensors are the output.

use std::collections::{HashMap, HashSet};

use super::{Candidate, Origin, PlannedTensor, Report};
use crate::error::ShapeDiff;
use crate::error::{Error, Result};
use crate::source::{Checkpoint, TensorSource};

/// The tensors to write, before dtype policy: the kept checkpoint tensors under
/// their output names, then the base tensors they do not replace.
pub(crate) fn overlay(
    cands: Vec<Candidate>,
    names: &[String],
    keep: &[bool],
    base: Option<(&Checkpoint, &HashMap<&str, &TensorSource>)>,
    strict: bool,
    report: &mut Report,
) -> Result<Vec<PlannedTensor>> {
    if let Some((bw, bmap)) = base {
        check_against_base(&cands, names, keep, bw, bmap)?;
    }
    // Sized exactly: one entry per output tensor, tens of thousands for a large
    // mixture of experts, and a vector grown by doubling holds up to twice that.
    let mut tensors: Vec<PlannedTensor> = Vec::with_capacity(keep.iter().filter(|k| **k).count());
    tensors.extend(
        cands
            .into_iter()
            .zip(names)
            .zip(keep)
            .filter(|(_, k)| **k)
            .map(|((c, n), _)| PlannedTensor {
                name: n.clone(),
                ..PlannedTensor::from_candidate(c)
            }),
    );
    if let Some((bw, _)) = base {
        let have: HashSet<&str> = names.iter().map(String::as_str).collect();
        let missing: Vec<&TensorSource> = bw
            .tensors
            .iter()
            .filter(|b| !have.contains(b.name.as_str()))
            .collect();
        tensors.reserve_exact(missing.len());
        for b in missing {
            report.from_base.push(b.name.clone());
            tensors.push(PlannedTensor::from_candidate(Candidate::copy(
                Origin::Base,
                b,
            )));
        }
        if strict && !report.from_base.is_empty() {
            return Err(Error::Strict {
                missing: report.from_base.clone(),
            });
        }
    }
    if tensors.is_empty() {
        return Err(Error::plan(
            "nothing to write: no tensors left after dropping buffers",
            None,
        ));
    }
    Ok(tensors)
}

/// Every kept checkpoint tensor is in the base with the same shape; the error
/// lists the ones that are not, with the base's closest names as a hint.
fn check_against_base(
    cands: &[Candidate],
    names: &[String],
    keep: &[bool],
    bw: &Checkpoint,
    bmap: &HashMap<&str, &TensorSource>,
) -> Result<()> {
    let mut unknown = Vec::new();
    let mut mismatched = Vec::new();
    for (i, n) in names.iter().enumerate() {
        if !keep[i] {
            continue;
        }
        match bmap.get(n.as_str()) {
            None => unknown.push(n.clone()),
            Some(b) if b.shape != cands[i].shape => mismatched.push(ShapeDiff {
                name: n.clone(),
                checkpoint: cands[i].shape.clone(),
                base: b.shape.clone(),
            }),
            Some(_) => {}
        }
    }
    if !unknown.is_empty() {
        let similar: Vec<String> = unknown
            .iter()
            .take(3)
            .filter_map(|u| closest(u, bw.tensors.iter().map(|t| t.name.as_str())))
            .collect();
        return Err(Error::UnknownTensors {
            names: unknown,
            base: bw.path.clone(),
            similar,
        });
    }
    if !mismatched.is_empty() {
        return Err(Error::ShapeMismatch {
            tensors: mismatched,
        });
    }
    Ok(())
}

/// The base name closest to `name` by shared trailing components.
fn closest<'a>(name: &str, base: impl Iterator<Item = &'a str>) -> Option<String> {
    let tail: Vec<&str> = name.rsplit('.').collect();
    let mut best: Option<(&str, usize)> = None;
    for b in base {
        let common = b
            .rsplit('.')
            .zip(&tail)
            .take_while(|(x, y)| x == *y)
            .count();
        if common >= 2 && best.is_none_or(|(_, c)| common > c) {
            best = Some((b, common));
        }
    }
    best.map(|(b, _)| b.to_string())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::error::Error;
    use crate::plan::mapping::candidates;
    use crate::plan::testing::{checkpoint, f32s};

    fn run(
        ckpt: &Checkpoint,
        base: Option<&Checkpoint>,
        strict: bool,
    ) -> (Result<Vec<PlannedTensor>>, Report) {
        let names: Vec<String> = ckpt.tensors.iter().map(|t| t.name.clone()).collect();
        let keep = vec![true; names.len()];
        let map: Option<HashMap<&str, &TensorSource>> =
            base.map(|b| b.tensors.iter().map(|t| (t.name.as_str(), t)).collect());
        let mut report = Report::default();
        let r = overlay(
            candidates(ckpt),
            &names,
            &keep,
            base.zip(map.as_ref()),
            strict,
            &mut report,
        );
        (r, report)
    }

    #[test]
    fn base_tensors_the_checkpoint_lacks_come_from_the_base() {
        let ckpt = checkpoint("c", f32s(&[("a", &[2])]));
        let base = checkpoint("b", f32s(&[("a", &[2]), ("b", &[3])]));
        let (r, report) = run(&ckpt, Some(&base), false);
        let t = r.unwrap();
        let got: Vec<(&str, Origin)> = t.iter().map(|t| (t.name.as_str(), t.origin)).collect();
        assert_eq!(got, [("a", Origin::Checkpoint), ("b", Origin::Base)]);
        assert_eq!(report.from_base, ["b"]);
        let (r, _) = run(&ckpt, Some(&base), true);
        let e = r.unwrap_err();
        assert!(
            matches!(&e, Error::Strict { missing } if missing == &["b"]),
            "{e:?}"
        );
        let e = e.to_string();
        assert!(
            e.starts_with("strict: 1 base tensor(s)") && e.contains('b'),
            "{e}"
        );
    }

    #[test]
    fn unknown_names_and_other_shapes_are_refused_with_the_closest_base_name() {
        let base = checkpoint("b", f32s(&[("model.layers.0.mlp.w", &[2])]));
        let ckpt = checkpoint("c", f32s(&[("layers.0.mlp.w", &[2])]));
        let e = run(&ckpt, Some(&base), false).0.unwrap_err();
        assert!(
            e.to_string()
                .contains("not in the base model b: layers.0.mlp.w"),
            "{e}"
        );
        assert!(e.hint().unwrap().contains("'model.layers.0.mlp.w'"));
        match &e {
            Error::UnknownTensors { names, similar, .. } => {
                assert_eq!(names, &["layers.0.mlp.w"]);
                assert_eq!(similar, &["model.layers.0.mlp.w"]);
            }
            other => panic!("{other:?}"),
        }
        let ckpt = checkpoint("c", f32s(&[("model.layers.0.mlp.w", &[3])]));
        let e = run(&ckpt, Some(&base), false).0.unwrap_err();
        let Error::ShapeMismatch { tensors } = &e else {
            panic!("{e:?}")
        };
        assert_eq!(
            (tensors[0].checkpoint.clone(), tensors[0].base.clone()),
            (vec![3], vec![2])
        );
        assert!(e.to_string().contains("checkpoint [3], base [2]"), "{e}");
    }

    #[test]
    fn kept_tensors_are_written_under_their_output_names() {
        // The names step may have changed a name after the mappings (a prefix
        // aligned with the base): the output name is that one, not the candidate's.
        let ckpt = checkpoint("c", f32s(&[("a", &[2]), ("b", &[2]), ("c", &[2])]));
        let mut report = Report::default();
        let t = overlay(
            candidates(&ckpt),
            &["model.a".into(), "model.b".into(), "model.c".into()],
            &[true, false, true],
            None,
            false,
            &mut report,
        )
        .unwrap();
        let got: Vec<&str> = t.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(got, ["model.a", "model.c"]);
    }

    #[test]
    fn the_hint_is_the_base_name_sharing_most_trailing_components() {
        let base = checkpoint(
            "b",
            f32s(&[
                ("model.layers.1.mlp.w", &[2]),
                ("model.layers.0.mlp.w", &[2]),
                ("other.1.mlp.w", &[2]),
                ("lm_head.w", &[2]),
            ]),
        );
        let names = || base.tensors.iter().map(|t| t.name.as_str());
        // 4 trailing components shared, against 2, 2 and 1.
        assert_eq!(
            closest("layers.0.mlp.w", names()),
            Some("model.layers.0.mlp.w".to_string())
        );
        // Two shared components are a hint, one is not; of equally close names
        // the base's first is the hint, so the message is the same on every run.
        assert_eq!(
            closest("up.mlp.w", names()),
            Some("model.layers.1.mlp.w".to_string())
        );
        assert_eq!(closest("head.w", names()), None);
    }

    #[test]
    fn nothing_left_is_an_error() {
        let ckpt = checkpoint("c", f32s(&[("a", &[2])]));
        let mut report = Report::default();
        let e = overlay(
            candidates(&ckpt),
            &["a".into()],
            &[false],
            None,
            false,
            &mut report,
        )
        .unwrap_err();
        assert!(e.to_string().starts_with("nothing to write"), "{e}");
    }
}
