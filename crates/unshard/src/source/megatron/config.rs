//! A Hugging Face `config.json` derived from Megatron-LM's training arguments,
//! for a Megatron-Core checkpoint merged without a base.
//!
//! The family follows from the features the arguments turn on: experts and q/k
//! norms make Qwen3-MoE, experts alone Mixtral, q/k/v biases Qwen2, q/k norms
//! alone Qwen3, none of them Llama. Field names and the values the arguments do
//! not carry (dropout, `use_cache`, sliding-window fields) are those transformers
//! writes for the family (`save_pretrained`, transformers 5). Anything the
//! arguments say that the family cannot express (multi-latent attention, rope
//! scaling, LayerNorm, biases on every linear, shared experts, another router)
//! is refused by the argument's name: a config that loads but computes another
//! model would be worse than none.
//!
//! Two things the arguments do not hold: the token ids (left `null`, with a
//! warning) and the tokenizer's own vocabulary size (Megatron records only the
//! size padded to a multiple of `make_vocab_size_divisible_by` x TP; it is kept,
//! with a warning, since the padding rows are trained rows of the embedding).

use std::collections::BTreeMap;

use serde_json::{json, Map, Value};

use super::args::{Arg, TrainingArgs};
use crate::error::{Error, Result};

/// The derived config and what the user should know about it.
#[derive(Clone, Debug, PartialEq)]
pub struct DerivedConfig {
    /// `config.json`.
    pub config: Map<String, Value>,
    /// Warnings for the merge's report.
    pub warnings: Vec<String>,
}

/// The largest size believed (so that products of two sizes fit in a u64).
const MAX_SIZE: i64 = 1 << 31;

/// The most layers believed (a config lists some per layer).
const MAX_LAYERS: u64 = 1 << 16;

/// The hint of every refusal.
const HINT: &str = "pass --base <HF model dir or Hub id> with the model's config.json (the model the training started from, or one of its family)";

/// The family a config is derived for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Family {
    Llama,
    Qwen2,
    Qwen3,
    Mixtral,
    Qwen3Moe,
}

impl Family {
    fn model_type(self) -> &'static str {
        match self {
            Family::Llama => "llama",
            Family::Qwen2 => "qwen2",
            Family::Qwen3 => "qwen3",
            Family::Mixtral => "mixtral",
            Family::Qwen3Moe => "qwen3_moe",
        }
    }

    fn architecture(self) -> &'static str {
        match self {
            Family::Llama => "LlamaForCausalLM",
            Family::Qwen2 => "Qwen2ForCausalLM",
            Family::Qwen3 => "Qwen3ForCausalLM",
            Family::Mixtral => "MixtralForCausalLM",
            Family::Qwen3Moe => "Qwen3MoeForCausalLM",
        }
    }
}

/// Typed access to the arguments; every error names the argument.
struct Args<'a>(&'a TrainingArgs);

impl Args<'_> {
    fn refuse(&self, name: &str, why: &str) -> Error {
        let shown = self.0.get(name).map_or("absent".into(), Arg::show);
        Error::plan(
            format!(
                "no Hugging Face config can be derived from the Megatron training arguments in {}: {name} = {shown}: {why}",
                self.0.source()
            ),
            Some(HINT.into()),
        )
    }

    /// A value that is set (absent and `None` are not).
    fn set(&self, name: &str) -> Option<&Arg> {
        self.0.get(name).filter(|a| **a != Arg::None)
    }

    fn int(&self, name: &str) -> Result<Option<i64>> {
        match self.set(name) {
            None => Ok(None),
            Some(Arg::Int(i)) => Ok(Some(*i)),
            Some(_) => Err(self.refuse(name, "not an integer")),
        }
    }

    /// A size that must be there: a positive integer, at most [`MAX_SIZE`].
    fn size(&self, name: &str) -> Result<u64> {
        self.optional_size(name)?
            .ok_or_else(|| self.refuse(name, "a positive integer is needed"))
    }

    /// A size, when it is set.
    fn optional_size(&self, name: &str) -> Result<Option<u64>> {
        match self.int(name)? {
            None => Ok(None),
            Some(i) if (1..=MAX_SIZE).contains(&i) => Ok(Some(i as u64)),
            Some(_) => Err(self.refuse(
                name,
                &format!("a positive integer of at most {MAX_SIZE} is needed"),
            )),
        }
    }

    fn float(&self, name: &str) -> Result<Option<f64>> {
        match self.set(name) {
            None => Ok(None),
            Some(Arg::Float(f)) if f.is_finite() => Ok(Some(*f)),
            Some(Arg::Int(i)) => Ok(Some(*i as f64)),
            Some(_) => Err(self.refuse(name, "not a finite number")),
        }
    }

    /// A flag: absent and `None` are false.
    fn flag(&self, name: &str) -> Result<bool> {
        match self.set(name) {
            None => Ok(false),
            Some(Arg::Bool(b)) => Ok(*b),
            Some(_) => Err(self.refuse(name, "not a boolean")),
        }
    }

    fn text(&self, name: &str) -> Result<Option<&str>> {
        match self.set(name) {
            None => Ok(None),
            Some(Arg::Str(s)) => Ok(Some(s)),
            Some(_) => Err(self.refuse(name, "not a string")),
        }
    }

    /// Refuses a flag that is on.
    fn not_on(&self, name: &str, why: &str) -> Result<()> {
        if self.flag(name)? {
            return Err(self.refuse(name, why));
        }
        Ok(())
    }

    /// Refuses an argument that is set at all.
    fn not_set(&self, name: &str, why: &str) -> Result<()> {
        if self.set(name).is_some() {
            return Err(self.refuse(name, why));
        }
        Ok(())
    }
}

/// Derives `config.json` from the training arguments, or refuses, naming the
/// argument that decides.
pub fn hf_config(training: &TrainingArgs) -> Result<DerivedConfig> {
    let a = Args(training);
    refuse_unsupported(&a)?;
    let layers = a.size("num_layers")?;
    if layers > MAX_LAYERS {
        return Err(a.refuse(
            "num_layers",
            &format!("more than {MAX_LAYERS} layers are not believed"),
        ));
    }
    let hidden = a.size("hidden_size")?;
    let heads = a.size("num_attention_heads")?;
    let groups = if a.flag("group_query_attention")? {
        a.size("num_query_groups")?
    } else {
        heads
    };
    if heads % groups != 0 {
        let why = format!("{heads} attention heads do not split into {groups} groups");
        return Err(a.refuse("num_query_groups", &why));
    }
    let head_dim = match a.optional_size("kv_channels")? {
        Some(d) => d,
        None if hidden % heads == 0 => hidden / heads,
        None => {
            return Err(a.refuse(
                "kv_channels",
                "hidden_size is not a multiple of num_attention_heads",
            ))
        }
    };
    let positions = match a.optional_size("max_position_embeddings")? {
        Some(p) => p,
        None => a.size("seq_length").map_err(|_| {
            a.refuse(
                "max_position_embeddings",
                "neither it nor seq_length is set",
            )
        })?,
    };
    let vocab = a.size("padded_vocab_size")?;
    let eps = match a.float("layernorm_epsilon")? {
        Some(e) => e,
        None => a
            .float("norm_epsilon")?
            .ok_or_else(|| a.refuse("norm_epsilon", "the norm's epsilon is needed"))?,
    };
    let rope_theta = a
        .float("rotary_base")?
        .ok_or_else(|| a.refuse("rotary_base", "the rope base is needed"))?;
    let tied = !a.flag("untie_embeddings_and_output_weights")?;
    let init = a.float("init_method_std")?.unwrap_or(0.02);
    let dtype = dtype(&a)?;
    let qkv_bias = a.flag("add_qkv_bias")?;
    let qk_norm = a.flag("qk_layernorm")?;
    let experts = match a.int("num_experts")? {
        Some(0) | None => None,
        Some(_) => Some(a.size("num_experts")?),
    };
    let family = match (experts.is_some(), qkv_bias, qk_norm) {
        (_, true, true) => {
            let why = "q/k/v biases with q/k norms (qk_layernorm) make no family unshard derives";
            return Err(a.refuse("add_qkv_bias", why));
        }
        (true, true, false) => {
            let why = "q/k/v biases in a mixture-of-experts model make no family unshard derives";
            return Err(a.refuse("add_qkv_bias", why));
        }
        (true, false, true) => Family::Qwen3Moe,
        (true, false, false) => Family::Mixtral,
        (false, true, false) => Family::Qwen2,
        (false, false, true) => Family::Qwen3,
        (false, false, false) => Family::Llama,
    };

    let mut c: BTreeMap<&str, Value> = BTreeMap::new();
    c.insert("architectures", json!([family.architecture()]));
    c.insert("model_type", json!(family.model_type()));
    c.insert("attention_dropout", py_float(0.0));
    c.insert("bos_token_id", Value::Null);
    c.insert("eos_token_id", Value::Null);
    c.insert("pad_token_id", Value::Null);
    c.insert("dtype", json!(dtype));
    c.insert("hidden_act", json!("silu"));
    c.insert("hidden_size", json!(hidden));
    c.insert("initializer_range", py_float(init));
    c.insert("max_position_embeddings", json!(positions));
    c.insert("num_attention_heads", json!(heads));
    c.insert("num_hidden_layers", json!(layers));
    c.insert("num_key_value_heads", json!(groups));
    c.insert("rms_norm_eps", py_float(eps));
    c.insert(
        "rope_parameters",
        json!({"rope_theta": py_float(rope_theta), "rope_type": "default"}),
    );
    c.insert("tie_word_embeddings", json!(tied));
    c.insert("use_cache", json!(true));
    c.insert("vocab_size", json!(vocab));
    let full_attention = || json!(vec!["full_attention"; layers as usize]);
    match family {
        Family::Llama => {
            c.insert("attention_bias", json!(false));
            c.insert("head_dim", json!(head_dim));
            c.insert("intermediate_size", json!(a.size("ffn_hidden_size")?));
            c.insert("mlp_bias", json!(false));
            c.insert("pretraining_tp", json!(1));
        }
        Family::Qwen2 | Family::Qwen3 => {
            if family == Family::Qwen2 {
                // Qwen2's config has no head_dim: it is always hidden / heads.
                if head_dim * heads != hidden {
                    let why = format!(
                        "a Qwen2 model (q/k/v biases) has hidden_size / num_attention_heads = {} channels per head",
                        hidden / heads
                    );
                    return Err(a.refuse("kv_channels", &why));
                }
            } else {
                c.insert("attention_bias", json!(false));
                c.insert("head_dim", json!(head_dim));
            }
            c.insert("intermediate_size", json!(a.size("ffn_hidden_size")?));
            c.insert("layer_types", full_attention());
            c.insert("max_window_layers", json!(28));
            c.insert("sliding_window", Value::Null);
            c.insert("use_sliding_window", json!(false));
        }
        Family::Mixtral | Family::Qwen3Moe => {
            let experts = experts.unwrap_or(0);
            let moe = moe(&a, family, layers)?;
            c.insert("num_local_experts", json!(experts));
            c.insert("num_experts_per_tok", json!(moe.topk));
            c.insert("output_router_logits", json!(false));
            c.insert("router_aux_loss_coef", py_float(moe.aux_loss));
            c.insert("sliding_window", Value::Null);
            if family == Family::Mixtral {
                // transformers writes null for the default hidden / heads.
                let default = head_dim * heads == hidden;
                c.insert(
                    "head_dim",
                    if default {
                        Value::Null
                    } else {
                        json!(head_dim)
                    },
                );
                c.insert("intermediate_size", json!(moe.ffn));
                c.insert("router_jitter_noise", py_float(0.0));
            } else {
                c.insert("attention_bias", json!(false));
                c.insert("decoder_sparse_step", json!(1));
                c.insert("head_dim", json!(head_dim));
                let dense = a.size("ffn_hidden_size")?;
                c.insert("intermediate_size", json!(dense));
                c.insert("mlp_only_layers", json!(moe.dense_layers));
                c.insert("moe_intermediate_size", json!(moe.ffn));
                c.insert("norm_topk_prob", json!(moe.normalized));
                c.insert("use_sliding_window", json!(false));
            }
        }
    }
    let config: Map<String, Value> = c.into_iter().map(|(k, v)| (k.to_string(), v)).collect();
    Ok(DerivedConfig {
        warnings: warnings(&a, family, vocab),
        config,
    })
}

/// A float as Python's `json.dumps` writes it (`repr`: the shortest digits that
/// read back, fixed notation from 1e-4 up to 1e16 with at least one decimal,
/// else an exponent of at least two digits): `1e-05`, `0.02`, `10000.0`. The
/// config then reads as transformers' own, text included.
fn py_float(f: f64) -> Value {
    let sci = format!("{f:e}");
    let (mantissa, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let (sign, mantissa) = match mantissa.strip_prefix('-') {
        Some(m) => ("-", m),
        None => ("", mantissa),
    };
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    let text = if (-4..16).contains(&exp) {
        let point = exp + 1;
        if point <= 0 {
            format!("{sign}0.{}{digits}", "0".repeat((-point) as usize))
        } else {
            let point = point as usize;
            let int = if digits.len() > point {
                &digits[..point]
            } else {
                &digits
            };
            let frac = digits.get(point..).filter(|f| !f.is_empty()).unwrap_or("0");
            format!(
                "{sign}{int}{}.{frac}",
                "0".repeat(point.saturating_sub(digits.len()))
            )
        }
    } else {
        let e = if exp < 0 { '-' } else { '+' };
        format!("{sign}{mantissa}e{e}{:02}", exp.unsigned_abs())
    };
    serde_json::from_str(&text).unwrap_or_else(|_| json!(f))
}

/// Features no derived family has.
fn refuse_unsupported(a: &Args<'_>) -> Result<()> {
    a.not_on(
        "multi_latent_attention",
        "multi-latent attention (DeepSeek's) has no config unshard derives",
    )?;
    a.not_set(
        "experimental_attention_variant",
        "an attention variant no config unshard derives has",
    )?;
    a.not_set(
        "linear_attention_freq",
        "linear-attention layers have no config unshard derives",
    )?;
    a.not_on(
        "attention_output_gate",
        "gated attention has no config unshard derives",
    )?;
    a.not_set("window_size", "sliding-window attention is not derived")?;
    a.not_set(
        "softmax_scale",
        "a custom softmax scale has no config field",
    )?;
    a.not_on(
        "apply_residual_connection_post_layernorm",
        "post-norm residuals have no config unshard derives",
    )?;
    match a.text("position_embedding_type")? {
        Some("rope") => {}
        None if a.flag("use_rotary_position_embeddings")? => {}
        _ => return Err(a.refuse("position_embedding_type", "only plain rope is derived")),
    }
    if a.float("rotary_percent")?.is_some_and(|p| p != 1.0) {
        return Err(a.refuse(
            "rotary_percent",
            "partial rotary embeddings are not derived",
        ));
    }
    a.not_on(
        "rotary_interleaved",
        "interleaved rope is not what the derived families compute",
    )?;
    a.not_on(
        "use_rope_scaling",
        "rope scaling (Llama 3.1's) is not derived",
    )?;
    a.not_set(
        "rotary_seq_len_interpolation_factor",
        "rope interpolation is not derived",
    )?;
    a.not_set("no_rope_freq", "layers without rope are not derived")?;
    if a.text("normalization")? != Some("RMSNorm") {
        return Err(a.refuse("normalization", "only RMSNorm models are derived"));
    }
    a.not_on(
        "layernorm_zero_centered_gamma",
        "zero-centered norm weights are not derived",
    )?;
    a.not_on(
        "apply_layernorm_1p",
        "zero-centered norm weights are not derived",
    )?;
    if !a.flag("swiglu")? {
        return Err(a.refuse("swiglu", "only SwiGLU MLPs are derived"));
    }
    a.not_on(
        "add_bias_linear",
        "biases on every linear layer have no config unshard derives",
    )?;
    a.not_set(
        "moe_shared_expert_intermediate_size",
        "shared experts have no config unshard derives",
    )?;
    if let Some(f) = a.text("moe_router_score_function")? {
        if f != "softmax" {
            return Err(a.refuse(
                "moe_router_score_function",
                "only a softmax router is derived",
            ));
        }
    }
    if a.float("moe_router_topk_scaling_factor")?
        .is_some_and(|s| s != 1.0)
    {
        return Err(a.refuse(
            "moe_router_topk_scaling_factor",
            "scaled routing weights are not derived",
        ));
    }
    a.not_set(
        "moe_router_num_groups",
        "group-limited routing is not derived",
    )?;
    a.not_on(
        "moe_router_enable_expert_bias",
        "a router expert bias is not derived",
    )?;
    a.not_set("moe_latent_size", "latent experts are not derived")?;
    Ok(())
}

/// The dtype the parameters were trained in: `bf16` / `fp16`, else `params_dtype`.
fn dtype(a: &Args<'_>) -> Result<&'static str> {
    if a.flag("bf16")? {
        return Ok("bfloat16");
    }
    if a.flag("fp16")? {
        return Ok("float16");
    }
    match a.set("params_dtype") {
        Some(Arg::Global(g)) => match g.as_str() {
            "torch.bfloat16" => Ok("bfloat16"),
            "torch.float16" | "torch.half" => Ok("float16"),
            "torch.float32" | "torch.float" => Ok("float32"),
            _ => Err(a.refuse("params_dtype", "not a floating dtype of the model")),
        },
        _ => {
            let why = "neither bf16 nor fp16 is set, and params_dtype does not give the dtype";
            Err(a.refuse("params_dtype", why))
        }
    }
}

/// What a mixture-of-experts config needs.
struct Moe {
    topk: u64,
    ffn: u64,
    aux_loss: f64,
    /// Whether the top-k weights are renormalized (Megatron's default:
    /// softmax over the top-k logits).
    normalized: bool,
    /// Layers with a dense MLP.
    dense_layers: Vec<u64>,
}

fn moe(a: &Args<'_>, family: Family, layers: u64) -> Result<Moe> {
    let topk = a.size("moe_router_topk")?;
    let ffn = match a.optional_size("moe_ffn_hidden_size")? {
        Some(f) => f,
        None => a.size("ffn_hidden_size")?,
    };
    let aux_loss = match a.set("moe_aux_loss_coeff") {
        None => 0.001,
        Some(Arg::List(items)) if items.len() == 1 => match items[0] {
            Arg::Float(f) => f,
            Arg::Int(i) => i as f64,
            _ => return Err(a.refuse("moe_aux_loss_coeff", "not a number")),
        },
        Some(_) => a.float("moe_aux_loss_coeff")?.unwrap_or(0.001),
    };
    let pattern: Vec<bool> = match a.set("moe_layer_freq") {
        None => vec![true; layers as usize],
        Some(Arg::Int(k)) if *k > 0 => (0..layers).map(|i| i % (*k as u64) == 0).collect(),
        Some(Arg::List(items)) if items.len() as u64 == layers => items
            .iter()
            .map(|i| match i {
                Arg::Int(0) => Ok(false),
                Arg::Int(1) => Ok(true),
                _ => {
                    let why = "a pattern of 0 (dense) and 1 (experts) per layer is needed";
                    Err(a.refuse("moe_layer_freq", why))
                }
            })
            .collect::<Result<_>>()?,
        Some(_) => {
            let why = format!("an integer or a list of {layers} layers is needed");
            return Err(a.refuse("moe_layer_freq", &why));
        }
    };
    let dense_layers: Vec<u64> = (0..layers).filter(|&i| !pattern[i as usize]).collect();
    let pre_softmax = a.flag("moe_router_pre_softmax")?;
    if family == Family::Mixtral {
        if !dense_layers.is_empty() {
            let why = "dense layers between expert layers are not Mixtral's (with q/k norms they would be Qwen3-MoE's)";
            return Err(a.refuse("moe_layer_freq", why));
        }
        if pre_softmax {
            return Err(a.refuse(
                "moe_router_pre_softmax",
                "Mixtral renormalizes the top-k weights",
            ));
        }
    }
    Ok(Moe {
        topk,
        ffn,
        aux_loss,
        normalized: !pre_softmax,
        dense_layers,
    })
}

/// What the user should check in a derived config.
fn warnings(a: &Args<'_>, family: Family, vocab: u64) -> Vec<String> {
    // Only words: an argument of an unexpected type here changes no field.
    let tokenizer = match a.set("tokenizer_model") {
        Some(Arg::Str(t)) => format!(" (the training's tokenizer: {t})"),
        _ => String::new(),
    };
    let divisor = match a.set("make_vocab_size_divisible_by") {
        Some(Arg::Int(d)) => {
            format!(", a multiple of make_vocab_size_divisible_by {d} x the tensor-parallel size")
        }
        _ => String::new(),
    };
    vec![
        format!(
            "config.json was derived from the Megatron training arguments in {} as a {} model: \
             the token ids (bos_token_id, eos_token_id, pad_token_id) are not among them and are \
             left null, and the output has no tokenizer or generation_config.json; pass --base \
             <HF model dir or Hub id>{tokenizer} to take them from the model",
            a.0.source(),
            family.model_type()
        ),
        format!(
            "vocab_size {vocab} is Megatron's padded vocabulary (padded_vocab_size{divisor}); the \
             tokenizer's own size is not among the training arguments, so rows past its last token \
             are padding kept in the embedding and the output layer; pass --base <HF model dir or \
             Hub id> to keep only the tokenizer's rows"
        ),
    ]
}

#[cfg(test)]
mod tests;
