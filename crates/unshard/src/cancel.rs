//! Cancellation: a token passed in an operation's options, never process-global
//! state, so that operations running side by side in one process stop separately
//! and a cancelled one does not affect the next.
//!
//! The engine checks the token before each block, verify and diff before each
//! window, and the computed-tensor pass before each tensor. An operation that sees
//! it returns [`Error::Interrupted`](crate::error::Error::Interrupted) after removing what
//! it wrote.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use crate::error::{Error, Result};

/// A cancellation token. Clones share one flag: keep one, pass one in the options,
/// and call [`Cancel::cancel`] from anywhere (another thread, a signal handler).
#[derive(Clone, Debug)]
pub struct Cancel(Flag);

#[derive(Clone, Debug)]
enum Flag {
    Shared(Arc<AtomicBool>),
    Static(&'static AtomicBool),
}

impl Default for Cancel {
    fn default() -> Self {
        Cancel::new()
    }
}

impl Cancel {
    /// A token that is not cancelled.
    pub fn new() -> Cancel {
        Cancel(Flag::Shared(Arc::new(AtomicBool::new(false))))
    }

    /// A token over a flag with a static lifetime, for a signal handler, which may
    /// only store to an atomic it can name.
    pub fn from_static(flag: &'static AtomicBool) -> Cancel {
        Cancel(Flag::Static(flag))
    }

    fn flag(&self) -> &AtomicBool {
        match &self.0 {
            Flag::Shared(f) => f,
            Flag::Static(f) => f,
        }
    }

    /// Asks every operation holding a clone of this token to stop.
    pub fn cancel(&self) {
        self.flag().store(true, Ordering::SeqCst);
    }

    /// Whether [`Cancel::cancel`] was called.
    pub fn is_cancelled(&self) -> bool {
        self.flag().load(Ordering::Relaxed)
    }

    /// `Err(Error::Interrupted)` once cancelled: the check operations make.
    pub fn check(&self) -> Result<()> {
        if self.is_cancelled() {
            Err(Error::Interrupted)
        } else {
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clones_share_one_flag_and_new_tokens_are_independent() {
        let a = Cancel::new();
        let b = a.clone();
        let c = Cancel::new();
        b.cancel();
        assert!(a.is_cancelled() && a.check().is_err());
        assert!(!c.is_cancelled() && c.check().is_ok());
        static FLAG: AtomicBool = AtomicBool::new(false);
        let s = Cancel::from_static(&FLAG);
        FLAG.store(true, Ordering::SeqCst);
        assert!(s.is_cancelled());
    }
}
