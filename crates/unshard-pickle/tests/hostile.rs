//! Corrupt, truncated and hostile inputs: every one is an `Err` or a bounded tree, never a
//! panic, a huge allocation or a long run. Also pins the error kinds and messages.

mod common;

use std::time::{Duration, Instant};

use common::{data_dir, read, render};
use unshard_pickle::{parse, parse_prefix, parse_with_limits, ErrorKind, Limits, Value};

/// Generous bound for "runs fast": the inputs below take milliseconds.
const QUICK: Duration = Duration::from_secs(5);

fn kind(data: &[u8]) -> ErrorKind {
    match parse(data) {
        Ok(p) => panic!("expected an error, parsed {}", render(&p)),
        Err(e) => e.kind,
    }
}

fn kind_with(data: &[u8], limits: &Limits) -> ErrorKind {
    match parse_with_limits(data, limits) {
        Ok(p) => panic!("expected an error, parsed {} nodes", p.len()),
        Err(e) => e.kind,
    }
}

fn committed_pickles() -> Vec<(String, Vec<u8>)> {
    let mut files: Vec<(String, Vec<u8>)> = std::fs::read_dir(data_dir())
        .expect("tests/data")
        .map(|entry| {
            let name = entry
                .expect("dir entry")
                .file_name()
                .to_string_lossy()
                .into_owned();
            let data = read(&name);
            (name, data)
        })
        .collect();
    files.sort();
    assert!(files.len() > 40, "tests/data looks empty");
    files
}

// ---- truncation and random bytes ----

#[test]
fn every_truncation_of_a_real_pickle_is_truncated_or_no_stop() {
    for (name, data) in committed_pickles() {
        let (_, end) = parse_prefix(&data, &Limits::default()).expect(&name);
        for cut in 0..end {
            match parse(&data[..cut]) {
                Ok(_) => panic!("{name} cut at {cut} parsed"),
                Err(e) => assert!(
                    matches!(e.kind, ErrorKind::Truncated | ErrorKind::NoStop),
                    "{name} cut at {cut}: {e}"
                ),
            }
        }
    }
}

/// xorshift64: deterministic and dependency-free.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// Parses and, on success, describes every node (as the fuzz target does).
fn exercise(data: &[u8]) {
    if let Ok(p) = parse(data) {
        for id in p.ids() {
            let _ = p.describe(id);
        }
    }
}

#[test]
fn random_bytes_never_panic() {
    // Mostly opcode bytes, so inputs get past the first few opcodes.
    let opcodes: Vec<u8> = b"(.012FIJKLMNPQRSTUVXabcdegijlmopqrstu}])GBC"
        .iter()
        .copied()
        .chain(0x80..=0x98)
        .collect();
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    for _ in 0..20_000 {
        let len = rng.below(200);
        let data: Vec<u8> = (0..len)
            .map(|_| match rng.below(4) {
                0 => rng.next() as u8,
                1 => rng.below(4) as u8,
                _ => opcodes[rng.below(opcodes.len())],
            })
            .collect();
        exercise(&data);
    }
}

#[test]
fn mutated_real_pickles_never_panic() {
    let files = committed_pickles();
    let mut rng = Rng(0x0123_4567_89ab_cdef);
    for _ in 0..10_000 {
        let (_, original) = &files[rng.below(files.len())];
        let mut data = original.clone();
        for _ in 0..1 + rng.below(6) {
            if data.is_empty() {
                break;
            }
            let at = rng.below(data.len());
            match rng.below(4) {
                0 => data[at] = rng.next() as u8,
                1 => data[at] = data[at].wrapping_add(1),
                2 => {
                    data.remove(at);
                }
                _ => data.insert(at, rng.next() as u8),
            }
        }
        exercise(&data);
    }
}

// ---- resource bombs ----

#[test]
fn memo_bomb_of_exponential_sharing_stays_linear() {
    // level[i] = [level[i-1], level[i-1]]: 2^100000 leaves if copied, 100001 nodes here.
    let levels = 100_000u32;
    let mut data = b"\x80\x02]r\0\0\0\0".to_vec();
    for i in 1..=levels {
        data.push(b'(');
        for _ in 0..2 {
            data.push(b'j');
            data.extend((i - 1).to_le_bytes());
        }
        data.push(b'l');
        data.push(b'r');
        data.extend(i.to_le_bytes());
    }
    data.push(b'.');
    let start = Instant::now();
    let p = parse(&data).expect("memo bomb parses");
    assert!(start.elapsed() < QUICK);
    assert_eq!(p.len(), levels as usize + 1);
    assert_eq!(p.describe(p.root()), "list(2 items)");
}

#[test]
fn binget_loop_is_bounded_by_the_container_limit() {
    let mut data = b"]q\0(".to_vec();
    for _ in 0..5000 {
        data.extend(b"h\0");
    }
    data.extend(b"e.");
    let limits = Limits {
        max_container_len: 1000,
        ..Limits::default()
    };
    assert_eq!(
        kind_with(&data, &limits),
        ErrorKind::LimitExceeded {
            what: "items in one container",
            limit: 1000
        }
    );
    // Within the limit, every slot is the same node: no copies.
    let p = parse(&data).expect("default limits");
    let items = p.items(p.root()).expect("list");
    assert_eq!(items.len(), 5000);
    assert!(items.iter().all(|&id| id == p.root()));
}

#[test]
fn appending_an_existing_node_costs_an_item() {
    // `h0 a` appends the list to itself: no new node, but a new slot each time.
    let mut data = b"]q\0".to_vec();
    for _ in 0..2000 {
        data.extend(b"h\0a");
    }
    data.push(b'.');
    let limits = Limits {
        max_nodes: 1000,
        ..Limits::default()
    };
    assert_eq!(
        kind_with(&data, &limits),
        ErrorKind::LimitExceeded {
            what: "container items in total",
            limit: 1000
        }
    );
}

#[test]
fn repeated_set_copies_are_charged() {
    // A list of 1000 distinct ints, then set(list) over and over: each call copies.
    let mut data = b"]q\0(".to_vec();
    for i in 0..1000i32 {
        data.push(b'J');
        data.extend(i.to_le_bytes());
    }
    data.extend(b"ec__builtin__\nset\nq\x01");
    for _ in 0..100 {
        data.extend(b"h\x01h\0\x85R0");
    }
    data.extend(b"N.");
    let limits = Limits {
        max_nodes: 50_000,
        ..Limits::default()
    };
    assert_eq!(
        kind_with(&data, &limits),
        ErrorKind::LimitExceeded {
            what: "container items in total",
            limit: 50_000
        }
    );
    assert!(parse(&data).is_ok());
}

#[test]
fn storing_a_big_memoised_key_again_and_again_stays_cheap() {
    // Two 4 MB string keys with equal content, stored alternately 100 000 times by
    // four-byte opcodes: comparing contents each time would be 400 GB of memcmp.
    let big = 4 << 20;
    let mut data = b"}".to_vec();
    for memo in [0u8, 1] {
        data.extend(b"X");
        data.extend(u32::try_from(big).expect("fits").to_le_bytes());
        data.resize(data.len() + big, b'k');
        data.extend([b'q', memo, b'0']);
    }
    for i in 0..100_000u32 {
        data.extend([b'h', (i % 2) as u8, b'N', b's']);
    }
    data.push(b'.');
    let start = Instant::now();
    let p = parse(&data).expect("repeated big keys");
    assert!(start.elapsed() < QUICK, "{:?}", start.elapsed());
    assert_eq!(p.dict_items(p.root()).map(<[_]>::len), Some(1));
}

#[test]
fn encoding_a_big_memoised_string_is_charged_each_time() {
    // A 256 KB str that is not latin-1 (so the call stays an object), encoded repeatedly.
    let mut data = b"c_codecs\nencode\nq\0X".to_vec();
    let text = [vec![b'a'; (256 << 10) - 3], "\u{20ac}".as_bytes().to_vec()].concat();
    data.extend(u32::try_from(text.len()).expect("fits").to_le_bytes());
    data.extend(&text);
    data.extend(b"q\x010X\x06\0\0\0latin1q\x020");
    for _ in 0..10_000 {
        data.extend(b"h\0h\x01h\x02\x86R0");
    }
    data.extend(b"N.");
    let limits = Limits {
        max_payload_bytes: 16 << 20,
        ..Limits::default()
    };
    let start = Instant::now();
    // The copy budget (twice the input plus 1 MiB) runs out before the payload bound.
    let what = match kind_with(&data, &limits) {
        ErrorKind::LimitExceeded { what, .. } => what,
        other => panic!("{other:?}"),
    };
    assert!(what.starts_with("bytes and items copied"), "{what}");
    assert!(start.elapsed() < QUICK);
}

#[test]
fn set_of_a_memoised_list_is_charged_for_every_scan() {
    // A list holding one node 10 000 times dedupes to a one-item set, but each
    // set(list) still walks 10 000 items.
    let mut data = b"]q\0(".to_vec();
    data.extend(b"Nq\x01");
    data.extend(b"h\x01".repeat(9_999));
    data.extend(b"ec__builtin__\nset\nq\x02");
    for _ in 0..10_000 {
        data.extend(b"h\x02h\0\x85R0");
    }
    data.extend(b"N.");
    let limits = Limits {
        max_nodes: 1_000_000,
        ..Limits::default()
    };
    assert_eq!(
        kind_with(&data, &limits),
        ErrorKind::LimitExceeded {
            what: "container items in total",
            limit: 1_000_000
        }
    );
}

#[test]
fn huge_declared_lengths_are_truncated_before_allocating() {
    let cases: [&[u8]; 7] = [
        b"\x8d\xff\xff\xff\xff\xff\xff\xff\xff.", // BINUNICODE8
        b"\x8e\0\0\0\0\0\x01\0\0.",               // BINBYTES8 2^40
        b"\x96\xff\xff\xff\xff\xff\xff\xff\x7f.", // BYTEARRAY8
        b"X\xff\xff\xff\xff.",                    // BINUNICODE
        b"B\xff\xff\xff\xff.",                    // BINBYTES
        b"\x8b\xff\xff\xff\x7f.",                 // LONG4
        b"\x80\x04\x95\xff\xff\xff\xff\xff\xff\xff\xff.", // FRAME
    ];
    for data in cases {
        let e = parse(data).expect_err("must fail");
        assert_eq!(e.kind, ErrorKind::Truncated, "{e}");
    }
    assert_eq!(kind(b"T\xff\xff\xff\xff."), ErrorKind::NegativeArgument(-1));
    assert_eq!(
        kind(b"\x8b\0\0\0\x80."),
        ErrorKind::NegativeArgument(i32::MIN.into())
    );
}

#[test]
fn deep_mark_nesting_hits_the_mark_limit() {
    let data = vec![b'('; 200_000];
    assert_eq!(
        kind(&data),
        ErrorKind::LimitExceeded {
            what: "nested marks",
            limit: 100_000
        }
    );
    // Open marks left at STOP are ignored, as CPython does.
    let mut data = vec![b'('; 50_000];
    data.extend(b"N.");
    let p = parse(&data).expect("open marks");
    assert_eq!(p.get(p.root()), &Value::None);
}

#[test]
fn hundred_thousand_nested_containers_do_not_overflow_the_stack() {
    // ((((None,),),)...) through TUPLE1.
    let mut data = b"N".to_vec();
    data.resize(data.len() + 100_000, 0x85);
    data.push(b'.');
    let p = parse(&data).expect("nested tuples");
    assert_eq!(p.describe(p.root()), "tuple(1 item)");
    drop(p);

    // The same through MARK ... TUPLE.
    let depth = 90_000;
    let mut data = vec![b'('; depth];
    data.push(b')');
    data.resize(data.len() + depth, b't');
    data.push(b'.');
    let p = parse(&data).expect("nested mark tuples");
    assert_eq!(p.len(), depth + 1);

    // A list nested 100 000 deep through APPEND.
    let depth = 100_000;
    let mut data = vec![b']'; depth];
    data.resize(data.len() + depth - 1, b'a');
    data.push(b'.');
    let p = parse(&data).expect("nested lists");
    assert_eq!(p.describe(p.root()), "list(1 item)");
}

#[test]
fn huge_memo_keys_cost_one_entry_and_the_memo_is_bounded() {
    let p = parse(b"Nr\xff\xff\xff\xffj\xff\xff\xff\xff\x86.").expect("huge key");
    assert_eq!(render(&p), "(None, None)");
    let p = parse(b"Np18446744073709551615\ng18446744073709551615\n\x86.").expect("u64 key");
    assert_eq!(render(&p), "(None, None)");

    let limits = Limits {
        max_memo: 10,
        ..Limits::default()
    };
    let mut data = b"N".to_vec();
    for i in 0..11u8 {
        data.extend([b'q', i]);
    }
    data.push(b'.');
    assert_eq!(
        kind_with(&data, &limits),
        ErrorKind::LimitExceeded {
            what: "memo entries",
            limit: 10
        }
    );
    // Overwriting one key does not grow the memo.
    let mut data = b"N".to_vec();
    for _ in 0..100 {
        data.extend(b"q\0");
    }
    data.push(b'.');
    assert!(parse_with_limits(&data, &limits).is_ok());
}

#[test]
fn memo_keys_out_of_order_overwritten_and_sparse_resolve_as_in_python() {
    // memo[2] = 'a'; memo[0] = 'b'; memo[1] = 'c'; memo[1] = 'd'; MEMOIZE 'e' (key
    // len(memo) = 3); memo[9] = 'f'; MEMOIZE 'g' (key 5); MEMOIZE 'h' (key 6).
    let mut data = b"\x80\x04".to_vec();
    for (text, put) in [
        ("a", &b"q\x02"[..]),
        ("b", b"q\x00"),
        ("c", b"q\x01"),
        ("d", b"q\x01"),
        ("e", b"\x94"),
        ("f", b"q\x09"),
        ("g", b"\x94"),
        ("h", b"\x94"),
    ] {
        data.extend([0x8c, 1, text.as_bytes()[0]]);
        data.extend(put);
        data.push(b'0');
    }
    data.push(b'(');
    for key in [0u8, 1, 2, 3, 5, 6, 9] {
        data.extend([b'h', key]);
    }
    data.extend(b"t.");
    let p = parse(&data).expect("memo in any order");
    assert_eq!(render(&p), "('b', 'd', 'a', 'e', 'g', 'h', 'f')");
    let mut missing = data.clone();
    let at = missing.len() - 3;
    missing[at] = 4;
    assert_eq!(kind(&missing), ErrorKind::MemoMissing(4));
}

#[test]
fn scaled_limits_admit_a_large_pickle_the_fixed_ones_refuse() {
    // A list of 1000 Nones: 1001 nodes in 2 + 1 + 1000 + 2 + 1 bytes.
    let mut data = b"\x80\x02](".to_vec();
    data.resize(data.len() + 1000, b'N');
    data.extend(b"e.");
    let tight = Limits {
        max_nodes: 600,
        max_container_len: 600,
        ..Limits::default()
    };
    assert_eq!(
        kind_with(&data, &tight),
        ErrorKind::LimitExceeded {
            what: "nodes",
            limit: 600
        }
    );
    let scaled = tight.clone().scaled_to(2 * data.len());
    assert_eq!(scaled.max_nodes, data.len());
    let p = parse_with_limits(&data, &scaled).expect("scaled to the input");
    assert_eq!(p.describe(p.root()), "list(1000 items)");
    // Scaling never lowers a limit.
    assert_eq!(tight.clone().scaled_to(10).max_nodes, 600);
}

#[test]
fn long_text_with_millions_of_digits_is_refused_quickly() {
    let mut data = b"L".to_vec();
    data.resize(data.len() + 2_000_000, b'9');
    data.extend(b"L\n.");
    let start = Instant::now();
    assert!(matches!(kind(&data), ErrorKind::BadLiteral(_)));
    assert!(start.elapsed() < QUICK);
    // The largest accepted literal converts quickly too.
    let mut data = b"I-".to_vec();
    data.resize(data.len() + 4300, b'7');
    data.extend(b"\n.");
    let p = parse(&data).expect("4300 digits");
    assert!(matches!(p.get(p.root()), Value::BigInt(b) if b.len() < 1800));
}

#[test]
fn node_and_payload_limits_apply() {
    let mut data = b"](".to_vec();
    data.extend(b"K\x01".repeat(20));
    data.extend(b"e.");
    let limits = Limits {
        max_nodes: 10,
        ..Limits::default()
    };
    assert_eq!(
        kind_with(&data, &limits),
        ErrorKind::LimitExceeded {
            what: "nodes",
            limit: 10
        }
    );

    let mut data = b"X\x14\0\0\0".to_vec();
    data.extend([b'a'; 20]);
    data.push(b'.');
    let limits = Limits {
        max_payload_bytes: 10,
        ..Limits::default()
    };
    assert_eq!(
        kind_with(&data, &limits),
        ErrorKind::LimitExceeded {
            what: "bytes of string and bytes payload",
            limit: 10
        }
    );
}

// ---- error kinds, offsets and messages ----

#[test]
fn error_message_names_offset_and_opcode() {
    let e = parse(b"\x80\x02h\x07.").expect_err("missing memo key");
    assert_eq!(e.offset, 2);
    assert_eq!(e.opcode, Some(b'h'));
    assert_eq!(e.kind, ErrorKind::MemoMissing(7));
    assert_eq!(
        e.to_string(),
        "pickle error at byte 2 (opcode BINGET 'h'): memo key 7 is not defined"
    );
    let e = parse(b"N\xff").expect_err("unknown opcode");
    assert_eq!(
        (e.offset, e.kind.clone()),
        (1, ErrorKind::UnknownOpcode(0xff))
    );
    assert!(e
        .to_string()
        .starts_with("pickle error at byte 1: unknown opcode byte 0xff"));
    let e = parse(b"N").expect_err("no stop");
    assert_eq!((e.offset, e.opcode, e.kind), (1, None, ErrorKind::NoStop));
}

#[test]
fn unsupported_opcodes_and_protocols_are_errors() {
    assert_eq!(kind(b"\x80\x06N."), ErrorKind::UnsupportedProtocol(6));
    assert!(parse(b"\x80\x05N.").is_ok());
    // EXT codes must have been registered by the pickle itself (copyreg.add_extension).
    assert_eq!(kind(b"\x82\x01."), ErrorKind::UnregisteredExtension(1));
    assert_eq!(kind(b"\x83\x01\0."), ErrorKind::UnregisteredExtension(1));
    assert_eq!(
        kind(b"\x84\x01\0\0\0."),
        ErrorKind::UnregisteredExtension(1)
    );
    assert_eq!(kind(b"\x82\x00."), ErrorKind::NegativeArgument(0));
    assert_eq!(kind(b"\x97."), ErrorKind::UnsupportedOpcode("NEXT_BUFFER"));
    assert_eq!(
        kind(b"N\x98."),
        ErrorKind::UnsupportedOpcode("READONLY_BUFFER")
    );
    assert_eq!(kind(b"\0"), ErrorKind::UnknownOpcode(0));
}

#[test]
fn stack_and_mark_misuse_are_errors() {
    assert_eq!(kind(b"."), ErrorKind::StackUnderflow);
    assert_eq!(kind(b"a"), ErrorKind::StackUnderflow);
    assert_eq!(
        kind(b"N(."),
        ErrorKind::StackUnderflow,
        "STOP may not pop past a mark"
    );
    assert_eq!(
        kind(b"N(2"),
        ErrorKind::StackUnderflow,
        "DUP may not read past a mark"
    );
    assert_eq!(kind(b"]N(\x85"), ErrorKind::StackUnderflow);
    assert_eq!(kind(b"]Ne"), ErrorKind::MarkMissing);
    assert_eq!(kind(b"Nt"), ErrorKind::MarkMissing);
    assert_eq!(kind(b"(o"), ErrorKind::StackUnderflow, "OBJ needs a class");
    // POP right after MARK removes the mark, as in CPython.
    let p = parse(b"N(0.").expect("POP of a mark");
    assert_eq!(p.get(p.root()), &Value::None);
    assert_eq!(kind(b"(0t"), ErrorKind::MarkMissing);
}

#[test]
fn adding_items_to_a_non_container_is_an_error() {
    assert_eq!(
        kind(b"K\x01K\x02a."),
        ErrorKind::NotAContainer {
            op: "APPEND",
            found: "int"
        }
    );
    assert_eq!(
        kind(b")K\x01K\x02s."),
        ErrorKind::NotAContainer {
            op: "SETITEM",
            found: "tuple"
        }
    );
    assert_eq!(
        kind(b"(K\x01\x91(K\x02\x90."),
        ErrorKind::NotAContainer {
            op: "ADDITEMS",
            found: "frozenset"
        }
    );
    // An empty batch is a no-op whatever the target, as in CPython.
    for data in [&b"K\x01(e."[..], b"K\x01(u.", b"K\x01(\x90."] {
        let p = parse(data).expect("empty batch");
        assert_eq!(p.as_int(p.root()), Some(1));
    }
    assert_eq!(
        kind(b"](K\x01\x90."),
        ErrorKind::NotAContainer {
            op: "ADDITEMS",
            found: "list"
        }
    );
}

#[test]
fn operands_of_the_wrong_type_are_errors() {
    assert_eq!(
        kind(b"K\x01K\x02\x93."),
        ErrorKind::WrongType {
            expected: "str module and name",
            found: "int"
        }
    );
    assert_eq!(
        kind(b"cos\nsystem\nK\x01R."),
        ErrorKind::WrongType {
            expected: "a tuple of arguments",
            found: "int"
        }
    );
    assert_eq!(
        kind(b"cgeometry\nPoint\n))\x92."),
        ErrorKind::WrongType {
            expected: "a dict of keyword arguments",
            found: "tuple"
        }
    );
    assert_eq!(kind(b"(K\x01d."), ErrorKind::OddItemCount(1));
    assert_eq!(kind(b"}(K\x01K\x02K\x03u."), ErrorKind::OddItemCount(3));
}

#[test]
fn malformed_text_is_an_error() {
    assert_eq!(kind(b"X\x02\0\0\0\xff\xfe."), ErrorKind::InvalidUtf8);
    assert_eq!(kind(b"c\xff\nx\n."), ErrorKind::InvalidUtf8);
    assert!(matches!(kind(b"Iabc\n."), ErrorKind::BadLiteral(_)));
    assert!(matches!(kind(b"Fx\n."), ErrorKind::BadLiteral(_)));
    assert!(matches!(kind(b"S'abc\n."), ErrorKind::BadLiteral(_)));
    assert!(matches!(kind(b"V\\ud800\n."), ErrorKind::BadLiteral(_)));
    assert!(matches!(kind(b"Np-1\n."), ErrorKind::BadLiteral(_)));
    assert!(matches!(kind(b"P\xe9\n."), ErrorKind::BadLiteral(_)));
    assert_eq!(
        kind(b"Iabc"),
        ErrorKind::Truncated,
        "a text argument needs its newline"
    );
}

#[test]
fn objects_collect_appends_setitems_and_the_last_build() {
    let p = parse(b"cmod\nCls\n)\x81(K\x01K\x02u(K\x03eK\x04a}b]b.").expect("object");
    assert_eq!(
        render(&p),
        "NewObj<mod.Cls() state=[] items=[3, 4] pairs={1: 2}>"
    );
    // BUILD on plain values is ignored.
    let p = parse(b"]}b.").expect("BUILD on a list");
    assert_eq!(render(&p), "[]");
    // INST with arguments.
    let p = parse(b"(K\x01K\x02imod\nCls\n.").expect("INST");
    assert_eq!(render(&p), "Inst<mod.Cls(1, 2)>");
}

#[test]
fn only_the_listed_builtins_are_interpreted() {
    let cases: [(&[u8], &str); 10] = [
        (b"ccollections\nOrderedDict\n)R.", "{}"),
        (b"ccollections\ndefaultdict\ncbuiltins\nlist\n\x85R.", "{}"),
        (
            b"ccollections\nCounter\n}X\x01\0\0\0aK\x02s\x85R.",
            "{'a': 2}",
        ),
        (b"ccollections\nOrderedDict\n)\x81.", "{}"),
        (b"c__builtin__\nset\n]\x85\x81.", "set([])"),
        (b"cbuiltins\nbytearray\nC\x02ab\x85R.", "b'ab'"),
        (
            b"c__builtin__\nbytearray\nX\x02\0\0\0\xc3\xa9X\x07\0\0\0latin-1\x86R.",
            r"b'\xe9'",
        ),
        (b"cbuiltins\ngetattr\ncm\nA\nX\x01\0\0\0B\x86R.", "m.A.B"),
        // Not interpreted: wrong module, wrong arity, non-latin-1 text.
        (
            b"cos\ngetattr\ncm\nA\nX\x01\0\0\0B\x86R.",
            "Reduce<os.getattr(m.A, 'B')>",
        ),
        (
            b"c_codecs\nencode\nX\x03\0\0\0\xe2\x82\xacX\x06\0\0\0latin1\x86R.",
            "Reduce<_codecs.encode('\u{20ac}', 'latin1')>",
        ),
    ];
    for (data, expected) in cases {
        let p = parse(data).unwrap_or_else(|e| panic!("{expected}: {e}"));
        assert_eq!(render(&p), expected);
    }
}

#[test]
fn sets_merge_equal_items() {
    let p = parse(b"\x8f(K\x01\x88G?\xf0\0\0\0\0\0\0K\x02\x90.").expect("set");
    // 1, True and 1.0 are one item; the first one stays.
    assert_eq!(render(&p), "set([1, 2])");
}
