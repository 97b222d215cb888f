//! The issuer check: collectives of one group (or stream) pair across ranks by the order they
//! are issued in, so two tasks issuing on one group pair wrongly as soon as they interleave
//! differently on two ranks — even one at a time, behind a lock, which orders them on a rank
//! but not across ranks. Ranks cannot know which ops a user meant to pair; they can compare
//! where each rank's group changed hands.
//!
//! A group's *turn* changes when a collective comes from another issuer (a tokio task, or a
//! thread outside tokio) than the group's previous collective. The first op of a new turn is
//! preceded by a small all_gather, the *turn check*, whose length says how the new issuer
//! relates to the previous one (task or thread; of two tasks or two threads, made later or
//! earlier: ids count up in spawn order). A rank whose group changed hands where a peer's did
//! not, or differently, issues a check where the peer issued something else: the backend's
//! cross-rank op check fails both with `Mismatch` and poisons the group (or the stream) on
//! every rank, so ops issued after it fail too. ARCHITECTURE.md says what this cannot see.
//! Within a turn the check costs a task-id read and one load.

use std::hash::{Hash, Hasher};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use comm_core::ops::AllGather;
use comm_core::{Backend, Collective, CommError, DType, HostBuffer, Op, Work};

/// What a turn check carries first, so that a check paired with a user's all_gather of the
/// same shape still fails.
const MAGIC: [u8; 8] = *b"commturn";
/// The shortest turn check (magic and turn number), in bytes.
const CHECK_LEN: usize = 16;
/// [`Issuers::last`] once a misuse was seen: no issuer has this number, so every op takes the
/// slow path and fails there.
const FAILED: u64 = u64::MAX;

/// Who issues an op: the tokio task, or the thread outside tokio, as a number (a task's id or
/// a thread's, times two, plus one for a thread; never 0). Both ids count up in the order
/// tasks are spawned and threads made.
fn current() -> u64 {
    thread_local! {
        // `thread::current()` clones a handle (two atomic ops): read the id once per thread.
        static THREAD: u64 = id_of(&std::thread::current().id());
    }
    let issuer = match tokio::task::try_id() {
        Some(id) => id_of(&id) << 1,
        None => (THREAD.with(|t| *t) << 1) | 1,
    };
    issuer.clamp(2, FAILED - 1)
}

/// The `u64` that a tokio task `Id` or a `ThreadId` holds (their only field), through `Hash`.
fn id_of(id: &impl Hash) -> u64 {
    struct Capture(u64);
    impl Hasher for Capture {
        fn finish(&self) -> u64 {
            self.0
        }
        fn write(&mut self, bytes: &[u8]) {
            self.0 = bytes.iter().fold(self.0, |h, &b| h.rotate_left(8) ^ u64::from(b));
        }
        fn write_u64(&mut self, x: u64) {
            self.0 = x;
        }
    }
    let mut h = Capture(0);
    id.hash(&mut h);
    h.0
}

fn describe(issuer: u64) -> String {
    let kind = if issuer & 1 == 0 { "tokio task" } else { "thread" };
    format!("{kind} {}", issuer >> 1)
}

/// Whether the check runs (`COMM_ISSUER_CHECK`, default on in every build).
pub(crate) fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| match comm_core::config::env_var("COMM_ISSUER_CHECK") {
        Some(v) => comm_core::config::parse_bool(&v).unwrap_or_else(|why| {
            eprintln!("comm: COMM_ISSUER_CHECK={v:?}: {why}; the check stays on");
            true
        }),
        None => true,
    })
}

/// The turns of one group (or stream), shared by its handles' clones.
#[derive(Debug, Default)]
pub(crate) struct Issuers {
    /// The issuer of the group's last collective (0 before the first), or [`FAILED`].
    last: AtomicU64,
    /// Whether the group ever changed hands (then errors name its issuers).
    changed: AtomicBool,
    turns: Mutex<Turns>,
    /// Why the group failed its check, once it did (read without the lock: a check can fail
    /// on the thread that holds it, when its all_gather completes inline).
    failed: OnceLock<String>,
}

#[derive(Debug, Default)]
struct Turns {
    /// How many times the group changed hands.
    count: u64,
    /// The issuer before the current one.
    previous: u64,
}

impl Issuers {
    /// Submits the collective `req` on `backend`, with a turn check first when it begins a
    /// turn; a failed check fails the op, and a `Mismatch` (or the poison it leaves) names the
    /// group's issuers.
    pub(crate) fn submit<R: Op>(self: &Arc<Self>, backend: &Arc<dyn Backend>, req: R) -> Work<R::Output>
    where
        dyn Backend: Collective<R>,
    {
        let me = current();
        let last = self.last.load(Relaxed);
        if last == me {
            return self.explain(Collective::<R>::submit(&**backend, req));
        }
        if let Some(why) = self.failed.get() {
            return Work::ready(Err(CommError::mismatch(R::NAME, why.clone())));
        }
        let mut turns = self.turns();
        let last = self.last.load(Relaxed);
        if last == 0 || last == me {
            self.last.store(me, Relaxed);
            drop(turns);
            return self.explain(Collective::<R>::submit(&**backend, req));
        }
        turns.count += 1;
        turns.previous = last;
        self.changed.store(true, Relaxed);
        let check = Check::new(turns.count, me, last);
        let world = backend.world_size() as usize;
        let gathered = Collective::<AllGather>::submit(&**backend, AllGather { input: check.buffer(), output: None });
        let (this, group, history) = (self.clone(), backend.clone(), history(&turns, me));
        let check = gathered.and_then(move |io| this.verify(R::NAME, &io.output, world, &*group, &history));
        self.last.store(me, Relaxed);
        let op = Collective::<R>::submit(&**backend, req);
        drop(turns);
        self.explain(op.after(check))
    }

    /// Checks that every rank's block is a turn check: one paired with a user's all_gather
    /// of the same shape (a rank that changed hands where its peers issued that) fails the
    /// group on every rank, through the backend, like any mismatch.
    fn verify(
        &self,
        op: &'static str,
        all: &HostBuffer,
        world: usize,
        group: &dyn Backend,
        history: &str,
    ) -> Result<(), CommError> {
        let len = all.len() / world.max(1);
        let odd = (0..world).find(|&r| all.as_bytes().get(r * len..r * len + MAGIC.len()) != Some(&MAGIC[..]));
        let Some(rank) = odd else { return Ok(()) };
        let why =
            format!("rank {rank} issued an all_gather where this rank's group changed hands ({history}). {ADVICE}");
        group.abort(&why);
        let _ = self.failed.set(why.clone());
        self.last.store(FAILED, Relaxed);
        Err(CommError::mismatch(op, why))
    }

    fn turns(&self) -> MutexGuard<'_, Turns> {
        self.turns.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Adds the group's issuers to a `Mismatch`, the poison one left or a `Timeout`, once the
    /// group has changed hands (an op of a group with one issuer has nothing to add).
    fn explain<T: Send + 'static>(self: &Arc<Self>, work: Work<T>) -> Work<T> {
        if !self.changed.load(Relaxed) {
            return work;
        }
        match work.inline_completion() {
            Some(c) if c.error.is_none() => work,
            Some(_) => {
                let hint = self.hint();
                work.map_err(move |e| add_hint(e, &hint))
            }
            None => {
                let this = self.clone();
                work.map_err(move |e| add_hint(e, &this.hint()))
            }
        }
    }

    fn hint(&self) -> String {
        let history = history(&self.turns(), self.last.load(Relaxed));
        format!(
            "this rank's collectives on the group came from more than one task ({history}; the all_gather of \
             {CHECK_LEN} to {} u8 a rank issues where its group changes hands is the issuer check). {ADVICE}",
            CHECK_LEN + 7
        )
    }
}

/// The group's issuers, for messages: "tokio task 7, after tokio task 5 (3 changes of task)".
fn history(turns: &Turns, last: u64) -> String {
    let now = if last == FAILED { "its last issuer".to_owned() } else { describe(last) };
    match turns.count {
        0 => format!("{now}, the group's only issuer on this rank"),
        n => format!("{now}, after {} ({n} change{} of task)", describe(turns.previous), if n == 1 { "" } else { "s" }),
    }
}

const ADVICE: &str = "Collectives of one group (or stream) pair across ranks by the order they are issued in, which \
    two tasks make differ between ranks, also one at a time behind a lock: give each task its own stream \
    (`pg.streams().await?.stream(key)`), or issue from one task (COMM_ISSUER_CHECK=0 turns this check off)";

fn add_hint(e: CommError, hint: &str) -> CommError {
    match e {
        CommError::Mismatch { op, detail } if !detail.contains(ADVICE) => {
            CommError::Mismatch { op, detail: format!("{detail}; {hint}") }
        }
        CommError::Poisoned { cause } if !cause.contains(ADVICE) => {
            CommError::Poisoned { cause: format!("{cause}; {hint}") }
        }
        // Ranks waiting for ops their peers paired otherwise time out.
        CommError::Timeout { op, after, detail } if !detail.contains(ADVICE) => {
            CommError::Timeout { op, after, detail: format!("{detail}; {hint}") }
        }
        e => e,
    }
}

/// A turn check: an all_gather of `u8`s whose length says how the turn's issuer relates to
/// the previous one (task or thread each; of two tasks or two threads, whether it was made
/// later), so ranks whose groups changed hands differently issue different shapes, which every
/// backend's cross-rank check refuses as it refuses any mismatch; it carries the magic and the
/// turn's number.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Check {
    turn: u64,
    how: u8,
}

impl Check {
    fn new(turn: u64, me: u64, previous: u64) -> Check {
        let (me_thread, prev_thread) = (me & 1 == 1, previous & 1 == 1);
        let later = me_thread == prev_thread && me > previous;
        Check { turn, how: u8::from(me_thread) | u8::from(prev_thread) << 1 | u8::from(later) << 2 }
    }

    fn buffer(self) -> HostBuffer {
        let mut b = HostBuffer::zeroed(DType::U8, CHECK_LEN + usize::from(self.how));
        b.as_bytes_mut()[..8].copy_from_slice(&MAGIC);
        b.as_bytes_mut()[8..16].copy_from_slice(&self.turn.to_le_bytes());
        b
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn threads_and_tasks_are_told_apart() {
        let on_thread = current();
        assert_eq!(on_thread & 1, 1, "a thread outside tokio: {on_thread}");
        let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
        let in_task = rt.block_on(async { tokio::spawn(async { current() }).await.unwrap() });
        assert_eq!(in_task & 1, 0, "a tokio task: {in_task}");
        assert!(describe(on_thread).starts_with("thread") && describe(in_task).starts_with("tokio task"));
    }

    #[test]
    fn checks_differ_by_how_the_issuer_changed() {
        let (task5, task7, thread1) = (10, 14, 3);
        let len = |c: Check| c.buffer().len();
        assert_ne!(len(Check::new(1, task7, task5)), len(Check::new(1, task5, task7)), "later or earlier task");
        assert_eq!(Check::new(1, task7, task5), Check::new(1, 22, 20), "only the order of the two tasks counts");
        assert_ne!(len(Check::new(1, task5, thread1)), len(Check::new(1, thread1, task5)), "task to thread or back");
        assert_eq!(len(Check::new(1, task7, task5)), len(Check::new(9, task7, task5)), "the turn is data");
        let b = Check::new(3, thread1, task5).buffer();
        assert_eq!((&b.as_bytes()[..8], b.as_bytes()[8]), (&MAGIC[..], 3));
    }
}
