//! Names from a checkpoint are data from a file: a tensor named `"\x1b]2;...\x07"`
//! would retitle the terminal, `"\r"` would overwrite the line, a bidi override
//! would reorder what is shown. Text output shows such characters escaped (`\x1b`,
//! `\u{202e}`); JSON output keeps the exact names (JSON escapes them itself).

use std::borrow::Cow;
use std::io::Write;

/// Characters that are shown escaped: control characters (C0, DEL, C1) and the
/// invisible formatting characters that reorder or hide text.
fn needs_escape(c: char) -> bool {
    c.is_control()
        || matches!(c,
            '\u{200b}'..='\u{200f}' // zero-width spaces and marks
            | '\u{202a}'..='\u{202e}' // bidi embeddings and overrides
            | '\u{2066}'..='\u{2069}' // bidi isolates
            | '\u{feff}')
}

/// `s` with control and bidi characters escaped; unchanged (borrowed) when clean.
pub fn escape(s: &str) -> Cow<'_, str> {
    if !s.chars().any(needs_escape) {
        return Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len() + 8);
    for c in s.chars() {
        if !needs_escape(c) {
            out.push(c);
        } else if (c as u32) < 0x100 {
            out.push_str(&format!("\\x{:02x}", c as u32));
        } else {
            out.push_str(&format!("\\u{{{:x}}}", c as u32));
        }
    }
    Cow::Owned(out)
}

/// A message of several lines (an error, a verify finding) with each line escaped:
/// the line breaks the message itself makes stay, anything else is shown escaped.
pub fn escape_lines(s: &str) -> String {
    s.split('\n').map(escape).collect::<Vec<_>>().join("\n")
}

/// Renders text output into a buffer, then writes it to `w` with every line
/// escaped: whatever a renderer forgets to escape cannot reach the terminal raw.
pub fn write_escaped(
    w: &mut dyn Write,
    render: impl FnOnce(&mut dyn Write) -> std::io::Result<()>,
) -> std::io::Result<()> {
    let mut buf = Vec::new();
    render(&mut buf)?;
    w.write_all(escape_lines(&String::from_utf8_lossy(&buf)).as_bytes())
}

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn control_and_bidi_characters_are_escaped_and_the_rest_kept() {
        assert!(matches!(escape("model.layers.0.weight"), Cow::Borrowed(_)));
        assert_eq!(escape("a\x1b[31mb"), "a\\x1b[31mb");
        assert_eq!(escape("x\ry\tz\u{7f}\u{9b}"), "x\\x0dy\\x09z\\x7f\\x9b");
        assert_eq!(escape("abc\u{202e}def"), "abc\\u{202e}def");
        assert_eq!(escape("größe.w"), "größe.w");
        assert_eq!(escape_lines("a\x1b\n  b\x07"), "a\\x1b\n  b\\x07");
    }
}
