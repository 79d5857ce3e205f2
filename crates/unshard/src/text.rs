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

/// A URL without what must never be shown or written: the user info
/// (`user:password@`), the query (`?X-Amz-Signature=...`, a SAS token) and the
/// fragment. `None` when `text` is not a URL or has none of them. The container of
/// an Azure Data Lake or Blob URL (`abfss://container@account...`) stands where
/// user info would, and is kept.
pub fn redact_url(text: &str) -> Option<String> {
    let (scheme, rest) = text.split_once("://")?;
    if scheme.is_empty()
        || !scheme
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '+')
    {
        return None;
    }
    let auth_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(auth_end);
    let host = match authority.rsplit_once('@') {
        Some((container, _)) if is_container(scheme, container) => authority,
        Some((_, host)) => host,
        None => authority,
    };
    let path = tail.split(['?', '#']).next().unwrap_or("");
    let clean = format!("{scheme}://{host}{path}");
    (clean != text).then_some(clean)
}

/// Whether `user_info` of a `scheme` URL is an Azure container name (letters,
/// digits and hyphens), not a user and a password.
fn is_container(scheme: &str, user_info: &str) -> bool {
    ["abfs", "abfss", "wasb", "wasbs"].contains(&scheme.to_ascii_lowercase().as_str())
        && !user_info.is_empty()
        && user_info
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-')
}

/// [`redact_url`], or the text unchanged.
pub fn without_secrets(text: &str) -> String {
    redact_url(text).unwrap_or_else(|| text.to_string())
}

/// `message` with [`redact_url`] applied to every URL in it (a client library's
/// error may quote the URL it requested).
#[cfg(feature = "remote")]
pub fn scrub(message: &str) -> String {
    if !message.contains("://") {
        return message.to_string();
    }
    let mut out = String::with_capacity(message.len());
    let mut rest = message;
    while let Some(at) = rest.find("://") {
        // The URL starts after the last delimiter before its scheme.
        let start = rest[..at]
            .rfind(|c: char| !(c.is_ascii_alphanumeric() || c == '+'))
            .map_or(0, |i| i + 1);
        let len = rest[at..]
            .find(|c: char| c.is_whitespace() || "()<>\"'`,;".contains(c))
            .map_or(rest.len() - at, |n| n);
        let end = at + len;
        out.push_str(&rest[..start]);
        out.push_str(&without_secrets(&rest[start..end]));
        rest = &rest[end..];
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn user_info_query_and_fragment_leave_a_url() {
        let cases = [
            (
                "https://user:pw@host:8080/a/b?X-Amz-Signature=s#f",
                Some("https://host:8080/a/b"),
            ),
            ("s3://bucket/key?versionId=1", Some("s3://bucket/key")),
            ("https://host/a@b/c", None),
            ("s3://bucket/key", None),
            ("/local/dir?x", None),
            ("az://u@container?sig=1", Some("az://container")),
            (
                "abfss://ckpt@acct.dfs.core.windows.net/run/x?sig=1",
                Some("abfss://ckpt@acct.dfs.core.windows.net/run/x"),
            ),
            ("abfss://ckpt@acct.dfs.core.windows.net/run/x", None),
            (
                "wasbs://u:pw@acct.blob.core.windows.net/c",
                Some("wasbs://acct.blob.core.windows.net/c"),
            ),
        ];
        for (given, want) in cases {
            assert_eq!(redact_url(given).as_deref(), want, "{given}");
        }
    }

    #[test]
    #[cfg(feature = "remote")]
    fn urls_inside_a_message_are_scrubbed() {
        let m = "error sending request for url (https://u:SECRET@h/x?sig=SECRET2): refused, see s3://b/k";
        assert_eq!(
            scrub(m),
            "error sending request for url (https://h/x): refused, see s3://b/k"
        );
    }
}
