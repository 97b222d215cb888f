//! The `profiling` and `otel` features through the facade: spans for every op of a group and
//! its sub-groups, the CommsLogger summary with the straggler view, OTLP export.
#![cfg(feature = "profiling")]

#[cfg(feature = "otel")]
use std::sync::{Arc, Mutex};

use comm_api::profiling::{CommsConfig, CommsLogger, ProfilingLayer};
use comm_api::{Config, HostBuffer, ReduceOp};
use tracing_subscriber::layer::SubscriberExt;

mod common;
use common::{two_rank_summaries, Recording};

#[tokio::test(flavor = "current_thread")]
async fn builder_profiles_the_group_and_its_sub_groups() {
    let logger = CommsLogger::new(CommsConfig::default());
    let _g = tracing::subscriber::set_default(tracing_subscriber::registry().with(logger.clone()));
    let pg = comm_api::builder(Config::single()).profiling(ProfilingLayer::new()).connect().await.unwrap();
    pg.all_reduce(HostBuffer::from_slice(&[1.0f32; 256]), ReduceOp::Sum).await.unwrap();
    pg.all_gather(HostBuffer::from_slice(&[1u8; 100])).await.unwrap();
    let sub = pg.new_group(&[0]).await.unwrap().unwrap();
    sub.barrier().await.unwrap();
    let s = logger.summary();
    let ops: Vec<(&str, u64, u64)> = s.rows.iter().map(|r| (r.op.as_str(), r.bytes, r.count)).collect();
    assert_eq!(ops, [("all_gather", 100, 1), ("all_reduce", 1024, 1), ("barrier", 0, 1)]);
    assert!(s.rows.iter().all(|r| r.group_size == 1 && r.errors == 0));
    // Profiling adds nothing to what the group does.
    assert_eq!(pg.backend_name(), "shm");
    pg.shutdown().await.unwrap();
}

#[tokio::test(flavor = "current_thread")]
async fn a_second_init_with_other_layers_is_refused() {
    let _ = comm_api::init(Config::single()).await.unwrap();
    let e = comm_api::builder(Config::single()).profiling(ProfilingLayer::new()).init().await.unwrap_err();
    assert!(e.to_string().contains("profiling"), "{e}");
}

#[test]
fn straggler_summary_over_a_process_group() {
    for s in two_rank_summaries(Recording::Spans, 5) {
        assert_eq!(s.rows.len(), 1, "the summary's own exchanges are not recorded: {:?}", s.rows);
        assert_eq!((s.rows[0].op.as_str(), s.rows[0].count, s.rows[0].group_size), ("all_reduce", 5, 2));
        let st = s.stragglers.unwrap();
        assert_eq!((st.ranks, st.rows.len(), st.rows[0].count), (2, 1, 5));
        assert!(st.rows[0].total_min_us <= st.rows[0].total_own_us);
    }
}

/// `otel`: the spans of a process group's ops reach an OTLP/HTTP receiver, under the user's
/// span, with the service name and rank.
#[cfg(feature = "otel")]
#[tokio::test(flavor = "current_thread")]
async fn otel_exports_the_ops_of_a_group() {
    use std::io::{BufRead, BufReader, Read, Write};
    use std::time::Duration;

    use comm_api::profiling::otel::{Exporter, OtelConfig};

    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let bodies = Arc::new(Mutex::new(Vec::new()));
    let b = bodies.clone();
    let server = std::thread::spawn(move || {
        let (conn, _) = listener.accept().unwrap();
        conn.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut r = BufReader::new(conn.try_clone().unwrap());
        let mut len = 0;
        loop {
            let mut h = String::new();
            r.read_line(&mut h).unwrap();
            if h.trim_end().is_empty() {
                break;
            }
            if let Some(v) = h.to_ascii_lowercase().strip_prefix("content-length:") {
                len = v.trim().parse().unwrap();
            }
        }
        let mut body = vec![0; len];
        r.read_exact(&mut body).unwrap();
        (&conn).write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n").unwrap();
        b.lock().unwrap().push(body);
    });

    let otel = OtelConfig::new("facade-test")
        .with_rank(0, 1)
        .with_exporter(Exporter::Otlp {
            endpoint: Some(format!("http://127.0.0.1:{port}")),
            timeout: Duration::from_secs(5),
        })
        .build()
        .unwrap();
    {
        let _g = tracing::subscriber::set_default(tracing_subscriber::registry().with(otel.layer()));
        let pg = comm_api::builder(Config::single()).profiling(ProfilingLayer::new()).connect().await.unwrap();
        let step = tracing::info_span!("train_step");
        let w = step.in_scope(|| pg.all_reduce(HostBuffer::from_slice(&[2.0f64; 8]), ReduceOp::Sum));
        w.await.unwrap();
        drop(step);
        pg.shutdown().await.unwrap();
    }
    otel.flush().unwrap();
    server.join().unwrap();
    let body = bodies.lock().unwrap().concat();
    let has = |s: &str| body.windows(s.len()).any(|w| w == s.as_bytes());
    for s in ["comm.all_reduce", "train_step", "facade-test", "comm.bytes", "shm"] {
        assert!(has(s), "`{s}` not in the OTLP request");
    }
}
