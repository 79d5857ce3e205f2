//! The `Serialize` forms that reports share: a path as it displays, an input
//! format as its stable id. (Kept apart from `report`, which errors use, so that
//! the readers' module does not depend on itself through the errors.)

/// Serializes a path as it displays (lossy for names that are not UTF-8).
pub(crate) fn display_path<S: serde::Serializer>(
    p: &std::path::Path,
    s: S,
) -> std::result::Result<S::Ok, S::Error> {
    s.serialize_str(&p.display().to_string())
}

/// Serializes an input format as its stable id (`torch-zip`, `dcp`...).
pub(crate) fn format_id<S: serde::Serializer>(
    f: &crate::source::Format,
    s: S,
) -> std::result::Result<S::Ok, S::Error> {
    s.serialize_str(f.id())
}
