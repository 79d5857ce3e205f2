//! Step 4 of planning: output dtypes. Only floating tensors are cast: to the dtype
//! asked for, or (by default) to the base's dtype for that tensor, else the base
//! config's. The config written is the base's with only its dtype key(s) changed.

use std::collections::HashMap;

use serde_json::{Map, Value};

use super::{BaseView, DtypeChoice, PlannedTensor, Report};
use crate::dtype::DType;
use crate::error::{Error, Result};

/// Sets each floating tensor's output dtype; a cast the kernels cannot do is an
/// error naming the tensor.
pub(crate) fn apply_dtype_policy(
    tensors: &mut [PlannedTensor],
    base: BaseView<'_>,
    choice: DtypeChoice,
) -> Result<()> {
    let config_dtype = base.config.and_then(config_dtype_of);
    let base_dtypes: Option<HashMap<&str, DType>> = base.weights.map(|w| {
        w.tensors
            .iter()
            .map(|t| (t.name.as_str(), t.dtype))
            .collect()
    });
    for t in tensors {
        if !t.source_dtype.is_float() {
            continue;
        }
        let target = match choice {
            DtypeChoice::Fixed(d) => Some(d),
            DtypeChoice::Auto => base_dtypes
                .as_ref()
                .and_then(|m| m.get(t.name.as_str()).copied())
                .filter(|d| d.is_float())
                .or(config_dtype.map(|(_, d)| d)),
        };
        if let Some(d) = target {
            if !crate::dtype::can_convert(t.source_dtype, d) {
                return Err(Error::plan(
                    format!(
                        "tensor '{}' cannot be cast from {} to {d}",
                        t.name, t.source_dtype
                    ),
                    None,
                ));
            }
            t.dtype = d;
        }
    }
    Ok(())
}

/// The dtype the config declares for the model written: the one most floating
/// elements are written in, so that a few tensors a class keeps in float32
/// (DeepSeek-V3's router, `_keep_in_fp32_modules`) do not decide it, whichever
/// comes first.
pub(crate) fn model_dtype(tensors: &[PlannedTensor]) -> Option<DType> {
    let mut by: Vec<(DType, u64)> = Vec::new();
    for t in tensors.iter().filter(|t| t.dtype.is_float()) {
        match by.iter_mut().find(|(d, _)| *d == t.dtype) {
            Some((_, n)) => *n = n.saturating_add(t.numel()),
            None => by.push((t.dtype, t.numel())),
        }
    }
    // The first seen wins a tie.
    by.iter().rev().max_by_key(|(_, n)| *n).map(|(d, _)| *d)
}

/// The casts, as `(from, to, count)` in the order first seen.
pub(crate) fn count_casts(tensors: &[PlannedTensor]) -> Vec<(DType, DType, usize)> {
    let mut casts: Vec<(DType, DType, usize)> = Vec::new();
    for t in tensors {
        if t.source_dtype != t.dtype {
            match casts
                .iter_mut()
                .find(|c| c.0 == t.source_dtype && c.1 == t.dtype)
            {
                Some(c) => c.2 += 1,
                None => casts.push((t.source_dtype, t.dtype, 1)),
            }
        }
    }
    casts
}

/// A base whose config.json has a `quantization_config` (FP8 blocks, MXFP4, GPTQ,
/// AWQ, bitsandbytes, torchao...) is refused: its weights are stored in another
/// form than the trained ones (copying them or casting into them gives a wrong
/// model), and a config that says "quantized" over unquantized weights does not
/// load as trained either.
pub(crate) fn refuse_quantized_base(config: Option<&Map<String, Value>>) -> Result<()> {
    let Some(q) = config.and_then(|c| c.get("quantization_config")) else {
        return Ok(());
    };
    let method = q
        .get("quant_method")
        .and_then(Value::as_str)
        .unwrap_or("unknown");
    Err(Error::plan(
        format!(
            "the base is quantized (config.json has a quantization_config, quant_method '{method}'): a trained checkpoint holds unquantized weights, and writing them into a quantized model's layout would not give the model that was trained"
        ),
        Some(
            "pass the unquantized base the run started from (the bfloat16 or float16 release of the model, not a -FP8, -bnb-4bit, -GPTQ, -AWQ or MXFP4 repository); quantize the merged model afterwards if you serve it quantized"
                .into(),
        ),
    ))
}

/// The config to write: the base's, with the dtype key(s) set to `dtype`. Without
/// a config, a warning that transformers cannot load the output as is.
pub(crate) fn output_config(
    config: Option<&Map<String, Value>>,
    dtype: Option<DType>,
    base_given: bool,
    report: &mut Report,
) -> Option<Map<String, Value>> {
    let config = config.map(|c| {
        let mut c = c.clone();
        if let Some(d) = dtype {
            set_dtype(&mut c, d, true);
        }
        c
    });
    if config.is_none() {
        // Never "no --base given" when one was: a base of weights only says so.
        report.warnings.push(if base_given {
            "the base has no config.json: the output has weights only and transformers cannot load it as is".into()
        } else {
            "no config.json (no base given): the output has weights only and transformers cannot load it as is".into()
        });
    }
    config
}

/// The dtype a config declares and the key it uses.
pub fn config_dtype_of(c: &Map<String, Value>) -> Option<(&'static str, DType)> {
    for key in ["dtype", "torch_dtype"] {
        if let Some(d) = c
            .get(key)
            .and_then(Value::as_str)
            .and_then(DType::from_torch_name)
        {
            return Some((key, d));
        }
    }
    None
}

/// Sets the dtype key(s) the config already uses (in nested sub-configs too);
/// at the top level, adds `dtype` if it has neither.
fn set_dtype(c: &mut Map<String, Value>, d: DType, top: bool) {
    let mut had = false;
    for key in ["dtype", "torch_dtype"] {
        if let Some(v) = c.get_mut(key) {
            if v.is_string() || v.is_null() {
                *v = Value::String(d.torch_name().into());
                had = true;
            }
        }
    }
    if top && !had {
        c.insert("dtype".into(), Value::String(d.torch_name().into()));
    }
    for (_, v) in c.iter_mut() {
        if let Value::Object(sub) = v {
            if sub.contains_key("dtype") || sub.contains_key("torch_dtype") {
                set_dtype(sub, d, false);
            }
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::plan::testing::{checkpoint, tensor};
    use crate::plan::{Candidate, Origin};

    fn planned(name: &str, dtype: DType) -> PlannedTensor {
        PlannedTensor::from_candidate(Candidate::copy(
            Origin::Checkpoint,
            &tensor(name, dtype, &[2]),
        ))
    }

    #[test]
    fn auto_takes_the_base_tensors_dtype_then_the_configs_and_leaves_integers() {
        let mut t = vec![
            planned("a", DType::F32),
            planned("b", DType::F32),
            planned("steps", DType::I64),
        ];
        let base = checkpoint("b", vec![tensor("a", DType::F16, &[2])]);
        let cfg: Map<String, Value> = serde_json::from_str(r#"{"dtype": "bfloat16"}"#).unwrap();
        let view = BaseView {
            config: Some(&cfg),
            weights: Some(&base),
            total_parameters: None,
        };
        apply_dtype_policy(&mut t, view, DtypeChoice::Auto).unwrap();
        let got: Vec<DType> = t.iter().map(|t| t.dtype).collect();
        assert_eq!(got, [DType::F16, DType::BF16, DType::I64]);
        assert_eq!(
            count_casts(&t),
            [(DType::F32, DType::F16, 1), (DType::F32, DType::BF16, 1)]
        );
        apply_dtype_policy(&mut t, view, DtypeChoice::Fixed(DType::F32)).unwrap();
        assert!(count_casts(&t).is_empty());
    }

    #[test]
    fn casts_are_counted_per_pair_of_dtypes_in_the_order_first_seen() {
        let cast = |name: &str, from: DType, to: DType| {
            let mut t = planned(name, from);
            t.dtype = to;
            t
        };
        let t = vec![
            cast("a", DType::F32, DType::BF16),
            cast("b", DType::F16, DType::BF16),
            cast("c", DType::F32, DType::BF16),
            planned("d", DType::BF16),
            cast("e", DType::F32, DType::F16),
            cast("f", DType::F32, DType::BF16),
        ];
        assert_eq!(
            count_casts(&t),
            [
                (DType::F32, DType::BF16, 3),
                (DType::F16, DType::BF16, 1),
                (DType::F32, DType::F16, 1)
            ]
        );
    }

    #[test]
    fn the_config_keeps_its_keys_and_gets_the_dtype() {
        let cfg: Map<String, Value> = serde_json::from_str(
            r#"{"torch_dtype": null, "vision": {"dtype": "float32"}, "x": 1}"#,
        )
        .unwrap();
        let mut report = Report::default();
        let c = output_config(Some(&cfg), Some(DType::BF16), true, &mut report).unwrap();
        assert_eq!(c["torch_dtype"], "bfloat16");
        assert_eq!(c["vision"]["dtype"], "bfloat16");
        assert_eq!(c["x"], 1);
        assert!(!c.contains_key("dtype") && report.warnings.is_empty());
        assert!(output_config(None, Some(DType::BF16), false, &mut report).is_none());
        assert_eq!(report.warnings.len(), 1);
        assert!(report.warnings[0].contains("no base given"));
        assert!(output_config(None, Some(DType::BF16), true, &mut report).is_none());
        assert!(
            !report.warnings[1].contains("no --base"),
            "{:?}",
            report.warnings
        );
        assert_eq!(config_dtype_of(&c), Some(("torch_dtype", DType::BF16)));
    }
}
