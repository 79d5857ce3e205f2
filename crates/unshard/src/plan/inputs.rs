//! The inputs a plan's tensors point into: the checkpoint, the base's weights and
//! any further input, each reached by the [`Origin`] a planned tensor names.

use std::sync::Arc;

use super::Origin;
use crate::bytes::Blob;
use crate::source::Checkpoint;

/// The inputs a plan's tensors point into, by [`Origin`].
#[derive(Clone, Copy)]
pub struct Inputs<'a> {
    /// The checkpoint.
    pub checkpoint: &'a Checkpoint,
    /// The base's weights.
    pub base: Option<&'a Checkpoint>,
    /// Further inputs (an adapter...): `Origin::Input(i)` is `extra[i]`.
    pub extra: &'a [&'a Checkpoint],
}

impl<'a> Inputs<'a> {
    /// The input a tensor comes from, if it was opened.
    pub fn get(&self, origin: Origin) -> Option<&'a Checkpoint> {
        match origin {
            Origin::Checkpoint => Some(self.checkpoint),
            Origin::Base => self.base,
            Origin::Input(i) => self.extra.get(i).copied(),
        }
    }

    /// The files of the input a tensor comes from (none if it was not opened:
    /// reading a piece then names the missing file).
    pub fn files(&self, origin: Origin) -> &'a [Arc<Blob>] {
        self.get(origin).map_or(&[], |c| &c.files)
    }

    /// Every opened input.
    pub fn all(&self) -> impl Iterator<Item = &'a Checkpoint> {
        std::iter::once(self.checkpoint)
            .chain(self.base)
            .chain(self.extra.iter().copied())
    }
}
