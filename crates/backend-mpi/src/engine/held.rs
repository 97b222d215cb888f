//! Which groups have collectives unfinished on this rank: a collective makes MPI's blocking
//! calls only where no rank held another group's ([`alone`]; ARCHITECTURE.md, "Blocking calls").

use std::sync::Mutex;

use super::Gid;

/// Unfinished collectives per group (groups with none are removed).
static HELD: Mutex<Vec<(Gid, usize)>> = Mutex::new(Vec::new());

fn held() -> std::sync::MutexGuard<'static, Vec<(Gid, usize)>> {
    HELD.lock().unwrap_or_else(|p| p.into_inner())
}

/// Counts one collective of a group from its submission until it finishes (dropped).
#[derive(Debug)]
pub(crate) struct Held(Gid);

impl Held {
    pub(crate) fn new(gid: Gid) -> Held {
        let mut h = held();
        match h.iter_mut().find(|(g, _)| *g == gid) {
            Some((_, n)) => *n += 1,
            None => h.push((gid, 1)),
        }
        Held(gid)
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        let mut h = held();
        if let Some(i) = h.iter().position(|(g, _)| *g == self.0) {
            h[i].1 -= 1;
            if h[i].1 == 0 {
                h.swap_remove(i);
            }
        }
    }
}

/// Whether every unfinished collective of this rank is of group `gid`.
pub(super) fn alone(gid: Gid) -> bool {
    held().iter().all(|(g, _)| *g == gid)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn another_groups_collective_is_seen_until_it_finishes() {
        // Gids no real group has (the worker counts from 0).
        let (a, b) = (u64::MAX - 1, u64::MAX - 2);
        let x = Held::new(a);
        let y = Held::new(a);
        assert!(alone(a));
        let z = Held::new(b);
        assert!(!alone(a) && !alone(b));
        drop(x);
        drop(y);
        assert!(alone(b) && !alone(a));
        drop(z);
        assert!(alone(a) && alone(b));
    }
}
