"""Text decode benchmark: our batched decode step vs HF transformers, and the bandwidth floor.

    python bench/text.py                          # Llama-3.2-1B shapes, bf16, CUDA (H200)
    python bench/text.py --small                  # tiny shapes, float32, CPU (< 2 min)
    python bench/text.py --batches 1 8 --steps 64 --no-hf
    python bench/text.py --embedded               # the embedded SmolLM2-135M GGUF (real weights), CPU: float32 and the cpu-native default

Random weights (seeded), built with transformers' LlamaForCausalLM and written with
``save_pretrained``; our TextModel loads that folder, so both run the same weights. Every stream
prefills a prompt of --prompt tokens, then decode steps are timed (all streams in one batched
step, the way the scheduler's text.decode lane runs them). Both implementations attend over the
whole cache length (--context) every step, so it is kept short by default. Ours runs eager and
(on CUDA) with the CUDA-graphed step; HF runs its eager model over a StaticCache, same batch.

Bandwidth floor: at batch 1 a step must read every weight once (the LM head included; the
embedding only one row), so tokens/s <= copy bandwidth / weight bytes. Copy bandwidth is measured
here with a large device-to-device copy (read + write bytes / time). Prints a table and writes
bench/results/text.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

from _common import commit, log  # bench/ is on sys.path when a script runs

ROOT = Path(__file__).resolve().parents[1]

LLAMA_3_2_1B = dict(
    hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
    head_dim=64, vocab_size=128256, max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=True,
    rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
)
SMALL = dict(
    hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
    head_dim=32, vocab_size=8192, max_position_embeddings=2048, rms_norm_eps=1e-5, tie_word_embeddings=True,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device, mib: int) -> float:
    """Bytes/s of a large device copy, counting the read and the write."""
    n = mib << 20
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync(device)
    reps = 10 if device.type == "cuda" else 3
    t0 = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src)
    sync(device)
    return 2 * n * reps / (time.perf_counter() - t0)


def build_checkpoint(shapes: dict, folder: Path, dtype: torch.dtype, device: torch.device) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(**shapes, torch_dtype=dtype)
    with torch.device(device):
        m = LlamaForCausalLM(cfg)
    m.to(dtype).save_pretrained(folder)
    del m


def ours_tokens_per_s(model, batch: int, prompt: int, steps: int, graphs: bool, temperature: float,  # noqa: ANN001
                      context: int, profile: dict | None = None, pipelined: bool = False,
                      advance: bool | None = None) -> tuple[float, list[int]]:
    from realtime.text_service import BatchDecoder

    dev = model.device
    dec = BatchDecoder(model, batch, context, cuda_graphs=graphs)
    if advance is not None:  # the step's token pick and bookkeeping in one launch (advance_rows) or torch ops
        dec.use_fused_advance(advance)
    g = torch.Generator().manual_seed(1)
    for s in range(batch):
        ids = torch.randint(0, model.vocab_size, (prompt,), generator=g).tolist()
        dec.start(s, ids, temperature, 0, 1.0, seed=s)
    slots = list(range(batch))
    greedy = temperature <= 0
    for _ in range(3):  # warm-up (and graph capture)
        dec.step(slots, greedy, filtered=False)
    sync(dev)
    t0 = time.perf_counter()
    first = []
    if pipelined:  # as the server's decode lane on CUDA: launch step n+1, then read step n
        pending = dec.launch(slots, greedy, filtered=False)
        for _ in range(steps - 1):
            nxt = dec.launch(slots, greedy, filtered=False)
            first.append(pending.result()[0])
            pending = nxt
        first.append(pending.result()[0])
    else:
        for _ in range(steps):
            out = dec.step(slots, greedy, filtered=False)  # each step reads its tokens back before the next
            first.append(out[0])
    dt = time.perf_counter() - t0
    if profile is not None and graphs and dev.type == "cuda":
        _profile_graphed(dec, slots, greedy, steps, dt, profile)
    del dec
    return batch * steps / dt, first


def _profile_graphed(dec, slots: list[int], greedy: bool, steps: int, wall: float, out: dict) -> None:  # noqa: ANN001
    """Where a graphed step's time goes: the device-only time (the step's graph replayed back to back,
    no token read between steps) next to the served loop's wall time, and the per-kernel table."""
    from torch.profiler import ProfilerActivity, profile

    mode = dec._mode(greedy, filtered=False)
    graph = next(g for (size, m), (g, _, _) in dec._graphs.items() if m == mode and size >= len(slots))
    n = 16
    dec.pos[:dec.n_slots].sub_(n)  # replay over positions the timed loop already used (stays inside the cache)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        graph.replay()
    torch.cuda.synchronize()
    device_ms = 1000 * (time.perf_counter() - t0) / n
    out["device_only_ms_per_step"] = device_ms
    out["served_loop_ms_per_step"] = 1000 * wall / steps
    log(f"batch {len(slots)}: device-only {device_ms:.3f} ms/step (graph replays back to back), served loop "
        f"{1000 * wall / steps:.3f} ms/step (a token read each step)")
    dec.pos[:dec.n_slots].sub_(n)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(8):
            graph.replay()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=24)
    out["kernels"] = table
    print(table, flush=True)


@torch.inference_mode()
def ours_teacher_forced(model, ids: list[int], split: int) -> torch.Tensor:  # noqa: ANN001
    """Our logits [T - split + 1, V] predicting after ids[:split], ids[:split+1], ..., ids[:T]: a
    cached prefill of ids[:split], then one decode step per remaining true token (the served path)."""
    dev = model.device
    cache = model.new_cache(1, len(ids) + 8)
    out = [model.prefill(cache, 0, ids[:split]).float().cpu()]
    slot = torch.zeros(1, dtype=torch.long, device=dev)
    for i in range(split, len(ids)):
        tok = torch.tensor([ids[i]], device=dev)
        out.append(model.decode_step(cache, slot, tok, torch.tensor([i], device=dev))[0].float().cpu())
    return torch.stack(out)


@torch.inference_mode()
def hf_tokens_per_s(hf, batch: int, prompt: int, steps: int, context: int) -> tuple[float, list[int]]:  # noqa: ANN001
    from transformers import StaticCache

    dev = hf.device
    g = torch.Generator().manual_seed(1)
    ids = torch.stack([torch.randint(0, hf.config.vocab_size, (prompt,), generator=g) for _ in range(batch)]).to(dev)
    cache = StaticCache(config=hf.config, max_cache_len=context)

    def step(tok: torch.Tensor, p: int) -> torch.Tensor:
        cp = torch.tensor([p], device=dev)
        return hf(tok[:, None], past_key_values=cache, cache_position=cp, use_cache=True).logits[:, -1]

    pos = torch.arange(prompt, device=dev)
    logits = hf(ids, past_key_values=cache, cache_position=pos, use_cache=True).logits[:, -1]
    tok = logits.argmax(-1)
    p = prompt
    for _ in range(3):
        logits = step(tok, p)
        tok = logits.argmax(-1)
        p += 1
    tok.tolist()
    sync(dev)
    t0 = time.perf_counter()
    first = []
    for _ in range(steps):
        logits = step(tok, p)
        tok = logits.argmax(-1)
        first.append(tok.tolist()[0])  # the same one read per step as ours
        p += 1
    dt = time.perf_counter() - t0
    return batch * steps / dt, first


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--small", action="store_true", help="tiny shapes in float32 on the CPU (smoke run)")
    ap.add_argument("--embedded", action="store_true",
                    help="the embedded SmolLM2-135M GGUF (real weights; HF loads the same file), CPU by default")
    ap.add_argument("--device", default=None, help="default: cuda if available (cpu with --small)")
    ap.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--batches", type=int, nargs="+", default=None)
    ap.add_argument("--steps", type=int, default=None, help="timed decode steps per batch size")
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens per stream")
    ap.add_argument("--context", type=int, default=None,
                    help="KV cache length per stream (both attend over all of it each step); default prompt+steps+8")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="> 0 times sampling (top-k and top-p off, the API default: no vocabulary sort)")
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--no-graphs", action="store_true", help="eager only")
    ap.add_argument("--profile", action="store_true", help="batch 1, graphed: device-only time and a kernel table")
    ap.add_argument("--advance-ab", action="store_true",
                    help="CUDA: each of our rows with the token pick and slot bookkeeping in advance_rows' one launch "
                         "(REALTIME_TEXT_ADVANCE=1), after a row with them as torch ops (impl suffix -torchpick)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "text.json"))
    args = ap.parse_args()

    small, embedded = args.small, args.embedded
    cpu_run = small or embedded
    device = torch.device(args.device or ("cpu" if cpu_run or not torch.cuda.is_available() else "cuda"))
    dtype = getattr(torch, args.dtype or ("float32" if cpu_run or device.type == "cpu" else "bfloat16"))
    batches = args.batches or ([1, 4, 8] if cpu_run else [1, 8, 32, 128])
    steps = args.steps or (16 if small else 32 if embedded else 128)
    shapes = SMALL if small else LLAMA_3_2_1B
    context = args.context or args.prompt + steps + 8
    if context < args.prompt + steps + 4:
        ap.error("--context must hold the prompt and the steps")
    if cpu_run and device.type == "cpu":
        torch.set_num_threads(min(torch.get_num_threads(), 2))
    graph_modes = [False] + ([True] if device.type == "cuda" and not args.no_graphs else [])
    label = "small" if small else "smollm2-135m-gguf" if embedded else "llama-3.2-1b"
    log(f"{label}, {dtype}, {device}, batches {batches}, {steps} steps, context {context}")

    from transformers import LlamaForCausalLM

    from realtime.engines.llama import TextModel

    results: dict = {"shapes": label, "device": str(device), "dtype": str(dtype),
                     "prompt_tokens": args.prompt, "steps": steps, "context": context, "temperature": args.temperature,
                     "torch": torch.__version__, "python": platform.python_version(), "commit": commit(), "rows": []}
    if device.type == "cuda":
        results["gpu"] = torch.cuda.get_device_name(device)
        # the decode stack's switches (REALTIME_STACK, _KERNEL, _INFLIGHT, _L2_KEEP, ...) as run
        results["stack_env"] = {k: v for k, v in sorted(os.environ.items()) if k.startswith("REALTIME_STACK")}
    bw = copy_bandwidth(device, 64 if cpu_run else 2048)
    results["copy_bandwidth_GBps"] = bw / 1e9
    log(f"copy bandwidth {bw / 1e9:.1f} GB/s")

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "llama"
        t0 = time.perf_counter()
        if embedded:
            from realtime.engines.llama import default_gguf_path

            ours = TextModel.from_pretrained(None, device=device, dtype=dtype)
            log(f"loaded the embedded GGUF in {time.perf_counter() - t0:.1f}s")
        else:
            build_checkpoint(shapes, folder, dtype, device)
            ours = TextModel.from_pretrained(folder, device=device, dtype=dtype)
            log(f"built and loaded random-weight checkpoint in {time.perf_counter() - t0:.1f}s")
        elt = torch.tensor([], dtype=dtype).element_size()
        n_transformer = sum(p.numel() for p in ours.transformer.parameters())
        head = ours.vocab_size * ours.config.dim
        weight_bytes = (n_transformer + head) * elt
        results["weight_bytes_per_step"] = weight_bytes
        results["floor_tokens_per_s_batch1"] = bw / weight_bytes
        log(f"weights read per step {weight_bytes / 1e9:.3f} GB → floor {bw / weight_bytes:.0f} tok/s at batch 1")

        modes = [(g, False) for g in graph_modes] + ([(True, True)] if True in graph_modes else [])
        for b in batches:
            for graphs, pipelined in modes:
                impl = "ours-graph-pipelined" if pipelined else "ours-graph" if graphs else "ours-eager"
                toks_ops = None
                if args.advance_ab and device.type == "cuda":  # the torch ops first, then advance_rows
                    tps, toks_ops = ours_tokens_per_s(ours, b, args.prompt, steps, graphs, args.temperature, context,
                                                      None, pipelined, advance=False)
                    results["rows"].append({"impl": impl + "-torchpick", "batch": b, "tokens_per_s": tps,
                                            "ms_per_step": 1000 * b / tps, "first_row": toks_ops[:16]})
                    log(f"{impl}-torchpick batch {b}: {tps:.0f} tok/s (the token pick and bookkeeping as torch ops)")
                prof = {} if args.profile and b == 1 and not pipelined else None
                tps, toks = ours_tokens_per_s(ours, b, args.prompt, steps, graphs, args.temperature, context, prof,
                                              pipelined, advance=True if toks_ops is not None else None)
                if toks_ops is not None:
                    log(f"{impl} batch {b}: the same tokens as the torch ops: {toks == toks_ops}")
                results["rows"].append({"impl": impl, "batch": b,
                                        "tokens_per_s": tps, "ms_per_step": 1000 * b / tps, "first_row": toks[:16]})
                if prof:
                    results["profile_b1"] = prof
                log(f"{impl} batch {b}: {tps:.0f} tok/s")
                if device.type == "cuda":
                    torch.cuda.empty_cache()
        g = torch.Generator().manual_seed(2)
        probe = torch.randint(0, ours.vocab_size, (args.prompt,), generator=g).tolist()
        split = args.prompt // 2
        ours_tf = ours_teacher_forced(ours, probe, split)
        del ours
        native_tf = None
        if embedded and device.type == "cpu":  # the server's CPU default: the file's 4-bit codes, bf16 products
            native = TextModel.from_pretrained(None, device=device, dtype=dtype, cpu_native=True)
            for b in batches:
                tps, toks = ours_tokens_per_s(native, b, args.prompt, steps, False, args.temperature, context)
                results["rows"].append({"impl": "ours-cpu-native", "batch": b, "tokens_per_s": tps,
                                        "ms_per_step": 1000 * b / tps, "first_row": toks[:16]})
                log(f"ours-cpu-native batch {b}: {tps:.0f} tok/s")
            native_tf = ours_teacher_forced(native, probe, split)
            del native
        if not args.no_hf:
            if embedded:  # transformers' own GGUF loading of the same file
                gguf = default_gguf_path()
                hf = LlamaForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=dtype)
                hf = hf.to(device).eval()
            else:
                hf = LlamaForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()
            # Parity with no divergence cascade: teacher-forced, the same true tokens into both.
            with torch.inference_mode():
                ref = hf(torch.tensor([probe], device=device)).logits[0, split - 1:].float().cpu()
            rel = float((ours_tf - ref).norm() / ref.norm())
            agree = float((ours_tf.argmax(-1) == ref.argmax(-1)).float().mean())
            results["parity_vs_hf"] = {"positions": len(ref), "logits_rel_l2": rel, "argmax_agreement": agree}
            log(f"parity vs HF (teacher-forced, {len(ref)} positions: prefill + decode steps): logits rel. L2 "
                f"{rel:.2e}, argmax agreement {agree:.3f}")
            if native_tf is not None:
                rel = float((native_tf - ref).norm() / ref.norm())
                agree = float((native_tf.argmax(-1) == ref.argmax(-1)).float().mean())
                results["parity_cpu_native_vs_hf"] = {"positions": len(ref), "logits_rel_l2": rel,
                                                      "argmax_agreement": agree}
                log(f"cpu-native vs HF (teacher-forced): logits rel. L2 {rel:.2e}, argmax agreement {agree:.3f}")
            for b in batches:
                tps, toks = hf_tokens_per_s(hf, b, args.prompt, steps, context)
                results["rows"].append({"impl": "hf-static", "batch": b, "tokens_per_s": tps,
                                        "ms_per_step": 1000 * b / tps, "first_row": toks[:16]})
                log(f"hf static-cache batch {b}: {tps:.0f} tok/s")
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            del hf

    # Greedy agreement of the first timed tokens (same weights, same random prompt): a sanity check,
    # not a parity test (bf16 near-ties may flip a token and the rest of the row with it).
    if args.temperature <= 0 and not args.no_hf:
        for row in results["rows"]:
            ref = next((r for r in results["rows"] if r["impl"] == "hf-static" and r["batch"] == row["batch"]), None)
            if ref is not None:
                pairs = list(zip(row["first_row"], ref["first_row"]))
                row["agrees_with_hf"] = sum(a == c for a, c in pairs) / len(pairs)

    floor = results["floor_tokens_per_s_batch1"]
    print()
    print(f"{'impl':<31} {'batch':>5} {'tok/s':>10} {'ms/step':>9} {'x floor(b1)':>11} {'agree':>6}")
    for r in results["rows"]:
        ag = r.get("agrees_with_hf")
        print(f"{r['impl']:<31} {r['batch']:>5} {r['tokens_per_s']:>10.0f} {r['ms_per_step']:>9.2f} "
              f"{r['tokens_per_s'] / floor:>11.2f} {'' if ag is None else f'{ag:.2f}':>6}")
    print(f"bandwidth floor at batch 1: {floor:.0f} tok/s ({results['weight_bytes_per_step'] / 1e9:.3f} GB/step at "
          f"{results['copy_bandwidth_GBps']:.0f} GB/s)")
    from realtime.kernels import gemv

    # the per-shape GEMV-or-cuBLAS choices the engine measured at load (see kernels/gemv.py)
    results["gemv_measured"] = [{k: (list(v) if isinstance(v, tuple) else v) for k, v in c.items()}
                                for c in gemv.choices()]
    for c in results["gemv_measured"]:
        print(f"GEMV choice {c}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    log(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
