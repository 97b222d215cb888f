//! How a large step writes its window: plain stores, or streaming ones when plain ones
//! crawl.
//!
//! A window line the peers read in a previous step may still be in their caches, and a plain
//! store to it first takes it back from there, one round trip per line. Where the cores share
//! a cache that costs little, but a virtual machine's vCPUs can sit on cores of different
//! chiplets for seconds at a time, and then plain stores into the window run ~10× slower than
//! streaming ones, which bypass every cache (the readers then fetch the lines from memory: ~2×
//! slower than from a shared cache, so plain stores stay the default). The engine times the
//! work of each large step (both phases: for an all_reduce the copy in and the reduction,
//! which writes the next buffer) and streams while plain steps cost several times more per
//! byte, trying the other kind now and then, less often each time it loses. Each op kind,
//! and one-step all_reduces, keep their own [`Stores`] (their work per byte differs). Ranks
//! choose each for itself.

use std::time::Duration;

/// Steps smaller than this are always plain (and not timed): a few lines' round trips, and
/// a reader's memory round trips would cost as much.
const MIN: usize = 64 << 10;
/// Streaming stores are used while plain steps cost this many times more per byte than
/// streaming ones: about half as much where the cores share a cache, 4–10× more where they
/// do not.
const SLOWER: f64 = 2.0;
/// Large steps between tries of the kind not in use: first, and at most.
const FIRST_TRY: u32 = 16;
const MAX_TRY: u32 = 1024;

#[derive(Debug)]
pub(super) struct Stores {
    /// The kind set by the user, if any: then nothing is timed.
    fixed: Option<bool>,
    /// Last measured cost of [plain, streaming] steps, in ns per KiB.
    cost: [Option<f64>; 2],
    streaming: bool,
    /// Large steps until the other kind is tried again, and the interval after that.
    until_try: u32,
    interval: u32,
    /// Plain steps in a row that cost over [`SLOWER`] times the last streaming one.
    slow: u32,
}

impl Stores {
    pub(super) fn new(fixed: Option<bool>) -> Stores {
        Stores { fixed, cost: [None; 2], streaming: false, until_try: FIRST_TRY, interval: FIRST_TRY, slow: 0 }
    }

    /// Whether steps that move `bytes` may stream (and are timed).
    pub(super) fn covers(&self, bytes: usize) -> bool {
        self.fixed.is_some() || bytes >= MIN
    }

    /// Whether a step that moves `bytes` should stream.
    pub(super) fn pick(&mut self, bytes: usize) -> bool {
        if let Some(fixed) = self.fixed {
            return fixed;
        }
        if bytes < MIN {
            return false;
        }
        if self.until_try == 0 {
            self.until_try = self.interval;
            return !self.streaming;
        }
        self.until_try -= 1;
        self.streaming
    }

    /// What the work of a step of `bytes` that [`pick`](Self::pick) chose for took.
    pub(super) fn record(&mut self, streaming: bool, bytes: usize, took: Duration) {
        if bytes < MIN || self.fixed.is_some() {
            return;
        }
        self.cost[usize::from(streaming)] = Some(took.as_nanos() as f64 * 1024.0 / bytes as f64);
        let [Some(plain), Some(stream)] = self.cost else { return };
        let want = plain > SLOWER * stream;
        if streaming != self.streaming {
            // A try of the other kind: switch if it won, else try it less often.
            if want == streaming {
                self.streaming = want;
                self.interval = FIRST_TRY;
            } else {
                self.interval = (self.interval * 2).min(MAX_TRY);
            }
            self.until_try = self.interval;
        } else if !streaming {
            // Plain steps just got slow (twice in a row: one may have lost its core for a
            // while): the streaming cost measured earlier is the best guess of the other's.
            self.slow = if want { self.slow + 1 } else { 0 };
            if self.slow >= 2 {
                (self.streaming, self.slow) = (true, 0);
                self.interval = FIRST_TRY;
                self.until_try = FIRST_TRY;
            }
        }
    }

    #[cfg(test)]
    fn streaming(&self) -> bool {
        self.streaming
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs `n` large steps, plain ones taking `plain` and streaming ones `stream` µs;
    /// returns how many streamed.
    fn run(s: &mut Stores, n: usize, plain: u64, stream: u64) -> usize {
        (0..n)
            .filter(|_| {
                let st = s.pick(1 << 20);
                s.record(st, 1 << 20, Duration::from_micros(if st { stream } else { plain }));
                st
            })
            .count()
    }

    #[test]
    fn streams_while_plain_stores_crawl_and_tries_less_often_when_they_do_not() {
        let mut s = Stores::new(None);
        // Cores that share a cache: plain stores, streaming tried ever more rarely.
        let tried = run(&mut s, 2000, 40, 35);
        assert!(!s.streaming() && (3..=8).contains(&tried), "{tried} tries of streaming stores");
        // The vCPUs move apart: plain stores take 10× longer: streaming at once, plain stores
        // tried now and then, less often each time.
        let plain = 500 - run(&mut s, 500, 400, 35);
        assert!(s.streaming() && (3..=7).contains(&plain), "{plain} plain copies");
        // Back together: plain stores win their next try.
        run(&mut s, 1100, 40, 35);
        assert!(!s.streaming());
        // Small copies never stream and do not count.
        assert!(!s.pick(MIN - 1));
        s.record(true, MIN - 1, Duration::from_secs(1));
        assert!(!s.streaming());
        // A kind set by the user stays, at any size.
        let mut s = Stores::new(Some(true));
        assert!(s.pick(64) && s.pick(1 << 20));
        s.record(true, 1 << 20, Duration::from_secs(1));
        assert!(s.pick(1 << 20));
    }

    #[test]
    fn plain_steps_that_slow_down_switch_once_streaming_was_measured() {
        let mut s = Stores::new(None);
        run(&mut s, 40, 40, 35); // one try of each kind measured
        assert!(!s.streaming());
        // One slow plain step (preempted, say) is not enough; two in a row are.
        let slow = |s: &mut Stores, us| {
            let st = s.pick(1 << 20);
            s.record(st, 1 << 20, Duration::from_micros(us));
        };
        slow(&mut s, 400);
        slow(&mut s, 40);
        slow(&mut s, 400);
        assert!(!s.streaming());
        slow(&mut s, 400);
        assert!(s.streaming());
    }
}
