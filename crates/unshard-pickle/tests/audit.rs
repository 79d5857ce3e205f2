//! The audit names every global and call outside the allowlist, on every path, with
//! the route that reaches it: picklescan's dangerous globals through every calling
//! opcode (`fixtures/hostile/picklescan/`, written by `fixtures/gen_hostile.py` from
//! the installed picklescan's own list), CPython's pickletester data, and hand-made
//! pickles for the routes a walk from the root would miss.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};

use unshard_pickle::{audit, parse, parse_partial, Audit, ErrorKind, Limits, Verdict};

fn hostile_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/hostile")
}

fn manifest() -> serde_json::Value {
    let text = std::fs::read_to_string(hostile_dir().join("manifest.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

/// Audit of a whole bare pickle, also when it breaks part-way.
fn audit_bytes(data: &[u8]) -> Audit {
    audit(&parse_partial(data, &Limits::default()).pickle)
}

fn names(a: &Audit) -> Vec<String> {
    a.findings.iter().map(|f| f.callable.clone()).collect()
}

#[test]
fn every_picklescan_dangerous_global_is_dangerous_through_every_route() {
    let manifest = manifest();
    let cases: Vec<&serde_json::Value> = manifest["cases"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c["file"].as_str().unwrap().starts_with("picklescan/"))
        .collect();
    // picklescan 1.x lists about 80 globals; each file uses one route in turn.
    assert!(cases.len() >= 60, "{}", cases.len());
    let mut routes = std::collections::BTreeSet::new();
    let mut missed_by_picklescan = 0;
    for c in &cases {
        let file = c["file"].as_str().unwrap();
        let want = c["callables"][0].as_str().unwrap();
        let route = c["route"].as_str().unwrap();
        let data = std::fs::read(hostile_dir().join(file)).unwrap();
        let a = audit_bytes(&data);
        let hit = a
            .findings
            .iter()
            .find(|f| f.callable == want)
            .unwrap_or_else(|| panic!("{file}: {want} not reported: {:?}", a.findings));
        assert_eq!(hit.verdict, Verdict::Dangerous, "{file}: {hit:?}");
        // The route names how the pickle reaches it.
        let expect_route = match route {
            "GLOBAL" => "GLOBAL (imported, not called)",
            "STACK_GLOBAL" => "REDUCE",
            "BUILD" => "BUILD __setstate__",
            other => other,
        };
        assert!(
            hit.route.contains(expect_route),
            "{file}: route {} for {route}",
            hit.route
        );
        routes.insert(route.to_string());
        if c["picklescan"]["verdict"] == "clean" {
            missed_by_picklescan += 1;
        }
    }
    assert_eq!(routes.len(), 11, "{routes:?}");
    // The EXT routes are the ones picklescan misses; the audit does not.
    assert!(missed_by_picklescan >= 15, "{missed_by_picklescan}");
}

#[test]
fn cpython_pickletester_data_is_unknown_not_safe_and_not_dangerous() {
    let dir = hostile_dir().join("pickletester");
    let mut seen = 0;
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        let data = std::fs::read(&path).unwrap();
        let p = parse(&data).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let a = audit(&p);
        assert!(
            names(&a).iter().any(|n| n == "__main__.C"),
            "{}: {a:?}",
            path.display()
        );
        assert_eq!(a.worst(), Some(Verdict::Unknown), "{}", path.display());
        // Protocols 0 and 1 (DATA0, DATA1, create_data_p0, _p1) build C with one
        // copy_reg._reconstructor(__main__.C, __builtin__.object, None)
        // (`pickletools.dis`): one finding, through that function.
        let name = path.file_name().unwrap().to_str().unwrap();
        if ["DATA0", "DATA1", "create_data_p0", "create_data_p1"]
            .iter()
            .any(|n| name.starts_with(&format!("{n}.")))
        {
            let found: Vec<_> = a
                .findings
                .iter()
                .map(|f| (f.callable.as_str(), f.route.as_str()))
                .collect();
            assert_eq!(
                found,
                [("__main__.C", "REDUCE via copy_reg._reconstructor")],
                "{name}"
            );
        }
        seen += 1;
    }
    assert!(seen >= 5, "{seen}");
}

#[test]
fn a_discarded_result_is_still_a_call() {
    // fickling's injection: exec(...) then POP, before the real data.
    let data = b"\x80\x02cbuiltins\nexec\nX\x02\x00\x00\x00idq\x00\x85R0}.";
    let p = parse(data).unwrap();
    assert!(p.dict_items(p.root()).is_some_and(<[_]>::is_empty));
    let a = audit(&p);
    assert_eq!(a.findings.len(), 1, "{a:?}");
    assert!(!a.is_clean());
    let f = &a.findings[0];
    // PROTO (2 bytes), GLOBAL (15), BINUNICODE (7), BINPUT (2), TUPLE1 (1): REDUCE at 27.
    assert_eq!(
        (f.callable.as_str(), f.route.as_str(), f.offset, f.verdict),
        ("builtins.exec", "REDUCE", 27, Verdict::Dangerous)
    );
}

#[test]
fn a_global_only_named_is_reported_as_imported() {
    let a = audit_bytes(b"\x80\x02cmymodule\nThing\n0N.");
    assert_eq!(a.findings.len(), 1);
    assert_eq!(a.findings[0].callable, "mymodule.Thing");
    assert_eq!(a.findings[0].route, "GLOBAL (imported, not called)");
    assert_eq!(a.findings[0].verdict, Verdict::Unknown);
}

#[test]
fn torch_state_dicts_are_clean() {
    let data = std::fs::read(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/torch_state_dict.pkl"),
    )
    .unwrap();
    let a = audit(&parse(&data).unwrap());
    assert!(a.is_clean(), "{a:?}");
}

#[test]
fn the_function_rebuild_from_type_calls_is_named() {
    // torch._tensor._rebuild_from_type_v2(posix.system, torch.Tensor, ('id',), {})
    let data = b"\x80\x02ctorch._tensor\n_rebuild_from_type_v2\n(cposix\nsystem\nctorch\nTensor\nX\x02\x00\x00\x00id\x85}tR.";
    let a = audit_bytes(data);
    assert_eq!(a.findings.len(), 1, "{a:?}");
    assert_eq!(a.findings[0].callable, "posix.system");
    assert_eq!(
        a.findings[0].route,
        "REDUCE via torch._tensor._rebuild_from_type_v2"
    );
}

#[test]
fn chains_that_produce_a_callable_are_rendered() {
    // functools.partial(posix.system, 'id')() and getattr(__import__('os'), 'system')('id')
    let partial = b"\x80\x02cfunctools\npartial\ncposix\nsystem\nX\x02\x00\x00\x00id\x86R)R.";
    let a = audit_bytes(partial);
    let p = parse(partial).unwrap();
    assert_eq!(
        unshard_pickle::audit::chain(&p, p.root()),
        "functools.partial(posix.system, 'id')()"
    );
    assert!(
        names(&a).contains(&"functools.partial(posix.system, 'id')".to_string()),
        "{a:?}"
    );
    let getattr = b"\x80\x02cbuiltins\ngetattr\ncbuiltins\n__import__\nX\x02\x00\x00\x00os\x85RX\x06\x00\x00\x00system\x86RX\x02\x00\x00\x00id\x85R.";
    let a = audit_bytes(getattr);
    assert!(
        names(&a).contains(&"builtins.getattr(builtins.__import__('os'), 'system')".to_string()),
        "{a:?}"
    );
    assert!(a.findings.iter().all(|f| f.verdict == Verdict::Dangerous));
}

#[test]
fn calls_before_a_parse_error_are_still_found() {
    // posix.system('id') runs under pickle.load before the unregistered EXT1 fails.
    let data = b"\x80\x02cposix\nsystem\nX\x02\x00\x00\x00id\x85R0\x82\x05.";
    let partial = parse_partial(data, &Limits::default());
    assert_eq!(
        partial.error.map(|e| e.kind),
        Some(ErrorKind::UnregisteredExtension(5))
    );
    assert_eq!(names(&audit(&partial.pickle)), ["posix.system"]);
}

#[test]
fn extension_codes_resolve_to_what_the_pickle_registered() {
    let data = b"\x80\x02ccopyreg\nadd_extension\n(X\x05\x00\x00\x00posixX\x06\x00\x00\x00systemK\x07tR0\x82\x07X\x02\x00\x00\x00id\x85R.";
    let p = parse(data).unwrap();
    let a = audit(&p);
    let ext = a
        .findings
        .iter()
        .find(|f| f.callable == "posix.system")
        .unwrap();
    assert_eq!(ext.route, "EXT1 (code 7) + REDUCE");
    assert!(names(&a).contains(&"copyreg.add_extension".to_string()));
}

#[test]
fn a_long_getattr_chain_stays_small() {
    // getattr(getattr(torch.Tensor, 'aaa…'), 'aaa…')…: 1500 steps of a 1000-char name
    // used to copy 1.1 GB of names; names are now bounded and the chain stops growing.
    let mut data =
        b"\x80\x02cbuiltins\ngetattr\nq\x00ctorch\nTensor\nq\x01X\xe8\x03\x00\x00".to_vec();
    data.extend([b'a'; 1000]);
    data.extend(b"q\x02");
    for _ in 0..1500 {
        data.extend(b"h\x00h\x01h\x02\x86Rq\x010");
    }
    data.extend(b"N.");
    let p = parse(&data).unwrap();
    let usage = p.usage();
    assert!(usage.payload_bytes < 64 << 10, "{usage:?}");
    // The chain is reported once, cut to a bounded length.
    let a = audit(&p);
    assert!(a.findings.iter().all(|f| f.callable.chars().count() < 600));
    assert!(names(&a).iter().any(|n| n == "builtins.getattr"));
}

#[test]
fn limits_left_after_one_pickle_bound_the_next() {
    let p = parse(b"\x80\x02X\x05\x00\x00\x00helloN\x86.").unwrap();
    let limits = Limits {
        max_payload_bytes: 8,
        ..Limits::default()
    };
    let left = limits.remaining_after(&p);
    assert_eq!(left.max_payload_bytes, 3);
    assert_eq!(left.max_nodes, Limits::default().max_nodes - 3);
    // The same string again no longer fits.
    let e = unshard_pickle::parse_with_limits(b"\x80\x02X\x05\x00\x00\x00hello.", &left)
        .expect_err("over the file's budget");
    assert!(matches!(e.kind, ErrorKind::LimitExceeded { .. }), "{e}");
}

#[test]
fn repeated_calls_of_a_global_are_logged_once_unless_their_function_argument_differs() {
    // 1000 x OrderedDict(), then _rebuild_from_type_v2 with torch's own function and
    // then with posix.system as its first argument.
    let mut data = b"\x80\x02ccollections\nOrderedDict\nq\x00".to_vec();
    for _ in 0..1000 {
        data.extend(b"h\x00)R0");
    }
    let rebuild = |func: &[u8]| {
        let mut v = b"ctorch._tensor\n_rebuild_from_type_v2\n(".to_vec();
        v.extend(func);
        v.extend(b"ctorch\nTensor\n)}tR0");
        v
    };
    data.extend(rebuild(b"ctorch._utils\n_rebuild_tensor_v2\n"));
    data.extend(rebuild(b"cposix\nsystem\n"));
    data.extend(b"N.");
    let p = parse(&data).unwrap();
    assert_eq!(p.trace().calls.len(), 3);
    let a = audit(&p);
    assert_eq!(names(&a), ["posix.system"]);
    assert_eq!(
        a.findings[0].route,
        "REDUCE via torch._tensor._rebuild_from_type_v2"
    );
}

#[test]
fn a_pickle_inside_bytes_given_to_pickle_loads_is_audited_too() {
    // pickle.loads(b"<posix.system('id')>"): the inner call is named, with its route.
    let inner = b"\x80\x02cposix\nsystem\nX\x02\x00\x00\x00id\x85R.";
    let mut data = b"\x80\x02cpickle\nloads\nC".to_vec();
    data.push(u8::try_from(inner.len()).unwrap());
    data.extend(inner);
    data.extend(b"\x85R.");
    let a = audit_bytes(&data);
    let hit = a
        .findings
        .iter()
        .find(|f| f.callable == "posix.system")
        .unwrap_or_else(|| panic!("{a:?}"));
    // Inner: PROTO (2), GLOBAL (14), BINUNICODE (7), TUPLE1 (1): REDUCE at 24.
    assert_eq!(
        hit.route,
        "REDUCE at byte 24 of a pickle passed to pickle.loads"
    );
    // At the offset of the outer call (`pickletools.dis`: REDUCE at 45), where a
    // reader of the outer file finds it.
    assert_eq!(hit.offset, 45);
    assert_eq!(hit.verdict, Verdict::Dangerous);
    assert!(names(&a).contains(&"pickle.loads".to_string()));
}

/// `pickle.loads(<bytes>)` around a pickle.
fn passed_to_loads(inner: &[u8]) -> Vec<u8> {
    let mut data = b"\x80\x02cpickle\nloads\nB".to_vec();
    data.extend(u32::try_from(inner.len()).unwrap().to_le_bytes());
    data.extend(inner);
    data.extend(b"\x85R.");
    data
}

#[test]
fn pickles_are_looked_into_three_levels_deep() {
    // posix.system('id') inside three pickle.loads is found; inside four, the
    // innermost pickle.loads is reported (dangerous) but not looked into.
    let payload = b"\x80\x02cposix\nsystem\nX\x02\x00\x00\x00id\x85R.".to_vec();
    let three = (0..3).fold(payload, |inner, _| passed_to_loads(&inner));
    let a = audit_bytes(&three);
    assert!(names(&a).contains(&"posix.system".to_string()), "{a:?}");
    let four = passed_to_loads(&three);
    let a = audit_bytes(&four);
    assert!(!names(&a).contains(&"posix.system".to_string()), "{a:?}");
    assert_eq!(a.worst(), Some(Verdict::Dangerous));
    assert!(!a.is_clean());
}

#[test]
fn findings_beyond_the_cap_inside_a_nested_pickle_are_counted() {
    // 300 distinct unknown globals named in a pickle given to pickle.loads: with the
    // loader itself, 301 distinct findings, of which MAX_FINDINGS are kept.
    let mut inner = b"\x80\x02".to_vec();
    for i in 0..300 {
        inner.extend(format!("cmymodule\nThing{i}\n0").bytes());
    }
    inner.extend(b"N.");
    let a = audit_bytes(&passed_to_loads(&inner));
    assert_eq!(a.findings.len(), unshard_pickle::audit::MAX_FINDINGS);
    assert_eq!(a.findings.len() + a.omitted, 301, "{}", a.omitted);
    assert!(!a.is_clean());
}

#[test]
fn the_verdicts_are_spelled_as_the_cli_documents() {
    // docs/cli.md, `scan`: `dangerous` and `unknown`.
    assert_eq!(Verdict::Dangerous.as_str(), "dangerous");
    assert_eq!(Verdict::Unknown.as_str(), "unknown");
}

#[test]
fn a_nested_class_named_through_getattr_by_torch_is_data_and_no_other_getattr_is() {
    // torch.save (protocol 2) of an FSDP sharded state dict names
    // ShardedTensor.ProcessGroupState as __builtin__.getattr(ShardedTensor,
    // 'ProcessGroupState') (`pickletools.dis` of the file's data.pkl).
    let zip = std::fs::read(
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../fixtures/sharded/fsdp1_sharded_w2_ranks/model_world_size_2_rank_0.pt"),
    )
    .unwrap();
    // The first entry, data.pkl, stored: its bytes follow the local header, the
    // name and the extra field.
    assert_eq!(&zip[..4], b"PK\x03\x04");
    let name_len = usize::from(u16::from_le_bytes([zip[26], zip[27]]));
    let extra_len = usize::from(u16::from_le_bytes([zip[28], zip[29]]));
    assert!(zip[30..30 + name_len].ends_with(b"/data.pkl"));
    let p = parse(&zip[30 + name_len + extra_len..]).unwrap();
    let getattr_calls = p
        .trace()
        .calls
        .iter()
        .filter(|c| unshard_pickle::audit::chain(&p, c.callable) == "__builtin__.getattr")
        .count();
    assert!(getattr_calls > 0);
    let a = audit(&p);
    assert!(a.is_clean(), "{a:?}");

    // The same arguments to another attribute, to another builtin, or to a getattr
    // of another module run code of the pickle's choosing.
    let sharded = "ctorch.distributed._shard.sharded_tensor.api\nShardedTensor\n";
    for (callable, attr, want) in [
        (
            "c__builtin__\ngetattr\n",
            "__reduce_ex__",
            "__builtin__.getattr",
        ),
        (
            "cbuiltins\ndelattr\n",
            "ProcessGroupState",
            "builtins.delattr",
        ),
        (
            "cmymodule\ngetattr\n",
            "ProcessGroupState",
            "mymodule.getattr",
        ),
    ] {
        let mut data = b"\x80\x02".to_vec();
        data.extend(callable.bytes());
        data.extend(sharded.bytes());
        data.push(b'X');
        data.extend(u32::try_from(attr.len()).unwrap().to_le_bytes());
        data.extend(attr.bytes());
        data.extend(b"\x86R.");
        let a = audit_bytes(&data);
        assert!(
            names(&a).contains(&want.to_string()),
            "{callable} {attr}: {a:?}"
        );
    }
}

/// `BINBYTES` of `data`.
fn binbytes(data: &[u8]) -> Vec<u8> {
    let mut v = b"B".to_vec();
    v.extend(u32::try_from(data.len()).unwrap().to_le_bytes());
    v.extend(data);
    v
}

#[test]
fn a_pickle_reaches_a_loader_through_partial_and_bytesio_and_nothing_else() {
    let payload = b"\x80\x02cposix\nsystem\nX\x02\x00\x00\x00id\x85R.";
    let with = |head: &[u8], tail: &[u8]| {
        let mut data = b"\x80\x02".to_vec();
        data.extend(head);
        data.extend(binbytes(payload));
        data.extend(tail);
        data
    };
    // functools.partial(pickle.loads)(payload), torch.load(io.BytesIO(payload)).
    for (data, loader) in [
        (
            with(b"cfunctools\npartial\ncpickle\nloads\n\x85R", b"\x85R."),
            "pickle.loads",
        ),
        (
            with(b"ctorch\nload\nc_io\nBytesIO\n", b"\x85R\x85R."),
            "torch.load",
        ),
    ] {
        let a = audit_bytes(&data);
        let hit = a
            .findings
            .iter()
            .find(|f| f.callable == "posix.system")
            .unwrap_or_else(|| panic!("{a:?}"));
        assert!(
            hit.route.ends_with(&format!("passed to {loader}")),
            "{}",
            hit.route
        );
    }
    // A pickle kept as data (bytearray(b'\x80...')) is not unpickled by torch.load.
    let a = audit_bytes(&with(b"cbuiltins\nbytearray\n", b"\x85R."));
    assert!(a.is_clean(), "{a:?}");
}

#[test]
fn chains_are_cut_in_depth_and_in_length_and_marked_where_cut() {
    let chain_of = |data: &[u8]| {
        let p = parse(data).unwrap();
        unshard_pickle::audit::chain(&p, p.root())
    };
    // Ten partials nested through the arguments:
    // functools.partial(functools.partial(...(posix.system)...)).
    let mut data = b"\x80\x02cfunctools\npartial\nq\x000".to_vec();
    data.extend(b"h\x00".repeat(10));
    data.extend(b"cposix\nsystem\n");
    data.extend(b"\x85R".repeat(10));
    data.push(b'.');
    let c = chain_of(&data);
    assert!(c.contains('\u{2026}'), "{c}");
    assert!(c.matches("functools.partial").count() < 10, "{c}");
    // Ten calls nested through the callable: posix.system()()()...().
    let mut data = b"\x80\x02cposix\nsystem\n".to_vec();
    data.extend(b")R".repeat(10));
    data.push(b'.');
    let c = chain_of(&data);
    assert!(c.contains('\u{2026}'), "{c}");
    assert!(c.matches("()").count() < 10, "{c}");
    // Three levels of three arguments each of a 35-character string: some 1300
    // characters in full, cut to a few hundred.
    let mut data = b"\x80\x02cposix\nsystem\nq\x000X\x23\x00\x00\x00".to_vec();
    data.extend([b's'; 35]);
    data.extend(b"q\x010");
    for (arg, memo) in [(1u8, 2u8), (2, 3)] {
        data.extend([
            b'h', 0, b'h', arg, b'h', arg, b'h', arg, 0x87, b'R', b'q', memo, b'0',
        ]);
    }
    data.extend(b"h\x00h\x03h\x03h\x03\x87R.");
    let c = chain_of(&data);
    assert!(
        c.starts_with("posix.system(posix.system(posix.system('sss"),
        "{c}"
    );
    assert!(c.chars().count() < 600, "{}: {c}", c.chars().count());
    assert!(c.contains('\u{2026}'), "{c}");
}

#[test]
fn strings_in_a_chain_escape_control_characters_only() {
    // posix.system('a\nb é\'\\')
    let text = "a\nb \u{e9}'\\";
    let mut data = b"\x80\x02cposix\nsystem\nX".to_vec();
    data.extend(u32::try_from(text.len()).unwrap().to_le_bytes());
    data.extend(text.as_bytes());
    data.extend(b"\x85R.");
    let p = parse(&data).unwrap();
    assert_eq!(
        unshard_pickle::audit::chain(&p, p.root()),
        "posix.system('a\\nb \u{e9}\\'\\\\')"
    );
}
