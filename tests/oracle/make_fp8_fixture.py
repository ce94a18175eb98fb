#!/usr/bin/env python3
"""Makes tests/fixtures/fp8_a: tiny_a quantised to block-scaled FP8, for tests/model_fp8_test.cc.

Needs only numpy (the safetensors files are read and written by hand here):

    python3 tests/oracle/make_fp8_fixture.py [SRC_DIR [OUT_DIR]]   # tests/fixtures/tiny_a, .../fp8_a

Every linear weight of tiny_a (projections, experts, lm_head, the indexer's linear maps) except
the routers (listed in modules_to_not_convert as "mlp.gate") is cut into blocks of 16 x 32 (the
tiny shapes then have partial blocks at the bottom and right edges: lm_head's 300 rows, the
48-column q_lora inputs, b_proj's 4 rows), each block scaled by scale = amax / 448 and rounded to
fp8 e4m3fn (nearest, ties to even), and stored as F8_E4M3 beside "<name>_scale_inv" (F32,
[ceil(rows / 16), ceil(cols / 32)]). Every other tensor is copied as it is; the vision tensors are
left out. config.json is tiny_a's with a top-level quantization_config.

The reference. There is no transformers run here: what the fixture pins is the dequantisation.
This script dequantises every FP8 tensor on its own path (fp8 decoded from its bit fields in
numpy, one fp32 product with the block's scale, rounded to bf16 to nearest even) and records in
dequant.json the FNV-1a 64 hash of each tensor's bf16 bytes. The test dequantises fp8_a with the
loader, checks each tensor's hash (bitwise equality with this script), builds the bf16 checkpoint
from those tensors, and checks that the runtime's logits on the FP8 checkpoint equal its logits on
that bf16 copy. dequant.json also records, per tensor, the largest |dequantised - tiny_a| over the
tensor's largest |value| (the quantisation error, for information).
"""
import json
import os
import struct
import sys

import numpy as np

BLOCK = (16, 32)
SKIP = ["mlp.gate"]  # modules_to_not_convert: the routers stay bf16
FP8_MAX = 448.0


def read_safetensors(path):
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    base = 8 + n
    out = {}
    for name, e in header.items():
        if name == "__metadata__":
            continue
        b, end = e["data_offsets"]
        out[name] = (e["dtype"], e["shape"], data[base + b:base + end])
    return out


def write_safetensors(path, tensors):
    """tensors: name -> (dtype, shape, bytes), written in sorted name order."""
    header, blobs, off = {}, [], 0
    for name in sorted(tensors):
        dt, shape, raw = tensors[name]
        header[name] = {"dtype": dt, "shape": list(shape), "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for raw in blobs:
            f.write(raw)


def bf16_to_f32(raw, shape):
    u = np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16
    return u.view(np.float32).reshape(shape)


def f32_to_bf16_bytes(x):
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16  # nearest even (no NaN here)
    return u.astype("<u2").tobytes()


def fp8_decode(codes):
    """e4m3fn bit fields -> float32 (codes 0x7f/0xff would be NaN; none are written)."""
    c = codes.astype(np.int32)
    e, m = (c >> 3) & 15, c & 7
    v = np.where(e == 0, m * 2.0 ** -9, (8 + m) * np.exp2(e - 10.0))
    return np.where(c & 0x80, -v, v).astype(np.float32)


POS = fp8_decode(np.arange(127, dtype=np.uint8)).astype(np.float64)  # codes 0..126, increasing


def fp8_encode(x):
    """float -> e4m3fn codes, nearest with ties to the even code, |x| <= 448."""
    a = np.minimum(np.abs(x).astype(np.float64), FP8_MAX)
    hi = np.clip(np.searchsorted(POS, a), 1, 126)
    lo = hi - 1
    dlo, dhi = a - POS[lo], POS[hi] - a
    code = np.where(dlo < dhi, lo, np.where(dhi < dlo, hi, np.where(lo % 2 == 0, lo, hi)))
    return (code | np.where(np.signbit(x), 0x80, 0)).astype(np.uint8)


def is_linear(name, shape):
    if "visual" in name or len(shape) != 2:
        return False
    if name.endswith("embed_tokens.weight") or ".hc_" in name or name.endswith("index_kpool_compress_ape"):
        return False
    return True


def skipped(name):
    module = name.rsplit(".", 1)[0]
    return any(module == s or module.endswith("." + s) or module.startswith(s + ".") for s in SKIP)


def fnv1a64(raw):
    h = 0xCBF29CE484222325
    for b in raw:
        h = ((h ^ b) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return "%016x" % h


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    src = sys.argv[1] if len(sys.argv) > 1 else os.path.normpath(os.path.join(here, "..", "fixtures", "tiny_a"))
    out = sys.argv[2] if len(sys.argv) > 2 else os.path.normpath(os.path.join(here, "..", "fixtures", "fp8_a"))
    os.makedirs(out, exist_ok=True)
    tensors = read_safetensors(os.path.join(src, "model.safetensors"))
    bm, bn = BLOCK
    written, report = {}, {}
    for name, (dt, shape, raw) in sorted(tensors.items()):
        if "visual" in name:
            continue
        if not is_linear(name, shape) or skipped(name):
            written[name] = (dt, shape, raw)
            continue
        assert dt == "BF16", name
        w = bf16_to_f32(raw, shape)
        rows, cols = shape
        nrb, ncb = -(-rows // bm), -(-cols // bn)
        scale = np.ones((nrb, ncb), dtype=np.float32)
        codes = np.zeros(shape, dtype=np.uint8)
        for i in range(nrb):
            for j in range(ncb):
                blk = w[i * bm:(i + 1) * bm, j * bn:(j + 1) * bn]
                amax = float(np.max(np.abs(blk)))
                s = np.float32(amax / FP8_MAX) if amax > 0 else np.float32(1.0)
                scale[i, j] = s
                codes[i * bm:(i + 1) * bm, j * bn:(j + 1) * bn] = fp8_encode(blk / s)
        written[name] = ("F8_E4M3", shape, codes.tobytes())
        written[name + "_scale_inv"] = ("F32", [nrb, ncb], scale.astype("<f4").tobytes())
        # the independent dequantisation: one fp32 product per element, then bf16
        full = np.repeat(np.repeat(scale, bm, axis=0), bn, axis=1)[:rows, :cols]
        deq = fp8_decode(codes) * full
        assert deq.dtype == np.float32
        dq_bytes = f32_to_bf16_bytes(deq)
        err = float(np.max(np.abs(bf16_to_f32(dq_bytes, shape) - w)) / max(float(np.max(np.abs(w))), 1e-30))
        report[name] = {"fnv1a64_bf16": fnv1a64(dq_bytes), "rel_err": err}
    write_safetensors(os.path.join(out, "model.safetensors"), written)
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
        "weight_block_size": list(BLOCK), "modules_to_not_convert": SKIP,
    }
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
        f.write("\n")
    with open(os.path.join(out, "dequant.json"), "w") as f:
        json.dump({"source": "tiny_a", "weight_block_size": list(BLOCK), "tensors": report}, f, indent=1,
                  sort_keys=True)
        f.write("\n")
    worst = max(r["rel_err"] for r in report.values())
    print(f"{out}: {len(report)} FP8 tensors, worst relative quantisation error {worst:.3e}")


if __name__ == "__main__":
    main()
