//! One case each: every op checked once against the reference, plus the send/recv ring, the
//! p2p batch and the barrier.

use comm_core::ops::{
    AllGather, AllReduce, AllToAll, Barrier, Broadcast, Gather, RecvFrom, Reduce, ReduceScatter, Scatter,
    SendTo as SendOp,
};
use comm_core::{DType, HostBuffer, Rank, ReduceOp};
use futures::future::join_all;

use super::runner::{junk, refs, submit, uneven, Runner};
use crate::reference;

impl Runner<'_> {
    // ---- one case each -----------------------------------------------------------------------

    pub(super) async fn all_reduce(&mut self, d: DType, len: usize, op: ReduceOp) {
        let salt = self.next_salt();
        let ins = self.inputs(op, d, len, salt);
        let want = self.expected(&ins, op);
        let got = submit(&self.b, AllReduce { buf: ins[self.me()].clone(), op }).await;
        self.check(&format!("all_reduce({op}) {d} × {len}"), got, &want);
    }

    pub(super) async fn broadcast(&mut self, d: DType, len: usize, root: Rank) {
        let salt = self.next_salt();
        let ins = self.inputs(ReduceOp::Sum, d, len, salt);
        let want = reference::broadcast(&refs(&ins), root).swap_remove(self.me());
        let got = submit(&self.b, Broadcast { buf: ins[self.me()].clone(), root }).await;
        self.check(&format!("broadcast(root {root}) {d} × {len}"), got, &want);
    }

    pub(super) async fn reduce(&mut self, d: DType, len: usize, op: ReduceOp, root: Rank) {
        let salt = self.next_salt();
        let ins = self.inputs(op, d, len, salt);
        let want = self.expected_at_root(&ins, op, root);
        let got = submit(&self.b, Reduce { buf: ins[self.me()].clone(), op, root }).await;
        self.check(&format!("reduce({op}, root {root}) {d} × {len}"), got, &want);
    }

    pub(super) async fn all_gather(&mut self, d: DType, len: usize, into: bool) {
        let salt = self.next_salt();
        let ins = self.inputs(ReduceOp::Sum, d, len, salt);
        let want = reference::concat(&refs(&ins));
        let output = into.then(|| junk(d, len * self.n as usize));
        let got = submit(&self.b, AllGather { input: ins[self.me()].clone(), output }).await;
        let what = format!("all_gather{} {d} × {len}", if into { "_into" } else { "" });
        self.check_io(&what, got, &ins[self.me()], &want);
    }

    pub(super) async fn reduce_scatter(&mut self, d: DType, len: usize, op: ReduceOp, into: bool) {
        let salt = self.next_salt();
        let ins = self.inputs(op, d, len * self.n as usize, salt);
        let want = self.expected_block(&ins, op);
        let output = into.then(|| junk(d, len));
        let got = submit(&self.b, ReduceScatter { input: ins[self.me()].clone(), op, output }).await;
        let into = if into { "_into" } else { "" };
        self.check_io(&format!("reduce_scatter{into}({op}) {d} × {len} per rank"), got, &ins[self.me()], &want);
    }

    pub(super) async fn all_to_all_equal(&mut self, d: DType, len: usize, into: bool) {
        let salt = self.next_salt();
        let ins = self.inputs(ReduceOp::Sum, d, len * self.n as usize, salt);
        let want = reference::all_to_all_equal(&refs(&ins)).swap_remove(self.me());
        let output = into.then(|| junk(d, len * self.n as usize));
        let req = AllToAll { input: ins[self.me()].clone(), output, input_splits: None, output_splits: None };
        let got = submit(&self.b, req).await;
        let into = if into { " into an output buffer" } else { "" };
        self.check_io(&format!("all_to_all (equal splits{into}) {d} × {len} per peer"), got, &ins[self.me()], &want);
    }

    pub(super) async fn all_to_all_uneven(&mut self, d: DType, len: usize, pattern: u8, into: bool) {
        let salt = self.next_salt();
        let n = self.n as usize;
        let splits: Vec<Vec<usize>> = (0..n).map(|i| (0..n).map(|j| uneven(pattern, len, i, j)).collect()).collect();
        let ins: Vec<HostBuffer> =
            (0..n).map(|i| reference::input(d, splits[i].iter().sum(), self.members[i], salt)).collect();
        let want = reference::all_to_all(&refs(&ins), &splits).swap_remove(self.me());
        let out_splits: Vec<usize> = (0..n).map(|i| splits[i][self.me()]).collect();
        let output = into.then(|| junk(d, out_splits.iter().sum()));
        let req = AllToAll {
            input: ins[self.me()].clone(),
            output,
            input_splits: Some(splits[self.me()].clone()),
            output_splits: Some(out_splits),
        };
        let got = submit(&self.b, req).await;
        let into = if into { " into an output buffer" } else { "" };
        self.check_io(&format!("all_to_all (uneven splits {splits:?}{into}) {d}"), got, &ins[self.me()], &want);
    }

    pub(super) async fn scatter(&mut self, d: DType, len: usize, root: Rank) {
        let salt = self.next_salt();
        let all = reference::input(d, len * self.n as usize, self.members[root as usize], salt);
        let want = reference::scatter(&all, self.n).swap_remove(self.me());
        let input = if self.me == root { all } else { HostBuffer::zeroed(d, 0) };
        let req = Scatter { output: junk(d, len), input: (self.me == root).then(|| input.clone()), root };
        let got = submit(&self.b, req).await;
        self.check_io(&format!("scatter(root {root}) {d} × {len} per rank"), got, &input, &want);
    }

    pub(super) async fn gather(&mut self, d: DType, len: usize, root: Rank, into: bool) {
        let salt = self.next_salt();
        let ins = self.inputs(ReduceOp::Sum, d, len, salt);
        let want = reference::gather(&refs(&ins), root).swap_remove(self.me());
        let output = (into && self.me == root).then(|| junk(d, len * self.n as usize));
        let got = submit(&self.b, Gather { input: ins[self.me()].clone(), output, root }).await;
        let into = if into { "_into" } else { "" };
        self.check_io(&format!("gather{into}(root {root}) {d} × {len} per rank"), got, &ins[self.me()], &want);
    }

    /// Rank r sends to r+1 and receives from r-1; the send is issued first on every rank and
    /// both eager works are awaited together.
    pub(super) async fn ring(&mut self, d: DType, len: usize) {
        let salt = self.next_salt();
        let tag = (self.case % 1000) as u32;
        let (me, n) = (self.me, self.n);
        let (next, prev) = ((me + 1) % n, (me + n - 1) % n);
        let mine = reference::input(d, len, self.members[me as usize], salt);
        let from_prev = reference::input(d, len, self.members[prev as usize], salt);
        let s = submit(&self.b, SendOp { buf: mine.clone(), dst: next, tag });
        let r = submit(&self.b, RecvFrom { buf: junk(d, len), src: prev, tag });
        let (s, r) = futures::future::join(s, r).await;
        self.check(&format!("ring send to rank {next} (buffer handed back) {d} × {len}"), s, &mine);
        self.check(&format!("ring recv from rank {prev} {d} × {len}"), r, &from_prev);
    }

    /// Two messages (tags 100 and 101, different lengths) to and from every peer, all issued
    /// before any is awaited; messages between a pair arrive in order.
    pub(super) async fn p2p_batch(&mut self, d: DType, len: usize) {
        let salt = self.next_salt();
        let n = self.n;
        let me = self.me;
        let msg =
            |src: Rank, dst: Rank, k: u32| reference::input(d, len + 3 * k as usize, (src * n + dst) * 2 + k, salt);
        let mut works = Vec::new();
        for peer in (0..n).filter(|&p| p != me) {
            for k in 0..2 {
                let sent = msg(me, peer, k);
                let s = submit(&self.b, SendOp { buf: sent.clone(), dst: peer, tag: 100 + k });
                works.push((format!("batched send #{k} to rank {peer} {d}"), s, sent));
                let r = submit(&self.b, RecvFrom { buf: junk(d, len + 3 * k as usize), src: peer, tag: 100 + k });
                works.push((format!("batched recv #{k} from rank {peer} {d}"), r, msg(peer, me, k)));
            }
        }
        let (names, (works, wants)): (Vec<_>, (Vec<_>, Vec<_>)) =
            works.into_iter().map(|(a, b, c)| (a, (b, c))).unzip();
        let results = join_all(works).await;
        for ((name, got), want) in names.iter().zip(results).zip(&wants) {
            self.check(name, got, want);
        }
    }

    pub(super) async fn barrier(&mut self) {
        let got = submit(&self.b, Barrier).await;
        self.check_ok("barrier", got);
    }
}
