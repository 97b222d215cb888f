//! A minimal blocking HTTP/1.1 client for OTLP export, on `std::net`.
//!
//! The OTLP exporter calls it from the batch processor's thread (through
//! `futures_executor::block_on`), so blocking here blocks nobody else. One connection per
//! export (`Connection: close`), no TLS, bounded by a timeout and a response size cap.

use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use bytes::Bytes;
use http::{Request, Response};
use opentelemetry_http::{HttpClient, HttpError};

use super::OtelError;

/// Responses larger than this are cut off (an OTLP response is a few bytes).
const MAX_RESPONSE: usize = 4 << 20;

#[derive(Clone, Debug)]
pub(super) struct StdHttpClient {
    timeout: Duration,
}

impl StdHttpClient {
    pub(super) fn new(timeout: Duration) -> Self {
        StdHttpClient { timeout }
    }
}

#[async_trait]
impl HttpClient for StdHttpClient {
    async fn send_bytes(&self, request: Request<Bytes>) -> Result<Response<Bytes>, HttpError> {
        send(&request, self.timeout).map_err(|e| Box::new(e) as HttpError)
    }
}

/// Refuses `https://` endpoints at build time (given, or from the environment), instead of
/// failing every export later.
pub(super) fn check_scheme(endpoint: Option<&str>) -> Result<(), OtelError> {
    let from_env = || {
        ["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT"]
            .iter()
            .find_map(|k| std::env::var(k).ok().filter(|v| !v.trim().is_empty()).map(|v| (*k, v)))
    };
    let (what, url) = match endpoint {
        Some(e) => ("the endpoint", e.to_owned()),
        None => match from_env() {
            Some((k, v)) => (k, v),
            None => return Ok(()),
        },
    };
    if url.trim().to_ascii_lowercase().starts_with("https://") {
        return Err(OtelError(format!(
            "{what} is {url}, but the built-in OTLP client speaks plain http:// only (no TLS): export to a local collector or agent that forwards over TLS"
        )));
    }
    Ok(())
}

fn invalid(msg: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, msg.into())
}

fn bad_response(msg: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg.into())
}

fn send(req: &Request<Bytes>, timeout: Duration) -> io::Result<Response<Bytes>> {
    let uri = req.uri();
    if uri.scheme_str() != Some("http") {
        return Err(invalid(format!("{uri}: only http:// endpoints are supported (no TLS)")));
    }
    let host = uri.host().ok_or_else(|| invalid(format!("{uri}: no host")))?;
    let port = uri.port_u16().unwrap_or(80);
    let deadline = Instant::now() + timeout;
    let left = || deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));

    let mut last = None;
    let mut stream = None;
    for addr in (host, port).to_socket_addrs()? {
        match TcpStream::connect_timeout(&addr, left()) {
            Ok(s) => {
                stream = Some(s);
                break;
            }
            Err(e) => last = Some(e),
        }
    }
    let mut stream =
        stream.ok_or_else(|| last.unwrap_or_else(|| invalid(format!("{host}: no address to connect to"))))?;
    stream.set_write_timeout(Some(left()))?;
    stream.set_read_timeout(Some(left()))?;

    let path = uri.path_and_query().map_or("/", |p| p.as_str());
    let authority = uri.authority().map_or(host, |a| a.as_str());
    let body = req.body();
    let mut head = format!(
        "{} {path} HTTP/1.1\r\nHost: {authority}\r\nContent-Length: {}\r\nConnection: close\r\n",
        req.method(),
        body.len()
    );
    for (name, value) in req.headers() {
        if matches!(name.as_str(), "host" | "content-length" | "connection" | "transfer-encoding") {
            continue;
        }
        let value = value.to_str().map_err(|_| invalid(format!("header {name} is not visible ASCII")))?;
        head.push_str(&format!("{name}: {value}\r\n"));
    }
    head.push_str("\r\n");
    stream.write_all(head.as_bytes())?;
    stream.write_all(body)?;
    stream.flush()?;

    read_response(BufReader::new(stream))
}

fn read_line(r: &mut impl BufRead) -> io::Result<String> {
    let mut line = String::new();
    r.by_ref().take(16 << 10).read_line(&mut line)?;
    if !line.ends_with('\n') {
        return Err(bad_response("truncated or overlong header line"));
    }
    Ok(line.trim_end_matches(['\r', '\n']).to_owned())
}

fn read_response(mut r: impl BufRead) -> io::Result<Response<Bytes>> {
    let status = read_line(&mut r)?;
    let code: u16 = status
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .filter(|_| status.starts_with("HTTP/1."))
        .ok_or_else(|| bad_response(format!("not an HTTP/1.x status line: {status:?}")))?;
    let mut builder = Response::builder().status(code);
    let (mut length, mut chunked) = (None, false);
    loop {
        let line = read_line(&mut r)?;
        if line.is_empty() {
            break;
        }
        let Some((name, value)) = line.split_once(':') else { continue };
        let (name, value) = (name.trim(), value.trim());
        if name.eq_ignore_ascii_case("content-length") {
            length = Some(value.parse::<usize>().map_err(|_| bad_response("bad Content-Length"))?);
        } else if name.eq_ignore_ascii_case("transfer-encoding") {
            chunked = value.to_ascii_lowercase().contains("chunked");
        }
        builder = builder.header(name, value);
    }
    let mut body = Vec::new();
    if chunked {
        loop {
            let size = read_line(&mut r)?;
            let size = usize::from_str_radix(size.split(';').next().unwrap_or("").trim(), 16)
                .map_err(|_| bad_response("bad chunk size"))?;
            if size == 0 {
                break;
            }
            if body.len() + size > MAX_RESPONSE {
                return Err(bad_response("response body over 4 MiB"));
            }
            let start = body.len();
            body.resize(start + size, 0);
            r.read_exact(&mut body[start..])?;
            read_line(&mut r)?;
        }
    } else if let Some(n) = length {
        if n > MAX_RESPONSE {
            return Err(bad_response("response body over 4 MiB"));
        }
        body.resize(n, 0);
        r.read_exact(&mut body)?;
    } else {
        r.take(MAX_RESPONSE as u64).read_to_end(&mut body)?;
    }
    builder.body(Bytes::from(body)).map_err(|e| bad_response(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_plain_and_chunked_responses() {
        let r = read_response(&b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nX-A: b\r\n\r\nabcEXTRA"[..]).unwrap();
        assert_eq!((r.status().as_u16(), r.body().as_ref()), (200, &b"abc"[..]));
        assert_eq!(r.headers()["x-a"], "b");
        let r = read_response(
            &b"HTTP/1.1 400 Bad\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2;x=y\r\nde\r\n0\r\n\r\n"[..],
        )
        .unwrap();
        assert_eq!((r.status().as_u16(), r.body().as_ref()), (400, &b"abcde"[..]));
        let r = read_response(&b"HTTP/1.0 204 No Content\r\n\r\n"[..]).unwrap();
        assert_eq!(r.status().as_u16(), 204);
        assert!(read_response(&b"SSH-2.0-OpenSSH\r\n"[..]).is_err());
        assert!(read_response(&b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc"[..]).is_err());
    }

    #[test]
    fn refuses_tls_and_unreachable_endpoints_without_hanging() {
        let req = |uri: &str| Request::post(uri).body(Bytes::from_static(b"x")).unwrap();
        let e = send(&req("https://localhost:1/v1/traces"), Duration::from_secs(1)).unwrap_err();
        assert!(e.to_string().contains("http://"), "{e}");
        // A port nobody listens on: refused at once.
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let start = Instant::now();
        assert!(send(&req(&format!("http://127.0.0.1:{port}/v1/traces")), Duration::from_secs(2)).is_err());
        assert!(start.elapsed() < Duration::from_secs(3));
        assert!(check_scheme(Some("https://x")).is_err());
        assert!(check_scheme(Some("http://x")).is_ok());
    }
}
