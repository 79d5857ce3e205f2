//! An object in a bucket as a [`ByteSource`]: ranged GETs, many in flight.
//!
//! The numbers, and why:
//! - **Reads of tensor data** come from the engine's blocks: before a worker fills
//!   an output block (8 MiB), it announces every input range the block reads
//!   ([`ByteSource::will_need_together`], from `write::fetch`). Ranges of one object
//!   less than [`BLOCK_GAP`] = 64 KiB apart (neighbouring tensors: a zip's local
//!   header, a safetensors file's nothing) become one ranged GET of at most 32 MiB,
//!   started in the background; the worker's reads of the pieces, in any order and
//!   1 MiB at a time when it converts, are served from that response, which is
//!   dropped when the block is done ([`ByteSource::done_with`]). So a block costs
//!   one GET per input file it reads (two where it holds the end of one tensor and
//!   the start of another stored apart), and each input byte is fetched once (the
//!   gaps, a few hundred bytes of headers, are all that may be fetched twice).
//! - **In flight**: [`READERS`] = 32 workers when any input is remote
//!   (`UNSHARD_REMOTE_READERS`, 1-256). What bounds the requests is bytes, not
//!   workers: a block's fetches start only when their bytes fit in the process's
//!   [`Budget`] of [`ahead_limit`] = 64 MiB (`UNSHARD_REMOTE_AHEAD_MIB`), four
//!   blocks of float32 input; the worker waits for that in
//!   [`ByteSource::will_need_together`], before it takes its output buffer, so
//!   waiting workers hold no memory. The bytes come back when the block is done.
//!   A block that reads several objects takes their bytes object by object; it
//!   waits for a later object's only while another block holding bytes is still
//!   working, so no two blocks wait for each other (the last to ask reads that
//!   object directly, a GET per read).
//! - **Memory** while merging from a bucket: the budget, plus an output block
//!   (8 MiB) and a conversion chunk (1 MiB) per worker that got its bytes. Hints
//!   that are not a block's take at most half the budget, so a block always fits
//!   once the other blocks are done. A block whose input alone exceeds the budget
//!   (more than 64 MiB read for 8 MiB of output) is fetched when nothing else is.
//! - **Metadata**: [`ByteSource::read_ranges`] (zip local headers, both ends of DCP
//!   chunk archives) coalesces ranges less than [`GAP`] = 1 MiB apart into runs of at
//!   most [`MAX_RUN`] = 16 MiB (one request costs ~10-50 ms; 1 MiB streams in ~10 ms)
//!   and fetches up to [`IN_FLIGHT`] = 32 runs at once. Small whole files (a
//!   `.metadata`, a config, an index) are one GET each.
//! - [`fetched`] counts the GETs and bytes, for tests and benchmarks.

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};

use object_store::ObjectStoreExt;

use super::store::{self, io_error, Location};
use crate::bytes::{coalesce, short_read, spans, ByteSource, Run};
use crate::error::{Error, Result};

/// Workers the engine runs when an input is an object (see the module docs).
pub const READERS: usize = 32;
/// [`READERS`], or `UNSHARD_REMOTE_READERS` (1 to 256) when set: fewer for a small
/// machine or a slow link, more for a 100 Gbit one.
pub fn readers() -> usize {
    static N: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *N.get_or_init(|| {
        let n = setting("UNSHARD_REMOTE_READERS", READERS as u64, 1..=256);
        usize::try_from(n).unwrap_or(READERS)
    })
}

/// The environment variable `name` as a whole number inside `bounds` (clamped),
/// or `default` when it is unset or not a whole number.
fn setting(name: &str, default: u64, bounds: std::ops::RangeInclusive<u64>) -> u64 {
    parse_setting(std::env::var(name).ok().as_deref(), default, bounds)
}

/// What [`setting`] makes of a variable's value (`None` when unset).
fn parse_setting(value: Option<&str>, default: u64, bounds: std::ops::RangeInclusive<u64>) -> u64 {
    value
        .and_then(|v| v.trim().parse::<u64>().ok())
        .map_or(default, |n| n.clamp(*bounds.start(), *bounds.end()))
}

/// Ranges closer than this are fetched by one request.
pub const GAP: u64 = 1 << 20;
/// The longest request made to serve several ranges.
pub const MAX_RUN: u64 = 16 << 20;
/// Requests [`ByteSource::read_ranges`] keeps in flight.
pub const IN_FLIGHT: usize = 32;
/// Bytes fetched ahead and not yet read, over all objects and workers, by default:
/// four blocks' input (8 MiB of bfloat16 output from float32 input each).
pub const AHEAD_BYTES: u64 = 64 << 20;
/// [`AHEAD_BYTES`], or `UNSHARD_REMOTE_AHEAD_MIB` MiB when set (64 to 65536): more
/// for a fast link far away, where more bytes must be on the way to fill it.
pub fn ahead_limit() -> u64 {
    static N: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *N.get_or_init(|| setting("UNSHARD_REMOTE_AHEAD_MIB", AHEAD_BYTES >> 20, 64..=65536) << 20)
}
/// The longest span one hint fetches ahead (a block's input read from float64).
/// At most half of [`ahead_limit`], so that a block always fits beside what hints
/// that are not a block's hold (see [`Budget::try_take`]).
const MAX_AHEAD: u64 = 32 << 20;
/// Ranges of one block closer than this are fetched by one request: what lies
/// between two tensors of a file is a few hundred bytes of headers.
pub const BLOCK_GAP: u64 = 64 << 10;

/// The bytes fetched ahead and not yet let go: started by a hint, until read or
/// until the block that announced them is done. A worker that announces a block
/// waits here until its bytes fit under the limit, before it takes its output
/// buffer, so the memory of a merge from a bucket does not grow with the number of
/// workers.
pub(crate) struct Budget {
    limit: u64,
    used: Mutex<Used>,
    freed: Condvar,
    /// The most bytes ever held at once (tests and benchmarks).
    peak: AtomicU64,
}

#[derive(Default)]
struct Used {
    bytes: u64,
    /// Bytes held by blocks, per thread that announced them.
    by_thread: std::collections::HashMap<std::thread::ThreadId, u64>,
    /// Threads that hold bytes for a block and wait for more (a block that reads
    /// several files announces them one by one).
    waiting_holders: usize,
}

impl Budget {
    pub(crate) fn new(limit: u64) -> Budget {
        Budget {
            limit,
            used: Mutex::new(Used::default()),
            freed: Condvar::new(),
            peak: AtomicU64::new(0),
        }
    }

    /// The most bytes held at once so far.
    #[cfg_attr(not(test), allow(dead_code))]
    pub(crate) fn peak(&self) -> u64 {
        self.peak.load(Ordering::Relaxed)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Used> {
        self.used.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn took(&self, used: &mut Used, n: u64, owner: Option<std::thread::ThreadId>) {
        used.bytes += n;
        if let Some(t) = owner {
            *used.by_thread.entry(t).or_default() += n;
        }
        self.peak.fetch_max(used.bytes, Ordering::Relaxed);
    }

    /// `n` bytes for a hint that is not a block's, if they fit in half the limit
    /// (so that what such hints hold, read or not, never keeps a block out).
    fn try_take(&self, n: u64) -> bool {
        let mut used = self.lock();
        if used.bytes + n > self.limit / 2 {
            return false;
        }
        self.took(&mut used, n, None);
        true
    }

    /// `n` bytes for a block announced by this thread: waits until they fit. A
    /// thread that already holds bytes for its block (an earlier file of it) waits
    /// only while another holder is still working, whose bytes will come back;
    /// otherwise it gets nothing (its reads go to the store one by one) rather than
    /// wait for itself. A block larger than the limit is fetched when nothing else is.
    fn take_for_block(&self, n: u64) -> bool {
        let me = std::thread::current().id();
        let mut used = self.lock();
        let holder = used.by_thread.contains_key(&me);
        loop {
            let fits = used.bytes + n <= self.limit || used.bytes == 0;
            if fits && (holder || used.waiting_holders == 0) {
                self.took(&mut used, n, Some(me));
                return true;
            }
            if holder {
                let others_working = used.by_thread.len() - 1 - used.waiting_holders;
                if others_working == 0 {
                    return false;
                }
                used.waiting_holders += 1;
                used = self.freed.wait(used).unwrap_or_else(|e| e.into_inner());
                used.waiting_holders -= 1;
            } else {
                used = self.freed.wait(used).unwrap_or_else(|e| e.into_inner());
            }
        }
    }

    fn give(&self, n: u64, owner: Option<std::thread::ThreadId>) {
        let mut used = self.lock();
        used.bytes -= n;
        if let Some(t) = owner {
            if let Some(held) = used.by_thread.get_mut(&t) {
                *held -= n;
                if *held == 0 {
                    used.by_thread.remove(&t);
                }
            }
        }
        drop(used);
        self.freed.notify_all();
    }
}

/// The process's [`Budget`], of [`ahead_limit`] bytes.
fn budget() -> &'static Budget {
    static B: std::sync::OnceLock<Budget> = std::sync::OnceLock::new();
    B.get_or_init(|| Budget::new(ahead_limit()))
}

/// GET requests made for object contents, and the bytes they asked for.
static GETS: AtomicU64 = AtomicU64::new(0);
static GOT_BYTES: AtomicU64 = AtomicU64::new(0);

fn count_get(range: &std::ops::Range<u64>) {
    GETS.fetch_add(1, Ordering::Relaxed);
    GOT_BYTES.fetch_add(range.end - range.start, Ordering::Relaxed);
}

/// Ranged GETs this process made for object contents so far, and the bytes they
/// asked for (listings and small whole objects are not counted).
#[cfg_attr(not(feature = "internals"), allow(dead_code))] // for the tests and fuzz targets
pub fn fetched() -> (u64, u64) {
    (
        GETS.load(Ordering::Relaxed),
        GOT_BYTES.load(Ordering::Relaxed),
    )
}

/// Fetches started by hints in flight at once, over all objects ([`readers`] of
/// them, or [`IN_FLIGHT`]): a DCP checkpoint of thousands of chunk files asks for
/// both ends of each when it is opened. The bytes are bounded by the [`Budget`].
fn ahead_in_flight() -> &'static tokio::sync::Semaphore {
    static S: std::sync::OnceLock<tokio::sync::Semaphore> = std::sync::OnceLock::new();
    S.get_or_init(|| tokio::sync::Semaphore::new(readers().max(IN_FLIGHT)))
}

/// A fetch started by a hint: filled by a background task, read by a worker.
#[derive(Default)]
struct Slot {
    data: Mutex<Option<std::result::Result<bytes::Bytes, ()>>>,
    ready: Condvar,
}

struct Ahead {
    start: u64,
    end: u64,
    slot: Arc<Slot>,
    /// Started for a block ([`ByteSource::will_need_together`]): kept until the block
    /// is done, whatever order its pieces are read in.
    block: bool,
    /// Its bytes are counted here until it is dropped; for a block, as held by the
    /// thread that announced it.
    budget: &'static Budget,
    owner: Option<std::thread::ThreadId>,
}

impl Drop for Ahead {
    fn drop(&mut self) {
        self.budget.give(self.end - self.start, self.owner);
    }
}

/// One object, opened: its client, key and size.
pub struct ObjectSource {
    loc: Location,
    len: u64,
    ahead: Arc<Mutex<Vec<Ahead>>>,
    budget: &'static Budget,
}

/// Whether `[offset, end)` of an object of `len` bytes is worth a fetch ahead: not
/// empty, not too long, inside the object, and not covered by a fetch started.
fn wanted(ahead: &[Ahead], len: u64, offset: u64, end: u64) -> bool {
    let n = end.saturating_sub(offset);
    n > 0
        && n <= MAX_AHEAD
        && end <= len
        && !ahead.iter().any(|a| a.start <= offset && end <= a.end)
}

/// Starts fetching `[offset, end)` of `loc` in the background; its bytes were taken
/// from `budget` (for `owner`'s block, or for a hint when `None`).
fn fetch_ahead(
    ahead: &mut Vec<Ahead>,
    loc: &Location,
    budget: &'static Budget,
    (offset, end): (u64, u64),
    owner: Option<std::thread::ThreadId>,
) {
    let len = end - offset;
    let slot = Arc::new(Slot::default());
    let (store, key, filled) = (loc.store.clone(), loc.key.clone(), slot.clone());
    count_get(&(offset..end));
    drop(store::spawn(async move {
        let _permit = ahead_in_flight().acquire().await;
        let got = store::again(|| store.get_range(&key, offset..end)).await;
        let got = match got {
            Ok(b) if b.len() as u64 == len => Ok(b),
            _ => Err(()),
        };
        *filled.data.lock().unwrap_or_else(|e| e.into_inner()) = Some(got);
        filled.ready.notify_all();
    }));
    ahead.push(Ahead {
        start: offset,
        end,
        slot,
        block: owner.is_some(),
        budget,
        owner,
    });
}

impl std::fmt::Debug for ObjectSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ObjectSource")
            .field("url", &self.loc.url)
            .field("len", &self.len)
            .finish()
    }
}

impl ObjectSource {
    /// Opens the object at `loc` whose size is known (from a listing), or asks for it.
    pub fn open(loc: Location, len: Option<u64>) -> Result<ObjectSource> {
        let len = match len {
            Some(n) => n,
            None => store::head(&loc)?.ok_or_else(|| {
                Error::io(
                    "open",
                    &loc.url,
                    std::io::Error::new(std::io::ErrorKind::NotFound, "no such object"),
                )
            })?,
        };
        Ok(ObjectSource {
            loc,
            len,
            ahead: Arc::new(Mutex::new(Vec::new())),
            budget: budget(),
        })
    }

    /// The same source counting its fetches ahead in `budget` instead of the
    /// process's (tests).
    #[cfg(test)]
    pub(crate) fn with_budget(self, budget: &'static Budget) -> ObjectSource {
        ObjectSource { budget, ..self }
    }

    fn get(&self, offset: u64, len: u64) -> Result<bytes::Bytes> {
        if len == 0 {
            return Ok(bytes::Bytes::new());
        }
        let end = offset
            .checked_add(len)
            .filter(|&e| e <= self.len)
            .ok_or_else(|| short_read(&self.loc.url, offset, len))?;
        count_get(&(offset..end));
        let body = store::block_on(store::again(|| {
            self.loc.store.get_range(&self.loc.key, offset..end)
        }))
        .map_err(|e| io_error("read", &self.loc.url, e))?;
        if body.len() as u64 != len {
            return Err(short_read(&self.loc.url, offset, len));
        }
        Ok(body)
    }

    /// The runs a block's ranges are fetched in (inside the object).
    fn block_runs(&self, ranges: &[(u64, u64)]) -> Vec<Run> {
        let inside: Vec<(u64, u64)> = ranges
            .iter()
            .map(|&(o, l)| (o.min(self.len), l.min(self.len.saturating_sub(o))))
            .collect();
        coalesce(&inside, BLOCK_GAP, MAX_AHEAD)
    }

    /// The bytes at `offset` from a fetch started by a hint, if one covers them.
    fn take_ahead(&self, offset: u64, buf: &mut [u8]) -> bool {
        let Some(end) = offset.checked_add(buf.len() as u64) else {
            return false;
        };
        let slot = {
            let ahead = self.ahead.lock().unwrap_or_else(|e| e.into_inner());
            match ahead.iter().find(|a| a.start <= offset && end <= a.end) {
                Some(a) => (a.start, a.end, a.slot.clone(), a.block),
                None => return false,
            }
        };
        let (start, a_end, slot, block) = slot;
        let mut data = slot.data.lock().unwrap_or_else(|e| e.into_inner());
        while data.is_none() {
            data = slot.ready.wait(data).unwrap_or_else(|e| e.into_inner());
        }
        let served = match data.as_ref() {
            Some(Ok(bytes)) => {
                let at = (offset - start) as usize;
                match bytes.get(at..at + buf.len()) {
                    Some(src) => {
                        buf.copy_from_slice(src);
                        true
                    }
                    None => false,
                }
            }
            // A failed fetch: the direct read that follows reports the error.
            _ => false,
        };
        drop(data);
        // A piece's span is read front to back: the read that reaches its end is the
        // last (a failed fetch is dropped at once). A block's fetch waits for
        // `done_with`.
        if !served || (end >= a_end && !block) {
            let mut ahead = self.ahead.lock().unwrap_or_else(|e| e.into_inner());
            ahead.retain(|a| !(a.start == start && a.end == a_end && Arc::ptr_eq(&a.slot, &slot)));
        }
        served
    }
}

impl ByteSource for ObjectSource {
    fn name(&self) -> &Path {
        &self.loc.url
    }

    fn len(&self) -> u64 {
        self.len
    }

    fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<()> {
        if buf.is_empty() || self.take_ahead(offset, buf) {
            return Ok(());
        }
        let data = self.get(offset, buf.len() as u64)?;
        buf.copy_from_slice(&data);
        Ok(())
    }

    /// Coalesces the ranges (see the module docs) and fetches the runs concurrently.
    fn read_ranges(&self, ranges: &mut [(u64, &mut [u8])]) -> Result<()> {
        let runs = coalesce(&spans(&self.loc.url, ranges)?, GAP, MAX_RUN);
        for r in &runs {
            if r.end > self.len {
                return Err(short_read(&self.loc.url, r.start, r.end - r.start));
            }
        }
        let limit = Arc::new(tokio::sync::Semaphore::new(IN_FLIGHT));
        let tasks: Vec<_> = runs
            .iter()
            .map(|r| {
                let (store, key, limit) =
                    (self.loc.store.clone(), self.loc.key.clone(), limit.clone());
                let range = r.start..r.end;
                count_get(&range);
                store::spawn(async move {
                    let _permit = limit.acquire_owned().await;
                    store::again(|| store.get_range(&key, range.clone())).await
                })
            })
            .collect();
        let bodies = store::block_on(async move {
            let mut out = Vec::with_capacity(tasks.len());
            for t in tasks {
                out.push(t.await);
            }
            out
        });
        for (run, body) in runs.iter().zip(bodies) {
            let body = match body {
                Ok(Ok(b)) => b,
                Ok(Err(e)) => return Err(io_error("read", &self.loc.url, e)),
                Err(e) => return Err(Error::io("read", &self.loc.url, std::io::Error::other(e))),
            };
            if body.len() as u64 != run.end - run.start {
                return Err(short_read(&self.loc.url, run.start, run.end - run.start));
            }
            for &m in &run.members {
                let (offset, buf) = &mut ranges[m];
                let at = (*offset - run.start) as usize;
                buf.copy_from_slice(&body[at..at + buf.len()]);
            }
        }
        Ok(())
    }

    /// Starts fetching `[offset, offset + len)` in the background, unless a fetch
    /// already covers it, it is too long, or the bytes do not fit in the budget now
    /// (the reads then go to the store one by one).
    fn will_need(&self, offset: u64, len: u64) {
        let len = len.min(self.len.saturating_sub(offset));
        let end = offset.saturating_add(len);
        let mut ahead = self.ahead.lock().unwrap_or_else(|e| e.into_inner());
        if wanted(&ahead, self.len, offset, end) && self.budget.try_take(len) {
            fetch_ahead(&mut ahead, &self.loc, self.budget, (offset, end), None);
        }
    }

    /// Coalesces the block's ranges (less than [`BLOCK_GAP`] apart, runs of at most
    /// 32 MiB), waits until their bytes fit in the budget, then starts one fetch
    /// per run. The worker takes its output buffer after this, so workers waiting
    /// here hold no memory. A block that reads several objects waits for a later
    /// one only while another block holding bytes is still working; otherwise that
    /// object's reads go to the store one by one (see `Budget::take_for_block`).
    fn will_need_together(&self, ranges: &[(u64, u64)]) {
        let runs: Vec<(u64, u64)> = {
            let ahead = self.ahead.lock().unwrap_or_else(|e| e.into_inner());
            self.block_runs(ranges)
                .into_iter()
                .map(|r| (r.start, r.end))
                .filter(|&(start, end)| wanted(&ahead, self.len, start, end))
                .collect()
        };
        let total: u64 = runs.iter().map(|&(s, e)| e - s).sum();
        if total == 0 || !self.budget.take_for_block(total) {
            return;
        }
        let me = std::thread::current().id();
        let mut left = total;
        let mut ahead = self.ahead.lock().unwrap_or_else(|e| e.into_inner());
        for run in runs {
            // Another worker may have started the same run while this one waited.
            if wanted(&ahead, self.len, run.0, run.1) {
                left -= run.1 - run.0;
                fetch_ahead(&mut ahead, &self.loc, self.budget, run, Some(me));
            }
        }
        drop(ahead);
        if left > 0 {
            self.budget.give(left, Some(me));
        }
    }

    /// Drops the fetches [`ByteSource::will_need_together`] started for `ranges`.
    fn done_with(&self, ranges: &[(u64, u64)]) {
        let runs = self.block_runs(ranges);
        let mut ahead = self.ahead.lock().unwrap_or_else(|e| e.into_inner());
        ahead.retain(|a| !(a.block && runs.iter().any(|r| r.start == a.start && r.end == a.end)));
    }

    /// Drops fetches that lie inside the released range.
    fn release(&self, offset: u64, len: u64) {
        let end = offset.saturating_add(len);
        let mut ahead = self.ahead.lock().unwrap_or_else(|e| e.into_inner());
        ahead.retain(|a| !(offset <= a.start && a.end <= end));
    }

    fn readers(&self) -> usize {
        readers()
    }
}

#[cfg(test)]
mod tests;
