//! The TCP store's wire protocol.
//!
//! Every message is a frame: a `u32` little-endian payload length, then the payload. Integers
//! are little-endian; byte strings are a `u32` length then the bytes; keys are UTF-8.
//!
//! 1. Handshake (mutual challenge–response, see `auth`; the job token never crosses the wire).
//!    The client sends `MAGIC, version: u32, client nonce`; the server answers `MAGIC,
//!    status: u8, version: u32` and, when the status is [`HELLO_OK`], `server nonce, server
//!    proof`; the client checks the proof and sends its own; the server answers `MAGIC,
//!    status, version` once more and closes the connection unless both statuses are OK.
//! 2. Requests: `id: u64, opcode: u8, fields...`; responses: `id: u64, status: u8, body`.
//!    A client may have several requests in flight; responses carry the request's id and may
//!    come back in any order (waits are answered when they are satisfied).

use std::sync::Arc;
use std::time::Duration;

use bytes::{Buf, BufMut, Bytes, BytesMut};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// First bytes of both handshake frames: tells a store from any other service on the port.
pub(crate) const MAGIC: [u8; 8] = *b"COMMSTOR";
/// Protocol version; bumped on any incompatible change (2: authenticated handshake).
pub(crate) const VERSION: u32 = 2;
/// Largest frame payload accepted after the handshake (values are at most about this big).
pub(crate) const MAX_FRAME: usize = 64 << 20;
/// Longest job token.
pub(crate) const MAX_TOKEN: usize = 1024;
/// Largest frame accepted before the handshake: a stranger cannot make the server allocate more.
pub(crate) const HELLO_MAX: usize = MAGIC.len() + 4 + 1 + crate::auth::NONCE + crate::auth::PROOF + 64;
/// Longest wait a request may ask for; longer ones are clamped (tokio deadlines overflow).
pub(crate) const MAX_WAIT: Duration = Duration::from_secs(365 * 24 * 3600);

/// Handshake status: accepted.
pub(crate) const HELLO_OK: u8 = 0;
/// Handshake status: the job tokens differ (the client's proof is wrong).
pub(crate) const HELLO_BAD_TOKEN: u8 = 1;
/// Handshake status: the protocol versions differ.
pub(crate) const HELLO_BAD_VERSION: u8 = 2;

/// Request opcodes.
pub(crate) mod op {
    pub(crate) const SET: u8 = 1;
    pub(crate) const GET: u8 = 2;
    pub(crate) const ADD: u8 = 3;
    pub(crate) const COMPARE_SET: u8 = 4;
    pub(crate) const DELETE: u8 = 5;
    pub(crate) const WAIT: u8 = 6;
}

/// Response status: success; the body depends on the request.
pub(crate) const STATUS_OK: u8 = 0;
/// Response status: the wait timed out; the body says which keys were missing.
pub(crate) const STATUS_TIMEOUT: u8 = 1;
/// Response status: the request failed; the body is the message.
pub(crate) const STATUS_ERROR: u8 = 2;

/// Why a frame could not be read.
#[derive(Debug)]
pub(crate) enum FrameError {
    /// The length prefix is over the limit; nothing was allocated for it.
    TooLarge(u32),
    /// The peer closed the connection in the middle of a frame.
    Truncated,
    /// The socket failed.
    Io(std::io::Error),
    /// A frame had begun but did not arrive whole within this deadline.
    Stalled(Duration),
}

impl std::fmt::Display for FrameError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FrameError::TooLarge(n) => write!(f, "frame length prefix {n} (0x{n:08x}) is over the limit"),
            FrameError::Truncated => f.write_str("connection closed in the middle of a frame"),
            FrameError::Io(e) => write!(f, "{e}"),
            FrameError::Stalled(d) => write!(f, "a frame did not arrive whole within {d:?} of its first byte"),
        }
    }
}

/// Reads one frame's payload; `Ok(None)` when the peer closed the connection between frames.
///
/// The buffer grows as bytes arrive, so a peer that announces a large frame and stalls costs
/// only what it actually sent.
pub(crate) async fn read_frame<R: AsyncRead + Unpin>(r: &mut R, max: usize) -> Result<Option<Bytes>, FrameError> {
    Ok(read_frame_held(r, max, None).await?.map(|(f, _)| f))
}

/// The largest frame read without taking from the frames' budget.
pub(crate) const SMALL_FRAME: usize = 4 << 10;

/// [`read_frame`], holding `budget` permits for the length of a frame over [`SMALL_FRAME`]
/// from the moment its length is known (waiting for them first): large frames in flight on
/// every connection together stay within the budget. The permits come back with the frame.
async fn read_frame_held<R: AsyncRead + Unpin>(
    r: &mut R,
    max: usize,
    budget: Option<&Arc<Semaphore>>,
) -> Result<Option<(Bytes, Option<OwnedSemaphorePermit>)>, FrameError> {
    let mut header = [0u8; 4];
    let mut got = 0;
    while got < header.len() {
        match r.read(&mut header[got..]).await.map_err(FrameError::Io)? {
            0 if got == 0 => return Ok(None),
            0 => return Err(FrameError::Truncated),
            n => got += n,
        }
    }
    let len = u32::from_le_bytes(header);
    if len as usize > max {
        return Err(FrameError::TooLarge(len));
    }
    // A small frame (every rendezvous request) takes nothing from the budget: frames that
    // other clients stall cannot hold it up. Each connection reads one frame at a time, so
    // small frames hold at most connections × SMALL_FRAME.
    let permit = match budget {
        Some(b) if len as usize > SMALL_FRAME => {
            Some(b.clone().acquire_many_owned(len).await.map_err(|_| FrameError::Truncated)?)
        }
        _ => None,
    };
    let mut payload = Vec::with_capacity((len as usize).min(64 << 10));
    r.take(u64::from(len)).read_to_end(&mut payload).await.map_err(FrameError::Io)?;
    if payload.len() != len as usize {
        return Err(FrameError::Truncated);
    }
    Ok(Some((payload.into(), permit)))
}

/// Like [`read_frame_held`], but once a frame's first byte has arrived the rest must follow
/// within `deadline` (waiting for the budget included): an idle connection may wait between
/// frames as long as it likes, a client that stalls in the middle of one is cut off.
pub(crate) async fn read_frame_within<R: AsyncRead + Unpin>(
    r: &mut R,
    max: usize,
    deadline: Duration,
    budget: &Arc<Semaphore>,
) -> Result<Option<(Bytes, Option<OwnedSemaphorePermit>)>, FrameError> {
    let mut first = [0u8; 1];
    if r.read(&mut first).await.map_err(FrameError::Io)? == 0 {
        return Ok(None);
    }
    let rest = async {
        let mut chained = AsyncReadExt::chain(&first[..], &mut *r);
        match read_frame_held(&mut chained, max, Some(budget)).await? {
            Some(f) => Ok(Some(f)),
            None => Err(FrameError::Truncated),
        }
    };
    tokio::time::timeout(deadline, rest).await.unwrap_or(Err(FrameError::Stalled(deadline)))
}

/// Writes a frame built by [`Enc`], whole.
pub(crate) async fn write_frame<W: AsyncWrite + Unpin>(w: &mut W, frame: &[u8]) -> std::io::Result<()> {
    w.write_all(frame).await?;
    w.flush().await
}

/// Builds a frame: the length prefix is filled in by [`Enc::finish`].
pub(crate) struct Enc(BytesMut);

impl Enc {
    pub(crate) fn new() -> Self {
        Self::with_capacity(64)
    }

    pub(crate) fn with_capacity(n: usize) -> Self {
        let mut b = BytesMut::with_capacity(n + 4);
        b.put_u32_le(0);
        Enc(b)
    }

    pub(crate) fn raw(mut self, b: &[u8]) -> Self {
        self.0.put_slice(b);
        self
    }

    pub(crate) fn u8(mut self, x: u8) -> Self {
        self.0.put_u8(x);
        self
    }

    pub(crate) fn u32(mut self, x: u32) -> Self {
        self.0.put_u32_le(x);
        self
    }

    pub(crate) fn u64(mut self, x: u64) -> Self {
        self.0.put_u64_le(x);
        self
    }

    pub(crate) fn i64(mut self, x: i64) -> Self {
        self.0.put_i64_le(x);
        self
    }

    /// A duration as saturating nanoseconds.
    pub(crate) fn duration(self, d: Duration) -> Self {
        self.u64(u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
    }

    /// A length-prefixed byte string; lengths over `u32::MAX` are caught by [`Enc::finish`]'s
    /// frame-size check first (the frame would be bigger still), so saturating is harmless.
    pub(crate) fn bytes(self, b: &[u8]) -> Self {
        self.u32(u32::try_from(b.len()).unwrap_or(u32::MAX)).raw(b)
    }

    /// The frame, or its payload size when it is over `max`.
    pub(crate) fn finish(mut self, max: usize) -> Result<Bytes, usize> {
        let len = self.0.len() - 4;
        match u32::try_from(len) {
            Ok(n) if len <= max => {
                self.0[..4].copy_from_slice(&n.to_le_bytes());
                Ok(self.0.freeze())
            }
            _ => Err(len),
        }
    }
}

/// A malformed payload.
#[derive(Debug)]
pub(crate) struct Malformed(pub(crate) &'static str);

/// What reading past the end of a payload is.
const ENDS_EARLY: Malformed = Malformed("payload ends early");

/// Reads fields off a payload, never past its end.
pub(crate) struct Dec<'a>(pub(crate) &'a [u8]);

impl<'a> Dec<'a> {
    pub(crate) fn take(&mut self, n: usize) -> Result<&'a [u8], Malformed> {
        let (head, rest) = self.0.split_at_checked(n).ok_or(ENDS_EARLY)?;
        self.0 = rest;
        Ok(head)
    }

    pub(crate) fn u8(&mut self) -> Result<u8, Malformed> {
        self.0.try_get_u8().map_err(|_| ENDS_EARLY)
    }

    pub(crate) fn u32(&mut self) -> Result<u32, Malformed> {
        self.0.try_get_u32_le().map_err(|_| ENDS_EARLY)
    }

    pub(crate) fn u64(&mut self) -> Result<u64, Malformed> {
        self.0.try_get_u64_le().map_err(|_| ENDS_EARLY)
    }

    pub(crate) fn i64(&mut self) -> Result<i64, Malformed> {
        self.0.try_get_i64_le().map_err(|_| ENDS_EARLY)
    }

    /// A duration, clamped to [`MAX_WAIT`].
    pub(crate) fn duration(&mut self) -> Result<Duration, Malformed> {
        Ok(Duration::from_nanos(self.u64()?).min(MAX_WAIT))
    }

    pub(crate) fn bytes(&mut self) -> Result<&'a [u8], Malformed> {
        let n = self.u32()?;
        self.take(n as usize)
    }

    pub(crate) fn str(&mut self) -> Result<&'a str, Malformed> {
        std::str::from_utf8(self.bytes()?).map_err(|_| Malformed("key is not UTF-8"))
    }

    /// Everything left.
    pub(crate) fn rest(&mut self) -> &'a [u8] {
        std::mem::take(&mut self.0)
    }

    pub(crate) fn end(&self) -> Result<(), Malformed> {
        if self.0.is_empty() {
            Ok(())
        } else {
            Err(Malformed("trailing bytes after the fields"))
        }
    }
}

/// A decoded request (the server's view).
#[derive(Debug, PartialEq)]
pub(crate) enum Request {
    Set { key: String, value: Vec<u8> },
    Get { key: String, timeout: Duration },
    Add { key: String, delta: i64 },
    CompareSet { key: String, expected: Option<Vec<u8>>, desired: Vec<u8> },
    Delete { key: String },
    Wait { keys: Vec<String>, timeout: Duration },
}

/// Decodes a request payload into its id and the request.
pub(crate) fn decode_request(payload: &[u8]) -> Result<(u64, Request), Malformed> {
    let mut d = Dec(payload);
    let id = d.u64()?;
    let req = match d.u8()? {
        op::SET => Request::Set { key: d.str()?.to_owned(), value: d.bytes()?.to_vec() },
        op::GET => Request::Get { key: d.str()?.to_owned(), timeout: d.duration()? },
        op::ADD => Request::Add { key: d.str()?.to_owned(), delta: d.i64()? },
        op::COMPARE_SET => {
            let key = d.str()?.to_owned();
            let expected = match d.u8()? {
                0 => None,
                1 => Some(d.bytes()?.to_vec()),
                _ => return Err(Malformed("bad option tag")),
            };
            Request::CompareSet { key, expected, desired: d.bytes()?.to_vec() }
        }
        op::DELETE => Request::Delete { key: d.str()?.to_owned() },
        op::WAIT => {
            let timeout = d.duration()?;
            let n = d.u32()?;
            // Each key takes at least its 4-byte length: bounds the allocation by the payload.
            if n as usize > d.0.len() / 4 {
                return Err(Malformed("key count larger than the payload"));
            }
            let keys = (0..n).map(|_| d.str().map(str::to_owned)).collect::<Result<_, _>>()?;
            Request::Wait { keys, timeout }
        }
        _ => return Err(Malformed("unknown opcode")),
    };
    d.end()?;
    Ok((id, req))
}

/// A response frame.
pub(crate) fn response(id: u64, status: u8, body: &[u8]) -> Bytes {
    // Bodies are at most a stored value, which fit in a request frame; the fallback keeps the
    // connection well-formed even so.
    Enc::with_capacity(body.len() + 9).u64(id).u8(status).raw(body).finish(MAX_FRAME).unwrap_or_else(|_| {
        Enc::new().u64(id).u8(STATUS_ERROR).raw(b"response too large for a frame").finish(MAX_FRAME).unwrap_or_default()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Large frames being read hold their length of the shared budget until they are
    /// dropped: a second one waits for room (here past its deadline), and reads once there
    /// is; a small frame never waits.
    #[tokio::test]
    async fn frames_in_flight_share_one_budget() {
        const K: usize = 1 << 10;
        let budget = Arc::new(Semaphore::new(100 * K));
        let frame = |n: usize| Enc::new().raw(&vec![1u8; n]).finish(MAX_FRAME).unwrap();
        let (a, b, small) = (frame(80 * K), frame(50 * K), frame(SMALL_FRAME));
        let held = read_frame_within(&mut &a[..], MAX_FRAME, Duration::from_secs(1), &budget).await.unwrap().unwrap();
        assert_eq!((held.0.len(), budget.available_permits()), (80 * K, 20 * K));
        let short = Duration::from_millis(100);
        assert!(matches!(read_frame_within(&mut &b[..], MAX_FRAME, short, &budget).await, Err(FrameError::Stalled(_))));
        let got = read_frame_within(&mut &small[..], MAX_FRAME, short, &budget).await.unwrap().unwrap();
        assert_eq!((got.0.len(), got.1.is_none()), (SMALL_FRAME, true));
        drop(held);
        let got = read_frame_within(&mut &b[..], MAX_FRAME, short, &budget).await.unwrap().unwrap();
        assert_eq!(got.0.len(), 50 * K);
    }

    fn frame_payload(f: &[u8]) -> &[u8] {
        let len = u32::from_le_bytes([f[0], f[1], f[2], f[3]]) as usize;
        assert_eq!(len, f.len() - 4);
        &f[4..]
    }

    #[test]
    fn requests_round_trip() {
        let f = Enc::new()
            .u64(7)
            .u8(op::COMPARE_SET)
            .bytes(b"k")
            .u8(1)
            .bytes(b"old")
            .bytes(b"new")
            .finish(MAX_FRAME)
            .unwrap();
        let (id, r) = decode_request(frame_payload(&f)).unwrap();
        assert_eq!(id, 7);
        assert_eq!(
            r,
            Request::CompareSet { key: "k".into(), expected: Some(b"old".to_vec()), desired: b"new".to_vec() }
        );
        let f = Enc::new()
            .u64(1)
            .u8(op::WAIT)
            .duration(Duration::MAX)
            .u32(2)
            .bytes(b"a")
            .bytes(b"b")
            .finish(MAX_FRAME)
            .unwrap();
        let (_, r) = decode_request(frame_payload(&f)).unwrap();
        assert_eq!(r, Request::Wait { keys: vec!["a".into(), "b".into()], timeout: MAX_WAIT });
    }

    #[test]
    fn malformed_requests_are_errors() {
        let cases: &[&[u8]] = &[
            b"",
            &[1, 0, 0, 0, 0, 0, 0, 0],
            &[1, 0, 0, 0, 0, 0, 0, 0, 99],
            // SET with a key length past the end.
            &[1, 0, 0, 0, 0, 0, 0, 0, op::SET, 255, 255, 255, 255],
            // WAIT claiming 2^32-1 keys.
            &[1, 0, 0, 0, 0, 0, 0, 0, op::WAIT, 0, 0, 0, 0, 0, 0, 0, 0, 255, 255, 255, 255],
            // DELETE with a non-UTF-8 key.
            &[1, 0, 0, 0, 0, 0, 0, 0, op::DELETE, 1, 0, 0, 0, 0xff],
            // DELETE with trailing bytes.
            &[1, 0, 0, 0, 0, 0, 0, 0, op::DELETE, 1, 0, 0, 0, b'k', 0],
        ];
        for c in cases {
            assert!(decode_request(c).is_err(), "{c:?}");
        }
    }

    #[test]
    fn oversized_frames_are_refused() {
        assert_eq!(Enc::new().raw(&[0; 10]).finish(9), Err(10));
        let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
        rt.block_on(async {
            let mut r: &[u8] = &[0xff, 0xff, 0xff, 0xff, 1, 2, 3];
            assert!(matches!(read_frame(&mut r, MAX_FRAME).await, Err(FrameError::TooLarge(u32::MAX))));
            let mut r: &[u8] = &[5, 0, 0, 0, 1, 2];
            assert!(matches!(read_frame(&mut r, MAX_FRAME).await, Err(FrameError::Truncated)));
            let mut r: &[u8] = &[5, 0];
            assert!(matches!(read_frame(&mut r, MAX_FRAME).await, Err(FrameError::Truncated)));
            let mut r: &[u8] = &[];
            assert!(matches!(read_frame(&mut r, MAX_FRAME).await, Ok(None)));
            let mut r: &[u8] = &[2, 0, 0, 0, 1, 2, 9];
            assert_eq!(read_frame(&mut r, MAX_FRAME).await.unwrap().as_deref(), Some(&[1, 2][..]));
        });
    }
}
