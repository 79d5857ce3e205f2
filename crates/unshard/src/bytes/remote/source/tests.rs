//! The read-ahead budget, which spans are fetched ahead, and an object read through
//! the [`ByteSource`] calls the engine makes, against an in-memory store.

#![allow(clippy::unwrap_used)]

use std::path::Path;
use std::sync::{mpsc, Arc};
use std::time::Duration;

use object_store::memory::InMemory;
use object_store::{ObjectStoreExt, PutPayload};

use super::super::store;
use super::{fetched, Budget, ObjectSource, GAP};
use crate::bytes::ByteSource;

/// A budget of `limit` bytes that lives as long as the sources counting in it.
fn leak(limit: u64) -> &'static Budget {
    Box::leak(Box::new(Budget::new(limit)))
}

/// An object of `n` bytes, no two neighbours alike, alone in a store registered as
/// `s3://{bucket}`, opened with its fetches ahead counted in `budget`.
fn object(bucket: &str, n: u64, budget: &'static Budget) -> (ObjectSource, Vec<u8>) {
    let mem = Arc::new(InMemory::new());
    store::register(&format!("s3://{bucket}"), mem.clone());
    let body: Vec<u8> = (0..n)
        .map(|i| (i as u8).wrapping_mul(7) ^ (i >> 8) as u8)
        .collect();
    store::block_on(mem.put(&"obj".into(), PutPayload::from(body.clone()))).unwrap();
    let loc = store::locate(Path::new(&format!("s3://{bucket}/obj"))).unwrap();
    (
        ObjectSource::open(loc, None).unwrap().with_budget(budget),
        body,
    )
}

/// The fetches `src` holds ahead: start, end, and whether a block's.
fn held(src: &ObjectSource) -> Vec<(u64, u64, bool)> {
    let ahead = src.ahead.lock().unwrap();
    let mut spans: Vec<_> = ahead.iter().map(|a| (a.start, a.end, a.block)).collect();
    spans.sort_unstable();
    spans
}

/// The GETs `f` made, and the bytes they asked for (the caller holds `COUNTED`).
fn gets<R>(f: impl FnOnce() -> R) -> (R, (u64, u64)) {
    let before = fetched();
    let r = f();
    let after = fetched();
    (r, (after.0 - before.0, after.1 - before.1))
}

/// Reads of an object return its bytes, the last one included, with one GET each;
/// range reads are coalesced into one GET per run of ranges less than `GAP` apart,
/// whatever order they come in; a read past the end, or whose end overflows, is an
/// error naming the URL and made before any request.
#[test]
fn reads_return_the_objects_bytes_and_refuse_what_lies_past_its_end() {
    let _one_at_a_time = super::super::tests::COUNTED
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    let len = 3 * GAP + 5;
    let (src, body) = object("source-reads", len, leak(1 << 20));
    assert_eq!(src.len(), len);
    assert_eq!(
        src.readers(),
        super::readers(),
        "the workers for a remote input"
    );
    assert_eq!(
        format!("{src:?}"),
        format!("ObjectSource {{ url: \"s3://source-reads/obj\", len: {len} }}")
    );
    let at = |offset: u64, n: usize| &body[offset as usize..offset as usize + n];
    for (offset, n) in [(0, 10), (len - 1, 1), (GAP + 3, 1000)] {
        let mut buf = vec![0u8; n];
        let (r, made) = gets(|| src.read_at(offset, &mut buf));
        r.unwrap();
        assert_eq!(buf, at(offset, n), "{n} bytes at {offset}");
        assert_eq!(made, (1, n as u64), "{n} bytes at {offset}");
    }
    let (r, made) = gets(|| src.read_at(len + 5, &mut []));
    r.unwrap();
    assert_eq!(made.0, 0, "an empty read asks for nothing");
    for (offset, n) in [(len - 1, 2), (len, 1), (u64::MAX, 2)] {
        let mut buf = vec![0u8; n];
        let (r, made) = gets(|| src.read_at(offset, &mut buf));
        let e = r.expect_err("a read past the end").to_string();
        assert!(e.contains("s3://source-reads/obj"), "{e}");
        assert!(e.contains(&format!("{n} bytes at byte {offset}")), "{e}");
        assert_eq!(made.0, 0, "{e}");
    }

    // Two runs: [5, 120) and [2 GAP + 3, len), given out of order.
    let wanted = [(2 * GAP + 3, 30), (100, 20), (len - 4, 4), (5, 10)];
    let mut bufs: Vec<Vec<u8>> = wanted.iter().map(|&(_, n)| vec![0u8; n]).collect();
    let mut ranges: Vec<(u64, &mut [u8])> = wanted
        .iter()
        .zip(bufs.iter_mut())
        .map(|(&(o, _), b)| (o, b.as_mut_slice()))
        .collect();
    let (r, made) = gets(|| src.read_ranges(&mut ranges));
    r.unwrap();
    assert_eq!(made, (2, 115 + (len - 2 * GAP - 3)), "one GET per run");
    for (&(offset, n), buf) in wanted.iter().zip(&bufs) {
        assert_eq!(buf.as_slice(), at(offset, n), "{n} bytes at {offset}");
    }
    for (offset, n) in [(len - 2, 4usize), (len, 1)] {
        let mut buf = vec![0u8; n];
        let mut first = [0u8; 3];
        let (r, made) =
            gets(|| src.read_ranges(&mut [(0, &mut first[..]), (offset, &mut buf[..])]));
        let e = r.expect_err("a range past the end").to_string();
        assert!(e.contains("s3://source-reads/obj"), "{e}");
        assert!(e.contains(&format!("{n} bytes at byte {offset}")), "{e}");
        assert_eq!(made.0, 0, "{e}");
    }
}

/// A block's ranges are fetched with one GET per run of ranges less than
/// `BLOCK_GAP` apart, cut at the object's end; its pieces are then read in any
/// order without a request, and stay fetched until the block is done, which drops
/// its fetches (and no hint's) and gives their bytes back. A span already fetched is
/// not fetched again.
#[test]
fn a_block_is_fetched_once_per_run_and_let_go_when_done() {
    let _one_at_a_time = super::super::tests::COUNTED
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    let budget = leak(1 << 20);
    let len = 512 << 10;
    let (src, body) = object("source-block", len, budget);
    let used = || budget.lock().bytes;
    src.will_need(0, 50);
    assert_eq!(held(&src), [(0, 50, false)]);
    let far = 200 << 10;
    let block = [(far, 1000), (0, 100), (150, 50)];
    let ((), made) = gets(|| src.will_need_together(&block));
    assert_eq!(made, (2, 200 + 1000));
    assert_eq!(
        held(&src),
        [(0, 50, false), (0, 200, true), (far, far + 1000, true)]
    );
    assert_eq!(used(), 50 + 200 + 1000);
    let pieces = [(far + 500, 500), (far, 500), (150, 50), (0, 100), (0, 100)];
    for (offset, n) in pieces {
        let mut buf = vec![0u8; n];
        let (r, made) = gets(|| src.read_at(offset, &mut buf));
        r.unwrap();
        assert_eq!(buf, body[offset as usize..offset as usize + n]);
        assert_eq!(made.0, 0, "{n} bytes at {offset} were fetched");
    }
    assert_eq!(
        held(&src).len(),
        3,
        "a block's fetch is kept until it is done"
    );
    // A hint's span goes with its last read, and only it (the block's run that
    // starts where it does stays).
    let mut buf = [0u8; 50];
    let (r, made) = gets(|| src.read_at(0, &mut buf));
    r.unwrap();
    assert_eq!((buf.as_slice(), made.0), (&body[..50], 0));
    assert_eq!(held(&src), [(0, 200, true), (far, far + 1000, true)]);
    assert_eq!(used(), 1200);
    let ((), made) = gets(|| src.will_need_together(&block[1..]));
    assert_eq!(made.0, 0, "a run already fetched");
    assert_eq!(used(), 1200);
    src.will_need(300, 10);
    src.done_with(&block);
    assert_eq!(held(&src), [(300, 310, false)], "done_with drops no hint");
    assert_eq!(used(), 10);
    src.release(0, len);
    assert_eq!((held(&src), used()), (vec![], 0));

    // Two blocks whose runs start at the same byte: each is let go by its own.
    src.will_need_together(&[(0, 100)]);
    src.will_need_together(&[(0, 200)]);
    assert_eq!(held(&src), [(0, 100, true), (0, 200, true)]);
    src.done_with(&[(0, 100)]);
    assert_eq!(held(&src), [(0, 200, true)]);
    src.done_with(&[(0, 200)]);
    assert_eq!((held(&src), used()), (vec![], 0));

    // Cut at the end of the object, and let go by the same ranges.
    let tail = [(len - 10, 100)];
    let ((), made) = gets(|| src.will_need_together(&tail));
    assert_eq!(made, (1, 10));
    let mut buf = [0u8; 10];
    let (r, made) = gets(|| src.read_at(len - 10, &mut buf));
    r.unwrap();
    assert_eq!((buf.as_slice(), made.0), (&body[len as usize - 10..], 0));
    src.done_with(&tail);
    assert_eq!((held(&src), used()), (vec![], 0));
}

/// A hint past the end is cut to the object; one whose bytes do not fit in half
/// the budget is not fetched; `release` drops the fetches that lie inside the range
/// released, and only those.
#[test]
fn hints_are_cut_to_the_object_and_released_by_the_range_holding_them() {
    let budget = leak(1000);
    let (src, _) = object("source-release", 800, budget);
    src.will_need(700, 500);
    assert_eq!(held(&src), [(700, 800, false)]);
    src.will_need(0, 401);
    assert_eq!(held(&src).len(), 1, "over half the budget");
    src.will_need(100, 100);
    src.will_need(300, 100);
    assert_eq!(held(&src).len(), 3);
    src.release(0, 150);
    src.release(150, 800);
    assert_eq!(held(&src), [(100, 200, false)]);
    assert_eq!(budget.lock().bytes, 100);
    src.release(100, 100);
    assert_eq!((held(&src), budget.lock().bytes), (vec![], 0));
}

/// Two workers announce the same block while the budget is full: once it is
/// given back, one fetches the block and the other, which took the bytes too,
/// finds it fetched and gives its bytes back.
#[test]
fn a_block_started_while_another_worker_waited_is_not_fetched_twice() {
    let budget = leak(1000);
    let (src, body) = object("source-race", 4096, budget);
    let me = std::thread::current().id();
    assert!(budget.take_for_block(1000));
    std::thread::scope(|s| {
        for _ in 0..2 {
            s.spawn(|| src.will_need_together(&[(0, 100)]));
        }
        // Until both wait for the bytes (they hold none, so nothing says so).
        std::thread::sleep(Duration::from_millis(300));
        budget.give(1000, Some(me));
    });
    assert_eq!(held(&src), [(0, 100, true)]);
    assert_eq!(budget.lock().bytes, 100);
    let mut buf = [0u8; 100];
    src.read_at(0, &mut buf).unwrap();
    assert_eq!(buf.as_slice(), &body[..100]);
    src.done_with(&[(0, 100)]);
    assert_eq!(budget.lock().bytes, 0);
    // A block larger than the budget is fetched when nothing else is.
    src.will_need_together(&[(0, 2000)]);
    assert_eq!(held(&src), [(0, 2000, true)]);
    src.done_with(&[(0, 2000)]);
    assert_eq!(budget.lock().bytes, 0);
}

/// A span is fetched ahead when it is not empty, at most `MAX_AHEAD` long, inside
/// the object, and not inside a fetch already started.
#[test]
fn a_span_is_wanted_when_short_inside_the_object_and_not_started() {
    use super::{wanted, Ahead, Slot, MAX_AHEAD};
    let budget = leak(1000);
    let none: [Ahead; 0] = [];
    assert!(wanted(&none, 100, 0, 100), "the whole object");
    assert!(!wanted(&none, 100, 10, 10), "empty");
    assert!(!wanted(&none, 100, 20, 10), "reversed");
    assert!(!wanted(&none, 100, 50, 101), "past the end");
    let big = 2 * MAX_AHEAD;
    assert!(wanted(&none, big, 1, MAX_AHEAD + 1), "MAX_AHEAD long");
    assert!(!wanted(&none, big, 0, MAX_AHEAD + 1), "longer");
    assert!(budget.try_take(40));
    let started = [Ahead {
        start: 10,
        end: 50,
        slot: std::sync::Arc::new(Slot::default()),
        block: false,
        budget,
        owner: None,
    }];
    assert!(!wanted(&started, 100, 10, 50), "the span started");
    assert!(!wanted(&started, 100, 20, 30), "inside it");
    assert!(wanted(&started, 100, 9, 50), "from before it");
    assert!(wanted(&started, 100, 10, 51), "past its end");
    drop(started);
    assert_eq!(
        budget.lock().bytes,
        0,
        "a dropped fetch gives its bytes back"
    );
}

/// Hints that are not a block's take at most half the limit between them, held
/// bytes of blocks included; what is given back leaves the count and, for a
/// block's bytes, that thread's share, which goes when it reaches nothing.
#[test]
fn hints_take_at_most_half_and_what_is_given_back_is_counted_out() {
    let budget = Budget::new(100);
    let me = std::thread::current().id();
    assert!(budget.try_take(50), "half the limit fits");
    assert!(!budget.try_take(1), "past half");
    assert_eq!(budget.lock().bytes, 50);
    assert!(budget.lock().by_thread.is_empty(), "a hint is no thread's");
    budget.give(50, None);
    assert_eq!(budget.lock().bytes, 0);
    assert!(!budget.try_take(51), "more than half at once");
    assert!(budget.try_take(1));
    budget.give(1, None);

    assert!(budget.take_for_block(70));
    assert!(
        !budget.try_take(1),
        "a block's bytes count against the half"
    );
    budget.give(30, Some(me));
    {
        let used = budget.lock();
        assert_eq!((used.bytes, used.by_thread.get(&me)), (40, Some(&40)));
    }
    assert!(!budget.try_take(11));
    assert!(budget.try_take(10));
    budget.give(10, None);
    budget.give(40, Some(me));
    let used = budget.lock();
    assert_eq!(used.bytes, 0);
    assert!(used.by_thread.is_empty(), "{:?}", used.by_thread);
    drop(used);
    assert_eq!(budget.peak(), 70);
}

/// Two blocks that each read two objects hold part of the budget for their first
/// one, and each wants more for its second than is left: the later to ask reads
/// its second object without fetching ahead (no other block is working, so
/// waiting would be for ever), and the earlier gets its bytes once the later is
/// done. Neither waits for the other.
#[test]
fn blocks_holding_part_of_the_budget_never_wait_for_each_other() {
    let budget = leak(100);
    let (holds, a_holds) = mpsc::channel();
    let (b_holds_tx, b_holds) = mpsc::channel();
    let (said, answers) = mpsc::channel();
    let said_b = said.clone();
    let a = std::thread::spawn(move || {
        let me = std::thread::current().id();
        assert!(budget.take_for_block(60));
        holds.send(()).unwrap();
        b_holds.recv().unwrap();
        let second = budget.take_for_block(30);
        said.send(("a", second)).unwrap();
        budget.give(if second { 90 } else { 60 }, Some(me));
    });
    let b = std::thread::spawn(move || {
        let me = std::thread::current().id();
        a_holds.recv().unwrap();
        assert!(budget.take_for_block(40));
        b_holds_tx.send(()).unwrap();
        // Until the first block waits for its second object's bytes.
        while budget.lock().waiting_holders == 0 {
            std::thread::sleep(Duration::from_millis(1));
        }
        let second = budget.take_for_block(30);
        said_b.send(("b", second)).unwrap();
        budget.give(if second { 70 } else { 40 }, Some(me));
    });
    let wait = Duration::from_secs(20);
    let first = answers.recv_timeout(wait);
    assert_eq!(
        first,
        Ok(("b", false)),
        "the later block waited for the earlier"
    );
    let second = answers.recv_timeout(wait);
    assert_eq!(
        second,
        Ok(("a", true)),
        "the earlier block never got its bytes"
    );
    a.join().unwrap();
    b.join().unwrap();
    assert_eq!(budget.lock().bytes, 0);
    assert_eq!(budget.peak(), 100);
}

/// The settings: a whole number clamped to its bounds, the default when unset or
/// not a number; unset, the defaults the docs give (32 workers, 64 MiB ahead).
#[test]
fn settings_are_clamped_whole_numbers_and_default_when_unset() {
    use super::{ahead_limit, parse_setting, readers};
    for (value, want) in [
        (None, 32),
        (Some("8"), 8),
        (Some(" 100\n"), 100),
        (Some("0"), 1),
        (Some("300"), 256),
        (Some("-4"), 32),
        (Some("16 MiB"), 32),
        (Some(""), 32),
    ] {
        assert_eq!(parse_setting(value, 32, 1..=256), want, "{value:?}");
    }
    if std::env::var_os("UNSHARD_REMOTE_READERS").is_none() {
        assert_eq!(readers(), 32);
    }
    if std::env::var_os("UNSHARD_REMOTE_AHEAD_MIB").is_none() {
        assert_eq!(ahead_limit(), 64 << 20);
    }
}
