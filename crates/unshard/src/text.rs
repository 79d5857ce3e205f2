//! Small formatting helpers shared by reports and errors: lists cut short, byte
//! counts, paths as they display.

/// Lists up to `max` items, then says how many more there are.
pub fn list_some<S: std::fmt::Display>(items: &[S], max: usize) -> String {
    let shown: Vec<String> = items.iter().take(max).map(ToString::to_string).collect();
    let mut s = shown.join(", ");
    if items.len() > max {
        s.push_str(&format!(" and {} more", items.len() - max));
    }
    s
}

/// Formats a byte count with binary units (`1.5 GiB`).
pub fn human_bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{n} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

/// Serializes a path as it displays (lossy for names that are not UTF-8).
pub(crate) fn display_path<S: serde::Serializer>(
    p: &std::path::Path,
    s: S,
) -> std::result::Result<S::Ok, S::Error> {
    s.serialize_str(&p.display().to_string())
}
