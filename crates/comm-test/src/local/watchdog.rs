//! The world's watchdog thread: fails ops whose peers do not arrive within the timeout.

use std::time::{Duration, Instant};

use comm_core::ops::{RecvFrom, SendTo as SendOp};
use comm_core::{CommError, Op};

use super::{Deferred, State, World};

/// Fails ops whose peers are late; returns when every handle of the world is gone.
pub(super) fn watchdog(world: &World) {
    let mut st = world.lock();
    loop {
        if st.handles == 0 {
            return;
        }
        let now = Instant::now();
        let mut deferred = Deferred::new();
        let next = expire(&mut st, now, world.timeout, &mut deferred);
        if !deferred.is_empty() {
            drop(st);
            deferred.into_iter().for_each(|d| d());
            st = world.lock();
            continue;
        }
        st = match next {
            None => {
                st.watchdog_idle = true;
                let mut st = world.wake.wait(st).unwrap_or_else(|e| e.into_inner());
                st.watchdog_idle = false;
                st
            }
            Some(t) => {
                world.wake.wait_timeout(st, t.saturating_duration_since(now)).unwrap_or_else(|e| e.into_inner()).0
            }
        };
    }
}

/// Times out everything past its deadline; returns the earliest deadline still pending.
fn expire(st: &mut State, now: Instant, timeout: Duration, deferred: &mut Deferred) -> Option<Instant> {
    let mut next: Option<Instant> = None;
    for g in st.groups.values_mut() {
        let mut causes = Vec::new();
        let late: Vec<u64> = g.slots.iter().filter(|(_, s)| s.deadline <= now).map(|(&k, _)| k).collect();
        for seq in late {
            let slot = g.slots.remove(&seq).expect("listed above");
            if slot.failed.is_some() {
                continue; // its arrivals already got the mismatch
            }
            let missing: Vec<usize> = (0..g.size()).filter(|&r| !slot.arrived[r]).collect();
            let present: Vec<usize> = (0..g.size()).filter(|&r| slot.arrived[r]).collect();
            let op = slot.entries.iter().flatten().map(|e| e.sig.op).next().unwrap_or("op");
            let detail = format!(
                "{} never joined op #{seq} ({op}) that {} started",
                g.name_ranks(&missing),
                g.name_ranks(&present)
            );
            for e in slot.entries.into_iter().flatten() {
                let err = CommError::timeout(e.sig.op, timeout, detail.clone());
                deferred.push(Box::new(move || (e.fail)(e.payload, err)));
            }
            causes.push(format!("{op} timed out: {detail}"));
        }
        for (&(src, dst), ch) in &mut g.p2p {
            while ch.sends.front().is_some_and(|p| p.deadline <= now) {
                let p = ch.sends.pop_front().expect("front exists");
                let detail = format!(
                    "rank {dst} never posted a recv for rank {src}'s send (tag {}, {} × {})",
                    p.req.tag,
                    p.req.buf.dtype(),
                    p.req.buf.len()
                );
                causes.push(format!("send timed out: {detail}"));
                let err = CommError::timeout(SendOp::NAME, timeout, detail);
                deferred.push(Box::new(move || p.done.complete(Err(err))));
            }
            while ch.recvs.front().is_some_and(|p| p.deadline <= now) {
                let p = ch.recvs.pop_front().expect("front exists");
                let detail = format!(
                    "rank {src} never sent the message rank {dst} waits for (tag {}, {} × {})",
                    p.req.tag,
                    p.req.buf.dtype(),
                    p.req.buf.len()
                );
                causes.push(format!("recv timed out: {detail}"));
                let err = CommError::timeout(RecvFrom::NAME, timeout, detail);
                deferred.push(Box::new(move || p.done.complete(Err(err))));
            }
        }
        if let Some(cause) = causes.first() {
            g.poison(cause, deferred);
        }
        let deadlines = g.slots.values().map(|s| s.deadline).chain(g.p2p.values().flat_map(|ch| {
            ch.sends.front().map(|p| p.deadline).into_iter().chain(ch.recvs.front().map(|p| p.deadline))
        }));
        for d in deadlines {
            next = Some(next.map_or(d, |n| n.min(d)));
        }
    }
    next
}
