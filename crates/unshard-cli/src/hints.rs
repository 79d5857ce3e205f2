//! The library's hints speak of its options (`strict`, `force`, `renames`); the
//! command line's speak of its flags. This maps the typed errors whose remedy is a
//! flag to the flag's words; any other error keeps the library's hint.

use unshard::Error;
use unshard::{AdapterOption, AdapterRemedy};

/// The hint for `e` in terms of this command's flags, when it has one.
pub fn for_flags(e: &Error) -> Option<String> {
    Some(match e {
        Error::UnknownTensors { similar, .. } if similar.is_empty() => {
            "check that --base is the model that was trained, or map names with --rename REGEX=REPLACEMENT".into()
        }
        Error::UnknownTensors { similar, .. } => format!(
            "the base has similar names ({}); map them with --rename REGEX=REPLACEMENT, or check that --base is the model that was trained",
            similar
                .iter()
                .map(|s| format!("'{s}'"))
                .collect::<Vec<_>>()
                .join(", ")
        ),
        Error::ShapeMismatch { .. } => {
            "the checkpoint was trained from a different architecture or size than --base".into()
        }
        Error::DuplicateName { .. } => {
            "use --rename to keep them apart, or --key to pick one state dict".into()
        }
        Error::Strict { .. } => "without --strict they are copied from the base".into(),
        Error::OutputExists { .. } => {
            "pass --force to replace it, or choose another --output".into()
        }
        Error::Overflow { dtype, .. } => format!(
            "values beyond the range of {dtype} cannot be represented; choose --dtype bfloat16 or float32, or pass --allow-overflow to write inf"
        ),
        Error::NonFinite { .. } => {
            "the output was not written; the run may have diverged. Drop --fail-on-nonfinite to write it anyway".into()
        }
        Error::AmbiguousTensors { candidates, .. } => format!(
            "pick one with --key, e.g. --key {}",
            candidates.first().map(String::as_str).unwrap_or("state")
        ),
        Error::Io { source, .. } if source.raw_os_error() == Some(libc::ENOSPC) => {
            "the disk is full; free space or choose another --output".into()
        }
        Error::Adapter { remedy, .. } => adapter_hint(*remedy)?.into(),
        _ => return None,
    })
}

/// The message of `e` in terms of this command's flags, when the library's names
/// one of its options.
pub fn message_for_flags(e: &Error) -> Option<String> {
    match e {
        Error::Adapter { msg, remedy } => remedy
            .option_in_message()
            .map(|o| msg.replacen(o.words(), adapter_flag(o), 1)),
        _ => None,
    }
}

fn adapter_flag(o: AdapterOption) -> &'static str {
    match o {
        AdapterOption::Name => "--adapter",
        AdapterOption::Config => "--adapter-config",
        AdapterOption::NoFuse => "--no-fuse",
    }
}

fn adapter_hint(remedy: AdapterRemedy) -> Option<&'static str> {
    Some(match remedy {
        AdapterRemedy::PickListed => "pass one of those names with --adapter",
        AdapterRemedy::NameOne => "choose one with --adapter NAME",
        AdapterRemedy::ConfigUnreadable => {
            "pass the adapter_config.json peft wrote for this adapter with --adapter-config"
        }
        AdapterRemedy::ConfigAbsent => {
            "pass the adapter_config.json the adapter was trained with (or its directory)"
        }
        AdapterRemedy::ConfigNotFound => {
            "pass the adapter config the run used with --adapter-config PATH (never guess lora_alpha)"
        }
        AdapterRemedy::CheckBase => "check that --base is the model the adapter was trained on",
        AdapterRemedy::NoBase => "pass the model the adapter was trained on with --base DIR",
        AdapterRemedy::BaseLacksWeight => {
            "pass the base model the adapter was trained on with --base"
        }
        AdapterRemedy::NotAnAdapter(_) => {
            "pass a peft adapter directory or a checkpoint of a peft-wrapped model, or drop the flag"
        }
        _ => return None,
    })
}
