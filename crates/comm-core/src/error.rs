use std::time::Duration;

use crate::{DType, Rank};

/// The one error type of the workspace.
///
/// Every variant names the problem and carries enough context (op, rank, dtype, values) to act
/// on it without reading the source.
#[non_exhaustive]
#[derive(Debug, thiserror::Error)]
pub enum CommError {
    /// An argument was invalid on this rank (root out of range, wrong dtype, bad lengths...).
    #[error("invalid argument to {op}: {reason}")]
    InvalidArgument {
        /// The op that was called.
        op: &'static str,
        /// What is wrong, with the values.
        reason: String,
    },
    /// Ranks called different ops, or the same op with different sizes, dtypes or roots.
    #[error("{op}: ranks disagree: {detail}")]
    Mismatch {
        /// The op this rank called.
        op: &'static str,
        /// What differed, between which ranks.
        detail: String,
    },
    /// A peer died, exited or aborted the group.
    #[error("peer rank {rank} lost: {detail}")]
    PeerLost {
        /// The peer's rank in the group.
        rank: Rank,
        /// How it was noticed.
        detail: String,
    },
    /// A wait ran past its deadline.
    #[error("{op} timed out after {}: {detail}", crate::config::fmt_duration(*.after))]
    Timeout {
        /// What was being waited for.
        op: String,
        /// The timeout that elapsed.
        after: Duration,
        /// Who or what was missing.
        detail: String,
    },
    /// An earlier error left the group unusable; later ops fail fast.
    #[error("process group is poisoned by an earlier error: {cause}")]
    Poisoned {
        /// The error that poisoned the group.
        cause: String,
    },
    /// The backend cannot be used here (not compiled in, no GPU, ranks on different hosts...).
    #[error("backend `{backend}` is unavailable: {why}")]
    Unavailable {
        /// The backend's name.
        backend: &'static str,
        /// Why, and what to do about it.
        why: String,
    },
    /// The backend does not implement this op/dtype combination.
    #[error("{op}{} is not supported by backend `{backend}`", dtype.map(|d| format!(" on {d}")).unwrap_or_default())]
    Unsupported {
        /// The op.
        op: &'static str,
        /// The dtype, when it matters.
        dtype: Option<DType>,
        /// The backend's name.
        backend: &'static str,
    },
    /// The rendezvous store failed or refused a request.
    #[error("store: {0}")]
    Store(String),
    /// Bad configuration (environment variables, config values).
    #[error("configuration: {0}")]
    Config(String),
    /// An operating-system call failed.
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The process group was shut down, or its worker is gone.
    #[error("process group has been shut down{}", if .0.is_empty() { String::new() } else { format!(": {}", .0) })]
    Shutdown(String),
    /// A backend-specific failure.
    #[error("backend `{backend}`: {source}")]
    Backend {
        /// The backend's name.
        backend: &'static str,
        /// The native error.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
}

impl CommError {
    /// Shorthand for [`CommError::InvalidArgument`].
    pub fn invalid(op: &'static str, reason: impl Into<String>) -> Self {
        CommError::InvalidArgument { op, reason: reason.into() }
    }

    /// Shorthand for [`CommError::Mismatch`].
    pub fn mismatch(op: &'static str, detail: impl Into<String>) -> Self {
        CommError::Mismatch { op, detail: detail.into() }
    }

    /// Shorthand for [`CommError::PeerLost`].
    pub fn peer_lost(rank: Rank, detail: impl Into<String>) -> Self {
        CommError::PeerLost { rank, detail: detail.into() }
    }

    /// Shorthand for [`CommError::Timeout`].
    pub fn timeout(op: impl Into<String>, after: Duration, detail: impl Into<String>) -> Self {
        CommError::Timeout { op: op.into(), after, detail: detail.into() }
    }

    /// This error as the end of a wait that began at `since` with `budget`: a
    /// [`CommError::Timeout`] gets the time waited as its `after` (what its message says),
    /// naming the budget when the two differ by more than a tenth (a wait cut into slices, a
    /// budget partly spent before); other errors pass through.
    ///
    /// ```
    /// use std::time::{Duration, Instant};
    /// use comm_core::CommError;
    /// let since = Instant::now() - Duration::from_secs(5);
    /// // The last slice of a 5 s wait timed out after 5 ms: the error says 5 s.
    /// let e = CommError::timeout("store get", Duration::from_millis(5), "key k never set");
    /// assert!(e.waited(since, Duration::from_secs(5)).to_string().starts_with("store get timed out after 5.0 s:"));
    /// let e = CommError::timeout("join", Duration::from_millis(5), "no group admitted it");
    /// assert!(e.waited(since, Duration::from_secs(1)).to_string().contains("(its budget: 1.0 s)"));
    /// ```
    pub fn waited(self, since: std::time::Instant, budget: Duration) -> CommError {
        match self {
            CommError::Timeout { op, detail, .. } => {
                let after = since.elapsed();
                let (a, b) = (after.as_secs_f64(), budget.as_secs_f64());
                let detail = if (a - b).abs() > 0.1 * b {
                    format!("{detail} (its budget: {})", crate::config::fmt_duration(budget))
                } else {
                    detail
                };
                CommError::Timeout { op, after, detail }
            }
            other => other,
        }
    }

    /// Shorthand for [`CommError::Io`] from an error convertible to `std::io::Error`.
    pub fn io(context: impl Into<String>, source: impl Into<std::io::Error>) -> Self {
        CommError::Io { context: context.into(), source: source.into() }
    }

    /// Whether the error leaves the group unusable (peer lost, mismatch, timeout...), as opposed to
    /// a local argument error after which the group is still fine.
    pub fn poisons_group(&self) -> bool {
        !matches!(self, CommError::InvalidArgument { .. } | CommError::Unsupported { .. } | CommError::Config(_))
    }

    /// A copy of this error suitable for reporting the same failure to several waiters.
    ///
    /// `CommError` is not `Clone` (it may hold an `io::Error`); this keeps the variant where it
    /// carries plain data and falls back to its message otherwise.
    pub fn duplicate(&self) -> CommError {
        match self {
            CommError::InvalidArgument { op, reason } => CommError::InvalidArgument { op, reason: reason.clone() },
            CommError::Mismatch { op, detail } => CommError::Mismatch { op, detail: detail.clone() },
            CommError::PeerLost { rank, detail } => CommError::PeerLost { rank: *rank, detail: detail.clone() },
            CommError::Timeout { op, after, detail } => {
                CommError::Timeout { op: op.clone(), after: *after, detail: detail.clone() }
            }
            CommError::Poisoned { cause } => CommError::Poisoned { cause: cause.clone() },
            CommError::Unavailable { backend, why } => CommError::Unavailable { backend, why: why.clone() },
            CommError::Unsupported { op, dtype, backend } => CommError::Unsupported { op, dtype: *dtype, backend },
            CommError::Store(s) => CommError::Store(s.clone()),
            CommError::Config(s) => CommError::Config(s.clone()),
            CommError::Shutdown(s) => CommError::Shutdown(s.clone()),
            CommError::Io { context, source } => CommError::Io {
                context: context.clone(),
                source: std::io::Error::new(source.kind(), source.to_string()),
            },
            CommError::Backend { backend, source } => CommError::Backend { backend, source: source.to_string().into() },
        }
    }
}

/// Runs `f`, catching a panic that unwinds out of it: its message instead. The one place the
/// workspace catches panics (workers, inline ops, loader calls), so each is reported alike.
#[inline]
pub fn catch_panic<T>(f: impl FnOnce() -> T) -> Result<T, String> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).map_err(|payload| panic_message(&*payload))
}

/// The message of a caught panic (`catch_unwind`'s payload), for the error that reports it.
pub fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_name_the_problem() {
        let e = CommError::Unsupported { op: "all_reduce", dtype: Some(DType::BF16), backend: "mpi" };
        assert_eq!(e.to_string(), "all_reduce on bf16 is not supported by backend `mpi`");
        let e = CommError::Shutdown(String::new());
        assert_eq!(e.to_string(), "process group has been shut down");
        let e = CommError::invalid("broadcast", "root 4 >= world size 4");
        assert_eq!(e.to_string(), "invalid argument to broadcast: root 4 >= world size 4");
        assert!(!e.poisons_group());
        let e = CommError::PeerLost { rank: 2, detail: "process 77 exited".into() };
        assert!(e.poisons_group());
        assert_eq!(e.duplicate().to_string(), e.to_string());
    }
}
