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
//!
//! Growing admits newcomers (processes that replace lost ranks): a newcomer takes a ticket
//! (`elastic/join/waiting`, a counter of the job's store) and waits for its assignment under
//! `elastic/join/ticket/<n>`. In [`Elastic::grow`], the group's rank 0 waits until `n`
//! newcomers hold tickets it has not handed out, claims them (`elastic/join/admitted`) and
//! writes each its rank (after the members') and the new group's name; the members and the
//! newcomers then build that group together. A grow whose newcomers do not come in time claims
//! nothing (rank 0 tells the members so: one verdict), so a late newcomer joins the next one.

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

/// Where a newcomer, or a member, goes in a grown group.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Admitted {
    /// Its rank in the new group.
    pub rank: Rank,
    /// The new group's size.
    pub world: u32,
    /// The new group's name (its keys in the store).
    pub prefix: String,
}

/// The most ranks a group may grow to.
pub const MAX_WORLD: u32 = 1 << 16;

const WAITING: &str = "elastic/join/waiting";
const ADMITTED: &str = "elastic/join/admitted";
/// Rank 0's answer to the members of a grow whose newcomers did not come in time.
const GAVE_UP: &str = "gave up: ";
/// How often rank 0 looks for newcomers while it grows the group.
const POLL_GROW: Duration = Duration::from_millis(10);

/// The shrinks and grows of one group, numbered the same on every member.
#[derive(Debug)]
pub struct Elastic {
    prefix: String,
    shrinks: AtomicU32,
    grows: AtomicU32,
}

impl Elastic {
    /// Shrinks and grows of the group named `prefix`.
    pub fn new(prefix: impl Into<String>) -> Self {
        Elastic { prefix: prefix.into(), shrinks: AtomicU32::new(0), grows: AtomicU32::new(0) }
    }

    /// This member's place in the group grown by `n` newcomers (every member calls it with the
    /// same `n`): the members keep their ranks, the newcomers follow in the order they came.
    /// Rank 0 hands the newcomers their tickets; the others check that it was asked for the
    /// same `n`.
    pub async fn grow(
        &self,
        store: &dyn Store,
        me: Rank,
        world: u32,
        n: u32,
        timeout: Duration,
    ) -> Result<Admitted, CommError> {
        let grown = world.checked_add(n).filter(|&w| n > 0 && w <= MAX_WORLD).ok_or_else(|| {
            CommError::invalid("grow", format!("{n} newcomers: at least one, and at most {MAX_WORLD} ranks in all"))
        })?;
        let prefix = format!("{}/grow/{}", self.prefix, self.grows.fetch_add(1, Ordering::SeqCst));
        let count_key = format!("{prefix}/n");
        if me == 0 {
            // Tickets are claimed only once that many newcomers hold them: a grow that times
            // out claims none, so a late newcomer's ticket goes to the next grow.
            let started = Instant::now();
            let admitted = store.add(ADMITTED, 0).await?;
            loop {
                let arrived = store.add(WAITING, 0).await? - admitted;
                if arrived >= i64::from(n) {
                    break;
                }
                if started.elapsed() >= timeout {
                    let why = format!("{arrived} of {n} newcomers asked to join (they call `join`)");
                    // The members' verdict too, so that all of them fail this grow alike.
                    store.set(&count_key, format!("{GAVE_UP}{why}").as_bytes()).await?;
                    return Err(CommError::timeout("grow", started.elapsed(), why));
                }
                tokio::time::sleep(POLL_GROW.min(timeout.saturating_sub(started.elapsed()))).await;
            }
            let last = store.add(ADMITTED, i64::from(n)).await?;
            for i in 0..n {
                let ticket = last - i64::from(n - i) + 1;
                let place = format!("{grown} {} {prefix}", world + i);
                store.set(&format!("elastic/join/ticket/{ticket}"), place.as_bytes()).await?;
            }
            store.set(&count_key, n.to_string().as_bytes()).await?;
        } else {
            // Rank 0 waits up to `timeout` for the newcomers, then says how the grow went.
            let started = Instant::now();
            let theirs = store.get(&count_key, timeout.saturating_mul(2)).await?;
            if let Some(why) = theirs.strip_prefix(GAVE_UP.as_bytes()) {
                return Err(CommError::timeout("grow", started.elapsed(), String::from_utf8_lossy(why)));
            }
            if theirs != n.to_string().as_bytes() {
                return Err(CommError::mismatch(
                    "grow",
                    format!("rank 0 admits {} newcomers, rank {me} {n}", String::from_utf8_lossy(&theirs)),
                ));
            }
        }
        Ok(Admitted { rank: me, world: grown, prefix })
    }

    /// Agrees with the other survivors of this group of `world` on who is left (see the
    /// [module docs](self)), then builds the group with `build`, again with the next
    /// attempt when a member is lost while it is being built. `gone(rank)` says whether a
    /// rank is known to be gone for good; ranks it cannot tell about are waited for up to
    /// `timeout`.
    pub async fn shrink<B, Fut>(
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
            let attempt = self.shrinks.fetch_add(1, Ordering::SeqCst);
            let base = format!("{}/shrink/{attempt}", self.prefix);
            let survivors = agree(store, &base, me, world, timeout, gone).await?;
            let ranks = survivors.ranks.clone();
            match build(survivors).await {
                Ok(group) => return Ok(Shrunk { group, ranks }),
                Err(CommError::PeerLost { .. }) => continue,
                Err(e) => return Err(e),
            }
        }
        Err(CommError::timeout(
            "shrink",
            timeout,
            format!("every one of {} attempts lost a member while the group was being built", world + 1),
        ))
    }
}

/// A newcomer's place: takes a ticket and waits up to `timeout` for a group to admit it
/// ([`Elastic::grow`] on its members).
pub async fn admission(store: &dyn Store, timeout: Duration) -> Result<Admitted, CommError> {
    let since = Instant::now();
    let ticket = store.add(WAITING, 1).await?;
    let place = match store.get(&format!("elastic/join/ticket/{ticket}"), timeout).await {
        Ok(place) => place,
        Err(CommError::Timeout { .. }) => {
            let why = format!("no group admitted this process (ticket {ticket}): its members call grow to admit it");
            return Err(CommError::timeout("join", timeout, why).waited(since, timeout));
        }
        Err(e) => return Err(e),
    };
    let text = String::from_utf8_lossy(&place);
    let mut it = text.splitn(3, ' ');
    match (it.next().and_then(|w| w.parse().ok()), it.next().and_then(|r| r.parse().ok()), it.next()) {
        (Some(world), Some(rank), Some(prefix)) if rank < world && world <= MAX_WORLD => {
            Ok(Admitted { rank, world, prefix: prefix.to_owned() })
        }
        _ => Err(CommError::Store(format!("malformed admission `{text}` for ticket {ticket}"))),
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
        return Err(CommError::timeout(
            "shrink",
            timeout,
            format!(
                "the survivors agreed on ranks {ranks:?} without rank {me}: it came to shrink after they had decided"
            ),
        ));
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
        let shrinks = Elastic::new("g");
        let mut attempts = Vec::new();
        let e = shrinks
            .shrink(&store, 0, 3, Duration::from_millis(20), &|r| r == 2, |s| {
                attempts.push(s.prefix.clone());
                async move { Err(CommError::peer_lost(1, "test")) }
            })
            .await
            .unwrap_err();
        // Every attempt failed the same way: bounded, then a timeout that says why.
        assert!(e.to_string().contains("attempts lost a member"), "{e}");
        assert_eq!(attempts.len(), 4);
        assert_eq!(attempts[1], "g/shrink/1/group");
        // Another error ends it at once.
        let e = shrinks
            .shrink(&store, 0, 3, Duration::from_millis(20), &gone_none, |_| async {
                Err(CommError::Config("no".into()))
            })
            .await
            .unwrap_err();
        assert!(matches!(e, CommError::Config(_)));
    }

    #[tokio::test]
    async fn newcomers_get_the_places_after_the_members() {
        let store = Arc::new(MemoryStore::new());
        let t = Duration::from_secs(10);
        let newcomer = |delay: Duration| {
            let store = store.clone();
            tokio::spawn(async move {
                tokio::time::sleep(delay).await;
                admission(&*store, t).await
            })
        };
        // Two newcomers: one waits before the members grow, one comes while they do.
        let (early, late) = (newcomer(Duration::ZERO), newcomer(Duration::from_millis(50)));
        let (a, b) = (Elastic::new("g"), Elastic::new("g"));
        let (m1, m0) = tokio::join!(b.grow(&*store, 1, 3, 2, t), a.grow(&*store, 0, 3, 2, t));
        assert_eq!(m0.unwrap(), Admitted { rank: 0, world: 5, prefix: "g/grow/0".into() });
        assert_eq!(m1.unwrap().rank, 1);
        let (early, late) = (early.await.unwrap().unwrap(), late.await.unwrap().unwrap());
        let mut got = [early.rank, late.rank];
        got.sort_unstable();
        assert_eq!((got, late.world), ([3, 4], 5));
        // The next grow is another group; a member asked for another count is told.
        let third = newcomer(Duration::ZERO);
        let (m1, m0) = tokio::join!(b.grow(&*store, 1, 5, 2, t), a.grow(&*store, 0, 5, 1, t));
        assert_eq!(m0.unwrap().prefix, "g/grow/1");
        assert!(matches!(m1, Err(CommError::Mismatch { .. })), "{m1:?}");
        assert_eq!(third.await.unwrap().unwrap().rank, 5);
        // Nobody admits a newcomer no grow asked for.
        let e = admission(&*store, Duration::from_millis(20)).await.unwrap_err();
        assert!(e.to_string().contains("no group admitted"), "{e}");
        for n in [0, MAX_WORLD] {
            assert!(a.grow(&*store, 0, 5, n, t).await.is_err());
        }
    }

    /// A grow whose newcomer is late times out on every member alike and claims no ticket: the
    /// newcomer joins the next grow, also when it comes while that one waits; one that never
    /// comes fails every try.
    #[tokio::test]
    async fn a_grow_that_times_out_claims_nothing() {
        let store = Arc::new(MemoryStore::new());
        let (a, b) = (Elastic::new("g"), Elastic::new("g"));
        let short = Duration::from_millis(60);
        for attempt in 0..2 {
            let (m1, m0) = tokio::join!(b.grow(&*store, 1, 2, 1, short), a.grow(&*store, 0, 2, 1, short));
            for m in [m0, m1] {
                match m {
                    Err(CommError::Timeout { detail, .. }) if detail.contains("0 of 1 newcomers") => {}
                    other => panic!("try {attempt}: {other:?}"),
                }
            }
        }
        // The newcomer comes during the third try.
        let late = tokio::spawn({
            let store = store.clone();
            async move {
                tokio::time::sleep(Duration::from_millis(100)).await;
                admission(&*store, Duration::from_secs(10)).await
            }
        });
        let t = Duration::from_secs(10);
        let (m1, m0) = tokio::join!(b.grow(&*store, 1, 2, 1, t), a.grow(&*store, 0, 2, 1, t));
        assert_eq!(m0.unwrap(), Admitted { rank: 0, world: 3, prefix: "g/grow/2".into() });
        assert_eq!(m1.unwrap().rank, 1);
        assert_eq!(late.await.unwrap().unwrap(), Admitted { rank: 2, world: 3, prefix: "g/grow/2".into() });
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
