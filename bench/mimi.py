"""Mimi streaming decode step: where its time goes, by switch, in one run.

    python bench/mimi.py [--device cuda] [--batches 1 8] [--out bench/results/mimi.json]

Random default-config Mimi (the published model's shapes), bf16 on CUDA (float32 on the CPU). One
code frame per step, as CSM feeds it. Each variant is timed full-batch (B slots of a B-slot
decoder) and as the server calls it (B slots of a 257-slot decoder, ``step(codes, slots)``; the
server's decoder holds its slots plus a scratch one). On
CUDA each step is captured in a CUDA graph and replayed back to back (median of 100 after 10
warm-up replays), with its kernel count from the profiler; on the CPU it runs eagerly.

Variants: the SEANet convs in NCW or channels-last (``channels_last``), and the streaming attention
as the Triton window kernel (which also writes the step's keys into the ring), the kernel after two
scatters, or SDPA with the same mask; and the window kernel with every product on cuBLAS (no
decode GEMV, whatever ``Transformer.choose_gemv`` measured), with the SEANet convs' elementwise glue
as plain PyTorch ops instead of ``kernels.seanet`` (ELU + state concat, overlap add + bias), or with
fc1's GELU as its own kernel instead of in the GEMV's epilogue; served, also with the slots' state
gathered before the step and written back after it (as before the kernels stepped it in place;
the SDPA and scatter variants always gather); and with the RVQ decode as PyTorch ops (two gathers,
sums and projections) instead of one gather-and-sum over the projection-folded codebooks.
``--profile`` prints the kernel table of the default served step at the first batch size. ``--tf32-check`` (CUDA) also steps the
same slots as a batch of 3 and of 4 in float32, per layout and TF32 setting: why float32 keeps NCW.
The outputs of all variants are compared with the first over 24 frames.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from _common import commit, log, write_json  # bench/ is on sys.path when a script runs

ROOT = Path(__file__).resolve().parents[1]
SERVED_SLOTS = 257


def build(device: str, dtype: torch.dtype):  # noqa: ANN201
    from realtime.codecs.mimi import Mimi, MimiConfig

    torch.manual_seed(0)
    m = Mimi(MimiConfig())
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn_like(p) * 0.02)
        for b in m.buffers():
            if b.is_floating_point():
                b.copy_(torch.randn_like(b))
    m = m.to(device, dtype).eval().requires_grad_(False)
    for rvq in (m.quantizer.semantic_residual_vector_quantizer, m.quantizer.acoustic_residual_vector_quantizer):
        rvq.codebooks = rvq.codebooks.float()  # as Mimi.from_pretrained keeps them
    for layer in m.decoder_transformer.layers:
        layer.self_attn.fuse()
    return m


def _sdpa_ring(self, q, k, v, qpos, kpos, window, new, rows=None):  # noqa: ANN001, ANN202
    """The ring attention as cuDNN SDPA with the position mask, after two scatters of the new keys."""
    from realtime.codecs.mimi import window_mask
    from realtime.kernels.window_attention import ring_write_ref

    ring_write_ref(k, v, *new)
    return self.attend(q, k, v, window_mask(qpos, kpos, window))


def _scatter_then_kernel(self, q, k, v, qpos, kpos, window, new, rows=None):  # noqa: ANN001, ANN202
    """The window kernel after two scatters of the new keys (the ring write outside the kernel)."""
    from realtime.kernels.window_attention import ring_write_ref, window_attention

    ring_write_ref(k, v, *new)
    o = window_attention(q, k, v, qpos, kpos, window, self.scale)
    return self.output(o.reshape(o.shape[0], o.shape[1], self.h * self.d))


def time_step(step, out_ref, device: str) -> tuple[float, int | None]:  # noqa: ANN001
    """ms per step (median) and kernels per step (CUDA)."""
    if device != "cuda":
        for _ in range(3):
            step()
        ts = []
        for _ in range(20):
            t0 = time.perf_counter()
            step()
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts) * 1e3, None
    from torch.profiler import ProfilerActivity, profile

    from realtime.cuda_graphs import capture

    graph, out = capture(step, torch.cuda.graph_pool_handle())
    out_ref.append(out)
    for _ in range(10):
        graph.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(100):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(4):
            graph.replay()
        torch.cuda.synchronize()
    kernels = sum(e.count for e in prof.key_averages()) // 4
    out_ref.append(graph)
    return statistics.median(ts), kernels


def profile_table(graph) -> str:  # noqa: ANN001
    """The kernels of 10 replays of a captured step, by total time (what a step spends where)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            graph.replay()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=45, max_name_column_width=60)
    print(table, flush=True)
    return table


def tf32_check(m) -> list[dict]:  # noqa: ANN001
    """float32: the same 3 slots stepped as a batch of 3 and of 4 (a padding row), per layout and TF32."""
    rows = []
    codes = torch.randint(0, 2048, (4, m.num_codebooks, 1), device="cuda")
    m32 = m.float()
    for tf32 in (True, False):
        torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = tf32
        for cl in (False, True):
            a, b = m32.streaming_decoder(6, cl), m32.streaming_decoder(6, cl)
            diffs = []
            for _ in range(6):
                ya = a.step(codes[:3], slots=torch.tensor([0, 1, 2], device="cuda"))
                yb = b.step(codes, slots=torch.tensor([0, 1, 2, 5], device="cuda"))[:3]
                diffs.append(((ya - yb).abs().max() / ya.abs().max()).item())
            rows.append({"tf32": tf32, "channels_last": cl, "max_rel_diff": max(diffs)})
            log(f"float32, TF32 {'on' if tf32 else 'off'}, {'channels-last' if cl else 'NCW'}: batch 3 vs 4, "
                f"max rel. diff {max(diffs):.1e}")
    torch.backends.cudnn.allow_tf32 = True
    torch.backends.cuda.matmul.allow_tf32 = False
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--frames", type=int, default=24, help="frames decoded to compare the variants' outputs")
    ap.add_argument("--served-slots", type=int, default=SERVED_SLOTS, help="slots of the served decoder")
    ap.add_argument("--tf32-check", action="store_true")
    ap.add_argument("--profile", action="store_true", help="kernel table of the default served step (CUDA)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "mimi.json"))
    args = ap.parse_args()
    if args.served_slots < 3 + max(args.batches):  # the served rows are slots 3 .. 3 + B - 1
        ap.error(f"--served-slots must be at least {3 + max(args.batches)} for batches {args.batches}")
    from realtime.codecs import mimi

    dev = args.device
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    m = build(dev, dtype)
    from realtime.kernels import seanet

    kernel_ring, glue = mimi.Attention.attend_ring, (seanet.state_concat, seanet.overlap_add)
    layers = m.decoder_transformer.layers
    gelus = [layer.gelu for layer in layers]

    def gathered(dec) -> None:  # noqa: ANN001
        dec.in_place = False

    def cublas_only(dec) -> None:  # noqa: ANN001
        """Every product on cuBLAS, as before the GEMV choice."""
        for layer in layers:
            layer.self_attn.gemv_qkv = layer.self_attn.gemv_o = layer.gemv_fc1 = layer.gemv_fc2 = False

    def gelu_apart(dec) -> None:  # noqa: ANN001
        """fc1 on the GEMV where its plain product measured faster, the GELU after it."""
        for layer in layers:
            layer.gelu = None
            layer.gemv_fc1 = mimi.use_gemv(layer.mlp.fc1.weight, layer.mlp.fc1.bias)

    def seanet_unfused(dec) -> None:  # noqa: ANN001
        """state_concat and overlap_add as PyTorch ops (their references; bias_act stays a kernel),
        the state gathered: the glue as the first SEANet kernels replaced it."""
        dec.in_place = False
        seanet.state_concat, seanet.overlap_add = seanet.state_concat_ref, seanet.overlap_add_ref

    from realtime.kernels import codebook

    codebook_kernel = codebook.codebook_sum

    def rvq_ops(dec) -> None:  # noqa: ANN001
        codebook.codebook_sum = lambda codes, table, dtype: m.quantizer.decode(codes, dtype)

    def restore() -> None:
        mimi.Attention.attend_ring = kernel_ring
        seanet.state_concat, seanet.overlap_add = glue
        codebook.codebook_sum = codebook_kernel
        for layer, gelu in zip(layers, gelus):
            layer.gelu = gelu

    # (name, attention, what to change after the decoder has made its GEMV choice)
    attn = [("window kernel", kernel_ring, None)]
    if dev == "cuda":
        attn += [("window kernel, state gathered", kernel_ring, gathered),
                 ("kernel + scatters", _scatter_then_kernel, gathered), ("SDPA", _sdpa_ring, gathered),
                 ("window kernel, cuBLAS only", kernel_ring, cublas_only),
                 ("window kernel, state gathered, SEANet glue unfused", kernel_ring, seanet_unfused),
                 ("window kernel, GELU apart from fc1", kernel_ring, gelu_apart),
                 ("window kernel, RVQ decode as PyTorch ops", kernel_ring, rvq_ops)]
    res = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
           "torch": torch.__version__, "dtype": str(dtype), "rows": [],
           "commit": commit()}
    g = torch.Generator().manual_seed(1)
    for b in args.batches:
        seq = torch.randint(0, 2048, (args.frames, b, m.num_codebooks, 1), generator=g).to(dev)
        first = None
        for served in (False, True):
            for cl in (False, True):
                for attn_name, ring, change in attn:
                    restore()
                    mimi.Attention.attend_ring = ring
                    dec = m.streaming_decoder(args.served_slots if served else b, cl)  # picks GEMV or cuBLAS
                    if change is not None:
                        change(dec)
                    inp = seq[0].clone()
                    slots = torch.arange(3, 3 + b, device=dev)

                    def step(dec=dec, inp=inp, slots=slots, served=served):  # noqa: ANN001, ANN202
                        return dec.step(inp, slots=slots) if served else dec.step(inp)

                    keep: list = []
                    ms, kernels = time_step(step, keep, dev)
                    if args.profile and dev == "cuda" and served and cl and change is None and ring is kernel_ring \
                            and b == args.batches[0]:
                        res["profile_served_b%d" % b] = profile_table(keep[1])
                    dec.reset()
                    outs = []
                    for i in range(args.frames):  # the same frames through every variant, from a reset
                        inp.copy_(seq[i])
                        if keep:
                            keep[1].replay()
                            outs.append(keep[0].float().clone())
                        else:
                            outs.append(step().float())
                    y = torch.cat(outs, -1)
                    first = y if first is None else first
                    rel = float((y - first).norm() / first.norm())
                    name = f"{'served' if served else 'full'}, {'channels-last' if cl else 'NCW'}, {attn_name}"
                    res["rows"].append({"batch": b, "served": served, "channels_last": cl, "attention": attn_name,
                                        "ms": ms, "kernels": kernels, "rel_l2_vs_first": rel})
                    log(f"batch {b} {name}: {ms:.3f} ms a step, {kernels if kernels is not None else '-'} kernels, "
                        f"rel. L2 vs the first variant {rel:.1e}")
    restore()
    if args.tf32_check and dev == "cuda":
        res["tf32_check"] = tf32_check(m)
    write_json(args.out, res)
    log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
