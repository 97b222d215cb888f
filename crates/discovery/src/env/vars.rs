//! The variables as launcher readers see them: lookup with a record of what was read, number
//! and port parsing, and the checks that turn a rank, a size and local values into a place.

use std::collections::HashMap;

use comm_core::{CommError, Launcher, StoreKind, WorldInfo, WorldSource};

use super::DEFAULT_MASTER_ADDR;

/// The variables, by name.
pub(super) struct Vars(pub(super) HashMap<String, String>);

impl Vars {
    pub(super) fn has(&self, name: &str) -> bool {
        self.0.contains_key(name)
    }

    pub(super) fn has_any(&self, names: &[&str]) -> bool {
        names.iter().any(|n| self.has(n))
    }
}

/// Reads variables and records each one read as `NAME=value`, for [`WorldSource::variables`].
pub(super) struct Recorder<'a> {
    vars: &'a Vars,
    pub(super) read: Vec<String>,
}

impl<'a> Recorder<'a> {
    pub(super) fn new(vars: &'a Vars) -> Self {
        Recorder { vars, read: Vec::new() }
    }

    pub(super) fn get(&mut self, name: &str) -> Option<&'a str> {
        let v = self.vars.0.get(name)?;
        self.read.push(format!("{name}={v}"));
        Some(v.as_str())
    }

    /// The first of `names` that is set, with its name.
    pub(super) fn first(&mut self, names: &[&'static str]) -> Option<(&'static str, &'a str)> {
        names.iter().find_map(|&n| self.get(n).map(|v| (n, v)))
    }

    /// A non-negative integer variable; `what` says what the number is, for the error.
    pub(super) fn uint(&mut self, name: &str, what: &str) -> Result<Option<u32>, CommError> {
        match self.get(name) {
            None => Ok(None),
            Some(v) => parse_uint(name, v, what).map(Some),
        }
    }

    /// `MASTER_ADDR`, when set (an empty one is an error).
    pub(super) fn master_addr(&mut self) -> Result<Option<String>, CommError> {
        match self.get("MASTER_ADDR").map(str::trim) {
            None => Ok(None),
            Some("") => Err(CommError::Config(
                "MASTER_ADDR is set but empty; set it to rank 0's host name or IP address".into(),
            )),
            Some(a) => Ok(Some(a.to_owned())),
        }
    }

    /// A TCP port variable, when set.
    pub(super) fn port(&mut self, name: &str) -> Result<Option<u16>, CommError> {
        self.get(name).map(|p| parse_port(name, p)).transpose()
    }

    pub(super) fn source(self, launcher: Launcher) -> WorldSource {
        WorldSource { launcher, variables: self.read }
    }
}

pub(super) fn parse_uint(name: &str, v: &str, what: &str) -> Result<u32, CommError> {
    v.trim()
        .parse::<u32>()
        .map_err(|_| CommError::Config(format!("{name}={v:?} is not a valid {what} (expected a non-negative integer)")))
}

pub(super) fn parse_port(name: &str, p: &str) -> Result<u16, CommError> {
    match p.trim().parse::<u64>() {
        Ok(n @ 1..=65535) => Ok(n as u16),
        Ok(n) => Err(CommError::Config(format!("{name}={n} is not a usable TCP port (1..=65535)"))),
        Err(_) => {
            Err(CommError::Config(format!("{name}={p:?} is not a valid TCP port (expected an integer in 1..=65535)")))
        }
    }
}

/// The checked place of this process: the values, with the names they came from for errors.
pub(super) struct Place<'n> {
    pub(super) rank: (u32, &'n str),
    pub(super) world_size: (u32, &'n str),
    pub(super) local_rank: Option<(u32, &'n str)>,
    pub(super) local_world_size: Option<(u32, &'n str)>,
}

impl Place<'_> {
    /// Checks the ranges and fills in missing local values (see [`from_vars`](super::from_vars)).
    pub(super) fn resolve(self) -> Result<(u32, u32, u32, u32), CommError> {
        let ((rank, rank_name), (ws, ws_name)) = (self.rank, self.world_size);
        if ws == 0 {
            return Err(CommError::Config(format!("{ws_name}=0: a job has at least one process")));
        }
        if rank >= ws {
            return Err(CommError::Config(format!(
                "{rank_name}={rank} is out of range for {ws_name}={ws} (ranks are 0..={})",
                ws - 1
            )));
        }
        let (local_rank, local_world_size) = match (self.local_rank, self.local_world_size) {
            (None, None) => (rank, ws),
            (lr, Some((lws, lws_name))) => {
                if lws == 0 {
                    return Err(CommError::Config(format!("{lws_name}=0: a host runs at least one process")));
                }
                if lws > ws {
                    return Err(CommError::Config(format!(
                        "{lws_name}={lws} exceeds {ws_name}={ws} (more processes on this host than in the job)"
                    )));
                }
                let (lr, lr_name) = lr.unwrap_or((rank % lws, "the local rank"));
                if lr >= lws {
                    return Err(CommError::Config(format!(
                        "{lr_name}={lr} is out of range for {lws_name}={lws} (local ranks are 0..={})",
                        lws - 1
                    )));
                }
                (lr, lws)
            }
            (Some((lr, lr_name)), None) => {
                if lr >= ws {
                    return Err(CommError::Config(format!(
                        "{lr_name}={lr} is out of range: the local world size is unset, so it is taken as \
                         {ws_name}={ws}"
                    )));
                }
                (lr, ws)
            }
        };
        Ok((rank, ws, local_rank, local_world_size))
    }
}

/// A value with the name of the variable it came from.
pub(super) type Named<'n> = (u32, &'n str);

/// Rank and size variables must come together.
pub(super) fn both<'n>(
    rank: (Option<u32>, &'n str),
    size: (Option<u32>, &'n str),
    hint: &str,
) -> Result<(Named<'n>, Named<'n>), CommError> {
    match (rank, size) {
        ((Some(r), rn), (Some(s), sn)) => Ok(((r, rn), (s, sn))),
        ((Some(r), rn), (None, sn)) => Err(CommError::Config(format!("{rn}={r} is set but {sn} is not; {hint}"))),
        ((None, rn), (Some(s), sn)) => Err(CommError::Config(format!("{sn}={s} is set but {rn} is not; {hint}"))),
        ((None, rn), (None, sn)) => Err(CommError::Config(format!("neither {rn} nor {sn} is set; {hint}"))),
    }
}

/// The store address of a launcher that does not say where rank 0 runs: `MASTER_ADDR`, this
/// host when every rank is here, else none (empty): the mpi and hier backends need no store,
/// and [`rendezvous`](crate::rendezvous) refuses, naming what to set, where one is needed.
pub(super) fn mpi_master_addr(r: &mut Recorder<'_>, ws: u32, lws: u32) -> Result<String, CommError> {
    match r.master_addr()? {
        Some(a) => Ok(a),
        None if lws == ws => Ok(DEFAULT_MASTER_ADDR.to_owned()),
        None => Ok(String::new()),
    }
}

pub(super) fn world(
    r: Recorder<'_>,
    launcher: Launcher,
    place: (u32, u32, u32, u32),
    master_addr: String,
    master_port: u16,
    store: StoreKind,
) -> WorldInfo {
    let (rank, world_size, local_rank, local_world_size) = place;
    WorldInfo {
        rank,
        world_size,
        local_rank,
        local_world_size,
        master_addr,
        master_port,
        store,
        source: r.source(launcher),
    }
}
