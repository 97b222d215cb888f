//! How a large piece of a collective writes its window: plain stores, or streaming ones while
//! plain ones crawl (a VM's vCPUs on different chiplets, where a plain store first takes its
//! line back from the peer that read it). Each rank times its pieces and chooses for itself;
//! ARCHITECTURE.md ("Plain or streaming window stores") has the rule and why. Point-to-point
//! chunks ([`Stores::writes`]) are timed by their copy alone: the sender cannot time the reads.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// Steps smaller than this are always plain (and not timed): a few lines' round trips, and
/// a reader's memory round trips would cost as much.
const MIN: usize = 64 << 10;
/// Streaming stores are used while plain steps cost this many times more per byte than
/// streaming ones: about half as much where the cores share a cache, 4–10× more where they
/// do not.
const SLOWER: f64 = 2.0;
/// [`SLOWER`] for [`Stores::writes`], which sees the writer's copy only.
const SLOWER_WRITES: f64 = 4.0;
/// Large steps between tries of the kind not in use: first, and at most.
const FIRST_TRY: u32 = 16;
const MAX_TRY: u32 = 1024;

#[derive(Debug)]
pub(super) struct Stores {
    /// The kind set by the user, if any: then nothing is timed.
    fixed: Option<bool>,
    /// The costs of the last [`RECENT`] plain steps, in ns per KiB (oldest first).
    plain: VecDeque<f64>,
    /// The cost of the last streaming step.
    stream: Option<f64>,
    streaming: bool,
    /// Large steps until the other kind is tried again, and the interval after that.
    until_try: u32,
    interval: u32,
    /// How many times a streaming step's cost plain ones must cost to stream.
    slower: f64,
}

/// Plain steps whose least cost is the plain cost: a step that lost its core, or met another
/// burst of traffic, only ever takes longer, so streaming needs this many slow ones in a row.
const RECENT: usize = 4;

impl Stores {
    pub(super) fn new(fixed: Option<bool>) -> Stores {
        Stores {
            fixed,
            plain: VecDeque::with_capacity(RECENT),
            stream: None,
            streaming: false,
            until_try: FIRST_TRY,
            interval: FIRST_TRY,
            slower: SLOWER,
        }
    }

    /// For pieces timed by the writer's copy alone (point-to-point chunks).
    pub(super) fn writes(fixed: Option<bool>) -> Stores {
        Stores { slower: SLOWER_WRITES, ..Stores::new(fixed) }
    }

    /// Starts a piece that moves `bytes` per rank: whether its copies into the window stream,
    /// and when it started where its time counts (for [`finish`](Self::finish)).
    pub(super) fn start(&mut self, bytes: usize) -> (bool, Option<Instant>) {
        match self.fixed {
            Some(fixed) => (fixed, None),
            None if bytes < MIN => (false, None),
            None => (self.pick(), Some(Instant::now())),
        }
    }

    /// Ends a piece [`start`](Self::start) began, waits included: a peer's reads of what we
    /// wrote (from memory, if we streamed) delay our next wait for it.
    pub(super) fn finish(&mut self, bytes: usize, stream: bool, start: Option<Instant>) {
        if let Some(t) = start {
            self.record(stream, bytes, t.elapsed());
        }
    }

    /// Whether a timed step should stream.
    fn pick(&mut self) -> bool {
        if self.until_try == 0 {
            self.until_try = self.interval;
            return !self.streaming;
        }
        self.until_try -= 1;
        self.streaming
    }

    /// What the work of a step of `bytes` that [`pick`](Self::pick) chose for took.
    fn record(&mut self, streaming: bool, bytes: usize, took: Duration) {
        let cost = took.as_nanos() as f64 * 1024.0 / bytes as f64;
        if streaming {
            self.stream = Some(cost);
        } else {
            if self.plain.len() == RECENT {
                self.plain.pop_front();
            }
            self.plain.push_back(cost);
        }
        let Some(stream) = self.stream else { return };
        let plain = self.plain.iter().copied().fold(f64::INFINITY, f64::min);
        let switch = if streaming == self.streaming {
            // Plain steps that got slow, all of the last few.
            !streaming && self.plain.len() == RECENT && plain > self.slower * stream
        } else if streaming {
            // A try of streaming stores: do they beat the least of the last plain steps?
            !self.plain.is_empty() && plain > self.slower * stream
        } else {
            // A try of plain stores, one step: a fast one is no accident.
            cost <= self.slower * stream
        };
        if switch {
            self.streaming = !self.streaming;
            self.interval = FIRST_TRY;
        } else if streaming != self.streaming {
            self.interval = (self.interval * 2).min(MAX_TRY);
        }
        if switch || streaming != self.streaming {
            self.until_try = self.interval;
        }
    }
}

/// A copy into our window, with streaming stores or plain ones.
pub(super) fn to_window(stream: bool, dst: &mut [u8], src: &[u8]) {
    if stream {
        comm_kernels::copy_streaming(dst, src);
    } else {
        dst.copy_from_slice(src);
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
                let st = s.pick();
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
        assert!(!s.streaming && (3..=8).contains(&tried), "{tried} tries of streaming stores");
        // The vCPUs move apart: plain stores take 10× longer: streaming at once, plain stores
        // tried now and then, less often each time.
        let plain = 500 - run(&mut s, 500, 400, 35);
        assert!(s.streaming && (5..=10).contains(&plain), "{plain} plain steps");
        // Back together: plain stores win their next try.
        run(&mut s, 1100, 40, 35);
        assert!(!s.streaming);
        // Small copies never stream and do not count.
        assert_eq!(s.start(MIN - 1), (false, None));
        // A kind set by the user stays, at any size, untimed.
        let mut s = Stores::new(Some(true));
        assert_eq!((s.start(64), s.start(1 << 20)), ((true, None), (true, None)));
    }

    #[test]
    fn writer_timed_pieces_stream_only_where_plain_copies_crawl() {
        let mut s = Stores::writes(None);
        // A shared cache: plain copies a little slower than streaming ones (the reads are not
        // seen): stay plain.
        let tried = run(&mut s, 2000, 60, 35);
        assert!(!s.streaming && (3..=8).contains(&tried), "{tried} tries of streaming stores");
        // Apart: plain copies ~10× slower: stream.
        run(&mut s, 500, 400, 35);
        assert!(s.streaming);
        // Back together.
        run(&mut s, 1100, 40, 35);
        assert!(!s.streaming);
    }

    #[test]
    fn plain_steps_that_slow_down_switch_once_streaming_was_measured() {
        let mut s = Stores::new(None);
        let rec = |s: &mut Stores, streaming, us| s.record(streaming, 1 << 20, Duration::from_micros(us));
        for _ in 0..RECENT {
            rec(&mut s, false, 40);
        }
        rec(&mut s, true, 35); // a try of streaming stores, which loses
        assert!(!s.streaming);
        // Slow steps between fast ones (preempted, say) are not enough ...
        for us in [400, 40, 400, 400, 400, 40, 400] {
            rec(&mut s, false, us);
        }
        assert!(!s.streaming);
        // ... four in a row are.
        for us in [400, 400, 400] {
            rec(&mut s, false, us);
        }
        assert!(s.streaming);
    }
}
