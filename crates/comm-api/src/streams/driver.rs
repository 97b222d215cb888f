//! The thread that runs the arbitration on every rank, and the arbiter itself on rank 0.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use comm_core::ops::{RecvFrom, SendTo};
use comm_core::{Backend, Collective, CommError, Completer, DType, HostBuffer, Op, Work};

use super::wire::*;

/// How long a rank's driver waits for something to do before it listens again to a peer it
/// owes nothing.
pub(super) const LISTEN_IDLE: Duration = Duration::from_micros(100);

/// Why the streams broke: said to every op, and whether the control group timed out (a
/// waiting op then fails with `Timeout`).
pub(super) struct Broken {
    why: String,
    timed_out: bool,
}

impl Broken {
    /// The control group failed with `e`.
    fn control(e: CommError) -> Broken {
        let timed_out = matches!(e, CommError::Timeout { .. });
        Broken { why: format!("the streams' control group failed: {e}"), timed_out }
    }
}

impl From<String> for Broken {
    fn from(why: String) -> Broken {
        Broken { why, timed_out: false }
    }
}

/// An op waiting for its turn, whatever its request type.
pub(super) trait Deferred: Send {
    fn run(self: Box<Self>, data: &Arc<dyn Backend>);
    fn fail(self: Box<Self>, error: &dyn Fn(&'static str) -> CommError);
}

pub(super) struct Undecided<R: Op> {
    pub(super) req: R,
    pub(super) done: Completer<R::Output>,
}

impl<R: Op> Deferred for Undecided<R>
where
    dyn Backend: Collective<R>,
{
    fn run(self: Box<Self>, data: &Arc<dyn Backend>) {
        let Undecided { req, done } = *self;
        Collective::<R>::submit(&**data, req).forward(done);
    }

    fn fail(self: Box<Self>, error: &dyn Fn(&'static str) -> CommError) {
        self.done.complete(Err(error(R::NAME)));
    }
}

pub(super) enum Event {
    Post {
        key: OpKey,
        sig: u64,
        op: Box<dyn Deferred>,
    },
    /// The standing receive from this peer completed.
    Frame(u32),
    /// End this rank's streams (at most the timeout): the others say goodbye to rank 0 and
    /// wait for its answer; rank 0 answers each and ends once all did. Completes the
    /// completer, if any, when done.
    Stop(Option<Completer<()>>),
}

/// What rank 0 knows of an undecided op.
pub(super) struct Known {
    /// Each rank's signature of it, once that rank issued it.
    sigs: Vec<Option<u64>>,
    first: Instant,
    at: u64,
}

/// Rank 0's view: every undecided op, in the order it first heard of them.
#[derive(Default)]
pub(super) struct Arbiter {
    known: HashMap<OpKey, Known>,
    order: BTreeMap<u64, OpKey>,
    next: u64,
    /// Each rank's undecided ops of each channel, in the order it issued them.
    queues: HashMap<(u32, OpKey), VecDeque<OpKey>>,
}

/// The thread that runs the arbitration on every rank (and the arbiter on rank 0).
pub(super) struct Driver {
    rank: u32,
    world: u32,
    data: Arc<dyn Backend>,
    control: Arc<dyn Backend>,
    tx: Sender<Event>,
    timeout: Duration,
    broken: Arc<Mutex<Option<String>>>,
    /// This rank's ops waiting for their verdict.
    mine: HashMap<OpKey, Box<dyn Deferred>>,
    /// Ops decided this turn, in order: run once the turn's frames are out, so that no peer
    /// waits for its verdict while this rank's op waits for the peer.
    decided: Vec<Box<dyn Deferred>>,
    /// Streams that failed, and why.
    dead: HashMap<u64, Failure>,
    /// The standing receive from each peer this rank hears from.
    recvs: Vec<Option<Work<HostBuffer>>>,
    /// Entries to send to each peer, and when it was last sent one.
    outbox: Vec<Vec<Entry>>,
    last_sent: Vec<Instant>,
    /// Goodbyes sent to and received from each peer: a pair that exchanged both sends and
    /// listens no more, so nothing is left pending on `control`.
    bye_sent: Vec<bool>,
    gone: Vec<bool>,
    /// The goodbyes on their way: waited for before the thread ends (and `shutdown`
    /// returns), so that a process that exits next has sent them.
    byes: Vec<Work<HostBuffer>>,
    /// Since when this rank is ending its streams, and who waits for it.
    stopping: Option<(Instant, Vec<Completer<()>>)>,
    /// Peers whose frame this turn took: listened to again once the turn's verdicts and ops
    /// are out, since posting a receive may hold this thread for the backend's spin budget.
    relisten: Vec<u32>,
    arbiter: Option<Arbiter>,
}

impl Driver {
    pub(super) fn new(
        data: Arc<dyn Backend>,
        control: Arc<dyn Backend>,
        tx: Sender<Event>,
        timeout: Duration,
        broken: Arc<Mutex<Option<String>>>,
    ) -> Driver {
        let (rank, world) = (data.rank(), data.world_size());
        let n = world as usize;
        Driver {
            rank,
            world,
            data,
            control,
            tx,
            timeout,
            broken,
            mine: HashMap::new(),
            decided: Vec::new(),
            dead: HashMap::new(),
            recvs: (0..n).map(|_| None).collect(),
            outbox: vec![Vec::new(); n],
            last_sent: vec![Instant::now(); n],
            bye_sent: vec![false; n],
            gone: vec![false; n],
            byes: Vec::new(),
            stopping: None,
            relisten: Vec::new(),
            arbiter: (rank == 0).then(Arbiter::default),
        }
    }

    /// The peers this rank exchanges frames with: the arbiter everyone, the others it.
    fn partners(&self) -> Vec<u32> {
        if self.rank == 0 {
            (1..self.world).collect()
        } else {
            vec![0]
        }
    }

    /// The partners this rank has not said goodbye to.
    fn peers(&self) -> Vec<u32> {
        self.partners().into_iter().filter(|&p| !self.bye_sent[p as usize]).collect()
    }

    fn keepalive(&self) -> Duration {
        (self.timeout / 4).max(Duration::from_millis(1))
    }

    pub(super) fn run(mut self, rx: Receiver<Event>) {
        for p in self.peers() {
            self.listen(p);
        }
        // Peers to listen to again once this rank has nothing else to do (see below), and
        // since when.
        let mut deferred: Vec<(u32, Instant)> = Vec::new();
        loop {
            let mut wait = self.next_deadline().saturating_duration_since(Instant::now());
            if !deferred.is_empty() {
                wait = wait.min(LISTEN_IDLE);
            }
            let first = match rx.recv_timeout(wait) {
                Ok(ev) => Some(ev),
                Err(RecvTimeoutError::Timeout) => {
                    for (p, _) in std::mem::take(&mut deferred) {
                        self.listen(p);
                    }
                    None
                }
                Err(RecvTimeoutError::Disconnected) => return,
            };
            // Everything that arrived meanwhile in one turn: one frame per peer per batch.
            for ev in first.into_iter().chain(std::iter::from_fn(|| rx.try_recv().ok())) {
                if let Err(why) = self.handle(ev) {
                    self.fail_all(why);
                    return self.end();
                }
            }
            let turn_at = Instant::now();
            if let Err(why) = self.turn() {
                self.fail_all(why);
                return self.end();
            }
            // Posting a receive may hold this thread for the backend's spin budget. A peer
            // this turn sent a frame to owes this rank the next frame (a verdict, or its next
            // ops after one): listen now, and that wait is for it. Any other peer is listened
            // to once nothing happens for a moment (or, if this rank stays busy, after that
            // moment anyway), so that this thread does not sit in a receive while its own
            // tasks' new ops wait for it.
            deferred.extend(std::mem::take(&mut self.relisten).into_iter().map(|p| (p, turn_at)));
            let (now, later): (Vec<_>, Vec<_>) = deferred
                .drain(..)
                .partition(|&(p, since)| self.last_sent[p as usize] >= turn_at || since.elapsed() >= LISTEN_IDLE);
            deferred = later;
            for (p, _) in now {
                self.listen(p);
            }
            let partners = self.partners();
            let all_gone = partners.iter().all(|&p| self.gone[p as usize]);
            match &self.stopping {
                Some((since, _)) if all_gone || since.elapsed() >= self.timeout => return self.end(),
                // The others ended theirs: so does this rank (later ops fail with `Shutdown`).
                None if all_gone && !partners.is_empty() => return self.end(),
                _ => {}
            }
        }
    }

    /// Ends the thread: waiting ops fail with `Shutdown`, `Streams::shutdown` returns.
    fn end(mut self) {
        for op in self.mine.drain().map(|(_, op)| op).chain(self.decided.drain(..)) {
            op.fail(&|_| CommError::Shutdown("the streams were shut down".into()));
        }
        // A peer that is gone fails the send (within the backend's timeout): nothing to add.
        for bye in self.byes.drain(..) {
            let _ = bye.wait();
        }
        for done in self.stopping.take().map(|(_, w)| w).unwrap_or_default() {
            done.complete(Ok(()));
        }
    }

    /// Says goodbye to `peer` (once): nothing is sent to it after this.
    fn say_bye(&mut self, peer: u32) {
        if !std::mem::replace(&mut self.bye_sent[peer as usize], true) {
            self.byes.push(Collective::<SendTo>::submit(&*self.control, SendTo { buf: bye(), dst: peer, tag: 0 }));
        }
    }

    fn next_deadline(&self) -> Instant {
        let keepalive = self.peers().iter().map(|&p| self.last_sent[p as usize] + self.keepalive()).min();
        let oldest =
            self.arbiter.as_ref().and_then(|a| a.order.values().next().map(|k| a.known[k].first + self.timeout));
        keepalive.into_iter().chain(oldest).min().unwrap_or_else(|| Instant::now() + self.keepalive())
    }

    /// Handles one event; `Err(why)` when the streams are broken.
    fn handle(&mut self, ev: Event) -> Result<(), Broken> {
        match ev {
            Event::Stop(done) => {
                let (_, waiting) = self.stopping.get_or_insert_with(|| (Instant::now(), Vec::new()));
                waiting.extend(done);
                for (_, op) in self.mine.drain() {
                    op.fail(&|_| CommError::Shutdown("the streams were shut down".into()));
                }
                // Rank 0 goes on deciding the others' ops (messages between two of them
                // need it) and answers each goodbye; the others leave now.
                if self.rank != 0 {
                    self.say_bye(0);
                }
                Ok(())
            }
            Event::Post { op, .. } if self.stopping.is_some() => {
                op.fail(&|_| CommError::Shutdown("the streams were shut down".into()));
                Ok(())
            }
            Event::Post { key, sig, op } => {
                if let Some(f) = self.dead.get(&key.stream).copied() {
                    op.fail(&|name| f.error(name, self.timeout, false));
                    return Ok(());
                }
                self.mine.insert(key, op);
                match self.rank {
                    0 => self.posted(0, key, sig),
                    _ => self.outbox[0].push(Entry { key, code: POSTED, sig, a: 0, b: 0 }),
                }
                Ok(())
            }
            Event::Frame(peer) => {
                let work = self.recvs[peer as usize].take().expect("a frame event follows its receive");
                let buf = work.wait().map_err(Broken::control)?;
                let entries = decode(&buf, self.world).map_err(|e| format!("rank {peer} sent a bad frame: {e}"))?;
                let Some(entries) = entries else {
                    self.gone[peer as usize] = true;
                    self.say_bye(peer);
                    return Ok(());
                };
                self.relisten.push(peer);
                for e in entries {
                    match (self.rank, e.code) {
                        (0, POSTED) if e.key.involves(self.world).contains(&peer) => self.posted(peer, e.key, e.sig),
                        (r, code) if r != 0 && code != POSTED => self.verdict(e),
                        _ => return Err(format!("rank {peer} sent an entry out of protocol: {e:?}").into()),
                    }
                }
                Ok(())
            }
        }
    }

    fn listen(&mut self, peer: u32) {
        let tx = self.tx.clone();
        let recv = RecvFrom { buf: HostBuffer::zeroed(DType::U8, FRAME), src: peer, tag: 0 };
        let work = Collective::<RecvFrom>::submit(&*self.control, recv).on_complete(move |_| {
            let _ = tx.send(Event::Frame(peer));
        });
        self.recvs[peer as usize] = Some(work);
    }

    /// A verdict from the arbiter on one of this rank's ops.
    fn verdict(&mut self, e: Entry) {
        let failure = |code| Failure { code, key: e.key, a: e.a, b: e.b };
        match e.code {
            RUN => self.decided.extend(self.mine.remove(&e.key)),
            DEAD => {
                let f = *self.dead.entry(e.key.stream).or_insert(failure(e.sig as u8));
                if let Some(op) = self.mine.remove(&e.key) {
                    op.fail(&|name| f.error(name, self.timeout, false));
                }
            }
            code => {
                let f = failure(code);
                self.dead.insert(e.key.stream, f);
                if let Some(op) = self.mine.remove(&e.key) {
                    op.fail(&|name| f.error(name, self.timeout, true));
                }
            }
        }
    }

    /// Rank 0: `from` issued `key`.
    fn posted(&mut self, from: u32, key: OpKey, sig: u64) {
        if let Some(f) = self.dead.get(&key.stream).copied() {
            let e = Entry { key, code: DEAD, sig: u64::from(f.code), a: f.a, b: f.b };
            return self.deliver(from, e);
        }
        let world = self.world as usize;
        let a = self.arbiter.as_mut().expect("rank 0 arbitrates");
        let at = a.next;
        let known = a.known.entry(key).or_insert_with(|| Known { sigs: vec![None; world], first: Instant::now(), at });
        if known.at == at {
            a.order.insert(at, key);
            a.next += 1;
        }
        known.sigs[from as usize] = Some(sig);
        a.queues.entry((from, key.channel())).or_default().push_back(key);
    }

    /// Rank 0: decides every op it can, fails those that waited too long, then sends.
    fn turn(&mut self) -> Result<(), Broken> {
        if self.arbiter.is_some() {
            self.decide();
            self.expire();
        }
        self.flush()?;
        for op in std::mem::take(&mut self.decided) {
            op.run(&self.data);
        }
        Ok(())
    }

    fn decide(&mut self) {
        let world = self.world;
        loop {
            let a = self.arbiter.as_ref().expect("rank 0 arbitrates");
            let ready = a.order.values().find_map(|key| {
                let known = &a.known[key];
                let involved = key.involves(world);
                let all_issued = involved.iter().all(|&p| known.sigs[p as usize].is_some());
                let first_of_channel =
                    involved.iter().all(|&p| a.queues.get(&(p, key.channel())).and_then(VecDeque::front) == Some(key));
                (all_issued && first_of_channel).then(|| {
                    let sig = known.sigs[involved[0] as usize];
                    let odd = involved.iter().find(|&&p| known.sigs[p as usize] != sig);
                    (*key, odd.map(|&p| (involved[0], p)))
                })
            });
            match ready {
                None => return,
                Some((key, None)) => self.settle(key, |_| RUN),
                Some((key, Some((a, b)))) => self.kill(Failure { code: MISMATCH, key, a, b }),
            }
        }
    }

    /// Rank 0: fails the ops that some rank has not issued within the timeout.
    fn expire(&mut self) {
        loop {
            let a = self.arbiter.as_ref().expect("rank 0 arbitrates");
            let Some(key) = a.order.values().next().copied() else { return };
            let known = &a.known[&key];
            if known.first.elapsed() < self.timeout {
                return;
            }
            let missing = key.involves(self.world).into_iter().find(|&p| known.sigs[p as usize].is_none()).unwrap_or(0);
            self.kill(Failure { code: TIMEOUT, key, a: missing, b: 0 });
        }
    }

    /// Rank 0: fails the stream of `f.key`: that op with `f`, its other undecided ops as dead.
    fn kill(&mut self, f: Failure) {
        self.dead.insert(f.key.stream, f);
        let a = self.arbiter.as_ref().expect("rank 0 arbitrates");
        let of_stream: Vec<OpKey> = a.order.values().filter(|k| k.stream == f.key.stream).copied().collect();
        for key in of_stream {
            self.settle(key, |key| if key == f.key { f.code } else { DEAD });
        }
    }

    /// Rank 0: sends `key`'s verdict to every rank that issued it, and forgets it.
    fn settle(&mut self, key: OpKey, code: impl Fn(OpKey) -> u8) {
        let a = self.arbiter.as_mut().expect("rank 0 arbitrates");
        let Some(known) = a.known.remove(&key) else { return };
        a.order.remove(&known.at);
        let f = self.dead.get(&key.stream).copied();
        let code = code(key);
        for (p, _) in known.sigs.iter().enumerate().filter(|(_, s)| s.is_some()) {
            let p = p as u32;
            if let Some(q) = a.queues.get_mut(&(p, key.channel())) {
                q.retain(|k| *k != key);
                if q.is_empty() {
                    a.queues.remove(&(p, key.channel()));
                }
            }
        }
        for p in known.sigs.iter().enumerate().filter(|(_, s)| s.is_some()).map(|(p, _)| p as u32) {
            let e = match (code, f) {
                (DEAD, Some(f)) => Entry { key, code, sig: u64::from(f.code), a: f.a, b: f.b },
                (_, Some(f)) => Entry { key, code, sig: 0, a: f.a, b: f.b },
                _ => Entry { key, code, sig: 0, a: 0, b: 0 },
            };
            self.deliver(p, e);
        }
    }

    fn deliver(&mut self, to: u32, e: Entry) {
        if to == self.rank {
            self.verdict(e);
        } else if !self.bye_sent[to as usize] {
            self.outbox[to as usize].push(e);
        }
    }

    /// Sends what each peer is owed, or an empty frame when it has heard nothing for a while.
    fn flush(&mut self) -> Result<(), Broken> {
        let now = Instant::now();
        for p in self.peers() {
            let p = p as usize;
            if self.outbox[p].is_empty() && now < self.last_sent[p] + self.keepalive() {
                continue;
            }
            for buf in encode(&std::mem::take(&mut self.outbox[p])) {
                let work = Collective::<SendTo>::submit(&*self.control, SendTo { buf, dst: p as u32, tag: 0 });
                if let Some(c) = work.inline_completion() {
                    if let Some(e) = c.error {
                        return Err(Broken::control(e.duplicate()));
                    }
                }
            }
            self.last_sent[p] = now;
        }
        Ok(())
    }

    /// Fails every waiting op with `why`, and every later one. An op still waiting for its
    /// turn is told which stream and op it was, and a timeout stays a `Timeout`.
    fn fail_all(&mut self, Broken { why, timed_out }: Broken) {
        tracing::warn!(target: "comm", "streams: {why}");
        *self.broken.lock().unwrap_or_else(|p| p.into_inner()) = Some(why.clone());
        let timeout = self.timeout;
        for (key, op) in self.mine.drain() {
            let what = format!("{} of stream {}", key.describe(), key.stream);
            op.fail(&|name| {
                if timed_out {
                    CommError::timeout(format!("{name} on stream {}", key.stream), timeout, format!("{what}: {why}"))
                } else {
                    CommError::Poisoned { cause: format!("{what}: {why}") }
                }
            });
        }
        for op in self.decided.drain(..) {
            op.fail(&|_| CommError::Poisoned { cause: why.clone() });
        }
    }
}
