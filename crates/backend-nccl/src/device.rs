//! Zero-copy ops on device buffers (`CudaSlice<T>`): NCCL-specific request types, submitted
//! through the same [`Collective`](comm_core::Collective) trait as the host ops.
//!
//! Like host buffers, a device buffer is moved into the op and handed back by its `Work` once
//! NCCL is done with it, so it can never be touched (or freed) while NCCL uses it. The buffer
//! must live on the communicator's device ([`NcclBackend::context`](crate::NcclBackend::context));
//! before the op runs, the communicator's stream waits for the work already queued on the
//! buffer's own stream, so writing a buffer on any stream of that context and submitting it
//! right away is correct. Nothing is allocated: outputs are the caller's.
//!
//! ```no_run
//! # async fn demo(pg: backend_nccl::NcclBackend) -> Result<(), comm_core::CommError> {
//! use backend_nccl::DeviceAllReduce;
//! use comm_core::{Collective, ReduceOp};
//! let stream = pg.context().default_stream();
//! let grads = stream.clone_htod(&[1.0f32, 2.0, 3.0]).unwrap();
//! let summed = pg.submit(DeviceAllReduce { buf: grads, op: ReduceOp::Sum }).await?;
//! let host: Vec<f32> = stream.clone_dtoh(&summed).unwrap();
//! # Ok(()) }
//! ```

use std::fmt;

use comm_core::ops::{check_len, check_peer, check_reduce, check_root, check_total};
use comm_core::{CommError, Completer, DType, Element, Op, OpKind, Rank, ReduceOp};
use cudarc::driver::{CudaContext, CudaSlice, DeviceRepr};

use crate::engine::{Body, Cx, Plan, Prepared};
use crate::ffi::Call;
use crate::plans::{dt, prepared, redop};

/// Element types of device buffers: the `comm-core` element types (all of which NCCL has).
pub trait DeviceElement: Element + DeviceRepr {}
impl<T: Element + DeviceRepr> DeviceElement for T {}

/// What ops with a separate input and output hand back.
pub struct DeviceInOut<T> {
    /// The input buffer, unchanged.
    pub input: CudaSlice<T>,
    /// The filled output buffer.
    pub output: CudaSlice<T>,
}

impl<T> fmt::Debug for DeviceInOut<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceInOut")
            .field("input_len", &self.input.len())
            .field("output_len", &self.output.len())
            .finish()
    }
}

fn same_device<T>(op: &'static str, s: &CudaSlice<T>, ctx: &CudaContext) -> Result<(), CommError> {
    if s.context().cu_ctx() != ctx.cu_ctx() {
        return Err(CommError::invalid(
            op,
            format!(
                "the device buffer lives on CUDA device {} but this communicator uses device {}",
                s.ordinal(),
                ctx.ordinal()
            ),
        ));
    }
    Ok(())
}

fn one(call: Call) -> Result<Body, CommError> {
    Ok(Body { calls: vec![call], group: false, staged: Vec::new() })
}

macro_rules! debug_lens {
    ($t:ident { $($f:ident),* } $(, $extra:ident)*) => {
        impl<T> fmt::Debug for $t<T> {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.debug_struct(stringify!($t))
                    $(.field(concat!(stringify!($f), "_len"), &self.$f.len()))*
                    $(.field(stringify!($extra), &self.$extra))*
                    .finish()
            }
        }
    };
}

/// `all_reduce` in place on a device buffer.
pub struct DeviceAllReduce<T> {
    /// Input, and output once reduced.
    pub buf: CudaSlice<T>,
    /// How to combine (sum, prod, min, max, avg: NCCL has no bitwise reductions).
    pub op: ReduceOp,
}
debug_lens!(DeviceAllReduce { buf }, op);

impl<T: DeviceElement> Op for DeviceAllReduce<T> {
    type Output = CudaSlice<T>;
    const KIND: OpKind = OpKind::AllReduce;
    fn bytes(&self) -> usize {
        self.buf.num_bytes()
    }
    fn dtype(&self) -> Option<DType> {
        Some(T::DTYPE)
    }
    fn validate(&self, _: Rank, _: u32) -> Result<(), CommError> {
        check_reduce(Self::NAME, self.op, T::DTYPE)
    }
    fn reduce_op(&self) -> Option<ReduceOp> {
        Some(self.op)
    }
}

impl<T: DeviceElement> Plan for DeviceAllReduce<T> {
    fn check_device(&self, ctx: &CudaContext) -> Result<(), CommError> {
        same_device(Self::NAME, &self.buf, ctx)
    }
    fn plan(self, cx: &mut Cx, done: Completer<CudaSlice<T>>) -> Prepared {
        let DeviceAllReduce { buf, op } = self;
        let b = (|| {
            let (dt, op) = (dt(Self::NAME, T::DTYPE)?, redop(Self::NAME, op, T::DTYPE)?);
            let p = cx.user_ptr(&buf, 0)?;
            one(Call::AllReduce { send: p, recv: p, count: buf.len(), dt, op })
        })();
        prepared(done, b, move |_| Ok(buf))
    }
}

/// `broadcast` in place on a device buffer.
pub struct DeviceBroadcast<T> {
    /// Data on the root; overwritten elsewhere.
    pub buf: CudaSlice<T>,
    /// The rank whose data is sent.
    pub root: Rank,
}
debug_lens!(DeviceBroadcast { buf }, root);

impl<T: DeviceElement> Op for DeviceBroadcast<T> {
    type Output = CudaSlice<T>;
    const KIND: OpKind = OpKind::Broadcast;
    fn bytes(&self) -> usize {
        self.buf.num_bytes()
    }
    fn dtype(&self) -> Option<DType> {
        Some(T::DTYPE)
    }
    fn validate(&self, _: Rank, world: u32) -> Result<(), CommError> {
        check_root(Self::NAME, self.root, world)
    }
    fn root(&self) -> Option<Rank> {
        Some(self.root)
    }
}

impl<T: DeviceElement> Plan for DeviceBroadcast<T> {
    fn check_device(&self, ctx: &CudaContext) -> Result<(), CommError> {
        same_device(Self::NAME, &self.buf, ctx)
    }
    fn plan(self, cx: &mut Cx, done: Completer<CudaSlice<T>>) -> Prepared {
        let DeviceBroadcast { buf, root } = self;
        let b = (|| {
            let dt = dt(Self::NAME, T::DTYPE)?;
            let p = cx.user_ptr(&buf, 0)?;
            one(Call::Broadcast { send: p, recv: p, count: buf.len(), dt, root: root as i32 })
        })();
        prepared(done, b, move |_| Ok(buf))
    }
}

/// `reduce` in place: the root's buffer ends with the reduction (the others' are unchanged).
pub struct DeviceReduce<T> {
    /// Input; on the root, the output.
    pub buf: CudaSlice<T>,
    /// How to combine.
    pub op: ReduceOp,
    /// The rank that receives the result.
    pub root: Rank,
}
debug_lens!(DeviceReduce { buf }, op, root);

impl<T: DeviceElement> Op for DeviceReduce<T> {
    type Output = CudaSlice<T>;
    const KIND: OpKind = OpKind::Reduce;
    fn bytes(&self) -> usize {
        self.buf.num_bytes()
    }
    fn dtype(&self) -> Option<DType> {
        Some(T::DTYPE)
    }
    fn validate(&self, _: Rank, world: u32) -> Result<(), CommError> {
        check_root(Self::NAME, self.root, world)?;
        check_reduce(Self::NAME, self.op, T::DTYPE)
    }
    fn root(&self) -> Option<Rank> {
        Some(self.root)
    }
    fn reduce_op(&self) -> Option<ReduceOp> {
        Some(self.op)
    }
}

impl<T: DeviceElement> Plan for DeviceReduce<T> {
    fn check_device(&self, ctx: &CudaContext) -> Result<(), CommError> {
        same_device(Self::NAME, &self.buf, ctx)
    }
    fn plan(self, cx: &mut Cx, done: Completer<CudaSlice<T>>) -> Prepared {
        let DeviceReduce { buf, op, root } = self;
        let b = (|| {
            let (dt, op) = (dt(Self::NAME, T::DTYPE)?, redop(Self::NAME, op, T::DTYPE)?);
            let p = cx.user_ptr(&buf, 0)?;
            one(Call::Reduce { send: p, recv: p, count: buf.len(), dt, op, root: root as i32 })
        })();
        prepared(done, b, move |_| Ok(buf))
    }
}

/// `all_gather_into_tensor`: `output` (`world × input.len()`) gets every rank's input in rank
/// order.
pub struct DeviceAllGather<T> {
    /// This rank's shard.
    pub input: CudaSlice<T>,
    /// Receives the gathered shards.
    pub output: CudaSlice<T>,
}
debug_lens!(DeviceAllGather { input, output });

impl<T: DeviceElement> Op for DeviceAllGather<T> {
    type Output = DeviceInOut<T>;
    const KIND: OpKind = OpKind::AllGather;
    fn bytes(&self) -> usize {
        self.input.num_bytes()
    }
    fn dtype(&self) -> Option<DType> {
        Some(T::DTYPE)
    }
    fn validate(&self, _: Rank, world: u32) -> Result<(), CommError> {
        let total = check_total(Self::NAME, self.input.len(), world, T::DTYPE)?;
        check_len(Self::NAME, "the output buffer", self.output.len(), total)
    }
}

impl<T: DeviceElement> Plan for DeviceAllGather<T> {
    fn check_device(&self, ctx: &CudaContext) -> Result<(), CommError> {
        same_device(Self::NAME, &self.input, ctx)?;
        same_device(Self::NAME, &self.output, ctx)
    }
    fn plan(self, cx: &mut Cx, done: Completer<DeviceInOut<T>>) -> Prepared {
        let DeviceAllGather { input, output } = self;
        let b = (|| {
            let dt = dt(Self::NAME, T::DTYPE)?;
            let (send, recv) = (cx.user_ptr(&input, 0)?, cx.user_ptr(&output, 0)?);
            one(Call::AllGather { send, recv, count: input.len(), dt })
        })();
        prepared(done, b, move |_| Ok(DeviceInOut { input, output }))
    }
}

/// `reduce_scatter_tensor`: `input` (`world × k`) is reduced across ranks and rank `r` gets block
/// `r` in `output` (`k`).
pub struct DeviceReduceScatter<T> {
    /// Full-length input.
    pub input: CudaSlice<T>,
    /// Receives this rank's reduced block.
    pub output: CudaSlice<T>,
    /// How to combine.
    pub op: ReduceOp,
}
debug_lens!(DeviceReduceScatter { input, output }, op);

impl<T: DeviceElement> Op for DeviceReduceScatter<T> {
    type Output = DeviceInOut<T>;
    const KIND: OpKind = OpKind::ReduceScatter;
    fn bytes(&self) -> usize {
        self.input.num_bytes()
    }
    fn dtype(&self) -> Option<DType> {
        Some(T::DTYPE)
    }
    fn validate(&self, _: Rank, world: u32) -> Result<(), CommError> {
        check_reduce(Self::NAME, self.op, T::DTYPE)?;
        let n = self.input.len();
        if !n.is_multiple_of(world as usize) {
            return Err(CommError::invalid(
                Self::NAME,
                format!("input length {n} is not divisible by the group size {world}"),
            ));
        }
        check_len(Self::NAME, "the output buffer", self.output.len(), n / world as usize)
    }
    fn reduce_op(&self) -> Option<ReduceOp> {
        Some(self.op)
    }
}

impl<T: DeviceElement> Plan for DeviceReduceScatter<T> {
    fn check_device(&self, ctx: &CudaContext) -> Result<(), CommError> {
        same_device(Self::NAME, &self.input, ctx)?;
        same_device(Self::NAME, &self.output, ctx)
    }
    fn plan(self, cx: &mut Cx, done: Completer<DeviceInOut<T>>) -> Prepared {
        let DeviceReduceScatter { input, output, op } = self;
        let b = (|| {
            let (dt, op) = (dt(Self::NAME, T::DTYPE)?, redop(Self::NAME, op, T::DTYPE)?);
            let (send, recv) = (cx.user_ptr(&input, 0)?, cx.user_ptr(&output, 0)?);
            one(Call::ReduceScatter { send, recv, count: output.len(), dt, op })
        })();
        prepared(done, b, move |_| Ok(DeviceInOut { input, output }))
    }
}

/// `all_to_all_single` with equal blocks: block `j` of rank `i`'s input becomes block `i` of
/// rank `j`'s output (grouped `ncclSend`/`ncclRecv`).
pub struct DeviceAllToAll<T> {
    /// Blocks in destination-rank order (`world × k`).
    pub input: CudaSlice<T>,
    /// Receives blocks in source-rank order (`world × k`).
    pub output: CudaSlice<T>,
}
debug_lens!(DeviceAllToAll { input, output });

impl<T: DeviceElement> Op for DeviceAllToAll<T> {
    type Output = DeviceInOut<T>;
    const KIND: OpKind = OpKind::AllToAll;
    fn bytes(&self) -> usize {
        self.input.num_bytes()
    }
    fn dtype(&self) -> Option<DType> {
        Some(T::DTYPE)
    }
    fn validate(&self, _: Rank, world: u32) -> Result<(), CommError> {
        let n = self.input.len();
        if !n.is_multiple_of(world as usize) {
            return Err(CommError::invalid(
                Self::NAME,
                format!("input length {n} is not divisible by the group size {world}"),
            ));
        }
        check_len(Self::NAME, "the output buffer", self.output.len(), n)
    }
}

impl<T: DeviceElement> Plan for DeviceAllToAll<T> {
    fn check_device(&self, ctx: &CudaContext) -> Result<(), CommError> {
        same_device(Self::NAME, &self.input, ctx)?;
        same_device(Self::NAME, &self.output, ctx)
    }
    fn plan(self, cx: &mut Cx, done: Completer<DeviceInOut<T>>) -> Prepared {
        let DeviceAllToAll { input, output } = self;
        let b = (|| {
            let dt = dt(Self::NAME, T::DTYPE)?;
            let (n, me) = (cx.world as usize, cx.rank as usize);
            let k = input.len() / n;
            let sz = std::mem::size_of::<T>();
            let (src, dst) = (cx.user_ptr(&input, 0)?, cx.user_ptr(&output, 0)?);
            let mut calls = Vec::with_capacity(2 * n);
            for p in 0..n {
                let (s, d) = (src.add(p * k * sz), dst.add(p * k * sz));
                if p == me {
                    calls.push(Call::Copy { src: s, dst: d, bytes: k * sz });
                } else {
                    calls.push(Call::Send { buf: s, count: k, dt, peer: p as i32 });
                    calls.push(Call::Recv { buf: d, count: k, dt, peer: p as i32 });
                }
            }
            Ok(Body { calls, group: true, staged: Vec::new() })
        })();
        prepared(done, b, move |_| Ok(DeviceInOut { input, output }))
    }
}

/// Point-to-point send of a device buffer (batched with the p2p ops submitted right after it
/// into one NCCL group). Tags do not exist in NCCL: messages between two ranks match in order.
pub struct DeviceSend<T> {
    /// The data.
    pub buf: CudaSlice<T>,
    /// Destination rank.
    pub dst: Rank,
}
debug_lens!(DeviceSend { buf }, dst);

impl<T: DeviceElement> Op for DeviceSend<T> {
    type Output = CudaSlice<T>;
    const KIND: OpKind = OpKind::Send;
    fn bytes(&self) -> usize {
        self.buf.num_bytes()
    }
    fn dtype(&self) -> Option<DType> {
        Some(T::DTYPE)
    }
    fn validate(&self, rank: Rank, world: u32) -> Result<(), CommError> {
        check_peer(Self::NAME, self.dst, rank, world)
    }
}

impl<T: DeviceElement> Plan for DeviceSend<T> {
    const P2P: bool = true;
    fn check_device(&self, ctx: &CudaContext) -> Result<(), CommError> {
        same_device(Self::NAME, &self.buf, ctx)
    }
    fn plan(self, cx: &mut Cx, done: Completer<CudaSlice<T>>) -> Prepared {
        let DeviceSend { buf, dst } = self;
        let b = (|| {
            let dt = dt(Self::NAME, T::DTYPE)?;
            one(Call::Send { buf: cx.user_ptr(&buf, 0)?, count: buf.len(), dt, peer: dst as i32 })
        })();
        prepared(done, b, move |_| Ok(buf))
    }
}

/// Point-to-point receive into a device buffer (its length must match the send).
pub struct DeviceRecv<T> {
    /// Receives the data.
    pub buf: CudaSlice<T>,
    /// Source rank.
    pub src: Rank,
}
debug_lens!(DeviceRecv { buf }, src);

impl<T: DeviceElement> Op for DeviceRecv<T> {
    type Output = CudaSlice<T>;
    const KIND: OpKind = OpKind::Recv;
    fn bytes(&self) -> usize {
        self.buf.num_bytes()
    }
    fn dtype(&self) -> Option<DType> {
        Some(T::DTYPE)
    }
    fn validate(&self, rank: Rank, world: u32) -> Result<(), CommError> {
        check_peer(Self::NAME, self.src, rank, world)
    }
}

impl<T: DeviceElement> Plan for DeviceRecv<T> {
    const P2P: bool = true;
    fn check_device(&self, ctx: &CudaContext) -> Result<(), CommError> {
        same_device(Self::NAME, &self.buf, ctx)
    }
    fn plan(self, cx: &mut Cx, done: Completer<CudaSlice<T>>) -> Prepared {
        let DeviceRecv { buf, src } = self;
        let b = (|| {
            let dt = dt(Self::NAME, T::DTYPE)?;
            one(Call::Recv { buf: cx.user_ptr(&buf, 0)?, count: buf.len(), dt, peer: src as i32 })
        })();
        prepared(done, b, move |_| Ok(buf))
    }
}
