//! CPU sets: the CPUs a thread may run on, as the kernel reports them and as ranks publish
//! them to each other (the kernel's list format, `0-3,8`).

/// A set of CPU numbers: the CPUs a thread may run on, or their union over the ranks of a
/// machine, which says whether those ranks can all run at once (and so whether a wait may
/// spin). A rank bound to one core sees one CPU; two ranks bound to two cores can both spin.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CpuSet(Vec<u64>);

/// CPU numbers past this are ignored (a malformed list must not allocate without bound).
const MAX_CPU: usize = 1 << 16;

impl CpuSet {
    /// The CPUs this thread may run on (`sched_getaffinity`); `None` where the system does
    /// not say.
    pub fn allowed() -> Option<CpuSet> {
        let set = rustix::thread::sched_getaffinity(None).ok()?;
        let cpus: CpuSet = (0..rustix::thread::CpuSet::MAX_CPU).filter(|&c| set.is_set(c)).collect();
        (!cpus.is_empty()).then_some(cpus)
    }

    /// `id` (a host identity) followed, after a newline, by the CPUs this thread may run on:
    /// what a rank publishes so that its peers learn both ([`split_id`](Self::split_id)).
    pub fn append_to(id: &str) -> String {
        format!("{id}\n{}", CpuSet::allowed().map(|c| c.to_string()).unwrap_or_default())
    }

    /// The identity and the CPUs of a value [`append_to`](Self::append_to) made (`None` where
    /// it carries none, or none readable).
    pub fn split_id(value: &str) -> (&str, Option<CpuSet>) {
        match value.split_once('\n') {
            Some((id, cpus)) => (id, CpuSet::parse(cpus).filter(|c| !c.is_empty())),
            None => (value, None),
        }
    }

    /// Parses the kernel's list format (`0-3,8,10-11`); `None` if it is not one.
    pub fn parse(list: &str) -> Option<CpuSet> {
        let mut set = CpuSet::default();
        for part in list.trim().split(',').filter(|p| !p.is_empty()) {
            let (a, b) = part.split_once('-').unwrap_or((part, part));
            let (a, b): (usize, usize) = (a.trim().parse().ok()?, b.trim().parse().ok()?);
            if a > b || b >= MAX_CPU {
                return None;
            }
            (a..=b).for_each(|c| set.insert(c));
        }
        Some(set)
    }

    /// The set of these bit words (CPU `64 * i + j` is bit `j` of word `i`).
    pub fn from_words(words: &[u64]) -> CpuSet {
        let mut w = words.to_vec();
        while w.last() == Some(&0) {
            w.pop();
        }
        CpuSet(w)
    }

    /// The bit words of this set (see [`from_words`](Self::from_words)).
    pub fn words(&self) -> &[u64] {
        &self.0
    }

    /// Adds CPU `cpu`.
    pub fn insert(&mut self, cpu: usize) {
        if self.0.len() <= cpu / 64 {
            self.0.resize(cpu / 64 + 1, 0);
        }
        self.0[cpu / 64] |= 1 << (cpu % 64);
    }

    /// The CPUs of the set, in increasing order.
    pub fn iter(&self) -> impl Iterator<Item = usize> + '_ {
        (0..self.0.len() * 64).filter(|&c| self.contains(c))
    }

    /// Whether CPU `cpu` is in the set.
    pub fn contains(&self, cpu: usize) -> bool {
        self.0.get(cpu / 64).is_some_and(|w| w & (1 << (cpu % 64)) != 0)
    }

    /// Adds every CPU of `other`.
    pub fn union_with(&mut self, other: &CpuSet) {
        if self.0.len() < other.0.len() {
            self.0.resize(other.0.len(), 0);
        }
        self.0.iter_mut().zip(&other.0).for_each(|(a, b)| *a |= b);
    }

    /// The union of `sets`, or `None` when one of them is unknown.
    pub fn union_of<'a>(sets: impl IntoIterator<Item = Option<&'a CpuSet>>) -> Option<CpuSet> {
        sets.into_iter().try_fold(CpuSet::default(), |mut all, s| {
            all.union_with(s?);
            Some(all)
        })
    }

    /// How many CPUs the set holds.
    pub fn len(&self) -> usize {
        self.0.iter().map(|w| w.count_ones() as usize).sum()
    }

    /// Whether the set holds no CPU.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// [`runnable`](Self::runnable) of `union` (every rank's CPUs together), or where some
    /// rank could not tell (`None`), this process's `available_parallelism`.
    pub fn runnable_of(union: Option<&CpuSet>) -> usize {
        union.map_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()), CpuSet::runnable)
    }

    /// How many threads of the ranks whose CPUs together are `self` can run at once: the
    /// set's size, capped by a CPU quota on this process (a container's `--cpus`), which std's
    /// `available_parallelism` reports below this thread's own CPU count.
    pub fn runnable(&self) -> usize {
        let std = std::thread::available_parallelism().map_or(1, |n| n.get());
        let own = CpuSet::allowed().map_or(std, |s| s.len());
        if std < own {
            self.len().min(std)
        } else {
            self.len().max(1)
        }
    }
}

impl FromIterator<usize> for CpuSet {
    fn from_iter<I: IntoIterator<Item = usize>>(cpus: I) -> Self {
        let mut set = CpuSet::default();
        cpus.into_iter().for_each(|c| set.insert(c));
        set
    }
}

impl std::fmt::Display for CpuSet {
    /// The kernel's list format, which [`parse`](Self::parse) reads.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut cpus = self.iter().peekable();
        let mut sep = "";
        while let Some(start) = cpus.next() {
            let mut end = start;
            while cpus.next_if_eq(&(end + 1)).is_some() {
                end += 1;
            }
            match end == start {
                true => write!(f, "{sep}{start}")?,
                false => write!(f, "{sep}{start}-{end}")?,
            }
            sep = ",";
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_sets_parse_print_and_join() {
        let a = CpuSet::parse("0-3,8").unwrap();
        assert_eq!((a.len(), a.to_string()), (5, "0-3,8".to_owned()));
        let b = CpuSet::parse(" 3-5,64,70-71\n").unwrap();
        let u = CpuSet::union_of([Some(&a), Some(&b)]).unwrap();
        assert_eq!(u.to_string(), "0-5,8,64,70-71");
        assert_eq!(CpuSet::union_of([Some(&a), None]), None);
        assert_eq!(CpuSet::from_words(u.words()), u);
        assert_eq!(CpuSet::from_words(&[0b11, 0, 0]), CpuSet::parse("0-1").unwrap());
        assert_eq!(u.iter().collect::<CpuSet>(), u);
        assert_eq!(u.iter().take(7).collect::<Vec<_>>(), [0, 1, 2, 3, 4, 5, 8]);
        for bad in ["x", "3-1", "0-99999999", "1-"] {
            assert_eq!(CpuSet::parse(bad), None, "{bad}");
        }
        assert!(CpuSet::parse("").unwrap().is_empty());
        assert_eq!(CpuSet::split_id("boot@h\n0-3,8"), ("boot@h", Some(a.clone())));
        assert_eq!(CpuSet::split_id("boot@h\n"), ("boot@h", None));
        assert_eq!(CpuSet::split_id("boot@h"), ("boot@h", None));
        assert_eq!(CpuSet::split_id(&CpuSet::append_to("boot@h")), ("boot@h", CpuSet::allowed()));
        // Where the system says, this thread may run somewhere, and alone it can run.
        if let Some(own) = CpuSet::allowed() {
            assert!(!own.is_empty());
            assert!((1..=own.len()).contains(&own.runnable()));
        }
    }
}
