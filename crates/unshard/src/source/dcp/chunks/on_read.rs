//! Small chunk archives planned without being read at open, and checked as the merge
//! reads them ([`OpenOptions::check_on_read`](crate::source::OpenOptions::check_on_read)).
//!
//! The scan reads every archive at open to check it against its template, and the
//! merge reads it again for the tensor's bytes: at 582 K chunks of a few KB each,
//! the first read cost as much as the second. Here the first archive of each
//! structure (length, dtype, chunk shape) is read and parsed at open, as the scan
//! would; the others of that structure are planned from it (the tensor at the same
//! place in the archive) without a read, and their files are wrapped in a
//! [`Framed`] source that checks each archive against the template's pattern when a
//! read first touches it, and fails the read if it differs: the merge then opens
//! the checkpoint again and scans it. Only archives of up to [`ON_READ_MAX`] bytes
//! whose tensor is contiguous and little-endian are planned so: the engine reads
//! those in runs that cover whole archives, so that the check needs no read of its
//! own. Larger or unusual ones go through the scan, as without the option.

use std::collections::HashMap;
use std::sync::Arc;

use super::super::super::bytes::{Frame, Framed, Pattern};
use super::super::super::zip::Archive;
use super::super::super::{contiguous_strides, Blob, FileId};
use super::super::metadata::{Entry, EntryKind};
use super::super::template::Templates;
use super::scan::{learn_from, Job};
use super::{Reader, Resolved};
use crate::DType;

/// The longest archive planned without a read at open.
pub(super) const ON_READ_MAX: u64 = 64 << 10;

/// The structure of an archive: its length, and the dtype and sizes of its tensor.
type Key<'m> = (u64, DType, &'m [u64]);

/// How the archives of one structure are planned: from the pattern of index
/// `pattern`, the tensor `rel_offset` bytes into the archive, with layout `layout`.
#[derive(Clone, Copy)]
struct Plan {
    pattern: u32,
    rel_offset: u64,
    layout: u32,
}

impl Reader<'_> {
    /// Plans the archives of `jobs` (in the order of their tensors) that can be
    /// checked on read, parsing the first of each structure (the template) and
    /// resolving the rest from it, and wraps their files in [`Framed`] sources.
    /// Returns the jobs left for the scan.
    pub(super) fn plan_on_read(
        &mut self,
        tensors: &[(String, &Entry)],
        jobs: &[Job],
        templates: &mut Templates,
    ) -> Vec<Job> {
        let mut rest = Vec::new();
        let mut plans: HashMap<Key<'_>, Option<Plan>> = HashMap::new();
        let mut patterns: Vec<Pattern> = Vec::new();
        // (job, plan) of the archives to frame, in the order of `jobs`.
        let mut framed: Vec<(Job, Plan)> = Vec::new();
        let mut last: Option<(Key<'_>, Option<Plan>)> = None;
        for &job in jobs {
            let (_, _, length, _, t, c) = job;
            let EntryKind::Tensor { dtype, chunks, .. } = &tensors[t as usize].1.kind else {
                continue;
            };
            let sizes = chunks.sizes(&chunks.list[c as usize]);
            if length > ON_READ_MAX {
                rest.push(job);
                continue;
            }
            // The chunks of a tensor are mostly of one structure: the last one
            // looked up is tried before the table.
            let key = (length, *dtype, sizes);
            let known = match &last {
                Some((k, plan)) if *k == key => Some(*plan),
                _ => plans.get(&key).copied(),
            };
            let plan = match known {
                Some(plan) => {
                    last = Some((key, plan));
                    plan
                }
                None => {
                    let (plan, resolved) = self.seed(job, *dtype, sizes, templates, &mut patterns);
                    plans.insert(key, plan);
                    if resolved {
                        continue;
                    }
                    plan
                }
            };
            match plan {
                Some(plan) => framed.push((job, plan)),
                None => rest.push(job),
            }
        }
        let patterns: Arc<[Pattern]> = patterns.into();
        framed.sort_unstable_by_key(|(j, _)| (j.0, j.1));
        for file in framed.chunk_by(|a, b| a.0 .0 == b.0 .0) {
            let id = file[0].0 .0 as FileId;
            let frame = |&(j, p): &(Job, Plan)| Frame {
                offset: j.1,
                len: j.2 as u32,
                pattern: p.pattern,
            };
            let frames: Vec<Frame> = file.iter().map(frame).collect();
            let inner = self.files[id].source().clone();
            let (source, refused) = match Framed::new(inner.clone(), frames, patterns.clone()) {
                Ok(f) => (f, Vec::new()),
                Err(refused) => {
                    let kept = file.iter().map(frame).filter(|f| !refused.contains(f));
                    match Framed::new(inner, kept.collect(), patterns.clone()) {
                        Ok(f) => (f, refused),
                        Err(_) => {
                            rest.extend(file.iter().map(|(j, _)| *j));
                            continue;
                        }
                    }
                }
            };
            for (job, plan) in file {
                if refused.iter().any(|f| f.offset == job.1) {
                    rest.push(*job);
                    continue;
                }
                self.resolved[job.3 as usize] = Some(Resolved {
                    file: job.0,
                    layout: plan.layout,
                    byte_offset: job.1 + plan.rel_offset,
                });
                self.on_read += 1;
            }
            self.files[id] = Arc::new(Blob::new(Arc::new(source)));
        }
        rest
    }

    /// Reads and parses the archive of `job`, the first of its structure, keeping it
    /// as a template if it is clean. Returns how the others of its structure are
    /// planned (`None`: by the scan) and whether this one was resolved (if not, the
    /// scan or the parse when its tensor is built reads it again and reports).
    fn seed(
        &mut self,
        job: Job,
        dtype: DType,
        sizes: &[u64],
        templates: &mut Templates,
        patterns: &mut Vec<Pattern>,
    ) -> (Option<Plan>, bool) {
        let (id, offset, length, idx, ..) = job;
        let blob = self.files[id as usize].clone();
        let Ok(bytes) = blob.read_vec(offset, length) else {
            return (None, false);
        };
        let Ok(mut archive) = Archive::new(&blob, offset, length) else {
            return (None, false);
        };
        archive.hold(0, bytes);
        let learned = learn_from(
            templates,
            &mut archive,
            self.ends,
            dtype,
            sizes,
            id as FileId,
        );
        let Some(piece) = learned else {
            return (None, false);
        };
        let resolved = piece
            .byte_offset
            .checked_sub(offset)
            .and_then(|_| self.layout_id(piece.strides.clone(), piece.big_endian));
        if let Some(layout) = resolved {
            self.resolved[idx as usize] = Some(Resolved {
                file: id,
                layout,
                byte_offset: piece.byte_offset,
            });
        }
        let plan = templates.pattern(length, dtype, sizes).and_then(|(p, l)| {
            if l.big_endian || l.strides != contiguous_strides(sizes) {
                return None;
            }
            let pattern = u32::try_from(patterns.len()).ok()?;
            patterns.push(p.clone());
            let (rel_offset, strides) = (l.rel_offset, l.strides.to_vec());
            let layout = self.layout_id(strides, false)?;
            Some(Plan {
                pattern,
                rel_offset,
                layout,
            })
        });
        (plan, resolved.is_some())
    }
}
