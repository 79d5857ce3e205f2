//! The cheaper content checks a merge runs: whether the checkpoint equals the base
//! (nothing was trained), `fail_on_nonfinite`, and dropping the cached output
//! before a read-back verification.

use std::collections::HashMap;
use std::path::Path;

use rayon::prelude::*;

use super::compare::same_values;
use crate::cancel::Cancel;
use crate::dtype::{self, ConvertStats};
use crate::error::NonFiniteTensor;
use crate::error::{Error, Result};
use crate::plan::{Origin, Plan, PlannedTensor};
use crate::prepare::Inputs;
use crate::source::TensorSource;
use crate::write::{read_tensor_range, windows, WINDOW_BYTES};

/// Whether every checkpoint tensor equals the base's after conversion to the output
/// dtype, i.e. the merge would write the base again (an adapter-only export, a
/// checkpoint saved before the first step). Returns how many tensors were compared
/// when they all match.
///
/// Cheap when training changed something: the first window of each tensor is
/// compared first, and the rest is read only if all of those match.
pub fn unchanged_from_base(
    plan: &Plan,
    inputs: Inputs<'_>,
    cancel: &Cancel,
) -> Result<Option<usize>> {
    const FIRST_BYTES: u64 = 64 << 10;
    let Some(base) = inputs.base else {
        return Ok(None);
    };
    let by_name: HashMap<&str, &TensorSource> =
        base.tensors.iter().map(|t| (t.name.as_str(), t)).collect();
    let mut pairs: Vec<(&PlannedTensor, &TensorSource, &TensorSource)> = Vec::new();
    for t in plan
        .tensors
        .iter()
        .filter(|t| t.origin == Origin::Checkpoint)
    {
        // A computed tensor is not the checkpoint's as it is: the output differs.
        let Some(source) = t.copied() else {
            return Ok(None);
        };
        match by_name.get(t.name.as_str()) {
            Some(b) if b.shape == t.shape && dtype::can_convert(b.dtype, t.dtype) => {
                pairs.push((t, source, b))
            }
            _ => return Ok(None),
        }
    }
    if pairs.is_empty() {
        return Ok(None);
    }
    let window_equal = |(t, source, b): (&PlannedTensor, &TensorSource, &TensorSource),
                        e0: u64,
                        e1: u64,
                        bufs: &mut (Vec<u8>, Vec<u8>)|
     -> Result<bool> {
        cancel.check()?;
        let len = ((e1 - e0) * t.dtype.size() as u64) as usize;
        bufs.0.resize(len, 0);
        bufs.1.resize(len, 0);
        read_tensor_range(
            &inputs.checkpoint.files,
            source,
            t.dtype,
            e0,
            e1,
            &mut bufs.0,
        )?;
        read_tensor_range(&base.files, b, t.dtype, e0, e1, &mut bufs.1)?;
        Ok(same_values(&bufs.0, &bufs.1, t.dtype))
    };
    let mut bufs = (Vec::new(), Vec::new());
    let mut rest: Vec<(usize, u64, u64)> = Vec::new();
    for (i, &(t, source, b)) in pairs.iter().enumerate() {
        let n = t.numel();
        let head = (FIRST_BYTES / t.dtype.size() as u64)
            .clamp(1, n.max(1))
            .min(n);
        if !window_equal((t, source, b), 0, head, &mut bufs)? {
            return Ok(None);
        }
        let per = WINDOW_BYTES / t.dtype.size() as u64;
        rest.extend(windows(head, n, per).map(|(e0, e1)| (i, e0, e1)));
    }
    let differs = rest
        .par_iter()
        .map_init(
            || (Vec::new(), Vec::new()),
            |bufs, &(i, e0, e1)| window_equal(pairs[i], e0, e1, bufs),
        )
        .find_any(|r| !matches!(r, Ok(true)));
    match differs {
        Some(Err(e)) => Err(e),
        Some(_) => Ok(None),
        None => Ok(Some(pairs.len())),
    }
}

/// The tensors that hold NaN or inf in the checkpoint or that overflowed to inf in
/// the cast, from the writer's own counts (this is a report of what writing saw, not
/// a check of the output: no second reading is needed). Both `fail_on_nonfinite` and
/// the merge's JSON report list them from here.
pub fn nonfinite_tensors(plan: &Plan, stats: &[ConvertStats]) -> Vec<NonFiniteTensor> {
    plan.tensors
        .iter()
        .zip(stats)
        .filter(|(_, s)| s.nan + s.inf + s.overflow > 0)
        .map(|(t, s)| NonFiniteTensor {
            name: t.name.clone(),
            nan: s.nan,
            inf: s.inf,
            overflow: s.overflow,
            dtype: t.dtype,
        })
        .collect()
}

/// `fail_on_nonfinite`: an error naming every tensor that holds NaN or inf in
/// the checkpoint or that overflowed to inf in the cast.
pub fn check_finite(plan: &Plan, stats: &[ConvertStats]) -> Result<()> {
    let tensors = nonfinite_tensors(plan, stats);
    if tensors.is_empty() {
        return Ok(());
    }
    Err(Error::NonFinite { tensors })
}

/// Asks the kernel to drop the cached pages of the planned shard files (fsynced, so
/// clean), so that a verification right after writing reads them back from the disk
/// rather than from memory. A hint: failures are ignored.
/// Linux only (`posix_fadvise`); elsewhere the read-back may come from the cache.
pub fn drop_cached(dir: &Path, plan: &Plan) {
    #[cfg(target_os = "linux")]
    for s in &plan.shards {
        use std::os::fd::AsRawFd;
        if let Ok(f) = std::fs::File::open(dir.join(&s.file_name)) {
            // SAFETY: fadvise only reads the descriptor, which is open for the call.
            let _ = unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (dir, plan);
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::dtype::DType;
    use crate::plan::{Content, Expr};
    use crate::source::test_input::MemInput as Input;
    use crate::verify::tests::plan;

    fn planned(source: TensorSource, origin: Origin) -> PlannedTensor {
        PlannedTensor {
            name: source.name.clone(),
            origin,
            shape: source.shape.clone(),
            source_dtype: DType::F32,
            dtype: DType::F32,
            content: Content::Copy(source),
        }
    }

    /// 20,000 elements: more than the first 64 KiB compared first.
    const N: usize = 20_000;

    /// `unchanged_from_base` of a checkpoint holding `w` (N values) and `b`, over a
    /// base holding `w` as `base_w` and `b`; `more` adds to the plan, the
    /// checkpoint and the base.
    fn unchanged(
        base_w: &[f32],
        more: impl FnOnce(&mut Vec<PlannedTensor>, &mut Input, &mut Input),
    ) -> Option<usize> {
        let w: Vec<f32> = (0..N).map(|i| i as f32).collect();
        let mut ck = Input::default();
        let mut tensors = vec![
            planned(
                ck.tensor("b", &[f32::from_bits(0x7fc0_0001), 1.0], &[2]),
                Origin::Checkpoint,
            ),
            planned(ck.tensor("w", &w, &[N as u64]), Origin::Checkpoint),
        ];
        let mut base = Input::default();
        base.tensor("b", &[f32::from_bits(0x7fc0_0002), 1.0], &[2]);
        base.tensor("w", base_w, &[base_w.len() as u64]);
        more(&mut tensors, &mut ck, &mut base);
        let plan = plan(tensors);
        let (ck, base) = (ck.checkpoint(), base.checkpoint());
        let inputs = Inputs {
            checkpoint: &ck,
            base: Some(&base),
            extra: &[],
        };
        unchanged_from_base(&plan, inputs, &Cancel::new()).unwrap()
    }

    #[test]
    fn a_checkpoint_equal_to_the_base_is_found_and_any_difference_is_not() {
        let w: Vec<f32> = (0..N).map(|i| i as f32).collect();
        // Equal, NaN payloads aside: both tensors compared.
        assert_eq!(unchanged(&w, |_, _, _| {}), Some(2));
        // A difference in the first window, and one past it.
        for at in [0, N - 1] {
            let mut other = w.clone();
            other[at] = -1.0;
            assert_eq!(unchanged(&other, |_, _, _| {}), None, "{at}");
        }
        // Another shape.
        assert_eq!(unchanged(&w[..N - 1], |_, _, _| {}), None);
        // A checkpoint tensor the base lacks.
        let extra = |t: &mut Vec<PlannedTensor>, c: &mut Input, _: &mut Input| {
            t.push(planned(c.tensor("z", &[0.0], &[1]), Origin::Checkpoint));
        };
        assert_eq!(unchanged(&w, extra), None);
        // The same in both: compared.
        let both = |t: &mut Vec<PlannedTensor>, c: &mut Input, b: &mut Input| {
            t.push(planned(c.tensor("z", &[0.0], &[1]), Origin::Checkpoint));
            b.tensor("z", &[0.0], &[1]);
        };
        assert_eq!(unchanged(&w, both), Some(3));
        // A tensor the plan takes from the base is not compared.
        let from_base = |t: &mut Vec<PlannedTensor>, _: &mut Input, b: &mut Input| {
            t.push(planned(b.tensor("z", &[0.0], &[1]), Origin::Base));
        };
        assert_eq!(unchanged(&w, from_base), Some(2));
        // A computed tensor differs from the checkpoint's as it is (here it is a
        // leaf equal to the base's).
        let computed = |t: &mut Vec<PlannedTensor>, c: &mut Input, b: &mut Input| {
            let mut z = planned(c.tensor("z", &[0.0], &[1]), Origin::Checkpoint);
            let leaf = Expr::leaf(Origin::Checkpoint, z.copied().unwrap().clone());
            z.content = Content::Computed(leaf);
            t.push(z);
            b.tensor("z", &[0.0], &[1]);
        };
        assert_eq!(unchanged(&w, computed), None);
        // A base tensor of a dtype that is not converted to the planned one: int64
        // zero against float32 zero.
        let int = |t: &mut Vec<PlannedTensor>, c: &mut Input, b: &mut Input| {
            t.push(planned(c.tensor("z", &[0.0], &[1]), Origin::Checkpoint));
            b.raw("z", &0i64.to_le_bytes(), DType::I64, &[1]);
        };
        assert!(!dtype::can_convert(DType::I64, DType::F32));
        assert_eq!(unchanged(&w, int), None);
    }

    #[test]
    fn without_a_base_or_checkpoint_tensors_nothing_is_compared() {
        let mut ck = Input::default();
        let t = planned(ck.tensor("w", &[1.0], &[1]), Origin::Checkpoint);
        let ck = ck.checkpoint();
        let inputs = Inputs {
            checkpoint: &ck,
            base: None,
            extra: &[],
        };
        assert_eq!(
            unchanged_from_base(&plan(vec![t.clone()]), inputs, &Cancel::new()).unwrap(),
            None
        );
        let inputs = Inputs {
            checkpoint: &ck,
            base: Some(&ck),
            extra: &[],
        };
        let only_base = PlannedTensor {
            origin: Origin::Base,
            ..t
        };
        assert_eq!(
            unchanged_from_base(&plan(vec![only_base]), inputs, &Cancel::new()).unwrap(),
            None
        );
    }

    #[test]
    fn the_nonfinite_tensors_are_those_the_writer_counted_any_nan_inf_or_overflow_in() {
        let mut ck = Input::default();
        let plan = plan(
            ["a", "b", "c", "d"]
                .iter()
                .map(|n| planned(ck.tensor(n, &[0.0], &[1]), Origin::Checkpoint))
                .collect(),
        );
        let s = |nan, inf, overflow| ConvertStats { nan, inf, overflow };
        let stats = [s(1, 0, 0), s(0, 0, 0), s(0, 2, 0), s(0, 0, 3)];
        let found: Vec<(String, u64, u64, u64)> = nonfinite_tensors(&plan, &stats)
            .into_iter()
            .map(|t| (t.name, t.nan, t.inf, t.overflow))
            .collect();
        let want = [("a", 1, 0, 0), ("c", 0, 2, 0), ("d", 0, 0, 3)]
            .map(|(n, a, b, c)| (n.to_string(), a, b, c));
        assert_eq!(found, want);
        assert!(check_finite(&plan, &[s(0, 0, 0); 4]).is_ok());
        match check_finite(&plan, &stats) {
            Err(Error::NonFinite { tensors }) => assert_eq!(tensors.len(), 3),
            other => panic!("{other:?}"),
        }
    }
}
