"""Mimi codec: parity with transformers' MimiModel (offline), and streaming == offline (exact causality).

Tiny random configs, seeded, saved with ``save_pretrained``.  The tiny config is chosen to exercise
every code path: an odd stride (3), two residual layers (dilation 2), GQA (4 heads / 2 KV heads), a
sliding window (5 tokens) much shorter than the sequences, and a chunk size whose token count
(2 * 7 = 14) exceeds the KV ring (W - 1 = 4).
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from transformers import CsmConfig, CsmForConditionalGeneration, MimiModel
from transformers import MimiConfig as HFMimiConfig

from realtime.codecs.mimi import CausalConv1d, CausalConvTranspose1d, Mimi, MimiConfig
from realtime.errors import ModelFormatError

TINY = dict(
    hidden_size=32, num_filters=4, upsampling_ratios=[3, 2, 2], num_residual_layers=2,
    codebook_size=16, codebook_dim=8, vector_quantization_hidden_dimension=8, num_quantizers=4,
    upsample_groups=32, num_hidden_layers=2, intermediate_size=64, num_attention_heads=4,
    num_key_value_heads=2, sliding_window=5,
)
T = 23  # code frames per test sequence (46 transformer tokens >> window 5)


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """The tiny model's ops are microseconds long: with 2 threads, thread hand-offs dominate and on a
    loaded 2-core box a streaming test goes from 0.3 s to 10 s.  Restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _randomize(model: MimiModel, seed: int) -> None:
    """HF initialises codebooks to zero and LayerScale to 0.01: give every tensor real values."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if not t.is_floating_point():
                continue
            if name.endswith("cluster_usage"):
                t.copy_(torch.rand(t.shape, generator=g) * 1.5 + 0.5)
            elif name.endswith("initialized"):
                t.fill_(1.0)
            elif "layernorm" in name or name.endswith(".scale"):
                t.copy_(torch.rand(t.shape, generator=g) + 0.5)
            elif t.dim() > 1:
                t.copy_(torch.randn(t.shape, generator=g) / math.sqrt(t[0].numel()))
            else:
                t.copy_(torch.randn(t.shape, generator=g) * 0.3)


def _calibrate_codebooks(model: MimiModel, seed: int) -> None:
    """Codebooks drawn from the encoder's own latents (and then residuals), layer by layer, like a
    k-means init: with codebooks of the wrong scale or offset, argmin picks the same entry always."""
    g = torch.Generator().manual_seed(seed)
    audio = torch.randn(2, 1, 16 * model.config.frame_size, generator=g) * 0.5
    with torch.no_grad():
        x = model.encoder(audio)
        x = model.encoder_transformer(x.transpose(1, 2))[0].transpose(1, 2)
        x = model.downsample(x)
        for rvq in (model.quantizer.semantic_residual_vector_quantizer,
                    model.quantizer.acoustic_residual_vector_quantizer):
            residual = rvq.input_proj(x).transpose(1, 2).reshape(-1, rvq.layers[0].codebook.embed_sum.shape[1])
            for layer in rvq.layers:
                cb = layer.codebook
                n = cb.embed_sum.shape[0]
                embed = residual[torch.randperm(residual.shape[0], generator=g)[:n]]
                embed = embed + 0.01 * embed.std() * torch.randn(embed.shape, generator=g)
                cb.embed_sum.copy_(embed * cb.cluster_usage[:, None])
                cb._embed = None  # HF caches embed_sum / cluster_usage
                residual = residual - embed[torch.cdist(residual, embed).argmin(-1)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[MimiModel, Path]:
    torch.manual_seed(0)
    hf = MimiModel(HFMimiConfig(**TINY)).eval()
    _randomize(hf, seed=1)
    _calibrate_codebooks(hf, seed=2)
    path = tmp_path_factory.mktemp("mimi")
    hf.save_pretrained(path)
    return hf, path


@pytest.fixture(scope="module")
def ours(tiny) -> Mimi:
    return Mimi.from_pretrained(tiny[1])


def _codes(seed: int, b: int = 2, k: int = 4, t: int = T) -> torch.Tensor:
    return torch.randint(0, 16, (b, k, t), generator=torch.Generator().manual_seed(seed))


def _close(a: torch.Tensor, b: torch.Tensor, tol: float = 1e-5) -> float:
    """Max abs difference, asserted against tol times the signal's peak."""
    assert a.shape == b.shape, (a.shape, b.shape)
    diff = (a - b).abs().max().item()
    assert diff <= tol * max(1.0, b.abs().max().item()), diff
    return diff


def _stream_decode(mimi: Mimi, codes: torch.Tensor, chunk: int, channels_last: bool | None = None) -> torch.Tensor:
    dec = mimi.streaming_decoder(codes.shape[0], channels_last)
    outs = []
    for i in range(0, codes.shape[-1], chunk):
        step = codes[:, :, i: i + chunk]
        y = dec.step(step)
        assert y.shape == (codes.shape[0], 1, step.shape[-1] * mimi.frame_size)
        outs.append(y)
    return torch.cat(outs, dim=-1)


# 1. offline decode == HF -------------------------------------------------------------------------

def test_offline_decode_matches_hf(tiny, ours):
    hf, _ = tiny
    codes = _codes(0)
    with torch.no_grad():
        ref = hf.decode(codes).audio_values
    out = ours.decode(codes)
    assert out.shape == (2, 1, T * ours.frame_size) == ref.shape
    rel = ((out - ref).norm() / ref.norm()).item()
    assert rel <= 1e-4, rel
    assert ref.abs().max() > 0.1  # the random weights produce a real signal, not ~0

    # Fewer codebooks (RVQ truncation), loaded with num_codebooks=2.
    two = Mimi.from_pretrained(tiny[1], num_codebooks=2)
    assert two.num_codebooks == 2
    with torch.no_grad():
        ref2 = hf.decode(codes[:, :2]).audio_values
    assert ((two.decode(codes[:, :2]) - ref2).norm() / ref2.norm()).item() <= 1e-4


# 2. streaming decode == offline decode, on every sample ------------------------------------------

@pytest.mark.parametrize("chunk", [1, 2, 3, 7])
def test_streaming_decode_equals_offline(ours, chunk):
    # The decoder is strictly causal (right-trimmed transposed convs, left-padded convs, causal
    # sliding-window attention), so EVERY output sample is reproducible by streaming, including the
    # final (kernel - stride) samples of each transposed conv: asserted on all T * frame_size samples.
    codes = _codes(1)
    offline = ours.decode(codes)
    _close(_stream_decode(ours, codes, chunk), offline)


def test_streamed_prefix_equals_offline_of_longer_sequence(ours):
    # Strict causality: sample p depends only on frames <= p // frame_size, so a stream of the first 9
    # frames equals the offline decode of all 23 frames on its whole length (nothing to trim).
    codes = _codes(2)
    _close(_stream_decode(ours, codes[:, :, :9], 1), ours.decode(codes)[..., : 9 * ours.frame_size])


@pytest.mark.parametrize("first", [9, 1])
def test_streaming_decode_batch_with_reset(ours, first):
    # Slot 0 streams A throughout; slot 1 streams B for `first` frames, is reset alone, then streams C
    # in chunks of 2.  first=1 leaves stale ring entries at positions the restarted stream reaches
    # inside its first chunk, so a reset that forgot the KV positions would be caught.
    fs = ours.frame_size
    a, b, c = _codes(3, b=1), _codes(4, b=1, t=first), _codes(5, b=1)
    dec = ours.streaming_decoder(2)
    buffers = [dec.upsample_tail, dec.kv.k, dec.kv.v, dec.kv.kv_pos, dec.kv.pos, *dec.convs]
    ptrs = [t.data_ptr() for t in buffers]
    out0, out1 = [], []
    for i in range(first):
        y = dec.step(torch.cat([a[:, :, i: i + 1], b[:, :, i: i + 1]]))
        out0.append(y[0:1]); out1.append(y[1:2])
    dec.reset(torch.tensor([False, True]))  # restart slot 1 only, slot 0 continues
    out1_new = []
    for i in range(first, T, 2):
        n = min(2, T - i)
        y = dec.step(torch.cat([a[:, :, i: i + n], c[:, :, i - first: i - first + n]]))
        out0.append(y[0:1]); out1_new.append(y[1:2])
    _close(torch.cat(out0, -1), ours.decode(a))
    _close(torch.cat(out1, -1), ours.decode(b))
    new = torch.cat(out1_new, -1)
    _close(new, ours.decode(c[:, :, : new.shape[-1] // fs]))
    # State lives in fixed buffers written in place: nothing was reallocated by step() or reset().
    assert [t.data_ptr() for t in buffers] == ptrs


@pytest.mark.parametrize("chunk", [1, 3])
def test_streaming_decode_channels_last_equals_offline(ours, chunk, monkeypatch):
    # The CUDA default: the SEANet decoder on channels-last 4-D activations (so cuDNN does not transpose
    # them). Same samples as offline, and every conv of the step really sees channels-last input and
    # weight; one NCW operand would make cuDNN transpose again, which is the cost this layout removes.
    seen = []
    for name in ("conv2d", "conv_transpose2d"):
        orig = getattr(torch.nn.functional, name)

        def spy(x, w, *a, _orig=orig, **kw):
            seen.append(all(t.is_contiguous(memory_format=torch.channels_last) for t in (x, w)))
            return _orig(x, w, *a, **kw)

        monkeypatch.setattr(torch.nn.functional, name, spy)
    codes = _codes(1)
    _close(_stream_decode(ours, codes, chunk, channels_last=True), ours.decode(codes))
    n_convs = sum(isinstance(m, (CausalConv1d, CausalConvTranspose1d)) for m in ours.decoder.modules())
    assert len(seen) == n_convs * -(-T // chunk) and all(seen)


@pytest.mark.parametrize("channels_last", [False, True])
def test_streaming_decode_of_slot_subsets(ours, channels_last):
    # The server steps only the slots with a frame ready: step(codes, slots) gathers their state,
    # steps it and writes it back. Streams A (slot 2) and B (slot 0) advance together, C (slot 3)
    # on its own at every third frame; slot 1 is never stepped and its state must stay as reset.
    a, b, c = _codes(20, b=1), _codes(21, b=1), _codes(22, b=1)
    dec = ours.streaming_decoder(4, channels_last)
    before = (dec.state[1].clone(), dec.kv.kv[:, :, 1].clone(), dec.kv.kp[1].clone())
    out_a, out_b, out_c, jc = [], [], [], 0
    for i in range(T):
        y = dec.step(torch.cat([a[:, :, i: i + 1], b[:, :, i: i + 1]]), slots=torch.tensor([2, 0]))
        out_a.append(y[0:1]); out_b.append(y[1:2])
        if i % 3 == 0:
            out_c.append(dec.step(c[:, :, jc: jc + 1], slots=torch.tensor([3])))
            jc += 1
    _close(torch.cat(out_a, -1), ours.decode(a))
    _close(torch.cat(out_b, -1), ours.decode(b))
    _close(torch.cat(out_c, -1), ours.decode(c[:, :, :jc]))
    after = (dec.state[1], dec.kv.kv[:, :, 1], dec.kv.kp[1])
    assert all(torch.equal(x, y) for x, y in zip(before, after))
    assert dec.state[3].abs().sum() > 0 and int(dec.kv.pos[3]) == 2 * jc


# 3. encoder == HF, streaming encode == offline encode ---------------------------------------------

def test_encode_matches_hf(tiny, ours):
    hf, path = tiny
    g = torch.Generator().manual_seed(6)
    fs = ours.frame_size
    for n in (T * fs, T * fs - 7):  # whole frames, and a trailing partial frame (right padding)
        audio = torch.randn(2, 1, n, generator=g) * 0.5
        with torch.no_grad():
            ref = hf.encode(audio).audio_codes
        out = ours.encode(audio)
        assert out.dtype == torch.long and out.shape == ref.shape == (2, 4, math.ceil(n / fs))
        assert torch.equal(out, ref)
        assert all(len(torch.unique(out[:, k])) >= 8 for k in range(4))  # codes actually vary
    two = Mimi.from_pretrained(path, num_codebooks=2)
    with torch.no_grad():
        ref2 = hf.encode(audio, num_quantizers=2).audio_codes
    assert torch.equal(two.encode(audio), ref2)


@pytest.mark.parametrize("chunk", [1, 3])
def test_streaming_encode_equals_offline(ours, chunk):
    fs = ours.frame_size
    audio = torch.randn(2, 1, T * fs, generator=torch.Generator().manual_seed(7)) * 0.5
    enc = ours.streaming_encoder(2)
    codes = torch.cat([enc.step(audio[..., i * fs: (i + chunk) * fs]) for i in range(0, T, chunk)], -1)
    assert torch.equal(codes, ours.encode(audio))


def test_streaming_encode_batch_with_reset(ours):
    fs = ours.frame_size
    g = torch.Generator().manual_seed(8)
    a, b, c = (torch.randn(1, 1, T * fs, generator=g) + 0.3 for _ in range(3))  # offset: replicate pad matters
    enc = ours.streaming_encoder(2)
    s0, s1, s1_new = [], [], []
    for i in range(6):
        y = enc.step(torch.cat([a[..., i * fs: (i + 1) * fs], b[..., i * fs: (i + 1) * fs]]))
        s0.append(y[0:1]); s1.append(y[1:2])
    enc.reset([False, True])
    for i in range(6, T):
        j = i - 6
        y = enc.step(torch.cat([a[..., i * fs: (i + 1) * fs], c[..., j * fs: (j + 1) * fs]]))
        s0.append(y[0:1]); s1_new.append(y[1:2])
    assert torch.equal(torch.cat(s0, -1), ours.encode(a))
    assert torch.equal(torch.cat(s1, -1), ours.encode(b[..., : 6 * fs]))
    assert torch.equal(torch.cat(s1_new, -1), ours.encode(c[..., : (T - 6) * fs]))


# 4. loading: CSM folder, bad folders ------------------------------------------------------------

def test_load_from_csm_folder(tmp_path):
    torch.manual_seed(0)
    small = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                 num_key_value_heads=1, vocab_size=19, pad_token_id=None, bos_token_id=None, eos_token_id=None)
    cfg = CsmConfig(
        num_codebooks=3, text_vocab_size=50, codebook_pad_token_id=18, codebook_eos_token_id=0,
        audio_token_id=42, audio_eos_token_id=43,
        depth_decoder_config=dict(num_codebooks=3, backbone_hidden_size=16, **small),
        codec_config=HFMimiConfig(**TINY).to_dict(), **small,
    )
    csm = CsmForConditionalGeneration(cfg).eval()
    _randomize(csm.codec_model, seed=9)
    csm.save_pretrained(tmp_path)
    mimi = Mimi.from_pretrained(tmp_path)
    assert mimi.num_codebooks == 3  # CSM's own num_codebooks
    codes = _codes(10, k=3)
    with torch.no_grad():
        ref = csm.codec_model.decode(codes).audio_values
    assert ((mimi.decode(codes) - ref).norm() / ref.norm()).item() <= 1e-4


def _copy_folder(src: Path, dst: Path, edit) -> Path:
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    tensors = load_file(src / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors")
    return dst


def test_bad_folders_raise_model_format_error(tiny, tmp_path):
    _, path = tiny
    key = "decoder.layers.0.conv.weight"
    missing = _copy_folder(path, tmp_path / "missing", lambda t: t.pop(key))
    with pytest.raises(ModelFormatError, match=key):
        Mimi.from_pretrained(missing)
    extra = _copy_folder(path, tmp_path / "extra", lambda t: t.update({"foo.bar": torch.zeros(1)}))
    with pytest.raises(ModelFormatError, match="foo.bar"):
        Mimi.from_pretrained(extra)
    shape = _copy_folder(path, tmp_path / "shape", lambda t: t.update({key: t[key][:, :3].contiguous()}))
    with pytest.raises(ModelFormatError, match=key):
        Mimi.from_pretrained(shape)
    with pytest.raises(ModelFormatError):
        Mimi.from_pretrained(tmp_path / "does-not-exist")
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ModelFormatError):
        Mimi.from_pretrained(other)
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text((path / "config.json").read_text())
    with pytest.raises(ModelFormatError):
        Mimi.from_pretrained(no_weights)


# 5. default config shape facts ------------------------------------------------------------------

def test_default_config_facts():
    hf = HFMimiConfig()
    cfg = MimiConfig.from_hf(hf.to_dict())
    assert cfg == MimiConfig()  # our defaults are the published model's
    # frame size = product of the SEANet ratios times the 25 -> 12.5 Hz resampling stride
    assert cfg.frame_size == math.prod(hf.upsampling_ratios) * cfg.resample_stride == hf.frame_size
    assert (cfg.sample_rate, cfg.frame_size, cfg.frame_rate) == (24_000, 1920, 12.5) == (
        hf.sampling_rate, hf.frame_size, hf.frame_rate)
    assert cfg.resample_kernel == 4 and cfg.sliding_window == 250

    # Full-size model (random weights): one frame in -> one frame out, and timing for the record.
    torch.manual_seed(0)
    mimi = Mimi(cfg).eval().requires_grad_(False)
    assert (mimi.sample_rate, mimi.frame_size, mimi.frame_rate, mimi.num_codebooks) == (24_000, 1920, 12.5, 32)
    dec = mimi.streaming_decoder(1)
    codes = torch.randint(0, 2048, (1, 32, 1))
    dec.step(codes)
    t0 = time.perf_counter()
    y = dec.step(codes)
    print(f"default Mimi streaming decode: {(time.perf_counter() - t0) * 1e3:.1f} ms/frame (CPU)")
    assert y.shape == (1, 1, 1920)
    assert dec.kv.k.shape[3] == 251  # KV ring: W - 1 past tokens + one frame's 2 new ones


# bf16 and CUDA -----------------------------------------------------------------------------------

def test_bf16_cpu_runs_and_tracks_fp32(tiny, ours):
    lo = Mimi.from_pretrained(tiny[1], dtype=torch.bfloat16)
    codes = _codes(11)
    ref = ours.decode(codes)
    off = lo.decode(codes)
    st = _stream_decode(lo, codes, 2)
    assert off.dtype == st.dtype == torch.bfloat16
    for y in (off, st):
        rel = ((y.float() - ref).norm() / ref.norm()).item()
        assert rel < 0.1, rel
    audio = torch.randn(2, 1, 4 * ours.frame_size, generator=torch.Generator().manual_seed(12))
    assert lo.encode(audio).shape == (2, 4, 4)


def _graphed(fn, *inputs):
    """Capture fn(*inputs) in a CUDA graph (after a side-stream warm-up); returns (graph, output)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn(*inputs)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(*inputs)
    return graph, out


@pytest.mark.gpu
def test_cuda_bf16_streaming_in_cuda_graphs(tiny, ours):
    gpu = Mimi.from_pretrained(tiny[1], device="cuda", dtype=torch.bfloat16)
    codes = _codes(13).cuda()
    ref = ours.decode(codes.cpu())
    off = gpu.decode(codes)
    assert ((off.float().cpu() - ref).norm() / ref.norm()).item() < 0.1
    eager = _stream_decode(gpu, codes, 1)
    # One-frame decoder steps replayed from a CUDA graph: fixed-shape state, no host syncs.
    dec = gpu.streaming_decoder(2)
    inp = codes[:, :, :1].clone()
    graph, out = _graphed(dec.step, inp)
    dec.reset()
    outs = []
    for i in range(T):
        inp.copy_(codes[:, :, i: i + 1])
        graph.replay()
        outs.append(out.clone())
    streamed = torch.cat(outs, -1)
    assert ((streamed.float() - eager.float()).norm() / eager.float().norm()).item() < 1e-2
    assert ((streamed.float() - off.float()).norm() / off.float().norm()).item() < 0.05
    # Encoder steps in a graph too.
    fs = gpu.frame_size
    audio = torch.randn(2, 1, T * fs, generator=torch.Generator().manual_seed(14)).cuda()
    enc = gpu.streaming_encoder(2)
    a_in = audio[..., :fs].clone()
    graph, codes_out = _graphed(enc.step, a_in)
    enc.reset()
    got = []
    for i in range(T):
        a_in.copy_(audio[..., i * fs: (i + 1) * fs])
        graph.replay()
        got.append(codes_out.clone())
    enc2 = gpu.streaming_encoder(2)
    want = torch.cat([enc2.step(audio[..., i * fs: (i + 1) * fs]) for i in range(T)], -1)
    assert torch.equal(torch.cat(got, -1), want)


@pytest.mark.gpu
def test_cuda_default_config_step_time():
    torch.manual_seed(0)
    mimi = Mimi(MimiConfig()).to("cuda", torch.bfloat16).eval().requires_grad_(False)
    for b in (1, 8):
        dec = mimi.streaming_decoder(b)
        inp = torch.randint(0, 2048, (b, 32, 1), device="cuda")
        graph, out = _graphed(dec.step, inp)
        for name, fn in (("eager", lambda: dec.step(inp)), ("graph", graph.replay)):
            fn()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(50):
                fn()
            torch.cuda.synchronize()
            print(f"default Mimi CUDA bf16 B={b} {name}: {(time.perf_counter() - t0) / 50 * 1e3:.2f} ms/frame")
        assert out.shape == (b, 1, 1920) and torch.isfinite(out.float()).all()
