#!/usr/bin/python3
"""Step time of trn-train layouts under two builds, run alternately (A B, B A, ...).

    /usr/bin/python3 bench/ab_builds.py --before DIR --after DIR [--hosts H] --per-host N
        [--steps 10] [--rounds 3] LAYOUT...

DIR: a directory holding trn-train, trnrun and trn-coordinator (and trn-netdelay for the bed).
--hosts 0 runs on this host (trnrun --nproc-per-node N); --hosts H > 0 on a test bed of H hosts
with N ranks each (root; bench/plan_validate.py's Bed). Each LAYOUT is one string of trn-train
layout flags. Prints each layout's median step time per build (the median of each run's own
step times, then the median over the runs) and every run's figure.
"""
import argparse
import os
import statistics
import sys
import types

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import plan_validate as pv  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", required=True)
    p.add_argument("--after", required=True)
    p.add_argument("--hosts", type=int, default=0)
    p.add_argument("--per-host", type=int, required=True)
    p.add_argument("--model", default="small")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--work-dir", default="/tmp/trn-ab")
    p.add_argument("layouts", nargs="+")
    args = p.parse_args()
    bins = {"before": os.path.abspath(args.before), "after": os.path.abspath(args.after)}
    a = types.SimpleNamespace(bin=bins["after"], model=args.model, seq_len=args.seq_len, n_layer=None,
                              precision=None, steps=args.steps, warmup=args.warmup, batch_size=args.batch_size,
                              timeout=600)
    os.makedirs(args.work_dir, exist_ok=True)
    bed = pv.Bed(a, args.hosts) if args.hosts else None
    res, n = {}, 0
    try:
        for r in range(args.rounds):
            for flags in args.layouts:
                for which in (("before", "after") if r % 2 == 0 else ("after", "before")):
                    n += 1
                    a.bin = bins[which]
                    lay = pv.Layout(pv.Case(args.hosts, args.per_host), flags.split())
                    run = pv.run_bed(a, bed, lay, args.work_dir, n) if bed else pv.run_local(a, lay, args.work_dir, n)
                    res.setdefault((flags, which), []).append(run[0])
    finally:
        if bed:
            bed.down()
    where = f"bed {args.hosts} x {args.per_host}" if args.hosts else f"1 host x {args.per_host}"
    for flags in args.layouts:
        b, f = statistics.median(res[(flags, "before")]), statistics.median(res[(flags, "after")])
        print(f"{where} | {flags} | before {b:.4f} | after {f:.4f} | {100 * (f / b - 1):+.1f}% | "
              f"runs before {['%.4f' % x for x in res[(flags, 'before')]]} after {['%.4f' % x for x in res[(flags, 'after')]]}")


if __name__ == "__main__":
    main()
