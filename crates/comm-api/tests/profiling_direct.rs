//! Direct recording (`ProfilingLayer::with_logger`) through the facade. A binary of its own:
//! its ops run with no subscriber while `profiling.rs`'s tests install scoped ones, and
//! `tracing` may cache a callsite's interest from whichever thread registers it first.
#![cfg(feature = "profiling")]

mod common;
use common::{two_rank_summaries, Recording};

/// Direct recording with the default sampling: every rank times the same calls, so the
/// straggler view compares all of them call by call (no rank recorded more).
#[test]
fn sampled_direct_recording_lines_up_across_ranks() {
    let summaries = two_rank_summaries(Recording::Direct, 500);
    for s in &summaries {
        let row = &s.rows[0];
        assert_eq!((s.rows.len(), row.count), (1, 500));
        assert!(row.timed > 32 && row.timed < 100, "{} timed of 500", row.timed);
        let st = s.stragglers.as_ref().unwrap();
        assert_eq!((st.rows[0].count, st.rows[0].counts_differ), (row.timed, false));
    }
    assert_eq!(summaries[0].rows[0].timed, summaries[1].rows[0].timed);
}
