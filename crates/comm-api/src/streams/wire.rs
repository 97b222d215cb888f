//! The frames ranks and the arbiter exchange: each op's name ([`OpKey`]) and what a frame
//! says of it ([`Entry`]), bounded and checked on the way in.

use std::time::Duration;

use comm_core::{CommError, DType, HostBuffer};

pub(super) const FRAME: usize = 4096;
pub(super) const MAGIC: u32 = u32::from_le_bytes(*b"cstr");
/// A rank's last frame to a peer: it sends and listens no more.
pub(super) const BYE: u32 = u32::from_le_bytes(*b"cbye");
pub(super) const ENTRY: usize = 48;
pub(super) const PER_FRAME: usize = (FRAME - 8) / ENTRY;

pub(super) const COLL: u8 = 0;
pub(super) const P2P: u8 = 1;

/// What a frame entry says of an op: issued (to the arbiter), or its verdict (from it).
pub(super) const POSTED: u8 = 0;
pub(super) const RUN: u8 = 1;
pub(super) const MISMATCH: u8 = 2;
pub(super) const TIMEOUT: u8 = 3;
/// The stream failed earlier (`sig`: that failure's code, `a`/`b`: its ranks).
pub(super) const DEAD: u8 = 4;

/// Every rank's name for one op.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) struct OpKey {
    pub(super) stream: u64,
    pub(super) class: u8,
    pub(super) src: u32,
    pub(super) dst: u32,
    pub(super) n: u64,
}

impl OpKey {
    pub(super) fn involves(&self, world: u32) -> Vec<u32> {
        match self.class {
            COLL => (0..world).collect(),
            _ => vec![self.src, self.dst],
        }
    }

    /// The sequence this op is numbered in: a stream's collectives, or its messages from
    /// `src` to `dst`. Each is ordered on its own, as a communicator orders its collectives
    /// and the messages between two ranks, and independently of the others.
    pub(super) fn channel(&self) -> OpKey {
        OpKey { n: 0, ..*self }
    }

    pub(super) fn describe(&self) -> String {
        match self.class {
            COLL => format!("collective #{}", self.n),
            _ => format!("message #{} from rank {} to rank {}", self.n, self.src, self.dst),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Entry {
    pub(super) key: OpKey,
    pub(super) code: u8,
    /// POSTED: the op's signature; DEAD: the code of the stream's failure.
    pub(super) sig: u64,
    pub(super) a: u32,
    pub(super) b: u32,
}

pub(super) fn encode(entries: &[Entry]) -> Vec<HostBuffer> {
    let chunks: Vec<&[Entry]> = if entries.is_empty() { vec![&[]] } else { entries.chunks(PER_FRAME).collect() };
    chunks
        .into_iter()
        .map(|chunk| {
            let mut buf = HostBuffer::zeroed(DType::U8, FRAME);
            let b = buf.as_bytes_mut();
            b[0..4].copy_from_slice(&MAGIC.to_le_bytes());
            b[4..8].copy_from_slice(&(chunk.len() as u32).to_le_bytes());
            for (e, out) in chunk.iter().zip(b[8..].chunks_exact_mut(ENTRY)) {
                out[0..8].copy_from_slice(&e.key.stream.to_le_bytes());
                out[8..16].copy_from_slice(&e.key.n.to_le_bytes());
                out[16..24].copy_from_slice(&e.sig.to_le_bytes());
                out[24..28].copy_from_slice(&e.key.src.to_le_bytes());
                out[28..32].copy_from_slice(&e.key.dst.to_le_bytes());
                out[32..34].copy_from_slice(&[e.key.class, e.code]);
                out[36..40].copy_from_slice(&e.a.to_le_bytes());
                out[40..44].copy_from_slice(&e.b.to_le_bytes());
            }
            buf
        })
        .collect()
}

pub(super) fn bye() -> HostBuffer {
    let mut buf = HostBuffer::zeroed(DType::U8, FRAME);
    buf.as_bytes_mut()[0..4].copy_from_slice(&BYE.to_le_bytes());
    buf
}

/// A peer's frame, checked: everything in it is bounded by `world` before it is used. `None`:
/// the peer's goodbye.
pub(super) fn decode(buf: &HostBuffer, world: u32) -> Result<Option<Vec<Entry>>, String> {
    let b = buf.as_bytes();
    let word = |at: usize| u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"));
    let long = |at: usize| u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"));
    if b.len() == FRAME && word(0) == BYE {
        return Ok(None);
    }
    if b.len() != FRAME || word(0) != MAGIC {
        return Err("not a stream frame".into());
    }
    let count = word(4) as usize;
    if count > PER_FRAME {
        return Err(format!("{count} entries (at most {PER_FRAME})"));
    }
    (0..count)
        .map(|i| {
            let at = 8 + i * ENTRY;
            let key =
                OpKey { stream: long(at), n: long(at + 8), src: word(at + 24), dst: word(at + 28), class: b[at + 32] };
            let e = Entry { key, code: b[at + 33], sig: long(at + 16), a: word(at + 36), b: word(at + 40) };
            let ranks_ok = key.class == COLL || (key.src < world && key.dst < world && key.src != key.dst);
            let ok = key.class <= P2P && e.code <= DEAD && ranks_ok && e.a < world.max(1) && e.b < world.max(1);
            ok.then_some(e).ok_or_else(|| format!("entry {i} is malformed"))
        })
        .collect::<Result<_, _>>()
        .map(Some)
}

/// Why a stream failed.
#[derive(Clone, Copy, Debug)]
pub(super) struct Failure {
    pub(super) code: u8,
    pub(super) key: OpKey,
    pub(super) a: u32,
    pub(super) b: u32,
}

impl Failure {
    pub(super) fn detail(&self) -> String {
        let what = self.key.describe();
        match self.code {
            MISMATCH => format!(
                "ranks {} and {} issued different ops (op, dtype, size or tag) as {what} of stream {}",
                self.a, self.b, self.key.stream
            ),
            _ => format!("rank {} did not issue {what} of stream {}", self.a, self.key.stream),
        }
    }

    /// The error of the op that failed the stream (`first`) or of a later op of it.
    pub(super) fn error(&self, op: &'static str, timeout: Duration, first: bool) -> CommError {
        let detail = self.detail();
        match self.code {
            _ if !first => CommError::Poisoned { cause: format!("stream {} failed: {detail}", self.key.stream) },
            MISMATCH => CommError::mismatch(op, detail + "; the stream is failed"),
            _ => CommError::timeout(
                format!("{op} on stream {}", self.key.stream),
                timeout,
                detail + "; the stream is failed, other streams go on",
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_round_trip_and_bad_ones_are_refused() {
        let key = OpKey { stream: 7, class: P2P, src: 1, dst: 0, n: 3 };
        let entries: Vec<Entry> = (0..PER_FRAME as u64 + 5)
            .map(|i| Entry { key: OpKey { n: i, ..key }, code: RUN, sig: i * 3, a: 1, b: 0 })
            .collect();
        let frames = encode(&entries);
        assert_eq!(frames.len(), 2);
        let back: Vec<Entry> = frames.iter().flat_map(|f| decode(f, 2).unwrap().unwrap()).collect();
        assert_eq!(back, entries);
        assert!(decode(&encode(&[])[0], 2).unwrap().unwrap().is_empty());
        assert_eq!(decode(&bye(), 2), Ok(None));
        // A peer naming a rank outside the group, or a count past the frame, is refused.
        assert!(decode(&frames[0], 1).unwrap_err().contains("malformed"));
        let mut bad = frames[1].clone();
        bad.as_bytes_mut()[4..8].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(decode(&bad, 2).unwrap_err().contains("entries"));
        bad.as_bytes_mut()[0] ^= 1;
        assert!(decode(&bad, 2).is_err());
    }
}
