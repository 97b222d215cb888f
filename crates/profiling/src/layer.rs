//! [`ProfilingLayer`] and [`Profiling<C>`]: one `tracing` span per op.

use std::cell::Cell;
use std::fmt;
use std::sync::Arc;

use async_trait::async_trait;
use comm_core::elastic::Shrunk;
use comm_core::{Backend, Collective, CommError, Completion, DType, Group, HostBuffer, Op, Rank, Work};
use tracing::field::Empty;
use tracing::{Instrument, Span};

use crate::timeline::{Meta, Seq};
use crate::{CommsLogger, Timeline, TARGET};

/// Wraps a backend (or any [`Collective`]) in [`Profiling`], tower-style: `layer.layer(inner)`.
///
/// ```
/// use comm_core::{Backend, Group};
/// use profiling::ProfilingLayer;
/// let ranks = comm_test::LocalWorld::new(1);
/// let profiled = ProfilingLayer::new().layer(ranks[0].clone()); // Profiling<Arc<dyn Backend>>
/// assert_eq!(profiled.world_size(), 1);
/// ```
#[derive(Clone, Debug, Default)]
pub struct ProfilingLayer {
    world: Option<(Rank, u32)>,
    logger: Option<CommsLogger>,
    timeline: Option<Timeline>,
}

/// Equal when they record the same way: same world and the same logger (clones included).
impl PartialEq for ProfilingLayer {
    fn eq(&self, other: &Self) -> bool {
        self.world == other.world
            && self.logger.as_ref().map(CommsLogger::id) == other.logger.as_ref().map(CommsLogger::id)
            && self.timeline.as_ref().map(Timeline::id) == other.timeline.as_ref().map(Timeline::id)
    }
}

impl ProfilingLayer {
    /// A layer whose spans take `comm.rank` / `comm.world_size` from the group it wraps
    /// (wrap the world group, as `comm-api` does, and they are the global values).
    pub const fn new() -> Self {
        ProfilingLayer { world: None, logger: None, timeline: None }
    }

    /// Sets the process's global rank and world size recorded on every span (for a layer that
    /// wraps a sub-group directly).
    pub const fn with_world(mut self, rank: Rank, world_size: u32) -> Self {
        self.world = Some((rank, world_size));
        self
    }

    /// Records every op into `logger` directly — the fast way to keep a [`CommsLogger`]
    /// summary: a few nanoseconds per op instead of a subscriber's span bookkeeping (about
    /// 0.3 µs), and no `tracing` subscriber needed. Spans are still opened for subscribers
    /// that want them (e.g. OpenTelemetry); if `logger` is also installed as a subscriber
    /// layer it leaves these ops' spans alone (no double count).
    ///
    /// ```
    /// # tokio::runtime::Runtime::new().unwrap().block_on(async {
    /// use comm_core::{ops::AllReduce, Collective, DType, HostBuffer, ReduceOp};
    /// use profiling::{CommsLogger, ProfilingLayer};
    /// let logger = CommsLogger::default();
    /// let rank = ProfilingLayer::new().with_logger(logger.clone()).layer(comm_test::LocalWorld::new(1).remove(0));
    /// for _ in 0..3 {
    ///     rank.submit(AllReduce { buf: HostBuffer::zeroed(DType::F32, 256), op: ReduceOp::Sum }).await.unwrap();
    /// }
    /// assert_eq!(logger.summary().rows[0].count, 3);
    /// # });
    /// ```
    pub fn with_logger(mut self, logger: CommsLogger) -> Self {
        self.logger = Some(logger);
        self
    }

    /// Records every op (of this group and the groups made from it) into `timeline`: its
    /// submission and completion times, for a per-rank trace (see [`Timeline`]).
    pub fn with_timeline(mut self, timeline: Timeline) -> Self {
        self.timeline = Some(timeline);
        self
    }

    /// Wraps `inner`.
    pub fn layer<C: Group>(&self, inner: C) -> Profiling<C> {
        let (rank, world_size) = self.world.unwrap_or_else(|| (inner.rank(), inner.world_size()));
        let group_size = inner.world_size();
        let timeline = self.timeline.clone().map(|t| (t, Arc::new(Seq::default())));
        Profiling { inner, rank, world_size, group_size, logger: self.logger.clone(), timeline }
    }
}

/// A [`Collective`] that opens a span `comm.<op>` (target [`TARGET`]) for every op of the
/// backend it wraps and closes it when the op completes.
///
/// **Span fields.** `comm.op` (`"all_reduce"`), `comm.bytes` ([`Op::bytes`]), `comm.dtype`
/// (absent for barrier), `comm.rank` and `comm.world_size` (the process in the job),
/// `comm.group_rank` and `comm.group_size` (in the group the op ran on: the `n` of the
/// bandwidth formulas), `comm.backend`, `otel.name` (= the span name) and `otel.kind`
/// (`client`: the op waits on remote peers, like a database call). Filled in at the end when
/// they apply: `comm.detached = true`, `otel.status_code = "ERROR"` and
/// `otel.status_description` (the error).
///
/// **When the span ends.** At the op's true completion, observed through
/// [`Work::on_complete`]: on the submitting thread for ops the backend finishes inline, on
/// the thread that completes the op otherwise (the backend's worker). Nothing waits or
/// synchronises to measure, and the end does not depend on when (or whether) the caller
/// awaits: an `all_gather` overlapped with compute is measured as the transfer, not as the
/// compute; a dropped (detached) `Work` still ends its span when the op finishes, with
/// `comm.detached = true`. The span is entered while the op is submitted, so spans and events
/// of inner layers and backends nest under it, and its parent is the caller's current span.
///
/// With [`ProfilingLayer::with_logger`], the op is also recorded straight into that
/// [`CommsLogger`] (`comm.logger` on the span names it, so the logger skips the span).
///
/// **Cost.** When no subscriber wants these spans the layer costs one relaxed load per op
/// (the callsite's interest) and forwards the op untouched: no allocation, no formatting.
/// When one does, it costs the subscriber's span bookkeeping plus one small allocation (the
/// completion hook) for ops that do not complete inline. A directly attached logger costs a
/// per-thread cache lookup and a plain store per op (no locked instruction), plus two clock
/// reads and a short lock for timed calls.
#[derive(Clone, Debug)]
pub struct Profiling<C> {
    inner: C,
    rank: Rank,
    world_size: u32,
    /// `inner.world_size()`, kept: asking costs a dynamic call on every op.
    group_size: u32,
    logger: Option<CommsLogger>,
    /// The timeline and this group's op counter.
    timeline: Option<(Timeline, Arc<Seq>)>,
}

impl<C> Profiling<C> {
    /// The wrapped collective.
    pub fn get_ref(&self) -> &C {
        &self.inner
    }

    /// The wrapped collective, mutably.
    pub fn get_mut(&mut self) -> &mut C {
        &mut self.inner
    }

    /// Unwraps.
    pub fn into_inner(self) -> C {
        self.inner
    }
}

thread_local! {
    static SUPPRESSED: Cell<bool> = const { Cell::new(false) };
    static LABEL: Cell<Option<(&'static str, u64)>> = const { Cell::new(None) };
}

/// Runs `f` with the ops it *submits* on this thread recorded as op `op` of `bytes` bytes (span
/// `comm.op`, summary row, timeline slice) instead of as themselves: an op composed of others
/// (the facade's object collectives) shows as one row of its own by labelling its main op
/// this way and submitting the rest under [`without_profiling`].
pub fn recorded_as<T>(op: &'static str, bytes: u64, f: impl FnOnce() -> T) -> T {
    struct Restore(Option<(&'static str, u64)>);
    impl Drop for Restore {
        fn drop(&mut self) {
            LABEL.with(|l| l.set(self.0));
        }
    }
    let _restore = Restore(LABEL.with(|l| l.replace(Some((op, bytes)))));
    f()
}

/// Runs `f` with profiling off for the ops it *submits* on this thread (their spans are not
/// created; ops submitted elsewhere meanwhile are profiled as usual). The summary's own
/// exchanges use it so they do not appear in the summary, like DeepSpeed's
/// `log_summary_barrier` row does.
///
/// Ops are eager, so wrapping the call that returns the `Work` is enough:
/// `let w = without_profiling(|| pg.barrier()); w.await?;`.
pub fn without_profiling<T>(f: impl FnOnce() -> T) -> T {
    struct Restore(bool);
    impl Drop for Restore {
        fn drop(&mut self) {
            SUPPRESSED.with(|s| s.set(self.0));
        }
    }
    let _restore = Restore(SUPPRESSED.with(|s| s.replace(true)));
    f()
}

/// The ops with a span name of their own; others share the callsite `comm.op`.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Known {
    AllReduce,
    Broadcast,
    Reduce,
    AllGather,
    ReduceScatter,
    AllToAll,
    Scatter,
    Gather,
    Send,
    Recv,
    Barrier,
    Other,
}

const fn str_eq(a: &str, b: &str) -> bool {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    if a.len() != b.len() {
        return false;
    }
    let mut i = 0;
    while i < a.len() {
        if a[i] != b[i] {
            return false;
        }
        i += 1;
    }
    true
}

impl Known {
    /// Evaluated at compile time per op type (`const { Known::of(R::NAME) }`), so the match
    /// in `span_for` folds to one callsite.
    const fn of(name: &str) -> Known {
        const TABLE: [(&str, Known); 11] = [
            ("all_reduce", Known::AllReduce),
            ("broadcast", Known::Broadcast),
            ("reduce", Known::Reduce),
            ("all_gather", Known::AllGather),
            ("reduce_scatter", Known::ReduceScatter),
            ("all_to_all", Known::AllToAll),
            ("scatter", Known::Scatter),
            ("gather", Known::Gather),
            ("send", Known::Send),
            ("recv", Known::Recv),
            ("barrier", Known::Barrier),
        ];
        let mut i = 0;
        while i < TABLE.len() {
            if str_eq(TABLE[i].0, name) {
                return TABLE[i].1;
            }
            i += 1;
        }
        Known::Other
    }
}

/// `comm.<op>` as the `otel.name` of an op outside the known list: formatted when a
/// subscriber records the field (a field value, unlike a span name, need not be `'static`).
struct OtherSpanName(&'static str);

impl fmt::Display for OtherSpanName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "comm.{}", self.0)
    }
}

// One callsite per op, so subscribers can filter by span name and each keeps its own interest
// cache. Field values are only evaluated when the span is enabled.
macro_rules! op_span {
    ($name:expr, $p:expr, $req:expr, $op:expr) => {
        tracing::info_span!(
            target: TARGET,
            $name,
            comm.op = $op,
            comm.bytes = $req.bytes() as i64,
            comm.dtype = $req.dtype().map(|d| d.name()),
            comm.rank = i64::from($p.rank),
            comm.world_size = i64::from($p.world_size),
            comm.group_rank = i64::from($p.inner.rank()),
            comm.group_size = i64::from($p.inner.world_size()),
            comm.backend = $p.inner.backend_name(),
            otel.name = $name,
            otel.kind = "client",
            comm.logger = $p.logger.as_ref().map(CommsLogger::id),
            comm.detached = Empty,
            otel.status_code = Empty,
            otel.status_description = Empty,
        )
    };
}

impl<C: Group> Profiling<C> {
    fn span_for<R: Op>(&self, req: &R) -> Span {
        match const { Known::of(R::NAME) } {
            Known::AllReduce => op_span!("comm.all_reduce", self, req, R::NAME),
            Known::Broadcast => op_span!("comm.broadcast", self, req, R::NAME),
            Known::Reduce => op_span!("comm.reduce", self, req, R::NAME),
            Known::AllGather => op_span!("comm.all_gather", self, req, R::NAME),
            Known::ReduceScatter => op_span!("comm.reduce_scatter", self, req, R::NAME),
            Known::AllToAll => op_span!("comm.all_to_all", self, req, R::NAME),
            Known::Scatter => op_span!("comm.scatter", self, req, R::NAME),
            Known::Gather => op_span!("comm.gather", self, req, R::NAME),
            Known::Send => op_span!("comm.send", self, req, R::NAME),
            Known::Recv => op_span!("comm.recv", self, req, R::NAME),
            Known::Barrier => op_span!("comm.barrier", self, req, R::NAME),
            Known::Other => self.other_span(R::NAME, req.bytes() as u64, req.dtype()),
        }
    }

    /// The shared `comm.op` callsite, for an op outside the known list or a labelled one.
    fn other_span(&self, op: &'static str, bytes: u64, dtype: Option<DType>) -> Span {
        tracing::info_span!(
            target: TARGET,
            "comm.op",
            comm.op = op,
            comm.bytes = bytes as i64,
            comm.dtype = dtype.map(|d| d.name()),
            comm.rank = i64::from(self.rank),
            comm.world_size = i64::from(self.world_size),
            comm.group_rank = i64::from(self.inner.rank()),
            comm.group_size = i64::from(self.inner.world_size()),
            comm.backend = self.inner.backend_name(),
            otel.name = tracing::field::display(OtherSpanName(op)),
            otel.kind = "client",
            comm.logger = self.logger.as_ref().map(CommsLogger::id),
            comm.detached = Empty,
            otel.status_code = Empty,
            otel.status_description = Empty,
        )
    }
}

/// Records how the op ended; dropping `span` (the last handle) closes it.
fn finish(span: Span, c: Completion<'_>) {
    if c.detached {
        span.record("comm.detached", true);
    }
    if let Some(e) = c.error {
        span.record("otel.status_code", "ERROR");
        span.record("otel.status_description", tracing::field::display(e));
    }
}

impl<R: Op, C: Collective<R>> Collective<R> for Profiling<C> {
    fn submit(&self, req: R) -> Work<R::Output> {
        if SUPPRESSED.with(Cell::get) {
            return self.inner.submit(req);
        }
        let label = LABEL.with(Cell::get);
        let Some((timeline, seq)) = &self.timeline else { return self.submit_profiled(req, label) };
        let (op, bytes) = label.unwrap_or((R::NAME, req.bytes() as u64));
        let meta = Meta {
            op,
            bytes,
            dtype: req.dtype(),
            group_size: self.group_size,
            group_rank: self.inner.rank(),
            seq: seq.next(),
        };
        let start = timeline.start();
        let work = self.submit_profiled(req, label);
        timeline.record(start, meta, work)
    }
}

impl<C> Profiling<C> {
    /// `label`: record the op as this op name and size instead ([`recorded_as`]).
    fn submit_profiled<R: Op>(&self, req: R, label: Option<(&'static str, u64)>) -> Work<R::Output>
    where
        C: Collective<R>,
    {
        let span = match label {
            None => self.span_for(&req),
            Some((op, bytes)) => self.other_span(op, bytes, req.dtype()),
        };
        let (op, bytes) = label.unwrap_or((R::NAME, req.bytes() as u64));
        let logged = self.logger.as_ref().and_then(|l| Some((l, l.begin(op, bytes, self.group_size, self.rank)?)));
        let Some((logger, ticket)) = logged else {
            if span.is_disabled() {
                return self.inner.submit(req);
            }
            let work = {
                let _entered = span.enter();
                self.inner.submit(req)
            };
            return work.on_complete(move |c| finish(span, c));
        };
        let work = {
            let _entered = span.enter();
            self.inner.submit(req)
        };
        if span.is_disabled() {
            // The hot path: a small op that finished inline was counted by `begin`.
            if let Some(c) = work.inline_completion() {
                logger.end_inline(ticket, c);
                return work;
            }
        }
        // Completes elsewhere: the hook only has work for a failure, a detached op or a timed
        // call, and carries the logger itself only for timed calls (the rest find it by id).
        let Some(key) = logger.key_of(ticket) else { return work.on_complete(move |c| finish(span, c)) };
        let (id, carried) = (logger.id(), ticket.is_timed().then(|| logger.clone()));
        work.on_complete(move |c| {
            if CommsLogger::needs_end(ticket, c) {
                if let Some(logger) = carried.or_else(|| CommsLogger::find(id)) {
                    logger.end(&key, ticket, c);
                }
            }
            finish(span, c);
        })
    }
}

impl<C> Profiling<C> {
    /// `g` (a sub-group or shrunk group of this one) profiled with the same process rank and
    /// world size; its ops are numbered from 1 of their own, on the same timeline.
    fn profiled(&self, g: Arc<dyn Backend>) -> Arc<dyn Backend> {
        let group_size = g.world_size();
        let logger = self.logger.clone();
        let timeline = self.timeline.as_ref().map(|(t, _)| (t.clone(), Arc::new(Seq::default())));
        Arc::new(Profiling { inner: g, rank: self.rank, world_size: self.world_size, group_size, logger, timeline })
    }
}

#[async_trait]
impl<C: Group> Group for Profiling<C> {
    fn rank(&self) -> Rank {
        self.inner.rank()
    }

    fn world_size(&self) -> u32 {
        self.inner.world_size()
    }

    fn backend_name(&self) -> &'static str {
        self.inner.backend_name()
    }

    /// The sub-group is profiled too, with the same process rank and world size.
    async fn new_group(&self, ranks: &[Rank]) -> Result<Option<Arc<dyn Backend>>, CommError> {
        let span = tracing::info_span!(target: TARGET, "comm.new_group", comm.ranks = ?ranks, otel.kind = "client");
        let sub = self.inner.new_group(ranks).instrument(span).await?;
        Ok(sub.map(|g| self.profiled(g)))
    }

    /// The shrunk group is profiled too, like a sub-group.
    async fn shrink(&self) -> Result<Shrunk, CommError> {
        let span = tracing::info_span!(target: TARGET, "comm.shrink", otel.kind = "client");
        let s = self.inner.shrink().instrument(span).await?;
        Ok(Shrunk { group: self.profiled(s.group), ranks: s.ranks })
    }

    async fn grow(&self, n: u32) -> Result<Arc<dyn Backend>, CommError> {
        let span = tracing::info_span!(target: TARGET, "comm.grow", comm.newcomers = n, otel.kind = "client");
        Ok(self.profiled(self.inner.grow(n).instrument(span).await?))
    }

    async fn shutdown(&self) -> Result<(), CommError> {
        self.inner.shutdown().await
    }

    fn alloc_buffer(&self, dtype: DType, len: usize) -> Result<HostBuffer, CommError> {
        self.inner.alloc_buffer(dtype, len)
    }

    fn abort(&self, cause: &str) {
        self.inner.abort(cause)
    }
    fn poison(&self) -> Option<&comm_core::handle::Poison> {
        self.inner.poison()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_ops_resolve_at_compile_time() {
        assert!(const { matches!(Known::of("all_reduce"), Known::AllReduce) });
        assert!(const { matches!(Known::of("reduce"), Known::Reduce) });
        assert!(const { matches!(Known::of("all_reduce_coalesced"), Known::Other) });
        assert_eq!(OtherSpanName("fancy").to_string(), "comm.fancy");
    }

    #[test]
    fn suppression_is_scoped_and_restored() {
        assert!(!SUPPRESSED.with(Cell::get));
        without_profiling(|| {
            assert!(SUPPRESSED.with(Cell::get));
            without_profiling(|| ());
            assert!(SUPPRESSED.with(Cell::get));
        });
        assert!(!SUPPRESSED.with(Cell::get));
    }
}
