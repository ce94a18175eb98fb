#!/usr/bin/env python3
"""Sums `ncu --metrics gpu__time_duration.sum --csv` output per kernel name (a decode step's
profile from bench/decode_bench --profile N), largest first.

    ncu --clock-control none --cache-control none --profile-from-start off \
        --metrics gpu__time_duration.sum --csv BIN --profile 1 > p.csv
    lab/ncu_summary.py p.csv

(--cache-control none: ncu otherwise flushes the caches before every kernel, which makes the
small kernels of a step read from memory what the real step finds in L2.)
"""
import collections
import csv
import sys

SCALE = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3}

rows = list(csv.reader(open(sys.argv[1])))
hdr, agg, total = None, collections.defaultdict(lambda: [0, 0.0]), 0.0
for r in rows:
    if "Kernel Name" in r:
        hdr = r
        continue
    if not hdr or len(r) != len(hdr):
        continue
    d = dict(zip(hdr, r))
    if d.get("Metric Name") != "gpu__time_duration.sum":
        continue
    us = float(d["Metric Value"].replace(",", "")) * SCALE.get(d.get("Metric Unit", ""), 1.0)
    k = d["Kernel Name"][:90]
    agg[k][0] += 1
    agg[k][1] += us
    total += us
print("total kernel time %.1f us over %d kernels" % (total, sum(a[0] for a in agg.values())))
for k, (n, us) in sorted(agg.items(), key=lambda x: -x[1][1])[:int(sys.argv[2]) if len(sys.argv) > 2 else 25]:
    print("%8.1f us %4d  %s" % (us, n, k))
