"""torch.distributed's NCCL all_reduce on the same GPU, in device_bench's columns.

Run where torch with CUDA exists (not part of `cargo xtask test`):
    torchrun --standalone --nproc-per-node 1 crates/backend-nccl/bench/torch_all_reduce.py
sync_us: one all_reduce then torch.cuda.synchronize() per op; queued_us: ops issued back to
back, one synchronize at the end (nccl-tests' loop). Sizes: DEVICE_BENCH_SIZES as for
device_bench.
"""
import os
import time

import torch
import torch.distributed as dist


def main():
    dist.init_process_group("nccl")
    rank, n = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    sizes = os.environ.get("DEVICE_BENCH_SIZES")
    sizes = [int(x) for x in sizes.split(",")] if sizes else [1 << p for p in range(3, 29, 2)]
    if rank == 0:
        print(f"# torch {torch.__version__}, NCCL {torch.cuda.nccl.version()}, {n} rank(s), {torch.cuda.get_device_name()}")
        print(f"{'size(B)':>12} {'sync_us':>10} {'queued_us':>10} {'algbw':>10} {'busbw':>10}")
    for nbytes in sizes:
        count = max(nbytes // 4, 1)
        iters = min(max(200_000_000 // max(nbytes, 1), 5), 1000)
        x = torch.ones(count, dtype=torch.float32, device="cuda")
        dist.all_reduce(x)
        torch.cuda.synchronize()
        assert bool((x == n).all()), f"{nbytes} B: {x[:4]}"
        dist.barrier()
        t = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(x)
            torch.cuda.synchronize()
        sync = (time.perf_counter() - t) * 1e6 / iters
        dist.barrier()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(x)
        torch.cuda.synchronize()
        queued = (time.perf_counter() - t) * 1e6 / iters
        algbw = nbytes / queued / 1e3
        busbw = algbw * 2 * (n - 1) / n
        if rank == 0:
            print(f"{nbytes:>12} {sync:>10.2} {queued:>10.2} {algbw:>10.2} {busbw:>10.2}")
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
