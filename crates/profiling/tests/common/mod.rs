//! Test helpers: a scripted backend whose ops complete when the test says so, and a layer
//! that captures spans.
#![allow(dead_code, unreachable_pub)]

use std::collections::{BTreeMap, VecDeque};
use std::fmt;
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use comm_core::ops::{AllGather, AllReduce, Barrier, Broadcast, ReduceScatter, SendTo as SendOp};
use comm_core::{Backend, Collective, CommError, Completer, DType, Group, HostBuffer, InOut, Op, Rank, Work};
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::Subscriber;
use tracing_subscriber::layer::Context;
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::Layer;

type Finish = Box<dyn FnOnce(Option<CommError>) + Send>;

/// A backend whose ops either complete inline (`inline = true`) or wait in a queue until
/// `complete_next` / `fail_next`.
#[derive(Clone)]
pub struct Mock {
    pub rank: Rank,
    pub world: u32,
    pub inline: bool,
    queue: Arc<Mutex<VecDeque<Finish>>>,
    inline_error: Arc<Mutex<Option<CommError>>>,
}

impl Mock {
    pub fn new(rank: Rank, world: u32, inline: bool) -> Self {
        Mock { rank, world, inline, queue: Arc::default(), inline_error: Arc::default() }
    }

    /// The next inline op fails with `e`.
    pub fn fail_inline_next(&self, e: CommError) {
        *self.inline_error.lock().unwrap() = Some(e);
    }

    pub fn pending(&self) -> usize {
        self.queue.lock().unwrap().len()
    }

    pub fn complete_next(&self) {
        let f = self.queue.lock().unwrap().pop_front().expect("an op to complete");
        f(None);
    }

    pub fn fail_next(&self, e: CommError) {
        let f = self.queue.lock().unwrap().pop_front().expect("an op to fail");
        f(Some(e));
    }

    fn run<T: Send + 'static>(&self, out: T) -> Work<T> {
        if self.inline {
            return Work::ready(match self.inline_error.lock().unwrap().take() {
                None => Ok(out),
                Some(e) => Err(e),
            });
        }
        let (c, w): (Completer<T>, Work<T>) = Work::pending();
        self.queue.lock().unwrap().push_back(Box::new(move |e| match e {
            None => c.complete(Ok(out)),
            Some(e) => c.complete(Err(e)),
        }));
        w
    }
}

#[async_trait]
impl Group for Mock {
    fn rank(&self) -> Rank {
        self.rank
    }
    fn world_size(&self) -> u32 {
        self.world
    }
    fn backend_name(&self) -> &'static str {
        "mock"
    }
    async fn new_group(&self, _: &[Rank]) -> Result<Option<Arc<dyn Backend>>, CommError> {
        Err(CommError::invalid("new_group", "mock has no sub-groups"))
    }
    async fn shutdown(&self) -> Result<(), CommError> {
        Ok(())
    }
}

impl Collective<AllReduce> for Mock {
    fn submit(&self, req: AllReduce) -> Work<HostBuffer> {
        self.run(req.buf)
    }
}
impl Collective<Broadcast> for Mock {
    fn submit(&self, req: Broadcast) -> Work<HostBuffer> {
        self.run(req.buf)
    }
}
impl Collective<AllGather> for Mock {
    fn submit(&self, req: AllGather) -> Work<InOut> {
        self.run(InOut { output: req.input.clone(), input: req.input })
    }
}
impl Collective<ReduceScatter> for Mock {
    fn submit(&self, req: ReduceScatter) -> Work<InOut> {
        self.run(InOut { output: req.input.clone(), input: req.input })
    }
}
impl Collective<SendOp> for Mock {
    fn submit(&self, req: SendOp) -> Work<HostBuffer> {
        self.run(req.buf)
    }
}
impl Collective<Barrier> for Mock {
    fn submit(&self, _: Barrier) -> Work<()> {
        self.run(())
    }
}

/// An op the library does not know: a backend-specific extension.
#[derive(Debug)]
pub struct Fancy(pub usize);

impl Op for Fancy {
    type Output = ();
    const NAME: &'static str = "fancy_op";
    fn bytes(&self) -> usize {
        self.0
    }
    fn dtype(&self) -> Option<DType> {
        None
    }
    fn validate(&self, _: Rank, _: u32) -> Result<(), CommError> {
        Ok(())
    }
}

impl Collective<Fancy> for Mock {
    fn submit(&self, _: Fancy) -> Work<()> {
        self.run(())
    }
}

pub fn f32s(n: usize) -> HostBuffer {
    HostBuffer::zeroed(DType::F32, n)
}

/// A span as the capture layer saw it.
#[derive(Clone, Debug, Default)]
pub struct Captured {
    pub name: &'static str,
    pub target: String,
    pub parent: Option<&'static str>,
    pub fields: BTreeMap<String, String>,
    pub closed: bool,
}

/// Records every span: name, parent, fields (as text), and whether it closed.
#[derive(Clone, Default)]
pub struct Capture {
    pub spans: Arc<Mutex<Vec<Captured>>>,
}

impl Capture {
    pub fn named(&self, name: &str) -> Vec<Captured> {
        self.spans.lock().unwrap().iter().filter(|s| s.name == name).cloned().collect()
    }

    pub fn all(&self) -> Vec<Captured> {
        self.spans.lock().unwrap().clone()
    }
}

struct Fields<'a>(&'a mut BTreeMap<String, String>);

impl Visit for Fields<'_> {
    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        self.0.insert(field.name().to_owned(), format!("{value:?}"));
    }
    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.insert(field.name().to_owned(), value.to_owned());
    }
}

struct Index(usize);

impl<S: Subscriber + for<'a> LookupSpan<'a>> Layer<S> for Capture {
    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, ctx: Context<'_, S>) {
        let span = ctx.span(id).unwrap();
        let mut c = Captured {
            name: attrs.metadata().name(),
            target: attrs.metadata().target().to_owned(),
            parent: span.parent().map(|p| p.name()),
            ..Captured::default()
        };
        attrs.record(&mut Fields(&mut c.fields));
        let mut spans = self.spans.lock().unwrap();
        span.extensions_mut().insert(Index(spans.len()));
        spans.push(c);
    }
    fn on_record(&self, id: &Id, values: &Record<'_>, ctx: Context<'_, S>) {
        let span = ctx.span(id).unwrap();
        let i = span.extensions().get::<Index>().unwrap().0;
        values.record(&mut Fields(&mut self.spans.lock().unwrap()[i].fields));
    }
    fn on_close(&self, id: Id, ctx: Context<'_, S>) {
        let span = ctx.span(&id).unwrap();
        let i = span.extensions().get::<Index>().unwrap().0;
        self.spans.lock().unwrap()[i].closed = true;
    }
}
