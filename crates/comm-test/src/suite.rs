//! The conformance suite every backend runs.
//!
//! [`run`] is called on every rank of a group with the same [`SuiteConfig`]; all ranks issue the
//! identical sequence of ops. Each rank regenerates every rank's inputs from
//! `(dtype, length, rank, salt)` with [`reference::input`] and checks its own outputs against
//! [`reference`](mod@crate::reference) byte for byte.
//!
//! A failed check does not stop the sequence (that would leave the other ranks waiting on a
//! collective this rank never issues); failures are collected and reported at the end.
//!
//! Coverage: every op × every dtype × every applicable reduce op × every length of
//! [`SuiteConfig::lengths`]; roots `0` and `world - 1`; the `_into` forms; all_to_all with equal
//! and uneven splits (zero-length blocks included); a large odd length for a subset; a send/recv
//! ring (one message over 1 MiB) and a batch of isends/irecvs to every peer; barriers; ops issued
//! back to back and awaited in reverse; a detached (dropped) `Work`; sub-groups (even ranks,
//! `[world - 1]`, and a nested one); and bad input that must fail with
//! [`CommError::InvalidArgument`] on every rank and leave the group usable.
//!
//! A backend runs it at several world sizes, e.g. one process per rank with the
//! [`multiprocess`](crate::multiprocess) harness:
//!
//! ```ignore
//! #[test]
//! fn conformance_4_ranks() {
//!     comm_test::multiprocess::run(4, "conformance_4_ranks", Duration::from_secs(300), || async {
//!         let backend: Arc<dyn Backend> = my_backend::init_from_env().await.map_err(|e| e.to_string())?;
//!         comm_test::suite::run(backend, &comm_test::SuiteConfig::default()).await.map(|_| ())
//!     });
//! }
//! ```
//!
//! or, for a backend whose ranks live in one process, [`run_all`] over every rank's handle.

use std::sync::Arc;
use std::time::{Duration, Instant};

use comm_core::ops::{
    AllGather, AllReduce, AllToAll, Barrier, Broadcast, Gather, RecvFrom, Reduce, ReduceScatter, Scatter,
    SendTo as SendOp,
};
use comm_core::{Backend, Collective, CommError, DType, HostBuffer, InOut, Op, Rank, ReduceOp, Work};
use futures::future::join_all;

use crate::reference;

/// The filled buffer of an op that hands back input and output.
fn output(io: InOut) -> HostBuffer {
    io.output
}

/// What the suite covers. Start from [`SuiteConfig::default`] (or [`SuiteConfig::quick`]) and
/// change fields.
#[non_exhaustive]
#[derive(Clone, Debug)]
pub struct SuiteConfig {
    /// Dtypes every op is tested with. Default: [`DType::ALL`].
    pub dtypes: Vec<DType>,
    /// Lengths every op × dtype × reduce op is tested with (per-rank block length for
    /// all_gather, reduce_scatter, all_to_all, scatter and gather). Default: `[0, 1, 7, 1000]`.
    pub lengths: Vec<usize>,
    /// A large (odd) length run for [`large_dtypes`](Self::large_dtypes) with `Sum` only;
    /// 0 skips it. Default: 100 003.
    pub large_len: usize,
    /// Dtypes used at [`large_len`](Self::large_len). Default: f32, bf16, i64.
    pub large_dtypes: Vec<DType>,
    /// Length in f32 elements of the large send/recv ring message (more than 1 MiB by
    /// default: 262 147); 0 skips it.
    pub p2p_large_len: usize,
    /// Seed of all generated data; change it to see different values.
    pub salt: u64,
    /// Run the bad-input part (every rank must get `InvalidArgument`).
    pub bad_input: bool,
    /// Run the sub-group part (`new_group`).
    pub sub_groups: bool,
    /// Count [`CommError::Unsupported`] results as skipped instead of failed (for backends that
    /// legitimately lack an op or dtype; every rank must then report it alike).
    pub allow_unsupported: bool,
}

impl Default for SuiteConfig {
    fn default() -> Self {
        SuiteConfig {
            dtypes: DType::ALL.to_vec(),
            lengths: vec![0, 1, 7, 1000],
            large_len: 100_003,
            large_dtypes: vec![DType::F32, DType::BF16, DType::I64],
            p2p_large_len: 262_147,
            salt: 0x5EED_C0FF_EE00_0001,
            bad_input: true,
            sub_groups: true,
            allow_unsupported: false,
        }
    }
}

impl SuiteConfig {
    /// A smaller run for quick feedback: lengths `[0, 1, 7, 100]`, no large length, a 1 MiB+
    /// p2p message still included.
    pub fn quick() -> Self {
        SuiteConfig { lengths: vec![0, 1, 7, 100], large_len: 0, ..Self::default() }
    }
}

/// What one rank's run of the suite did.
#[derive(Clone, Debug)]
pub struct SuiteReport {
    /// This rank.
    pub rank: Rank,
    /// The group size.
    pub world_size: u32,
    /// The backend's name.
    pub backend: &'static str,
    /// Checks that passed (outputs compared equal to the reference, expected errors seen).
    pub checks: usize,
    /// Checks skipped because the backend answered `Unsupported` (only with
    /// [`SuiteConfig::allow_unsupported`]).
    pub skipped: Vec<String>,
    /// How long the run took.
    pub elapsed: Duration,
}

/// Runs the conformance suite on this rank of `backend`'s group.
///
/// Every rank of the group must call it with the same `cfg`. Returns the report, or every
/// failure this rank saw (the first ones in full) as one message.
pub async fn run(backend: Arc<dyn Backend>, cfg: &SuiteConfig) -> Result<SuiteReport, String> {
    let start = Instant::now();
    let (me, n) = (backend.rank(), backend.world_size());
    if me >= n {
        return Err(format!("backend reports rank {me} in a group of {n} ranks"));
    }
    let mut r = Runner::new(backend.clone(), cfg, (0..n).collect(), String::new(), cfg.salt);
    r.full().await;
    let t = r.tally;
    let name = backend.backend_name();
    if t.failures.is_empty() {
        return Ok(SuiteReport {
            rank: me,
            world_size: n,
            backend: name,
            checks: t.passed,
            skipped: t.skipped,
            elapsed: start.elapsed(),
        });
    }
    let mut msg = format!(
        "conformance suite on backend `{name}`, rank {me} of {n}: {} check(s) failed, {} passed",
        t.failed, t.passed
    );
    for f in &t.failures {
        msg.push_str("\n  - ");
        msg.push_str(f);
    }
    if t.failed > t.failures.len() {
        msg.push_str(&format!("\n  ... and {} more", t.failed - t.failures.len()));
    }
    Err(msg)
}

/// Runs [`run`] on every handle of one process's group concurrently (in one task, so no
/// runtime is needed; the backend must progress ops without the caller's help) and returns
/// every rank's report, or all ranks' failures.
pub async fn run_all(backends: Vec<Arc<dyn Backend>>, cfg: &SuiteConfig) -> Result<Vec<SuiteReport>, String> {
    let results = join_all(backends.into_iter().map(|b| run(b, cfg))).await;
    let errors: Vec<String> = results.iter().filter_map(|r| r.as_ref().err().cloned()).collect();
    if errors.is_empty() {
        Ok(results.into_iter().map(|r| r.expect("no errors")).collect())
    } else {
        Err(errors.join("\n"))
    }
}

/// Issues `req` on `b`: the one place the suite names the `Collective<R>` trait.
fn submit<R: Op>(b: &Arc<dyn Backend>, req: R) -> Work<R::Output>
where
    dyn Backend: Collective<R>,
{
    Collective::<R>::submit(&**b, req)
}

fn refs(v: &[HostBuffer]) -> Vec<&HostBuffer> {
    v.iter().collect()
}

/// A buffer of recognisable junk (0xA5 bytes: finite, non-zero values in every dtype), so an
/// output a backend forgot to write never passes by accident.
fn junk(dtype: DType, len: usize) -> HostBuffer {
    HostBuffer::from_bytes(dtype, &vec![0xA5; len * dtype.size()]).expect("whole elements")
}

/// Uneven all_to_all block sizes: elements rank `i` sends to rank `j`, by pattern.
fn uneven(pattern: u8, len: usize, i: usize, j: usize) -> usize {
    match pattern {
        // Some zero blocks, others up to 2 × (len/3 + 1).
        0 => ((i + 2 * j + len) % 3) * (len / 3 + 1),
        // Nothing to itself, a different count to every other rank.
        1 => {
            if i == j {
                0
            } else {
                (i * 5 + j * 3 + len) % 7 + len / 2
            }
        }
        // Rank 0 sends nothing at all.
        _ => {
            if i == 0 {
                0
            } else {
                j + 1 + len
            }
        }
    }
}

const MAX_KEPT_FAILURES: usize = 20;

#[derive(Default)]
struct Tally {
    passed: usize,
    failed: usize,
    failures: Vec<String>,
    skipped: Vec<String>,
}

impl Tally {
    fn fail(&mut self, msg: String) {
        self.failed += 1;
        if self.failures.len() < MAX_KEPT_FAILURES {
            self.failures.push(msg);
        }
    }

    fn absorb(&mut self, other: Tally) {
        self.passed += other.passed;
        self.failed += other.failed;
        self.skipped.extend(other.skipped);
        let room = MAX_KEPT_FAILURES.saturating_sub(self.failures.len());
        self.failures.extend(other.failures.into_iter().take(room));
    }
}

/// The suite's state on one rank of one group.
struct Runner<'a> {
    b: Arc<dyn Backend>,
    cfg: &'a SuiteConfig,
    me: Rank,
    n: u32,
    /// The world rank of each group rank: inputs are generated per world rank, so a sub-group's
    /// results can only match when exactly its members contributed.
    members: Vec<Rank>,
    /// Prefix naming the group in messages ("" for the world).
    label: String,
    /// Cases run so far; every case gets its own salt. A sub-group has its own counter so the
    /// world's sequence stays the same on members and non-members.
    case: u64,
    salt: u64,
    tally: Tally,
}

impl<'a> Runner<'a> {
    fn new(b: Arc<dyn Backend>, cfg: &'a SuiteConfig, members: Vec<Rank>, label: String, salt: u64) -> Self {
        let (me, n) = (b.rank(), b.world_size());
        Runner { b, cfg, me, n, members, label, case: 0, salt, tally: Tally::default() }
    }

    fn next_salt(&mut self) -> u64 {
        self.case += 1;
        reference::mix(self.salt ^ self.case.wrapping_mul(0x2545_F491_4F6C_DD1D))
    }

    fn me(&self) -> usize {
        self.me as usize
    }

    fn roots(&self) -> Vec<Rank> {
        if self.n == 1 {
            vec![0]
        } else {
            vec![0, self.n - 1]
        }
    }

    /// Every group rank's input for a case (index = group rank).
    fn inputs(&self, op: ReduceOp, d: DType, len: usize, salt: u64) -> Vec<HostBuffer> {
        self.members.iter().map(|&w| reference::input_for(op, d, len, w, salt)).collect()
    }

    fn what(&self, what: &str) -> String {
        format!("{}{what}", self.label)
    }

    fn error(&mut self, what: &str, e: CommError) {
        let what = self.what(what);
        if self.cfg.allow_unsupported && matches!(e, CommError::Unsupported { .. }) {
            self.tally.skipped.push(format!("{what}: {e}"));
        } else {
            self.tally.fail(format!("{what}, rank {}: the op failed: {e}", self.me));
        }
    }

    fn check(&mut self, what: &str, got: Result<HostBuffer, CommError>, want: &HostBuffer) {
        match got {
            Ok(buf) => match reference::compare(&buf, want, &self.what(what), self.me) {
                Ok(()) => self.tally.passed += 1,
                Err(e) => self.tally.fail(e),
            },
            Err(e) => self.error(what, e),
        }
    }

    /// An op that reads one buffer and fills another: `output` as wanted, and `input` handed back
    /// unchanged.
    fn check_io(&mut self, what: &str, got: Result<InOut, CommError>, input: &HostBuffer, want: &HostBuffer) {
        match got {
            Ok(io) => {
                let r = reference::compare(&io.output, want, &self.what(what), self.me).and_then(|()| {
                    reference::compare(&io.input, input, &self.what(&format!("{what}: its input handed back")), self.me)
                });
                match r {
                    Ok(()) => self.tally.passed += 1,
                    Err(e) => self.tally.fail(e),
                }
            }
            Err(e) => self.error(what, e),
        }
    }

    fn check_ok<T>(&mut self, what: &str, got: Result<T, CommError>) -> Option<T> {
        match got {
            Ok(v) => {
                self.tally.passed += 1;
                Some(v)
            }
            Err(e) => {
                self.error(what, e);
                None
            }
        }
    }

    fn check_invalid<T>(&mut self, what: &str, got: Result<T, CommError>) {
        match got {
            Err(CommError::InvalidArgument { .. }) => self.tally.passed += 1,
            Err(e) => {
                let msg = format!("{}, rank {}: expected InvalidArgument, got: {e}", self.what(what), self.me);
                self.tally.fail(msg);
            }
            Ok(_) => {
                let msg =
                    format!("{}, rank {}: expected InvalidArgument, but the op succeeded", self.what(what), self.me);
                self.tally.fail(msg);
            }
        }
    }

    // ---- the parts -------------------------------------------------------------------------

    async fn full(&mut self) {
        let cfg = self.cfg;
        for &d in &cfg.dtypes {
            for &len in &cfg.lengths {
                self.every_collective(d, len).await;
            }
        }
        if cfg.large_len > 0 {
            for &d in &cfg.large_dtypes {
                self.large(d, cfg.large_len).await;
            }
        }
        if self.n >= 2 {
            for &d in &cfg.dtypes {
                for &len in &cfg.lengths {
                    self.ring(d, len).await;
                }
            }
            if cfg.p2p_large_len > 0 {
                self.ring(DType::F32, cfg.p2p_large_len).await;
            }
            for &d in &cfg.dtypes {
                self.p2p_batch(d, 7).await;
            }
            self.p2p_batch(DType::F32, 1000).await;
        }
        for _ in 0..3 {
            self.barrier().await;
        }
        self.back_to_back().await;
        if cfg.bad_input {
            self.bad_input().await;
        }
        if cfg.sub_groups {
            self.sub_groups().await;
        }
        self.barrier().await;
    }

    async fn every_collective(&mut self, d: DType, len: usize) {
        let ops: Vec<ReduceOp> = ReduceOp::ALL.into_iter().filter(|op| op.applies_to(d)).collect();
        for &op in &ops {
            self.all_reduce(d, len, op).await;
        }
        for root in self.roots() {
            self.broadcast(d, len, root).await;
            for &op in &ops {
                self.reduce(d, len, op, root).await;
            }
        }
        self.all_gather(d, len, false).await;
        self.all_gather(d, len, true).await;
        for &op in &ops {
            self.reduce_scatter(d, len, op, false).await;
        }
        self.reduce_scatter(d, len, ReduceOp::Sum, true).await;
        self.all_to_all_equal(d, len, false).await;
        self.all_to_all_equal(d, len, true).await;
        self.all_to_all_uneven(d, len, 0, false).await;
        self.all_to_all_uneven(d, len, 1, true).await;
        self.all_to_all_uneven(d, len, 2, false).await;
        for root in self.roots() {
            self.scatter(d, len, root).await;
            self.gather(d, len, root, false).await;
            self.gather(d, len, root, true).await;
        }
    }

    async fn large(&mut self, d: DType, len: usize) {
        let last = self.n - 1;
        self.all_reduce(d, len, ReduceOp::Sum).await;
        self.broadcast(d, len, last).await;
        self.reduce(d, len, ReduceOp::Sum, 0).await;
        self.all_gather(d, len, true).await;
        self.reduce_scatter(d, len, ReduceOp::Sum, false).await;
        self.all_to_all_equal(d, len, false).await;
        self.all_to_all_uneven(d, len, 0, true).await;
        self.scatter(d, len, last).await;
        self.gather(d, len, 0, true).await;
    }

    /// The reduced set run on sub-groups.
    async fn reduced(&mut self) {
        let last = self.n - 1;
        for d in [DType::F32, DType::I32, DType::BF16] {
            for len in [7, 1000] {
                self.all_reduce(d, len, ReduceOp::Sum).await;
                self.all_reduce(d, len, ReduceOp::Max).await;
                self.broadcast(d, len, last).await;
                self.reduce(d, len, ReduceOp::Sum, 0).await;
                self.all_gather(d, len, false).await;
                self.reduce_scatter(d, len, ReduceOp::Sum, true).await;
                self.all_to_all_equal(d, len, true).await;
                self.all_to_all_uneven(d, len, 0, false).await;
                self.scatter(d, len, last).await;
                self.gather(d, len, 0, true).await;
            }
        }
        self.barrier().await;
        if self.n >= 2 {
            self.ring(DType::F32, 7).await;
            self.p2p_batch(DType::I64, 7).await;
        }
    }

    // ---- one case each -----------------------------------------------------------------------

    async fn all_reduce(&mut self, d: DType, len: usize, op: ReduceOp) {
        let salt = self.next_salt();
        let ins = self.inputs(op, d, len, salt);
        let want = reference::reduce(&refs(&ins), op);
        let got = submit(&self.b, AllReduce { buf: ins[self.me()].clone(), op }).await;
        self.check(&format!("all_reduce({op}) {d} × {len}"), got, &want);
    }

    async fn broadcast(&mut self, d: DType, len: usize, root: Rank) {
        let salt = self.next_salt();
        let ins = self.inputs(ReduceOp::Sum, d, len, salt);
        let want = reference::broadcast(&refs(&ins), root).swap_remove(self.me());
        let got = submit(&self.b, Broadcast { buf: ins[self.me()].clone(), root }).await;
        self.check(&format!("broadcast(root {root}) {d} × {len}"), got, &want);
    }

    async fn reduce(&mut self, d: DType, len: usize, op: ReduceOp, root: Rank) {
        let salt = self.next_salt();
        let ins = self.inputs(op, d, len, salt);
        let want = reference::reduce_to_root(&refs(&ins), op, root).swap_remove(self.me());
        let got = submit(&self.b, Reduce { buf: ins[self.me()].clone(), op, root }).await;
        self.check(&format!("reduce({op}, root {root}) {d} × {len}"), got, &want);
    }

    async fn all_gather(&mut self, d: DType, len: usize, into: bool) {
        let salt = self.next_salt();
        let ins = self.inputs(ReduceOp::Sum, d, len, salt);
        let want = reference::concat(&refs(&ins));
        let output = into.then(|| junk(d, len * self.n as usize));
        let got = submit(&self.b, AllGather { input: ins[self.me()].clone(), output }).await;
        let what = format!("all_gather{} {d} × {len}", if into { "_into" } else { "" });
        self.check_io(&what, got, &ins[self.me()], &want);
    }

    async fn reduce_scatter(&mut self, d: DType, len: usize, op: ReduceOp, into: bool) {
        let salt = self.next_salt();
        let ins = self.inputs(op, d, len * self.n as usize, salt);
        let want = reference::reduce_scatter(&refs(&ins), op).swap_remove(self.me());
        let output = into.then(|| junk(d, len));
        let got = submit(&self.b, ReduceScatter { input: ins[self.me()].clone(), op, output }).await;
        let into = if into { "_into" } else { "" };
        self.check_io(&format!("reduce_scatter{into}({op}) {d} × {len} per rank"), got, &ins[self.me()], &want);
    }

    async fn all_to_all_equal(&mut self, d: DType, len: usize, into: bool) {
        let salt = self.next_salt();
        let ins = self.inputs(ReduceOp::Sum, d, len * self.n as usize, salt);
        let want = reference::all_to_all_equal(&refs(&ins)).swap_remove(self.me());
        let output = into.then(|| junk(d, len * self.n as usize));
        let req = AllToAll { input: ins[self.me()].clone(), output, input_splits: None, output_splits: None };
        let got = submit(&self.b, req).await;
        let into = if into { " into an output buffer" } else { "" };
        self.check_io(&format!("all_to_all (equal splits{into}) {d} × {len} per peer"), got, &ins[self.me()], &want);
    }

    async fn all_to_all_uneven(&mut self, d: DType, len: usize, pattern: u8, into: bool) {
        let salt = self.next_salt();
        let n = self.n as usize;
        let splits: Vec<Vec<usize>> = (0..n).map(|i| (0..n).map(|j| uneven(pattern, len, i, j)).collect()).collect();
        let ins: Vec<HostBuffer> =
            (0..n).map(|i| reference::input(d, splits[i].iter().sum(), self.members[i], salt)).collect();
        let want = reference::all_to_all(&refs(&ins), &splits).swap_remove(self.me());
        let out_splits: Vec<usize> = (0..n).map(|i| splits[i][self.me()]).collect();
        let output = into.then(|| junk(d, out_splits.iter().sum()));
        let req = AllToAll {
            input: ins[self.me()].clone(),
            output,
            input_splits: Some(splits[self.me()].clone()),
            output_splits: Some(out_splits),
        };
        let got = submit(&self.b, req).await;
        let into = if into { " into an output buffer" } else { "" };
        self.check_io(&format!("all_to_all (uneven splits {splits:?}{into}) {d}"), got, &ins[self.me()], &want);
    }

    async fn scatter(&mut self, d: DType, len: usize, root: Rank) {
        let salt = self.next_salt();
        let all = reference::input(d, len * self.n as usize, self.members[root as usize], salt);
        let want = reference::scatter(&all, self.n).swap_remove(self.me());
        let input = if self.me == root { all } else { HostBuffer::zeroed(d, 0) };
        let req = Scatter { output: junk(d, len), input: (self.me == root).then(|| input.clone()), root };
        let got = submit(&self.b, req).await;
        self.check_io(&format!("scatter(root {root}) {d} × {len} per rank"), got, &input, &want);
    }

    async fn gather(&mut self, d: DType, len: usize, root: Rank, into: bool) {
        let salt = self.next_salt();
        let ins = self.inputs(ReduceOp::Sum, d, len, salt);
        let want = reference::gather(&refs(&ins), root).swap_remove(self.me());
        let output = (into && self.me == root).then(|| junk(d, len * self.n as usize));
        let got = submit(&self.b, Gather { input: ins[self.me()].clone(), output, root }).await;
        let into = if into { "_into" } else { "" };
        self.check_io(&format!("gather{into}(root {root}) {d} × {len} per rank"), got, &ins[self.me()], &want);
    }

    /// Rank r sends to r+1 and receives from r-1; the send is issued first on every rank and
    /// both eager works are awaited together.
    async fn ring(&mut self, d: DType, len: usize) {
        let salt = self.next_salt();
        let tag = (self.case % 1000) as u32;
        let (me, n) = (self.me, self.n);
        let (next, prev) = ((me + 1) % n, (me + n - 1) % n);
        let mine = reference::input(d, len, self.members[me as usize], salt);
        let from_prev = reference::input(d, len, self.members[prev as usize], salt);
        let s = submit(&self.b, SendOp { buf: mine.clone(), dst: next, tag });
        let r = submit(&self.b, RecvFrom { buf: junk(d, len), src: prev, tag });
        let (s, r) = futures::future::join(s, r).await;
        self.check(&format!("ring send to rank {next} (buffer handed back) {d} × {len}"), s, &mine);
        self.check(&format!("ring recv from rank {prev} {d} × {len}"), r, &from_prev);
    }

    /// Two messages (tags 100 and 101, different lengths) to and from every peer, all issued
    /// before any is awaited; messages between a pair arrive in order.
    async fn p2p_batch(&mut self, d: DType, len: usize) {
        let salt = self.next_salt();
        let n = self.n;
        let me = self.me;
        let msg =
            |src: Rank, dst: Rank, k: u32| reference::input(d, len + 3 * k as usize, (src * n + dst) * 2 + k, salt);
        let mut works = Vec::new();
        for peer in (0..n).filter(|&p| p != me) {
            for k in 0..2 {
                let sent = msg(me, peer, k);
                let s = submit(&self.b, SendOp { buf: sent.clone(), dst: peer, tag: 100 + k });
                works.push((format!("batched send #{k} to rank {peer} {d}"), s, sent));
                let r = submit(&self.b, RecvFrom { buf: junk(d, len + 3 * k as usize), src: peer, tag: 100 + k });
                works.push((format!("batched recv #{k} from rank {peer} {d}"), r, msg(peer, me, k)));
            }
        }
        let (names, (works, wants)): (Vec<_>, (Vec<_>, Vec<_>)) =
            works.into_iter().map(|(a, b, c)| (a, (b, c))).unzip();
        let results = join_all(works).await;
        for ((name, got), want) in names.iter().zip(results).zip(&wants) {
            self.check(name, got, want);
        }
    }

    async fn barrier(&mut self) {
        let got = submit(&self.b, Barrier).await;
        self.check_ok("barrier", got);
    }

    /// Several ops issued without awaiting in between, awaited in reverse order; plus a dropped
    /// (detached) work that must still complete without disturbing later ops.
    async fn back_to_back(&mut self) {
        let me = self.me();
        let last = self.n - 1;
        let n = self.n as usize;
        let mut pending: Vec<(String, Work<HostBuffer>, HostBuffer)> = Vec::new();

        let s = self.next_salt();
        let ins = self.inputs(ReduceOp::Sum, DType::F32, 1000, s);
        let want = reference::reduce(&refs(&ins), ReduceOp::Sum);
        pending.push((
            "all_reduce(sum) f32".into(),
            submit(&self.b, AllReduce { buf: ins[me].clone(), op: ReduceOp::Sum }),
            want,
        ));

        let s = self.next_salt();
        let ins = self.inputs(ReduceOp::Sum, DType::I64, 33, s);
        let want = ins[last as usize].clone();
        pending.push(("broadcast i64".into(), submit(&self.b, Broadcast { buf: ins[me].clone(), root: last }), want));

        let s = self.next_salt();
        let ins = self.inputs(ReduceOp::Sum, DType::BF16, 7, s);
        let want = reference::concat(&refs(&ins));
        pending.push((
            "all_gather bf16".into(),
            submit(&self.b, AllGather { input: ins[me].clone(), output: None }).map(output),
            want,
        ));

        let s = self.next_salt();
        let ins = self.inputs(ReduceOp::Max, DType::F64, 5 * n, s);
        let want = reference::reduce_scatter(&refs(&ins), ReduceOp::Max).swap_remove(me);
        let req = ReduceScatter { input: ins[me].clone(), op: ReduceOp::Max, output: None };
        pending.push(("reduce_scatter(max) f64".into(), submit(&self.b, req).map(output), want));

        let barrier = submit(&self.b, Barrier);

        let s = self.next_salt();
        let ins = self.inputs(ReduceOp::Sum, DType::U8, 3 * n, s);
        let want = reference::all_to_all_equal(&refs(&ins)).swap_remove(me);
        let req = AllToAll { input: ins[me].clone(), output: None, input_splits: None, output_splits: None };
        pending.push(("all_to_all u8".into(), submit(&self.b, req).map(output), want));

        let s = self.next_salt();
        let ins = self.inputs(ReduceOp::BXor, DType::I8, 9, s);
        let want = reference::reduce(&refs(&ins), ReduceOp::BXor);
        pending.push((
            "all_reduce(bxor) i8".into(),
            submit(&self.b, AllReduce { buf: ins[me].clone(), op: ReduceOp::BXor }),
            want,
        ));

        let s = self.next_salt();
        let ins = self.inputs(ReduceOp::Sum, DType::F16, 4, s);
        let want = reference::gather(&refs(&ins), 0).swap_remove(me);
        let req = Gather { input: ins[me].clone(), output: None, root: 0 };
        pending.push(("gather f16".into(), submit(&self.b, req).map(output), want));

        // Detached: dropping the work must not cancel the op or upset the next one.
        let s = self.next_salt();
        let ins = self.inputs(ReduceOp::Sum, DType::I32, 5, s);
        drop(submit(&self.b, AllReduce { buf: ins[me].clone(), op: ReduceOp::Sum }));
        let s = self.next_salt();
        let ins = self.inputs(ReduceOp::Sum, DType::I32, 5, s);
        let want = reference::reduce(&refs(&ins), ReduceOp::Sum);
        let req = AllReduce { buf: ins[me].clone(), op: ReduceOp::Sum };
        pending.push(("all_reduce(sum) i32 after a detached op".into(), submit(&self.b, req), want));

        let mut rest = pending.split_off(5);
        while let Some((what, w, want)) = rest.pop() {
            let got = w.await;
            self.check(&format!("back-to-back {what}"), got, &want);
        }
        let got = barrier.await;
        self.check_ok("back-to-back barrier", got);
        while let Some((what, w, want)) = pending.pop() {
            let got = w.await;
            self.check(&format!("back-to-back {what}"), got, &want);
        }
    }

    /// Bad input on every rank must give `InvalidArgument` everywhere and leave the group usable.
    async fn bad_input(&mut self) {
        let n = self.n;
        let nu = n as usize;
        let me = self.me;
        let f32s = |len: usize| junk(DType::F32, len);
        let b = self.b.clone();

        let got = submit(&b, Broadcast { buf: f32s(3), root: n }).await;
        self.check_invalid("broadcast with root = world size", got);
        let got = submit(&b, Reduce { buf: f32s(3), op: ReduceOp::Sum, root: n + 5 }).await;
        self.check_invalid("reduce with root > world size", got);
        let got = submit(&b, Scatter { output: f32s(3), input: Some(f32s(3 * nu)), root: n }).await;
        self.check_invalid("scatter with root = world size", got);
        let got = submit(&b, Gather { input: f32s(3), output: None, root: n }).await;
        self.check_invalid("gather with root = world size", got);
        if n > 1 {
            let got = submit(&b, ReduceScatter { input: f32s(2 * nu + 1), op: ReduceOp::Sum, output: None }).await;
            self.check_invalid("reduce_scatter with a length not divisible by the world size", got);
        }
        for (d, op) in [(DType::F32, ReduceOp::BXor), (DType::BF16, ReduceOp::BAnd), (DType::I32, ReduceOp::Avg)] {
            let got = submit(&b, AllReduce { buf: junk(d, 4), op }).await;
            self.check_invalid(&format!("all_reduce({op}) on {d}"), got);
        }
        let got = submit(&b, Reduce { buf: junk(DType::F64, 4), op: ReduceOp::BOr, root: 0 }).await;
        self.check_invalid("reduce(bor) on f64", got);
        for (d, op) in [(DType::F16, ReduceOp::BXor), (DType::U8, ReduceOp::Avg)] {
            let got = submit(&b, ReduceScatter { input: junk(d, nu), op, output: None }).await;
            self.check_invalid(&format!("reduce_scatter({op}) on {d}"), got);
        }
        let req = AllToAll {
            input: f32s(4 * nu),
            output: None,
            input_splits: Some(vec![1; nu]),
            output_splits: Some(vec![1; nu]),
        };
        self.check_invalid("all_to_all with input_splits not summing to the input length", submit(&b, req).await);
        let req = AllToAll { input: f32s(nu), output: None, input_splits: Some(vec![1; nu]), output_splits: None };
        self.check_invalid("all_to_all with input_splits but no output size", submit(&b, req).await);
        let got = submit(&b, SendOp { buf: f32s(2), dst: me, tag: 0 }).await;
        self.check_invalid("send to itself", got);
        let got = submit(&b, SendOp { buf: f32s(2), dst: n, tag: 0 }).await;
        self.check_invalid("send to a rank out of range", got);
        let got = submit(&b, RecvFrom { buf: f32s(2), src: me, tag: 0 }).await;
        self.check_invalid("recv from itself", got);
        let got = submit(&b, RecvFrom { buf: f32s(2), src: n + 1, tag: 0 }).await;
        self.check_invalid("recv from a rank out of range", got);
        let got = submit(&b, AllGather { input: f32s(3), output: Some(junk(DType::F64, 3 * nu)) }).await;
        self.check_invalid("all_gather_into an output of the wrong dtype", got);
        let got = submit(&b, AllGather { input: f32s(3), output: Some(f32s(3 * nu + 1)) }).await;
        self.check_invalid("all_gather_into an output of the wrong length", got);
        let req = ReduceScatter { input: f32s(3 * nu), op: ReduceOp::Sum, output: Some(junk(DType::I32, 3)) };
        self.check_invalid("reduce_scatter_into an output of the wrong dtype", submit(&b, req).await);
        let req = ReduceScatter { input: f32s(3 * nu), op: ReduceOp::Sum, output: Some(f32s(4)) };
        self.check_invalid("reduce_scatter_into an output of the wrong length", submit(&b, req).await);
        let req = AllToAll {
            input: f32s(3 * nu),
            output: Some(junk(DType::F64, 3 * nu)),
            input_splits: None,
            output_splits: None,
        };
        self.check_invalid("all_to_all into an output of the wrong dtype", submit(&b, req).await);
        let req = AllToAll {
            input: f32s(3 * nu),
            output: Some(f32s(3 * nu + 1)),
            input_splits: Some(vec![3; nu]),
            output_splits: Some(vec![3; nu]),
        };
        self.check_invalid("all_to_all into an output of the wrong length", submit(&b, req).await);

        // The group must still work.
        self.all_reduce(DType::F32, 7, ReduceOp::Sum).await;
        self.barrier().await;
    }

    /// Checks a `new_group(ranks)` result: members get a group where they are rank
    /// `ranks.index(me)` of `ranks.len()`, the others get `None`.
    fn membership(
        &mut self,
        ranks: &[Rank],
        got: Result<Option<Arc<dyn Backend>>, CommError>,
    ) -> Option<Arc<dyn Backend>> {
        let what = format!("new_group({ranks:?})");
        let got = self.check_ok(&what, got)?;
        let pos = ranks.iter().position(|&r| r == self.me);
        match (pos, got) {
            (None, None) => None,
            (Some(i), Some(g)) => {
                if g.rank() as usize == i && g.world_size() as usize == ranks.len() {
                    self.tally.passed += 1;
                    Some(g)
                } else {
                    let msg = format!(
                        "{}, rank {}: the new group says rank {} of {}, expected {i} of {}",
                        self.what(&what),
                        self.me,
                        g.rank(),
                        g.world_size(),
                        ranks.len()
                    );
                    self.tally.fail(msg);
                    None
                }
            }
            (None, Some(_)) => {
                let msg = format!("{}, rank {}: a non-member got a group", self.what(&what), self.me);
                self.tally.fail(msg);
                None
            }
            (Some(_), None) => {
                let msg = format!("{}, rank {}: a member got None", self.what(&what), self.me);
                self.tally.fail(msg);
                None
            }
        }
    }

    fn sub_runner(&self, g: Arc<dyn Backend>, ranks: &[Rank], label: &str) -> Runner<'a> {
        let members = ranks.iter().map(|&r| self.members[r as usize]).collect::<Vec<_>>();
        let label = format!("{}[{label}: world ranks {members:?}] ", self.label);
        let salt = reference::mix(self.salt ^ reference::mix(members.len() as u64 ^ u64::from(members[0]) << 20));
        Runner::new(g, self.cfg, members, label, salt)
    }

    async fn sub_groups(&mut self) {
        let n = self.n;
        let evens: Vec<Rank> = (0..n).step_by(2).collect();
        let got = self.b.new_group(&evens).await;
        if let Some(g) = self.membership(&evens, got) {
            let mut sub = self.sub_runner(g, &evens, "even ranks");
            sub.reduced().await;
            // A sub-group of a sub-group: its last rank alone.
            let nested = [sub.n - 1];
            let got = sub.b.new_group(&nested).await;
            if let Some(g) = sub.membership(&nested, got) {
                let mut inner = sub.sub_runner(g, &nested, "last even rank");
                inner.all_reduce(DType::F32, 7, ReduceOp::Sum).await;
                inner.all_gather(DType::I64, 5, true).await;
                inner.barrier().await;
                sub.tally.absorb(inner.tally);
            }
            self.tally.absorb(sub.tally);
        }
        // The parent group keeps working, whatever its members did on the sub-group.
        self.all_reduce(DType::F32, 7, ReduceOp::Sum).await;

        let last = [n - 1];
        let got = self.b.new_group(&last).await;
        if let Some(g) = self.membership(&last, got) {
            let mut sub = self.sub_runner(g, &last, "last rank");
            sub.reduced().await;
            self.tally.absorb(sub.tally);
        }
        self.all_reduce(DType::I32, 7, ReduceOp::Sum).await;
        self.barrier().await;
    }
}
