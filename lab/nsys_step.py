#!/usr/bin/env python3
"""A decode step's critical path from an Nsight Systems trace of bench/decode_bench --profile N.

What each kernel adds to the step: its end minus the latest end before it. Kernels launched for
programmatic dependent launch start before their predecessor ends, so their own durations overlap
and do not add up to the step; the end-to-end differences do. Also the GPU's idle time between
steps (the host's round trip for the token, the table upload and the graph launch). Graph-node
tracing slows the host's calls and each kernel a little: take the idle time as an upper bound
and compare kernels within one trace (decode_bench's own rows give the untraced figures).

On the device machine (Nsight Systems ships inside Nsight Compute there; its importer needs
Debian's libdw.so.1 and the libelf, liblzma and libbz2 it pulls, carried in a folder, LIBS):
    H=/opt/nvidia/nsight-compute/2025.3.1/host
    $H/target-linux-x64/nsys profile -o /tmp/rep --capture-range=cudaProfilerApi \\
        --cuda-graph-trace=node -t cuda decode_bench --steps 8 --profile 4
    LD_LIBRARY_PATH=LIBS $H/linux-desktop-glibc_2_11_3-x64/QdstrmImporter -i /tmp/rep.qdstrm
    $H/target-linux-x64/nsys stats --report cuda_gpu_trace --format csv -o $OUT/trace /tmp/rep.nsys-rep
Then here:  lab/nsys_step.py trace_cuda_gpu_trace.csv[.gz] [STEP]
(STEP: which step to list, default the second; a step starts at each embed_dev kernel.)
"""
import csv
import gzip
import re
import sys


def short(name):
    name = re.sub(r"^void ", "", name)
    name = re.sub(r"[<(].*", "", name)
    return name


def main():
    path = sys.argv[1]
    which = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    f = gzip.open(path, "rt") if path.endswith(".gz") else open(path)
    rows = list(csv.DictReader(f))
    starts = [i for i, r in enumerate(rows) if r["Name"].startswith("void embed_dev")]
    if len(starts) < 2:
        sys.exit("nsys_step: fewer than two steps (embed_dev kernels) in the trace")
    print("step  kernels  span_us  period_us  idle_us")
    for n, (a, b) in enumerate(zip(starts, starts[1:])):
        ks = [r for r in rows[a:b] if r["GrdX"]]
        t0 = int(ks[0]["Start (ns)"])
        end = max(int(r["Start (ns)"]) + int(r["Duration (ns)"]) for r in ks)
        nxt = int(rows[b]["Start (ns)"])
        print(f"{n:4d}  {len(ks):7d}  {(end - t0) / 1e3:7.1f}  {(nxt - t0) / 1e3:9.1f}  {(nxt - end) / 1e3:7.1f}")
    a, b = starts[which], starts[which + 1] if which + 1 < len(starts) else len(rows)
    ks = [r for r in rows[a:b] if r["GrdX"]]
    t0 = int(ks[0]["Start (ns)"])
    print(f"\nstep {which}: kernel, grid, duration, adds to the critical path, end (us from the step's start)")
    last = t0
    for r in ks:
        s, d = int(r["Start (ns)"]), int(r["Duration (ns)"])
        e = s + d
        grid = f'{r["GrdX"]}x{r["GrdY"]}x{r["GrdZ"]}'
        print(f"  {short(r['Name'])[:34]:34s} {grid:>12s} {d / 1e3:8.2f} {(max(e, last) - last) / 1e3:8.2f} "
              f"{(e - t0) / 1e3:9.1f}")
        last = max(last, e)


if __name__ == "__main__":
    main()
