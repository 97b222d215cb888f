//! The OTLP exporter's HTTP client: `ureq` (blocking, rustls).
//!
//! The exporter calls it from the batch processor's own thread (through
//! `futures_executor::block_on`), so blocking here blocks nobody else.

use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use http::{Request, Response};
use opentelemetry_http::{HttpClient, HttpError};

/// Responses larger than this are an error (an OTLP response is a few bytes).
const MAX_RESPONSE: u64 = 4 << 20;

#[derive(Clone, Debug)]
pub(super) struct UreqClient {
    agent: ureq::Agent,
}

impl UreqClient {
    pub(super) fn new(timeout: Duration) -> Self {
        let agent = ureq::Agent::config_builder()
            .timeout_global(Some(timeout))
            // The exporter reads the status itself (and reports non-2xx).
            .http_status_as_error(false)
            // A POST must not turn into a GET on a redirect.
            .max_redirects(0)
            .build()
            .new_agent();
        UreqClient { agent }
    }
}

#[async_trait]
impl HttpClient for UreqClient {
    async fn send_bytes(&self, request: Request<Bytes>) -> Result<Response<Bytes>, HttpError> {
        let (parts, body) = request.into_parts();
        let response = self.agent.run(Request::from_parts(parts, &body[..]))?;
        let (parts, body) = response.into_parts();
        let body = body.into_with_config().limit(MAX_RESPONSE).read_to_vec()?;
        Ok(Response::from_parts(parts, Bytes::from(body)))
    }
}

#[cfg(test)]
mod tests {
    use std::io::{BufRead, BufReader, Read, Write};
    use std::net::TcpListener;
    use std::time::Instant;

    use super::*;

    fn post(client: &UreqClient, url: &str) -> Result<Response<Bytes>, HttpError> {
        let req = Request::post(url).header("content-type", "application/x-protobuf").body(Bytes::from_static(b"abc"));
        tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(client.send_bytes(req.unwrap()))
    }

    #[test]
    fn posts_the_body_and_returns_status_headers_and_body() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let server = std::thread::spawn(move || {
            let (mut conn, _) = listener.accept().unwrap();
            let mut r = BufReader::new(conn.try_clone().unwrap());
            let (mut head, mut line) = (String::new(), String::new());
            while r.read_line(&mut line).unwrap() > 2 {
                head.push_str(&line);
                line.clear();
            }
            let mut body = [0; 3];
            r.read_exact(&mut body).unwrap();
            conn.write_all(b"HTTP/1.1 400 Bad Request\r\nX-A: b\r\nContent-Length: 4\r\n\r\nnope").unwrap();
            (head, body)
        });
        let r = post(&UreqClient::new(Duration::from_secs(5)), &format!("http://127.0.0.1:{port}/v1/traces")).unwrap();
        assert_eq!((r.status().as_u16(), r.body().as_ref()), (400, &b"nope"[..]));
        assert_eq!(r.headers()["x-a"], "b");
        let (head, body) = server.join().unwrap();
        assert!(head.starts_with("POST /v1/traces HTTP/1.1\r\n"), "{head}");
        assert!(head.to_ascii_lowercase().contains("content-type: application/x-protobuf"), "{head}");
        assert_eq!(&body, b"abc");
    }

    #[test]
    fn https_endpoints_speak_tls() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let server = std::thread::spawn(move || {
            let (mut conn, _) = listener.accept().unwrap();
            let mut first = [0; 1];
            conn.read_exact(&mut first).unwrap();
            first[0]
        });
        // Not a TLS server, so the request fails, but only after a ClientHello was sent.
        assert!(post(&UreqClient::new(Duration::from_secs(2)), &format!("https://127.0.0.1:{port}/v1/traces")).is_err());
        assert_eq!(server.join().unwrap(), 0x16, "a TLS handshake record");
    }

    #[test]
    fn unreachable_endpoints_fail_without_hanging() {
        // A port nobody listens on: refused at once.
        let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let start = Instant::now();
        assert!(post(&UreqClient::new(Duration::from_secs(2)), &format!("http://127.0.0.1:{port}/v1/traces")).is_err());
        assert!(start.elapsed() < Duration::from_secs(3));
    }
}
