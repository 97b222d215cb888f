//! The direct path ([`ProfilingLayer::with_logger`](crate::ProfilingLayer::with_logger)): ops
//! counted when submitted, a [`Ticket`] deciding whether the call is timed, and its end on
//! whichever thread sees the op complete.

use std::num::NonZeroU32;
use std::sync::atomic::Ordering;

use comm_core::Completion;

use super::rows::{Key, CACHE};
use super::{registry, CommsLogger, DEBUG, ENABLED, VERBOSE};

/// splitmix64's finaliser: a call index to a well-mixed word, to pick the timed calls.
fn mix(mut x: u64) -> u64 {
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// [`Ticket::start`] of a call that is not timed.
const UNTIMED: u64 = u64::MAX;

/// What [`CommsLogger::begin`] decided for one op recorded directly; handed back when the op
/// completes. Two words, so it travels in registers on the hot path.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Ticket {
    /// The op's row ([`Cell::row`](super::rows::Cell::row)).
    row: NonZeroU32,
    /// The clock at submission (its ticks); [`UNTIMED`] when the call is not timed.
    start: u64,
}

const _: () = assert!(std::mem::size_of::<Option<Ticket>>() == 16);

impl Ticket {
    /// Whether the call is timed (its completion hook then carries the logger itself).
    pub(crate) fn is_timed(&self) -> bool {
        self.start != UNTIMED
    }
}

impl CommsLogger {
    /// The direct path's start ([`Profiling`](crate::Profiling) with a logger): counts the
    /// op as a success and decides whether to time it. Then [`end_inline`](Self::end_inline)
    /// on the submitting thread, or [`end`](Self::end) from the completion hook when
    /// [`needs_end`](Self::needs_end).
    #[inline]
    pub(crate) fn begin(&self, op: &'static str, bytes: u64, group_size: u32, rank: u32) -> Option<Ticket> {
        let flags = self.inner.flags.load(Ordering::Relaxed);
        if flags & ENABLED == 0 || !self.wants(flags, op) {
            return None;
        }
        let caller = if flags & DEBUG != 0 { tracing::Span::current().metadata().map(|m| m.name()) } else { None };
        let key = Key { op, caller, group_size, bytes };
        let (row, index) = self.with_cached(&key, rank, |c| (c.row, c.counts.submitted.bump()));
        let timed = index < u64::from(self.inner.sample_every.load(Ordering::Relaxed))
            || flags & VERBOSE != 0
            || bytes >= self.inner.time_all_from.load(Ordering::Relaxed)
            || mix(index) < self.inner.sample_below.load(Ordering::Relaxed);
        let start = if timed { self.inner.clock.raw() } else { UNTIMED };
        Some(Ticket { row, start })
    }

    /// An op [`begin`](Self::begin) counted finished inline: only a failure or a timed call
    /// has anything left to record.
    #[inline]
    pub(crate) fn end_inline(&self, t: Ticket, c: Completion<'_>) {
        if c.error.is_some() || t.is_timed() {
            self.end_inline_rest(t, c);
        }
    }

    #[inline(never)]
    fn end_inline_rest(&self, t: Ticket, c: Completion<'_>) {
        if let Some(key) = self.key_of(t) {
            self.end(&key, t, c);
        }
    }

    /// The key of `t`'s row (from this thread's cache, else the logger's list of rows).
    pub(crate) fn key_of(&self, t: Ticket) -> Option<Key> {
        let id = self.inner.id;
        let cached =
            CACHE.with(|cache| cache.borrow().iter().find(|c| c.logger == id && c.row == t.row).map(|c| c.key));
        cached.or_else(|| {
            let rows = self.inner.rows.read().unwrap_or_else(|e| e.into_inner());
            rows.get(t.row.get() as usize - 1).map(|c| c.key)
        })
    }

    /// Completes the record of an op [`begin`](Self::begin) counted as a success, on the
    /// thread that sees it complete: takes a failure back out (on this thread's own counter)
    /// and counts it as an error, and adds the latency of a timed call. An untimed success
    /// has nothing left to do: see [`needs_end`](Self::needs_end).
    pub(crate) fn end(&self, key: &Key, t: Ticket, c: Completion<'_>) {
        let failed = c.error.is_some();
        let latency = t.is_timed().then(|| self.inner.elapsed_ns(t.start));
        let rank = self.inner.rank.get().copied().unwrap_or(0);
        self.with_cached(key, rank, |e| {
            if failed {
                e.counts.taken_back.bump();
                e.cell.errors.fetch_add(1, Ordering::Relaxed);
            } else if let Some(ns) = latency {
                e.cell.samples().push(ns);
            }
            if c.detached {
                e.cell.detached.fetch_add(1, Ordering::Relaxed);
            }
        });
        if let Some(ns) = latency {
            self.verbose(key, ns, failed, c.detached);
        }
    }

    /// Whether [`end`](Self::end) has anything to record for this completion.
    pub(crate) fn needs_end(t: Ticket, c: Completion<'_>) -> bool {
        c.error.is_some() || c.detached || t.is_timed()
    }

    /// The live logger with this id, for a completion hook that did not carry one (a rare
    /// failed or detached untimed op).
    pub(crate) fn find(id: u64) -> Option<CommsLogger> {
        let registry = registry().lock().unwrap_or_else(|e| e.into_inner());
        registry.iter().find(|(i, _)| *i == id).and_then(|(_, w)| w.upgrade()).map(|inner| CommsLogger { inner })
    }
}

#[cfg(test)]
mod tests {
    use super::super::CommsConfig;
    use super::*;

    #[test]
    fn sampling_times_the_first_calls_then_one_in_n_by_a_hash_of_the_index() {
        let cfg = CommsConfig { sample_every: 4, time_all_from: 1000, ..CommsConfig::default() };
        let logger = CommsLogger::new(cfg);
        let timed: Vec<bool> = (0..4000).map(|_| logger.begin("all_reduce", 8, 2, 0).unwrap().is_timed()).collect();
        assert!(timed[..4].iter().all(|t| *t));
        let n = timed.iter().filter(|t| **t).count();
        assert!((900..1100).contains(&n), "{n} of 4000 timed, expected about 1000");
        // The same calls on every rank: a fresh logger (a fresh per-thread index) picks the same.
        let again = CommsLogger::new(logger.config());
        assert!((0..4000).all(|i| again.begin("all_reduce", 8, 2, 0).unwrap().is_timed() == timed[i]));
        // Large messages: every call.
        assert!((0..100).all(|_| logger.begin("all_reduce", 1000, 2, 0).unwrap().is_timed()));
        // Not a periodic pick: some window of 4 consecutive calls has no timed call.
        assert!(timed[4..].chunks(4).any(|w| w.iter().all(|t| !*t)));
    }
}
