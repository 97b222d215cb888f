//! A per-rank timeline in Chrome's trace-event format (what Perfetto and `chrome://tracing`
//! open): every op a slice on its rank's track, clocks aligned across ranks, so a straggler is
//! visible at a glance.
//!
//! ```
//! # tokio::runtime::Runtime::new().unwrap().block_on(async {
//! use comm_core::{ops::AllReduce, Collective, DType, HostBuffer, ReduceOp};
//! use profiling::{ProfilingLayer, Timeline};
//! let timeline = Timeline::new();
//! let rank = ProfilingLayer::new().with_timeline(timeline.clone()).layer(comm_test::LocalWorld::new(1).remove(0));
//! timeline.align(&rank).await.unwrap();
//! rank.submit(AllReduce { buf: HostBuffer::zeroed(DType::F32, 256), op: ReduceOp::Sum }).await.unwrap();
//! let json = timeline.gather(&rank).await.unwrap().expect("rank 0 gets the merged trace");
//! assert!(json.contains(r#""name":"all_reduce""#) && json.contains(r#""ph":"X""#));
//! # });
//! ```

use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use comm_core::ops::{AllGather, AllReduce, Barrier};
use comm_core::{Collective, CommError, DType, HostBuffer, ReduceOp, Work};
use serde::{Deserialize, Serialize};

use crate::without_profiling;

/// One op on one rank: when it was submitted and when it completed, on this process's clock.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TraceEvent {
    /// The op (`"all_reduce"`).
    pub op: String,
    /// [`comm_core::Op::bytes`].
    pub bytes: u64,
    /// The element type, when the op carries data.
    pub dtype: Option<String>,
    /// Size of the group the op ran on, and this rank's place in it.
    pub group_size: u32,
    /// This rank's rank in that group.
    pub group_rank: u32,
    /// The op's number in its group (1 for the first op the layer saw).
    pub seq: u64,
    /// Submission, in ns since the timeline was made.
    pub start_ns: u64,
    /// Completion, in ns since the timeline was made.
    pub end_ns: u64,
    /// Whether it failed.
    pub failed: bool,
}

/// Collects [`TraceEvent`]s (attach with [`ProfilingLayer::with_timeline`](crate::ProfilingLayer::with_timeline)),
/// aligns this rank's clock with rank 0's ([`Timeline::align`]) and merges every rank's
/// events into one trace ([`Timeline::gather`]). Cheap to clone (clones share the events).
#[derive(Clone, Debug)]
pub struct Timeline {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    base: Instant,
    events: Mutex<Vec<TraceEvent>>,
    /// Add to this rank's times to get rank 0's clock (ns).
    offset_ns: AtomicI64,
}

impl Default for Timeline {
    fn default() -> Self {
        Timeline::new()
    }
}

/// Most events a timeline keeps (about 20 MiB of JSON per rank).
pub const MAX_EVENTS: usize = 100_000;

/// Rounds of the clock alignment; the median offset is kept.
const ALIGN_ROUNDS: usize = 7;

impl Timeline {
    /// An empty timeline whose clock starts now.
    pub fn new() -> Self {
        Timeline {
            inner: Arc::new(Inner {
                base: Instant::now(),
                events: Mutex::new(Vec::new()),
                offset_ns: AtomicI64::new(0),
            }),
        }
    }

    fn now_ns(&self) -> u64 {
        self.inner.base.elapsed().as_nanos() as u64
    }

    /// Identifies the timeline (clones share it): layers are equal when they record into the same.
    pub(crate) fn id(&self) -> usize {
        Arc::as_ptr(&self.inner) as usize
    }

    /// A copy of the events recorded so far, in completion order.
    pub fn events(&self) -> Vec<TraceEvent> {
        self.inner.events.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// What to add to this rank's times to put them on rank 0's clock (ns).
    pub fn offset_ns(&self) -> i64 {
        self.inner.offset_ns.load(Ordering::Relaxed)
    }

    /// Records `work` (submitted just now as op number `seq`) and returns it.
    pub(crate) fn record<T: Send + 'static>(&self, start_ns: u64, meta: Meta, work: Work<T>) -> Work<T> {
        let timeline = self.clone();
        work.on_complete(move |c| {
            let end_ns = timeline.now_ns();
            let e = TraceEvent {
                op: meta.op.to_owned(),
                bytes: meta.bytes,
                dtype: meta.dtype.map(|d| d.name().to_owned()),
                group_size: meta.group_size,
                group_rank: meta.group_rank,
                seq: meta.seq,
                start_ns,
                end_ns,
                failed: c.error.is_some(),
            };
            let mut events = timeline.inner.events.lock().unwrap_or_else(|p| p.into_inner());
            // A bounded record: a long run keeps its first MAX_EVENTS ops.
            if events.len() < MAX_EVENTS {
                events.push(e);
            }
        })
    }

    pub(crate) fn start(&self) -> u64 {
        self.now_ns()
    }

    /// Estimates this rank's clock offset from rank 0's: every rank reads its clock as it
    /// leaves a barrier, the readings are all-gathered, and the median over a few rounds of
    /// (rank 0's reading − ours) is kept. Collective over `group` (the world group); its own
    /// ops are not recorded. Exact to about a barrier's exit skew (microseconds on one host).
    pub async fn align<G>(&self, group: &G) -> Result<(), CommError>
    where
        G: Collective<Barrier> + Collective<AllGather> + ?Sized,
    {
        let mut offsets = Vec::with_capacity(ALIGN_ROUNDS);
        for _ in 0..ALIGN_ROUNDS {
            without_profiling(|| group.submit(Barrier)).await?;
            let t = self.now_ns() as i64;
            let all =
                without_profiling(|| group.submit(AllGather { input: HostBuffer::from_slice(&[t]), output: None }))
                    .await?
                    .output;
            offsets.push(all.as_slice::<i64>()?[0] - t);
        }
        offsets.sort_unstable();
        self.inner.offset_ns.store(offsets[ALIGN_ROUNDS / 2], Ordering::Relaxed);
        Ok(())
    }

    /// Every rank's events merged into one Chrome trace-event JSON document, on rank 0 (`None`
    /// elsewhere): one process track per rank (`pid` = rank, named "rank N"), each op a
    /// complete event (`ph: "X"`, `ts` / `dur` in µs on rank 0's clock) with its op, bytes,
    /// dtype, group and sequence number in `args`. Collective over `group`.
    pub async fn gather<G>(&self, group: &G) -> Result<Option<String>, CommError>
    where
        G: Collective<AllGather> + Collective<AllReduce> + ?Sized,
    {
        let mine = serde_json::to_vec(&(self.offset_ns(), self.events()))
            .map_err(|e| CommError::invalid("Timeline::gather", format!("serialising the events: {e}")))?;
        let len = HostBuffer::from_slice(&[mine.len() as i64]);
        let max = without_profiling(|| group.submit(AllReduce { buf: len, op: ReduceOp::Max })).await?;
        let max = max.as_slice::<i64>()?[0].max(0) as usize;
        let mut padded = HostBuffer::zeroed(DType::U8, max);
        padded.as_bytes_mut()[..mine.len()].copy_from_slice(&mine);
        let all = without_profiling(|| group.submit(AllGather { input: padded, output: None })).await?.output;
        if group.rank() != 0 {
            return Ok(None);
        }
        let mut ranks = Vec::new();
        for r in 0..group.world_size() as usize {
            let raw = &all.as_bytes()[r * max..(r + 1) * max];
            let end = raw.iter().rposition(|&b| b != 0).map_or(0, |i| i + 1);
            let (offset, events): (i64, Vec<TraceEvent>) = serde_json::from_slice(&raw[..end])
                .map_err(|e| CommError::mismatch("Timeline::gather", format!("rank {r}'s events: {e}")))?;
            ranks.push((r as u32, offset, events));
        }
        Ok(Some(chrome_trace(&ranks)))
    }
}

/// What the layer knows of an op when it is submitted.
pub(crate) struct Meta {
    pub(crate) op: &'static str,
    pub(crate) bytes: u64,
    pub(crate) dtype: Option<DType>,
    pub(crate) group_size: u32,
    pub(crate) group_rank: u32,
    pub(crate) seq: u64,
}

/// Per-group op numbers.
#[derive(Debug, Default)]
pub(crate) struct Seq(AtomicU64);

impl Seq {
    pub(crate) fn next(&self) -> u64 {
        self.0.fetch_add(1, Ordering::Relaxed) + 1
    }
}

/// The Chrome trace-event JSON of `(rank, clock offset, events)` per rank; times start at the
/// earliest event.
pub fn chrome_trace(ranks: &[(u32, i64, Vec<TraceEvent>)]) -> String {
    let at = |offset: i64, ns: u64| ns as i64 + offset;
    let origin = ranks.iter().flat_map(|(_, o, ev)| ev.iter().map(move |e| at(*o, e.start_ns))).min().unwrap_or(0);
    let us = |ns: i64| (ns - origin) as f64 / 1000.0;
    let mut out = Vec::new();
    for (rank, offset, events) in ranks {
        out.push(serde_json::json!({
            "name": "process_name", "ph": "M", "pid": rank, "tid": 0, "args": { "name": format!("rank {rank}") }
        }));
        out.push(serde_json::json!({
            "name": "process_sort_index", "ph": "M", "pid": rank, "tid": 0, "args": { "sort_index": rank }
        }));
        let mut events = events.clone();
        events.sort_by_key(|e| e.start_ns);
        for e in events {
            out.push(serde_json::json!({
                "name": e.op,
                "cat": "comm",
                "ph": "X",
                "pid": rank,
                "tid": 0,
                "ts": us(at(*offset, e.start_ns)),
                "dur": (e.end_ns.saturating_sub(e.start_ns)) as f64 / 1000.0,
                "args": {
                    "bytes": e.bytes,
                    "dtype": e.dtype,
                    "group_size": e.group_size,
                    "group_rank": e.group_rank,
                    "seq": e.seq,
                    "failed": e.failed,
                },
            }));
        }
    }
    serde_json::json!({ "traceEvents": out, "displayTimeUnit": "ns" }).to_string()
}
