//! Compile-time checks that the handles backends and users pass between threads stay `Send`
//! (and `Sync` where they are): a field that loses either breaks this file, not a user's code.

use comm_core::{CommError, Completer, HostBuffer, Work};

fn assert_send<T: Send>() {}
fn assert_sync<T: Sync>() {}

#[test]
fn work_is_send() {
    // Not `Sync`: `map` and `join_all` keep their state in a box that is only `Send`.
    assert_send::<Work<HostBuffer>>();
    assert_send::<Work<()>>();
}

#[test]
fn completer_is_send_and_sync() {
    assert_send::<Completer<HostBuffer>>();
    assert_sync::<Completer<HostBuffer>>();
    assert_send::<Completer<()>>();
    assert_sync::<Completer<()>>();
}

#[test]
fn host_buffer_is_send_and_sync() {
    assert_send::<HostBuffer>();
    assert_sync::<HostBuffer>();
}

#[test]
fn comm_error_is_send_and_sync() {
    assert_send::<CommError>();
    assert_sync::<CommError>();
}
