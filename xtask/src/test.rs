//! `cargo xtask test` / `ci` (fmt, clippy, the workspace's tests, the feature and MPI runs,
//! the examples and the bench smoke runs) and `cargo xtask gpu-test`.

use std::ffi::OsStr;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use crate::{cargo, mpi, root, run, run_bounded, step, target_dir, Failure, Result};

/// Wall-clock bound of one launched job (examples, smoke bench).
const JOB_TIMEOUT: Duration = Duration::from_secs(300);
/// Sizes that keep the examples quick in `test` (the tensor-parallel MLP defaults to hidden 4096).
const EXAMPLE_ENV: [(&str, &str); 2] = [("TP_MLP_HIDDEN", "256"), ("TP_MLP_TOKENS", "5")];
/// The features that build the mpi backend into comm-api and comm-bench.
const MPI_FEATURES: &str = "comm-api/mpi,comm-bench/mpi,comm-bench/mpi-raw,comm-bench/hier";
/// The feature that builds the nccl backend into comm-api (builds without CUDA).
const NCCL_FEATURES: &str = "comm-api/nccl";
/// The features of the profiling layer, its OpenTelemetry export and comm-bench's --profile.
const PROFILING_FEATURES: &str = "profiling/otel,comm-api/otel,comm-bench/profiling";
/// comm-bench arguments of the smoke runs in `cargo xtask test`.
const SMOKE_BENCH: [&str; 10] =
    ["--op", "all", "--dtype", "f32,bf16", "--sizes", "8B..1MiB:x16", "--iters", "5", "--warmup", "1"];

pub(crate) fn test(quick: bool) -> Result {
    let total = Instant::now();
    let mut with_mpi = false;
    step("system packages of the mpi backend", || {
        with_mpi = mpi::ensure_packages()?;
        Ok(())
    })?;
    step("tidy", crate::tidy::tidy)?;
    if quick {
        println!("== fmt, clippy: skipped (--quick) ==");
    } else {
        step("fmt", || {
            let mut c = cargo();
            c.args(["fmt", "--all", "--", "--check"]);
            run(c)
        })?;
        step("clippy", || {
            let mut c = cargo();
            c.args(["clippy", "--workspace", "--all-targets"]);
            if with_mpi {
                c.args(["--features", MPI_FEATURES]);
            } else {
                c.args(["--exclude", "backend-mpi"]);
            }
            c.args(["--features", NCCL_FEATURES]);
            c.args(["--features", PROFILING_FEATURES]);
            c.args(["--", "-D", "warnings"]);
            run(c)
        })?;
    }
    step("test", || {
        let mut c = cargo();
        c.args(["test", "--workspace", "--exclude", "backend-mpi"]);
        run(c)
    })?;
    step("profiling and otel features: spans, CommsLogger, OTLP export; comm-api with them", || {
        let mut c = cargo();
        c.args(["test", "-p", "profiling", "--all-features"]);
        run(c)?;
        let mut c = cargo();
        c.args(["test", "-p", "comm-api", "--features", "profiling,otel"]);
        run(c)
    })?;
    step("loom: every interleaving of Work's completion slot (comm-core built with --cfg loom)", || {
        let mut c = cargo();
        // Its own target dir: RUSTFLAGS would otherwise rebuild the whole workspace.
        c.env("RUSTFLAGS", "--cfg loom").env("CARGO_TARGET_DIR", root().join("target/loom"));
        c.args(["test", "-p", "comm-core", "--test", "loom_work", "--release"]);
        run(c)
    })?;
    step("nccl feature: comm-api unit tests with the nccl backend compiled in", || {
        let mut c = cargo();
        c.args(["test", "-p", "comm-api", "--features", "nccl", "--lib"]);
        run(c)
    })?;
    if with_mpi {
        step("mpi backend: unit tests, singleton suite, suite under mpirun at 1-4 and 8 ranks, faults", || {
            let mut c = cargo();
            c.args(["test", "-p", "backend-mpi", "--", "--test-threads=1", "--nocapture"]);
            run(c)
        })?;
        step("hier backend: suite on 2 × 2 (also on per-host daemons, no MASTER_ADDR), 2 × 4 and 3 + 1 simulated hosts, composite-op checks, a killed rank (mpirun, MPI over TCP)", || {
            let mut c = cargo();
            c.args(["test", "-p", "comm-api", "--features", "mpi", "--test", "hier"]);
            c.args(["--", "--test-threads=1", "--nocapture"]);
            run(c)
        })?;
    }
    step("publishable: cargo package of every library crate and commrun; comm-api's docs with every feature", || {
        let mut c = cargo();
        c.args(["package", "--workspace", "--no-verify", "--allow-dirty"]);
        c.args(["--exclude", "xtask", "--exclude", "comm-bench", "--exclude", "comm-test"]);
        run(c)?;
        // Every feature where MPI is installed; else what docs.rs builds (no MPI there).
        let mut c = cargo();
        c.args(["doc", "-p", "comm-api", "--no-deps"]);
        c.args(if with_mpi { &["--all-features"][..] } else { &["--features", "shm,nccl,profiling,otel"][..] });
        c.env("RUSTDOCFLAGS", "-D warnings");
        run(c)
    })?;
    step("build commrun, comm-bench, examples", || {
        let mut c = cargo();
        c.args(["build", "-p", "commrun", "-p", "comm-bench", "-p", "comm-api", "--bins", "--examples"]);
        c.args(["--features", "comm-bench/profiling"]);
        if with_mpi {
            c.args(["--features", MPI_FEATURES]);
        }
        run(c)
    })?;
    let target = target_dir()?.join("debug");
    let commrun = target.join("commrun");
    // `elastic` kills a rank on purpose: it runs on its own, with a restart, below.
    let examples: Vec<String> =
        examples(&root().join("crates/comm-api/examples"))?.into_iter().filter(|e| e != "elastic").collect();
    for example in &examples {
        for np in [2, 3] {
            step(&format!("example {example}, {np} ranks"), || {
                let mut c = Command::new(&commrun);
                c.current_dir(root()).env("COMM_TIMEOUT", "120").envs(EXAMPLE_ENV);
                c.arg("-n").arg(np.to_string()).arg("--").arg(target.join("examples").join(example));
                run_bounded(c, JOB_TIMEOUT)
            })?;
        }
    }
    step(
        "example elastic: 4 ranks, one killed, the others shrink, a replacement rejoins (commrun --max-restarts 1)",
        || {
            let mut c = Command::new(&commrun);
            c.current_dir(root()).env("COMM_TIMEOUT", "120");
            c.args(["-n", "4", "--max-restarts", "1", "--"]).arg(target.join("examples").join("elastic"));
            run_bounded(c, JOB_TIMEOUT)
        },
    )?;
    step("README's user crate: its two blocks built as a crate outside the workspace, run under commrun -n 2", || {
        user_crate(&target_dir()?, &commrun)
    })?;
    step("bench smoke (comm-bench, 2 ranks, with --profile and --trace)", || {
        let trace = target.join("smoke-trace.json");
        let _ = std::fs::remove_file(&trace);
        let mut c = Command::new(&commrun);
        c.current_dir(root()).env("COMM_TIMEOUT", "120");
        c.args(["-n", "2", "--"]).arg(target.join("comm-bench")).args(SMOKE_BENCH).arg("--profile");
        c.arg("--trace").arg(&trace);
        run_bounded(c, JOB_TIMEOUT)?;
        // xtask has no JSON parser: the shape is checked here, the format by comm-api's tests.
        let text = std::fs::read_to_string(&trace)
            .map_err(|e| Failure { code: 1, msg: format!("{}: {e}", trace.display()) })?;
        let ok = text.starts_with("{\"") && text.contains("\"traceEvents\":[") && text.contains("\"ph\":\"X\"");
        if !ok || !text.contains("\"rank 1\"") {
            return Err(Failure { code: 1, msg: format!("{} is not a two-rank trace", trace.display()) });
        }
        Ok(())
    })?;
    step("bench smoke of streams (comm-bench --stream, then --tasks 3 with one direct stream, 2 ranks)", || {
        for (args, direct) in [(&["--stream"][..], "2"), (&["--tasks", "3"][..], "1")] {
            let mut c = Command::new(&commrun);
            c.current_dir(root()).env("COMM_TIMEOUT", "120").env("COMM_STREAMS_DIRECT", direct);
            c.args(["-n", "2", "--"]).arg(target.join("comm-bench"));
            c.args(["--sizes", "8B,64KiB", "--iters", "20", "--warmup", "2", "--progress", "off"]).args(args);
            run_bounded(c, JOB_TIMEOUT)?;
        }
        Ok(())
    })?;
    if with_mpi {
        for example in &examples {
            step(&format!("example {example} under mpirun -np 2 (backend auto: mpi)"), || {
                let mut c = mpi::mpirun(2);
                c.current_dir(root()).env("COMM_TIMEOUT", "120").env_remove("COMM_BACKEND").envs(EXAMPLE_ENV);
                c.arg(target.join("examples").join(example));
                run_bounded(c, JOB_TIMEOUT)
            })?;
        }
        for backend in ["mpi", "mpi-raw", "hier"] {
            step(&format!("bench smoke (comm-bench, {backend}, mpirun -np 2)"), || {
                let mut c = mpi::mpirun(2);
                c.current_dir(root()).env("COMM_TIMEOUT", "120").env("COMM_BACKEND", backend);
                c.arg(target.join("comm-bench")).args(SMOKE_BENCH);
                run_bounded(c, JOB_TIMEOUT)
            })?;
        }
        for backend in ["shm", "mpi"] {
            step(&format!("bench smoke (comm-bench, {backend} interleaved with mpi-raw, mpirun -np 2)"), || {
                let json = target.join("smoke-interleaved.{backend}.json");
                let report = |k: &str| json.to_string_lossy().replace("{backend}", k);
                for k in [backend, "mpi-raw"] {
                    let _ = std::fs::remove_file(report(k));
                }
                let mut c = mpi::mpirun(2);
                c.current_dir(root()).env("COMM_TIMEOUT", "120").env("COMM_BACKEND", backend);
                c.arg(target.join("comm-bench")).args(SMOKE_BENCH);
                c.args(["--interleave", "mpi-raw", "--json"]).arg(&json);
                run_bounded(c, JOB_TIMEOUT)?;
                // Both reports, readable side by side.
                let mut c = Command::new(target.join("comm-bench"));
                c.arg("compare").arg(format!("{backend}={}", report(backend)));
                c.arg(format!("mpi-raw={}", report("mpi-raw")));
                run(c)
            })?;
        }
    }
    println!("\n== all steps passed in {:.1}s ==", total.elapsed().as_secs_f64());
    Ok(())
}

pub(crate) fn gpu_test(no_run: bool) -> Result {
    if no_run {
        return step("build the GPU tests (backend-nccl tests/gpu.rs)", || {
            let mut c = cargo();
            c.args(["test", "-p", "backend-nccl", "--test", "gpu", "--no-run"]);
            run(c)
        });
    }
    step("GPU tests: backend-nccl (COMM_NCCL_REQUIRE_GPU=1)", || {
        let mut c = cargo();
        c.env("COMM_NCCL_REQUIRE_GPU", "1");
        c.args(["test", "-p", "backend-nccl", "--", "--test-threads=1", "--nocapture"]);
        run(c)
    })?;
    step("GPU tests: comm-api with the nccl feature", || {
        let mut c = cargo();
        c.args(["test", "-p", "comm-api", "--features", "nccl", "--lib", "--", "nccl", "--nocapture"]);
        run(c)
    })
}

/// Example names in `dir`: `name.rs` files and `name/main.rs` directories, sorted.
fn examples(dir: &Path) -> Result<Vec<String>> {
    let entries =
        std::fs::read_dir(dir).map_err(|e| Failure { code: 1, msg: format!("reading {}: {e}", dir.display()) })?;
    let mut names: Vec<String> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter_map(|p| {
            if p.extension() == Some(OsStr::new("rs")) {
                p.file_stem().map(|s| s.to_string_lossy().into_owned())
            } else if p.join("main.rs").is_file() {
                p.file_name().map(|s| s.to_string_lossy().into_owned())
            } else {
                None
            }
        })
        .collect();
    names.sort();
    Ok(names)
}

/// The fenced block after `<!-- user-crate:NAME -->` in `readme`.
fn readme_block(readme: &str, name: &str) -> Result<String> {
    let missing = || Failure { code: 1, msg: format!("README.md has no block marked <!-- user-crate:{name} -->") };
    let after = readme.split_once(&format!("<!-- user-crate:{name} -->")).ok_or_else(missing)?.1;
    let body = after.split_once("```").and_then(|(_, b)| b.split_once('\n')).ok_or_else(missing)?.1;
    Ok(body.split_once("```").ok_or_else(missing)?.0.to_owned())
}

/// Builds README's "Use it from your crate" blocks, as written (the checkout's path put in for
/// `/path/to/comm`), as a crate of its own under `target`, and runs it on 2 ranks.
fn user_crate(target: &Path, commrun: &Path) -> Result {
    let io = |what: &str, e: std::io::Error| Failure { code: 1, msg: format!("{what}: {e}") };
    let readme = std::fs::read_to_string(root().join("README.md")).map_err(|e| io("README.md", e))?;
    let deps = readme_block(&readme, "Cargo.toml")?.replace("/path/to/comm", &root().display().to_string());
    let main = readme_block(&readme, "main.rs")?;
    let dir = target.join("user-crate");
    std::fs::create_dir_all(dir.join("src")).map_err(|e| io("creating the user crate", e))?;
    // `[workspace]`: a workspace of its own, although it lies inside this one's directory.
    let manifest =
        format!("[package]\nname = \"comm-user\"\nversion = \"0.1.0\"\nedition = \"2021\"\n\n[workspace]\n\n{deps}");
    std::fs::write(dir.join("Cargo.toml"), manifest).map_err(|e| io("writing Cargo.toml", e))?;
    std::fs::write(dir.join("src/main.rs"), main).map_err(|e| io("writing main.rs", e))?;
    let mut c = cargo();
    c.arg("build").arg("--manifest-path").arg(dir.join("Cargo.toml")).env("CARGO_TARGET_DIR", dir.join("target"));
    run(c)?;
    let mut c = Command::new(commrun);
    c.env("COMM_TIMEOUT", "60").args(["-n", "2", "--"]).arg(dir.join("target/debug/comm-user"));
    run_bounded(c, JOB_TIMEOUT)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn comm_api_examples_are_found() {
        let names = examples(&root().join("crates/comm-api/examples")).unwrap();
        assert!(names.iter().any(|n| n == "all_reduce"), "{names:?}");
    }
}
