//! The conformance suite every backend runs.
//!
//! [`run`] is called on every rank of a group with the same [`SuiteConfig`]; all ranks issue the
//! identical sequence of ops. Each rank regenerates every rank's inputs from
//! `(dtype, length, rank, salt)` with [`reference::input`](crate::reference::input) and checks
//! its own outputs against [`reference`](mod@crate::reference) byte for byte.
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
//! [`CommError::InvalidArgument`](comm_core::CommError::InvalidArgument) on every rank and leave
//! the group usable.
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

use comm_core::{Backend, DType, Rank, ReduceOp};
use futures::future::join_all;

mod cases;
mod runner;
mod scenarios;

use runner::Runner;

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
    /// Count [`CommError::Unsupported`](comm_core::CommError::Unsupported) results as skipped
    /// instead of failed (for backends that legitimately lack an op or dtype; every rank must then
    /// report it alike).
    pub allow_unsupported: bool,
    /// For a backend that reduces per host first (`hier`): the world's ranks by host, hosts in
    /// the order their results are combined. Reductions of the whole group are then checked
    /// against [`reference::reduce_grouped`](crate::reference::reduce_grouped). Default: `None`
    /// (rank order).
    pub hosts: Option<Vec<Vec<Rank>>>,
}

impl SuiteConfig {
    /// For many ranks on few cores (8 or 16 processes on 2): three dtypes (f32, bf16, i64),
    /// the usual lengths, one large f32 length and a shorter large message; every op, the
    /// bad-input and the sub-group parts as by default.
    pub fn many_ranks() -> Self {
        SuiteConfig {
            dtypes: vec![DType::F32, DType::BF16, DType::I64],
            large_len: 20_011,
            large_dtypes: vec![DType::F32],
            p2p_large_len: 70_001,
            ..SuiteConfig::default()
        }
    }

    /// [`many_ranks`](Self::many_ranks) when `COMM_TEST_SUITE=many` (how a parent test asks
    /// the ranks it launches for it), else the default.
    pub fn from_env() -> Self {
        match std::env::var("COMM_TEST_SUITE").as_deref() {
            Ok("many") => SuiteConfig::many_ranks(),
            _ => SuiteConfig::default(),
        }
    }
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
            hosts: None,
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
    r.hosts = cfg.hosts.clone();
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

impl Runner<'_> {
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
}
