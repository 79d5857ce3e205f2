//! Which part writes which shard, and which part this process is.

use crate::error::{Error, Result};

/// One part of a merge split `count` ways; `index` counts from 0, as `RANK` and
/// `SLURM_PROCID` do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Part {
    /// This part, from 0.
    pub index: usize,
    /// How many parts the merge is split into.
    pub count: usize,
}

impl Part {
    /// Parses `I/N` (`0 <= I < N`).
    pub fn parse(s: &str) -> Result<Part> {
        let bad = || {
            Error::Usage(format!(
                "--part '{s}' is not I/N with 0 <= I < N (e.g. 0/4 ... 3/4), or 'auto'"
            ))
        };
        let (i, n) = s.trim().split_once('/').ok_or_else(bad)?;
        let index: usize = i.trim().parse().map_err(|_| bad())?;
        let count: usize = n.trim().parse().map_err(|_| bad())?;
        if count == 0 || index >= count {
            return Err(bad());
        }
        Ok(Part { index, count })
    }

    /// The part from the launcher's environment: torchrun's `RANK`/`WORLD_SIZE`,
    /// then `srun`'s `SLURM_PROCID`/`SLURM_NTASKS` (when more than one task), then a
    /// Slurm job array's `SLURM_ARRAY_TASK_ID` (less `SLURM_ARRAY_TASK_MIN`) and
    /// `SLURM_ARRAY_TASK_COUNT`.
    pub fn from_env(var: impl Fn(&str) -> Option<String>) -> Result<Part> {
        let num =
            |k: &str| -> Result<Option<usize>> {
                match var(k) {
                    None => Ok(None),
                    Some(v) => v.trim().parse().map(Some).map_err(|_| {
                        Error::Usage(format!("--part auto: {k}='{v}' is not a number"))
                    }),
                }
            };
        let make = |index: usize, count: usize, from: &str| {
            if count == 0 || index >= count {
                Err(Error::Usage(format!(
                    "--part auto: {from} give part {index} of {count}, which does not exist"
                )))
            } else {
                Ok(Part { index, count })
            }
        };
        if let (Some(r), Some(w)) = (num("RANK")?, num("WORLD_SIZE")?) {
            return make(r, w, "RANK and WORLD_SIZE");
        }
        if let (Some(r), Some(n)) = (num("SLURM_PROCID")?, num("SLURM_NTASKS")?) {
            if n > 1 {
                return make(r, n, "SLURM_PROCID and SLURM_NTASKS");
            }
        }
        if let (Some(id), Some(n)) = (num("SLURM_ARRAY_TASK_ID")?, num("SLURM_ARRAY_TASK_COUNT")?) {
            let min = num("SLURM_ARRAY_TASK_MIN")?.unwrap_or(0);
            let i = id.checked_sub(min).ok_or_else(|| {
                Error::Usage(format!(
                    "--part auto: SLURM_ARRAY_TASK_ID {id} is below SLURM_ARRAY_TASK_MIN {min}"
                ))
            })?;
            return make(i, n, "SLURM_ARRAY_TASK_ID and SLURM_ARRAY_TASK_COUNT");
        }
        Err(Error::Usage(
            "--part auto found no launcher variables (RANK/WORLD_SIZE, SLURM_PROCID/SLURM_NTASKS, SLURM_ARRAY_TASK_ID/SLURM_ARRAY_TASK_COUNT)".into(),
        ))
    }
}

/// The part that writes each shard, from the shards' sizes: largest first, each to
/// the part with the fewest bytes so far (the lowest index on a tie). Deterministic,
/// so every part computes the same assignment; no part gets more than the largest
/// shard above an even share.
pub fn assign(sizes: &[u64], count: usize) -> Vec<usize> {
    let count = count.max(1);
    let mut order: Vec<usize> = (0..sizes.len()).collect();
    order.sort_by(|&a, &b| sizes[b].cmp(&sizes[a]).then(a.cmp(&b)));
    let mut load = vec![0u64; count];
    let mut owner = vec![0; sizes.len()];
    for i in order {
        let p = (0..count).min_by_key(|&p| (load[p], p)).unwrap_or(0);
        load[p] += sizes[i];
        owner[i] = p;
    }
    owner
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn parts_parse_and_come_from_launchers() {
        assert_eq!(Part::parse("2/7").unwrap(), Part { index: 2, count: 7 });
        for bad in ["7/7", "1/0", "a/2", "3", "-1/2"] {
            assert!(Part::parse(bad).is_err(), "{bad}");
        }
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |k: &str| {
                pairs
                    .iter()
                    .find(|(n, _)| *n == k)
                    .map(|(_, v)| v.to_string())
            }
        };
        let p = Part::from_env(env(&[
            ("RANK", "3"),
            ("WORLD_SIZE", "4"),
            ("SLURM_PROCID", "0"),
        ]));
        assert_eq!(p.unwrap(), Part { index: 3, count: 4 });
        let p = Part::from_env(env(&[("SLURM_PROCID", "1"), ("SLURM_NTASKS", "2")]));
        assert_eq!(p.unwrap(), Part { index: 1, count: 2 });
        // A single srun task inside a job array: the array decides.
        let p = Part::from_env(env(&[
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "1"),
            ("SLURM_ARRAY_TASK_ID", "12"),
            ("SLURM_ARRAY_TASK_MIN", "10"),
            ("SLURM_ARRAY_TASK_COUNT", "3"),
        ]));
        assert_eq!(p.unwrap(), Part { index: 2, count: 3 });
        assert!(Part::from_env(env(&[])).is_err());
        assert!(Part::from_env(env(&[("RANK", "4"), ("WORLD_SIZE", "4")])).is_err());
    }

    #[test]
    fn shards_are_balanced_by_bytes_and_every_shard_has_one_part() {
        let sizes = [100, 10, 10, 10, 10, 10, 10, 10, 10, 10, 10, 60];
        let owner = assign(&sizes, 3);
        let mut load = [0u64; 3];
        for (i, &p) in owner.iter().enumerate() {
            load[p] += sizes[i];
        }
        // 260 bytes: the 100-byte shard alone, the rest split evenly.
        assert_eq!(load, [100, 80, 80]);
        // More parts than shards: some parts write nothing.
        let owner = assign(&[5, 5], 7);
        assert_eq!(owner, [0, 1]);
        // Same input, same answer.
        assert_eq!(assign(&sizes, 3), owner_again(&sizes));
    }

    fn owner_again(sizes: &[u64]) -> Vec<usize> {
        assign(sizes, 3)
    }
}
