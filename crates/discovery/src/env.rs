//! [`WorldInfo`] from the variables a launcher sets.

use std::collections::HashMap;

use comm_core::{CommError, Launcher, WorldInfo, WorldSource};

/// The address rank 0's store listens on when `MASTER_ADDR` is unset (torch's default).
const DEFAULT_MASTER_ADDR: &str = "127.0.0.1";
/// The port of rank 0's store when `MASTER_PORT` is unset (torch's default).
const DEFAULT_MASTER_PORT: u16 = 29500;

/// One launcher's reader: `None` when none of its variables are present, so the next one is tried.
type Reader = fn(&Vars) -> Option<Result<WorldInfo, CommError>>;

/// The launchers, in precedence order: the first whose variables are present wins.
///
/// torchrun comes first because `commrun` and the DeepSpeed launcher set its variables, and
/// because it is often run *inside* an `mpirun` or `srun` allocation, whose variables then
/// describe the allocation rather than the ranks.
const READERS: &[Reader] = &[torchrun];

/// This process's [`WorldInfo`], read from the process environment.
///
/// See [`from_vars`] for the rules. Variables whose names or values are not valid UTF-8 are
/// read lossily (so a garbled `RANK` is reported, not ignored).
pub fn from_env() -> Result<WorldInfo, CommError> {
    from_vars(std::env::vars_os().map(|(k, v)| (k.to_string_lossy().into_owned(), v.to_string_lossy().into_owned())))
}

/// A [`WorldInfo`] from `(name, value)` pairs, as a launcher would set them (later pairs win).
///
/// Launchers are tried in precedence order; the first whose variables are present wins and is
/// recorded in [`WorldInfo::source`] with the `NAME=value` pairs that were read. Today:
///
/// - torchrun / `commrun` ([`Launcher::Torchrun`]) and the DeepSpeed launcher
///   ([`Launcher::DeepSpeed`], recognised by `LOCAL_SIZE`): `RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
///   `LOCAL_WORLD_SIZE` (or DeepSpeed's `LOCAL_SIZE`), `MASTER_ADDR` (default `127.0.0.1`),
///   `MASTER_PORT` (default `29500`).
///
///   When `LOCAL_RANK` and `LOCAL_WORLD_SIZE`/`LOCAL_SIZE` are both absent, every rank is assumed
///   to be on this host (`local_rank = rank`, `local_world_size = world_size`). When only the
///   local size is given, ranks are assumed to be placed in blocks per host, as torchrun and
///   DeepSpeed do (`local_rank = rank % local_world_size`); when only `LOCAL_RANK` is given, the
///   local size is assumed to be `world_size`.
///
/// With none of a launcher's variables present (no `RANK`, no `WORLD_SIZE`) the result is
/// [`WorldInfo::single`]. Contradictions and unparsable values are [`CommError::Config`] errors
/// that name the variables and their values: `RANK` without `WORLD_SIZE` (or the reverse),
/// `RANK >= WORLD_SIZE`, `WORLD_SIZE=0`, `LOCAL_RANK >= LOCAL_WORLD_SIZE`, a port of 0 or above
/// 65535, and so on.
pub fn from_vars<I, K, V>(vars: I) -> Result<WorldInfo, CommError>
where
    I: IntoIterator<Item = (K, V)>,
    K: AsRef<str>,
    V: AsRef<str>,
{
    let vars = Vars(vars.into_iter().map(|(k, v)| (k.as_ref().to_owned(), v.as_ref().to_owned())).collect());
    READERS.iter().find_map(|read| read(&vars)).unwrap_or_else(|| Ok(WorldInfo::single()))
}

/// The variables, by name.
struct Vars(HashMap<String, String>);

impl Vars {
    fn has(&self, name: &str) -> bool {
        self.0.contains_key(name)
    }
}

/// Reads variables and records each one read as `NAME=value`, for [`WorldSource::variables`].
struct Recorder<'a> {
    vars: &'a Vars,
    read: Vec<String>,
}

impl<'a> Recorder<'a> {
    fn new(vars: &'a Vars) -> Self {
        Recorder { vars, read: Vec::new() }
    }

    fn get(&mut self, name: &str) -> Option<&'a str> {
        let v = self.vars.0.get(name)?;
        self.read.push(format!("{name}={v}"));
        Some(v.as_str())
    }

    /// A non-negative integer variable; `what` says what the number is, for the error.
    fn uint(&mut self, name: &str, what: &str) -> Result<Option<u32>, CommError> {
        match self.get(name) {
            None => Ok(None),
            Some(v) => v.trim().parse::<u32>().map(Some).map_err(|_| {
                CommError::Config(format!("{name}={v:?} is not a valid {what} (expected a non-negative integer)"))
            }),
        }
    }

    fn source(self, launcher: Launcher) -> WorldSource {
        WorldSource { launcher, variables: self.read }
    }
}

/// torchrun, `commrun` and the DeepSpeed launcher.
fn torchrun(vars: &Vars) -> Option<Result<WorldInfo, CommError>> {
    if !vars.has("RANK") && !vars.has("WORLD_SIZE") {
        return None;
    }
    Some(read_torchrun(vars))
}

fn read_torchrun(vars: &Vars) -> Result<WorldInfo, CommError> {
    let mut r = Recorder::new(vars);
    let rank = r.uint("RANK", "rank")?;
    let world_size = r.uint("WORLD_SIZE", "world size")?;
    let local_rank = r.uint("LOCAL_RANK", "local rank")?;
    let lws = r.uint("LOCAL_WORLD_SIZE", "local world size")?;
    let local_size = r.uint("LOCAL_SIZE", "local world size")?;
    let master_addr = r.get("MASTER_ADDR");
    let master_port = r.get("MASTER_PORT");

    let both = "a launcher sets both (torchrun, DeepSpeed, commrun), or neither for a single process";
    let (rank, world_size) = match (rank, world_size) {
        (Some(rank), Some(ws)) => (rank, ws),
        (Some(rank), None) => {
            return Err(CommError::Config(format!("RANK={rank} is set but WORLD_SIZE is not; {both}")))
        }
        (None, Some(ws)) => return Err(CommError::Config(format!("WORLD_SIZE={ws} is set but RANK is not; {both}"))),
        // Unreachable through `torchrun`, which checks one of them is present; kept total.
        (None, None) => return Ok(WorldInfo::single()),
    };
    if world_size == 0 {
        return Err(CommError::Config("WORLD_SIZE=0: a job has at least one process".into()));
    }
    if rank >= world_size {
        return Err(CommError::Config(format!(
            "RANK={rank} is out of range for WORLD_SIZE={world_size} (ranks are 0..={})",
            world_size - 1
        )));
    }

    // LOCAL_WORLD_SIZE (torchrun) and LOCAL_SIZE (DeepSpeed) mean the same; both may be set.
    let (lws, lws_name) = match (lws, local_size) {
        (Some(a), Some(b)) if a != b => {
            return Err(CommError::Config(format!("LOCAL_WORLD_SIZE={a} and LOCAL_SIZE={b} disagree")));
        }
        (Some(a), _) => (Some(a), "LOCAL_WORLD_SIZE"),
        (None, Some(b)) => (Some(b), "LOCAL_SIZE"),
        (None, None) => (None, "LOCAL_WORLD_SIZE"),
    };
    let (local_rank, local_world_size) = match (local_rank, lws) {
        (None, None) => (rank, world_size),
        (lr, Some(lws)) => {
            if lws == 0 {
                return Err(CommError::Config(format!("{lws_name}=0: a host runs at least one process")));
            }
            if lws > world_size {
                return Err(CommError::Config(format!(
                    "{lws_name}={lws} exceeds WORLD_SIZE={world_size} (more processes on this host than in the job)"
                )));
            }
            let lr = lr.unwrap_or(rank % lws);
            if lr >= lws {
                return Err(CommError::Config(format!(
                    "LOCAL_RANK={lr} is out of range for {lws_name}={lws} (local ranks are 0..={})",
                    lws - 1
                )));
            }
            (lr, lws)
        }
        (Some(lr), None) => {
            if lr >= world_size {
                return Err(CommError::Config(format!(
                    "LOCAL_RANK={lr} is out of range: LOCAL_WORLD_SIZE is unset, so it is taken as \
                     WORLD_SIZE={world_size}"
                )));
            }
            (lr, world_size)
        }
    };

    let master_addr = match master_addr.map(str::trim) {
        None => DEFAULT_MASTER_ADDR.to_owned(),
        Some("") => {
            return Err(CommError::Config(
                "MASTER_ADDR is set but empty; set it to rank 0's host name or IP address".into(),
            ));
        }
        Some(a) => a.to_owned(),
    };
    let master_port = match master_port {
        None => DEFAULT_MASTER_PORT,
        Some(p) => match p.trim().parse::<u64>() {
            Ok(n @ 1..=65535) => n as u16,
            Ok(n) => {
                return Err(CommError::Config(format!("MASTER_PORT={n} is not a usable TCP port (1..=65535)")));
            }
            Err(_) => {
                return Err(CommError::Config(format!(
                    "MASTER_PORT={p:?} is not a valid TCP port (expected an integer in 1..=65535)"
                )));
            }
        },
    };

    let launcher = if vars.has("LOCAL_SIZE") { Launcher::DeepSpeed } else { Launcher::Torchrun };
    Ok(WorldInfo {
        rank,
        world_size,
        local_rank,
        local_world_size,
        master_addr,
        master_port,
        source: r.source(launcher),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What torchrun 2.x gives worker 1 of node 1 with `--nnodes 2 --nproc-per-node 4`, plus some
    /// of the shell's own variables.
    const TORCHRUN: &str = "\
        PATH=/usr/local/bin:/usr/bin:/bin
        HOME=/home/alice
        OMP_NUM_THREADS=1
        LOCAL_RANK=1
        RANK=5
        GROUP_RANK=1
        ROLE_RANK=5
        ROLE_NAME=default
        LOCAL_WORLD_SIZE=4
        WORLD_SIZE=8
        GROUP_WORLD_SIZE=2
        ROLE_WORLD_SIZE=8
        MASTER_ADDR=node01.cluster
        MASTER_PORT=29400
        TORCHELASTIC_RESTART_COUNT=0
        TORCHELASTIC_MAX_RESTARTS=0
        TORCHELASTIC_RUN_ID=none
        TORCHELASTIC_USE_AGENT_STORE=True
        TORCH_NCCL_ASYNC_ERROR_HANDLING=1
        TORCHELASTIC_ERROR_FILE=/tmp/torchelastic_x1y2/none_abc/attempt_0/1/error.json";

    /// What `deepspeed --num_gpus 2` (launcher/launch.py) gives rank 3 of a 2-node job.
    const DEEPSPEED: &str = "\
        PATH=/usr/bin
        MASTER_ADDR=10.0.0.7
        MASTER_PORT=29500
        WORLD_SIZE=4
        CROSS_RANK=1
        CROSS_SIZE=2
        LOCAL_SIZE=2
        RANK=3
        LOCAL_RANK=1
        PYTHONUNBUFFERED=1";

    fn parse(dump: &str) -> Vec<(String, String)> {
        dump.lines().filter_map(|l| l.trim().split_once('=')).map(|(k, v)| (k.to_owned(), v.to_owned())).collect()
    }

    /// `dump` with `overrides` applied (`NAME=value`, or `NAME` alone to remove it).
    fn with(dump: &str, overrides: &[&str]) -> Vec<(String, String)> {
        let mut vars = parse(dump);
        for o in overrides {
            let (k, v) = o.split_once('=').map_or((*o, None), |(k, v)| (k, Some(v)));
            vars.retain(|(name, _)| name != k);
            if let Some(v) = v {
                vars.push((k.to_owned(), v.to_owned()));
            }
        }
        vars
    }

    fn config_err(vars: Vec<(String, String)>) -> String {
        match from_vars(vars) {
            Err(CommError::Config(msg)) => msg,
            other => panic!("expected a configuration error, got {other:?}"),
        }
    }

    #[test]
    fn torchrun_full_dump() {
        let w = from_vars(parse(TORCHRUN)).unwrap();
        assert_eq!((w.rank, w.world_size, w.local_rank, w.local_world_size), (5, 8, 1, 4));
        assert_eq!((w.master_addr.as_str(), w.master_port), ("node01.cluster", 29400));
        assert_eq!(w.source.launcher, Launcher::Torchrun);
        assert_eq!(
            w.source.variables,
            [
                "RANK=5",
                "WORLD_SIZE=8",
                "LOCAL_RANK=1",
                "LOCAL_WORLD_SIZE=4",
                "MASTER_ADDR=node01.cluster",
                "MASTER_PORT=29400"
            ]
        );
        assert!(!w.all_local());
        assert!(w.to_string().contains("RANK=5"), "{w}");
    }

    #[test]
    fn deepspeed_full_dump() {
        let w = from_vars(parse(DEEPSPEED)).unwrap();
        assert_eq!((w.rank, w.world_size, w.local_rank, w.local_world_size), (3, 4, 1, 2));
        assert_eq!((w.master_addr.as_str(), w.master_port), ("10.0.0.7", 29500));
        assert_eq!(w.source.launcher, Launcher::DeepSpeed);
        assert!(w.source.variables.contains(&"LOCAL_SIZE=2".to_owned()));
        // Newer DeepSpeed sets both names; they agree.
        let w = from_vars(with(DEEPSPEED, &["LOCAL_WORLD_SIZE=2"])).unwrap();
        assert_eq!((w.local_rank, w.local_world_size, w.source.launcher), (1, 2, Launcher::DeepSpeed));
        let e = config_err(with(DEEPSPEED, &["LOCAL_WORLD_SIZE=4"]));
        assert!(e.contains("LOCAL_WORLD_SIZE=4") && e.contains("LOCAL_SIZE=2"), "{e}");
    }

    #[test]
    fn nothing_set_is_a_single_process() {
        let w = from_vars(parse("PATH=/bin\nHOME=/root")).unwrap();
        assert_eq!(w, WorldInfo::single());
        // MASTER_* or LOCAL_RANK alone do not make a job.
        let w = from_vars([("MASTER_ADDR", "h"), ("MASTER_PORT", "1234"), ("LOCAL_RANK", "0")]).unwrap();
        assert_eq!(w, WorldInfo::single());
        assert_eq!(from_vars(Vec::<(String, String)>::new()).unwrap(), WorldInfo::single());
    }

    #[test]
    fn defaults_and_single_host_assumption() {
        let w = from_vars([("RANK", "2"), ("WORLD_SIZE", "3")]).unwrap();
        assert_eq!((w.rank, w.world_size, w.local_rank, w.local_world_size), (2, 3, 2, 3));
        assert_eq!((w.master_addr.as_str(), w.master_port), ("127.0.0.1", 29500));
        assert_eq!(w.source.variables, ["RANK=2", "WORLD_SIZE=3"]);
        assert!(w.all_local());
        // Only the local size: block placement.
        let w = from_vars(with(TORCHRUN, &["LOCAL_RANK"])).unwrap();
        assert_eq!((w.local_rank, w.local_world_size), (1, 4));
        // Only the local rank: the local size is the world size.
        let w = from_vars(with(TORCHRUN, &["LOCAL_WORLD_SIZE"])).unwrap();
        assert_eq!((w.local_rank, w.local_world_size), (1, 8));
        // Whitespace around numbers is tolerated, as Python's int() does; later pairs win.
        let w = from_vars([("RANK", "9"), ("RANK", " 1 "), ("WORLD_SIZE", "2\n"), ("MASTER_PORT", " 80")]).unwrap();
        assert_eq!((w.rank, w.world_size, w.master_port), (1, 2, 80));
    }

    #[test]
    fn rank_without_world_size_and_reverse() {
        let e = config_err(with(TORCHRUN, &["WORLD_SIZE"]));
        assert!(e.contains("RANK=5 is set but WORLD_SIZE is not"), "{e}");
        let e = config_err(with(TORCHRUN, &["RANK"]));
        assert!(e.contains("WORLD_SIZE=8 is set but RANK is not"), "{e}");
    }

    #[test]
    fn unparsable_numbers_name_the_variable() {
        for (var, bad) in [("RANK", "five"), ("WORLD_SIZE", "-1"), ("LOCAL_RANK", "1.0"), ("LOCAL_WORLD_SIZE", "")] {
            let e = config_err(with(TORCHRUN, &[&format!("{var}={bad}")]));
            assert!(e.starts_with(&format!("{var}=\"{bad}\" is not a valid")), "{e}");
        }
        let e = config_err(with(DEEPSPEED, &["LOCAL_SIZE=two"]));
        assert!(e.contains("LOCAL_SIZE=\"two\""), "{e}");
        let e = config_err(with(TORCHRUN, &["RANK=99999999999"]));
        assert!(e.contains("RANK=\"99999999999\""), "{e}");
    }

    #[test]
    fn out_of_range_ranks() {
        let e = config_err(with(TORCHRUN, &["RANK=8"]));
        assert!(e.contains("RANK=8") && e.contains("WORLD_SIZE=8"), "{e}");
        let e = config_err(with(TORCHRUN, &["WORLD_SIZE=0", "RANK=0"]));
        assert!(e.contains("WORLD_SIZE=0"), "{e}");
        let e = config_err(with(TORCHRUN, &["LOCAL_RANK=4"]));
        assert!(e.contains("LOCAL_RANK=4") && e.contains("LOCAL_WORLD_SIZE=4"), "{e}");
        let e = config_err(with(DEEPSPEED, &["LOCAL_RANK=2"]));
        assert!(e.contains("LOCAL_RANK=2") && e.contains("LOCAL_SIZE=2"), "{e}");
        let e = config_err(with(TORCHRUN, &["LOCAL_WORLD_SIZE=0"]));
        assert!(e.contains("LOCAL_WORLD_SIZE=0"), "{e}");
        let e = config_err(with(TORCHRUN, &["LOCAL_WORLD_SIZE=16", "LOCAL_RANK=9"]));
        assert!(e.contains("LOCAL_WORLD_SIZE=16") && e.contains("WORLD_SIZE=8"), "{e}");
        let e = config_err(with(TORCHRUN, &["LOCAL_WORLD_SIZE", "LOCAL_RANK=8"]));
        assert!(e.contains("LOCAL_RANK=8") && e.contains("WORLD_SIZE=8"), "{e}");
    }

    #[test]
    fn bad_master_port_and_addr() {
        for (bad, quoted) in [("0", "MASTER_PORT=0"), ("65536", "MASTER_PORT=65536"), ("http", "MASTER_PORT=\"http\"")]
        {
            let e = config_err(with(TORCHRUN, &[&format!("MASTER_PORT={bad}")]));
            assert!(e.contains(quoted), "{e}");
        }
        let e = config_err(with(TORCHRUN, &["MASTER_ADDR= "]));
        assert!(e.contains("MASTER_ADDR"), "{e}");
        let w = from_vars(with(TORCHRUN, &["MASTER_PORT=65535"])).unwrap();
        assert_eq!(w.master_port, 65535);
    }

    #[test]
    fn torchrun_wins_over_other_launchers_variables() {
        // torchrun inside an mpirun/srun allocation: the torchrun variables describe the ranks.
        let mut vars = parse(TORCHRUN);
        vars.extend(parse("OMPI_COMM_WORLD_RANK=0\nOMPI_COMM_WORLD_SIZE=2\nSLURM_PROCID=1\nSLURM_NTASKS=2"));
        let w = from_vars(vars).unwrap();
        assert_eq!((w.rank, w.world_size, w.source.launcher), (5, 8, Launcher::Torchrun));
    }

    #[test]
    fn from_env_agrees_with_from_vars() {
        assert_eq!(from_env().ok(), from_vars(std::env::vars()).ok());
    }
}
