//! Self-tests of the multi-process harness: children see the torchrun variables, and a failing
//! child makes the parent panic with a message that names it.

use std::time::Duration;

use comm_test::multiprocess;

fn env_u32(name: &str) -> Result<u32, String> {
    std::env::var(name).map_err(|e| format!("{name}: {e}"))?.parse().map_err(|e| format!("{name}: {e}"))
}

/// The panic message of `f`, which must panic.
fn panic_message(f: impl FnOnce() + std::panic::UnwindSafe) -> String {
    let payload = std::panic::catch_unwind(f).expect_err("the harness should have panicked");
    payload
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| payload.downcast_ref::<&str>().map(|s| (*s).to_owned()))
        .unwrap_or_default()
}

#[test]
fn children_see_their_rank_and_world() {
    multiprocess::run(3, "children_see_their_rank_and_world", Duration::from_secs(120), || async {
        let (rank, world) = (env_u32("RANK")?, env_u32("WORLD_SIZE")?);
        if world != 3 || rank >= 3 {
            return Err(format!("RANK={rank} WORLD_SIZE={world}"));
        }
        if env_u32("LOCAL_RANK")? != rank || env_u32("LOCAL_WORLD_SIZE")? != 3 {
            return Err("LOCAL_RANK / LOCAL_WORLD_SIZE do not match".into());
        }
        if std::env::var("MASTER_ADDR").as_deref() != Ok("127.0.0.1") || env_u32("MASTER_PORT")? == 0 {
            return Err("MASTER_ADDR / MASTER_PORT missing".into());
        }
        if std::env::var("COMM_JOB_TOKEN").map_or(0, |t| t.len()) < 16 {
            return Err("COMM_JOB_TOKEN missing or short".into());
        }
        // The body runs inside a tokio runtime.
        tokio::time::sleep(Duration::from_millis(10)).await;
        Ok(())
    });
}

#[test]
fn per_rank_environment() {
    multiprocess::run_with_env(
        2,
        "per_rank_environment",
        Duration::from_secs(120),
        |rank| vec![("COMM_TEST_EXTRA".to_owned(), format!("value-{rank}"))],
        || async {
            let rank = env_u32("RANK")?;
            match std::env::var("COMM_TEST_EXTRA") {
                Ok(v) if v == format!("value-{rank}") => Ok(()),
                other => Err(format!("COMM_TEST_EXTRA = {other:?}")),
            }
        },
    );
}

#[test]
fn a_failing_rank_is_named() {
    let msg = panic_message(|| {
        multiprocess::run(3, "a_failing_rank_is_named", Duration::from_secs(120), || async {
            if env_u32("RANK")? == 1 {
                return Err("rank one fails on purpose".into());
            }
            Ok(())
        })
    });
    assert!(msg.contains("failed on rank(s) [1]"), "{msg}");
    assert!(msg.contains("--- rank 1: exit status: 1"), "{msg}");
    assert!(msg.contains("rank one fails on purpose"), "{msg}");
}

#[test]
#[should_panic(expected = "panicked on purpose")]
fn a_panicking_rank_fails_the_parent() {
    multiprocess::run(2, "a_panicking_rank_fails_the_parent", Duration::from_secs(120), || async {
        if env_u32("RANK")? == 0 {
            panic!("rank 0 panicked on purpose");
        }
        Ok(())
    });
}

#[test]
fn a_hung_rank_is_killed_at_the_timeout() {
    let start = std::time::Instant::now();
    let msg = panic_message(|| {
        multiprocess::run(2, "a_hung_rank_is_killed_at_the_timeout", Duration::from_secs(3), || async {
            if env_u32("RANK")? == 1 {
                tokio::time::sleep(Duration::from_secs(600)).await;
            }
            Ok(())
        })
    });
    assert!(msg.contains("failed on rank(s) [1]") && msg.contains("timeout"), "{msg}");
    assert!(start.elapsed() < Duration::from_secs(60), "took {:?}", start.elapsed());
}

#[test]
fn a_wrong_test_name_is_not_a_silent_pass() {
    let msg = panic_message(|| {
        multiprocess::run(1, "no_such_test", Duration::from_secs(120), || async { Ok(()) });
    });
    assert!(msg.contains("is there a test named exactly `no_such_test`"), "{msg}");
}

/// A rank that announces its death is not a failure, whatever status it ends with; one that
/// dies without announcing it is.
#[test]
fn announced_deaths_are_accepted() {
    multiprocess::run(2, "announced_deaths_are_accepted", Duration::from_secs(60), || async {
        if env_u32("RANK")? == 1 {
            multiprocess::dying_on_purpose();
            std::process::abort();
        }
        Ok(())
    });
}

#[test]
fn unannounced_deaths_fail() {
    let msg = panic_message(|| {
        multiprocess::run(2, "unannounced_deaths_fail", Duration::from_secs(60), || async {
            if env_u32("RANK")? == 1 {
                std::process::abort();
            }
            Ok(())
        })
    });
    assert!(msg.contains("failed on rank(s) [1]"), "{msg}");
}
