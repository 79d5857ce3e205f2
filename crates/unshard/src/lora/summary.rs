//! What a merge says about the adapter it fused: which adapter, how many weights,
//! with which scale; and, loudly, when the fuse cannot change anything (verl's
//! merger writes `lora_alpha: 0`, and a "merged" model equal to the base is the
//! result: verl issue 7285).

use super::eval::read_f32;
use super::mapping::LoraFuse;
use crate::error::Result;
use crate::plan::Report;
use crate::source::Checkpoint;

/// Adds the adapter's notes and warnings to a plan's report.
pub fn add(fuse: &LoraFuse, ckpt: &Checkpoint, report: &mut Report) -> Result<()> {
    let r = fuse.resolved();
    let c = &r.config;
    let kind = match (c.use_dora, c.use_rslora) {
        (true, true) => "DoRA, rsLoRA scale alpha/sqrt(r)",
        (true, false) => "DoRA",
        (false, true) => "rsLoRA, scale alpha/sqrt(r)",
        (false, false) => "LoRA",
    };
    let patterns = if c.rank_pattern.is_empty() && c.alpha_pattern.is_empty() {
        String::new()
    } else {
        format!(
            ", {} rank and {} alpha pattern(s)",
            c.rank_pattern.len(),
            c.alpha_pattern.len()
        )
    };
    let saved = r.tensors.iter().filter(|t| r.owns(&t.name)).count();
    let what = if fuse.no_fuse() {
        format!(
            "kept apart (--no-fuse): the base weights are written unchanged and the adapter to adapter/ ({} LoRA weight(s), {saved} saved tensor(s))",
            r.fuses.len()
        )
    } else {
        format!(
            "fused into {} weight(s){}",
            r.fuses.len(),
            if saved > 0 {
                format!(", {saved} tensor(s) of saved modules replace the base's")
            } else {
                String::new()
            }
        )
    };
    report.notes.push(format!(
        "adapter '{}' ({kind}, r={}, lora_alpha={}{patterns}; config {}) {what}",
        r.adapter,
        c.r,
        c.lora_alpha,
        c.path.display()
    ));
    report.notes.extend(r.notes.iter().cloned());
    if !fuse.no_fuse() && saved == 0 && changes_nothing(fuse, ckpt)? {
        report.warnings.push(format!(
            "THE OUTPUT IS THE BASE MODEL UNCHANGED: every LoRA update of adapter '{}' is zero (lora_alpha={} in {}, or all-zero lora_A/lora_B). If the adapter was trained, its config is wrong (verl's merger writes lora_alpha 0): pass the config the run used with --adapter-config",
            r.adapter,
            c.lora_alpha,
            c.path.display()
        ));
    }
    Ok(())
}

/// Whether no fuse can change its weight: a zero scale, or a factor of zeros (a
/// DoRA magnitude can still rescale, so a DoRA fuse always counts as a change).
fn changes_nothing(fuse: &LoraFuse, ckpt: &Checkpoint) -> Result<bool> {
    for f in &fuse.resolved().fuses {
        if f.magnitude.is_some() {
            return Ok(false);
        }
        if f.scale == 0.0 {
            continue;
        }
        let zero = |t| -> Result<bool> { Ok(read_f32(&ckpt.files, t)?.iter().all(|&v| v == 0.0)) };
        if !zero(&f.a)? && !zero(&f.b)? {
            return Ok(false);
        }
    }
    Ok(true)
}
