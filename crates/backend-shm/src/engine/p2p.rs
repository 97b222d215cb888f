//! Point-to-point: per-pair mailboxes, progressed between and during collectives.

use std::sync::atomic::Ordering::{Acquire, Release, SeqCst};

use comm_core::lane::CallerWait;
use comm_core::{CommError, DType, OpKind};

use crate::layout::{MsgHeader, CARRIED, IN_PLACE, OFF_RECEIVING, SLOTS};

use super::steps::{read_chunk, write_chunk};
use super::zero_copy::{copy_in_place, decode, encode, place_of};
use super::{Engine, Result};

impl Engine {
    pub(super) fn progress_p2p(&mut self) -> Result<bool> {
        let mut any = false;
        for peer in 0..self.world {
            while self.progress_send(peer)? {
                any = true;
            }
            while self.progress_recv(peer)? {
                any = true;
            }
        }
        Ok(any)
    }

    /// Progresses point-to-point traffic on a caller's thread until `done()`, waiting as `wait`
    /// says (`None`: one pass), but not yielding for an awaited peer that waits in a receive
    /// itself (`OFF_RECEIVING`; why: ARCHITECTURE.md, "Direct point-to-point"). An error poisons
    /// the group, as on the worker, and ends the wait.
    pub(crate) fn progress_inline(&mut self, wait: Option<CallerWait>, done: impl Fn() -> bool) {
        let Some(wait) = wait else {
            self.p2p_pass();
            return;
        };
        self.me().u32_at(OFF_RECEIVING).store(1, Release);
        wait.wait(|yielding| (!self.p2p_pass() || done() || yielding && self.awaited_peer_receiving()).then_some(()));
        self.me().u32_at(OFF_RECEIVING).store(0, Release);
    }

    /// One pass over point-to-point traffic; whether the group is still healthy (an error
    /// poisons it, as on the worker).
    fn p2p_pass(&mut self) -> bool {
        if self.poisoned.is_some() {
            return false;
        }
        match self.progress_p2p() {
            Ok(_) => true,
            Err(e) => {
                self.poison_with(&e);
                false
            }
        }
    }

    /// Whether a peer we wait for a message from waits in a receive itself.
    fn awaited_peer_receiving(&self) -> bool {
        (0..self.world).any(|p| !self.recvs[p].is_empty() && self.segs[p].u32_at(OFF_RECEIVING).load(Acquire) != 0)
    }

    /// Writes the next chunk of the first queued send to `peer`, if a slot is free.
    pub(super) fn progress_send(&mut self, peer: usize) -> Result<bool> {
        let Some(op) = self.sends[peer].front_mut() else { return Ok(false) };
        let chunk = self.sent[peer];
        // The peer's counter is read (a line from its cache) only when the slots we know to
        // be free are used up.
        if chunk - self.peer_acked[peer] >= SLOTS {
            self.peer_acked[peer] = self.segs[peer].u64_at(self.lay.acked(self.rank)).load(Acquire);
            if chunk - self.peer_acked[peer] >= SLOTS {
                return Ok(false);
            }
        }
        let total = op.req.buf.byte_len();
        if op.offset == total && total > 0 {
            // Sent in place: the buffer is the peer's to read until it acknowledges the chunk.
            self.peer_acked[peer] = self.segs[peer].u64_at(self.lay.acked(self.rank)).load(Acquire);
            if self.peer_acked[peer] < chunk {
                return Ok(false);
            }
            let op = self.sends[peer].pop_front().expect("front exists");
            op.done.complete(Ok(op.req.buf));
            return Ok(true);
        }
        let me = &self.segs[self.rank];
        // A large message from the arena goes in place: the receiver copies it from there
        // (one copy instead of two through the mailbox).
        let place = (op.offset == 0 && total >= self.params.send_in_place_min && self.procs[peer].is_some())
            .then(|| place_of(&op.req.buf))
            .flatten();
        let hdr =
            MsgHeader { total: total as u64, tag: op.req.tag, dtype: op.req.buf.dtype().code(), ..Default::default() };
        let in_place = place.is_some();
        if let Some(place) = place {
            let hdr = MsgHeader { len: CARRIED as u64, flags: IN_PLACE, ..hdr };
            write_chunk(me, &self.lay, peer, chunk, hdr, &encode(Some(place), true), false);
            op.offset = total;
        } else {
            let len = (total - op.offset).min(self.lay.slot);
            let hdr = MsgHeader { offset: op.offset as u64, len: len as u64, ..hdr };
            let stores = &mut self.write_stores[usize::from(OpKind::Send.code())];
            let (stream, start) = stores.start(len);
            write_chunk(me, &self.lay, peer, chunk, hdr, &op.req.buf.as_bytes()[op.offset..op.offset + len], stream);
            stores.finish(len, stream, start);
            op.offset += len;
        }
        self.sent[peer] = chunk + 1;
        // A send in place completes once the peer acknowledges it (above).
        let finished = !in_place && op.offset == total;
        self.ring(peer);
        if finished {
            let op = self.sends[peer].pop_front().expect("front exists");
            op.done.complete(Ok(op.req.buf));
        }
        Ok(true)
    }

    /// Copies the next available chunk from `peer` into the first queued receive. A receive
    /// that does not match what arrives fails with the `Mismatch` (the group is then poisoned
    /// and only later ops see `Poisoned`).
    pub(super) fn progress_recv(&mut self, peer: usize) -> Result<bool> {
        self.progress_recv_front(peer).inspect_err(|e| {
            if let Some(op) = self.recvs[peer].pop_front() {
                op.done.complete(Err(e.duplicate()));
            }
        })
    }

    pub(super) fn progress_recv_front(&mut self, peer: usize) -> Result<bool> {
        let Some(op) = self.recvs[peer].front_mut() else { return Ok(false) };
        let chunk = self.acked[peer];
        let src = &self.segs[peer];
        let at = self.lay.msg_header(self.rank, chunk);
        if src.u64_at(at).load(Acquire) != chunk + 1 {
            return Ok(false);
        }
        let h: MsgHeader = src.read(at);
        let want_total = op.req.buf.byte_len() as u64;
        let want_dtype = op.req.buf.dtype();
        let bad = |detail: String| Err(CommError::mismatch("recv", detail));
        if h.offset != op.offset as u64 {
            let (at, want) = (h.offset, op.offset);
            return bad(format!(
                "mailbox from rank {peer} is out of order (chunk {chunk} at offset {at}, expected offset {want})"
            ));
        }
        if h.tag != op.req.tag || h.total != want_total || h.dtype != want_dtype.code() {
            let their_dtype = DType::from_code(h.dtype).map_or("?", DType::name);
            return bad(format!(
                    "rank {peer} sent {} bytes of {their_dtype} with tag {} but rank {} posted a recv of {want_total} bytes of {want_dtype} with tag {} (messages between two ranks match in order)",
                    h.total, h.tag, self.rank, op.req.tag
                ));
        }
        let len = h.len as usize;
        if h.flags == IN_PLACE && h.offset == 0 && len == CARRIED {
            let data = read_chunk(src, &self.lay, self.rank, chunk, len).try_into().expect("CARRIED bytes");
            let Some(place) = decode(&data).0 else {
                return bad(format!("rank {peer} sent a message in place but did not say where"));
            };
            let total = op.req.buf.byte_len();
            let seg = self.map_zero_copy(peer, place, total)?;
            let op = self.recvs[peer].front_mut().expect("front exists");
            copy_in_place(&seg, place.off, op.req.buf.as_bytes_mut());
            self.still_held(peer)?;
            self.recvs[peer].front_mut().expect("front exists").offset = total;
        } else if op.offset + len > op.req.buf.byte_len() || len > self.lay.slot || h.flags != 0 {
            return bad(format!("rank {peer} sent a chunk of {len} bytes past the message end"));
        } else {
            let data = read_chunk(src, &self.lay, self.rank, chunk, len);
            op.req.buf.as_bytes_mut()[op.offset..op.offset + len].copy_from_slice(data);
            op.offset += len;
        }
        let op = self.recvs[peer].front_mut().expect("front exists");
        let finished = op.offset == op.req.buf.byte_len();
        self.acked[peer] = chunk + 1;
        self.me().u64_at(self.lay.acked(peer)).store(chunk + 1, SeqCst);
        self.ring(peer);
        if finished {
            let op = self.recvs[peer].pop_front().expect("front exists");
            op.done.complete(Ok(op.req.buf));
        }
        Ok(true)
    }

    pub(super) fn check_p2p_deadlines(&mut self) -> Result<()> {
        for peer in 0..self.world {
            let fronts = [self.sends[peer].front().map(|o| o.started), self.recvs[peer].front().map(|o| o.started)];
            let Some(started) = fronts.into_iter().flatten().min() else { continue };
            let timeout = self.params.timeout;
            let why = || format!("rank {peer} never posted the matching operation");
            let r = self.check_peer(peer).and_then(|()| match started.elapsed() >= timeout {
                true => Err(CommError::timeout("send/recv", timeout, why())),
                false => Ok(()),
            });
            if let Err(e) = r {
                // Every send and recv waiting on this peer gets the real cause; the others
                // see the group poisoned.
                self.give_up(&e.to_string());
                self.fail_p2p(peer, &e);
                return Err(e);
            }
        }
        Ok(())
    }
}
