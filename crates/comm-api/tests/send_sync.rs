//! Compile-time check that a [`ProcessGroup`] can be moved to and shared between threads (a
//! data loader thread, a tokio task): a field that loses `Send` or `Sync` breaks this file.

use comm_api::ProcessGroup;

fn assert_send<T: Send>() {}
fn assert_sync<T: Sync>() {}

#[test]
fn process_group_is_send_and_sync() {
    assert_send::<ProcessGroup>();
    assert_sync::<ProcessGroup>();
}
