//! Pass a token around a ring with send/recv: rank r sends to r+1 and receives from r-1.
//!
//! ```text
//! cargo build --examples && commrun -n 3 -- target/debug/examples/ring
//! ```

use comm_api::{Config, DType, HostBuffer};

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), comm_api::CommError> {
    let pg = comm_api::init(Config::from_env()?).await?;
    let (rank, n) = (pg.rank(), pg.world_size());
    if n < 2 {
        println!("ring needs at least 2 ranks; run it under `commrun -n 2`");
        return Ok(());
    }
    let (next, prev) = ((rank + 1) % n, (rank + n - 1) % n);

    // Every rank issues its send first and then its receive; both are eager works, so
    // there is no send/send deadlock, whatever the message size.
    let mut token = HostBuffer::from_slice(&[rank as i64; 1 << 16]);
    for hop in 0..n {
        let sent = pg.send(token, next);
        let got = pg.recv(HostBuffer::zeroed(DType::I64, 1 << 16), prev).await?;
        sent.await?;
        token = got;
        let from = (rank + n - 1 - hop % n) % n;
        assert_eq!(token.as_slice::<i64>()?[0], from as i64, "hop {hop}");
    }
    println!("rank {rank}: token went around the ring of {n} and came back");
    pg.shutdown().await
}
