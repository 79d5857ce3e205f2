//! Which globals and calls of a pickle would run code under `torch.load`.
//!
//! [`audit`] reads a pickle's [`crate::Trace`] (every global named and every call
//! asked for, on every path, with byte offsets) and reports each one outside the
//! allowlist of [`names::allowed`] as a [`Finding`]: the callable's full name, or the
//! chain of calls that produces it (`functools.partial(posix.system, 'id')`,
//! `builtins.getattr(builtins.__import__('os'), 'system')`), the route (the opcode that
//! calls it, with `EXT` and `BUILD __setstate__` spelled out), and the offset.
//!
//! Nothing is "safe" because it is absent from a list of bad names: a global outside
//! the allowlist is [`Verdict::Unknown`] at best, [`Verdict::Dangerous`] when
//! [`names::dangerous`] knows it. Both run under `torch.load(weights_only=False)`:
//! importing a module runs its code, and calling an unknown class runs its
//! constructor.
//!
//! Work is linear in the trace: each call site and global is looked at once, chains
//! are rendered to a bounded depth and length, and at most [`MAX_FINDINGS`] distinct
//! findings are kept (the rest are counted).

pub mod names;
mod nested;

use std::collections::{HashMap, HashSet};
use std::fmt::Write;

use crate::opcode;
use crate::trace::opcode_name;
use crate::{NodeId, Pickle, Value};

/// Findings kept per pickle; further distinct ones are only counted.
pub const MAX_FINDINGS: usize = 256;
/// Characters of a rendered callable chain.
const MAX_CHAIN_CHARS: usize = 240;
/// Calls nested inside a rendered chain.
const MAX_CHAIN_DEPTH: usize = 4;
/// Arguments shown per call in a chain.
const MAX_CHAIN_ARGS: usize = 3;

/// How bad a finding is known to be.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Verdict {
    /// Outside the allowlist and not known to be harmful: it still runs (an import, a
    /// constructor) and nothing vouches for it.
    Unknown,
    /// Known to run code, touch files or the network, or load another pickle.
    Dangerous,
}

impl Verdict {
    /// `"dangerous"` or `"unknown"`.
    pub fn as_str(self) -> &'static str {
        match self {
            Verdict::Unknown => "unknown",
            Verdict::Dangerous => "dangerous",
        }
    }
}

/// Something that would run under `torch.load`.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Finding {
    /// The callable's full name (`posix.system`) or the chain producing it
    /// (`functools.partial(posix.system, 'id')`). Printable: control characters are
    /// escaped, and it is cut at a bounded length.
    pub callable: String,
    /// How the pickle reaches it: the calling opcode (`REDUCE`, `NEWOBJ`, `INST`,
    /// `OBJ`, `BUILD __setstate__`), `EXT1 (code 7) + REDUCE` for a global from the
    /// extension registry, `REDUCE via torch._tensor._rebuild_from_type_v2` for a
    /// function torch's rebuild calls, or `GLOBAL (imported, not called)` for a global
    /// that is only named (importing runs the module's code).
    pub route: String,
    /// Byte offset of the opcode in the pickle.
    pub offset: usize,
    pub verdict: Verdict,
}

/// The findings of one pickle, in file order.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Audit {
    pub findings: Vec<Finding>,
    /// Distinct findings beyond [`MAX_FINDINGS`], not kept.
    pub omitted: usize,
}

impl Audit {
    /// Whether nothing outside the allowlist was found.
    pub fn is_clean(&self) -> bool {
        self.findings.is_empty() && self.omitted == 0
    }

    /// The worst verdict, if any.
    pub fn worst(&self) -> Option<Verdict> {
        self.findings.iter().map(|f| f.verdict).max()
    }
}

/// Functions on the allowlist that call one of their arguments: torch's
/// `_rebuild_from_type_v2(func, new_type, args, state)` calls `func(*args)`, and
/// copyreg's helpers instantiate the class they are given.
const CALLS_ARGUMENT: &[(&str, &str, usize)] = &[
    ("torch._tensor", "_rebuild_from_type_v2", 0),
    ("copyreg", "_reconstructor", 0),
    ("copy_reg", "_reconstructor", 0),
    ("copyreg", "__newobj__", 0),
    ("copy_reg", "__newobj__", 0),
    ("copyreg", "__newobj_ex__", 0),
    ("copy_reg", "__newobj_ex__", 0),
];

/// Classifies every global and call of a pickle (see the module docs), and of the
/// pickles it hands to `pickle.loads`, `numpy.load` and the like.
pub fn audit(p: &Pickle) -> Audit {
    audit_at(p, 0)
}

fn audit_at(p: &Pickle, depth: usize) -> Audit {
    let extensions = p
        .trace()
        .globals
        .iter()
        .filter_map(|g| g.ext_code.map(|code| (g.node, (g.opcode, code))))
        .collect();
    let mut auditor = Auditor {
        p,
        extensions,
        audit: Audit::default(),
        seen: HashSet::new(),
        called: HashSet::new(),
        depth,
        nested_seen: HashSet::new(),
    };
    auditor.calls();
    auditor.globals();
    auditor.audit.findings.sort_by_key(|f| f.offset);
    auditor.audit
}

struct Auditor<'a> {
    p: &'a Pickle,
    /// Global nodes that came from the extension registry: `(EXT opcode, code)`.
    extensions: HashMap<NodeId, (u8, i64)>,
    audit: Audit,
    /// `(callable, route)` already reported: a payload repeated a thousand times is
    /// one finding.
    seen: HashSet<(String, String)>,
    /// Global nodes reported as called (or inside a reported chain), so that they are
    /// not reported again as merely named.
    called: HashSet<NodeId>,
    /// How many pickles this one is inside.
    depth: usize,
    /// Bytes nodes already looked into for a nested pickle.
    nested_seen: HashSet<NodeId>,
}

impl Auditor<'_> {
    fn calls(&mut self) {
        let p = self.p;
        for call in &p.trace().calls {
            let route = self.route_of(call.opcode, call.callable);
            if self.depth < nested::MAX_NESTING {
                if let Some(loader) = nested::loader(p, call.callable) {
                    self.nested(&loader, call.args, call.offset);
                }
            }
            match p.get(call.callable) {
                Value::Global(g) if names::allowed(&g.module, &g.name) => {
                    self.called.insert(call.callable);
                    for &(m, n, index) in CALLS_ARGUMENT {
                        if g.module != m || g.name != n {
                            continue;
                        }
                        let Some(&func) = p.items(call.args).and_then(|a| a.get(index)) else {
                            continue;
                        };
                        if is_allowed_global(p, func) {
                            continue;
                        }
                        let route = format!("{route} via {m}.{n}");
                        self.report_chain(func, route, call.offset);
                    }
                }
                _ if self.nested_class(call.callable, call.args) => {
                    self.called.insert(call.callable);
                }
                _ => self.report_chain(call.callable, route, call.offset),
            }
        }
    }

    fn globals(&mut self) {
        let p = self.p;
        for g in &p.trace().globals {
            if self.called.contains(&g.node) || is_allowed_global(p, g.node) {
                continue;
            }
            let Value::Global(name) = p.get(g.node) else {
                continue;
            };
            let verdict = if names::dangerous(&name.module, &name.name) {
                Verdict::Dangerous
            } else {
                Verdict::Unknown
            };
            let mut callable = String::new();
            push_name(&mut callable, &name.module, &name.name);
            let via = match (g.ext_code, g.opcode) {
                (Some(code), op) => format!("{} (code {code})", opcode_name(op)),
                // A name `getattr(<global>, 'attr')` produced.
                (None, opcode::REDUCE) => "REDUCE of getattr".to_string(),
                (None, op) => opcode_name(op).to_string(),
            };
            let route = format!("{via} (imported, not called)");
            self.push(Finding {
                callable,
                route,
                offset: g.offset,
                verdict,
            });
        }
    }

    /// Whether this is `getattr(<allowed class>, 'Name')` naming an allowed nested
    /// class: how protocols before 4 write a nested class (`ShardedTensor.
    /// ProcessGroupState`). Any other getattr is reported.
    fn nested_class(&self, callable: NodeId, args: NodeId) -> bool {
        let p = self.p;
        let Value::Global(g) = p.get(callable) else {
            return false;
        };
        if !matches!(g.module.as_str(), "builtins" | "__builtin__") || g.name != "getattr" {
            return false;
        }
        match p.items(args) {
            Some(&[owner, attr]) => match (p.get(owner), p.as_str(attr)) {
                (Value::Global(o), Some(attr)) => {
                    names::allowed(&o.module, &o.name)
                        && names::allowed(&o.module, &format!("{}.{attr}", o.name))
                }
                _ => false,
            },
            _ => false,
        }
    }

    /// The route of a call: its opcode, with where the callable came from when that
    /// is the extension registry.
    fn route_of(&self, code: u8, callable: NodeId) -> String {
        let call = match code {
            opcode::BUILD => "BUILD __setstate__".to_string(),
            other => opcode_name(other).to_string(),
        };
        match self.extensions.get(&callable) {
            Some(&(ext, code)) => format!("{} (code {code}) + {call}", opcode_name(ext)),
            None => call,
        }
    }

    /// Reports what the pickles handed to `loader` would run, at the loader call's
    /// offset, with the inner route and offset in the route.
    fn nested(&mut self, loader: &str, args: NodeId, offset: usize) {
        for inner in nested::pickles_in_args(self.p, args, &mut self.nested_seen) {
            let found = audit_at(&inner, self.depth + 1);
            for f in found.findings {
                self.push(Finding {
                    route: format!(
                        "{} at byte {} of a pickle passed to {loader}",
                        f.route, f.offset
                    ),
                    offset,
                    ..f
                });
            }
            self.audit.omitted += found.omitted;
        }
    }

    /// Reports a call of `callable`, rendered as a chain.
    fn report_chain(&mut self, callable: NodeId, route: String, offset: usize) {
        let mut chain = Chain {
            p: self.p,
            out: String::new(),
            verdict: Verdict::Unknown,
            globals: Vec::new(),
        };
        chain.render(callable, 0);
        self.called.extend(chain.globals.iter().copied());
        let verdict = chain.verdict;
        self.push(Finding {
            callable: chain.out,
            route,
            offset,
            verdict,
        });
    }

    fn push(&mut self, finding: Finding) {
        if !self
            .seen
            .insert((finding.callable.clone(), finding.route.clone()))
        {
            return;
        }
        if self.audit.findings.len() >= MAX_FINDINGS {
            self.audit.omitted += 1;
            return;
        }
        self.audit.findings.push(finding);
    }
}

fn is_allowed_global(p: &Pickle, id: NodeId) -> bool {
    matches!(p.get(id), Value::Global(g) if names::allowed(&g.module, &g.name))
}

/// A node as the chain of calls that produces it, bounded in depth and length:
/// `functools.partial(posix.system)`, `posix.system('id')`, `torch.Size((2, 3))` is
/// shown as `torch.Size(<tuple>)`. For messages that name what an opaque object is.
pub fn chain(p: &Pickle, id: NodeId) -> String {
    let mut chain = Chain {
        p,
        out: String::new(),
        verdict: Verdict::Unknown,
        globals: Vec::new(),
    };
    chain.render(id, 0);
    chain.out
}

/// Renders a callable (a global, or an object made by calls) as a bounded chain and
/// notes the globals in it.
struct Chain<'a> {
    p: &'a Pickle,
    out: String,
    verdict: Verdict,
    globals: Vec<NodeId>,
}

impl Chain<'_> {
    fn full(&self) -> bool {
        self.out.chars().count() >= MAX_CHAIN_CHARS
    }

    fn render(&mut self, id: NodeId, depth: usize) {
        if self.full() {
            if !self.out.ends_with('…') {
                self.out.push('…');
            }
            return;
        }
        let p = self.p;
        match p.get(id) {
            Value::Global(g) => {
                self.globals.push(id);
                if !names::allowed(&g.module, &g.name) && names::dangerous(&g.module, &g.name) {
                    self.verdict = Verdict::Dangerous;
                }
                push_name(&mut self.out, &g.module, &g.name);
            }
            Value::Object { callable, args, .. } => {
                if depth >= MAX_CHAIN_DEPTH {
                    self.out.push('…');
                    return;
                }
                self.render(*callable, depth + 1);
                self.out.push('(');
                let args = p.items(*args).unwrap_or_default();
                for (i, &arg) in args.iter().enumerate() {
                    if i > 0 {
                        self.out.push_str(", ");
                    }
                    if i == MAX_CHAIN_ARGS {
                        self.out.push_str("...");
                        break;
                    }
                    self.render(arg, depth + 1);
                }
                self.out.push(')');
            }
            Value::Str(s) => {
                let mut quoted = String::new();
                push_quoted(&mut quoted, s, 40);
                self.out.push_str(&quoted);
            }
            Value::Int(i) => {
                let _ = write!(self.out, "{i}");
            }
            Value::Bool(b) => self.out.push_str(if *b { "True" } else { "False" }),
            Value::None => self.out.push_str("None"),
            Value::PersistentId(_) => self.out.push_str("<persistent id>"),
            other => {
                let _ = write!(self.out, "<{}>", other.type_name());
            }
        }
    }
}

/// `module.name`, control characters escaped, each part cut at 120 characters.
fn push_name(out: &mut String, module: &str, name: &str) {
    push_printable(out, module, 120);
    out.push('.');
    push_printable(out, name, 120);
}

fn push_printable(out: &mut String, text: &str, max: usize) {
    for (i, c) in text.chars().enumerate() {
        if i == max {
            out.push('…');
            return;
        }
        if c.is_control() {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
}

/// `'text'` with quotes, backslashes and control characters escaped, cut at `max`.
fn push_quoted(out: &mut String, text: &str, max: usize) {
    out.push('\'');
    for (i, c) in text.chars().enumerate() {
        if i == max {
            out.push('…');
            break;
        }
        match c {
            '\'' => out.push_str("\\'"),
            '\\' => out.push_str("\\\\"),
            c if c.is_control() => out.extend(c.escape_default()),
            c => out.push(c),
        }
    }
    out.push('\'');
}
