//! Data movement: broadcast, all_gather, all_to_all, scatter and gather.

use comm_core::ops::{AllGather, AllToAll, Broadcast, Gather, Op, Scatter};
use comm_core::{CommError, Completer, DType, HostBuffer, InOut, OpKind, Rank};

use crate::engine::header::{inline_max, Exchange, Header, INLINE_ANY};
use crate::engine::op::{Job, Plan};
use crate::engine::steps::{done, done_io, take, wait, Env, Reply, Step, Steps};
use crate::engine::Params;
use crate::raw;

use super::{Part, DIRECT_MAX};

/// The transfer of an all_to_all.
fn ialltoallv(env: &Env<'_>, input: HostBuffer, out: HostBuffer, parts: &[Vec<Part>; 2]) -> Result<Step, CommError> {
    let req = raw::ialltoallv(env.comm, input, &parts[0], out, &parts[1], env.may_block)?;
    Ok(wait(req, |_, b| done_io(take(b.send)?, take(b.recv)?)))
}

/// Checks every rank's all_to_all row (`n` send counts, then `n` receive counts, per rank)
/// against every other's.
fn check_splits(m: &[i64], n: usize) -> Result<(), CommError> {
    for i in 0..n {
        for j in 0..n {
            let (sends, expects) = (m[i * 2 * n + j], m[j * 2 * n + n + i]);
            if sends != expects {
                return Err(CommError::mismatch("all_to_all", format!(
                        "rank {i} sends {sends} elements to rank {j}, but rank {j}'s output splits expect {expects} from rank {i}"
                    )));
            }
        }
    }
    Ok(())
}

impl Plan for AllToAll {
    /// Its splits fit the exchange: once every rank is in, the rest waits for the transfer.
    fn direct(&self, _: &Params, size: usize) -> bool {
        16 * size <= inline_max(size)
    }

    fn job(self, d: Completer<InOut>, _: &Params, n: usize) -> Job {
        let (ins, outs) = self.splits(n as u32);
        let AllToAll { input, output, .. } = self;
        let (dtype, es) = (input.dtype(), input.dtype().size());
        let header = Header::new(Self::KIND, Some(dtype), 0, None, None);
        // Every rank checks every pair's counts (sent and expected), so all reach one verdict;
        // they ride in the exchange after a flag saying whether the input follows them.
        let row: Vec<i64> = ins.iter().chain(&outs).map(|&c| c as i64).collect();
        let with_data = 8 + row.len() * 8 + input.byte_len() <= inline_max(n);
        let payload = (8 + row.len() * 8 <= inline_max(n)).then(|| {
            let mut p = Vec::with_capacity(8 + row.len() * 8 + if with_data { input.byte_len() } else { 0 });
            p.extend_from_slice(&i64::from(with_data).to_ne_bytes());
            p.extend_from_slice(bytemuck::cast_slice(&row));
            if with_data {
                p.extend_from_slice(input.as_bytes());
            }
            p
        });
        let start = move |env: &Env<'_>, ex: Option<&mut Exchange>| -> Result<Step, CommError> {
            let offsets = |v: &[usize]| -> Vec<(usize, usize)> {
                v.iter().scan(0, |at, &c| Some((std::mem::replace(at, *at + c), c))).collect()
            };
            let parts = [offsets(&ins), offsets(&outs)];
            let mut out = output.unwrap_or_else(|| env.pool.buffer(dtype, outs.iter().sum()));
            if !env.params.check || n == 1 {
                return ialltoallv(env, input, out, &parts);
            }
            if let Some(ex) = ex {
                let head = |p: usize| bytemuck::pod_collect_to_vec::<u8, i64>(ex.data(p, 8 + 16 * n));
                let heads: Vec<Vec<i64>> = (0..n).map(head).collect();
                let rows: Vec<i64> = heads.iter().flat_map(|h| h[1..].iter().copied()).collect();
                check_splits(&rows, n)?;
                if heads.iter().any(|h| h[0] == 0) {
                    return ialltoallv(env, input, out, &parts);
                }
                // Every input came with the headers: take our block of each.
                let me = env.rank;
                for (p, h) in heads.iter().enumerate() {
                    let sent = &h[1..=n];
                    let at = sent[..me].iter().sum::<i64>() as usize * es;
                    let len = sent[me] as usize * es;
                    let data = &ex.data(p, 8 + 16 * n + at + len)[8 + 16 * n + at..];
                    let (o, l) = parts[1][p];
                    out.as_bytes_mut()[o * es..(o + l) * es].copy_from_slice(data);
                }
                return done_io(input, out);
            }
            // A group too large for the rows in its slots: gather them in a round of their own.
            let all = HostBuffer::zeroed(DType::I64, 2 * n * n);
            let req = raw::iallgather(env.comm, HostBuffer::from_slice(&row), all, env.may_block)?;
            Ok(wait(req, move |env, b| {
                check_splits(take(b.recv)?.as_slice::<i64>()?, n)?;
                ialltoallv(env, input, out, &parts)
            }))
        };
        Job::Collective(Steps::new(Self::NAME, header, payload, start, Reply::Io(d)))
    }
}

impl Plan for Broadcast {
    /// Whatever fits the exchange is within [`DIRECT_MAX`] too.
    fn direct(&self, _: &Params, _: usize) -> bool {
        self.buf.byte_len() <= DIRECT_MAX
    }

    fn job(self, d: Completer<HostBuffer>, _: &Params, n: usize) -> Job {
        let Broadcast { buf, root } = self;
        let header = Header::new(Self::KIND, Some(buf.dtype()), buf.len(), Some(root), None);
        let payload = (buf.byte_len() <= inline_max(n)).then(|| buf.as_bytes().to_vec());
        let start = move |env: &Env<'_>, ex: Option<&mut Exchange>| -> Result<Step, CommError> {
            let mut buf = buf;
            if let Some(ex) = ex {
                let bytes = buf.byte_len();
                buf.as_bytes_mut().copy_from_slice(ex.data(root as usize, bytes));
                return done(buf);
            }
            let req = raw::ibcast(env.comm, buf, root as i32, env.may_block)?;
            Ok(wait(req, |_, b| done(take(b.recv)?)))
        };
        Job::Collective(Steps::new(Self::NAME, header, payload, start, Reply::Buf(d)))
    }
}

impl Plan for AllGather {
    fn direct(&self, _: &Params, size: usize) -> bool {
        self.input.byte_len() <= inline_max(size) || self.input.byte_len().saturating_mul(size) <= DIRECT_MAX
    }

    fn job(self, d: Completer<InOut>, _: &Params, n: usize) -> Job {
        plan_gather(self, None, d, n)
    }
}

/// Whether a scatter of `block` bytes per rank ships its data in the exchange.
fn scatter_inline(block: usize, size: usize) -> bool {
    block.checked_mul(size).is_some_and(|all| all <= INLINE_ANY)
}

impl Plan for Scatter {
    fn direct(&self, _: &Params, size: usize) -> bool {
        let all = self.output.byte_len().saturating_mul(size);
        scatter_inline(self.output.byte_len(), size) || all <= DIRECT_MAX
    }

    fn job(self, d: Completer<InOut>, _: &Params, _: usize) -> Job {
        let Scatter { input, output, root } = self;
        let dtype = output.dtype();
        let header = Header::new(Self::KIND, Some(dtype), output.len(), Some(root), None);
        // The root's blocks ride in the exchange when they fit any group's slot, so every rank
        // decides alike from the sizes alone.
        let payload = Some(match &input {
            Some(all) if all.byte_len() <= INLINE_ANY => all.as_bytes().to_vec(),
            _ => Vec::new(),
        });
        let start = move |env: &Env<'_>, ex: Option<&mut Exchange>| -> Result<Step, CommError> {
            // Off the root MPI reads no input: one passed anyway comes back as it is.
            let (input, spare) = if env.rank == root as usize { (input, None) } else { (None, input) };
            let b = output.byte_len();
            if let (Some(ex), true) = (ex, scatter_inline(b, env.size)) {
                let mut output = output;
                output.as_bytes_mut().copy_from_slice(&ex.data(root as usize, b * env.size)[env.rank * b..][..b]);
                let input = input.or(spare).unwrap_or_else(|| HostBuffer::zeroed(dtype, 0));
                return done_io(input, output);
            }
            let req = raw::iscatter(env.comm, input, output, root as i32, env.may_block)?;
            Ok(wait(req, move |_, b| {
                let input = b.send.or(spare).unwrap_or_else(|| HostBuffer::zeroed(dtype, 0));
                done_io(input, take(b.recv)?)
            }))
        };
        Job::Collective(Steps::new(Self::NAME, header, payload, start, Reply::Io(d)))
    }
}

impl Plan for Gather {
    fn direct(&self, _: &Params, size: usize) -> bool {
        self.input.byte_len() <= inline_max(size) || self.input.byte_len().saturating_mul(size) <= DIRECT_MAX
    }

    fn job(self, d: Completer<InOut>, _: &Params, n: usize) -> Job {
        plan_gather(AllGather { input: self.input, output: self.output }, Some(self.root), d, n)
    }
}

/// all_gather (`root == None`) or gather to `root` in a group of `n`; off the root, an output
/// passed anyway comes back as it is.
fn plan_gather(AllGather { input, output }: AllGather, root: Option<Rank>, d: Completer<InOut>, n: usize) -> Job {
    let kind = if root.is_some() { OpKind::Gather } else { OpKind::AllGather };
    let (dtype, len) = (input.dtype(), input.len());
    let header = Header::new(kind, Some(dtype), len, root, None);
    let payload = (input.byte_len() <= inline_max(n)).then(|| input.as_bytes().to_vec());
    let start = move |env: &Env<'_>, ex: Option<&mut Exchange>| -> Result<Step, CommError> {
        let (out, spare) = match root.is_none_or(|r| env.rank == r as usize) {
            true => (Some(output.unwrap_or_else(|| env.pool.buffer(dtype, len * env.size))), None),
            false => (None, output),
        };
        if let Some(ex) = ex {
            // Every rank's input came with the headers.
            let b = input.byte_len();
            let output = match out {
                Some(mut out) => {
                    for p in 0..env.size {
                        out.as_bytes_mut()[p * b..(p + 1) * b].copy_from_slice(ex.data(p, b));
                    }
                    out
                }
                None => spare.unwrap_or_else(|| HostBuffer::zeroed(dtype, 0)),
            };
            return done_io(input, output);
        }
        let req = match root {
            None => raw::iallgather(env.comm, input, take(out)?, env.may_block)?,
            Some(r) => raw::igather(env.comm, input, out, r as i32, env.may_block)?,
        };
        Ok(wait(req, move |_, b| {
            let output = b.recv.or(spare).unwrap_or_else(|| HostBuffer::zeroed(dtype, 0));
            done_io(take(b.send)?, output)
        }))
    };
    Job::Collective(Steps::new(kind.name(), header, payload, start, Reply::Io(d)))
}
