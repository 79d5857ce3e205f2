//! The library's layers, enforced: every top-level module of `src/` imports only
//! modules below it in [`LAYERS`], and nothing inside the library imports through
//! the facade (`lib.rs`'s re-exports, such as `crate::Error`): a module names the
//! module that owns what it uses.
//!
//! The check reads the source as text: every `crate::NAME` path, and every
//! `super::` path that climbs out of its top-level module, outside comments and
//! test code (files named `tests.rs`, and the item after each `#[cfg(test)]`). `docs/architecture.md` draws the same
//! layers.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// The top-level modules, lowest first, grouped by layer. A module may import the
/// modules listed before it, never one listed after it.
const LAYERS: &[(&str, &[&str])] = &[
    ("ground", &["text", "dtype", "error", "cancel", "digest"]),
    ("bytes", &["bytes", "hub"]),
    ("readers", &["source"]),
    ("tensor reading", &["read"]),
    ("mapping", &["arch", "plan", "lora"]),
    ("engine and sinks", &["write"]),
    (
        "operations",
        &[
            "options", "stats", "prepare", "verify", "manifest", "merge", "parts", "diff",
            "inspect", "scan",
        ],
    ),
];

fn order() -> Vec<&'static str> {
    LAYERS.iter().flat_map(|(_, m)| m.iter().copied()).collect()
}

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).expect("src/ is readable") {
        let p = e.expect("a directory entry").path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// The file's module path below the crate root: `source/dcp/mod.rs` is
/// `["source", "dcp"]`, `source/fs.rs` is `["source", "fs"]`, `lib.rs` is `[]`.
fn module_path(rel: &Path) -> Vec<String> {
    let mut parts: Vec<String> = rel
        .iter()
        .map(|c| c.to_string_lossy().into_owned())
        .collect();
    let last = parts.pop().unwrap_or_default();
    let stem = last.trim_end_matches(".rs");
    if stem != "mod" && stem != "lib" {
        parts.push(stem.to_string());
    }
    parts
}

/// The code of a file without comments, string contents and test code (each item
/// under `#[cfg(test)]`: a `mod tests;` line, or a block to its closing brace).
fn code(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut skipping = false;
    let mut depth = 0i64;
    let mut opened = false;
    for line in text.lines() {
        let line = match line.find("//") {
            Some(i) => &line[..i],
            None => line,
        };
        // Drop string literals: text in messages is not an import.
        let mut kept = String::new();
        let mut in_str = false;
        let mut prev = ' ';
        for c in line.chars() {
            if c == '"' && prev != '\\' {
                in_str = !in_str;
            } else if !in_str {
                kept.push(c);
            }
            prev = if prev == '\\' && c == '\\' { ' ' } else { c };
        }
        if kept.trim() == "#[cfg(test)]" {
            skipping = true;
            depth = 0;
            opened = false;
            continue;
        }
        if skipping {
            for c in kept.chars() {
                match c {
                    '{' => {
                        depth += 1;
                        opened = true;
                    }
                    '}' => depth -= 1,
                    _ => {}
                }
            }
            let item_ended = if opened {
                depth <= 0
            } else {
                kept.trim_end().ends_with(';')
            };
            if item_ended {
                skipping = false;
            }
            continue;
        }
        out.push_str(&kept);
        out.push('\n');
    }
    out
}

/// The first segments of the paths after `crate::` in `code`, a `crate::{a, b::c}`
/// group giving each of its members.
fn crate_paths(code: &str) -> Vec<String> {
    let mut found = Vec::new();
    let mut rest = code;
    while let Some(i) = rest.find("crate::") {
        let before = rest[..i].chars().next_back();
        rest = &rest[i + "crate::".len()..];
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
            continue; // `unshard_crate::` and the like
        }
        if let Some(group) = rest.strip_prefix('{') {
            let mut depth = 1;
            let mut end = 0;
            for (k, c) in group.char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' => depth -= 1,
                    _ => {}
                }
                if depth == 0 {
                    end = k;
                    break;
                }
            }
            let mut depth = 0;
            let mut member = String::new();
            for c in group[..end].chars().chain(std::iter::once(',')) {
                match c {
                    '{' => depth += 1,
                    '}' => depth -= 1,
                    ',' if depth == 0 => {
                        let name: String = member
                            .trim()
                            .chars()
                            .take_while(|c| c.is_alphanumeric() || *c == '_')
                            .collect();
                        if !name.is_empty() {
                            found.push(name);
                        }
                        member.clear();
                        continue;
                    }
                    _ => {}
                }
                member.push(c);
            }
        } else {
            let name: String = rest
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect();
            if !name.is_empty() {
                found.push(name);
            }
        }
    }
    found
}

/// The targets of `super::` paths that climb out of the file's top-level module:
/// from module path `path`, `super::` repeated `k` times with `k >= path.len()`
/// reaches the crate root, and the segment after it names a top-level item.
fn escaping_super_paths(code: &str, path: &[String]) -> Vec<String> {
    let mut found = Vec::new();
    let mut rest = code;
    while let Some(i) = rest.find("super::") {
        let before = rest[..i].chars().next_back();
        let mut tail = &rest[i..];
        let mut k = 0;
        while let Some(t) = tail.strip_prefix("super::") {
            k += 1;
            tail = t;
        }
        rest = tail;
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == ':') {
            continue;
        }
        if k >= path.len() {
            let name: String = tail
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect();
            if !name.is_empty() {
                found.push(name);
            }
        }
    }
    found
}

/// Every `(file, module, imported top-level name)` of the library.
fn imports() -> Vec<(String, String, String)> {
    let root = src();
    let mut files = Vec::new();
    rust_files(&root, &mut files);
    files.sort();
    let mut out = Vec::new();
    for f in files {
        let rel = f.strip_prefix(&root).expect("under src/").to_path_buf();
        let name = rel.file_name().map(|n| n.to_string_lossy().into_owned());
        if name.as_deref() == Some("tests.rs")
            || name.as_deref().is_some_and(|n| n.ends_with("_tests.rs"))
        {
            continue;
        }
        let path = module_path(&rel);
        let Some(top) = path.first().cloned() else {
            continue; // lib.rs: the facade may use everything
        };
        let text = std::fs::read_to_string(&f).expect("a source file");
        let code = code(&text);
        let shown = rel.display().to_string();
        for name in crate_paths(&code)
            .into_iter()
            .chain(escaping_super_paths(&code, &path))
        {
            out.push((shown.clone(), top.clone(), name));
        }
    }
    out
}

/// The edges that break the layers, as messages.
fn violations(order: &[&str], imports: &[(String, String, String)]) -> Vec<String> {
    let rank = |m: &str| order.iter().position(|o| *o == m);
    let mut bad = BTreeSet::new();
    for (file, top, name) in imports {
        if name == "self" || name == top {
            continue;
        }
        let Some(from) = rank(top) else {
            bad.insert(format!(
                "{file}: module `{top}` is in no layer: add it to LAYERS"
            ));
            continue;
        };
        match rank(name) {
            None => {
                bad.insert(format!(
                    "{file}: `crate::{name}` goes through the facade (lib.rs); import it from the module that owns it"
                ));
            }
            Some(to) if to > from => {
                bad.insert(format!(
                    "{file}: `{top}` imports `{name}`, which is above it: move what it needs down, or the code up"
                ));
            }
            Some(_) => {}
        }
    }
    bad.into_iter().collect()
}

#[test]
fn modules_import_only_downward() {
    let order = order();
    let bad = violations(&order, &imports());
    assert!(
        bad.is_empty(),
        "{} import(s) break the layers:\n{}",
        bad.len(),
        bad.join("\n")
    );
}

/// Every module `lib.rs` declares (in its `modules!` list, or with a `mod` line) is
/// in a layer, and every layer's module exists.
#[test]
fn every_top_level_module_is_in_a_layer() {
    let root = src();
    let lib = code(&std::fs::read_to_string(root.join("lib.rs")).expect("lib.rs"));
    let mut declared: Vec<String> = Vec::new();
    if let Some(start) = lib.find("modules!(") {
        let list = &lib[start + "modules!(".len()..];
        let list = &list[..list.find(')').expect("the modules! list closes")];
        declared.extend(
            list.split(',')
                .map(|m| m.trim().to_string())
                .filter(|m| !m.is_empty()),
        );
    }
    for line in lib.lines() {
        let line = line.trim();
        if let Some(decl) = line
            .strip_prefix("pub mod ")
            .or_else(|| line.strip_prefix("pub(crate) mod "))
            .or_else(|| line.strip_prefix("mod "))
        {
            if !decl.contains('$') {
                declared.push(decl.trim_end_matches(';').trim().to_string());
            }
        }
    }
    assert!(declared.len() > 10, "lib.rs declares {declared:?}");
    let order = order();
    let missing: Vec<_> = declared
        .iter()
        .filter(|m| !order.contains(&m.as_str()))
        .collect();
    assert!(missing.is_empty(), "modules in no layer: {missing:?}");
    let absent: Vec<_> = order
        .iter()
        .filter(|m| !declared.iter().any(|d| d == *m))
        .collect();
    assert!(
        absent.is_empty(),
        "layers name modules lib.rs does not declare: {absent:?}"
    );
}

/// The check itself: an upward import, an import through the facade and a `super`
/// path out of the module are each found; imports in comments, strings and tests
/// are not.
#[test]
fn the_check_finds_upward_imports() {
    let order = ["error", "source", "write"];
    let path = |s: &str| module_path(Path::new(s));
    let edges = |file: &str, text: &str| -> Vec<(String, String, String)> {
        let p = path(file);
        let c = code(text);
        crate_paths(&c)
            .into_iter()
            .chain(escaping_super_paths(&c, &p))
            .map(|n| (file.to_string(), p[0].clone(), n))
            .collect()
    };
    let up = edges("source/x.rs", "use crate::write::Sink;\n");
    assert_eq!(violations(&order, &up).len(), 1);
    let facade = edges("source/x.rs", "use crate::{Error, error::Result};\n");
    assert_eq!(violations(&order, &facade).len(), 1, "{facade:?}");
    let climb = edges("source/dcp/x.rs", "use super::super::super::write::Sink;\n");
    assert_eq!(violations(&order, &climb).len(), 1, "{climb:?}");
    let inside = edges("source/dcp/x.rs", "use super::super::bytes::Blob;\n");
    assert!(violations(&order, &inside).is_empty(), "{inside:?}");
    let quiet = edges(
        "source/x.rs",
        "// crate::write::Sink\nlet s = \"crate::write\";\n#[cfg(test)]\nmod tests { use crate::write::Sink; }\n",
    );
    assert!(violations(&order, &quiet).is_empty(), "{quiet:?}");
    let down = edges(
        "write/x.rs",
        "use crate::{error::Error, source::{self, Blob}};\n",
    );
    assert!(violations(&order, &down).is_empty(), "{down:?}");
}
