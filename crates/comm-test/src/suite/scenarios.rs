//! The parts beyond one op at a time: ops issued back to back and awaited out of order, bad
//! input, and sub-groups.

use std::sync::Arc;

use comm_core::ops::{
    AllGather, AllReduce, AllToAll, Barrier, Broadcast, Gather, RecvFrom, Reduce, ReduceScatter, Scatter,
    SendTo as SendOp,
};
use comm_core::{Backend, CommError, DType, HostBuffer, Rank, ReduceOp, Work};

use super::runner::{junk, output, refs, submit, Runner};
use crate::reference;

impl<'a> Runner<'a> {
    /// Several ops issued without awaiting in between, awaited in reverse order; plus a dropped
    /// (detached) work that must still complete without disturbing later ops.
    pub(super) async fn back_to_back(&mut self) {
        let me = self.me();
        let last = self.n - 1;
        let n = self.n as usize;
        let mut pending: Vec<(String, Work<HostBuffer>, HostBuffer)> = Vec::new();

        let s = self.next_salt();
        let ins = self.inputs(ReduceOp::Sum, DType::F32, 1000, s);
        let want = self.expected(&ins, ReduceOp::Sum);
        pending.push((
            "all_reduce(sum) f32".into(),
            submit(&self.b, AllReduce { buf: ins[me].clone(), op: ReduceOp::Sum }),
            want,
        ));

        let s = self.next_salt();
        let ins = self.inputs(ReduceOp::Sum, DType::I64, 33, s);
        let want = ins[last as usize].clone();
        pending.push(("broadcast i64".into(), submit(&self.b, Broadcast { buf: ins[me].clone(), root: last }), want));

        let s = self.next_salt();
        let ins = self.inputs(ReduceOp::Sum, DType::BF16, 7, s);
        let want = reference::concat(&refs(&ins));
        pending.push((
            "all_gather bf16".into(),
            submit(&self.b, AllGather { input: ins[me].clone(), output: None }).map(output),
            want,
        ));

        let s = self.next_salt();
        let ins = self.inputs(ReduceOp::Max, DType::F64, 5 * n, s);
        let want = self.expected_block(&ins, ReduceOp::Max);
        let req = ReduceScatter { input: ins[me].clone(), op: ReduceOp::Max, output: None };
        pending.push(("reduce_scatter(max) f64".into(), submit(&self.b, req).map(output), want));

        let barrier = submit(&self.b, Barrier);

        let s = self.next_salt();
        let ins = self.inputs(ReduceOp::Sum, DType::U8, 3 * n, s);
        let want = reference::all_to_all_equal(&refs(&ins)).swap_remove(me);
        let req = AllToAll { input: ins[me].clone(), output: None, input_splits: None, output_splits: None };
        pending.push(("all_to_all u8".into(), submit(&self.b, req).map(output), want));

        let s = self.next_salt();
        let ins = self.inputs(ReduceOp::BXor, DType::I8, 9, s);
        let want = self.expected(&ins, ReduceOp::BXor);
        pending.push((
            "all_reduce(bxor) i8".into(),
            submit(&self.b, AllReduce { buf: ins[me].clone(), op: ReduceOp::BXor }),
            want,
        ));

        let s = self.next_salt();
        let ins = self.inputs(ReduceOp::Sum, DType::F16, 4, s);
        let want = reference::gather(&refs(&ins), 0).swap_remove(me);
        let req = Gather { input: ins[me].clone(), output: None, root: 0 };
        pending.push(("gather f16".into(), submit(&self.b, req).map(output), want));

        // Detached: dropping the work must not cancel the op or upset the next one.
        let s = self.next_salt();
        let ins = self.inputs(ReduceOp::Sum, DType::I32, 5, s);
        drop(submit(&self.b, AllReduce { buf: ins[me].clone(), op: ReduceOp::Sum }));
        let s = self.next_salt();
        let ins = self.inputs(ReduceOp::Sum, DType::I32, 5, s);
        let want = self.expected(&ins, ReduceOp::Sum);
        let req = AllReduce { buf: ins[me].clone(), op: ReduceOp::Sum };
        pending.push(("all_reduce(sum) i32 after a detached op".into(), submit(&self.b, req), want));

        let mut rest = pending.split_off(5);
        while let Some((what, w, want)) = rest.pop() {
            let got = w.await;
            self.check(&format!("back-to-back {what}"), got, &want);
        }
        let got = barrier.await;
        self.check_ok("back-to-back barrier", got);
        while let Some((what, w, want)) = pending.pop() {
            let got = w.await;
            self.check(&format!("back-to-back {what}"), got, &want);
        }
    }

    /// Bad input on every rank must give `InvalidArgument` everywhere and leave the group usable.
    pub(super) async fn bad_input(&mut self) {
        let n = self.n;
        let nu = n as usize;
        let me = self.me;
        let f32s = |len: usize| junk(DType::F32, len);
        let b = self.b.clone();

        let got = submit(&b, Broadcast { buf: f32s(3), root: n }).await;
        self.check_invalid("broadcast with root = world size", got);
        let got = submit(&b, Reduce { buf: f32s(3), op: ReduceOp::Sum, root: n + 5 }).await;
        self.check_invalid("reduce with root > world size", got);
        let got = submit(&b, Scatter { output: f32s(3), input: Some(f32s(3 * nu)), root: n }).await;
        self.check_invalid("scatter with root = world size", got);
        let got = submit(&b, Gather { input: f32s(3), output: None, root: n }).await;
        self.check_invalid("gather with root = world size", got);
        if n > 1 {
            let got = submit(&b, ReduceScatter { input: f32s(2 * nu + 1), op: ReduceOp::Sum, output: None }).await;
            self.check_invalid("reduce_scatter with a length not divisible by the world size", got);
        }
        for (d, op) in [(DType::F32, ReduceOp::BXor), (DType::BF16, ReduceOp::BAnd), (DType::I32, ReduceOp::Avg)] {
            let got = submit(&b, AllReduce { buf: junk(d, 4), op }).await;
            self.check_invalid(&format!("all_reduce({op}) on {d}"), got);
        }
        let got = submit(&b, Reduce { buf: junk(DType::F64, 4), op: ReduceOp::BOr, root: 0 }).await;
        self.check_invalid("reduce(bor) on f64", got);
        for (d, op) in [(DType::F16, ReduceOp::BXor), (DType::U8, ReduceOp::Avg)] {
            let got = submit(&b, ReduceScatter { input: junk(d, nu), op, output: None }).await;
            self.check_invalid(&format!("reduce_scatter({op}) on {d}"), got);
        }
        let req = AllToAll {
            input: f32s(4 * nu),
            output: None,
            input_splits: Some(vec![1; nu]),
            output_splits: Some(vec![1; nu]),
        };
        self.check_invalid("all_to_all with input_splits not summing to the input length", submit(&b, req).await);
        let req = AllToAll { input: f32s(nu), output: None, input_splits: Some(vec![1; nu]), output_splits: None };
        self.check_invalid("all_to_all with input_splits but no output size", submit(&b, req).await);
        let got = submit(&b, SendOp { buf: f32s(2), dst: me, tag: 0 }).await;
        self.check_invalid("send to itself", got);
        let got = submit(&b, SendOp { buf: f32s(2), dst: n, tag: 0 }).await;
        self.check_invalid("send to a rank out of range", got);
        let got = submit(&b, RecvFrom { buf: f32s(2), src: me, tag: 0 }).await;
        self.check_invalid("recv from itself", got);
        let got = submit(&b, RecvFrom { buf: f32s(2), src: n + 1, tag: 0 }).await;
        self.check_invalid("recv from a rank out of range", got);
        let got = submit(&b, AllGather { input: f32s(3), output: Some(junk(DType::F64, 3 * nu)) }).await;
        self.check_invalid("all_gather_into an output of the wrong dtype", got);
        let got = submit(&b, AllGather { input: f32s(3), output: Some(f32s(3 * nu + 1)) }).await;
        self.check_invalid("all_gather_into an output of the wrong length", got);
        let req = ReduceScatter { input: f32s(3 * nu), op: ReduceOp::Sum, output: Some(junk(DType::I32, 3)) };
        self.check_invalid("reduce_scatter_into an output of the wrong dtype", submit(&b, req).await);
        let req = ReduceScatter { input: f32s(3 * nu), op: ReduceOp::Sum, output: Some(f32s(4)) };
        self.check_invalid("reduce_scatter_into an output of the wrong length", submit(&b, req).await);
        let req = AllToAll {
            input: f32s(3 * nu),
            output: Some(junk(DType::F64, 3 * nu)),
            input_splits: None,
            output_splits: None,
        };
        self.check_invalid("all_to_all into an output of the wrong dtype", submit(&b, req).await);
        let req = AllToAll {
            input: f32s(3 * nu),
            output: Some(f32s(3 * nu + 1)),
            input_splits: Some(vec![3; nu]),
            output_splits: Some(vec![3; nu]),
        };
        self.check_invalid("all_to_all into an output of the wrong length", submit(&b, req).await);

        // The group must still work.
        self.all_reduce(DType::F32, 7, ReduceOp::Sum).await;
        self.barrier().await;
    }

    /// Checks a `new_group(ranks)` result: members get a group where they are rank
    /// `ranks.index(me)` of `ranks.len()`, the others get `None`.
    fn membership(
        &mut self,
        ranks: &[Rank],
        got: Result<Option<Arc<dyn Backend>>, CommError>,
    ) -> Option<Arc<dyn Backend>> {
        let what = format!("new_group({ranks:?})");
        let got = self.check_ok(&what, got)?;
        let pos = ranks.iter().position(|&r| r == self.me);
        match (pos, got) {
            (None, None) => None,
            (Some(i), Some(g)) => {
                if g.rank() as usize == i && g.world_size() as usize == ranks.len() {
                    self.tally.passed += 1;
                    Some(g)
                } else {
                    let msg = format!(
                        "{}, rank {}: the new group says rank {} of {}, expected {i} of {}",
                        self.what(&what),
                        self.me,
                        g.rank(),
                        g.world_size(),
                        ranks.len()
                    );
                    self.tally.fail(msg);
                    None
                }
            }
            (None, Some(_)) => {
                let msg = format!("{}, rank {}: a non-member got a group", self.what(&what), self.me);
                self.tally.fail(msg);
                None
            }
            (Some(_), None) => {
                let msg = format!("{}, rank {}: a member got None", self.what(&what), self.me);
                self.tally.fail(msg);
                None
            }
        }
    }

    fn sub_runner(&self, g: Arc<dyn Backend>, ranks: &[Rank], label: &str) -> Runner<'a> {
        let members = ranks.iter().map(|&r| self.members[r as usize]).collect::<Vec<_>>();
        let label = format!("{}[{label}: world ranks {members:?}] ", self.label);
        let salt = reference::mix(self.salt ^ reference::mix(members.len() as u64 ^ u64::from(members[0]) << 20));
        Runner::new(g, self.cfg, members, label, salt)
    }

    pub(super) async fn sub_groups(&mut self) {
        let n = self.n;
        let evens: Vec<Rank> = (0..n).step_by(2).collect();
        let got = self.b.new_group(&evens).await;
        if let Some(g) = self.membership(&evens, got) {
            let mut sub = self.sub_runner(g, &evens, "even ranks");
            sub.reduced().await;
            // A sub-group of a sub-group: its last rank alone.
            let nested = [sub.n - 1];
            let got = sub.b.new_group(&nested).await;
            if let Some(g) = sub.membership(&nested, got) {
                let mut inner = sub.sub_runner(g, &nested, "last even rank");
                inner.all_reduce(DType::F32, 7, ReduceOp::Sum).await;
                inner.all_gather(DType::I64, 5, true).await;
                inner.barrier().await;
                sub.tally.absorb(inner.tally);
            }
            self.tally.absorb(sub.tally);
        }
        // The parent group keeps working, whatever its members did on the sub-group.
        self.all_reduce(DType::F32, 7, ReduceOp::Sum).await;

        let last = [n - 1];
        let got = self.b.new_group(&last).await;
        if let Some(g) = self.membership(&last, got) {
            let mut sub = self.sub_runner(g, &last, "last rank");
            sub.reduced().await;
            self.tally.absorb(sub.tally);
        }
        self.all_reduce(DType::I32, 7, ReduceOp::Sum).await;
        self.barrier().await;
    }
}
