//! The checkpoint's files read ahead while `.metadata` is parsed.
//!
//! From a cold cache, opening a checkpoint of many ranks first parses `.metadata`
//! (seconds of CPU for 80 MB) and only then scans the chunk archives of the
//! `.distcp` files, so the disk idles through the parse and the CPU through much of
//! the scan. The files are known from the directory listing before the parse, so a
//! thread asks the kernel (`posix_fadvise(WILLNEED)`) for `.metadata`, then for the
//! `.distcp` files in rank order, while the parse runs. It is bounded three ways:
//!
//! - in bytes: at most a share ([`SHARE`]) of the memory the system reports
//!   available, so that pages read ahead are not evicted before they are used and
//!   push little else out; the files beyond that are left to the reads that need
//!   them (whole files are taken in order, so a checkpoint larger than the budget
//!   gets its first files read ahead, not a little of each);
//! - in flight: at most [`AHEAD`] bytes (and [`STEPS`] requests) asked for and not
//!   yet known to be read: before asking for more the thread waits for the oldest
//!   request by reading its last byte, so the reads the parse and the scan wait for
//!   queue behind a few MB, not behind the whole checkpoint;
//! - in time: it stops when the open is over (see [`Readahead`]'s `Drop`).
//!
//! Only hints: nothing read here is used from here, and a file that does not open
//! is skipped (the readers report it).

use std::collections::VecDeque;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

/// Bytes asked for with one hint.
const STEP: u64 = 8 << 20;
/// Bytes asked for and not yet known to be read, at most.
const AHEAD: u64 = 32 << 20;
/// Requests not yet known to be read, at most (each holds its file open).
const STEPS: usize = 4;
/// The read-ahead budget is the available memory divided by this.
const SHARE: u64 = 4;

/// A thread reading ahead; stopped (and joined) when dropped.
pub(super) struct Readahead {
    stop: Arc<AtomicBool>,
    handle: Option<JoinHandle<u64>>,
}

impl Readahead {
    /// Starts reading ahead the files of the local DCP directory `dir`, within a
    /// budget of a [`SHARE`] of the available memory. `None` for a remote directory,
    /// when the available memory is unknown, or when there is nothing to read.
    pub(super) fn start(dir: &Path) -> Option<Readahead> {
        if crate::bytes::fs::is_url(dir) {
            return None;
        }
        let budget = available_memory()? / SHARE;
        let dir = dir.to_path_buf();
        Readahead::spawn(move |stop| read_ahead(&dir, budget, stop))
    }

    fn spawn(f: impl FnOnce(&AtomicBool) -> u64 + Send + 'static) -> Option<Readahead> {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let handle = std::thread::Builder::new()
            .name("unshard-readahead".into())
            .spawn(move || f(&flag))
            .ok()?;
        Some(Readahead {
            stop,
            handle: Some(handle),
        })
    }

    /// Stops the thread; returns how many bytes it asked for.
    #[cfg_attr(not(test), allow(dead_code))]
    pub(super) fn finish(mut self) -> u64 {
        self.stop_and_join()
    }

    fn stop_and_join(&mut self) -> u64 {
        self.stop.store(true, Ordering::Relaxed);
        self.handle.take().and_then(|h| h.join().ok()).unwrap_or(0)
    }
}

impl Drop for Readahead {
    fn drop(&mut self) {
        self.stop_and_join();
    }
}

/// Reads the files of `dir` ahead (see [`plan`] and [`run`]); returns the bytes
/// asked for.
fn read_ahead(dir: &Path, budget: u64, stop: &AtomicBool) -> u64 {
    let Ok(entries) = crate::bytes::fs::list(dir) else {
        return 0;
    };
    let files: Vec<(PathBuf, u64)> = entries
        .into_iter()
        .filter(|e| !e.is_dir)
        .map(|e| (e.path, e.len))
        .collect();
    run(&plan(&files, budget), STEP, AHEAD, STEPS, stop, &mut Kernel)
}

/// What to read ahead, in order: `.metadata` first (the parse waits for it), then
/// the `.distcp` files by rank (`__10_0` after `__9_0`), each whole, as long as the
/// total stays within `budget`.
fn plan(files: &[(PathBuf, u64)], budget: u64) -> Vec<(PathBuf, u64)> {
    let name = |p: &Path| p.file_name().map(|n| n.to_string_lossy().into_owned());
    let mut data: Vec<(String, &PathBuf, u64)> = files
        .iter()
        .filter_map(|(p, len)| Some((name(p)?, p, *len)))
        .filter(|(n, _, _)| n.ends_with(".distcp"))
        .collect();
    // Shorter names first: rank 9 before rank 10.
    data.sort_by(|a, b| (a.0.len(), &a.0).cmp(&(b.0.len(), &b.0)));
    let meta = files
        .iter()
        .filter(|(p, _)| name(p).as_deref() == Some(".metadata"))
        .map(|(p, len)| (String::new(), p, *len));
    let mut out = Vec::new();
    let mut total = 0u64;
    for (_, path, len) in meta.chain(data) {
        match total.checked_add(len) {
            Some(t) if t <= budget => total = t,
            _ => break,
        }
        if len > 0 {
            out.push((path.clone(), len));
        }
    }
    out
}

/// Where [`run`]'s requests go: the kernel, or a test's record.
trait Disk {
    type File;
    fn open(&mut self, path: &Path) -> Option<Self::File>;
    /// Asks for `len` bytes at `offset` to be read, without waiting.
    fn will_need(&mut self, file: &Self::File, offset: u64, len: u64);
    /// Waits until the byte at `offset` has been read.
    fn wait(&mut self, file: &Self::File, offset: u64);
}

struct Kernel;

impl Disk for Kernel {
    type File = File;

    fn open(&mut self, path: &Path) -> Option<File> {
        File::open(path).ok()
    }

    fn will_need(&mut self, file: &File, offset: u64, len: u64) {
        crate::bytes::advise_will_need(file, offset, len);
    }

    fn wait(&mut self, file: &File, offset: u64) {
        let _ = file.read_at(&mut [0u8], offset);
    }
}

/// Asks `disk` for every file of `plan` front to back in requests of `step`
/// bytes, with at most `ahead` bytes and `steps` requests not yet waited for;
/// stops early when `stop` is set. Returns the bytes asked for.
fn run<D: Disk>(
    plan: &[(PathBuf, u64)],
    step: u64,
    ahead: u64,
    steps: usize,
    stop: &AtomicBool,
    disk: &mut D,
) -> u64 {
    let step = step.max(1);
    let mut asked = 0u64;
    // Requests not waited for: file, last byte, length.
    let mut pending: VecDeque<(Arc<D::File>, u64, u64)> = VecDeque::new();
    let mut in_flight = 0u64;
    for (path, len) in plan {
        let Some(file) = disk.open(path).map(Arc::new) else {
            continue;
        };
        let mut at = 0;
        while at < *len {
            if stop.load(Ordering::Relaxed) {
                return asked;
            }
            let n = step.min(len - at);
            while !pending.is_empty() && (in_flight + n > ahead || pending.len() >= steps) {
                if let Some((f, last, l)) = pending.pop_front() {
                    disk.wait(&f, last);
                    in_flight -= l;
                }
            }
            disk.will_need(&file, at, n);
            pending.push_back((file.clone(), at + n - 1, n));
            in_flight += n;
            asked += n;
            at += n;
        }
    }
    asked
}

/// The memory the system reports available (`MemAvailable`: free memory plus what
/// the page cache could give back), in bytes; `None` where it is not known.
fn available_memory() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn files(list: &[(&str, u64)]) -> Vec<(PathBuf, u64)> {
        list.iter()
            .map(|(n, l)| (PathBuf::from("/ckpt").join(n), *l))
            .collect()
    }

    fn names(plan: &[(PathBuf, u64)]) -> Vec<String> {
        plan.iter()
            .map(|(p, _)| p.file_name().unwrap().to_string_lossy().into_owned())
            .collect()
    }

    /// `.metadata` first, then the rank files in rank order, whole, while the total
    /// stays within the budget; other files never.
    #[test]
    fn the_plan_takes_metadata_then_ranks_in_order_within_the_budget() {
        let all = files(&[
            ("__10_0.distcp", 100),
            ("__2_0.distcp", 100),
            ("config.json", 5),
            (".metadata", 50),
            ("__1_0.distcp", 100),
            ("__0_0.distcp", 0),
        ]);
        assert_eq!(
            names(&plan(&all, u64::MAX)),
            [".metadata", "__1_0.distcp", "__2_0.distcp", "__10_0.distcp"]
        );
        // 50 + 100 + 100 = 250: the third rank file would go over.
        let p = plan(&all, 349);
        assert_eq!(names(&p), [".metadata", "__1_0.distcp", "__2_0.distcp"]);
        assert!(p.iter().map(|(_, l)| l).sum::<u64>() <= 349);
        assert!(plan(&all, 49).is_empty());
    }

    /// A record of the requests, with what is in flight checked at each.
    #[derive(Default)]
    struct Record {
        /// Per file: the ranges asked for.
        asked: HashMap<PathBuf, Vec<(u64, u64)>>,
        /// Ranges asked for and not waited for.
        flying: Vec<(PathBuf, u64, u64)>,
        max_bytes: u64,
        max_requests: usize,
        waits: usize,
    }

    impl Disk for Record {
        type File = PathBuf;
        fn open(&mut self, path: &Path) -> Option<PathBuf> {
            (!path.ends_with("missing")).then(|| path.to_path_buf())
        }
        fn will_need(&mut self, file: &PathBuf, offset: u64, len: u64) {
            self.asked
                .entry(file.clone())
                .or_default()
                .push((offset, len));
            self.flying.push((file.clone(), offset, len));
            let bytes = self.flying.iter().map(|f| f.2).sum();
            self.max_bytes = self.max_bytes.max(bytes);
            self.max_requests = self.max_requests.max(self.flying.len());
        }
        fn wait(&mut self, file: &PathBuf, offset: u64) {
            // Waiting for a byte finishes the requests holding it.
            self.flying
                .retain(|(f, o, l)| !(f == file && (*o..o + l).contains(&offset)));
            self.waits += 1;
        }
    }

    /// Every byte of every planned file is asked for once, in order, and never
    /// more than the bounds are in flight; a file that does not open is skipped.
    #[test]
    fn requests_cover_the_plan_once_and_stay_within_the_bounds() {
        let plan = files(&[(".metadata", 70), ("missing", 40), ("a", 25), ("b", 3)]);
        let mut disk = Record::default();
        let stop = AtomicBool::new(false);
        let asked = run(&plan, 10, 30, 8, &stop, &mut disk);
        assert_eq!(asked, 98);
        for (path, len) in &plan {
            let got = disk.asked.get(path).cloned().unwrap_or_default();
            if path.ends_with("missing") {
                assert!(got.is_empty());
                continue;
            }
            let mut at = 0;
            for (o, l) in got {
                assert_eq!(o, at, "{path:?}");
                assert!(l <= 10);
                at += l;
            }
            assert_eq!(at, *len, "{path:?}");
        }
        assert!(disk.max_bytes <= 30, "{}", disk.max_bytes);
        assert!(disk.max_bytes > 20, "{}", disk.max_bytes);
        assert!(disk.waits > 0);
        // The bound on requests, when it is the tighter one.
        let mut disk = Record::default();
        run(&plan, 10, 1000, 2, &stop, &mut disk);
        assert_eq!(disk.max_requests, 2);
    }

    /// A stopped thread asks for nothing more.
    #[test]
    fn a_stopped_run_asks_for_nothing() {
        let plan = files(&[("a", 100)]);
        let mut disk = Record::default();
        assert_eq!(run(&plan, 10, 30, 8, &AtomicBool::new(true), &mut disk), 0);
        assert!(disk.asked.is_empty());
    }

    /// The thread stops when told to, before it has gone through a plan it could
    /// not finish, and `finish` waits for it.
    #[test]
    fn finish_stops_the_thread() {
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let r = Readahead::spawn(move |stop| {
            let mut n = 0;
            while !stop.load(Ordering::Relaxed) {
                n += 1;
                let _ = tx.send(());
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
            n
        })
        .unwrap();
        rx.recv().unwrap();
        assert!(r.finish() >= 1);
    }

    /// On a real checkpoint directory, every byte of `.metadata` and the rank files
    /// is asked for and nothing else (the fixture's other files are not), or, within
    /// a smaller budget, only `.metadata` and the first rank files.
    #[test]
    fn a_directory_is_read_ahead_within_the_budget() {
        let dir = crate::fixtures().join("sharded/llama_w3_dcp");
        let len = |n: &str| std::fs::metadata(dir.join(n)).unwrap().len();
        let meta = len(".metadata");
        let ranks: Vec<u64> = (0..3).map(|r| len(&format!("__{r}_0.distcp"))).collect();
        let all = meta + ranks.iter().sum::<u64>();
        let go = AtomicBool::new(false);
        assert_eq!(read_ahead(&dir, u64::MAX, &go), all);
        assert_eq!(read_ahead(&dir, all - 1, &go), meta + ranks[0] + ranks[1]);
        assert_eq!(read_ahead(&dir, meta, &go), meta);
        assert_eq!(read_ahead(&dir.join("missing"), u64::MAX, &go), 0);
        assert!(available_memory().unwrap() > 1 << 20);
    }
}
