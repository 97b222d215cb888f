//! The per-rank timeline (feature `profiling`) at 2 and 3 real ranks: the merged file is valid
//! Chrome trace-event JSON (fields, one track per rank, ordered timestamps), and a rank that is
//! deliberately late shows up as such on rank 0's clock.
#![cfg(feature = "profiling")]

use std::time::Duration;

use comm_api::profiling::{ProfilingLayer, Timeline};
use comm_api::{BackendKind, Config, HostBuffer, ReduceOp};
use comm_test::multiprocess;
use serde_json::Value;

const T: Duration = Duration::from_secs(120);
/// How late the last rank is for every all_reduce.
const LATE: Duration = Duration::from_millis(40);
const OPS: u64 = 5;

async fn body() -> Result<(), String> {
    let timeline = Timeline::new();
    let pg = comm_api::builder(Config::from_env().map_err(|e| e.to_string())?)
        .backend(BackendKind::Shm)
        .profiling(ProfilingLayer::new().with_timeline(timeline.clone()))
        .connect()
        .await
        .map_err(|e| e.to_string())?;
    let (me, n) = (pg.rank(), pg.world_size());
    timeline.align(pg.backend()).await.map_err(|e| e.to_string())?;
    for _ in 0..OPS {
        if me == n - 1 {
            std::thread::sleep(LATE);
        }
        pg.all_reduce(HostBuffer::from_slice(&[1.0f32; 1024]), ReduceOp::Sum).await.map_err(|e| e.to_string())?;
    }
    let merged = timeline.gather(pg.backend()).await.map_err(|e| e.to_string())?;
    pg.shutdown().await.map_err(|e| e.to_string())?;
    let Some(json) = merged else {
        return if me == 0 { Err("rank 0 got no trace".into()) } else { Ok(()) };
    };
    check(&json, n)
}

fn check(json: &str, n: u32) -> Result<(), String> {
    let doc: Value = serde_json::from_str(json).map_err(|e| format!("not JSON: {e}"))?;
    let events = doc["traceEvents"].as_array().ok_or("no traceEvents array")?;
    let mut names = Vec::new();
    // (rank, seq) -> (ts, dur) of the all_reduce slices.
    let mut slices = std::collections::BTreeMap::new();
    for e in events {
        let pid = e["pid"].as_u64().ok_or(format!("no pid: {e}"))? as u32;
        if e["tid"].as_u64() != Some(0) || pid >= n {
            return Err(format!("one track per rank: {e}"));
        }
        match e["ph"].as_str() {
            Some("M") if e["name"] == "process_name" => names.push(e["args"]["name"].as_str().unwrap_or("").to_owned()),
            Some("M") => {}
            Some("X") => {
                let (ts, dur) = (e["ts"].as_f64().ok_or("no ts")?, e["dur"].as_f64().ok_or("no dur")?);
                let args = &e["args"];
                if e["name"] != "all_reduce"
                    || args["bytes"] != 4096
                    || args["dtype"] != "f32"
                    || args["group_size"] != n
                {
                    return Err(format!("unexpected slice: {e}"));
                }
                if ts < 0.0 || dur < 0.0 {
                    return Err(format!("negative time: {e}"));
                }
                let seq = args["seq"].as_u64().ok_or("no seq")?;
                slices.insert((pid, seq), (ts, dur));
            }
            other => return Err(format!("unexpected phase {other:?}: {e}")),
        }
    }
    let want: Vec<String> = (0..n).map(|r| format!("rank {r}")).collect();
    if names != want {
        return Err(format!("process names {names:?}"));
    }
    for r in 0..n {
        let ts: Vec<f64> = (1..=OPS)
            .map(|s| slices.get(&(r, s)).map(|x| x.0).ok_or(format!("rank {r} op {s} missing")))
            .collect::<Result<_, _>>()?;
        if ts.windows(2).any(|w| w[1] < w[0]) {
            return Err(format!("rank {r}: timestamps out of order {ts:?}"));
        }
    }
    // The late rank enters every all_reduce ~LATE after rank 0 (aligned clocks), and rank 0's
    // slices are the long ones: it waited.
    let late = LATE.as_secs_f64() * 1e6 * 0.7;
    for s in 2..=OPS {
        let (t0, d0) = slices[&(0, s)];
        let (tl, dl) = slices[&(n - 1, s)];
        if tl - t0 < late || d0 < late || dl > d0 {
            return Err(format!("op {s}: rank 0 at {t0} µs for {d0} µs, the late rank at {tl} µs for {dl} µs"));
        }
    }
    println!("trace: {} events, late rank visible", events.len());
    Ok(())
}

#[test]
fn timeline_2_ranks() {
    multiprocess::run(2, "timeline_2_ranks", T, body);
}

#[test]
fn timeline_3_ranks() {
    multiprocess::run(3, "timeline_3_ranks", T, body);
}
