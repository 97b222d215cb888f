//! torchrun, `commrun` and the DeepSpeed launcher.

use comm_core::{CommError, Launcher, StoreKind, WorldInfo};

use super::vars::{both, world, Place, Recorder, Vars};
use super::{DEFAULT_MASTER_ADDR, DEFAULT_MASTER_PORT, OTHER_RANK_VARS};

/// torchrun, `commrun` and the DeepSpeed launcher.
pub(super) fn torchrun(vars: &Vars) -> Option<Result<WorldInfo, CommError>> {
    if !vars.has("RANK") && !vars.has("WORLD_SIZE") {
        return None;
    }
    // A lone WORLD_SIZE next to another launcher's rank: that launcher's (PMIx reads it).
    if !vars.has("RANK") && vars.has_any(OTHER_RANK_VARS) {
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
    // torchrun's node rank: only checked, the global rank already accounts for it.
    r.uint("GROUP_RANK", "node rank")?;
    let master_addr = r.master_addr()?;
    let master_port = r.port("MASTER_PORT")?;
    let store = match r.get("TORCHELASTIC_USE_AGENT_STORE") {
        None => StoreKind::Rank0,
        Some(v) => match v.trim().to_ascii_lowercase().as_str() {
            "true" | "1" | "yes" => StoreKind::Torch,
            "false" | "0" | "no" | "" => StoreKind::Rank0,
            _ => {
                return Err(CommError::Config(format!("TORCHELASTIC_USE_AGENT_STORE={v:?} is neither True nor False")))
            }
        },
    };

    let hint = "a launcher sets both (torchrun, DeepSpeed, commrun), or neither for a single process";
    let (rank, ws) = both((rank, "RANK"), (world_size, "WORLD_SIZE"), hint)?;
    // LOCAL_WORLD_SIZE (torchrun) and LOCAL_SIZE (DeepSpeed) mean the same; both may be set.
    let lws = match (lws, local_size) {
        (Some(a), Some(b)) if a != b => {
            return Err(CommError::Config(format!("LOCAL_WORLD_SIZE={a} and LOCAL_SIZE={b} disagree")));
        }
        (Some(a), _) => Some((a, "LOCAL_WORLD_SIZE")),
        (None, Some(b)) => Some((b, "LOCAL_SIZE")),
        (None, None) => None,
    };
    let place =
        Place { rank, world_size: ws, local_rank: local_rank.map(|l| (l, "LOCAL_RANK")), local_world_size: lws }
            .resolve()?;
    let launcher = if vars.has("LOCAL_SIZE") {
        Launcher::DeepSpeed
    } else if r.get("COMM_LAUNCHER").is_some_and(|l| l.trim() == "commrun") {
        Launcher::Commrun
    } else {
        Launcher::Torchrun
    };
    let addr = master_addr.unwrap_or_else(|| DEFAULT_MASTER_ADDR.to_owned());
    Ok(world(r, launcher, place, addr, master_port.unwrap_or(DEFAULT_MASTER_PORT), store))
}

#[cfg(test)]
mod tests {
    use super::super::fixtures::*;
    use super::super::from_vars;
    use comm_core::{Launcher, StoreKind};

    #[test]
    fn commrun_says_so() {
        let w = from_vars(parse("RANK=1\nWORLD_SIZE=2\nMASTER_PORT=5\nCOMM_LAUNCHER=commrun")).unwrap();
        assert_eq!(w.source.launcher, Launcher::Commrun);
        assert!(w.source.variables.contains(&"COMM_LAUNCHER=commrun".to_owned()), "{:?}", w.source.variables);
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
                "GROUP_RANK=1",
                "MASTER_ADDR=node01.cluster",
                "MASTER_PORT=29400",
                "TORCHELASTIC_USE_AGENT_STORE=True"
            ]
        );
        // torchrun's agent already serves a torch TCPStore on MASTER_PORT.
        assert_eq!(w.store, StoreKind::Torch);
        let w = from_vars(with(TORCHRUN, &["TORCHELASTIC_USE_AGENT_STORE=False"])).unwrap();
        assert_eq!(w.store, StoreKind::Rank0);
        let e = config_err(with(TORCHRUN, &["TORCHELASTIC_USE_AGENT_STORE=maybe"]));
        assert!(e.contains("TORCHELASTIC_USE_AGENT_STORE=\"maybe\""), "{e}");
        let e = config_err(with(TORCHRUN, &["GROUP_RANK=x"]));
        assert!(e.contains("GROUP_RANK=\"x\""), "{e}");
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
}
