//! Object collectives (torch's `all_gather_object`, `broadcast_object_list`, `gather_object`,
//! `scatter_object_list`) for any serde type, built on the tensor ops so every backend has them.
//!
//! Objects travel as `postcard` bytes in two ops. The first all-gathers every rank's header —
//! a magic word, a fingerprint of the object's type, the rank's size cap and its object sizes —
//! so every rank sees the same headers and reaches the same verdict: ranks that disagree on the
//! type, or sizes over the cap, fail on every rank before anything is allocated. The second
//! moves the bytes, padded to the largest object. Decoding is strict (trailing bytes are an
//! error naming the rank). These are `async fn`s that issue their two ops one after the other:
//! await each before the group's next op.

use serde::de::DeserializeOwned;
use serde::Serialize;

use comm_core::{CommError, DType, HostBuffer, Rank};

use crate::ProcessGroup;

/// First word of every header: a plain tensor op that meets an object op fails its check.
const MAGIC: u64 = u64::from_le_bytes(*b"commobj1");
/// A size slot that holds no object (a non-root's, or a root that passed none).
const NONE: u64 = u64::MAX;
/// Words before the sizes: magic, type fingerprint, size cap.
const HEAD: usize = 3;

/// The largest object, and the largest buffer of padded objects, an op accepts: a peer can
/// never make this rank allocate more (`COMM_OBJECT_MAX`, a size; 1 GiB by default). Ranks
/// with different caps use the smallest.
fn size_cap() -> Result<u64, CommError> {
    let cap = comm_core::config::env_parse("COMM_OBJECT_MAX", comm_core::config::parse_size)?;
    Ok(cap.unwrap_or(1 << 30) as u64)
}

/// A fingerprint of `T`'s name (FNV-1a): the same on every rank built from the same source.
fn fingerprint<T>() -> u64 {
    crate::group::fnv1a(std::any::type_name::<T>().as_bytes())
}

fn encode<T: Serialize>(op: &'static str, obj: &T) -> Result<Vec<u8>, CommError> {
    postcard::to_stdvec(obj).map_err(|e| CommError::invalid(op, format!("the object does not serialize: {e}")))
}

/// Decodes exactly `bytes` as a `T`: bytes left over mean the sender's type was another one.
fn decode<T: DeserializeOwned>(op: &'static str, bytes: &[u8], from: Rank) -> Result<T, CommError> {
    let mismatch = |what: String| {
        CommError::mismatch(op, format!("rank {from}'s object {what} (do all ranks pass the same type?)"))
    };
    let ty = std::any::type_name::<T>();
    match postcard::take_from_bytes(bytes) {
        Ok((obj, [])) => Ok(obj),
        Ok((_, rest)) => Err(mismatch(format!("has {} bytes left over after a {ty}", rest.len()))),
        Err(e) => Err(mismatch(format!("does not decode as {ty}: {e}"))),
    }
}

/// Every rank's header, checked alike on every rank (the same magic and type, sizes within
/// the smallest cap): each rank's size slots, and that cap.
struct Headers {
    sizes: Vec<Vec<u64>>,
    cap: u64,
}

impl ProcessGroup {
    /// All-gathers this rank's header (`sizes` slots) for an object op on `T`.
    async fn object_headers<T>(&self, op: &'static str, sizes: &[u64]) -> Result<Headers, CommError> {
        let mut mine = vec![MAGIC, fingerprint::<T>(), size_cap()?];
        mine.extend_from_slice(sizes);
        let width = mine.len();
        // No u64 dtype: the words travel as i64 bit patterns.
        let words: Vec<i64> = mine.iter().map(|&w| w as i64).collect();
        let all = quietly(|| self.all_gather(HostBuffer::from_slice(&words))).await?;
        let all: Vec<u64> = all.as_slice::<i64>()?.iter().map(|&w| w as u64).collect();
        let ty = std::any::type_name::<T>();
        let me = self.rank();
        let mut cap = u64::MAX;
        for (r, h) in all.chunks_exact(width).enumerate() {
            if h[0] != MAGIC {
                return Err(CommError::mismatch(op, format!("rank {r} called another op (rank {me} called {op})")));
            }
            if h[1] != mine[1] {
                return Err(CommError::mismatch(op, format!("rank {r} passes another type than rank {me}'s {ty}")));
            }
            cap = cap.min(h[2]);
        }
        let sizes: Vec<Vec<u64>> = all.chunks_exact(width).map(|h| h[HEAD..].to_vec()).collect();
        for (r, s) in sizes.iter().enumerate() {
            if let Some(big) = s.iter().find(|&&s| s != NONE && s > cap) {
                return Err(CommError::invalid(
                    op,
                    format!("rank {r}'s object is {big} bytes, over the cap of {cap} (COMM_OBJECT_MAX)"),
                ));
            }
        }
        Ok(Headers { sizes, cap })
    }
}

/// The bytes of `count` blocks of `block` bytes, or an error naming the cap.
fn within_cap(op: &'static str, count: usize, block: u64, cap: u64) -> Result<usize, CommError> {
    let total = (count as u64).checked_mul(block).filter(|&t| t <= cap).ok_or_else(|| {
        CommError::invalid(
            op,
            format!("{count} objects of up to {block} bytes exceed the cap of {cap} (COMM_OBJECT_MAX)"),
        )
    })?;
    Ok(total as usize)
}

/// `count` blocks of `block` bytes, zeroed, or an error naming the cap.
fn blocks(op: &'static str, count: usize, block: u64, cap: u64) -> Result<HostBuffer, CommError> {
    HostBuffer::try_zeroed(DType::U8, within_cap(op, count, block, cap)?)
}

/// The header exchange is the object op's bookkeeping: not profiled on its own.
fn quietly<T>(f: impl FnOnce() -> T) -> T {
    #[cfg(feature = "profiling")]
    return profiling::without_profiling(f);
    #[cfg(not(feature = "profiling"))]
    f()
}

/// The op that moves the objects: profiled as the object op itself (`op`, this rank's encoded
/// `bytes`), so the summary has one row per call.
fn as_op<T>(op: &'static str, bytes: u64, f: impl FnOnce() -> T) -> T {
    #[cfg(feature = "profiling")]
    return profiling::recorded_as(op, bytes, f);
    #[cfg(not(feature = "profiling"))]
    {
        let _ = (op, bytes);
        f()
    }
}

/// Each rank's size in an op where every rank sends an object.
fn every_rank_sent(op: &'static str, h: &Headers) -> Result<Vec<u64>, CommError> {
    let lens: Vec<u64> = h.sizes.iter().map(|s| s[0]).collect();
    match lens.iter().position(|&l| l == NONE) {
        Some(r) => Err(CommError::mismatch(op, format!("rank {r} sent no object"))),
        None => Ok(lens),
    }
}

/// The largest of `sizes` that holds an object.
fn largest(sizes: impl IntoIterator<Item = u64>) -> u64 {
    sizes.into_iter().filter(|&s| s != NONE).max().unwrap_or(0)
}

/// `bytes`, padded with zeros to `len` (checked against the cap already).
fn padded(bytes: &[u8], len: u64, cap: u64) -> Result<HostBuffer, CommError> {
    let mut b = blocks("object collective", 1, len, cap)?;
    b.as_bytes_mut()[..bytes.len()].copy_from_slice(bytes);
    Ok(b)
}

/// Decodes rank `r`'s object from block `r` of `all` (blocks of `max` bytes).
fn decode_block<T: DeserializeOwned>(
    op: &'static str,
    all: &HostBuffer,
    max: u64,
    r: usize,
    len: u64,
) -> Result<T, CommError> {
    let at = r * max as usize;
    decode(op, &all.as_bytes()[at..at + len as usize], r as Rank)
}

impl ProcessGroup {
    /// Every rank's `obj`, in rank order (torch's `all_gather_object`).
    pub async fn all_gather_object<T: Serialize + DeserializeOwned>(&self, obj: &T) -> Result<Vec<T>, CommError> {
        const OP: &str = "all_gather_object";
        let mine = encode(OP, obj)?;
        let h = self.object_headers::<T>(OP, &[mine.len() as u64]).await?;
        let lens = every_rank_sent(OP, &h)?;
        let max = largest(lens.iter().copied());
        // Checked before the op: every rank allocates world_size × max bytes.
        within_cap(OP, lens.len(), max, h.cap)?;
        let input = padded(&mine, max, h.cap)?;
        let all = as_op(OP, mine.len() as u64, || self.all_gather(input)).await?;
        lens.iter().enumerate().map(|(r, &len)| decode_block(OP, &all, max, r, len)).collect()
    }

    /// `root`'s object on every rank (torch's `broadcast_object_list` of one object): the root
    /// passes `Some(obj)`, the others `None`.
    #[doc(alias = "broadcast_object_list")]
    pub async fn broadcast_object<T: Serialize + DeserializeOwned>(
        &self,
        obj: Option<T>,
        root: Rank,
    ) -> Result<T, CommError> {
        const OP: &str = "broadcast_object";
        self.check_root(OP, root)?;
        let is_root = self.rank() == root;
        // A root without an object still takes part (so nobody waits for it), sending NONE.
        let mine = match (&obj, is_root) {
            (Some(o), true) => Some(encode(OP, o)?),
            _ => None,
        };
        let h = self.object_headers::<T>(OP, &[mine.as_ref().map_or(NONE, |m| m.len() as u64)]).await?;
        let size = h.sizes[root as usize][0];
        if size == NONE {
            return Err(CommError::invalid(OP, format!("the root (rank {root}) passed no object")));
        }
        let buf = padded(mine.as_deref().unwrap_or(&[]), size, h.cap)?;
        let bytes = as_op(OP, size, || self.broadcast(buf, root)).await?;
        match obj.filter(|_| is_root) {
            Some(o) => Ok(o),
            None => decode(OP, bytes.as_bytes(), root),
        }
    }

    /// Every rank's `obj` on `root` in rank order, `None` elsewhere (torch's `gather_object`).
    pub async fn gather_object<T: Serialize + DeserializeOwned>(
        &self,
        obj: &T,
        root: Rank,
    ) -> Result<Option<Vec<T>>, CommError> {
        const OP: &str = "gather_object";
        self.check_root(OP, root)?;
        let mine = encode(OP, obj)?;
        let h = self.object_headers::<T>(OP, &[mine.len() as u64]).await?;
        let lens = every_rank_sent(OP, &h)?;
        let max = largest(lens.iter().copied());
        within_cap(OP, lens.len(), max, h.cap)?;
        let input = padded(&mine, max, h.cap)?;
        let Some(all) = as_op(OP, mine.len() as u64, || self.gather(input, root)).await?.into_result() else {
            return Ok(None);
        };
        lens.iter().enumerate().map(|(r, &len)| decode_block(OP, &all, max, r, len)).collect::<Result<_, _>>().map(Some)
    }

    /// Object `r` of the root's list on rank `r` (torch's `scatter_object_list`): the root
    /// passes `Some(list)` with one object per rank, the others `None`.
    #[doc(alias = "scatter_object_list")]
    pub async fn scatter_object<T: Serialize + DeserializeOwned>(
        &self,
        objs: Option<Vec<T>>,
        root: Rank,
    ) -> Result<T, CommError> {
        const OP: &str = "scatter_object";
        self.check_root(OP, root)?;
        let n = self.world_size() as usize;
        let is_root = self.rank() == root;
        // The root's sizes ride in its header (NONE each when it has no valid list: everyone
        // fails alike).
        let encoded = match (&objs, is_root) {
            (Some(list), true) if list.len() == n => {
                Some(list.iter().map(|o| encode(OP, o)).collect::<Result<Vec<_>, _>>()?)
            }
            _ => None,
        };
        let sizes: Vec<u64> = match &encoded {
            Some(e) => e.iter().map(|b| b.len() as u64).collect(),
            None => vec![NONE; n],
        };
        let h = self.object_headers::<T>(OP, &sizes).await?;
        let sizes = &h.sizes[root as usize];
        if sizes.contains(&NONE) {
            return Err(CommError::invalid(OP, format!("the root (rank {root}) passed no list of {n} objects")));
        }
        let max = largest(sizes.iter().copied());
        within_cap(OP, n, max, h.cap)?;
        let input = match encoded {
            Some(e) => {
                let mut all = blocks(OP, n, max, h.cap)?;
                for (r, b) in e.iter().enumerate() {
                    let at = r * max as usize;
                    all.as_bytes_mut()[at..at + b.len()].copy_from_slice(b);
                }
                Some(all)
            }
            None => None,
        };
        let me = self.rank() as usize;
        let output = blocks(OP, 1, max, h.cap)?;
        let block = as_op(OP, sizes[me], || self.scatter(output, input, root)).await?.output;
        decode(OP, &block.as_bytes()[..sizes[me] as usize], root)
    }

    /// A root out of range fails here, on the rank that passed it, before any op.
    fn check_root(&self, op: &'static str, root: Rank) -> Result<(), CommError> {
        if root >= self.world_size() {
            return Err(CommError::invalid(
                op,
                format!("root {root} is not a rank of this group of {}", self.world_size()),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decoding_is_strict_and_names_the_rank() {
        let pair = encode("t", &(3u32, 4u32)).unwrap();
        let e = decode::<u32>("broadcast_object", &pair, 2).unwrap_err().to_string();
        assert!(e.contains("rank 2's object has 1 bytes left over after a u32"), "{e}");
        let e = decode::<String>("t", &[200], 1).unwrap_err().to_string();
        assert!(e.contains("rank 1's object does not decode as alloc::string::String"), "{e}");
        assert_eq!(decode::<(u32, u32)>("t", &pair, 0).unwrap(), (3, 4));
    }

    #[test]
    fn type_fingerprints_differ_and_blocks_are_capped() {
        assert_ne!(fingerprint::<u32>(), fingerprint::<(u32, u32)>());
        assert_eq!(fingerprint::<Vec<u8>>(), fingerprint::<Vec<u8>>());
        assert!(blocks("t", 3, u64::MAX / 2, u64::MAX).is_err(), "an overflowing total is an error");
        assert!(blocks("t", 2, 600, 1000).unwrap_err().to_string().contains("exceed the cap of 1000"));
        assert_eq!(blocks("t", 2, 500, 1000).unwrap().byte_len(), 1000);
    }
}
