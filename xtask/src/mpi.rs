//! What the `mpi` backend needs from the system: the apt packages (installed when missing and
//! we are root), and `mpirun` with the right flags for the MPI at hand.

use std::process::{Command, Stdio};

use crate::{run, Failure, Result};

/// What building (rsmpi: bindgen needs libclang, mpi-sys finds MPI with mpicc/pkg-config) and
/// running (`mpirun`) the mpi backend needs on Debian/Ubuntu.
pub(crate) const PACKAGES: [&str; 4] = ["libopenmpi-dev", "openmpi-bin", "libclang-dev", "pkg-config"];

fn quiet(cmd: &mut Command) -> Option<std::process::Output> {
    cmd.stdin(Stdio::null()).output().ok()
}

fn installed(package: &str) -> bool {
    quiet(Command::new("dpkg").args(["-s", package])).is_some_and(|o| {
        o.status.success() && String::from_utf8_lossy(&o.stdout).contains("Status: install ok installed")
    })
}

fn is_root() -> bool {
    quiet(Command::new("id").arg("-u")).is_some_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
}

fn have(program: &str, arg: &str) -> bool {
    quiet(Command::new(program).arg(arg)).is_some_and(|o| o.status.success())
}

/// Makes sure the mpi backend can be built and run. Returns `false` (after saying why) when it
/// cannot: packages missing and not root, or no apt. Installs with apt only what is missing.
pub(crate) fn ensure_packages() -> Result<bool> {
    if !have("dpkg", "--version") {
        // Not Debian: trust an MPI that is on PATH.
        let ok = have("mpicc", "--version") && have("mpirun", "--version");
        if !ok {
            println!("note: no dpkg and no mpicc/mpirun on PATH: the mpi backend is not built or tested here");
        }
        return Ok(ok);
    }
    let missing: Vec<&str> = PACKAGES.iter().copied().filter(|p| !installed(p)).collect();
    if missing.is_empty() {
        println!("MPI packages present: {}", PACKAGES.join(", "));
        return Ok(true);
    }
    if !is_root() || !have("apt-get", "--version") {
        println!(
            "note: missing {} and not root (or no apt-get): the mpi backend is not built or tested here; \
             install with: sudo apt-get install -y --no-install-recommends {}",
            missing.join(", "),
            PACKAGES.join(" ")
        );
        return Ok(false);
    }
    let mut update = Command::new("apt-get");
    update.arg("update").env("DEBIAN_FRONTEND", "noninteractive");
    run(update)?;
    let mut install = Command::new("apt-get");
    install.args(["install", "-y", "--no-install-recommends"]).args(PACKAGES).env("DEBIAN_FRONTEND", "noninteractive");
    run(install)?;
    let still: Vec<&str> = PACKAGES.iter().copied().filter(|p| !installed(p)).collect();
    if !still.is_empty() {
        return Err(Failure { code: 1, msg: format!("apt-get did not install {}", still.join(", ")) });
    }
    Ok(true)
}

/// `mpirun -np N` with what a small shared machine needs: for Open MPI `--oversubscribe` (more
/// ranks than cores), `--bind-to none` (otherwise each of 2 ranks is pinned to one core,
/// with its comm thread) and, as root, `--allow-run-as-root`. Other MPIs (MPICH's Hydra)
/// need none of these.
pub(crate) fn mpirun(np: u32) -> Command {
    let open_mpi = quiet(Command::new("mpirun").arg("--version"))
        .is_some_and(|o| String::from_utf8_lossy(&o.stdout).contains("Open MPI"));
    let mut c = Command::new("mpirun");
    if open_mpi {
        c.args(["--oversubscribe", "--bind-to", "none"]);
        if is_root() {
            c.arg("--allow-run-as-root");
        }
    }
    c.arg("-np").arg(np.to_string());
    c
}
