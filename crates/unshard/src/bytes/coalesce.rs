//! Turning many small range requests into a few reads.
//!
//! Readers ask for what they need at once (every local header of a zip, both ends of
//! a DCP chunk archive). [`coalesce`] groups the requests into runs, each served by
//! one read: ranges that overlap, touch, or lie within a small gap of each other share
//! a run, as long as the run stays short enough to be held in memory. [`read_runs`]
//! makes the reads and copies each request's bytes out. Sources with another cost
//! model (many requests in flight) reuse [`coalesce`] with their own gap and run size.

use super::{short_read, ByteSource};
use crate::error::Result;

/// One read serving several requested ranges.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Run {
    /// First byte of the read.
    pub start: u64,
    /// One past its last byte.
    pub end: u64,
    /// Indices of the requests it serves, in order of offset.
    pub members: Vec<usize>,
}

/// Groups `(offset, len)` requests into runs: sorted by offset, a request joins the
/// current run when it starts no more than `max_gap` bytes after the run's end and the
/// run would not grow beyond `max_run` bytes. Empty requests need no bytes and join no
/// run. Every non-empty request is in exactly one run, inside its bounds. Offsets
/// must not overflow with their lengths (see [`super::spans`]).
pub fn coalesce(requests: &[(u64, u64)], max_gap: u64, max_run: u64) -> Vec<Run> {
    let mut order: Vec<usize> = (0..requests.len()).filter(|&i| requests[i].1 > 0).collect();
    order.sort_by_key(|&i| requests[i]);
    let mut runs: Vec<Run> = Vec::new();
    for i in order {
        let (offset, len) = requests[i];
        let end = offset.saturating_add(len);
        if let Some(run) = runs.last_mut() {
            let near = offset <= run.end.saturating_add(max_gap);
            if near && end.max(run.end) - run.start <= max_run {
                run.end = run.end.max(end);
                run.members.push(i);
                continue;
            }
        }
        runs.push(Run {
            start: offset,
            end,
            members: vec![i],
        });
    }
    runs
}

/// Serves `ranges` by reading each run once: a run of one request reads straight
/// into its buffer, a longer one into a scratch buffer whose parts are copied out.
/// When a shared read fails, its requests are read one by one so that the error
/// names the range at fault.
pub fn read_runs<S: ByteSource + ?Sized>(
    src: &S,
    ranges: &mut [(u64, &mut [u8])],
    runs: &[Run],
) -> Result<()> {
    let mut scratch = Vec::new();
    for run in runs {
        if let [only] = run.members[..] {
            let (offset, buf) = &mut ranges[only];
            src.read_at(*offset, buf)?;
            continue;
        }
        let span = run.end - run.start;
        let n = usize::try_from(span).map_err(|_| short_read(src.name(), run.start, span))?;
        scratch.resize(n, 0);
        if src.read_at(run.start, &mut scratch).is_err() {
            // Read each request on its own: the first that fails names its range (if
            // none does, the shared read only failed in a gap and all are served).
            for &m in &run.members {
                let (offset, buf) = &mut ranges[m];
                src.read_at(*offset, buf)?;
            }
            continue;
        }
        for &m in &run.members {
            let (offset, buf) = &mut ranges[m];
            let at = (*offset - run.start) as usize;
            buf.copy_from_slice(&scratch[at..at + buf.len()]);
        }
    }
    Ok(())
}
