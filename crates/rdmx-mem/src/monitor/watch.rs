//! Watching ranges, counted per page: a page is registered with userfaultfd while any
//! holder watches it, and unregistered when the last lets go.

use std::fmt;
use std::io;
use std::sync::Arc;

use super::Shared;
use crate::ranges::merge;
use crate::sys;

/// Keeps a range watched ([`Monitor::watch_while`](super::Monitor::watch_while)) until
/// dropped.
#[must_use = "the range is unwatched when this is dropped"]
pub struct Watched {
    pub(super) shared: Arc<Shared>,
    pub(super) start: usize,
    pub(super) end: usize,
}

impl Drop for Watched {
    fn drop(&mut self) {
        if std::process::id() != self.shared.pid {
            // A forked child's copy: the descriptor's ioctls would unwatch the parent's
            // memory.
            return;
        }
        let mut counts = self.shared.watched.lock();
        let freed = merge(
            counts
                .pieces(self.start, self.end)
                .into_iter()
                .filter(|&(_, _, c)| c == 1),
        );
        counts.add(self.start, self.end, -1);
        // Under the lock: a watch of the same pages meanwhile registers after this.
        for (s, e) in freed {
            // Pages unmapped since were unwatched by the kernel with their mapping.
            if let Err(err) = self.shared.uffd.unregister(s, e - s) {
                tracing::debug!(addr = s, len = e - s, %err, "unwatching failed");
            }
        }
    }
}

impl fmt::Debug for Watched {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Watched")
            .field("start", &format_args!("{:#x}", self.start))
            .field("end", &format_args!("{:#x}", self.end))
            .finish()
    }
}

impl Shared {
    /// Registers the pages of `[addr, addr + len)` and counts them as watched once more;
    /// returns the page span.
    pub(super) fn watch(&self, addr: usize, len: usize) -> io::Result<(usize, usize)> {
        if std::process::id() != self.pid {
            return Err(io::Error::new(
                io::ErrorKind::Unsupported,
                "the userfaultfd monitor serves the parent of this forked process",
            ));
        }
        let (start, end) = match sys::page_span(addr, len) {
            Some(span) if len > 0 => span,
            _ => {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!("cannot watch {len} bytes at {addr:#x}: empty or overflowing range"),
                ))
            }
        };
        // Under the lock: an unwatch of the same pages meanwhile unregisters before this.
        let mut counts = self.watched.lock();
        self.uffd.register_write_protect(start, end - start)?;
        counts.add(start, end, 1);
        Ok((start, end))
    }
}
