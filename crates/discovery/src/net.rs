//! Opening connections, optionally from a chosen local address.

use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use comm_core::CommError;
use tokio::net::{TcpSocket, TcpStream};
use tokio::time::Instant;

/// How a connection attempt to a store ended, short of success.
pub(crate) enum Hello {
    /// The server answered and said no, or is not a store: retrying will not help.
    Refused(CommError),
    /// The connection failed: worth another attempt.
    Retry(String),
}

/// Shortest time given to one attempt, even when the budget is spent.
const MIN_ATTEMPT: Duration = Duration::from_millis(100);
/// First and largest pause between attempts.
const BACKOFF: (Duration, Duration) = (Duration::from_millis(10), Duration::from_millis(500));

/// Runs `attempt` (given the time left, at least 100 ms) until it succeeds or is refused, with
/// backoff between attempts, for `timeout`; then fails with `gave_up(the last reason)`.
pub(crate) async fn retry<T, Fut>(
    timeout: Duration,
    mut attempt: impl FnMut(Duration) -> Fut,
    gave_up: impl FnOnce(String) -> CommError,
) -> Result<T, CommError>
where
    Fut: Future<Output = Result<T, Hello>>,
{
    let deadline = Instant::now() + timeout.min(crate::wire::MAX_WAIT);
    let mut backoff = BACKOFF.0;
    let last = loop {
        let left = deadline.saturating_duration_since(Instant::now()).max(MIN_ATTEMPT);
        let why = match attempt(left).await {
            Ok(done) => return Ok(done),
            Err(Hello::Refused(e)) => return Err(e),
            Err(Hello::Retry(why)) => why,
        };
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            break why;
        }
        tokio::time::sleep(backoff.min(left)).await;
        backoff = (backoff * 2).min(BACKOFF.1);
    };
    Err(gave_up(last))
}

/// The local address to connect from: `COMM_BIND_ADDR` (an IP address), or `None` to let the
/// system choose.
///
/// Useful on hosts with several interfaces, and to simulate several hosts on one machine
/// (ranks connecting from 127.0.0.2, 127.0.0.3...).
pub fn bind_addr() -> Result<Option<IpAddr>, comm_core::CommError> {
    match std::env::var("COMM_BIND_ADDR") {
        Err(_) => Ok(None),
        Ok(v) if v.trim().is_empty() => Ok(None),
        Ok(v) => v.trim().parse().map(Some).map_err(|_| {
            comm_core::CommError::Config(format!("COMM_BIND_ADDR={v:?} is not an IP address of this host"))
        }),
    }
}

/// Connects to `addr:port` (a host name is resolved on every call: it may appear late), from
/// `bind` when given. Tries each resolved address of a usable family in turn.
pub(crate) async fn dial(addr: &str, port: u16, bind: Option<IpAddr>) -> std::io::Result<TcpStream> {
    let mut last = None;
    for target in tokio::net::lookup_host((addr, port)).await? {
        let attempt = async {
            let stream = match bind {
                None => TcpStream::connect(target).await?,
                Some(ip) => {
                    let socket = if target.is_ipv4() { TcpSocket::new_v4()? } else { TcpSocket::new_v6()? };
                    socket.bind(SocketAddr::new(ip, 0))?;
                    socket.connect(target).await?
                }
            };
            let _ = stream.set_nodelay(true);
            Ok::<_, std::io::Error>(stream)
        };
        match bind {
            // A v4 source cannot reach a v6 target or the reverse: skip without an attempt.
            Some(ip) if ip.is_ipv4() != target.is_ipv4() => continue,
            _ => {}
        }
        match attempt.await {
            Ok(s) => return Ok(s),
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| {
        let why = match bind {
            Some(ip) => format!("{addr} has no address of the same family as COMM_BIND_ADDR={ip}"),
            None => format!("{addr} resolves to no address"),
        };
        std::io::Error::new(std::io::ErrorKind::NotFound, why)
    }))
}
