//! Opening connections, optionally from a chosen local address.

use std::net::{IpAddr, SocketAddr};

use tokio::net::{TcpSocket, TcpStream};

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
