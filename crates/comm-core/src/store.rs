use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use async_trait::async_trait;
use tokio::sync::Notify;

use crate::CommError;

/// The rendezvous key-value store ranks use to bootstrap (exchange shm names, NCCL ids...).
///
/// Semantics follow torch's `Store`: `get` and `wait` block until the keys exist or the
/// timeout elapses; `add` creates a counter at 0; `compare_set` swaps when the current value
/// equals `expected` (`None` = the key is absent) and returns the value now stored.
#[async_trait]
pub trait Store: Send + Sync + std::fmt::Debug {
    /// Sets `key` to `value`, waking waiters.
    async fn set(&self, key: &str, value: &[u8]) -> Result<(), CommError>;
    /// The value of `key`, waiting up to `timeout` for it to be set.
    async fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>, CommError>;
    /// Adds `delta` to the integer counter `key` and returns the new value.
    async fn add(&self, key: &str, delta: i64) -> Result<i64, CommError>;
    /// Atomically replaces the value when it equals `expected`; returns the value now stored.
    async fn compare_set(&self, key: &str, expected: Option<&[u8]>, desired: &[u8]) -> Result<Vec<u8>, CommError>;
    /// Removes `key`; returns whether it existed.
    async fn delete(&self, key: &str) -> Result<bool, CommError>;
    /// Waits up to `timeout` until every key in `keys` exists.
    async fn wait(&self, keys: &[&str], timeout: Duration) -> Result<(), CommError>;
}

/// An in-process [`Store`], for single-process worlds and tests.
#[derive(Debug, Default)]
pub struct MemoryStore {
    map: Mutex<HashMap<String, Vec<u8>>>,
    changed: Notify,
}

impl MemoryStore {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }

    fn with<T>(&self, f: impl FnOnce(&mut HashMap<String, Vec<u8>>) -> T) -> T {
        let out = f(&mut self.map.lock().unwrap_or_else(|e| e.into_inner()));
        self.changed.notify_waiters();
        out
    }

    async fn wait_for<T>(
        &self,
        what: &str,
        timeout: Duration,
        mut probe: impl FnMut(&HashMap<String, Vec<u8>>) -> Option<T>,
    ) -> Result<T, CommError> {
        // Far-future deadlines (Duration::MAX) mean "no deadline", not an overflow panic.
        let deadline = tokio::time::Instant::now().checked_add(timeout);
        loop {
            let notified = self.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if let Some(v) = probe(&self.map.lock().unwrap_or_else(|e| e.into_inner())) {
                return Ok(v);
            }
            let expired = match deadline {
                Some(d) => tokio::time::timeout_at(d, notified).await.is_err(),
                None => {
                    notified.await;
                    false
                }
            };
            if expired {
                return Err(CommError::timeout("store wait", timeout, format!("key(s) {what} never set")));
            }
        }
    }
}

#[async_trait]
impl Store for MemoryStore {
    async fn set(&self, key: &str, value: &[u8]) -> Result<(), CommError> {
        self.with(|m| m.insert(key.to_owned(), value.to_vec()));
        Ok(())
    }

    async fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>, CommError> {
        self.wait_for(key, timeout, |m| m.get(key).cloned()).await
    }

    async fn add(&self, key: &str, delta: i64) -> Result<i64, CommError> {
        self.with(|m| {
            let cur = match m.get(key) {
                None => 0,
                Some(v) => std::str::from_utf8(v)
                    .ok()
                    .and_then(|s| s.parse::<i64>().ok())
                    .ok_or_else(|| CommError::Store(format!("add on key `{key}` whose value is not an integer")))?,
            };
            let new = cur.wrapping_add(delta);
            m.insert(key.to_owned(), new.to_string().into_bytes());
            Ok(new)
        })
    }

    async fn compare_set(&self, key: &str, expected: Option<&[u8]>, desired: &[u8]) -> Result<Vec<u8>, CommError> {
        Ok(self.with(|m| {
            let cur = m.get(key).map(Vec::as_slice);
            if cur == expected {
                m.insert(key.to_owned(), desired.to_vec());
                desired.to_vec()
            } else {
                cur.map(<[u8]>::to_vec).unwrap_or_default()
            }
        }))
    }

    async fn delete(&self, key: &str) -> Result<bool, CommError> {
        Ok(self.with(|m| m.remove(key).is_some()))
    }

    async fn wait(&self, keys: &[&str], timeout: Duration) -> Result<(), CommError> {
        self.wait_for(&keys.join(", "), timeout, |m| keys.iter().all(|k| m.contains_key(*k)).then_some(())).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[tokio::test]
    async fn get_waits_for_set_and_times_out() {
        let s = Arc::new(MemoryStore::new());
        let s2 = s.clone();
        let t = tokio::spawn(async move { s2.get("k", Duration::from_secs(5)).await });
        tokio::task::yield_now().await;
        s.set("k", b"v").await.unwrap();
        assert_eq!(t.await.unwrap().unwrap(), b"v");
        let e = s.wait(&["k", "missing"], Duration::from_millis(20)).await.unwrap_err();
        s.wait(&["k"], Duration::MAX).await.unwrap();
        assert!(e.to_string().contains("missing"), "{e}");
    }

    #[tokio::test]
    async fn add_and_compare_set() {
        let s = MemoryStore::new();
        assert_eq!(s.add("c", 2).await.unwrap(), 2);
        assert_eq!(s.add("c", -5).await.unwrap(), -3);
        assert_eq!(s.compare_set("x", None, b"a").await.unwrap(), b"a");
        assert_eq!(s.compare_set("x", Some(b"b"), b"c").await.unwrap(), b"a");
        assert_eq!(s.compare_set("x", Some(b"a"), b"c").await.unwrap(), b"c");
        assert!(s.delete("x").await.unwrap());
        assert!(!s.delete("x").await.unwrap());
        s.set("y", b"zz").await.unwrap();
        assert!(s.add("y", 1).await.is_err());
    }
}
