//! Running library work from Python: off the GIL, with progress and Ctrl-C.
//!
//! The work runs on a scoped thread with the GIL released. The calling thread waits
//! for it in short slices; between slices it re-attaches to the interpreter to call
//! the progress callback with the latest counts and to run Python's signal handlers.
//! A pending `KeyboardInterrupt` (or any exception from the callback) cancels the
//! job through its token; the job then unwinds its own staging, and the exception is
//! raised once the job has ended, so nothing is left behind when control returns.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::time::Duration;

use pyo3::prelude::*;

/// How often the waiting thread wakes for progress and signals.
const SLICE: Duration = Duration::from_millis(100);

/// Progress counters shared between the job and the waiting thread.
#[derive(Default)]
pub struct Counters {
    done: AtomicU64,
    total: AtomicU64,
}

impl Counters {
    /// Sets the total and resets the count (a new phase of work).
    pub fn start(&self, total: u64) {
        self.total.store(total, Ordering::Relaxed);
        self.done.store(0, Ordering::Relaxed);
    }

    /// Adds finished bytes.
    pub fn advance(&self, n: u64) {
        self.done.fetch_add(n, Ordering::Relaxed);
    }

    fn get(&self) -> (u64, u64) {
        (
            self.done.load(Ordering::Relaxed),
            self.total.load(Ordering::Relaxed),
        )
    }
}

/// Runs `work` off the GIL. `cancel` is called (once) when Python asks to stop.
///
/// Returns the work's result, or the Python exception that interrupted it.
pub fn run<T, F>(
    py: Python<'_>,
    counters: &Counters,
    callback: Option<&Bound<'_, PyAny>>,
    cancel: &(dyn Fn() + Sync),
    work: F,
) -> PyResult<T>
where
    T: Send,
    F: FnOnce() -> T + Send,
{
    std::thread::scope(|scope| {
        let (tx, rx) = mpsc::channel();
        // Waiting happens off the GIL, where only `Sync` data may be borrowed.
        let rx = std::sync::Mutex::new(rx);
        scope.spawn(move || {
            // The receiver outlives this thread (same scope): the send cannot fail
            // unless the waiting thread panicked, and then the result has no reader.
            let _ = tx.send(work());
        });
        let mut interrupted: Option<PyErr> = None;
        let mut last = (u64::MAX, u64::MAX);
        loop {
            let received = py.detach(|| match rx.lock() {
                Ok(rx) => rx.recv_timeout(SLICE),
                Err(_) => Err(mpsc::RecvTimeoutError::Disconnected),
            });
            let finished = match received {
                Ok(result) => Some(result),
                Err(mpsc::RecvTimeoutError::Timeout) => None,
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    // The work thread panicked; the scope re-raises it on exit.
                    return Err(pyo3::exceptions::PyRuntimeError::new_err(
                        "unshard's worker thread stopped unexpectedly; please report this as a bug",
                    ));
                }
            };
            if interrupted.is_none() {
                let now = counters.get();
                if let Some(cb) = callback.filter(|_| now != last && now.1 > 0) {
                    last = now;
                    if let Err(e) = cb.call1(now) {
                        cancel();
                        interrupted = Some(e);
                    }
                }
            }
            if interrupted.is_none() {
                if let Err(e) = py.check_signals() {
                    cancel();
                    interrupted = Some(e);
                }
            }
            if let Some(result) = finished {
                return match interrupted {
                    Some(e) => Err(e),
                    None => Ok(result),
                };
            }
        }
    })
}
