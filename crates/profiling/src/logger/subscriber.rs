//! The `tracing_subscriber::Layer`: ops recorded from the `comm.<op>` spans, from open to
//! close, when no logger records them directly.

use std::fmt;
use std::sync::atomic::Ordering;
use std::sync::{Mutex, OnceLock};

use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::Subscriber;
use tracing_subscriber::layer::Context;
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::Layer;

use crate::TARGET;

use super::rows::Key;
use super::{CommsLogger, DEBUG, ENABLED};

/// Kept in the span's extensions from open to close.
struct Pending {
    key: Key,
    rank: u32,
    start: u64,
    failed: bool,
    detached: bool,
}

/// Distinct op names [`intern`] keeps; later ones share the row name [`OTHER_OP`].
const MAX_OTHER_OPS: usize = 64;
const OTHER_OP: &str = "other";

/// The op name of a `comm.op` span (an op outside the layer's known list, whose name comes
/// in a field) as the `'static` name of its row. Field values are arbitrary strings, so the
/// names kept are bounded: op types are few, but a stray span must not grow memory forever.
fn intern(name: &str) -> &'static str {
    static NAMES: [OnceLock<Box<str>>; MAX_OTHER_OPS] = [const { OnceLock::new() }; MAX_OTHER_OPS];
    static USED: Mutex<usize> = Mutex::new(0);
    let mut used = USED.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(n) = NAMES[..*used].iter().filter_map(OnceLock::get).find(|n| ***n == *name) {
        return n;
    }
    let Some(slot) = NAMES.get(*used) else { return OTHER_OP };
    *used += 1;
    slot.get_or_init(|| name.into())
}

#[derive(Default)]
struct OpFields {
    op: Option<&'static str>,
    bytes: i64,
    group_size: i64,
    rank: i64,
    /// `comm.logger`: the logger that records the op directly, if any.
    logger: Option<u64>,
    /// `comm.op` is only read for the shared `comm.op` callsite.
    read_op: bool,
}

impl Visit for OpFields {
    fn record_u64(&mut self, field: &Field, value: u64) {
        if field.name() == "comm.logger" {
            self.logger = Some(value);
        }
    }
    fn record_i64(&mut self, field: &Field, value: i64) {
        match field.name() {
            "comm.bytes" => self.bytes = value,
            "comm.group_size" => self.group_size = value,
            "comm.rank" => self.rank = value,
            _ => {}
        }
    }
    fn record_str(&mut self, field: &Field, value: &str) {
        if self.read_op && field.name() == "comm.op" {
            self.op = Some(intern(value));
        }
    }
    fn record_debug(&mut self, _: &Field, _: &dyn fmt::Debug) {}
}

struct EndFields<'a>(&'a mut Pending);

impl Visit for EndFields<'_> {
    fn record_bool(&mut self, field: &Field, value: bool) {
        if field.name() == "comm.detached" {
            self.0.detached = value;
        }
    }
    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "otel.status_code" {
            self.0.failed = value.eq_ignore_ascii_case("error");
        }
    }
    fn record_debug(&mut self, _: &Field, _: &dyn fmt::Debug) {}
}

impl<S> Layer<S> for CommsLogger
where
    S: Subscriber + for<'a> LookupSpan<'a>,
{
    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, ctx: Context<'_, S>) {
        let flags = self.inner.flags.load(Ordering::Relaxed);
        let meta = attrs.metadata();
        if flags & ENABLED == 0 || meta.target() != TARGET {
            return;
        }
        let Some(short) = meta.name().strip_prefix("comm.") else { return };
        let mut f = OpFields { read_op: short == "op", ..OpFields::default() };
        attrs.record(&mut f);
        if f.logger == Some(self.inner.id) {
            return; // recorded directly, without the span
        }
        let op = if f.read_op { f.op } else { Some(short) };
        // Spans of the target without op fields (e.g. comm.new_group) have no group size.
        let Some(op) = op.filter(|_| f.group_size > 0) else { return };
        if !self.wants(flags, op) {
            return;
        }
        let Some(span) = ctx.span(id) else { return };
        let caller = if flags & DEBUG != 0 { span.parent().map(|p| p.name()) } else { None };
        let key = Key { op, caller, group_size: f.group_size as u32, bytes: f.bytes.max(0) as u64 };
        let pending =
            Pending { key, rank: f.rank as u32, start: self.inner.clock.raw(), failed: false, detached: false };
        span.extensions_mut().insert(pending);
    }

    fn on_record(&self, id: &Id, values: &Record<'_>, ctx: Context<'_, S>) {
        let Some(span) = ctx.span(id) else { return };
        let mut ext = span.extensions_mut();
        if let Some(p) = ext.get_mut::<Pending>() {
            values.record(&mut EndFields(p));
        }
    }

    fn on_close(&self, id: Id, ctx: Context<'_, S>) {
        let Some(span) = ctx.span(&id) else { return };
        let Some(p) = span.extensions_mut().remove::<Pending>() else { return };
        let latency = self.inner.elapsed_ns(p.start);
        self.record(&p.key, p.rank, p.failed, p.detached, Some(latency));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn interned_names_are_shared_and_bounded() {
        let a = intern("intern_test_op");
        assert!(std::ptr::eq(a, intern(&String::from("intern_test_op"))));
        // Other tests may hold slots too: fill whatever is left, then names share a row.
        for i in 0..MAX_OTHER_OPS {
            intern(&format!("intern_test_{i}"));
        }
        assert_eq!(intern("intern_test_one_too_many"), OTHER_OP);
        assert_eq!(intern("intern_test_op"), "intern_test_op");
    }
}
