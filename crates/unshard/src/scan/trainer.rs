//! The one pickle outside the allowlist that every fine-tuning run leaves beside its
//! weights: the Trainer's `training_args.bin` (`torch.save(self.args, ...)` in
//! transformers' Trainer and every TRL trainer). Under `torch.load` it imports
//! transformers, trl and accelerate (installed libraries, not code from the file),
//! creates its arguments objects without running their constructors (NEWOBJ, then
//! BUILD sets their fields) and looks enum members up by value (REDUCE on an Enum
//! class). None of these classes defines `__new__`, `__setstate__` or `__reduce__`,
//! so nothing the file chooses runs. A scan that flagged it would fail on every
//! Trainer checkpoint and teach users to ignore the scan.
//!
//! The recognition is per call and by route: the same class reached by REDUCE (its
//! constructor, `__post_init__` included, run with arguments the file chooses) is
//! not recognised, and any other callable in the same file is still reported.

use super::UnsafeCall;

/// Arguments dataclasses, recognised when created by NEWOBJ (no constructor runs).
const DATACLASSES: &[&str] = &[
    "transformers.training_args.TrainingArguments",
    "transformers.training_args_seq2seq.Seq2SeqTrainingArguments",
    "transformers.trainer_pt_utils.AcceleratorConfig",
    "accelerate.state.PartialState",
];

/// Enum classes, recognised when called by REDUCE (a lookup by value).
const ENUMS: &[&str] = &[
    "transformers.trainer_utils.SchedulerType",
    "transformers.trainer_utils.IntervalStrategy",
    "transformers.trainer_utils.SaveStrategy",
    "transformers.trainer_utils.HubStrategy",
    "transformers.trainer_utils.EvaluationStrategy",
    "transformers.trainer_utils.FSDPOption",
    "transformers.training_args.OptimizerNames",
    "transformers.debug_utils.DebugOption",
    "accelerate.utils.dataclasses.DistributedType",
];

/// Whether `call` only rebuilds a Trainer's arguments (see the module docs).
pub(super) fn is_trainer_arguments(call: &UnsafeCall) -> bool {
    let name = call.callable.as_str();
    match call.route.as_str() {
        "NEWOBJ" | "NEWOBJ_EX" => DATACLASSES.contains(&name) || is_trl_config(name),
        "REDUCE" => ENUMS.contains(&name),
        _ => false,
    }
}

/// TRL's trainer configs: `trl.trainer.<x>_config.<X>Config`, every one a
/// TrainingArguments dataclass (DPOConfig, SFTConfig, GRPOConfig, ...).
fn is_trl_config(name: &str) -> bool {
    let Some(rest) = name.strip_prefix("trl.trainer.") else {
        return false;
    };
    let Some((module, class)) = rest.split_once('.') else {
        return false;
    };
    let plain = |s: &str| !s.is_empty() && s.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
    module.ends_with("_config") && plain(module) && class.ends_with("Config") && plain(class)
}

#[cfg(test)]
mod tests {
    use super::*;
    use unshard_pickle::Verdict;

    fn call(callable: &str, route: &str) -> UnsafeCall {
        UnsafeCall {
            path: "training_args.bin".into(),
            entry: "training_args/data.pkl".into(),
            callable: callable.into(),
            route: route.into(),
            offset: 0,
            verdict: Verdict::Unknown,
        }
    }

    #[test]
    fn recognised_only_by_the_route_torch_save_writes() {
        let ta = "transformers.training_args.TrainingArguments";
        assert!(is_trainer_arguments(&call(ta, "NEWOBJ")));
        assert!(!is_trainer_arguments(&call(ta, "REDUCE")));
        assert!(!is_trainer_arguments(&call(ta, "INST")));
        let e = "transformers.trainer_utils.SchedulerType";
        assert!(is_trainer_arguments(&call(e, "REDUCE")));
        assert!(!is_trainer_arguments(&call(e, "NEWOBJ")));
    }

    #[test]
    fn trl_configs_by_shape_only() {
        assert!(is_trainer_arguments(&call(
            "trl.trainer.dpo_config.DPOConfig",
            "NEWOBJ"
        )));
        for other in [
            "trl.trainer.dpo_trainer.DPOTrainer",
            "trl.trainer.dpo_config.DPOConfig.__init__",
            "trl.trainer.utils.Config",
            "trl.trainer.x_config.Evil Config",
            "trlx.trainer.dpo_config.DPOConfig",
        ] {
            assert!(!is_trainer_arguments(&call(other, "NEWOBJ")), "{other}");
        }
    }
}
