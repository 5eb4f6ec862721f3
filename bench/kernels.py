"""Triton decode-path kernels vs their PyTorch references on CUDA, at CSM-1B / Llama-3.2-1B shapes.

    python bench/kernels.py                        # bf16, B in 1 8 32
    python bench/kernels.py --batch 1 4 --json bench/results/kernels.json

Shapes: dim D=2048, H=32 query heads, Hkv=8 kv heads, head_dim 64, vocab V=128256 (Llama text)
and V=2051 (CSM audio codebook), static cache Tmax=2048 with rows filled to --fill of Tmax.

Times are medians in µs from triton.testing: "eager" launches each call (includes Python and
launch overhead, what an uncaptured step pays), "graph" replays a CUDA graph of the call (device
time, what a captured decode step pays). GB/s = minimum bytes moved / graph time, with:
  rmsnorm        (2·R·D + D)·e            read x, weight; write y           (R = B rows)
  add_rmsnorm    (4·R·D + D)·e            read x, residual, weight; write y, new residual
  apply_rotary   2·(H + Hkv)·B·T·hd·e + 2·B·T·hd·e    read+write q, k; read cos, sin (T = 1)
  decode_attn    2·Hkv·hd·e·Σ lengths + 2·B·H·hd·e    read valid K and V; read q, write out
  sample         B·V·e_logits             one read of the logits (the kernel reads top-k rows 5x)
with e the element size in bytes. Must run on a CUDA machine; nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

import torch

from realtime.kernels.decode_attention import decode_attention, decode_attention_ref
from realtime.kernels.rmsnorm import add_rmsnorm, add_rmsnorm_ref, rmsnorm, rmsnorm_ref
from realtime.kernels.rotary import apply_rotary, apply_rotary_ref, rotary_cache_write
from realtime.kernels.sampling import sample, sample_ref

DIM, N_HEADS, N_KV_HEADS, HEAD_DIM, TMAX = 2048, 32, 8, 64, 2048
VOCABS = {"llama": 128256, "csm": 2051}


def _times_us(fn) -> tuple[float, float]:
    import triton.testing

    eager = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3
    # Captures many unrolled calls in one graph on a side stream (warm-up included).
    graph = triton.testing.do_bench_cudagraph(fn, rep=20, return_mode="median") * 1e3
    return eager, graph


def _cases(b: int, dtype: torch.dtype, fill: float):
    dev = "cuda"
    e = torch.tensor([], dtype=dtype).element_size()
    x = torch.randn(b, DIM, device=dev, dtype=dtype)
    r = torch.randn_like(x)
    w = torch.randn(DIM, device=dev, dtype=dtype)
    yield "rmsnorm", (2 * b * DIM + DIM) * e, lambda: rmsnorm(x, w, 1e-5), lambda: rmsnorm_ref(x, w, 1e-5)
    yield ("add_rmsnorm", (4 * b * DIM + DIM) * e,
           lambda: add_rmsnorm(x, r, w, 1e-5), lambda: add_rmsnorm_ref(x, r, w, 1e-5))

    q = torch.randn(b, 1, N_HEADS, HEAD_DIM, device=dev, dtype=dtype).transpose(1, 2)  # engine layout
    k = torch.randn(b, 1, N_KV_HEADS, HEAD_DIM, device=dev, dtype=dtype).transpose(1, 2)
    ang = torch.rand(b, 1, HEAD_DIM // 2, device=dev) * 1000
    emb = torch.cat((ang, ang), -1)[:, None]
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    yield ("apply_rotary", (2 * (N_HEADS + N_KV_HEADS) * b * HEAD_DIM + 2 * b * HEAD_DIM) * e,
           lambda: apply_rotary(q, k, cos, sin), lambda: apply_rotary_ref(q, k, cos, sin))

    slots_n = max(b, 1)
    kc = torch.randn(slots_n, N_KV_HEADS, TMAX, HEAD_DIM, device=dev, dtype=dtype)
    vc = torch.randn_like(kc)
    qd = torch.randn(b, N_HEADS, HEAD_DIM, device=dev, dtype=dtype)
    slots = torch.randperm(slots_n, device=dev)[:b]
    n = max(1, int(fill * TMAX))
    lengths = torch.full((b,), n, device=dev, dtype=torch.long)
    scale = 1 / math.sqrt(HEAD_DIM)
    yield (f"decode_attn(len={n})", 2 * N_KV_HEADS * HEAD_DIM * e * b * n + 2 * b * N_HEADS * HEAD_DIM * e,
           lambda: decode_attention(qd, kc, vc, slots, lengths, scale),
           lambda: decode_attention_ref(qd, kc, vc, slots, lengths, scale))
    # One layer of the engine's decode step: RoPE + the own key's cache write, then the attention,
    # with the split's first key block loaded before its PDL wait (EARLY_KV) against without
    # ("ref" here is early_kv=False; the speedup column is EARLY_KV's).
    qkv = torch.randn(b, (N_HEADS + 2 * N_KV_HEADS) * HEAD_DIM, device=dev, dtype=dtype)
    tab = torch.rand(TMAX, HEAD_DIM, device=dev, dtype=torch.float32) * 6.28
    tcos, tsin = tab.cos().to(dtype), tab.sin().to(dtype)
    pos = lengths - 1

    def layer(early: bool):  # noqa: ANN202
        def f():  # noqa: ANN202
            qr = rotary_cache_write(qkv, tcos, tsin, pos, kc, vc, slots, N_HEADS, N_KV_HEADS)
            return decode_attention(qr, kc, vc, slots, lengths, scale, early_kv=early)
        return f
    yield (f"rope+decode_attn(len={n}), early_kv on vs off", 2 * N_KV_HEADS * HEAD_DIM * e * b * n,
           layer(True), layer(False))

    for name, v in VOCABS.items():
        logits = torch.randn(b, v, device=dev, dtype=torch.float32) * 3
        temp = torch.full((b,), 0.9, device=dev)
        seeds = torch.arange(b, device=dev)
        steps = torch.full((b,), 7, device=dev, dtype=torch.long)
        for top_k in (0, 50):
            tk = torch.full((b,), top_k, device=dev, dtype=torch.long)
            yield (f"sample({name} V={v}, k={top_k})", b * v * 4,
                   lambda lg=logits, tk=tk: sample(lg, temp, tk, seeds, steps),
                   lambda lg=logits, tk=tk: sample_ref(lg, temp, tk, seeds, steps))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    ap.add_argument("--fill", type=float, default=0.5, help="fraction of Tmax holding valid keys")
    ap.add_argument("--json", default=None, help="also write the rows here")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench/kernels.py needs a CUDA GPU", file=sys.stderr)
        return 2
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    rows = []
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  dtype {args.dtype}")
    print(f"{'kernel':34} {'B':>3} {'kern eager':>10} {'kern graph':>10} {'ref eager':>10} {'ref graph':>10} "
          f"{'kern GB/s':>9} {'ref GB/s':>9} {'speedup':>7}")
    for b in args.batch:
        for name, nbytes, kern, ref in _cases(b, dtype, args.fill):
            ke, kg = _times_us(kern)
            re_, rg = _times_us(ref)
            row = {"kernel": name, "batch": b, "dtype": args.dtype, "bytes": nbytes,
                   "kernel_eager_us": ke, "kernel_graph_us": kg, "ref_eager_us": re_, "ref_graph_us": rg,
                   "kernel_gbps": nbytes / (kg * 1e-6) / 1e9, "ref_gbps": nbytes / (rg * 1e-6) / 1e9}
            rows.append(row)
            print(f"{name:34} {b:>3} {ke:>10.1f} {kg:>10.1f} {re_:>10.1f} {rg:>10.1f} "
                  f"{row['kernel_gbps']:>9.1f} {row['ref_gbps']:>9.1f} {rg / kg:>6.2f}x", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
