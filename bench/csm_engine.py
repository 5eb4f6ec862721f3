"""CSM-1B + Mimi engine benchmark on one GPU: ours (eager and CUDA-graphed) vs HF transformers.

    python bench/csm_engine.py --out bench/results/csm_engine.json [--folder /tmp/csm1b]

Builds a CSM-1B checkpoint with random bf16 weights (HF default CsmConfig = the public csm-1b
shapes) and saves it with save_pretrained, so both implementations load the same weights. Times
frames/s at batch 1 for HF generate (eager and static cache) and for our step (eager, graphed),
our graphed step at larger batches, and Mimi decode per frame; reports the bandwidth floor
(weight bytes read per frame / measured copy bandwidth). Warm-up first; medians.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from _common import commit, log, write_json  # bench/ is on sys.path when a script runs

ROOT = Path(__file__).resolve().parents[1]


def byte_tokenizer(folder: Path) -> None:
    """A byte-level tokenizer with Llama-3's special ids (no real tokenizer can be downloaded here)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {f"<0x{b:02X}>": b for b in range(256)}
    vocab.update({chr(c): 256 + i for i, c in enumerate(range(33, 127))})
    vocab[" "] = 400
    specials = {"<|begin_of_text|>": 128000, "<|end_of_text|>": 128001, "<|AUDIO|>": 128002, "<|audio_eos|>": 128003}
    vocab.update(specials)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Split(" ", "isolated")
    tok.decoder = decoders.ByteFallback()
    tok.add_special_tokens([AddedToken(s, special=True) for s in specials])
    tok.save(str(folder / "tokenizer.json"))


def build(folder: Path) -> None:
    import transformers

    if (folder / "config.json").exists():
        return
    log("building CSM-1B with random bf16 weights on the GPU")
    cfg = transformers.CsmConfig()
    with torch.device("cuda"):
        torch.manual_seed(0)
        model = transformers.CsmForConditionalGeneration(cfg).to(torch.bfloat16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            elif not name.startswith("codec_model."):
                p.normal_(0.0, 0.02)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    byte_tokenizer(folder)
    del model
    torch.cuda.empty_cache()
    log(f"saved to {folder}")


def cuda_time(fn, n: int) -> list[float]:
    out = []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return out


def copy_bandwidth() -> float:
    x = torch.empty(2 * 1024**3 // 2, dtype=torch.bfloat16, device="cuda").normal_()
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    ts = cuda_time(lambda: y.copy_(x), 10)
    return 2 * x.numel() * 2 / statistics.median(ts)  # bytes read + written per second


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--folder", default="/tmp/csm1b")
    ap.add_argument("--frames", type=int, default=48)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "csm_engine.json"))
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--variants", nargs="+", default=["eager", "graphed", "graphed_kernels"],
                    help="eager | graphed (plain PyTorch ops) | graphed_kernels (the fast path: Triton RMSNorm+residual, "
                         "RoPE + cache write, decode attention, fused sampler, fused q|k|v and gate|up, the decode "
                         "GEMV where it beats cuBLAS) | graphed_kernels_nogemv (the fast path with cuBLAS only)")
    ap.add_argument("--variant-batches", type=int, nargs="+", default=None,
                    help="batch sizes for every variant but the last (default: --batches)")
    args = ap.parse_args()
    folder = Path(args.folder)
    build(folder)
    res: dict = {"date": time.strftime("%Y-%m-%d"), "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
                 "commit": commit()}
    bw = copy_bandwidth()
    res["copy_bandwidth_TBps"] = bw / 1e12
    log(f"copy bandwidth {bw / 1e12:.2f} TB/s")

    import transformers

    from realtime.tts_csm import CSMBackend

    text = "Hello there, how are you today?"
    if not args.skip_hf:
        log("HF transformers: loading")
        hf = transformers.CsmForConditionalGeneration.from_pretrained(folder, torch_dtype=torch.bfloat16).cuda().eval()
        ids = torch.tensor([[128000] + list(range(300, 300 + len(text))) + [128001]], device="cuda")
        for impl in ("eager", "static"):
            kw = {"cache_implementation": "static"} if impl == "static" else {}
            gen = lambda: hf.generate(ids, max_new_tokens=args.frames, min_new_tokens=args.frames, do_sample=False,
                                      depth_decoder_do_sample=False, **kw)  # noqa: E731
            try:
                gen()  # warm-up
                ts = cuda_time(gen, 3)
                res[f"hf_{impl}_frames_per_s"] = args.frames / statistics.median(ts)
                log(f"HF generate ({impl}): {res[f'hf_{impl}_frames_per_s']:.1f} frames/s")
            except Exception as exc:  # report, keep going
                res[f"hf_{impl}_error"] = repr(exc)[:300]
                log(f"HF {impl} failed: {exc!r}")
        # HF Mimi decode of one frame
        codes = torch.randint(0, 2048, (1, 32, 1), device="cuda")
        dec = lambda: hf.codec_model.decode(codes)  # noqa: E731
        for _ in range(3):
            dec()
        res["hf_mimi_decode_ms"] = statistics.median(cuda_time(dec, 10)) * 1000
        log(f"HF Mimi decode 1 frame: {res['hf_mimi_decode_ms']:.2f} ms")
        del hf
        torch.cuda.empty_cache()

    import realtime.engines.transformer as tr
    from realtime.engines.transformer import use_kernels

    n_slots = max(args.batches)
    gemv_env = tr._GEMV
    for tag in args.variants:
        graphs = tag != "eager"
        use_kernels("kernels" in tag)  # before loading: the fast path also fuses the projections at load
        tr._GEMV = "0" if "nogemv" in tag else gemv_env  # the decode GEMV is chosen per shape at load
        log(f"ours ({tag}): loading + capture")
        t0 = time.perf_counter()
        b = CSMBackend(str(folder), "cuda", "cuda", torch.bfloat16, n_slots=n_slots, max_seq_len=1024,
                       cuda_graphs=graphs)
        if graphs:
            b.capture_graphs()
        res[f"ours_{tag}_setup_s"] = time.perf_counter() - t0
        csm = b.csm
        mods = [m for stack in (csm.backbone, csm.depth) for m in stack.modules()]
        res[f"ours_{tag}_gemv_choices"] = {
            "qkv": sum(getattr(m, "gemv_qkv", False) for m in mods), "o": sum(getattr(m, "gemv_o", False) for m in mods),
            "gate_up+swiglu": sum(getattr(m, "gemv_gate_up", False) for m in mods),
            "down": sum(getattr(m, "gemv_down", False) for m in mods),
            "lm_head": csm.gemv_lm_head, "projector": csm.gemv_projector, "codebook_heads": csm.gemv_codebooks}
        log(f"ours ({tag}): GEMV chosen for {res[f'ours_{tag}_gemv_choices']}")
        if csm.depth.stack_cuda:  # the CUDA stack's settings (REALTIME_STACK_INFLIGHT, REALTIME_STACK_L2_KEEP)
            from realtime.kernels import decode_stack_cuda as dsc

            res[f"ours_{tag}_stack"] = {"inflight": dsc.INFLIGHT, "l2_keep": csm.depth.stack.l2_keep,
                                        "l2_set_aside_bytes": csm.l2_kept}
            log(f"ours ({tag}): CUDA stack {res[f'ours_{tag}_stack']}")
        if "weight_bytes_per_frame" not in res:
            def nbytes(m) -> int:  # noqa: ANN001
                ps = [m] if isinstance(m, torch.nn.Parameter) else list(m.parameters())
                return sum(p.numel() * p.element_size() for p in ps)

            k = csm.num_codebooks
            # Weights read per frame at batch 1: the backbone stack once (one step: the frame's
            # embedding in, the next hidden out), the codebook-0 head, the depth stack once per
            # codebook 1..K-1, each depth head slice once, the projector K times. Embedding rows are
            # gathered (a few KB), not read whole.
            res["weight_bytes_per_frame"] = (nbytes(csm.backbone) + nbytes(csm.lm_head) + nbytes(csm.codebooks_head)
                                             + (k - 1) * nbytes(csm.depth) + k * nbytes(csm.depth_projector))
            # the convention: floor time = weight bytes per frame / measured copy bandwidth
            res["floor_frames_per_s"] = bw / res["weight_bytes_per_frame"]
        try:
            _bench_variant(args, res, b, csm, tag, graphs, text)
        except Exception as exc:  # one failing variant must not lose the others' numbers
            res[f"ours_{tag}_error"] = repr(exc)[:400]
            log(f"variant {tag} failed: {exc!r}")
        b = None  # free the caches before the next variant
        torch.cuda.empty_cache()
    use_kernels(True)
    from realtime.kernels import gemv

    res["gemv_measured"] = [{k: (list(v) if isinstance(v, tuple) else v) for k, v in c.items()} for c in gemv.choices()]
    for c in res["gemv_measured"]:
        log(f"GEMV choice {c}")
    from realtime.kernels import sampling

    res["sampler_measured"] = sampling.choices()
    log(f"sampler choice (digit bits / warps: us a row) {res['sampler_measured']}")
    res["gpu_mem_peak_GiB"] = torch.cuda.max_memory_allocated() / 2**30
    write_json(args.out, res)
    print(json.dumps({k: v for k, v in res.items() if not k.startswith("profile")}, indent=2))
    return 0


def _bench_variant(args, res: dict, b, csm, tag: str, graphs: bool, text: str) -> None:  # noqa: ANN001
    """frames/s and Mimi decode time of one variant at each batch size (eager: batch 1 only)."""
    batches = args.batches if tag == args.variants[-1] or not args.variant_batches else args.variant_batches
    for bsz in batches if graphs else [1]:
        slots = torch.arange(bsz)
        for s in range(bsz):
            csm.prefill(b.state, s, csm.build_prompt(text, 0))
        temp, tk, sd = torch.full((bsz,), 0.9), torch.full((bsz,), 50, dtype=torch.long), torch.arange(bsz)

        def frames(n: int = 16) -> None:
            for _ in range(n):
                b.frame_step(slots, temp, tk, sd)

        frames(4)
        if bsz == 1:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
                frames(2)
                torch.cuda.synchronize()
            table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=18)
            res[f"profile_{tag}_b1"] = table
            print(table, flush=True)
        ts = cuda_time(frames, 5)
        fps = 16 / statistics.median(ts)
        if bsz == 1:  # what a first frame waits for: step called on an idle GPU -> codes on the host
            lat = []
            for _ in range(20):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                b.frame_step(slots, temp, tk, sd)
                lat.append(time.perf_counter() - t0)
            torch.cuda.synchronize()
            res[f"ours_{tag}_b1_codes_latency_ms"] = statistics.median(lat) * 1000
            log(f"ours {tag} batch 1: codes on the host {statistics.median(lat) * 1000:.2f} ms after the call "
                f"(a frame every {1000 / fps:.2f} ms)")
        res[f"ours_{tag}_b{bsz}_frames_per_s_per_stream"] = fps
        res[f"ours_{tag}_b{bsz}_aggregate_frames_per_s"] = fps * bsz
        log(f"ours {tag} batch {bsz}: {fps:.1f} frames/s per stream, {fps * bsz:.0f} aggregate")
        for s in range(bsz):
            b.state.reset([s])
        codes = torch.randint(0, 2048, (bsz, 32, 1))
        dec = lambda: b.decode_slots(slots, codes)  # noqa: E731
        for _ in range(3):
            dec()
        res[f"ours_{tag}_b{bsz}_mimi_decode_ms"] = statistics.median(cuda_time(dec, 10)) * 1000
        if bsz == 1 and tag == args.variants[-1]:  # where the Mimi step's time goes (one frame)
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(4):
                    dec()
                torch.cuda.synchronize()
            res["profile_mimi_b1"] = prof.key_averages().table(sort_by="cuda_time_total", row_limit=14)
            print(res["profile_mimi_b1"], flush=True)
        step_note = ""
        if b.decode_graphs is not None:  # the decode step alone: its graph replayed back to back
            g = b.decode_graphs.graphs[b.decode_graphs.bucket(bsz)]

            def replays(n: int = 20) -> None:
                for _ in range(n):
                    g.replay()

            res[f"ours_{tag}_b{bsz}_mimi_step_graph_ms"] = statistics.median(cuda_time(replays, 10)) * 1000 / 20
            step_note = f" (the step's graph alone: {res[f'ours_{tag}_b{bsz}_mimi_step_graph_ms']:.3f} ms)"
        log(f"ours {tag} Mimi decode batch {bsz}: {res[f'ours_{tag}_b{bsz}_mimi_decode_ms']:.2f} ms a call{step_note}")
    if graphs and tag == args.variants[-1] and b.prefill_graphs is not None:
        _bench_prefill(res, b, csm, tag, text)


def _bench_prefill(res: dict, b, csm, tag: str, text: str) -> None:  # noqa: ANN001
    """Prefill time, eager (one batched pass of PyTorch calls) vs replayed from the prefill graphs,
    for "Hello." alone, the sentence after a ~5 s voice reference (62 frames), and 16 new streams."""
    torch.manual_seed(0)
    ref = torch.randint(0, 2048, (62, csm.num_codebooks))
    cases = {"hello": [csm.build_prompt("Hello.", 0)],
             "sentence_after_5s_reference": [csm.build_prompt(text, 0, [(0, "A reference voice.", ref)])],
             "16_streams_sentence": [csm.build_prompt(text, 0)] * 16}
    for name, prompts in cases.items():
        n = len(prompts)
        if n > b.n_slots:
            continue
        slots = list(range(n))
        for mode, graphs in (("eager", None), ("graphed", b.prefill_graphs)):
            run = lambda: csm.prefill_many(b.state, slots, prompts, graphs=graphs)  # noqa: E731
            for _ in range(3):
                run()
            ms = statistics.median(cuda_time(run, 10)) * 1000
            res[f"ours_{tag}_prefill_{name}_{mode}_ms"] = ms
            log(f"prefill {name} ({n} x {len(prompts[0])} positions) {mode}: {ms:.2f} ms")
        b.state.reset(slots)


if __name__ == "__main__":
    sys.exit(main())
