//! Any bytes: `parse` returns, never panics, and a parsed arena can be described node
//! by node (which is what error messages and `inspect` do with untrusted files); the
//! audit of what a pickle would run, complete or broken, returns bounded findings.
#![no_main]

use libfuzzer_sys::fuzz_target;
use unshard_pickle::{audit, parse_partial, parse_prefix, Limits};

fuzz_target!(|data: &[u8]| {
    // Small limits keep each run cheap and exercise the limit paths too.
    let limits = Limits {
        max_nodes: 100_000,
        max_container_len: 100_000,
        max_payload_bytes: 1 << 20,
        max_memo: 100_000,
        max_marks: 1_000,
    };
    if let Ok((pickle, end)) = parse_prefix(data, &limits) {
        assert!(end <= data.len());
        for id in pickle.ids() {
            let _ = pickle.describe(id);
            let _ = pickle.object(id);
        }
        let _ = pickle.describe(pickle.root());
    }
    let partial = parse_partial(data, &limits);
    let findings = audit(&partial.pickle);
    assert!(findings.findings.len() <= unshard_pickle::audit::MAX_FINDINGS);
    for f in &findings.findings {
        assert!(f.callable.chars().count() < 1024);
    }
});
