#!/usr/bin/python3
"""PyTorch DDP (gloo) training of the reference GPT-2 on random tokens, for bench/dp_scaling.py.

Each of --workers processes runs one thread and --per-worker-batch sequences per step; prints
the global tokens/s measured after --warmup steps.
"""
import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "reference"))
from gpt2_reference import GPT2, PRESETS  # noqa: E402


def worker(rank, a, port, queue):
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    if a.workers > 1:
        dist.init_process_group("gloo", rank=rank, world_size=a.workers)
    c = PRESETS[a.model]
    torch.manual_seed(1337)
    model = GPT2(c)
    if a.workers > 1:
        model = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    g = torch.Generator().manual_seed(rank)
    data = torch.randint(0, c["vocab"], (a.steps + a.warmup, a.per_worker_batch, a.seq_len + 1), generator=g)
    t0 = None
    for s in range(a.steps + a.warmup):
        if s == a.warmup:
            t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = model(data[s, :, :-1], data[s, :, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    dt = time.perf_counter() - t0
    if rank == 0:
        queue.put(a.steps * a.per_worker_batch * a.workers * a.seq_len / dt)
    if a.workers > 1:
        dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default="small")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--per-worker-batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--warmup", type=int, default=3)
    a = p.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["OPENBLAS_NUM_THREADS"] = "1"
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, a, port, q)) for r in range(a.workers)]
    for pr in procs:
        pr.start()
    tps = q.get(timeout=900)
    for pr in procs:
        pr.join(timeout=60)
    print(f"torch {'DDP ' if a.workers > 1 else ''}{a.model} {a.workers} x {a.per_worker_batch}x{a.seq_len}: {tps:.0f} tok/s")


if __name__ == "__main__":
    main()
