//! OpenTelemetry export: span names, attributes, status and parentage through the SDK's
//! in-memory exporter, and the real OTLP/HTTP path into an in-process receiver that decodes
//! the protobuf.
#![cfg(feature = "otel")]

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::sync::mpsc;
use std::time::Duration;

use comm_core::ops::{AllGather, AllReduce, Broadcast};
use comm_core::{Collective, CommError, DType, HostBuffer, ReduceOp};
use common::{Fancy, Mock};
use opentelemetry::trace::{SpanId, SpanKind, Status};
use opentelemetry::{KeyValue, Value};
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::any_value;
use opentelemetry_sdk::trace::InMemorySpanExporter;
use profiling::otel::{Exporter, OtelConfig};
use profiling::ProfilingLayer;
use prost::Message;
use tracing_subscriber::layer::SubscriberExt;

fn attr<'a>(attrs: &'a [KeyValue], key: &str) -> Option<&'a Value> {
    attrs.iter().find(|kv| kv.key.as_str() == key).map(|kv| &kv.value)
}

/// A user span around two ops: one that completes later, one that fails.
fn workload() {
    let mock = Mock::new(1, 2, false);
    let p = ProfilingLayer::new().layer(mock.clone());
    let step = tracing::info_span!("train_step", otel.name = "train_step");
    let (a, b) = step.in_scope(|| {
        let a = p.submit(AllReduce { buf: HostBuffer::zeroed(DType::BF16, 512), op: ReduceOp::Sum });
        let b = p.submit(Broadcast { buf: HostBuffer::zeroed(DType::F32, 4), root: 0 });
        (a, b)
    });
    drop(step);
    mock.complete_next();
    mock.fail_next(CommError::timeout("broadcast", Duration::from_secs(3), "rank 0"));
    a.wait().unwrap();
    assert!(b.wait().is_err());
    // A detached op outside any user span: a root span.
    drop(p.submit(AllGather { input: HostBuffer::zeroed(DType::U8, 10), output: None }));
    mock.complete_next();
    // An op outside the known list: its span name comes from a field.
    let w = p.submit(Fancy(8));
    mock.complete_next();
    w.wait().unwrap();
}

#[test]
fn in_memory_export_has_names_attributes_status_and_parents() {
    let mem = InMemorySpanExporter::default();
    let otel = OtelConfig::new("trainer").with_rank(1, 2).build_with_exporter(mem.clone());
    tracing::subscriber::with_default(tracing_subscriber::registry().with(otel.layer()), workload);
    otel.flush().unwrap();
    let spans = mem.get_finished_spans().unwrap();
    let by = |name: &str| spans.iter().find(|s| s.name == name).unwrap_or_else(|| panic!("no span {name}: {spans:?}"));

    let step = by("train_step");
    let ar = by("comm.all_reduce");
    assert_eq!(ar.parent_span_id, step.span_context.span_id());
    assert_eq!(ar.span_context.trace_id(), step.span_context.trace_id());
    assert_eq!(ar.span_kind, SpanKind::Client);
    assert_eq!(ar.status, Status::Unset);
    assert_eq!(attr(&ar.attributes, "comm.bytes"), Some(&Value::I64(1024)));
    assert_eq!(attr(&ar.attributes, "comm.op"), Some(&Value::from("all_reduce")));
    assert_eq!(attr(&ar.attributes, "comm.dtype"), Some(&Value::from("bf16")));
    assert_eq!(attr(&ar.attributes, "comm.group_size"), Some(&Value::I64(2)));
    assert_eq!(attr(&ar.attributes, "comm.rank"), Some(&Value::I64(1)));
    assert_eq!(attr(&ar.attributes, "comm.backend"), Some(&Value::from("mock")));
    assert!(attr(&ar.attributes, "otel.name").is_none(), "consumed as the span name");
    assert_eq!(attr(&by("comm.fancy_op").attributes, "comm.op"), Some(&Value::from("fancy_op")));

    let bc = by("comm.broadcast");
    assert_eq!(bc.parent_span_id, step.span_context.span_id());
    match &bc.status {
        Status::Error { description } => assert!(description.contains("timed out after 3.0 s"), "{description}"),
        other => panic!("broadcast status {other:?}"),
    }

    let ag = by("comm.all_gather");
    assert_eq!(ag.parent_span_id, SpanId::INVALID);
    assert_eq!(attr(&ag.attributes, "comm.detached"), Some(&Value::Bool(true)));
    otel.shutdown().unwrap();
}

/// Accepts OTLP/HTTP posts on 127.0.0.1 and hands each (path, content type, body) over.
fn receiver() -> (u16, mpsc::Receiver<(String, String, Vec<u8>)>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        // Bounded: a few requests at most, each with a read timeout.
        for conn in listener.incoming().take(8) {
            let Ok(mut conn) = conn else { return };
            conn.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
            let mut r = BufReader::new(conn.try_clone().unwrap());
            let mut line = String::new();
            r.read_line(&mut line).unwrap();
            let path = line.split_whitespace().nth(1).unwrap_or("").to_owned();
            let (mut len, mut ctype) = (0, String::new());
            loop {
                let mut h = String::new();
                r.read_line(&mut h).unwrap();
                let h = h.trim_end();
                if h.is_empty() {
                    break;
                }
                let (k, v) = h.split_once(':').unwrap();
                match k.to_ascii_lowercase().as_str() {
                    "content-length" => len = v.trim().parse().unwrap(),
                    "content-type" => ctype = v.trim().to_owned(),
                    _ => {}
                }
            }
            let mut body = vec![0; len];
            r.read_exact(&mut body).unwrap();
            conn.write_all(b"HTTP/1.1 200 OK\r\nContent-Type: application/x-protobuf\r\nContent-Length: 0\r\n\r\n")
                .unwrap();
            if tx.send((path, ctype, body)).is_err() {
                return;
            }
        }
    });
    (port, rx)
}

fn str_of(v: &Option<opentelemetry_proto::tonic::common::v1::AnyValue>) -> String {
    match v.as_ref().and_then(|v| v.value.as_ref()) {
        Some(any_value::Value::StringValue(s)) => s.clone(),
        Some(any_value::Value::IntValue(i)) => i.to_string(),
        Some(any_value::Value::BoolValue(b)) => b.to_string(),
        other => format!("{other:?}"),
    }
}

#[test]
fn otlp_http_export_reaches_a_real_receiver() {
    let (port, rx) = receiver();
    let otel = OtelConfig::new("trainer")
        .with_rank(1, 2)
        .with_exporter(Exporter::Otlp {
            endpoint: Some(format!("http://127.0.0.1:{port}")),
            timeout: Duration::from_secs(5),
        })
        .build()
        .unwrap();
    tracing::subscriber::with_default(tracing_subscriber::registry().with(otel.layer()), workload);
    otel.flush().unwrap();

    let (path, ctype, body) = rx.recv_timeout(Duration::from_secs(10)).unwrap();
    assert_eq!((path.as_str(), ctype.as_str()), ("/v1/traces", "application/x-protobuf"));
    let req = ExportTraceServiceRequest::decode(body.as_slice()).unwrap();
    let rs = &req.resource_spans[0];
    let res = &rs.resource.as_ref().unwrap().attributes;
    let res_attr = |k: &str| res.iter().find(|a| a.key == k).map(|a| str_of(&a.value));
    assert_eq!(res_attr("service.name").as_deref(), Some("trainer"));
    assert_eq!(res_attr("rank").as_deref(), Some("1"));
    assert_eq!(res_attr("world_size").as_deref(), Some("2"));

    let spans: Vec<_> = rs.scope_spans.iter().flat_map(|s| &s.spans).collect();
    let by = |name: &str| *spans.iter().find(|s| s.name == name).unwrap_or_else(|| panic!("no {name}"));
    let (step, ar, bc) = (by("train_step"), by("comm.all_reduce"), by("comm.broadcast"));
    assert_eq!(ar.parent_span_id, step.span_id);
    assert_eq!(ar.trace_id, step.trace_id);
    assert_eq!(bc.parent_span_id, step.span_id);
    let a = |s: &opentelemetry_proto::tonic::trace::v1::Span, k: &str| {
        s.attributes.iter().find(|kv| kv.key == k).map(|kv| str_of(&kv.value))
    };
    assert_eq!(a(ar, "comm.bytes").as_deref(), Some("1024"));
    assert_eq!(a(ar, "comm.op").as_deref(), Some("all_reduce"));
    assert_eq!(bc.status.as_ref().map(|s| s.code), Some(2), "STATUS_CODE_ERROR");
    assert!(bc.status.as_ref().unwrap().message.contains("timed out"));
    assert!(by("comm.all_gather").parent_span_id.is_empty());
    otel.shutdown().unwrap();
}

#[test]
fn unreachable_collector_is_an_error_not_a_stall() {
    let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let otel = OtelConfig::new("t")
        .with_exporter(Exporter::Otlp {
            endpoint: Some(format!("http://127.0.0.1:{port}")),
            timeout: Duration::from_secs(2),
        })
        .build()
        .unwrap();
    let start = std::time::Instant::now();
    tracing::subscriber::with_default(tracing_subscriber::registry().with(otel.layer()), workload);
    assert!(start.elapsed() < Duration::from_secs(1), "ops never wait for the exporter");
    assert!(otel.flush().is_err());
    let stdout = OtelConfig::new("t").with_exporter(Exporter::Stdout).build().unwrap();
    tracing::subscriber::with_default(tracing_subscriber::registry().with(stdout.layer()), workload);
    stdout.shutdown().unwrap();
    let none = OtelConfig::new("t").with_exporter(Exporter::None).build().unwrap();
    tracing::subscriber::with_default(tracing_subscriber::registry().with(none.layer()), workload);
}
