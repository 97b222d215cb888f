//! Shrinking a group after a failure: the survivors agree, through the store, on who is
//! still there, then build a fresh group of exactly those ranks.
//!
//! The agreement is the same on every backend; a backend supplies two things: whether a rank
//! is known to be gone (shm: its process exited), and how to build a group of the survivors.
//!
//! One attempt (keys under `<group>/shrink/<attempt>`):
//! 1. Each survivor announces itself (`here/<rank>`).
//! 2. It waits until every rank of the old group has announced itself or is known gone, or
//!    until the timeout (a rank that is alive but never comes, e.g. stopped, is left out).
//! 3. It proposes the ranks that announced themselves with one `compare_set` on `decision`,
//!    expecting the key to be absent. The store applies the first proposal and answers every
//!    later one with it, so every survivor adopts the same membership, whatever failures each
//!    one saw; a survivor that sees a decision already made while waiting adopts it at once.
//! 4. A survivor the decision leaves out (it came too late) gets an error; the others build
//!    the group. If a member dies before the new group is up, building it fails with
//!    `PeerLost` on every member still waiting, and they start the next attempt.

use std::future::Future;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::{Backend, CommError, Rank, Store};

/// How often a survivor looks at who has come while it waits.
const POLL: Duration = Duration::from_millis(2);

/// The group the survivors agreed on, as one survivor sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Survivors {
    /// The members: ranks of the old group, increasing. Rank `i` of the new group is `ranks[i]`.
    pub ranks: Vec<Rank>,
    /// This rank's rank in the new group.
    pub rank: Rank,
    /// The new group's name (its keys in the store).
    pub prefix: String,
}

/// A group made by [`Group::shrink`](crate::Group::shrink).
pub struct Shrunk {
    /// The new group.
    pub group: Arc<dyn Backend>,
    /// Its members, as ranks of the old group (rank `i` of the new group is `ranks[i]`).
    pub ranks: Vec<Rank>,
}

impl std::fmt::Debug for Shrunk {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shrunk").field("ranks", &self.ranks).finish_non_exhaustive()
    }
}

/// The shrink attempts of one group, numbered the same on every survivor.
#[derive(Debug)]
pub struct Shrinks {
    prefix: String,
    next: AtomicU32,
}

impl Shrinks {
    /// Shrinks of the group named `prefix`.
    pub fn new(prefix: impl Into<String>) -> Self {
        Shrinks { prefix: prefix.into(), next: AtomicU32::new(0) }
    }

    /// Agrees with the other survivors of this group of `world` on who is left (see the
    /// [module docs](self)), then builds the group with `build`, again with the next
    /// attempt when a member is lost while it is being built. `gone(rank)` says whether a
    /// rank is known to be gone for good; ranks it cannot tell about are waited for up to
    /// `timeout`.
    pub async fn run<B, Fut>(
        &self,
        store: &dyn Store,
        me: Rank,
        world: u32,
        timeout: Duration,
        gone: &(dyn Fn(Rank) -> bool + Sync),
        mut build: B,
    ) -> Result<Shrunk, CommError>
    where
        B: FnMut(Survivors) -> Fut,
        Fut: Future<Output = Result<Arc<dyn Backend>, CommError>>,
    {
        // Each failed attempt has lost at least one member, so this bounds the retries.
        for _ in 0..=world {
            let attempt = self.next.fetch_add(1, Ordering::SeqCst);
            let base = format!("{}/shrink/{attempt}", self.prefix);
            let survivors = agree(store, &base, me, world, timeout, gone).await?;
            let ranks = survivors.ranks.clone();
            match build(survivors).await {
                Ok(group) => return Ok(Shrunk { group, ranks }),
                Err(CommError::PeerLost { .. }) => continue,
                Err(e) => return Err(e),
            }
        }
        Err(CommError::Timeout {
            op: "shrink".into(),
            after: timeout,
            detail: format!("every one of {} attempts lost a member while the group was being built", world + 1),
        })
    }
}

/// One agreement under `base`: steps 1–3 of the [module docs](self).
pub async fn agree(
    store: &dyn Store,
    base: &str,
    me: Rank,
    world: u32,
    timeout: Duration,
    gone: &(dyn Fn(Rank) -> bool + Sync),
) -> Result<Survivors, CommError> {
    if me >= world {
        return Err(CommError::invalid("shrink", format!("rank {me} is not in a group of {world}")));
    }
    store.set(&format!("{base}/here/{me}"), b"1").await?;
    if crate::config::fault_injection()?.kill_in_shrink {
        crate::config::kill_self();
    }
    let decision_key = format!("{base}/decision");
    let deadline = Instant::now() + timeout;
    // Ranks neither seen here nor known gone.
    let mut pending: Vec<Rank> = (0..world).filter(|&r| r != me).collect();
    let mut here = vec![me];
    let decided = loop {
        if let Ok(d) = store.get(&decision_key, Duration::ZERO).await {
            break d;
        }
        let mut still = Vec::with_capacity(pending.len());
        for r in pending {
            if store.get(&format!("{base}/here/{r}"), Duration::ZERO).await.is_ok() {
                here.push(r);
            } else if !gone(r) {
                still.push(r);
            }
        }
        pending = still;
        if pending.is_empty() || Instant::now() >= deadline {
            here.sort_unstable();
            let proposal = encode(&here);
            break store.compare_set(&decision_key, None, proposal.as_bytes()).await?;
        }
        tokio::time::sleep(POLL).await;
    };
    let ranks = decode(&decided, world)?;
    let Some(rank) = ranks.iter().position(|&r| r == me) else {
        return Err(CommError::Timeout {
            op: "shrink".into(),
            after: timeout,
            detail: format!(
                "the survivors agreed on ranks {ranks:?} without rank {me}: it came to shrink after they had decided"
            ),
        });
    };
    Ok(Survivors { ranks, rank: rank as Rank, prefix: format!("{base}/group") })
}

fn encode(ranks: &[Rank]) -> String {
    ranks.iter().map(Rank::to_string).collect::<Vec<_>>().join(",")
}

/// A decision from the store: strictly increasing ranks of a group of `world`, at least one.
fn decode(bytes: &[u8], world: u32) -> Result<Vec<Rank>, CommError> {
    let text = String::from_utf8_lossy(bytes);
    let ranks: Option<Vec<Rank>> = text.split(',').map(|r| r.parse().ok()).collect();
    match ranks {
        Some(r) if !r.is_empty() && r.windows(2).all(|w| w[0] < w[1]) && r.iter().all(|&x| x < world) => Ok(r),
        _ => Err(CommError::Store(format!("malformed shrink decision `{text}` for a group of {world}"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::MemoryStore;

    fn gone_none(_: Rank) -> bool {
        false
    }

    #[tokio::test]
    async fn survivors_agree_on_who_came() {
        let store = Arc::new(MemoryStore::new());
        // Rank 2 of 4 is gone; the three others agree on [0, 1, 3] without waiting for it.
        let gone = |r: Rank| r == 2;
        let runs = [0, 1, 3].map(|me| {
            let store = store.clone();
            async move { agree(&*store, "g/shrink/0", me, 4, Duration::from_secs(10), &gone).await }
        });
        let t = Instant::now();
        let got = futures_join(runs).await;
        assert!(t.elapsed() < Duration::from_secs(5));
        for (i, s) in got.into_iter().enumerate() {
            let s = s.unwrap();
            assert_eq!(s.ranks, vec![0, 1, 3]);
            assert_eq!(s.rank, i as Rank);
            assert_eq!(s.prefix, "g/shrink/0/group");
        }
    }

    #[tokio::test]
    async fn a_late_rank_is_left_out_and_told() {
        let store = MemoryStore::new();
        // Rank 1 never comes (alive but stopped): rank 0 decides alone at the timeout.
        let s = agree(&store, "g/shrink/0", 0, 2, Duration::from_millis(50), &gone_none).await.unwrap();
        assert_eq!(s.ranks, vec![0]);
        let e = agree(&store, "g/shrink/0", 1, 2, Duration::from_secs(5), &gone_none).await.unwrap_err();
        assert!(matches!(e, CommError::Timeout { .. }) && e.to_string().contains("without rank 1"), "{e}");
    }

    #[tokio::test]
    async fn a_member_lost_while_building_starts_the_next_attempt() {
        let store = MemoryStore::new();
        let shrinks = Shrinks::new("g");
        let mut attempts = Vec::new();
        let e = shrinks
            .run(&store, 0, 3, Duration::from_millis(20), &|r| r == 2, |s| {
                attempts.push(s.prefix.clone());
                async move { Err(CommError::PeerLost { rank: 1, detail: "test".into() }) }
            })
            .await
            .unwrap_err();
        // Every attempt failed the same way: bounded, then a timeout that says why.
        assert!(e.to_string().contains("attempts lost a member"), "{e}");
        assert_eq!(attempts.len(), 4);
        assert_eq!(attempts[1], "g/shrink/1/group");
        // Another error ends it at once.
        let e = shrinks
            .run(&store, 0, 3, Duration::from_millis(20), &gone_none, |_| async {
                Err(CommError::Config("no".into()))
            })
            .await
            .unwrap_err();
        assert!(matches!(e, CommError::Config(_)));
    }

    #[test]
    fn decisions_are_checked() {
        assert_eq!(decode(b"0,2,3", 4).unwrap(), vec![0, 2, 3]);
        for bad in [&b""[..], b"0,0", b"2,1", b"0,4", b"x", b"0,,1"] {
            assert!(decode(bad, 4).is_err(), "{bad:?}");
        }
    }

    async fn futures_join<F: Future>(fs: [F; 3]) -> [F::Output; 3] {
        let [a, b, c] = fs;
        let (a, b, c) = tokio::join!(a, b, c);
        [a, b, c]
    }
}
