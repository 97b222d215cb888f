//! Model check of `Work`'s completion slot: every interleaving of a backend completing an op
//! with a user waiting on it, polling it, adding a hook to it or dropping it (detaching).
//!
//! ```text
//! RUSTFLAGS="--cfg loom" cargo test -p comm-core --test loom_work --release
//! ```
#![cfg(loom)]

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::Ordering::SeqCst;
use std::task::{Context, Poll, Waker};

use comm_core::{CommError, Work};
use loom::sync::atomic::AtomicUsize;
use loom::sync::Arc;
use loom::thread;

/// A result that counts its drops: it must be dropped exactly once, by whoever ends up with it.
struct Token(Arc<AtomicUsize>);

impl Drop for Token {
    fn drop(&mut self) {
        self.0.fetch_add(1, SeqCst);
    }
}

/// A pending `Work<Token>` with a hook that counts its runs and the drop count of its token.
fn pending_with_hook() -> (comm_core::Completer<Token>, Work<Token>, Arc<AtomicUsize>, Arc<AtomicUsize>) {
    let (done, work) = Work::pending();
    let hooks = Arc::new(AtomicUsize::new(0));
    let h = hooks.clone();
    let work = work.on_complete(move |c| {
        assert!(c.error.is_none());
        h.fetch_add(1, SeqCst);
    });
    (done, work, hooks, Arc::new(AtomicUsize::new(0)))
}

#[test]
fn complete_while_waiting() {
    loom::model(|| {
        let (done, work, hooks, drops) = pending_with_hook();
        let token = Token(drops.clone());
        let t = thread::spawn(move || done.complete(Ok(token)));
        let got = work.wait().expect("the op succeeded");
        assert_eq!(hooks.load(SeqCst), 1, "the hook ran before the result was handed over");
        drop(got);
        t.join().unwrap();
        assert_eq!(hooks.load(SeqCst), 1);
        assert_eq!(drops.load(SeqCst), 1);
    });
}

#[test]
fn complete_while_polling() {
    loom::model(|| {
        let (done, mut work, hooks, drops) = pending_with_hook();
        let token = Token(drops.clone());
        let t = thread::spawn(move || done.complete(Ok(token)));
        let completed = work.is_completed();
        let mut cx = Context::from_waker(Waker::noop());
        match Pin::new(&mut work).poll(&mut cx) {
            // The result is handed over once: a second poll finds it taken.
            Poll::Ready(r) => {
                drop(r.expect("the op succeeded"));
                assert!(matches!(
                    Pin::new(&mut work).poll(&mut cx),
                    Poll::Ready(Err(CommError::InvalidArgument { .. }))
                ));
            }
            // `is_completed` never runs ahead of the result.
            Poll::Pending => assert!(!completed),
        }
        t.join().unwrap();
        assert!(work.is_completed());
        drop(work);
        assert_eq!(hooks.load(SeqCst), 1);
        assert_eq!(drops.load(SeqCst), 1, "the result is dropped once, polled or not");
    });
}

#[test]
fn complete_while_detaching() {
    loom::model(|| {
        let (done, work, hooks, drops) = pending_with_hook();
        let token = Token(drops.clone());
        let t = thread::spawn(move || done.complete(Ok(token)));
        drop(work);
        t.join().unwrap();
        assert_eq!(hooks.load(SeqCst), 1, "a detached op's hook still runs, once");
        assert_eq!(drops.load(SeqCst), 1, "nobody takes a detached op's result: it is dropped once");
    });
}

#[test]
fn hook_added_while_completing() {
    loom::model(|| {
        let (done, work) = Work::<u8>::pending();
        let hooks = Arc::new(AtomicUsize::new(0));
        let t = thread::spawn(move || done.complete(Ok(3)));
        let h = hooks.clone();
        // Either the completer runs it, or it runs here because the op already ended.
        let work = work.on_complete(move |c| {
            assert!(c.error.is_none() && !c.detached);
            h.fetch_add(1, SeqCst);
        });
        assert_eq!(work.wait().unwrap(), 3);
        t.join().unwrap();
        assert_eq!(hooks.load(SeqCst), 1);
    });
}

#[test]
fn completer_dropped_while_waiting() {
    loom::model(|| {
        let (done, work) = Work::<u8>::pending();
        let t = thread::spawn(move || drop(done));
        assert!(matches!(work.wait(), Err(CommError::Shutdown(_))));
        t.join().unwrap();
    });
}
