//! The progress bar on stderr, fed by the library's `Progress` callbacks.

use std::time::Duration;

use indicatif::{ProgressBar, ProgressStyle};
use unshard::write::Progress;

/// A progress bar on stderr, or nothing.
///
/// Fault-injection tests set `UNSHARD_TEST_WINDOW_DELAY_MS` to slow every window
/// down, so that a signal or a truncated input reliably lands mid-write.
pub struct Bar(Option<ProgressBar>, Option<Duration>);

impl Bar {
    pub fn new(enabled: bool) -> Bar {
        let delay = std::env::var("UNSHARD_TEST_WINDOW_DELAY_MS")
            .ok()
            .and_then(|v| v.parse().ok())
            .map(Duration::from_millis);
        Bar(
            enabled.then(|| {
                let pb = ProgressBar::new(0);
                pb.set_style(stage_style());
                pb.enable_steady_tick(Duration::from_millis(200));
                pb
            }),
            delay,
        )
    }
}

/// A spinner and a line saying what is being done, before any bytes are counted.
fn stage_style() -> ProgressStyle {
    ProgressStyle::with_template("{spinner} [{elapsed_precise}] {msg}")
        .unwrap_or_else(|_| ProgressStyle::default_spinner())
}

fn bar_style() -> ProgressStyle {
    ProgressStyle::with_template(
        "{spinner} [{elapsed_precise}] [{wide_bar}] {bytes}/{total_bytes} {bytes_per_sec} ETA {eta}",
    )
    .unwrap_or_else(|_| ProgressStyle::default_bar())
    .progress_chars("=> ")
}

impl Progress for Bar {
    fn stage(&self, what: &str) {
        if let Some(pb) = &self.0 {
            pb.set_style(stage_style());
            pb.set_message(what.to_string());
        }
    }
    fn start(&self, total: u64) {
        if let Some(pb) = &self.0 {
            pb.set_style(bar_style());
            pb.set_message("");
            pb.set_length(total);
        }
    }
    fn advance(&self, bytes: u64) {
        if let Some(pb) = &self.0 {
            pb.inc(bytes);
        }
        if let Some(d) = self.1 {
            std::thread::sleep(d);
        }
    }
    fn finish(&self) {
        if let Some(pb) = &self.0 {
            pb.finish_and_clear();
        }
    }
}
