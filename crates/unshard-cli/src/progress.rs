//! Progress on stderr, fed by the library's `Progress` callbacks: a bar on a
//! terminal; a plain line every few seconds when stderr is a file or a pipe (CI
//! logs, Slurm), so that a long run shows it is alive without filling the log
//! with redraws; nothing under --quiet.
//!
//! The count is of bytes of tensor data: written to the output by `merge`,
//! compared by `verify` and `diff` (the unit is in the line: `written`, `compared`).
//! Before the library says how many bytes there are (`start`), only a spinner and
//! what is being done are shown, never a bar of `0 B/0 B`.

use std::io::{IsTerminal, Write};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressStyle};
use unshard::Progress;

use crate::text::human_bytes;

/// Seconds between plain progress lines; the first comes after one interval, so a
/// short run prints none.
const PLAIN_INTERVAL: Duration = Duration::from_secs(10);

/// Overrides [`PLAIN_INTERVAL`] (in seconds, fractions allowed), for tests and for
/// logs that want more or fewer lines.
const INTERVAL_VAR: &str = "UNSHARD_PROGRESS_INTERVAL";

/// Progress display of one command.
///
/// Fault-injection tests set `UNSHARD_TEST_WINDOW_DELAY_MS` to slow every window
/// down, so that a signal or a truncated input reliably lands mid-write, and
/// `UNSHARD_TEST_STAGE_DELAY_MS` to slow the reading stage down the same way.
pub struct Bar {
    shown: Shown,
    unit: &'static str,
    window_delay: Option<Duration>,
    stage_delay: Option<Duration>,
}

enum Shown {
    Off,
    Terminal(ProgressBar),
    Plain(Plain),
}

fn env_millis(var: &str) -> Option<Duration> {
    std::env::var(var)
        .ok()
        .and_then(|v| v.parse().ok())
        .map(Duration::from_millis)
}

impl Bar {
    /// Progress for a command whose bytes are `unit` ("written", "compared").
    pub fn new(quiet: bool, unit: &'static str) -> Bar {
        let shown = if quiet {
            Shown::Off
        } else if std::io::stderr().is_terminal() {
            let pb = ProgressBar::new(0);
            pb.set_style(stage_style());
            pb.enable_steady_tick(Duration::from_millis(200));
            Shown::Terminal(pb)
        } else {
            let interval = std::env::var(INTERVAL_VAR)
                .ok()
                .and_then(|v| v.parse::<f64>().ok())
                .filter(|s| s.is_finite() && *s > 0.0)
                .map_or(PLAIN_INTERVAL, Duration::from_secs_f64);
            Shown::Plain(Plain::spawn(interval, unit))
        };
        Bar {
            shown,
            unit,
            window_delay: env_millis("UNSHARD_TEST_WINDOW_DELAY_MS"),
            stage_delay: env_millis("UNSHARD_TEST_STAGE_DELAY_MS"),
        }
    }
}

/// A spinner and a line saying what is being done, before any bytes are counted.
fn stage_style() -> ProgressStyle {
    ProgressStyle::with_template("{spinner} [{elapsed_precise}] {msg}")
        .unwrap_or_else(|_| ProgressStyle::default_spinner())
}

fn bar_style(unit: &str) -> ProgressStyle {
    ProgressStyle::with_template(&format!(
        "{{spinner}} [{{elapsed_precise}}] [{{wide_bar}}] {{bytes}}/{{total_bytes}} {unit} {{bytes_per_sec}} ETA {{eta}}"
    ))
    .unwrap_or_else(|_| ProgressStyle::default_bar())
    .progress_chars("=> ")
}

impl Progress for Bar {
    fn stage(&self, what: &str) {
        match &self.shown {
            Shown::Terminal(pb) => {
                pb.set_style(stage_style());
                pb.set_message(what.to_string());
            }
            Shown::Plain(p) => *lock(&p.state.stage) = what.to_string(),
            Shown::Off => {}
        }
        if let Some(d) = self.stage_delay {
            std::thread::sleep(d);
        }
    }
    fn start(&self, total: u64) {
        match &self.shown {
            // Nothing to count: a bar would be full at 0 B/0 B. Keep the spinner.
            Shown::Terminal(pb) if total == 0 => pb.set_message(self.unit),
            // The length first: a bar style drawn before it is a full bar of 0 B/0 B.
            Shown::Terminal(pb) => {
                pb.set_length(total);
                pb.set_message("");
                pb.set_style(bar_style(self.unit));
            }
            Shown::Plain(p) => {
                *lock(&p.state.counting) = Some(Instant::now());
                *lock(&p.state.stage) = String::new();
                p.state.total.store(total, Ordering::Relaxed);
            }
            Shown::Off => {}
        }
    }
    fn advance(&self, bytes: u64) {
        match &self.shown {
            Shown::Terminal(pb) => pb.inc(bytes),
            Shown::Plain(p) => {
                p.state.done.fetch_add(bytes, Ordering::Relaxed);
            }
            Shown::Off => {}
        }
        if let Some(d) = self.window_delay {
            std::thread::sleep(d);
        }
    }
    fn finish(&self) {
        match &self.shown {
            Shown::Terminal(pb) => pb.finish_and_clear(),
            Shown::Plain(p) => p.stop(),
            Shown::Off => {}
        }
    }
}

impl Drop for Bar {
    /// A command that fails mid-way never calls `finish`: stop the line printer.
    fn drop(&mut self) {
        if let Shown::Plain(p) = &self.shown {
            p.stop();
        }
    }
}

/// What the plain printer reads.
struct PlainState {
    started: Instant,
    /// What is being done before bytes are counted; empty once counting.
    stage: Mutex<String>,
    total: AtomicU64,
    done: AtomicU64,
    /// When counting began, for the rate.
    counting: Mutex<Option<Instant>>,
    stopped: Mutex<bool>,
    wake: Condvar,
}

/// A thread that prints a progress line every interval until stopped.
struct Plain {
    state: Arc<PlainState>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Plain {
    fn spawn(interval: Duration, unit: &'static str) -> Plain {
        let state = Arc::new(PlainState {
            started: Instant::now(),
            stage: Mutex::new(String::new()),
            total: AtomicU64::new(0),
            done: AtomicU64::new(0),
            counting: Mutex::new(None),
            stopped: Mutex::new(false),
            wake: Condvar::new(),
        });
        let s = Arc::clone(&state);
        let thread = std::thread::Builder::new()
            .name("progress".into())
            .spawn(move || {
                let mut next = Instant::now() + interval;
                let mut stopped = lock(&s.stopped);
                loop {
                    let now = Instant::now();
                    if *stopped {
                        return;
                    }
                    if now < next {
                        stopped = s
                            .wake
                            .wait_timeout(stopped, next - now)
                            .unwrap_or_else(|e| e.into_inner())
                            .0;
                        continue;
                    }
                    next += interval;
                    let line = s.line(unit);
                    let _ = writeln!(std::io::stderr().lock(), "{line}");
                }
            })
            .ok();
        Plain {
            state,
            thread: Mutex::new(thread),
        }
    }

    fn stop(&self) {
        *lock(&self.state.stopped) = true;
        self.state.wake.notify_all();
        if let Some(t) = lock(&self.thread).take() {
            let _ = t.join();
        }
    }
}

impl PlainState {
    /// `progress: 1.2 GiB/4.0 GiB written (30%), 250.0 MiB/s, 00:00:12 elapsed`,
    /// or `progress: reading ckpt/, 00:00:12 elapsed` before bytes are counted.
    fn line(&self, unit: &str) -> String {
        let secs = self.started.elapsed().as_secs();
        let elapsed = format!(
            "{:02}:{:02}:{:02} elapsed",
            secs / 3600,
            secs / 60 % 60,
            secs % 60
        );
        let total = self.total.load(Ordering::Relaxed);
        let stage = lock(&self.stage).clone();
        if total == 0 {
            let what = if stage.is_empty() { "working" } else { &stage };
            return crate::text::escape(&format!("progress: {what}, {elapsed}")).into_owned();
        }
        let done = self.done.load(Ordering::Relaxed).min(total);
        let since = lock(&self.counting).unwrap_or(self.started);
        let rate = done as f64 / since.elapsed().as_secs_f64().max(1e-9);
        format!(
            "progress: {}/{} {unit} ({}%), {}/s, {elapsed}",
            human_bytes(done),
            human_bytes(total),
            done * 100 / total,
            human_bytes(rate as u64)
        )
    }
}
