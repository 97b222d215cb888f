"""DeepSpeed's CPU shared-memory all_reduce (`deepspeed.comm.inference_all_reduce`), timed like
comm-bench and written as a comm-bench JSON report (so `comm-bench compare` and `comm-bench
scaling` read it). Run one process per rank under torchrun with LOCAL_SIZE = the world size
(DeepSpeed builds its shm workspace only then) and DS_ACCELERATOR=cpu.

    LOCAL_SIZE=4 DS_ACCELERATOR=cpu torchrun --nproc-per-node 4 ds_allreduce.py \
        --sizes 8,4096,1048576 --dtypes f32,bf16 --json ds.np4.json
"""

import argparse
import json
import os
import platform
import time

import torch
import torch.distributed as dist

import deepspeed.comm as ds

DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}
TARGET_BYTES = 4 << 30  # as comm-bench: iterations = clamp(4 GiB / size, 5, 10000)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", required=True, help="bytes, comma-separated")
    ap.add_argument("--dtypes", default="f32,bf16")
    ap.add_argument("--json", required=True)
    ap.add_argument("--max-iters", type=int, default=10000)
    a = ap.parse_args()
    ds.init_distributed(dist_backend="gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    rows = []
    for name in a.dtypes.split(","):
        dtype = DTYPES[name]
        es = torch.tensor([], dtype=dtype).element_size()
        for size in (int(s) for s in a.sizes.split(",")):
            count = max(size // es, 1)
            iters = max(5, min(a.max_iters, TARGET_BYTES // max(size, 1)))
            warmup = max(2, min(iters // 10, 1000))
            t = torch.full((count,), float(rank + 1), dtype=dtype)
            for _ in range(warmup):
                t.fill_(rank + 1)
                ds.inference_all_reduce(t)
            want = n * (n + 1) / 2
            ok = bool(torch.all(t == want))  # exact in bf16 too up to 16 ranks (136)
            dist.barrier()
            start = time.perf_counter()
            for _ in range(iters):
                ds.inference_all_reduce(t)
            mine = (time.perf_counter() - start) / iters * 1e6
            slowest = torch.tensor([mine], dtype=torch.float64)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            us = float(slowest[0])
            algbw = count * es / us / 1e3
            rows.append({
                "op": "all_reduce", "dtype": name, "bytes": count * es, "count": count, "redop": "sum",
                "root": -1, "iters": iters, "warmup": warmup, "time_us": us, "algbw_gbps": algbw,
                "busbw_gbps": algbw * 2 * (n - 1) / n, "wrong": 0 if ok else count,
                "backend": "deepspeed", "np": n,
            })
            if rank == 0:
                print(f"deepspeed np={n} {name} {count * es:>10} B  {us:10.2f} us  busbw {rows[-1]['busbw_gbps']:.2f} GB/s"
                      f"{'' if ok else '  WRONG'}", flush=True)
    if rank == 0:
        cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "")
        doc = {"host": platform.node(), "cpu": cpu, "backend": "deepspeed", "np": n,
               "git_rev": None, "rows": rows}
        with open(a.json, "w") as f:
            json.dump(doc, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
