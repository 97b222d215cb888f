//! Which ranks share a host: found once at start-up with one all_gather over the world group.

use comm_core::cpus::CpuSet;
use comm_core::ops::AllGather;
use comm_core::{Backend, CommError, HostBuffer, Rank};

/// Bytes per rank in the start-up exchanges: a length byte and up to 255 bytes.
const SLOT: usize = 256;

/// The hosts of a job and where this rank sits among them.
///
/// Hosts are ordered by their first (lowest) rank, ranks on a host by rank: host `h`'s
/// *leader* is `hosts[h][0]`, and a rank's *local index* is its position on its host.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Layout {
    hosts: Vec<Vec<Rank>>,
    names: Vec<String>,
    /// Every rank's CPUs (its affinity), where it said.
    cpus: Vec<Option<CpuSet>>,
    rank: Rank,
    host: usize,
    local: usize,
}

impl Layout {
    /// The layout of a world whose rank `r` runs on host `ids[r]` (equal ids: one host), seen
    /// from `rank`. An id may go on with the CPUs the rank may run on
    /// ([`CpuSet::append_to`], as [`discover`](Self::discover) sends it).
    pub fn from_ids(ids: &[String], rank: Rank) -> Result<Layout, CommError> {
        if rank as usize >= ids.len() {
            return Err(CommError::invalid("hier layout", format!("rank {rank} is not in a world of {}", ids.len())));
        }
        let (ids, cpus): (Vec<String>, Vec<Option<CpuSet>>) = ids
            .iter()
            .map(|id| {
                let (host, cpus) = CpuSet::split_id(id);
                (host.to_owned(), cpus)
            })
            .unzip();
        let mut hosts: Vec<Vec<Rank>> = Vec::new();
        let mut names: Vec<String> = Vec::new();
        for (r, id) in ids.iter().enumerate() {
            match names.iter().position(|n| n == id) {
                Some(h) => hosts[h].push(r as Rank),
                None => {
                    names.push(id.clone());
                    hosts.push(vec![r as Rank]);
                }
            }
        }
        let host = names.iter().position(|n| *n == ids[rank as usize]).expect("every id has a host");
        let local = hosts[host].iter().position(|&r| r == rank).expect("every rank is on its host");
        Ok(Layout { hosts, names, cpus, rank, host, local })
    }

    /// Gathers every rank's host identity over `world` (collective: every rank calls it).
    pub async fn discover(world: &dyn Backend, host_id: &str) -> Result<Layout, CommError> {
        // With this rank's CPUs where they fit the slot: whether a machine is crowded.
        let mine = Some(CpuSet::append_to(host_id)).filter(|m| m.len() < SLOT).unwrap_or_else(|| host_id.to_owned());
        let ids = gather_slots(world, mine.as_bytes(), "host identity").await?;
        let ids: Vec<String> = ids.iter().map(|b| String::from_utf8_lossy(b).into_owned()).collect();
        Layout::from_ids(&ids, world.rank())
    }

    /// Every host's ranks, hosts in order of their first rank.
    pub fn hosts(&self) -> &[Vec<Rank>] {
        &self.hosts
    }

    /// This rank (in the world).
    pub fn rank(&self) -> Rank {
        self.rank
    }

    /// This rank's host (an index into [`hosts`](Self::hosts)).
    pub fn host(&self) -> usize {
        self.host
    }

    /// The host of world rank `r`.
    pub fn host_of(&self, r: Rank) -> Option<usize> {
        self.hosts.iter().position(|h| h.contains(&r))
    }

    /// This rank's index on its host.
    pub fn local_index(&self) -> usize {
        self.local
    }

    /// How many ranks this rank's host has.
    pub fn local_size(&self) -> usize {
        self.hosts[self.host].len()
    }

    /// The most ranks any host has.
    pub fn max_local(&self) -> usize {
        self.hosts.iter().map(Vec::len).max().unwrap_or(0)
    }

    /// Whether every host has the same number of ranks (then ranks with equal local indices
    /// form rails).
    pub fn is_even(&self) -> bool {
        self.hosts.iter().all(|h| h.len() == self.hosts[0].len())
    }

    /// Whether this rank leads its host (is its first rank).
    pub fn is_leader(&self) -> bool {
        self.local == 0
    }

    /// The world size.
    pub fn world_size(&self) -> u32 {
        self.hosts.iter().map(Vec::len).sum::<usize>() as u32
    }

    /// Whether hierarchy pays here: several hosts, and more than one rank on some host.
    pub fn is_hierarchical(&self) -> bool {
        self.hosts.len() > 1 && self.max_local() > 1
    }

    /// Ranks that run on this machine's cores: this host's, and those of hosts with the same
    /// boot id (containers or namespaces of one machine, such as simulated hosts).
    fn machine_ranks(&self) -> impl Iterator<Item = Rank> + '_ {
        let boot = |id: &str| id.split_once('@').map(|(b, _)| b.to_owned());
        let mine = boot(&self.names[self.host]);
        let same = move |h: usize| h == self.host || (mine.is_some() && boot(&self.names[h]) == mine);
        (0..self.hosts.len()).filter(move |&h| same(h)).flat_map(move |h| self.hosts[h].iter().copied())
    }

    /// Whether this machine's ranks outnumber the CPUs they may run on together (then waits
    /// should not spin, and a rank per rail only competes for the cores). Ranks bound to a
    /// core each see one CPU apiece but are not crowded.
    pub fn is_crowded(&self) -> bool {
        let all = CpuSet::union_of(self.machine_ranks().map(|r| self.cpus[r as usize].as_ref()));
        self.machine_ranks().count() > CpuSet::runnable_of(all.as_ref())
    }

    /// One line: the hosts (the host name part of their identities) with their ranks.
    pub fn describe(&self) -> String {
        let name = |id: &str| id.rsplit_once('@').map_or(id, |(_, name)| name).to_owned();
        let hosts: Vec<String> =
            self.hosts.iter().zip(&self.names).map(|(r, id)| format!("{} {r:?}", name(id))).collect();
        format!("{} host(s): {}", self.hosts.len(), hosts.join(", "))
    }
}

/// Every host leader's `payload` (at most 255 bytes), as seen by the ranks of its host: one
/// all_gather over `world` (collective). Non-leaders' payloads are ignored.
pub async fn from_leader(world: &dyn Backend, layout: &Layout, payload: &[u8]) -> Result<Vec<u8>, CommError> {
    let all = gather_slots(world, payload, "leader payload").await?;
    Ok(all[layout.hosts[layout.host][0] as usize].clone())
}

/// All-gathers one short byte string per rank.
async fn gather_slots(world: &dyn Backend, mine: &[u8], what: &str) -> Result<Vec<Vec<u8>>, CommError> {
    if mine.len() >= SLOT {
        return Err(CommError::invalid(
            "hier start-up",
            format!("the {what} `{}` is longer than {} bytes", String::from_utf8_lossy(mine), SLOT - 1),
        ));
    }
    let mut slot = [0u8; SLOT];
    slot[0] = mine.len() as u8;
    slot[1..=mine.len()].copy_from_slice(mine);
    let input = HostBuffer::from_slice(&slot[..]);
    let out = comm_core::Collective::<AllGather>::submit(world, AllGather { input, output: None }).await?.output;
    Ok(out.as_bytes().chunks(SLOT).map(|c| c[1..=c[0] as usize].to_vec()).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| format!("boot@{s}")).collect()
    }

    #[test]
    fn hosts_are_ordered_by_first_rank() {
        let l = Layout::from_ids(&ids(&["b", "a", "b", "a"]), 3).unwrap();
        assert_eq!(l.hosts(), &[vec![0, 2], vec![1, 3]]);
        assert_eq!((l.host(), l.local_index(), l.local_size()), (1, 1, 2));
        assert!(l.is_even() && l.is_hierarchical() && !l.is_leader());
        assert_eq!(l.host_of(2), Some(0));
        assert_eq!(l.describe(), "2 host(s): b [0, 2], a [1, 3]");
        // One boot id: two containers of one machine share its cores.
        assert_eq!(l.machine_ranks().count(), 4);
        let other_machine = vec!["m1@a".to_owned(), "m2@b".to_owned(), "m1@a".to_owned()];
        assert_eq!(Layout::from_ids(&other_machine, 0).unwrap().machine_ranks().count(), 2);
    }

    #[test]
    fn crowding_counts_the_machine_ranks_cpus_together() {
        let with = |v: &[(&str, &str)]| v.iter().map(|(h, c)| format!("boot@{h}\n{c}")).collect::<Vec<_>>();
        // Four ranks of two simulated hosts, each bound to its own core: not crowded (unless
        // a CPU quota on this process allows fewer than four at once).
        let own = with(&[("a", "0"), ("b", "1"), ("a", "2"), ("b", "3")]);
        let l = Layout::from_ids(&own, 0).unwrap();
        assert_eq!(
            (l.hosts(), l.describe().as_str()),
            (&[vec![0, 2], vec![1, 3]][..], "2 host(s): a [0, 2], b [1, 3]")
        );
        assert_eq!(l.is_crowded(), CpuSet::parse("0-3").unwrap().runnable() < 4);
        // All four on cores 0-1: crowded.
        let shared = with(&[("a", "0-1"), ("b", "0-1"), ("a", "0-1"), ("b", "0")]);
        assert!(Layout::from_ids(&shared, 3).unwrap().is_crowded());
    }

    #[test]
    fn uneven_and_flat_layouts() {
        let l = Layout::from_ids(&ids(&["a", "a", "a", "b"]), 3).unwrap();
        assert!(!l.is_even() && l.is_hierarchical() && l.is_leader());
        assert_eq!((l.max_local(), l.local_size(), l.world_size()), (3, 1, 4));
        // One rank per host, or one host: nothing to gain from hierarchy.
        assert!(!Layout::from_ids(&ids(&["a", "b"]), 0).unwrap().is_hierarchical());
        assert!(!Layout::from_ids(&ids(&["a", "a"]), 0).unwrap().is_hierarchical());
        assert!(Layout::from_ids(&ids(&["a"]), 1).is_err());
    }
}
