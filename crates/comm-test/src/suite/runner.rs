//! The suite's machinery: [`Runner`] (one rank's state on one group, the tally of checks and
//! the check helpers) and the helpers that build requests and data.

use std::sync::Arc;

use comm_core::{Backend, Collective, CommError, DType, HostBuffer, InOut, Op, Rank, ReduceOp, Work};

use super::SuiteConfig;
use crate::reference;

/// The filled buffer of an op that hands back input and output.
pub(super) fn output(io: InOut) -> HostBuffer {
    io.output
}

/// Issues `req` on `b`: the one place the suite names the `Collective<R>` trait.
pub(super) fn submit<R: Op>(b: &Arc<dyn Backend>, req: R) -> Work<R::Output>
where
    dyn Backend: Collective<R>,
{
    Collective::<R>::submit(&**b, req)
}

pub(super) fn refs(v: &[HostBuffer]) -> Vec<&HostBuffer> {
    v.iter().collect()
}

/// A buffer of recognisable junk (0xA5 bytes: finite, non-zero values in every dtype), so an
/// output a backend forgot to write never passes by accident.
pub(super) fn junk(dtype: DType, len: usize) -> HostBuffer {
    HostBuffer::from_bytes(dtype, &vec![0xA5; len * dtype.size()]).expect("whole elements")
}

/// Uneven all_to_all block sizes: elements rank `i` sends to rank `j`, by pattern.
pub(super) fn uneven(pattern: u8, len: usize, i: usize, j: usize) -> usize {
    match pattern {
        // Some zero blocks, others up to 2 × (len/3 + 1).
        0 => ((i + 2 * j + len) % 3) * (len / 3 + 1),
        // Nothing to itself, a different count to every other rank.
        1 => {
            if i == j {
                0
            } else {
                (i * 5 + j * 3 + len) % 7 + len / 2
            }
        }
        // Rank 0 sends nothing at all.
        _ => {
            if i == 0 {
                0
            } else {
                j + 1 + len
            }
        }
    }
}

const MAX_KEPT_FAILURES: usize = 20;

#[derive(Default)]
pub(super) struct Tally {
    pub(super) passed: usize,
    pub(super) failed: usize,
    pub(super) failures: Vec<String>,
    pub(super) skipped: Vec<String>,
}

impl Tally {
    pub(super) fn fail(&mut self, msg: String) {
        self.failed += 1;
        if self.failures.len() < MAX_KEPT_FAILURES {
            self.failures.push(msg);
        }
    }

    pub(super) fn absorb(&mut self, other: Tally) {
        self.passed += other.passed;
        self.failed += other.failed;
        self.skipped.extend(other.skipped);
        let room = MAX_KEPT_FAILURES.saturating_sub(self.failures.len());
        self.failures.extend(other.failures.into_iter().take(room));
    }
}

/// The suite's state on one rank of one group.
pub(super) struct Runner<'a> {
    pub(super) b: Arc<dyn Backend>,
    pub(super) cfg: &'a SuiteConfig,
    pub(super) me: Rank,
    pub(super) n: u32,
    /// The world rank of each group rank: inputs are generated per world rank, so a sub-group's
    /// results can only match when exactly its members contributed.
    pub(super) members: Vec<Rank>,
    /// Prefix naming the group in messages ("" for the world).
    pub(super) label: String,
    /// The group's hosts when reductions go per host first ([`SuiteConfig::hosts`]; the
    /// world's runner only: sub-groups reduce in rank order).
    pub(super) hosts: Option<Vec<Vec<Rank>>>,
    /// Cases run so far; every case gets its own salt. A sub-group has its own counter so the
    /// world's sequence stays the same on members and non-members.
    pub(super) case: u64,
    pub(super) salt: u64,
    pub(super) tally: Tally,
}

impl<'a> Runner<'a> {
    pub(super) fn new(b: Arc<dyn Backend>, cfg: &'a SuiteConfig, members: Vec<Rank>, label: String, salt: u64) -> Self {
        let (me, n) = (b.rank(), b.world_size());
        Runner { b, cfg, me, n, members, label, hosts: None, case: 0, salt, tally: Tally::default() }
    }

    /// The reduction of every member's input, in the order this group reduces in.
    pub(super) fn expected(&self, ins: &[HostBuffer], op: ReduceOp) -> HostBuffer {
        match &self.hosts {
            Some(hosts) => reference::reduce_grouped(&refs(ins), op, hosts),
            None => reference::reduce(&refs(ins), op),
        }
    }

    /// What a reduce to `root` leaves on this rank.
    pub(super) fn expected_at_root(&self, ins: &[HostBuffer], op: ReduceOp, root: Rank) -> HostBuffer {
        if self.me == root {
            self.expected(ins, op)
        } else {
            ins[self.me()].clone()
        }
    }

    /// This rank's block of a reduce_scatter.
    pub(super) fn expected_block(&self, ins: &[HostBuffer], op: ReduceOp) -> HostBuffer {
        let all = self.expected(ins, op);
        let k = all.len() / self.n as usize;
        reference::slice(&all, self.me() * k, k)
    }

    pub(super) fn next_salt(&mut self) -> u64 {
        self.case += 1;
        reference::mix(self.salt ^ self.case.wrapping_mul(0x2545_F491_4F6C_DD1D))
    }

    pub(super) fn me(&self) -> usize {
        self.me as usize
    }

    pub(super) fn roots(&self) -> Vec<Rank> {
        if self.n == 1 {
            vec![0]
        } else {
            vec![0, self.n - 1]
        }
    }

    /// Every group rank's input for a case (index = group rank).
    pub(super) fn inputs(&self, op: ReduceOp, d: DType, len: usize, salt: u64) -> Vec<HostBuffer> {
        self.members.iter().map(|&w| reference::input_for(op, d, len, w, salt)).collect()
    }

    pub(super) fn what(&self, what: &str) -> String {
        format!("{}{what}", self.label)
    }

    fn error(&mut self, what: &str, e: CommError) {
        let what = self.what(what);
        if self.cfg.allow_unsupported && matches!(e, CommError::Unsupported { .. }) {
            self.tally.skipped.push(format!("{what}: {e}"));
        } else {
            self.tally.fail(format!("{what}, rank {}: the op failed: {e}", self.me));
        }
    }

    pub(super) fn check(&mut self, what: &str, got: Result<HostBuffer, CommError>, want: &HostBuffer) {
        match got {
            Ok(buf) => match reference::compare(&buf, want, &self.what(what), self.me) {
                Ok(()) => self.tally.passed += 1,
                Err(e) => self.tally.fail(e),
            },
            Err(e) => self.error(what, e),
        }
    }

    /// An op that reads one buffer and fills another: `output` as wanted, and `input` handed back
    /// unchanged.
    pub(super) fn check_io(
        &mut self,
        what: &str,
        got: Result<InOut, CommError>,
        input: &HostBuffer,
        want: &HostBuffer,
    ) {
        match got {
            Ok(io) => {
                let r = reference::compare(&io.output, want, &self.what(what), self.me).and_then(|()| {
                    reference::compare(&io.input, input, &self.what(&format!("{what}: its input handed back")), self.me)
                });
                match r {
                    Ok(()) => self.tally.passed += 1,
                    Err(e) => self.tally.fail(e),
                }
            }
            Err(e) => self.error(what, e),
        }
    }

    pub(super) fn check_ok<T>(&mut self, what: &str, got: Result<T, CommError>) -> Option<T> {
        match got {
            Ok(v) => {
                self.tally.passed += 1;
                Some(v)
            }
            Err(e) => {
                self.error(what, e);
                None
            }
        }
    }

    pub(super) fn check_invalid<T>(&mut self, what: &str, got: Result<T, CommError>) {
        match got {
            Err(CommError::InvalidArgument { .. }) => self.tally.passed += 1,
            Err(e) => {
                let msg = format!("{}, rank {}: expected InvalidArgument, got: {e}", self.what(what), self.me);
                self.tally.fail(msg);
            }
            Ok(_) => {
                let msg =
                    format!("{}, rank {}: expected InvalidArgument, but the op succeeded", self.what(what), self.me);
                self.tally.fail(msg);
            }
        }
    }
}
