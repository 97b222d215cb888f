//! NCCL and CUDA failures as [`CommError`]s.
//!
//! cudarc's `NcclError` has neither `Display` nor `std::error::Error` (its `Debug` prints just
//! `NcclError`), so the code is mapped here to its name and NCCL's description, plus NCCL's
//! last-error text when the library can give it.

use std::fmt;

use comm_core::CommError;
use cudarc::nccl::sys::ncclResult_t;

use crate::ffi::{self, CallError};
use crate::BACKEND;

/// A failed call into NCCL or the CUDA driver: the `source` of [`CommError::Backend`] errors of
/// this backend (`err.source().downcast_ref::<NcclFailure>()`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NcclFailure {
    /// The call that failed (`ncclAllReduce`, `cuMemcpyHtoDAsync`, ...).
    pub call: String,
    /// NCCL's result code (`ncclResult_t` as an integer), for NCCL calls.
    pub nccl_code: Option<u32>,
    /// The code's name (`ncclUnhandledCudaError`, `CUDA_ERROR_OUT_OF_MEMORY`, ...).
    pub name: String,
    /// What the code means, and NCCL's last error message when there is one.
    pub message: String,
}

impl fmt::Display for NcclFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} failed: {}", self.call, self.name)?;
        if let Some(c) = self.nccl_code {
            write!(f, " ({c})")?;
        }
        if !self.message.is_empty() {
            write!(f, ": {}", self.message)?;
        }
        Ok(())
    }
}

impl std::error::Error for NcclFailure {}

/// Name and meaning of an NCCL result code (NCCL's own wording, so no library is needed).
pub(crate) fn describe(code: ncclResult_t) -> (&'static str, &'static str) {
    use ncclResult_t as R;
    match code {
        R::ncclSuccess => ("ncclSuccess", "no error"),
        R::ncclUnhandledCudaError => {
            ("ncclUnhandledCudaError", "unhandled cuda error (run with NCCL_DEBUG=INFO for details)")
        }
        R::ncclSystemError => ("ncclSystemError", "unhandled system error (run with NCCL_DEBUG=INFO for details)"),
        R::ncclInternalError => {
            ("ncclInternalError", "internal error - please report this issue to the NCCL developers")
        }
        R::ncclInvalidArgument => ("ncclInvalidArgument", "invalid argument (run with NCCL_DEBUG=WARN for details)"),
        R::ncclInvalidUsage => ("ncclInvalidUsage", "invalid usage (run with NCCL_DEBUG=WARN for details)"),
        R::ncclRemoteError => ("ncclRemoteError", "remote process exited or there was a network error"),
        R::ncclInProgress => ("ncclInProgress", "NCCL operation in progress"),
        R::ncclTimeout => ("ncclTimeout", "NCCL operation timed out"),
        R::ncclNumResults => ("ncclNumResults", "unknown result code"),
    }
}

/// An NCCL error code of call `call` as a [`CommError`] (always [`CommError::Backend`], which
/// poisons the group: once one rank's NCCL call failed its peers cannot finish theirs).
pub(crate) fn nccl_error(code: ncclResult_t, call: &str, last: Option<String>) -> CommError {
    let (name, meaning) = describe(code);
    let mut message = meaning.to_owned();
    if let Some(last) = last.filter(|l| !l.is_empty()) {
        message.push_str("; NCCL says: ");
        message.push_str(&last);
    }
    CommError::Backend {
        backend: BACKEND,
        source: Box::new(NcclFailure {
            call: call.to_owned(),
            nccl_code: Some(code as u32),
            name: name.into(),
            message,
        }),
    }
}

/// A CUDA driver error as a [`CommError`].
pub(crate) fn cuda_error(call: &str, error: &cudarc::driver::DriverError) -> CommError {
    // `DriverError`'s Display asks libcuda for the text; only ever built when libcuda is loaded.
    let name = format!("{:?}", error.0);
    let message = error.error_string().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
    CommError::Backend {
        backend: BACKEND,
        source: Box::new(NcclFailure { call: call.to_owned(), nccl_code: None, name, message }),
    }
}

/// The error of one failed call, for the op `op`.
pub(crate) fn call_error(e: CallError, aborted_because: &str) -> CommError {
    match e {
        CallError::Nccl(c) => nccl_error(c.code, c.call, c.last),
        CallError::Cuda { call, error } => cuda_error(call, &error),
        CallError::Aborted => CommError::Poisoned { cause: aborted_because.to_owned() },
    }
}

/// NCCL's own description of a code, when libnccl is loaded (for diagnostics).
pub fn nccl_description(code: u32) -> Option<String> {
    let code = code_from_u32(code)?;
    ffi::nccl_error_string(code)
}

fn code_from_u32(code: u32) -> Option<ncclResult_t> {
    use ncclResult_t as R;
    Some(match code {
        0 => R::ncclSuccess,
        1 => R::ncclUnhandledCudaError,
        2 => R::ncclSystemError,
        3 => R::ncclInternalError,
        4 => R::ncclInvalidArgument,
        5 => R::ncclInvalidUsage,
        6 => R::ncclRemoteError,
        7 => R::ncclInProgress,
        8 => R::ncclTimeout,
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::error::Error as _;

    #[test]
    fn nccl_codes_map_to_named_backend_errors_that_poison() {
        let e = nccl_error(
            ncclResult_t::ncclUnhandledCudaError,
            "ncclCommInitRank",
            Some("Cuda failure 'CUDA driver version is insufficient'".into()),
        );
        assert!(e.poisons_group());
        let text = e.to_string();
        assert!(text.starts_with("backend `nccl`: ncclCommInitRank failed: ncclUnhandledCudaError (1)"), "{text}");
        assert!(text.contains("unhandled cuda error") && text.contains("NCCL says: Cuda failure"), "{text}");
        let CommError::Backend { source, .. } = &e else { panic!("{e:?}") };
        let f = source.downcast_ref::<NcclFailure>().expect("an NcclFailure");
        assert_eq!((f.nccl_code, f.name.as_str()), (Some(1), "ncclUnhandledCudaError"));

        let e = nccl_error(ncclResult_t::ncclRemoteError, "ncclGroupEnd", None);
        assert!(e.to_string().contains("remote process exited"), "{e}");
        assert!(e.source().is_some());
        for code in 0..9 {
            let c = code_from_u32(code).expect("known code");
            assert_eq!(c as u32, code);
            assert!(!describe(c).0.is_empty());
        }
        assert_eq!(code_from_u32(99), None);
    }

    #[test]
    fn aborted_calls_report_the_cause() {
        let e = call_error(CallError::Aborted, "all_reduce timed out");
        assert!(matches!(&e, CommError::Poisoned { cause } if cause == "all_reduce timed out"), "{e:?}");
    }
}
