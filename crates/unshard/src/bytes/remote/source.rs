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
//! - **In flight**: [`READERS`] = 32 workers when any input is remote, each waiting
//!   on its block's GET, so 32 GETs of 8-16 MiB are in flight. One S3 stream
//!   delivers ~80-100 MB/s: 14 streams fill a 10 Gbit NIC (1.25 GB/s), 32 fill 25
//!   Gbit (3.1 GB/s); `UNSHARD_REMOTE_READERS` changes it (1-256). The engine keeps 2
//!   per core for local inputs.
//! - **Memory** while merging from a bucket is bounded by 32 × (16 MiB fetched
//!   for a block + 8 MiB block + 1 MiB chunk) = 800 MiB in the worst case (a
//!   float32 to bfloat16 merge), 32 × (8 + 8) = 512 MiB when nothing is converted.
//!   The fetched bytes are capped process-wide by [`ahead_limit`] ([`AHEAD_PER_READER`]
//!   = 16 MiB per worker, 512 MiB with 32) with at most [`readers`] fetches in flight;
//!   past the cap a hint is ignored and reads go to the store one by one.
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
        std::env::var("UNSHARD_REMOTE_READERS")
            .ok()
            .and_then(|v| v.trim().parse::<usize>().ok())
            .map_or(READERS, |n| n.clamp(1, 256))
    })
}

/// Ranges closer than this are fetched by one request.
pub const GAP: u64 = 1 << 20;
/// The longest request made to serve several ranges.
pub const MAX_RUN: u64 = 16 << 20;
/// Requests [`ByteSource::read_ranges`] keeps in flight.
pub const IN_FLIGHT: usize = 32;
/// Bytes fetched ahead and not yet read, per worker: the input of one output block
/// (8 MiB of bfloat16 output from float32 input).
pub const AHEAD_PER_READER: u64 = 16 << 20;
/// Bytes fetched ahead and not yet read, over all objects: [`AHEAD_PER_READER`] for
/// each of the [`readers`] (512 MiB with 32).
pub fn ahead_limit() -> u64 {
    (readers() as u64 * AHEAD_PER_READER).max(MAX_AHEAD)
}
/// The longest span one hint fetches ahead (a block's input read from float64).
const MAX_AHEAD: u64 = 32 << 20;
/// Ranges of one block closer than this are fetched by one request: what lies
/// between two tensors of a file is a few hundred bytes of headers.
pub const BLOCK_GAP: u64 = 64 << 10;

static AHEAD_BYTES: AtomicU64 = AtomicU64::new(0);

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
/// them): a DCP checkpoint of thousands of chunk files asks for both ends of each
/// when it is opened, and each engine worker asks for its block's input.
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
}

impl Drop for Ahead {
    fn drop(&mut self) {
        AHEAD_BYTES.fetch_sub(self.end - self.start, Ordering::Relaxed);
    }
}

/// One object, opened: its client, key and size.
pub struct ObjectSource {
    loc: Location,
    len: u64,
    ahead: Mutex<Vec<Ahead>>,
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
            ahead: Mutex::new(Vec::new()),
        })
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

    /// Starts fetching `[offset, end)` in the background, unless a fetch already
    /// covers it, it is too long, or the read-ahead cap is reached (the reads then go
    /// to the store one by one).
    fn fetch_ahead(&self, ahead: &mut Vec<Ahead>, offset: u64, end: u64, block: bool) {
        let len = end.saturating_sub(offset);
        if len == 0 || len > MAX_AHEAD || end > self.len {
            return;
        }
        if ahead.iter().any(|a| a.start <= offset && end <= a.end) {
            return;
        }
        if AHEAD_BYTES.fetch_add(len, Ordering::Relaxed) + len > ahead_limit() {
            AHEAD_BYTES.fetch_sub(len, Ordering::Relaxed);
            return;
        }
        let slot = Arc::new(Slot::default());
        let (store, key, filled) = (self.loc.store.clone(), self.loc.key.clone(), slot.clone());
        count_get(&(offset..end));
        drop(store::spawn(async move {
            let _permit = ahead_in_flight().acquire().await;
            let got = store.get_range(&key, offset..end).await;
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
            block,
        });
    }

    /// The bytes at `offset` from a fetch started by a hint, if one covers them.
    fn take_ahead(&self, offset: u64, buf: &mut [u8]) -> bool {
        let end = offset + buf.len() as u64;
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
    /// already covers it, it is too long, or the read-ahead cap is reached.
    fn will_need(&self, offset: u64, len: u64) {
        let len = len.min(self.len.saturating_sub(offset));
        if len == 0 || len > MAX_AHEAD {
            return;
        }
        let mut ahead = self.ahead.lock().unwrap_or_else(|e| e.into_inner());
        self.fetch_ahead(&mut ahead, offset, offset + len, false);
    }

    /// Coalesces the block's ranges (less than [`BLOCK_GAP`] apart, runs of at most
    /// 32 MiB) and starts one fetch per run: one GET per block and input file.
    fn will_need_together(&self, ranges: &[(u64, u64)]) {
        let mut ahead = self.ahead.lock().unwrap_or_else(|e| e.into_inner());
        for run in self.block_runs(ranges) {
            self.fetch_ahead(&mut ahead, run.start, run.end, true);
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
