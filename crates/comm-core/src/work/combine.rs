//! The works that combine others ([`Work::map`], [`Work::after`], [`Work::join`]): each a
//! [`Source`] a `Work` polls, waits on and hangs hooks on.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use super::sync::{Arc, AtomicUsize, Mutex, Ordering};
use super::{Completion, Hook, Source, Work};
use crate::CommError;

pub(super) struct Map<T, F> {
    pub(super) work: Work<T>,
    pub(super) f: Option<F>,
}

impl<T, U, F> Source<U> for Map<T, F>
where
    T: Send + 'static,
    F: FnOnce(Result<T, CommError>) -> Result<U, CommError> + Send,
{
    fn poll(&mut self, cx: &mut Context<'_>) -> Poll<Result<U, CommError>> {
        let r = std::task::ready!(Pin::new(&mut self.work).poll(cx));
        Poll::Ready(self.apply(r))
    }
    fn is_completed(&self) -> bool {
        self.work.is_completed()
    }
    fn wait(&mut self) -> Result<U, CommError> {
        let work = std::mem::replace(&mut self.work, Work::ready(Err(CommError::invalid("Work", "waited twice"))));
        let r = work.wait();
        self.apply(r)
    }
    fn add_hook(&mut self, hook: Hook) {
        // The hook reports the op itself, so it goes to the inner work; `f` is the caller's
        // post-processing and runs later, when the result is taken.
        self.work.add_hook(hook);
    }
}

impl<T, U, F: FnOnce(Result<T, CommError>) -> Result<U, CommError>> Map<T, F> {
    fn apply(&mut self, r: Result<T, CommError>) -> Result<U, CommError> {
        match self.f.take() {
            Some(f) => f(r),
            None => Err(CommError::invalid("Work", "polled after completion")),
        }
    }
}

/// [`Work::after`]: `first`'s error, else `work`'s result.
pub(super) struct After<T> {
    /// `None` once it succeeded.
    pub(super) first: Option<Work<()>>,
    pub(super) work: Work<T>,
}

impl<T: Send + 'static> Source<T> for After<T> {
    fn poll(&mut self, cx: &mut Context<'_>) -> Poll<Result<T, CommError>> {
        if let Some(first) = &mut self.first {
            std::task::ready!(Pin::new(first).poll(cx))?;
            self.first = None;
        }
        Pin::new(&mut self.work).poll(cx)
    }
    fn is_completed(&self) -> bool {
        self.first.as_ref().is_none_or(Work::is_completed) && self.work.is_completed()
    }
    fn wait(&mut self) -> Result<T, CommError> {
        if let Some(first) = self.first.take() {
            first.wait()?;
        }
        std::mem::replace(&mut self.work, Work::ready(Err(CommError::invalid("Work", "waited twice")))).wait()
    }
    fn add_hook(&mut self, hook: Hook) {
        self.work.add_hook(hook);
    }
}

pub(super) struct Join<T> {
    pub(super) works: Vec<Work<T>>,
    /// Results taken so far (index = work).
    pub(super) results: Vec<Option<Result<T, CommError>>>,
}

impl<T: Send + 'static> Join<T> {
    fn collect(&mut self) -> Result<Vec<T>, CommError> {
        let mut out = Vec::with_capacity(self.results.len());
        for r in self.results.drain(..) {
            out.push(r.unwrap_or_else(|| Err(CommError::invalid("Work", "polled after completion")))?);
        }
        Ok(out)
    }
}

impl<T: Send + 'static> Source<Vec<T>> for Join<T> {
    fn poll(&mut self, cx: &mut Context<'_>) -> Poll<Result<Vec<T>, CommError>> {
        let mut pending = false;
        for (w, r) in self.works.iter_mut().zip(self.results.iter_mut()) {
            if r.is_none() {
                match Pin::new(w).poll(cx) {
                    Poll::Ready(x) => *r = Some(x),
                    Poll::Pending => pending = true,
                }
            }
        }
        if pending {
            Poll::Pending
        } else {
            Poll::Ready(self.collect())
        }
    }
    fn is_completed(&self) -> bool {
        self.works.iter().zip(&self.results).all(|(w, r)| r.is_some() || w.is_completed())
    }
    fn wait(&mut self) -> Result<Vec<T>, CommError> {
        let works = std::mem::take(&mut self.works);
        for (w, r) in works.into_iter().zip(self.results.iter_mut()) {
            if r.is_none() {
                *r = Some(w.wait());
            }
        }
        self.collect()
    }
    fn add_hook(&mut self, hook: Hook) {
        // Runs when the last op ends, with that op's outcome (errors are in the result).
        let left = Arc::new(AtomicUsize::new(self.works.len()));
        let hook = Arc::new(Mutex::new(Some(hook)));
        if self.works.is_empty() {
            if let Some(h) = hook.lock().unwrap_or_else(|p| p.into_inner()).take() {
                h(Completion { error: None, detached: false });
            }
        }
        for w in &mut self.works {
            let (left, hook) = (left.clone(), hook.clone());
            w.add_hook(Box::new(move |c| {
                if left.fetch_sub(1, Ordering::AcqRel) == 1 {
                    if let Some(h) = hook.lock().unwrap_or_else(|p| p.into_inner()).take() {
                        h(c);
                    }
                }
            }));
        }
    }
}
