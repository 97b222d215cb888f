//! How each host-buffer op of `comm-core` runs on NCCL: inputs are copied through pinned
//! memory into device staging buffers, NCCL works on those, outputs come back the same way.
//!
//! all_to_all, scatter and gather are grouped `ncclSend`/`ncclRecv` (one NCCL group per op);
//! the block a rank keeps for itself is a device-to-device copy. Barrier is a one-element
//! all_reduce. Zero-length transfers are never issued (every rank skips them alike).

use comm_core::ops::{
    AllGather, AllReduce, AllToAll, Barrier, Broadcast, Gather, RecvFrom, Reduce, ReduceScatter, Scatter, SendTo,
};
use comm_core::{CommError, Completer, DType, HostBuffer, InOut, Op, ReduceOp};
use cudarc::nccl::sys::{ncclDataType_t, ncclRedOp_t};

use crate::engine::{Body, Cx, Plan, Prepared, Staged};
use crate::ffi::{self, Call};
use crate::{Stall, BACKEND};

/// NCCL's type for `d` (checked at submit; an error here is a bug, not a panic).
pub(crate) fn dt(op: &'static str, d: DType) -> Result<ncclDataType_t, CommError> {
    ffi::nccl_dtype(d).ok_or(CommError::Unsupported { op, dtype: Some(d), backend: BACKEND })
}

/// NCCL's reduction for `r`.
pub(crate) fn redop(op: &'static str, r: ReduceOp, d: DType) -> Result<ncclRedOp_t, CommError> {
    ffi::nccl_op(r).ok_or(CommError::Unsupported { op, dtype: Some(d), backend: BACKEND })
}

/// A plan whose output is computed by `output` from the staging buffers, once the op is done.
pub(crate) fn prepared<O: Send + 'static>(
    done: Completer<O>,
    body: Result<Body, CommError>,
    output: impl FnOnce(&mut [Staged]) -> Result<O, CommError> + 'static,
) -> Prepared {
    Prepared { finish: Box::new(move |r| done.complete(r.and_then(output))), body }
}

fn body(calls: Vec<Call>, group: bool, staged: Vec<Staged>) -> Result<Body, CommError> {
    Ok(Body { calls, group, staged })
}

/// The input and output of an op staged as `[input, output]`.
fn in_out(st: &mut [Staged]) -> Result<InOut, CommError> {
    Ok(InOut { input: st[0].take()?, output: st[1].take()? })
}

impl Plan for AllReduce {
    fn plan(self, cx: &mut Cx, done: Completer<HostBuffer>) -> Prepared {
        let AllReduce { buf, op } = self;
        let b = (|| {
            let (count, dt, op) = (buf.len(), dt(Self::NAME, buf.dtype())?, redop(Self::NAME, op, buf.dtype())?);
            let s = cx.stage_in(buf, true)?;
            let p = cx.ptr(&s, 0);
            body(vec![Call::AllReduce { send: p, recv: p, count, dt, op }], false, vec![s])
        })();
        prepared(done, b, |st| st[0].take())
    }
}

impl Plan for Broadcast {
    fn plan(self, cx: &mut Cx, done: Completer<HostBuffer>) -> Prepared {
        let Broadcast { buf, root } = self;
        let b = (|| {
            let (count, dt) = (buf.len(), dt(Self::NAME, buf.dtype())?);
            let s = cx.stage_in(buf, true)?;
            let p = cx.ptr(&s, 0);
            body(vec![Call::Broadcast { send: p, recv: p, count, dt, root: root as i32 }], false, vec![s])
        })();
        prepared(done, b, |st| st[0].take())
    }
}

impl Plan for Reduce {
    fn plan(self, cx: &mut Cx, done: Completer<HostBuffer>) -> Prepared {
        let Reduce { buf, op, root } = self;
        let b = (|| {
            let (count, dt, op) = (buf.len(), dt(Self::NAME, buf.dtype())?, redop(Self::NAME, op, buf.dtype())?);
            // Non-roots get their input back, untouched.
            let s = cx.stage_in(buf, cx.rank == root)?;
            let p = cx.ptr(&s, 0);
            body(vec![Call::Reduce { send: p, recv: p, count, dt, op, root: root as i32 }], false, vec![s])
        })();
        prepared(done, b, |st| st[0].take())
    }
}

impl Plan for AllGather {
    fn plan(self, cx: &mut Cx, done: Completer<InOut>) -> Prepared {
        let AllGather { input, output } = self;
        let n = cx.world as usize;
        let b = (|| {
            let (count, dt) = (input.len(), dt(Self::NAME, input.dtype())?);
            let out = output.unwrap_or_else(|| HostBuffer::zeroed(input.dtype(), count * n));
            let sin = cx.stage_in(input, false)?;
            let sout = cx.stage_out(out)?;
            let call = Call::AllGather { send: cx.ptr(&sin, 0), recv: cx.ptr(&sout, 0), count, dt };
            body(vec![call], false, vec![sin, sout])
        })();
        prepared(done, b, in_out)
    }
}

impl Plan for ReduceScatter {
    fn plan(self, cx: &mut Cx, done: Completer<InOut>) -> Prepared {
        let ReduceScatter { input, op, output } = self;
        let k = input.len() / cx.world as usize;
        let b = (|| {
            let (dt, op) = (dt(Self::NAME, input.dtype())?, redop(Self::NAME, op, input.dtype())?);
            let out = output.unwrap_or_else(|| HostBuffer::zeroed(input.dtype(), k));
            let sin = cx.stage_in(input, false)?;
            let sout = cx.stage_out(out)?;
            let call = Call::ReduceScatter { send: cx.ptr(&sin, 0), recv: cx.ptr(&sout, 0), count: k, dt, op };
            body(vec![call], false, vec![sin, sout])
        })();
        prepared(done, b, in_out)
    }
}

fn offsets(splits: &[usize]) -> Vec<usize> {
    splits
        .iter()
        .scan(0, |acc, &s| {
            let o = *acc;
            *acc += s;
            Some(o)
        })
        .collect()
}

impl Plan for AllToAll {
    fn plan(self, cx: &mut Cx, done: Completer<InOut>) -> Prepared {
        let (ins, outs) = self.splits(cx.world);
        let AllToAll { input, output, .. } = self;
        let (me, d) = (cx.rank as usize, input.dtype());
        let total: usize = outs.iter().sum();
        let b = (|| {
            if ins[me] != outs[me] {
                return Err(CommError::invalid(
                    Self::NAME,
                    format!("rank {me} sends {} elements to itself but expects to receive {}", ins[me], outs[me]),
                ));
            }
            let dt = dt(Self::NAME, d)?;
            let sz = d.size();
            let out = output.unwrap_or_else(|| HostBuffer::zeroed(d, total));
            let sin = cx.stage_in(input, false)?;
            let sout = cx.stage_out(out)?;
            let (oi, oo) = (offsets(&ins), offsets(&outs));
            let mut calls = Vec::with_capacity(2 * ins.len());
            for p in 0..ins.len() {
                let (src, dst) = (cx.ptr(&sin, oi[p] * sz), cx.ptr(&sout, oo[p] * sz));
                if p == me {
                    calls.push(Call::Copy { src, dst, bytes: ins[p] * sz });
                } else {
                    calls.push(Call::Send { buf: src, count: ins[p], dt, peer: p as i32 });
                    calls.push(Call::Recv { buf: dst, count: outs[p], dt, peer: p as i32 });
                }
            }
            body(calls, true, vec![sin, sout])
        })();
        prepared(done, b, in_out)
    }
}

impl Plan for Scatter {
    fn plan(self, cx: &mut Cx, done: Completer<InOut>) -> Prepared {
        let Scatter { output, input, root } = self;
        let (me, n, k, d) = (cx.rank, cx.world, output.len(), output.dtype());
        // Off the root nothing is sent: an input passed anyway comes back as it is.
        let (input, spare) = if me == root { (input, None) } else { (None, input) };
        let b = (|| {
            let dt = dt(Self::NAME, d)?;
            let sz = d.size();
            let sout = cx.stage_out(output)?;
            let mut calls = Vec::new();
            let mut staged = Vec::new();
            if me == root {
                let all =
                    input.ok_or_else(|| CommError::invalid(Self::NAME, "the root must pass the data to scatter"))?;
                let sin = cx.stage_in(all, false)?;
                for p in 0..n {
                    let src = cx.ptr(&sin, p as usize * k * sz);
                    if p == me {
                        calls.push(Call::Copy { src, dst: cx.ptr(&sout, 0), bytes: k * sz });
                    } else {
                        calls.push(Call::Send { buf: src, count: k, dt, peer: p as i32 });
                    }
                }
                staged.push(sin);
            } else {
                calls.push(Call::Recv { buf: cx.ptr(&sout, 0), count: k, dt, peer: root as i32 });
            }
            staged.insert(0, sout);
            body(calls, true, staged)
        })();
        prepared(done, b, move |st| {
            let output = st[0].take()?;
            let input = match st.get_mut(1) {
                Some(s) => s.take()?,
                None => spare.unwrap_or_else(|| HostBuffer::zeroed(d, 0)),
            };
            Ok(InOut { input, output })
        })
    }
}

impl Plan for Gather {
    fn plan(self, cx: &mut Cx, done: Completer<InOut>) -> Prepared {
        let Gather { input, output, root } = self;
        let (me, n, k, d) = (cx.rank, cx.world, input.len(), input.dtype());
        let is_root = me == root;
        // Off the root nothing is received: an output passed anyway comes back as it is.
        let (out, spare) = match is_root {
            true => (Some(output.unwrap_or_else(|| HostBuffer::zeroed(d, k * n as usize))), None),
            false => (None, output),
        };
        let b = (|| {
            let dt = dt(Self::NAME, d)?;
            let sz = d.size();
            let sin = cx.stage_in(input, false)?;
            let mut calls = Vec::new();
            let mut staged = vec![];
            if let Some(out) = out {
                let sout = cx.stage_out(out)?;
                for p in 0..n {
                    let dst = cx.ptr(&sout, p as usize * k * sz);
                    if p == me {
                        calls.push(Call::Copy { src: cx.ptr(&sin, 0), dst, bytes: k * sz });
                    } else {
                        calls.push(Call::Recv { buf: dst, count: k, dt, peer: p as i32 });
                    }
                }
                staged.push(sout);
            } else {
                calls.push(Call::Send { buf: cx.ptr(&sin, 0), count: k, dt, peer: root as i32 });
            }
            // [input, output] on the root, [input] elsewhere.
            staged.insert(0, sin);
            body(calls, true, staged)
        })();
        prepared(done, b, move |st| {
            let input = st[0].take()?;
            let output = match st.get_mut(1) {
                Some(s) => s.take()?,
                None => spare.unwrap_or_else(|| HostBuffer::zeroed(d, 0)),
            };
            Ok(InOut { input, output })
        })
    }
}

impl Plan for SendTo {
    const P2P: bool = true;
    fn plan(self, cx: &mut Cx, done: Completer<HostBuffer>) -> Prepared {
        let SendTo { buf, dst, .. } = self;
        let b = (|| {
            let (count, dt) = (buf.len(), dt(Self::NAME, buf.dtype())?);
            let s = cx.stage_in(buf, false)?;
            body(vec![Call::Send { buf: cx.ptr(&s, 0), count, dt, peer: dst as i32 }], false, vec![s])
        })();
        prepared(done, b, |st| st[0].take())
    }
}

impl Plan for RecvFrom {
    const P2P: bool = true;
    fn plan(self, cx: &mut Cx, done: Completer<HostBuffer>) -> Prepared {
        let RecvFrom { buf, src, .. } = self;
        let b = (|| {
            let (count, dt) = (buf.len(), dt(Self::NAME, buf.dtype())?);
            let s = cx.stage_out(buf)?;
            body(vec![Call::Recv { buf: cx.ptr(&s, 0), count, dt, peer: src as i32 }], false, vec![s])
        })();
        prepared(done, b, |st| st[0].take())
    }
}

impl Plan for Barrier {
    fn plan(self, cx: &mut Cx, done: Completer<()>) -> Prepared {
        let b = cx.scratch().and_then(|p| {
            let call = Call::AllReduce {
                send: p,
                recv: p,
                count: 1,
                dt: ncclDataType_t::ncclFloat32,
                op: ncclRedOp_t::ncclSum,
            };
            body(vec![call], false, Vec::new())
        });
        prepared(done, b, |_| Ok(()))
    }
}

impl Plan for Stall {
    fn plan(self, _cx: &mut Cx, done: Completer<()>) -> Prepared {
        prepared(done, body(vec![Call::Stall(self.release)], false, Vec::new()), |_| Ok(()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_offsets() {
        assert_eq!(offsets(&[2, 0, 3]), [0, 2, 2]);
        assert!(offsets(&[]).is_empty());
    }

    #[test]
    fn unsupported_reductions_are_named() {
        let e = redop("all_reduce", ReduceOp::BXor, DType::I32).unwrap_err();
        assert_eq!(e.to_string(), "all_reduce on i32 is not supported by backend `nccl`");
        assert!(!e.poisons_group());
        assert!(dt("all_reduce", DType::BF16).is_ok());
    }
}
