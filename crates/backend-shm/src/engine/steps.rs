//! The step protocol over the mapped window, and every access to mapped memory the
//! engine makes outside the zero-copy all_reduce.

#![allow(unsafe_code)] // see the SAFETY comments

use std::sync::atomic::Ordering::{Acquire, SeqCst};
use std::time::{Duration, Instant};

use comm_core::{CommError, DType, OpKind, Rank, ReduceOp};

use crate::layout::{
    body, Layout, MsgHeader, StepHeader, CARRIED, CARRIED_AT, OFF_DOORBELL, OFF_RANK, OFF_REASON, OFF_SLEEPING,
    OFF_STATE, OFF_STEP, OFF_VERSION, OFF_WINDOW, OFF_WORLD, REASON_LEN, SLEEP_ENGINE, SLEEP_PEERS, STATE_ABORTED,
    STATE_READY, STATE_WRITING, VERSION,
};
use crate::segment::Segment;
use crate::sys::{futex_wait, futex_wake};

use super::{describe, Choice, Engine, Io, Phase, Result};

/// A step word a peer fenced: [`FENCED`], the fencer's rank from [`FENCER_SHIFT`], the step's
/// low bits.
const FENCED: u64 = 1 << 63;
const FENCER_SHIFT: u32 = 40;
const STEP_MASK: u64 = (1 << FENCER_SHIFT) - 1;

/// Whether a header's step word `v` says its rank published step `k` (and was not fenced).
fn published(v: u64, k: u64) -> bool {
    v & FENCED == 0 && v >= k
}

impl Engine {
    pub(super) fn peer_step(&self, p: usize) -> u64 {
        self.segs[p].u64_at(OFF_STEP).load(Acquire)
    }

    pub(super) fn reached(&self, target: u64) -> bool {
        (0..self.world).all(|p| p == self.rank || self.peer_step(p) >= target)
    }

    /// `Err` when `peer`, late for step `target` a moment ago, can no longer reach it. A peer
    /// publishes a step before it closes or exits, so one seen gone that has reached the step
    /// joined it (it published between the look that found it late and this one).
    fn check_late(&mut self, peer: usize, target: u64) -> Result<()> {
        match self.check_peer(peer) {
            Err(_) if self.peer_step(peer) >= target => Ok(()),
            r => r,
        }
    }

    /// Waits until every peer published step `target`, progressing p2p meanwhile.
    pub(super) fn wait_all(&mut self, target: u64) -> Result<()> {
        if self.all_at >= target {
            return Ok(());
        }
        if self.reached(target) {
            self.all_at = target;
            return Ok(());
        }
        let start = Instant::now();
        let mut spun = false;
        loop {
            if self.reached(target) {
                self.all_at = target;
                return Ok(());
            }
            if self.pump()? {
                continue;
            }
            if let Some(e) = self.poison_error() {
                return Err(e);
            }
            if !spun {
                spun = true;
                while start.elapsed() < self.params.spin {
                    std::thread::yield_now();
                    if self.reached(target) {
                        return Ok(());
                    }
                }
                continue;
            }
            let late: Vec<usize> = (0..self.world).filter(|&p| p != self.rank && self.peer_step(p) < target).collect();
            for &p in &late {
                // A peer publishes a step before it closes or exits: one seen gone after it
                // reached the step has joined it (it was only late when `late` was read).
                self.check_late(p, target)?;
            }
            if start.elapsed() >= self.params.timeout {
                // One verdict: fence the late peers' step first; one that published it meanwhile
                // (its header's step word, set before its step counter) joined the op after all.
                let late: Vec<usize> = late.into_iter().filter(|&p| self.fence(p, target)).collect();
                if late.is_empty() {
                    self.all_at = target;
                    return Ok(());
                }
                let who: Vec<String> = late.iter().map(|p| format!("rank {p}")).collect();
                return Err(CommError::timeout(
                    self.op,
                    self.params.timeout,
                    format!("{} never joined op #{} (set COMM_TIMEOUT to wait longer)", who.join(", "), self.seq),
                ));
            }
            self.sleep(|e| e.reached(target))?;
        }
    }

    pub(super) fn header(&self, op: OpKind, dtype: DType, n: usize, root: Rank, red: Option<ReduceOp>) -> StepHeader {
        StepHeader {
            seq: self.seq,
            count: n as u64,
            root,
            op: op.code(),
            dtype: dtype.code(),
            redop: red.map_or(u8::MAX, ReduceOp::code),
            ..StepHeader::default()
        }
    }

    /// Starts step `k = step + 1`: waits for the buffer to be free and writes our header.
    pub(super) fn begin(&mut self, hdr: &StepHeader) -> Result<u64> {
        let k = self.step + 1;
        self.wait_all(k - 1)?;
        self.write_header(k, hdr);
        self.phase = Phase::Writable(k);
        Ok(k)
    }

    /// Writes our header of step `k` but its step word, which [`announce`](Self::announce)
    /// sets. Only once every peer published `k - 1`.
    pub(super) fn write_header(&self, k: u64, hdr: &StepHeader) {
        // SAFETY: every peer published `k - 1`, so all reads of this header from step `k - 2`
        // are finished; peers read it again only after `announce(k)` sets its step word, and
        // the step word (the first 8 bytes, atomic only) is not written here.
        unsafe { self.me().write(self.lay.step_header(k) + 8, body(hdr)) };
    }

    /// Whether every peer's header of step `k` is published: the inline path's wait, which
    /// finds the step and the header in one cache line (the worker waits on the step counter,
    /// which its sleeping protocol is built on).
    pub(super) fn headers_reached(&self, k: u64) -> bool {
        let at = self.lay.step_header(k);
        (0..self.world).all(|p| p == self.rank || published(self.segs[p].u64_at(at).load(Acquire), k))
    }

    /// Our buffer for step `k` from where a step of `bytes` starts ([`Layout::rotation`]),
    /// while writable.
    pub(super) fn window_mut(&mut self, k: u64, bytes: usize) -> &mut [u8] {
        assert!(matches!(self.phase, Phase::Writable(s) if s == k), "window_mut outside the write phase of step {k}");
        let at = self.lay.rotation(k, bytes);
        // SAFETY: write phase of step `k` (checked above): no peer reads this buffer until we
        // publish `k`, and `&mut self` makes this the only live slice of it on our side.
        unsafe { self.segs[self.rank].bytes_mut(self.lay.step_data(k) + at, self.lay.window - at) }
    }

    /// Publishes step `k`, waits for every peer to publish it, and checks their headers.
    pub(super) fn publish(&mut self, k: u64, hdr: &StepHeader) -> Result<()> {
        self.announce(k)?;
        self.wait_all(k)?;
        self.check_headers(k, hdr)
    }

    /// Publishes step `k` (release) and wakes sleeping peers; `Err` when a peer gave up
    /// waiting for it first (ARCHITECTURE.md, "One verdict per op"): then the op failed on
    /// the peers, and fails here too.
    pub(super) fn announce(&mut self, k: u64) -> Result<()> {
        // The header's step word first: a peer that sees it reads the header and data. Set
        // by one compare-and-swap from the step before it in this slot, so that it and a
        // peer's fence (`fence`) cannot both succeed.
        let slot = self.me().u64_at(self.lay.step_header(k));
        if let Err(seen) = slot.compare_exchange(k.saturating_sub(2), k, SeqCst, Acquire) {
            let e = self.fenced(seen, k);
            self.failed(&e);
            return Err(e);
        }
        self.me().u64_at(OFF_STEP).store(k, SeqCst);
        self.step = k;
        self.phase = Phase::Idle;
        for p in (0..self.world).filter(|&p| p != self.rank) {
            self.ring(p);
        }
        Ok(())
    }

    /// Gives up waiting for `peer`'s step `k`: marks its step word of `k` so that it cannot
    /// publish `k` any more (its `announce` fails instead). Whether the peer is now fenced
    /// (by this rank or another); `false` when it published `k` after all.
    fn fence(&self, peer: usize, k: u64) -> bool {
        let slot = self.segs[peer].u64_at(self.lay.step_header(k));
        let mark = FENCED | (self.rank as u64) << FENCER_SHIFT | (k & STEP_MASK);
        match slot.compare_exchange(k.saturating_sub(2), mark, SeqCst, Acquire) {
            Ok(_) => true,
            Err(seen) => !published(seen, k),
        }
    }

    /// The error of this rank's op at step `k`, which a peer fenced (`seen`): the op failed on
    /// the peers (they waited past their timeout), so it fails here with what they said.
    fn fenced(&self, seen: u64, k: u64) -> CommError {
        let by = ((seen & !FENCED) >> FENCER_SHIFT) as usize;
        let reason = self.peer_reason(by.min(self.world - 1));
        let reason = if reason.is_empty() { "it timed out waiting for this rank".to_owned() } else { reason };
        CommError::timeout(
            self.op,
            self.params.timeout,
            format!(
                "this rank came to op #{} (step {k}) after rank {by} had given up waiting for it, so the op failed \
                 on every rank; rank {by} said: {reason}",
                self.seq
            ),
        )
    }

    /// Once every peer published `k`: compares their step headers with ours and opens the
    /// read phase.
    pub(super) fn check_headers(&mut self, k: u64, hdr: &StepHeader) -> Result<()> {
        for p in (0..self.world).filter(|&p| p != self.rank) {
            let theirs: StepHeader = self.segs[p].read(self.lay.step_header(k));
            if theirs.step != k {
                return Err(CommError::mismatch(
                    self.op,
                    format!("rank {p} is out of step (at step {}, expected {k})", theirs.step),
                ));
            }
            if (StepHeader { step: k, data: theirs.data, ..*hdr }) != theirs {
                return Err(CommError::mismatch(
                    self.op,
                    format!("rank {p} called {} but rank {} called {}", describe(&theirs), self.rank, describe(hdr)),
                ));
            }
        }
        self.phase = Phase::Readable(k);
        Ok(())
    }

    /// Every rank's buffer for step `k` (index = rank) and our buffer for step `k + 1`, from
    /// where steps of `bytes` start in them, while step `k` is readable.
    pub(super) fn views(&mut self, k: u64, bytes: usize) -> (Views<'_>, &mut [u8]) {
        assert!(matches!(self.phase, Phase::Readable(s) if s == k), "views outside the read phase of step {k}");
        let (at, at_next) = (self.lay.rotation(k, bytes), self.lay.rotation(k + 1, bytes));
        let off = self.lay.step_data(k) + at;
        // SAFETY: read phase of step `k` (checked): every rank published `k`, and none writes
        // its buffer `k % 2` again before all of us publish `k + 1`, which we do only after
        // these slices are gone (`step`/`begin` take `&mut self`).
        let views = self.segs.iter().map(|s| unsafe { s.bytes(off, self.lay.window - at) }).collect::<Views<'_>>();
        // SAFETY: our buffer `(k + 1) % 2` was last read by peers in step `k - 1`, and all of
        // them published `k`; it is a different range from every slice above.
        let next = unsafe { self.me().bytes_mut(self.lay.step_data(k + 1) + at_next, self.lay.window - at_next) };
        (views, next)
    }

    /// The data every rank's header of step `k` carries (index = rank), while step `k` is
    /// readable.
    pub(super) fn carried_views(&self, k: u64) -> Views<'_> {
        assert!(matches!(self.phase, Phase::Readable(s) if s == k), "carried_views outside the read phase of step {k}");
        let off = self.lay.step_header(k) + CARRIED_AT;
        // SAFETY: as for `views`: every rank published `k` and none rewrites its header
        // `k % 2` before all of us publish `k + 1`, which needs `&mut self`.
        self.segs.iter().map(|s| unsafe { s.bytes(off, CARRIED) }).collect()
    }

    /// One step that moves `bytes` per rank: `io(Io::Write(our buffer), stream)`, publish and
    /// check, then `io(Io::Read(every rank's buffer, our next buffer), stream)`. One closure
    /// for both phases, so it can borrow the user's buffer mutably in both. `stream`: whether
    /// the closure's copies into our buffers should stream ([`Choice`]).
    pub(super) fn step(
        &mut self,
        hdr: &StepHeader,
        bytes: usize,
        choice: Choice,
        mut io: impl FnMut(Io<'_>, bool),
    ) -> Result<()> {
        let (stream, start) = match choice {
            Choice::Plain | Choice::Writes => (false, None),
            Choice::Given(stream) => (stream, None),
            Choice::Timed => self.choose(hdr.op, bytes),
        };
        let k = self.begin(hdr)?;
        // A writer-timed copy starts its clock once the buffer is ours.
        let kind = usize::from(hdr.op);
        let (stream, copy) = match (choice, self.write_stores.get_mut(kind)) {
            (Choice::Writes, Some(s)) => s.start(bytes),
            _ => (stream, None),
        };
        io(Io::Write(self.window_mut(k, bytes)), stream);
        if let Some(s) = self.write_stores.get_mut(kind) {
            s.finish(bytes, stream, copy);
        }
        self.publish(k, hdr)?;
        {
            let (views, next) = self.views(k, bytes);
            io(Io::Read(&views, next), stream);
        }
        self.chosen(hdr.op, bytes, stream, start);
        Ok(())
    }

    /// [`Stores::start`](super::stores::Stores::start) for a piece of op kind `op` (its code).
    pub(super) fn choose(&mut self, op: u8, bytes: usize) -> (bool, Option<Instant>) {
        self.stores.get_mut(usize::from(op)).map_or((false, None), |s| s.start(bytes))
    }

    /// [`Stores::finish`](super::stores::Stores::finish) for a piece of op kind `op`.
    pub(super) fn chosen(&mut self, op: u8, bytes: usize, stream: bool, start: Option<Instant>) {
        if let Some(s) = self.stores.get_mut(usize::from(op)) {
            s.finish(bytes, stream, start);
        }
    }

    /// One futex sleep on this rank's doorbell, unless `ready` or new work shows up first.
    pub(super) fn sleep(&mut self, ready: impl Fn(&Engine) -> bool) -> Result<()> {
        let me = self.segs[self.rank].clone();
        let bell = me.u32_at(OFF_DOORBELL);
        let seen = bell.load(SeqCst);
        me.u32_at(OFF_SLEEPING).fetch_or(SLEEP_ENGINE, SeqCst);
        // Re-check after announcing the sleep: a peer that published before seeing the flag
        // is visible now; one that publishes after will ring.
        let skip = if ready(self) { Ok(true) } else { self.pump() };
        if let Ok(false) = skip {
            futex_wait(bell, seen, Duration::from_millis(10));
        }
        me.u32_at(OFF_SLEEPING).fetch_and(!SLEEP_ENGINE, SeqCst);
        skip.map(drop)
    }

    pub(super) fn ring(&self, peer: usize) {
        let seg = &self.segs[peer];
        if seg.u32_at(OFF_SLEEPING).load(SeqCst) & (SLEEP_PEERS | SLEEP_ENGINE) != 0 {
            seg.u32_at(OFF_DOORBELL).fetch_add(1, SeqCst);
            futex_wake(seg.u32_at(OFF_DOORBELL));
        }
    }

    pub(super) fn ring_all(&self) {
        for p in (0..self.world).filter(|&p| p != self.rank) {
            let seg = &self.segs[p];
            seg.u32_at(OFF_DOORBELL).fetch_add(1, SeqCst);
            futex_wake(seg.u32_at(OFF_DOORBELL));
        }
    }
}

/// Fills in a new segment's identity, which peers check when they map it.
pub(crate) fn init_segment(me: &Segment, world: u32, rank: u32, window: usize) {
    // SAFETY: nobody else knows the segment's name yet.
    unsafe {
        me.write(OFF_VERSION, VERSION);
        me.write(OFF_WORLD, world);
        me.write(OFF_RANK, rank);
        me.write(OFF_WINDOW, window as u64);
    }
}

/// Writes why this rank gave up, for peers to report; the caller then stores `STATE_ABORTED`.
/// Says in this rank's segment that it gave up the group, with `cause`, where the peers' waits
/// see it (state `ABORTED`, the reason beside it). Once: the caller that moves the state word
/// from `READY` writes; any other waits until that one is done (a rank that gave up releases
/// the buffers its peers read only after saying so). Whether this call wrote it.
pub(crate) fn publish_abort(me: &Segment, cause: &str) -> bool {
    let state = me.u32_at(OFF_STATE);
    if state.compare_exchange(STATE_READY, STATE_WRITING, SeqCst, SeqCst).is_err() {
        while state.load(SeqCst) == STATE_WRITING {
            std::hint::spin_loop();
        }
        return false;
    }
    let bytes = cause.as_bytes();
    let n = bytes.len().min(REASON_LEN - 1);
    for (i, b) in bytes[..n].iter().chain(std::iter::once(&0)).enumerate() {
        // SAFETY: the reason area is written only here, by the one caller that moved the state
        // word from READY to WRITING, before the state store below releases it; peers read it
        // only after acquiring STATE_ABORTED.
        unsafe { me.write(OFF_REASON + i, *b) };
    }
    state.store(STATE_ABORTED, SeqCst);
    true
}

/// Writes chunk `chunk` of a message to `peer` into our mailbox slot for it (its data in the
/// header when it fits, else with streaming stores if `stream`) and publishes it. Call only
/// when the peer has acknowledged chunk `chunk - SLOTS` (the slot's previous use).
pub(super) fn write_chunk(
    me: &Segment,
    lay: &Layout,
    peer: usize,
    chunk: u64,
    mut hdr: MsgHeader,
    data: &[u8],
    stream: bool,
) {
    let at = lay.msg_header(peer, chunk);
    let carried = data.len() <= CARRIED;
    if carried {
        hdr.data[..data.len()].copy_from_slice(data);
    }
    // SAFETY: slot `chunk % SLOTS` was last used by chunk `chunk - SLOTS`, which the peer
    // acknowledged after it finished copying it out (the caller checked), and the peer reads
    // this one only after the store of `published` below; the first word is not written here.
    unsafe {
        me.write(at + 8, body(&hdr));
        if !carried {
            super::stores::to_window(stream, me.bytes_mut(lay.msg_data(peer, chunk, data.len()), data.len()), data);
        }
    }
    // SeqCst: paired with the receiver's announcement that it sleeps (see `ring`).
    me.u64_at(at).store(chunk + 1, SeqCst);
}

/// Chunk `chunk` of the message `src` (a peer's segment) sends rank `me`, its header read
/// from `at` (the data is in it up to [`CARRIED`] bytes). Call only after reading its
/// `published` word (acquire), and drop the slice before acknowledging.
pub(super) fn read_chunk<'a>(src: &'a Segment, lay: &Layout, me: usize, chunk: u64, len: usize) -> &'a [u8] {
    let at = if len <= CARRIED { lay.msg_header(me, chunk) + CARRIED_AT } else { lay.msg_data(me, chunk, len) };
    // SAFETY: the sender published this chunk after writing its header and slot (the caller
    // checked) and will not rewrite them until we acknowledge it, which the caller does after
    // this borrow ends.
    unsafe { src.bytes(at, len) }
}

/// Every rank's window of a step: on the stack up to 16 ranks (a small op's step is a few
/// hundred nanoseconds, an allocation a noticeable part of it).
pub(super) type Views<'a> = smallvec::SmallVec<[&'a [u8]; 16]>;

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::engine::Params;
    use crate::layout::{OFF_STATE, STATE_CLOSED, STATE_READY};

    /// Two ranks' segments and rank 0's engine over them (rank 1 is played by hand).
    fn engine_and_peer() -> (Arc<comm_core::lane::Lane<Engine>>, Arc<Segment>, Layout) {
        let lay = Layout::new(2, 64 << 10, 16 << 10).expect("a small layout");
        let segs: Vec<Arc<Segment>> =
            (0..2).map(|r| Arc::new(Segment::anonymous(&format!("test-{r}"), lay.total).expect("memfd"))).collect();
        for (r, seg) in segs.iter().enumerate() {
            init_segment(seg, 2, r as u32, lay.window);
            seg.u32_at(OFF_STATE).store(STATE_READY, SeqCst);
        }
        let peer = segs[1].clone();
        let params = Params {
            timeout: Duration::from_secs(5),
            spin: Duration::ZERO,
            cpus: 1,
            panic_at: None,
            stream: None,
            zc_min: usize::MAX,
            send_in_place_min: usize::MAX,
        };
        let (lane, _tx) = Engine::start(0, lay, segs, vec![None, None], params);
        (lane, peer, lay)
    }

    #[test]
    fn a_peer_gone_after_reaching_the_step_joined_it() {
        let (lane, peer, _) = engine_and_peer();
        let mut e = lane.lock();
        peer.u32_at(OFF_STATE).store(STATE_CLOSED, SeqCst);
        // Closed after publishing step 3: it joined step 3, but cannot reach step 4.
        peer.u64_at(OFF_STEP).store(3, SeqCst);
        assert!(e.check_late(1, 3).is_ok());
        let lost = e.check_late(1, 4).expect_err("a closed peer short of the step is lost");
        assert!(matches!(lost, CommError::PeerLost { rank: 1, .. }), "{lost}");
    }

    /// A peer that gave up waiting fences the late rank's step: then the late rank cannot
    /// publish it (its op fails, naming the peer), and a peer that published first is not
    /// fenced (it joined the op).
    #[test]
    fn a_fenced_step_cannot_be_published_and_a_published_one_cannot_be_fenced() {
        let (lane, peer, lay) = engine_and_peer();
        let mut e = lane.lock();
        // Rank 1 published step 1; rank 0 publishes it too, then gives up on rank 1's step 2.
        peer.u64_at(lay.step_header(1)).store(1, SeqCst);
        assert!(!e.fence(1, 1), "a published step is not fenced");
        e.announce(1).unwrap();
        assert!(e.fence(1, 2), "rank 1 had not published step 2");
        assert!(!e.headers_reached(2) && e.fence(1, 2), "fenced once, fenced for every rank");
        // Rank 1 fences rank 0's step 2 the same way: rank 0's announce fails.
        e.me().u64_at(lay.step_header(2)).store(FENCED | 1 << FENCER_SHIFT | 2, SeqCst);
        let err = e.announce(2).unwrap_err();
        assert!(matches!(&err, CommError::Timeout { .. }) && err.to_string().contains("rank 1"), "{err}");
        assert_eq!(e.peer_step(0), 1, "a fenced rank's step counter stays where it was");
    }
}
