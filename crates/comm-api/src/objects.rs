//! Object collectives (torch's `all_gather_object`, `broadcast_object_list`, `gather_object`,
//! `scatter_object_list`) for any serde type, built on the tensor ops so every backend has them.
//!
//! Objects travel as `postcard` bytes: first their sizes (one `i64` per object), then the
//! bytes padded to the largest, so ranks may hold objects of different sizes. These are `async
//! fn`s that issue their two ops one after the other: await each before the group's next op.

use serde::de::DeserializeOwned;
use serde::Serialize;

use comm_core::{CommError, DType, HostBuffer, Rank};

use crate::ProcessGroup;

fn encode<T: Serialize>(op: &'static str, obj: &T) -> Result<Vec<u8>, CommError> {
    postcard::to_stdvec(obj).map_err(|e| CommError::invalid(op, format!("the object does not serialize: {e}")))
}

fn decode<T: DeserializeOwned>(op: &'static str, bytes: &[u8], from: Rank) -> Result<T, CommError> {
    postcard::from_bytes(bytes).map_err(|e| CommError::Mismatch {
        op,
        detail: format!(
            "rank {from}'s object does not decode as {}: {e} (do all ranks pass the same type?)",
            std::any::type_name::<T>()
        ),
    })
}

fn len_of(buf: &HostBuffer, i: usize) -> Result<usize, CommError> {
    let v = buf.as_slice::<i64>()?[i];
    usize::try_from(v).map_err(|_| CommError::Mismatch { op: "object collective", detail: format!("size {v}") })
}

/// `bytes` padded with zeros to `len`.
fn padded(bytes: &[u8], len: usize) -> HostBuffer {
    let mut b = HostBuffer::zeroed(DType::U8, len);
    b.as_bytes_mut()[..bytes.len()].copy_from_slice(bytes);
    b
}

impl ProcessGroup {
    /// Every rank's `obj`, in rank order (torch's `all_gather_object`).
    pub async fn all_gather_object<T: Serialize + DeserializeOwned>(&self, obj: &T) -> Result<Vec<T>, CommError> {
        const OP: &str = "all_gather_object";
        let mine = encode(OP, obj)?;
        let lens = self.all_gather(HostBuffer::from_slice(&[mine.len() as i64])).await?;
        let n = self.world_size() as usize;
        let max = (0..n).map(|r| len_of(&lens, r)).try_fold(0, |m, l| l.map(|l| m.max(l)))?;
        let all = self.all_gather(padded(&mine, max)).await?;
        (0..n).map(|r| decode(OP, &all.as_bytes()[r * max..r * max + len_of(&lens, r)?], r as Rank)).collect()
    }

    /// `root`'s object on every rank (torch's `broadcast_object_list` of one object): the root
    /// passes `Some(obj)`, the others `None`.
    pub async fn broadcast_object<T: Serialize + DeserializeOwned>(
        &self,
        obj: Option<T>,
        root: Rank,
    ) -> Result<T, CommError> {
        const OP: &str = "broadcast_object";
        let is_root = self.rank() == root;
        // A root without an object still takes part (so nobody waits for it), sending size -1.
        let mine = match (&obj, is_root) {
            (Some(o), true) => Some(encode(OP, o)?),
            _ => None,
        };
        let size = mine.as_ref().map_or(-1, |m| m.len() as i64);
        let size = self.broadcast(HostBuffer::from_slice(&[size]), root).await?.as_slice::<i64>()?[0];
        let Ok(size) = usize::try_from(size) else {
            return Err(CommError::invalid(OP, format!("the root (rank {root}) passed no object")));
        };
        let bytes = self.broadcast(padded(mine.as_deref().unwrap_or(&[]), size), root).await?;
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
        let mine = encode(OP, obj)?;
        let lens = self.all_gather(HostBuffer::from_slice(&[mine.len() as i64])).await?;
        let n = self.world_size() as usize;
        let max = (0..n).map(|r| len_of(&lens, r)).try_fold(0, |m, l| l.map(|l| m.max(l)))?;
        let all = self.gather(padded(&mine, max), root).await?;
        if self.rank() != root {
            return Ok(None);
        }
        (0..n)
            .map(|r| decode(OP, &all.as_bytes()[r * max..r * max + len_of(&lens, r)?], r as Rank))
            .collect::<Result<_, _>>()
            .map(Some)
    }

    /// Object `r` of the root's list on rank `r` (torch's `scatter_object_list`): the root
    /// passes `Some(list)` with one object per rank, the others `None`.
    pub async fn scatter_object<T: Serialize + DeserializeOwned>(
        &self,
        objs: Option<Vec<T>>,
        root: Rank,
    ) -> Result<T, CommError> {
        const OP: &str = "scatter_object";
        let n = self.world_size() as usize;
        let is_root = self.rank() == root;
        // The root's sizes go first (-1 each when it has no valid list: everyone fails alike).
        let encoded = match (&objs, is_root) {
            (Some(list), true) if list.len() == n => {
                Some(list.iter().map(|o| encode(OP, o)).collect::<Result<Vec<_>, _>>()?)
            }
            _ => None,
        };
        let sizes: Vec<i64> = match &encoded {
            Some(e) => e.iter().map(|b| b.len() as i64).collect(),
            None => vec![-1; n],
        };
        let sizes = self.broadcast(HostBuffer::from_slice(&sizes), root).await?;
        let sizes = sizes.as_slice::<i64>()?.to_vec();
        if sizes.iter().any(|&s| s < 0) {
            return Err(CommError::invalid(OP, format!("the root (rank {root}) passed no list of {n} objects")));
        }
        let max = sizes.iter().copied().max().unwrap_or(0) as usize;
        let input = encoded.map(|e| {
            let mut all = HostBuffer::zeroed(DType::U8, max * n);
            for (r, b) in e.iter().enumerate() {
                all.as_bytes_mut()[r * max..r * max + b.len()].copy_from_slice(b);
            }
            all
        });
        let block = self.scatter(HostBuffer::zeroed(DType::U8, max), input, root).await?.output;
        let me = self.rank() as usize;
        decode(OP, &block.as_bytes()[..sizes[me] as usize], root)
    }
}
