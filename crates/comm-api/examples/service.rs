//! A service whose request handlers run as concurrent tokio tasks, each with its own stream:
//! the tasks' collectives and messages never pair with another task's, whatever order the
//! tasks happen to issue them in on each rank. Every result is checked.
//!
//! ```text
//! cargo build --examples && commrun -n 3 -- target/debug/examples/service
//! ```

use comm_api::{Config, DType, HostBuffer, ProcessGroup, ReduceOp};

/// One request: a few mixed ops on the request's own stream.
async fn handle(stream: ProcessGroup, request: u64) -> Result<(), comm_api::CommError> {
    let (me, n) = (stream.rank(), stream.world_size());
    let value = |rank: u32| (request * 100 + u64::from(rank)) as f32;
    let len = 1 + (request as usize * 37) % 500;

    let sum = stream.all_reduce(HostBuffer::from_slice(&vec![value(me); len]), ReduceOp::Sum).await?;
    let want: f32 = (0..n).map(value).sum();
    assert!(sum.to_vec::<f32>()?.iter().all(|&x| x == want), "request {request}: all_reduce");

    let all = stream.all_gather(HostBuffer::from_slice(&[value(me)])).await?.to_vec::<f32>()?;
    assert_eq!(all, (0..n).map(value).collect::<Vec<_>>(), "request {request}: all_gather");

    let root = (request % u64::from(n)) as u32;
    let got = stream.broadcast(HostBuffer::from_slice(&vec![value(me); len]), root).await?;
    assert!(got.to_vec::<f32>()?.iter().all(|&x| x == value(root)), "request {request}: broadcast");

    // A ring of messages: to the next rank, from the previous one.
    let (next, prev) = ((me + 1) % n, (me + n - 1) % n);
    let sent = stream.isend(HostBuffer::from_slice(&[value(me); 8]), next, 0);
    let got = stream.irecv(HostBuffer::zeroed(DType::F32, 8), prev, 0).await?;
    sent.await?;
    assert_eq!(got.to_vec::<f32>()?, [value(prev); 8], "request {request}: ring");
    Ok(())
}

#[tokio::main]
async fn main() -> Result<(), comm_api::CommError> {
    let pg = comm_api::init(Config::from_env()?).await?;
    // Collective, once: then every `stream(key)` is local.
    let streams = pg.streams().await?;

    // Requests 0..64, eight at a time; each rank serves the same requests (in a real
    // service, the request id comes with the request) on the stream named by its id.
    let requests: Vec<u64> = (0..64).collect();
    for batch in requests.chunks(8) {
        let handlers: Vec<_> = batch.iter().map(|&r| tokio::spawn(handle(streams.stream(r), r))).collect();
        for h in handlers {
            h.await.expect("handler panicked")?;
        }
    }
    println!("rank {}/{}: served {} requests on their own streams", pg.rank(), pg.world_size(), requests.len());
    streams.shutdown().await?;
    pg.barrier().await?;
    pg.shutdown().await
}
