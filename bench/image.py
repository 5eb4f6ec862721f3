"""Image (DiT) benchmark: engine step/preview/end-to-end next to diffusers' DiTPipeline, the served
/v1/image path (time to first preview), and a mixed run of speech streams + image requests.

    python bench/image.py --small                        # tiny random model on the CPU (< 2 min)
    python bench/image.py                                # DiT-XL/2 shapes at 256 and 512, bf16, cuda:0
    python bench/image.py --shapes 256 --batches 1 8 16 --speech-streams 8 --image-requests 8
    python bench/image.py --tts-model /path/to/csm       # speech streams from CSM instead of Piper

Weights are random (no public diffusion weights can be downloaded here): a DiT-XL/2-shaped
transformer, the SD kl-f8 VAE shape and a TAESD-shaped preview decoder are built with diffusers
and saved with save_pretrained into a temp folder, so timings are those of the real shapes.
Reported: step time per batch size (one batched denoising step incl. classifier-free guidance),
preview overhead (preview + host copy + JPEG per step, as % of the step; target <= 5 %),
end-to-end (N steps + VAE decode) for our engine and for DiTPipeline in the same process, the
served time to first preview, and speech underruns while images are generated on the same worker.
The speech streams come from the embedded Piper voice, or with ``--tts-model PATH`` from that CSM
checkpoint folder (``speech-streams + 1`` KV slots, CUDA graphs on CUDA; bf16 on cuda), so a
machine without the Piper voice package can run the served/mixed part.
Prints a table; writes bench/results/image.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from _common import commit, log  # bench/ is on sys.path when a script runs

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "server"))

SPEECH = ("The committee met on Tuesday to discuss the new budget. After a long debate, they agreed "
          "to fund the library renovation. Work will begin early next spring.")


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def make_checkpoint(folder: Path, image_size: int, small: bool, dtype: torch.dtype) -> Path:
    """A diffusers DiT folder (transformer/, vae/, scheduler/, preview_decoder/) with random weights."""
    from diffusers import AutoencoderKL, AutoencoderTiny, DDIMScheduler, DiTPipeline, DiTTransformer2DModel

    torch.manual_seed(0)
    if small:
        dit = DiTTransformer2DModel(num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=8,
                                    num_layers=2, sample_size=image_size // 8, patch_size=2, num_embeds_ada_norm=1000)
        vae = AutoencoderKL(block_out_channels=(8, 8, 8, 8), layers_per_block=1, norm_num_groups=4, latent_channels=4,
                            up_block_types=("UpDecoderBlock2D",) * 4, down_block_types=("DownEncoderBlock2D",) * 4)
        tiny = AutoencoderTiny(encoder_block_out_channels=(8,) * 4, decoder_block_out_channels=(8,) * 4)
    else:  # DiT-XL/2 (facebook/DiT-XL-2-256 / -512 shapes) + the SD kl-f8 VAE + TAESD
        dit = DiTTransformer2DModel(num_attention_heads=16, attention_head_dim=72, in_channels=4, out_channels=8,
                                    num_layers=28, sample_size=image_size // 8, patch_size=2,
                                    num_embeds_ada_norm=1000)
        vae = AutoencoderKL(block_out_channels=(128, 256, 512, 512), layers_per_block=2, latent_channels=4,
                            norm_num_groups=32, up_block_types=("UpDecoderBlock2D",) * 4,
                            down_block_types=("DownEncoderBlock2D",) * 4)
        tiny = AutoencoderTiny()
    with torch.no_grad():  # small random weights keep bf16 activations finite through 28 blocks
        for p in dit.parameters():
            p.normal_(0, 0.02)
    DiTPipeline(transformer=dit.to(dtype).eval(), vae=vae.to(dtype).eval(),
                scheduler=DDIMScheduler()).save_pretrained(folder)
    tiny.to(dtype).save_pretrained(folder / "preview_decoder")
    return folder


def bench_engine(folder: Path, device: str, dtype: torch.dtype, batches: list[int], steps: int,
                 reps: int) -> dict:
    from realtime.engines.diffusion import DiTEngine, to_jpeg
    from realtime.image_service import _to_u8

    eng = DiTEngine.from_pretrained(folder, device=device, dtype=dtype)
    out: dict = {"batches": {}}
    for b in batches:
        states = [eng.new_state(i % 1000, i, 1000, 4.0, "ddim") for i in range(b)]
        for _ in range(3):  # warm-up (kernels, allocator)
            eng.step_batch(states)
        sync(device)
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            eng.step_batch(states)
            sync(device)
            ts.append(time.perf_counter() - t0)
        step = statistics.median(ts)
        prev, jpeg = {}, {}
        for kind in ("latent2rgb", "taesd"):
            for _ in range(3):  # warm-up: the first calls per shape pick conv algorithms
                _to_u8(eng.preview(states, kind))
            pts, jts = [], []
            for _ in range(max(3, reps // 2)):
                t0 = time.perf_counter()
                pix = _to_u8(eng.preview(states, kind))  # what the lane does on the worker (incl. host copy)
                t1 = time.perf_counter()
                for img in pix:  # what the encoder threads do, off the worker
                    to_jpeg(img, eng.dit.cfg.sample_size * 8)
                pts.append(t1 - t0)
                jts.append(time.perf_counter() - t1)
            prev[kind], jpeg[kind] = statistics.median(pts), statistics.median(jts)
        out["batches"][b] = {"step_ms": step * 1000, "per_image_step_ms": step * 1000 / b,
                             "preview_ms": {k: v * 1000 for k, v in prev.items()},
                             "jpeg_ms": {k: v * 1000 for k, v in jpeg.items()},
                             # the worker's share: the preview + host copy; JPEG runs on other threads
                             "preview_overhead_pct": {k: 100 * v / step for k, v in prev.items()},
                             "preview_overhead_with_jpeg_pct": {k: 100 * (v + jpeg[k]) / step
                                                                for k, v in prev.items()}}
        log(f"  batch {b}: step {step * 1000:.2f} ms; preview on the worker: "
            f"latent2rgb {prev['latent2rgb'] * 1000:.2f} ms ({100 * prev['latent2rgb'] / step:.1f} %), "
            f"taesd {prev['taesd'] * 1000:.2f} ms ({100 * prev['taesd'] / step:.1f} %); "
            f"JPEG off the worker {jpeg['latent2rgb'] * 1000:.2f} ms")
    # end-to-end: N steps + VAE decode for one image
    e2e = []
    for r in range(3):
        sync(device)
        t0 = time.perf_counter()
        lat = eng.generate([207], [r], steps, 4.0, "ddim")
        _to_u8(eng.decode(lat))
        e2e.append(time.perf_counter() - t0)
    out["e2e_ms"] = statistics.median(e2e[1:]) * 1000
    del eng
    return out


def bench_diffusers(folder: Path, device: str, dtype: torch.dtype, steps: int) -> dict:
    from diffusers import DiTPipeline

    pipe = DiTPipeline.from_pretrained(folder, torch_dtype=dtype).to(device)
    pipe.set_progress_bar_config(disable=True)
    ts = []
    for r in range(3):
        sync(device)
        t0 = time.perf_counter()
        pipe([207], guidance_scale=4.0, num_inference_steps=steps, generator=torch.Generator().manual_seed(r),
             output_type="np")
        sync(device)
        ts.append(time.perf_counter() - t0)
    del pipe
    return {"e2e_ms": statistics.median(ts[1:]) * 1000}


async def image_request(url: str, label: int, seed: int, steps: int, preview_every: int, preview_size: int) -> dict:
    import msgpack
    import websockets

    t0 = time.monotonic()
    first = None
    n_prev = 0
    async with websockets.connect(url, max_size=None) as ws:
        await ws.send(msgpack.packb({"type": "start", "class_label": label, "seed": seed, "steps": steps,
                                     "preview_every": preview_every, "preview_size": preview_size,
                                     "preview": "taesd"}))
        stats = None
        async for frame in ws:
            msg = msgpack.unpackb(frame, raw=False)
            if msg["type"] == "preview":
                n_prev += 1
                first = first or time.monotonic()
            elif msg["type"] == "done":
                stats = msg["stats"]
            elif msg["type"] == "error":
                raise RuntimeError(msg)
    return {"client_first_preview_ms": None if first is None else (first - t0) * 1000,
            "client_total_ms": (time.monotonic() - t0) * 1000, "previews": n_prev, "server": stats}


async def speech_stream(url: str, delay: float) -> dict:
    from realtime.clients.tts import TTSStream

    await asyncio.sleep(delay)
    async with TTSStream(url, format="pcm_s16le", sample_rate=24000) as s:
        await s.send_text(SPEECH)
        await s.stop()
        async for _ in s:
            pass
    return s.stats


def speech_backend(tts_model: str | None, device: str, speech_streams: int):  # noqa: ANN201 - a TTSBackend
    """The Piper voice (fp32), or a CSM folder with a KV slot per stream (+1 spare)."""
    if tts_model is None:
        from realtime.tts_piper import PiperBackend

        tts = PiperBackend(None, device, device, torch.float32)
    else:
        from realtime.tts_csm import CSMBackend

        dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
        tts = CSMBackend(tts_model, device, device, dtype, n_slots=max(2, speech_streams + 1))
    if hasattr(tts, "warmup"):
        tts.warmup()
    return tts


def bench_server(folder: Path, device: str, dtype_name: str, tts_device: str, steps: int, speech_streams: int,
                 image_requests: int, tts_model: str | None = None) -> dict:
    from liveserver import serve

    from realtime.config import ServerConfig
    from realtime.image_service import ImageService
    from realtime.server import create_app

    cfg = ServerConfig(image_model=str(folder), generator_device=device, codec_device=device, dtype=dtype_name,
                       warmup=True, max_frame_bytes=8 << 20)
    tts = speech_backend(tts_model, tts_device, speech_streams)
    svc = ImageService(cfg)
    app = create_app(cfg, tts=tts, services=[svc])
    res: dict = {"tts": tts.name}
    with serve(app, ws_max_size=64 << 20) as live:
        img_url, tts_url = f"{live.ws}/v1/image", f"{live.ws}/v1/tts"
        size = svc.info.image_size

        async def alone() -> list[dict]:
            out = []
            for r in range(3):
                out.append(await image_request(img_url, 207, r, steps, 1, size))
            return out

        solo = asyncio.run(alone())[1:]
        res["single"] = {
            "client_first_preview_ms": statistics.median(r["client_first_preview_ms"] for r in solo),
            "client_total_ms": statistics.median(r["client_total_ms"] for r in solo),
            "server_step_ms_p50": statistics.median(r["server"]["step_ms_p50"] for r in solo)}
        log(f"  served single: first preview {res['single']['client_first_preview_ms']:.1f} ms, "
            f"total {res['single']['client_total_ms']:.0f} ms")

        async def speech_only() -> list[dict]:
            return await asyncio.gather(*[speech_stream(tts_url, 0.05 * i) for i in range(speech_streams)])

        async def mixed() -> tuple[list[dict], list[dict]]:
            sp = [speech_stream(tts_url, 0.05 * i) for i in range(speech_streams)]
            im = [image_request(img_url, 100 + i, i, steps, 1, size) for i in range(image_requests)]
            out = await asyncio.gather(*sp, *im)
            return list(out[:speech_streams]), list(out[speech_streams:])

        base = asyncio.run(speech_only())
        sp, im = asyncio.run(mixed())

        def summary(streams: list[dict]) -> dict:
            return {"streams": len(streams),
                    "underruns_over_100ms": sum(s["underruns_over_100ms"] for s in streams),
                    "underruns": sum(s["underruns"] for s in streams),
                    "max_underrun_ms": max(s["max_underrun_ms"] for s in streams),
                    "ttfa_ms_p50": statistics.median(s["ttfa_ms"] for s in streams)}

        res["speech_only"] = summary(base)
        res["mixed"] = {"speech": summary(sp), "images": {
            "requests": len(im), "client_total_ms_p50": statistics.median(r["client_total_ms"] for r in im),
            "client_first_preview_ms_p50": statistics.median(r["client_first_preview_ms"] for r in im),
            "server_step_ms_p50": statistics.median(r["server"]["step_ms_p50"] for r in im)}}
        log(f"  mixed: speech underruns>100ms {res['mixed']['speech']['underruns_over_100ms']} "
            f"(alone {res['speech_only']['underruns_over_100ms']}), images p50 total "
            f"{res['mixed']['images']['client_total_ms_p50']:.0f} ms")
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", action="store_true", help="tiny random model, CPU-friendly")
    ap.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                    help="default: bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--tts-device", default=None, help="device of the speech backend (default: --device)")
    ap.add_argument("--tts-model", default=None, help="a CSM folder for the speech streams instead of Piper")
    ap.add_argument("--shapes", type=int, nargs="+", default=None, help="image sides (default 256 512; small: 64)")
    ap.add_argument("--batches", type=int, nargs="+", default=None, help="batch sizes (default 1 4 16; small: 1 4)")
    ap.add_argument("--steps", type=int, default=None, help="denoising steps end-to-end (default 50; small: 20)")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--speech-streams", type=int, default=None)
    ap.add_argument("--image-requests", type=int, default=None)
    ap.add_argument("--no-diffusers", action="store_true")
    ap.add_argument("--no-server", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "image.json"))
    args = ap.parse_args()
    small = args.small
    dtype_name = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    dtype = getattr(torch, dtype_name)
    shapes = args.shapes or ([64] if small else [256, 512])
    batches = args.batches or ([1, 4] if small else [1, 4, 16])
    steps = args.steps or (20 if small else 50)
    reps = args.reps or (10 if small else 20)
    n_speech = args.speech_streams if args.speech_streams is not None else (2 if small else 4)
    n_img = args.image_requests if args.image_requests is not None else (2 if small else 4)
    if args.device == "cpu":
        torch.set_num_threads(max(1, torch.get_num_threads()))
    results: dict = {"date": time.strftime("%Y-%m-%d"), "commit": commit(), "machine": platform.machine(),
                     "torch": torch.__version__, "device": args.device, "dtype": dtype_name, "small": small,
                     "steps": steps, "shapes": {}}
    if args.device.startswith("cuda"):
        results["gpu"] = torch.cuda.get_device_name(args.device)
    with tempfile.TemporaryDirectory() as tmp:
        for side in shapes:
            log(f"shape {side}x{side}: building a random {'tiny' if small else 'DiT-XL/2'} checkpoint")
            folder = make_checkpoint(Path(tmp) / f"dit{side}", side, small, dtype)
            r = {"engine": bench_engine(folder, args.device, dtype, batches, steps, reps)}
            if not args.no_diffusers:
                r["diffusers"] = bench_diffusers(folder, args.device, dtype, steps)
            log(f"  end-to-end {steps} steps + VAE: ours {r['engine']['e2e_ms']:.0f} ms"
                + (f", DiTPipeline {r['diffusers']['e2e_ms']:.0f} ms" if "diffusers" in r else ""))
            if not args.no_server and side == shapes[0]:
                r["server"] = bench_server(folder, args.device, dtype_name, args.tts_device or args.device, steps,
                                           n_speech, n_img, args.tts_model)
            results["shapes"][side] = r
            if args.device.startswith("cuda"):
                torch.cuda.empty_cache()

    print()
    print(f"DiT on {results.get('gpu', args.device)} ({dtype_name}), {steps} steps, random weights")
    print("preview %: preview + host copy on the worker per step / step time (target <= 5); +jpeg: incl. encoding")
    print(f"{'shape':>6} {'batch':>5} {'step ms':>9} {'ms/img':>8} {'l2rgb %':>8} {'taesd %':>8} {'l2rgb+jpeg %':>13}")
    for side, r in results["shapes"].items():
        for b, v in r["engine"]["batches"].items():
            print(f"{side:>6} {b:>5} {v['step_ms']:>9.2f} {v['per_image_step_ms']:>8.2f} "
                  f"{v['preview_overhead_pct']['latent2rgb']:>8.1f} {v['preview_overhead_pct']['taesd']:>8.1f} "
                  f"{v['preview_overhead_with_jpeg_pct']['latent2rgb']:>13.1f}")
    print(f"{'shape':>6} {'ours e2e ms':>12} {'DiTPipeline ms':>15} {'first preview ms':>17} "
          f"{'speech >100ms (alone/mixed)':>28}")
    for side, r in results["shapes"].items():
        d = r.get("diffusers", {}).get("e2e_ms")
        s = r.get("server")
        fp = f"{s['single']['client_first_preview_ms']:.1f}" if s else "-"
        und = (f"{s['speech_only']['underruns_over_100ms']}/{s['mixed']['speech']['underruns_over_100ms']}"
               if s else "-")
        print(f"{side:>6} {r['engine']['e2e_ms']:>12.0f} {'-' if d is None else f'{d:.0f}':>15} {fp:>17} {und:>28}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2, default=str))
    log(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
