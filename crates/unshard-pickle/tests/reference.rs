//! Pickles written by CPython (see `gen_pickles.py`) parse to the values CPython loads.

mod common;

use common::{load, read, render, render_node};
use unshard_pickle::{parse_prefix, Limits, NodeId, ObjectKind, Value};

const NESTED: &str = "{'ints': [0, 1, -1, 255, 256, 65535, 65536, -123456, 2147483647, \
    -2147483648, 9223372036854775807, -9223372036854775808], 'floats': [1.5, -0.25], \
    'text': ['', 'abc', 'h\u{e9}llo \u{20ac} \u{1f600}', 'back\\\\slash\\nnewline'], \
    'bytes': [b'', b'\\x00\\x01\\xff'], 'consts': (None, True, False), \
    'tuples': ((), (1,), (1, 2), (1, 2, 3), (1, 2, 3, 4)), \
    'nested': {'x': [], 'y': {}, 'z': [[1], [2, [3]]]}, 1: 'int key'}";

#[test]
fn every_protocol_gives_the_same_nested_tree() {
    for proto in 0..=5 {
        let p = load(&format!("nested_p{proto}.pkl"));
        assert_eq!(render(&p), NESTED, "protocol {proto}");
    }
}

#[test]
fn ordered_dict_keeps_insertion_order_and_ignores_its_metadata_attribute() {
    for proto in [0, 2, 4] {
        let p = load(&format!("ordered_dict_p{proto}.pkl"));
        assert!(
            matches!(p.get(p.root()), Value::Dict(_)),
            "protocol {proto}"
        );
        assert_eq!(
            render(&p),
            "{'zeta': 1, 'alpha': 2, 'mid': 3}",
            "protocol {proto}"
        );
    }
}

#[test]
fn memo_shares_one_node_instead_of_copying() {
    for proto in [0, 2, 4] {
        let p = load(&format!("shared_p{proto}.pkl"));
        let items = p.items(p.root()).expect("a list");
        assert_eq!(items.len(), 2);
        assert_eq!(items[0], items[1], "protocol {proto}: a=[1]; [a, a]");
        assert_eq!(render(&p), "[[1], [1]]");
    }
}

#[test]
fn self_containing_list_is_a_cycle_in_the_arena() {
    for proto in [0, 2, 4] {
        let p = load(&format!("self_list_p{proto}.pkl"));
        assert_eq!(p.items(p.root()), Some(&[p.root()][..]), "protocol {proto}");
    }
}

#[test]
fn recursive_tuple_uses_pop_and_pop_mark_and_closes_the_cycle() {
    for proto in [0, 1, 2, 4] {
        let p = load(&format!("recursive_tuple_p{proto}.pkl"));
        let tuple = p.root();
        assert!(matches!(p.get(tuple), Value::Tuple(_)), "protocol {proto}");
        let list = p.items(tuple).expect("tuple")[0];
        assert_eq!(p.items(list), Some(&[tuple][..]), "protocol {proto}");
    }
}

#[test]
fn big_ints_cross_the_i64_boundaries_identically_in_text_and_binary() {
    let text = load("big_ints_p0.pkl");
    let binary = load("big_ints_p2.pkl");
    assert_eq!(render(&text), render(&binary));
    let items = binary.items(binary.root()).expect("a list");
    assert_eq!(binary.as_int(items[0]), Some(i64::MAX));
    assert_eq!(
        binary.get(items[1]),
        &Value::BigInt(vec![0, 0, 0, 0, 0, 0, 0, 0x80, 0])
    );
    assert_eq!(binary.as_int(items[2]), Some(i64::MIN));
    assert_eq!(
        render_node(&binary, items[3]),
        "-9223372036854775809",
        "-(2**63) - 1"
    );
    assert_eq!(
        render_node(&binary, items[5]),
        "1267650600228229401496703205376"
    );
    assert_eq!(render_node(&binary, items[6]), "-1180591620717411303424");
    // 2**3000 and its negation travel as LONG4 (376 bytes).
    let mut pos = vec![0u8; 375];
    pos.push(0x01);
    let mut neg = vec![0u8; 375];
    neg.push(0xff);
    assert_eq!(binary.get(items[7]), &Value::BigInt(pos));
    assert_eq!(binary.get(items[8]), &Value::BigInt(neg));
    let decimal = render_node(&text, items[7]);
    assert_eq!(decimal.len(), 904);
    assert!(decimal.starts_with("1230231922161117176931558813276752514640713895736833"));
    assert!(decimal.ends_with("9079911291512399773872178519018229989376"));
}

#[test]
fn floats_keep_sign_infinity_and_nan_in_text_and_binary() {
    for name in ["floats_p0.pkl", "floats_p2.pkl"] {
        let p = load(name);
        let floats: Vec<f64> = p
            .items(p.root())
            .expect("a list")
            .iter()
            .map(|&id| p.as_float(id).expect("a float"))
            .collect();
        assert_eq!(floats.len(), 9, "{name}");
        assert!(
            floats[1] == 0.0 && floats[1].is_sign_negative(),
            "{name}: -0.0"
        );
        assert_eq!(
            floats[2..7],
            [1.5, -2.25e-300, 1e308, f64::INFINITY, f64::NEG_INFINITY]
        );
        assert!(floats[7].is_nan(), "{name}");
        assert_eq!(floats[8], 0.1, "{name}: repr round trip");
    }
}

#[test]
fn bytes_and_bytearray_are_bytes_in_every_protocol() {
    // Protocols 0-2 write `_codecs.encode(text, 'latin1')`, 3-4 BINBYTES, and
    // bytearray is a REDUCE before protocol 5's BYTEARRAY8.
    for proto in 0..=5 {
        let p = load(&format!("bytes_p{proto}.pkl"));
        assert_eq!(
            render(&p),
            r"[b'', b'\x00\x01\xff', b'ab', b'']",
            "protocol {proto}"
        );
    }
}

#[test]
fn sets_and_frozensets_are_data_in_every_protocol() {
    for proto in [0, 2, 4] {
        let p = load(&format!("sets_p{proto}.pkl"));
        assert_eq!(
            render(&p),
            "[set([1, 2, 3]), frozenset([4, 5]), set([]), frozenset([])]",
            "protocol {proto}"
        );
    }
}

#[test]
fn class_instance_becomes_an_object_with_its_build_state() {
    for proto in [2, 4] {
        let p = load(&format!("instance_p{proto}.pkl"));
        let obj = p.object(p.root()).expect("an object");
        assert_eq!(obj.kind, ObjectKind::NewObj);
        assert!(obj.is("geometry", "Point"));
        assert!(obj.args.is_empty());
        let state = obj.state.expect("BUILD state");
        assert_eq!(p.dict_get(state, "x").and_then(|x| p.as_int(x)), Some(1));
        assert_eq!(
            p.dict_get(state, "y").and_then(|y| p.as_str(y)),
            Some("two")
        );
    }
    // Protocol 0 goes through copy_reg._reconstructor, which stays an object too.
    let p = load("instance_p0.pkl");
    assert_eq!(
        render(&p),
        "Reduce<copy_reg._reconstructor(geometry.Point, __builtin__.object, None) \
         state={'x': 1, 'y': 'two'}>"
    );
}

#[test]
fn newobj_ex_keeps_positional_args_and_drops_keywords() {
    let p = load("keyworded_p4.pkl");
    assert_eq!(
        render(&p),
        "NewObj<geometry.Keyworded(1,) state={'a': 1, 'b': 2}>"
    );
}

#[test]
fn nested_class_via_getattr_or_dotted_name_is_one_global() {
    for proto in [2, 4] {
        let p = load(&format!("nested_class_p{proto}.pkl"));
        assert_eq!(
            p.global(p.root()),
            Some(("geometry", "Outer.Inner")),
            "protocol {proto}"
        );
    }
}

#[test]
fn os_system_stays_an_inert_object() {
    for proto in [0, 2] {
        let p = load(&format!("os_system_p{proto}.pkl"));
        let obj = p.object(p.root()).expect("an object");
        assert_eq!(obj.kind, ObjectKind::Reduce);
        assert_eq!(obj.global, Some(("posix", "system")));
        assert_eq!(obj.args.len(), 1);
        assert_eq!(p.as_str(obj.args[0]), Some("echo pwned"));
        assert_eq!(p.describe(p.root()), "object posix.system(...)");
    }
}

#[test]
fn persistent_ids_wrap_their_tuple() {
    let p = load("persid_p2.pkl");
    assert_eq!(render(&p), "{'w': pid('storage', '0', 'cpu', 6)}");
    let w = p.dict_get(p.root(), "w").expect("key w");
    let pid = p.persistent_id(w).expect("a persistent id");
    assert_eq!(p.items(pid).map(<[NodeId]>::len), Some(4));
}

#[test]
fn protocol_0_text_opcodes_decode_like_python_2() {
    let p = load("text_opcodes_p0.pkl");
    assert_eq!(
        render(&p),
        "['plain', 'it\\'s AA\\n\\\\ \u{e9}', 'unicode \u{e9}\u{20ac}\u{1f600} \\\\\\\\u0041', \
         True, False, -42, 12345678901234567890, 123456789012345678901234567890, -5, 1.5, \
         -inf, None, Inst<geometry.Point() state={'x': 1, 'y': 2}>, pid('storage-key'), 'plain']"
    );
    let items = p.items(p.root()).expect("a list");
    // INT 01 / INT 00 are booleans, not ints.
    assert_eq!(p.as_bool(items[3]), Some(true));
    assert_eq!(p.as_int(items[3]), None);
    // GET 1 shares the node PUT 1 stored.
    assert_eq!(items[0], items[14]);
}

#[test]
fn protocol_1_binary_opcodes_include_obj_dup_pop_and_pop_mark() {
    let p = load("binary_opcodes_p1.pkl");
    assert_eq!(
        render(&p),
        "['abc', '\u{e9}\u{ff}', 7, 256, -1, 1.5, Inst<geometry.Point(5, 6)>, None, None]"
    );
    let items = p.items(p.root()).expect("a list");
    assert_eq!(items[7], items[8], "DUP pushes the same node");
}

#[test]
fn protocol_5_wide_opcodes_parse() {
    let p = load("wide_opcodes_p5.pkl");
    assert_eq!(
        render(&p),
        r"['abc', b'\x00\x01', b'z', -32768, b'x', b'y', 's', NewObj<geometry.Point() state={'x': 3, 'y': 4}>]"
    );
}

#[test]
fn equal_keys_replace_values_in_place_as_python_does() {
    // OrderedDict with 'a': 1, 1: 'one', True: 'true', 1.0: 'float', 'a': 2.
    let p = load("duplicate_keys_p2.pkl");
    assert_eq!(render(&p), "{'a': 2, 1: 'float'}");
    let pairs = p.dict_items(p.root()).expect("a dict");
    assert_eq!(
        p.as_int(pairs[1].0),
        Some(1),
        "the first key object is kept"
    );
}

#[test]
fn back_to_back_pickles_parse_one_after_another() {
    let data = read("back_to_back_p2.pkl");
    let limits = Limits::default();
    let (first, end1) = parse_prefix(&data, &limits).expect("first pickle");
    assert_eq!(render(&first), "119547037146038801333356");
    let (second, len2) = parse_prefix(&data[end1..], &limits).expect("second pickle");
    assert_eq!(second.as_int(second.root()), Some(1001));
    let (third, len3) = parse_prefix(&data[end1 + len2..], &limits).expect("third pickle");
    assert_eq!(render(&third), "{'k': 1}");
    assert_eq!(end1 + len2 + len3, data.len());
    // `parse` takes the first pickle and ignores what follows.
    let whole = unshard_pickle::parse(&data).expect("parse");
    assert_eq!(render(&whole), render(&first));
}

#[test]
fn torch_state_dict_shows_storages_and_rebuild_calls() {
    let p = load("torch_state_dict.pkl");
    let root = p.root();
    let keys: Vec<&str> = p
        .dict_items(root)
        .expect("a dict")
        .iter()
        .filter_map(|&(k, _)| p.as_str(k))
        .collect();
    assert_eq!(keys, ["w", "t", "p", "step"]);

    let w = p
        .object(p.dict_get(root, "w").expect("w"))
        .expect("an object");
    assert!(w.is("torch._utils", "_rebuild_tensor_v2"));
    assert_eq!(w.args.len(), 6);
    let pid = p.persistent_id(w.args[0]).expect("storage");
    let storage = p.items(pid).expect("storage tuple");
    assert_eq!(p.as_str(storage[0]), Some("storage"));
    assert_eq!(p.global(storage[1]), Some(("torch", "FloatStorage")));
    assert_eq!(p.as_str(storage[2]), Some("0"));
    assert_eq!(p.as_int(storage[4]), Some(6));
    assert_eq!(render_node(&p, w.args[2]), "(2, 3)");
    assert_eq!(render_node(&p, w.args[3]), "(3, 1)");
    // backward_hooks is OrderedDict(), interpreted as an empty dict.
    assert_eq!(p.dict_items(w.args[5]), Some(&[][..]));

    // The transposed view names the same storage; torch rebuilds the tuple but the
    // memo shares its key string.
    let t = p
        .object(p.dict_get(root, "t").expect("t"))
        .expect("an object");
    let t_storage = p
        .persistent_id(t.args[0])
        .and_then(|id| p.items(id))
        .expect("storage tuple");
    assert_eq!(t_storage[2], storage[2]);
    assert_eq!(render_node(&p, t.args[3]), "(1, 3)");

    let param = p
        .object(p.dict_get(root, "p").expect("p"))
        .expect("an object");
    assert!(param.is("torch._utils", "_rebuild_parameter"));
    assert_eq!(
        p.describe(param.args[0]),
        "object torch._utils._rebuild_tensor_v2(...)"
    );
    assert_eq!(p.describe(root), "dict(4 items)");
}

#[test]
fn torch_legacy_stream_is_five_pickles_then_storage_bytes() {
    let data = read("torch_legacy.pt");
    let limits = Limits::default();
    let mut at = 0;
    let mut pickles = Vec::new();
    for _ in 0..5 {
        let (p, len) = parse_prefix(&data[at..], &limits).expect("legacy pickle");
        at += len;
        pickles.push(p);
    }
    assert_eq!(render(&pickles[0]), "119547037146038801333356");
    assert_eq!(pickles[1].as_int(pickles[1].root()), Some(1001));
    let sys_info = &pickles[2];
    let little = sys_info.dict_get(sys_info.root(), "little_endian");
    assert_eq!(little.and_then(|id| sys_info.as_bool(id)), Some(true));
    // The object: the storage persistent id is a 6-tuple with a view_metadata slot.
    let obj = &pickles[3];
    let x = obj
        .object(obj.dict_get(obj.root(), "x").expect("x"))
        .expect("tensor");
    let storage = obj
        .persistent_id(x.args[0])
        .and_then(|pid| obj.items(pid))
        .expect("storage tuple");
    assert_eq!(storage.len(), 6);
    assert_eq!(obj.global(storage[1]), Some(("torch", "ShortStorage")));
    let key = obj.as_str(storage[2]).expect("key");
    let keys = &pickles[4];
    let listed: Vec<&str> = keys
        .items(keys.root())
        .expect("key list")
        .iter()
        .filter_map(|&k| keys.as_str(k))
        .collect();
    assert_eq!(listed, [key]);
    // Then the raw storage: an i64 element count and the int16 elements.
    assert_eq!(&data[at..], b"\x03\0\0\0\0\0\0\0\x01\0\x02\0\x03\0");
}

#[test]
fn describe_is_short_and_bounded() {
    let p = load("nested_p2.pkl");
    let root = p.root();
    assert_eq!(p.describe(root), "dict(8 items)");
    let text = p.dict_get(root, "text").expect("text");
    let items = p.items(text).expect("list");
    assert_eq!(p.describe(items[1]), "str 'abc'");
    assert_eq!(p.describe(items[3]), "str 'back\\\\slash\\nnewline'");
    let ints = p.dict_get(root, "ints").expect("ints");
    assert_eq!(p.describe(p.items(ints).expect("list")[3]), "int 255");
    let consts = p.dict_get(root, "consts").expect("consts");
    assert_eq!(p.describe(consts), "tuple(3 items)");
    assert_eq!(p.describe(p.items(consts).expect("tuple")[1]), "bool True");
    let bytes = p.dict_get(root, "bytes").expect("bytes");
    assert_eq!(
        p.describe(p.items(bytes).expect("list")[1]),
        "bytes(3 bytes)"
    );

    let long =
        unshard_pickle::parse(&[b"X\x00\x10\x00\x00".as_slice(), &[b'a'; 4096], b"."].concat())
            .expect("long string");
    let described = long.describe(long.root());
    assert!(described.len() < 60, "{described}");
    assert!(described.ends_with("…'"), "{described}");
}
