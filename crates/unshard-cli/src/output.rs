//! What the user sees: errors, progress, the merge summary, and signal handling.

use std::io::Write;
use std::sync::atomic::Ordering;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressStyle};
use unshard::merge::{MergeOptions, MergeOutcome};
use unshard::plan::Origin;
use unshard::report::{human_bytes, list_some};
use unshard::write::{Progress, INTERRUPTED};
use unshard::Error;

/// Prints `error: ...`, each cause, and a hint when there is one.
pub fn print_error(e: &anyhow::Error) {
    let mut err = std::io::stderr().lock();
    let _ = writeln!(err, "error: {e}");
    for cause in e.chain().skip(1).take(8) {
        let _ = writeln!(err, "  caused by: {cause}");
    }
    if let Some(hint) = e.downcast_ref::<Error>().and_then(Error::hint) {
        let _ = writeln!(err, "hint: {hint}");
    }
}

extern "C" fn on_signal(_: libc::c_int) {
    INTERRUPTED.store(true, Ordering::SeqCst);
}

/// SIGINT and SIGTERM stop the writer at the next window; the staging directory is
/// then removed and the process exits 1.
pub fn install_signal_handlers() {
    // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
    unsafe {
        libc::signal(libc::SIGINT, on_signal as *const () as libc::sighandler_t);
        libc::signal(libc::SIGTERM, on_signal as *const () as libc::sighandler_t);
    }
}

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

/// The report after a successful merge.
pub fn print_merge_summary(
    w: &mut dyn Write,
    opts: &MergeOptions,
    o: &MergeOutcome,
) -> std::io::Result<()> {
    let plan = &o.plan;
    let r = &plan.report;
    let from_ckpt = plan
        .tensors
        .iter()
        .filter(|t| t.origin == Origin::Checkpoint)
        .count();
    let at = o
        .checkpoint_key
        .as_deref()
        .map(|k| format!(", tensors under '{k}'"))
        .unwrap_or_default();
    writeln!(
        w,
        "read {} ({}{at})",
        opts.checkpoint.display(),
        o.checkpoint_format
    )?;
    for n in &o.checkpoint_notes {
        writeln!(w, "note: {n}")?;
    }
    if let Some(c) = &o.config_from {
        writeln!(w, "note: config and tokenizer taken from {}", c.display())?;
    }
    writeln!(
        w,
        "tensors: {} written, {from_ckpt} from the checkpoint, {} from the base",
        plan.tensors.len(),
        r.from_base.len()
    )?;
    if let Some((a, b)) = r.renamed.first() {
        let more = if r.renamed.len() > 1 { ", ..." } else { "" };
        writeln!(w, "renamed: {} ({a} -> {b}{more})", r.renamed.len())?;
    }
    for (name, why) in &r.dropped {
        writeln!(w, "dropped: {name} ({why})")?;
    }
    if !r.from_base.is_empty() {
        writeln!(w, "from base: {}", list_some(&r.from_base, 6))?;
    }
    for (from, to, n) in &r.casts {
        writeln!(w, "cast: {n} tensor(s) {from} -> {to}")?;
    }
    for n in &r.notes {
        writeln!(w, "note: {n}")?;
    }
    for (t, s) in plan.tensors.iter().zip(&o.write.stats) {
        if s.nan > 0 || s.inf > 0 {
            writeln!(
                w,
                "warning: tensor '{}' holds {} NaN and {} inf value(s) in the checkpoint",
                t.name, s.nan, s.inf
            )?;
        }
        if s.overflow > 0 {
            writeln!(
                w,
                "warning: tensor '{}': {} value(s) overflowed to inf in {}",
                t.name, s.overflow, t.dtype
            )?;
        }
    }
    for x in &r.warnings {
        writeln!(w, "warning: {x}")?;
    }
    if let Some(v) = &o.verified {
        writeln!(w, "verified: {}", v.summary())?;
    }
    for c in &o.write.cleaned {
        writeln!(
            w,
            "note: removed {} left by an interrupted run",
            c.display()
        )?;
    }
    let secs = o.elapsed.as_secs_f64();
    writeln!(
        w,
        "wrote {} in {} shard(s) to {} in {secs:.2} s ({}/s)",
        human_bytes(plan.total_size),
        plan.shards.len(),
        opts.output.display(),
        human_bytes((plan.total_size as f64 / secs.max(1e-9)) as u64)
    )
}
