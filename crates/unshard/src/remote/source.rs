//! An object in a bucket as a [`ByteSource`]: ranged GETs, many in flight.
//!
//! The numbers, and why:
//! - **Reads of tensor data** come from the engine's blocks: each worker asks for
//!   the input span of one output block (at most 8 MiB of output, at most 16 MiB of
//!   input when widening is undone) with [`ByteSource::will_need`], which starts one
//!   ranged GET for the span in the background, then reads it front to back (in 1 MiB
//!   chunks when it converts), served from that response. One GET per span: each
//!   input byte is fetched once.
//! - **In flight**: [`READERS`] = 32 workers when any input is remote (a single S3
//!   stream delivers ~80-100 MB/s, so 32 streams of 8-16 MiB fill a 25 Gbit NIC;
//!   the engine keeps 2 per core for local inputs). Memory while merging from a
//!   bucket is therefore bounded by 32 × (8 MiB block + 1 MiB chunk + 16 MiB span)
//!   = 800 MiB in the worst case (a converting merge), 288 MiB when nothing is
//!   converted (the span is read straight into the block), plus the read-ahead cap
//!   below.
//! - **Read-ahead cap**: spans fetched ahead and not yet consumed hold at most
//!   [`AHEAD_LIMIT`] = 256 MiB over the whole process, at most [`IN_FLIGHT`] = 32
//!   of them in flight; past the byte cap a hint is ignored and the read goes
//!   straight to the store.
//! - **Metadata**: [`ByteSource::read_ranges`] (zip local headers, both ends of DCP
//!   chunk archives) coalesces ranges less than [`GAP`] = 1 MiB apart into runs of at
//!   most [`MAX_RUN`] = 16 MiB (one request costs ~10-50 ms; 1 MiB streams in ~10 ms)
//!   and fetches up to [`IN_FLIGHT`] = 32 runs at once. Small whole files (a
//!   `.metadata`, a config, an index) are one GET each.

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};

use object_store::ObjectStoreExt;

use super::store::{self, io_error, Location};
use crate::source::bytes::{coalesce, short_read, spans, ByteSource};
use crate::{Error, Result};

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
/// Bytes fetched ahead and not yet read, over all objects.
pub const AHEAD_LIMIT: u64 = 256 << 20;
/// The longest span one hint fetches ahead.
const MAX_AHEAD: u64 = 32 << 20;

static AHEAD_BYTES: AtomicU64 = AtomicU64::new(0);

/// Fetches started by hints in flight at once, over all objects: a DCP checkpoint of
/// thousands of chunk files asks for both ends of each when it is opened.
static AHEAD_IN_FLIGHT: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(IN_FLIGHT);

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
        let body = store::block_on(self.loc.store.get_range(&self.loc.key, offset..end))
            .map_err(|e| io_error("read", &self.loc.url, e))?;
        if body.len() as u64 != len {
            return Err(short_read(&self.loc.url, offset, len));
        }
        Ok(body)
    }

    /// The bytes at `offset` from a fetch started by a hint, if one covers them.
    fn take_ahead(&self, offset: u64, buf: &mut [u8]) -> bool {
        let end = offset + buf.len() as u64;
        let slot = {
            let ahead = self.ahead.lock().unwrap_or_else(|e| e.into_inner());
            match ahead.iter().find(|a| a.start <= offset && end <= a.end) {
                Some(a) => (a.start, a.end, a.slot.clone()),
                None => return false,
            }
        };
        let (start, a_end, slot) = slot;
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
        // Workers read their span front to back: the read that reaches its end is
        // the last (a failed fetch is dropped at once).
        if !served || end >= a_end {
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
                store::spawn(async move {
                    let _permit = limit.acquire_owned().await;
                    store.get_range(&key, range).await
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
        let end = offset + len;
        let mut ahead = self.ahead.lock().unwrap_or_else(|e| e.into_inner());
        if ahead.iter().any(|a| a.start <= offset && end <= a.end) {
            return;
        }
        if AHEAD_BYTES.fetch_add(len, Ordering::Relaxed) + len > AHEAD_LIMIT {
            AHEAD_BYTES.fetch_sub(len, Ordering::Relaxed);
            return;
        }
        let slot = Arc::new(Slot::default());
        let (store, key, filled) = (self.loc.store.clone(), self.loc.key.clone(), slot.clone());
        drop(store::spawn(async move {
            let _permit = AHEAD_IN_FLIGHT.acquire().await;
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
        });
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
