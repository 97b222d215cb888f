//! The per-job settings shared by all ranks and the environment each rank gets.

use std::fmt::Write as _;
use std::io;
use std::net::{Ipv4Addr, TcpListener};

use crate::cli::Options;

/// Default rendezvous address when neither `--master-addr` nor `$MASTER_ADDR` is given.
pub const DEFAULT_MASTER_ADDR: &str = "127.0.0.1";

/// Settings shared by all ranks of one job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Job {
    /// Number of ranks (`WORLD_SIZE`, also `LOCAL_WORLD_SIZE`: all ranks are local).
    pub world_size: u32,
    /// `MASTER_ADDR`.
    pub master_addr: String,
    /// `MASTER_PORT`.
    pub master_port: u16,
    /// `COMM_JOB_TOKEN`: identifies the job; the same for all its ranks.
    pub token: String,
    /// Whether commrun serves the store (the ranks get `COMM_STORE=external`).
    pub serves_store: bool,
}

impl Job {
    /// Resolves the job's settings from the options and the launcher's environment (`getenv`).
    ///
    /// Precedence: a flag, then the launcher's own `MASTER_ADDR` / `MASTER_PORT` /
    /// `COMM_JOB_TOKEN`, then a default (127.0.0.1, a free port, a fresh random token).
    /// A port of 0 (from the flag or the environment) means "pick a free port".
    pub fn resolve(opts: &Options, getenv: impl Fn(&str) -> Option<String>) -> Result<Job, String> {
        let nonempty = |key: &str| getenv(key).map(|v| v.trim().to_owned()).filter(|v| !v.is_empty());
        let master_addr = match &opts.master_addr {
            Some(addr) if !addr.trim().is_empty() => addr.trim().to_owned(),
            Some(_) => return Err("--master-addr must not be empty".to_owned()),
            None => nonempty("MASTER_ADDR").unwrap_or_else(|| DEFAULT_MASTER_ADDR.to_owned()),
        };
        let port = match (opts.master_port, nonempty("MASTER_PORT")) {
            (Some(port), _) => port,
            (None, Some(text)) => text
                .parse::<u16>()
                .map_err(|_| format!("MASTER_PORT={text} in the environment is not a valid port (0-65535)"))?,
            (None, None) => 0,
        };
        let master_port =
            if port == 0 { free_port().map_err(|e| format!("cannot find a free port: {e}"))? } else { port };
        let token = match nonempty("COMM_JOB_TOKEN") {
            Some(token) => token,
            None => new_token().map_err(|e| format!("cannot generate a job token: {e}"))?,
        };
        Ok(Job { world_size: opts.nproc, master_addr, master_port, token, serves_store: false })
    }

    /// Serves the job's rendezvous store from this process, so that it outlives any rank,
    /// unless the launcher's environment names a store of its own (`COMM_STORE`). `None`
    /// when it cannot bind the address (not this machine's): then rank 0 serves it, as
    /// without commrun. A port that is taken is an error: something else (another job's
    /// store, a torch store) listens there, and the ranks would meet it instead.
    pub fn serve_store(
        &mut self,
        getenv: impl Fn(&str) -> Option<String>,
    ) -> Result<Option<discovery::StoreServer>, String> {
        if getenv("COMM_STORE").is_some_and(|v| !v.trim().is_empty()) {
            return Ok(None);
        }
        let server = match discovery::StoreServer::bind(&self.master_addr, self.master_port, &self.token) {
            Ok(server) => server,
            Err(comm_core::CommError::Io { source, .. }) if source.kind() == std::io::ErrorKind::AddrInUse => {
                return Err(format!(
                    "port {} of {} is taken (another job's store, or torch's?): pass a free --master-port, or none \
                     for a free one",
                    self.master_port, self.master_addr
                ))
            }
            Err(_) => return Ok(None),
        };
        self.master_port = server.local_addr().port();
        self.serves_store = true;
        Ok(Some(server))
    }

    /// The environment variables of `rank` (in `0..world_size`).
    pub fn rank_env(&self, rank: u32) -> Vec<(&'static str, String)> {
        let store = self.serves_store.then(|| ("COMM_STORE", "external".to_owned()));
        vec![
            ("RANK", rank.to_string()),
            ("WORLD_SIZE", self.world_size.to_string()),
            ("LOCAL_RANK", rank.to_string()),
            ("LOCAL_WORLD_SIZE", self.world_size.to_string()),
            ("GROUP_RANK", "0".to_owned()),
            ("MASTER_ADDR", self.master_addr.clone()),
            ("MASTER_PORT", self.master_port.to_string()),
            ("COMM_JOB_TOKEN", self.token.clone()),
            // So `describe()` names commrun, not the torchrun whose variables it sets.
            ("COMM_LAUNCHER", "commrun".to_owned()),
        ]
        .into_iter()
        .chain(store)
        .collect()
    }
}

/// Asks the OS for a free TCP port: binds 127.0.0.1:0, reads the port and closes the listener.
///
/// The OS hands out ephemeral ports from a randomised sequence, so jobs started at the same
/// time (parallel tests) get different ports.
pub fn free_port() -> io::Result<u16> {
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?;
    Ok(listener.local_addr()?.port())
}

/// A fresh random 128-bit token as 32 lowercase hex digits.
pub fn new_token() -> io::Result<String> {
    let mut bytes = [0u8; 16];
    getrandom::fill(&mut bytes).map_err(|e| io::Error::other(e.to_string()))?;
    Ok(bytes.iter().fold(String::with_capacity(32), |mut s, b| {
        let _ = write!(s, "{b:02x}");
        s
    }))
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::time::Duration;

    use super::*;

    fn opts(n: u32) -> Options {
        Options {
            nproc: n,
            master_addr: None,
            master_port: None,
            quiet_ranks: false,
            enable_recovery: false,
            max_restarts: 0,
            allow_shrink: false,
            restart_backoff: Duration::from_millis(100),
            timeout_kill: Duration::from_secs(5),
            command: vec!["true".into()],
        }
    }

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: HashMap<String, String> = pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        move |k| map.get(k).cloned()
    }

    #[test]
    fn defaults() {
        let job = Job::resolve(&opts(3), env(&[])).unwrap();
        assert_eq!(job.world_size, 3);
        assert_eq!(job.master_addr, "127.0.0.1");
        assert_ne!(job.master_port, 0);
        assert_eq!(job.token.len(), 32);
        assert!(job.token.bytes().all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase()));
        let other = Job::resolve(&opts(3), env(&[])).unwrap();
        assert_ne!(job.token, other.token);
    }

    #[test]
    fn environment_then_flags() {
        let e = env(&[("MASTER_ADDR", "10.1.2.3"), ("MASTER_PORT", "2345"), ("COMM_JOB_TOKEN", "abc")]);
        let job = Job::resolve(&opts(2), &e).unwrap();
        assert_eq!((job.master_addr.as_str(), job.master_port, job.token.as_str()), ("10.1.2.3", 2345, "abc"));
        let mut o = opts(2);
        o.master_addr = Some("host".into());
        o.master_port = Some(4567);
        let job = Job::resolve(&o, &e).unwrap();
        assert_eq!((job.master_addr.as_str(), job.master_port, job.token.as_str()), ("host", 4567, "abc"));
        o.master_port = Some(0);
        assert_ne!(Job::resolve(&o, &e).unwrap().master_port, 0);
    }

    #[test]
    fn bad_environment_port() {
        let err = Job::resolve(&opts(2), env(&[("MASTER_PORT", "http")])).unwrap_err();
        assert!(err.contains("MASTER_PORT=http"), "{err}");
        let job = Job::resolve(&opts(2), env(&[("MASTER_PORT", " "), ("COMM_JOB_TOKEN", "")])).unwrap();
        assert_ne!(job.master_port, 0);
        assert_eq!(job.token.len(), 32);
    }

    #[test]
    fn commrun_serves_the_store_where_it_can() {
        let mut job = Job::resolve(&opts(2), env(&[("MASTER_PORT", "0")])).unwrap();
        let server = job.serve_store(env(&[])).unwrap().expect("127.0.0.1 is this machine's");
        assert_eq!(server.local_addr().port(), job.master_port);
        let ranks: HashMap<_, _> = job.rank_env(1).into_iter().collect();
        assert_eq!(ranks["COMM_STORE"], "external");
        // Its port taken (by the server above): an error naming it, not rank 0 serving there.
        let o = Options { master_port: Some(job.master_port), ..opts(2) };
        let mut second = Job::resolve(&o, env(&[])).unwrap();
        let err = second.serve_store(env(&[])).unwrap_err();
        assert!(err.contains(&format!("port {} of 127.0.0.1 is taken", job.master_port)), "{err}");
        // A store named by the environment, or an address of another machine: rank 0 serves.
        for (addr, getenv) in [("127.0.0.1", env(&[("COMM_STORE", "torch")])), ("192.0.2.1", env(&[]))] {
            let mut job = Job::resolve(&opts(2), env(&[("MASTER_ADDR", addr)])).unwrap();
            assert!(job.serve_store(getenv).unwrap().is_none(), "{addr}");
            assert!(!job.rank_env(0).iter().any(|(k, _)| *k == "COMM_STORE"));
        }
    }

    #[test]
    fn rank_environment() {
        let job =
            Job { world_size: 4, master_addr: "a".into(), master_port: 9, token: "t".into(), serves_store: false };
        let env: HashMap<_, _> = job.rank_env(2).into_iter().collect();
        assert_eq!(env["RANK"], "2");
        assert_eq!(env["WORLD_SIZE"], "4");
        assert_eq!(env["LOCAL_RANK"], "2");
        assert_eq!(env["LOCAL_WORLD_SIZE"], "4");
        assert_eq!(env["GROUP_RANK"], "0");
        assert_eq!(env["MASTER_ADDR"], "a");
        assert_eq!(env["MASTER_PORT"], "9");
        assert_eq!(env["COMM_JOB_TOKEN"], "t");
        assert_eq!(env["COMM_LAUNCHER"], "commrun");
        assert_eq!(env.len(), 9);
    }
}
