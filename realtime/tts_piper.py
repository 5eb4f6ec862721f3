"""The embedded voice on the scheduler: Piper VITS as a two-stage pipeline.

GENERATOR lane (worker "generator"): one text segment → phonemes → latent frames z [1, C, F] for
each sentence (text encoder + duration predictor + flow). When the vocoder has nothing queued for
the stream and its player is close to running dry (a talk spurt's first sentence), a long
sentence's flow runs in two parts on the CPU: the frames its first two windows read, handed over
at once, then the rest (the flow is convolutional, so the parts equal the whole;
``PiperVoice.flow``). VOCODER lane (worker "codec"): windows of latent frames → PCM through
HiFi-GAN with context on both sides, so chunked audio equals whole-utterance audio. Windows of
equal length from different streams run as one batched call.
The first window of a talk spurt is short (first audio soon); later ones are longer (less context
overhead per sample).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from realtime.protocol.tts import StartParams
from realtime.scheduler import Lane
from realtime.tts import TTSBackend, TTSJob

if TYPE_CHECKING:
    from realtime.engines.vits import PiperVoice

log = logging.getLogger("realtime.piper")

FIRST_WINDOW = 8  # latent frames (256 samples each): ~93 ms at 22.05 kHz
MIN_WINDOW = 32  # ~370 ms: context overhead (2 x 11 frames) stays under 70 %
MAX_WINDOW = 64  # ~740 ms
MAX_UTTS_AHEAD = 4  # sentences synthesized but not yet vocoded, per stream
HEAD_FRAMES = 3 * FIRST_WINDOW  # a sentence's first two windows (8 + 16 frames): its flow's first part
# The split costs 2 x the flow's context (64 frames) more flow work, so it is made only where the
# player holds less audio than a long sentence's whole flow plus its first window take (2-core CPU:
# ~30 + ~15 ms), with a margin.
HEAD_BELOW_S = 0.15


@dataclass(eq=False)
class Utterance:
    z: torch.Tensor  # [1, C, F] on the codec device; frames [0, made) are final
    next_frame: int = 0
    ready: torch.cuda.Event | None = None  # CUDA: z is complete once this event has fired
    made: int = -1  # frames of z made so far (-1: all of them; less while the flow's rest runs)

    def __post_init__(self) -> None:
        if self.made < 0:
            self.made = self.frames

    def vocodable(self, start: int, voice: PiperVoice) -> int:
        """How far a window starting at ``start`` may reach with the frames made so far."""
        return voice.window_reach(self.frames, start, self.made)

    def wait(self) -> None:
        """Make the codec worker's stream wait for the generator's stream (no host sync)."""
        if self.ready is not None:
            torch.cuda.current_stream(self.z.device).wait_event(self.ready)
            self.ready = None

    @property
    def frames(self) -> int:
        return int(self.z.shape[-1])


@dataclass
class PiperState:
    utts: deque[Utterance] = field(default_factory=deque)
    inflight: int = 0  # segments popped by the generator but not yet turned into latents
    generator: torch.Generator | None = None
    windows: int = 0

    def busy(self) -> bool:
        return bool(self.utts) or self.inflight > 0


class PiperGenerateLane(Lane):
    name = "piper.generate"
    worker = "generator"
    max_batch = 1  # one segment per step keeps steps short, so deadlines stay responsive

    def __init__(self, backend: "PiperBackend") -> None:
        super().__init__()
        self.b = backend

    def is_ready(self, job: TTSJob) -> bool:  # type: ignore[override]
        st: PiperState = job.engine_state
        return job.has_text() and len(st.utts) < MAX_UTTS_AHEAD and job.can_produce(time.monotonic())

    def run(self, jobs: list[TTSJob]) -> None:  # type: ignore[override]
        for job in jobs:
            t0 = time.perf_counter()
            st: PiperState = job.engine_state
            seg = job.take_segment()
            if seg is None:
                continue

            def publish(utt: Utterance, grown: bool = False, job: TTSJob = job, st: PiperState = st) -> None:
                if not grown:
                    with job.lock:
                        st.utts.append(utt)
                # the codec worker decodes the new frames now, not on its idle recheck
                self.wake(PiperVocodeLane.worker)

            with job.lock:  # nothing queued for the vocoder and the player near its end: audio is due now
                head = not st.utts and job.ahead_s(time.monotonic()) < HEAD_BELOW_S
            try:
                utts = self.b.synthesize_latents(seg, job.params, st.generator, publish=publish, head=head,
                                                 count=job.count_input)
            finally:
                with job.lock:
                    st.inflight -= 1
            job.compute_s += time.perf_counter() - t0
            if not utts:
                job.finish_spurt()


class PiperVocodeLane(Lane):
    name = "piper.vocode"
    worker = "codec"
    max_batch = 8

    def __init__(self, backend: "PiperBackend") -> None:
        super().__init__()
        self.b = backend

    def is_ready(self, job: TTSJob) -> bool:  # type: ignore[override]
        st: PiperState = job.engine_state
        if not st.utts:
            return False
        utt = st.utts[0]
        return (utt.vocodable(utt.next_frame, self.b.vocoder) > utt.next_frame
                and job.can_produce(time.monotonic()))

    def run(self, jobs: list[TTSJob]) -> None:  # type: ignore[override]
        t0 = time.perf_counter()
        now = time.monotonic()
        items = []
        for job in jobs:
            st: PiperState = job.engine_state
            utt = st.utts[0]
            # A window may hold as much audio as the client already has buffered: at RTF < 1 it is
            # then ready before the buffer runs dry. Each window costs 2*context extra frames, so
            # bigger is cheaper per sample; the first one is small for a quick first chunk.
            # Sizes are powers of two so windows of different streams batch together. Only a
            # stream's first windows are small (each must be ready before the one before it has
            # played); later small windows would spend most of their time on context
            # (2 x 11 frames), which under load starves everyone.
            buffered = int(job.ahead_s(now) * self.b.native_rate / self.b.voice.hop)
            size = min(MIN_WINDOW, FIRST_WINDOW << st.windows)  # 8, 16, then at least 32
            while size * 2 <= min(MAX_WINDOW, buffered):
                size *= 2
            end = min(utt.vocodable(utt.next_frame, self.b.vocoder), utt.next_frame + size)
            items.append((job, utt, utt.next_frame, end))
        for _, utt, _, _ in items:
            utt.wait()
        pcms = self.b.vocode_batch([(u.z, s, e) for _, u, s, e in items])
        share = (time.perf_counter() - t0) / len(items)
        for (job, utt, start, end), pcm in zip(items, pcms, strict=True):
            st = job.engine_state
            job.compute_s += share
            job.emit_pcm(pcm.reshape(-1).float().cpu().numpy(), frames=end - start)
            utt.next_frame = end
            st.windows += 1
            if end >= utt.frames:
                with job.lock:
                    held = len(st.utts) >= MAX_UTTS_AHEAD
                    st.utts.popleft()
                if held:
                    self.wake(PiperGenerateLane.worker)  # room for the next segment's latents
                job.finish_spurt()


class PiperBackend(TTSBackend):
    """The embedded Piper voice (or any Piper .onnx voice) served through the scheduler."""

    default_chunk_ms = 40

    def __init__(self, onnx_path: str | None = None, generator_device: str = "cpu",
                 codec_device: str = "cpu", dtype: torch.dtype = torch.float32) -> None:
        from realtime.engines.vits import PiperVoice

        t0 = time.perf_counter()
        self.voice = PiperVoice.load(onnx_path, device=generator_device, dtype=dtype)
        # The vocoder stage lives on its own device; on one device both stages share the weights.
        self.vocoder = (self.voice if codec_device == generator_device
                        else PiperVoice.load(onnx_path, device=codec_device, dtype=dtype))
        self.codec_device = codec_device
        self.native_rate = self.voice.sample_rate
        self.name = f"piper-{self.voice.name}"
        self.voices = (self.voice.name,)
        log.info("loaded Piper voice %s (%d Hz) in %.2fs", self.voice.name, self.native_rate,
                 time.perf_counter() - t0)

    def lanes(self) -> list[Lane]:
        return [PiperGenerateLane(self), PiperVocodeLane(self)]

    def prepare(self, job: TTSJob) -> None:
        gen = None
        if job.params.seed is not None:
            gen = torch.Generator(device="cpu").manual_seed(job.params.seed)
        job.engine_state = PiperState(generator=gen)

    def check(self, params: StartParams) -> None:
        super().check(params)
        if params.reference_audio is not None:
            from realtime.errors import UnsupportedError

            raise UnsupportedError("the Piper voice does not take reference audio; serve a CSM model for that")

    def synthesize_latents(self, text: str, params: StartParams, generator: torch.Generator | None,
                           publish: Callable[..., None] | None = None, head: bool = False,
                           count: Callable[[int], None] | None = None) -> list[Utterance]:
        """Latent frames for each sentence of ``text``. ``publish(utt)`` (if given) is called as
        soon as an utterance's first frames are made, and ``publish(utt, grown=True)`` once the rest
        are. With ``head`` (and generator and codec on the CPU), a first sentence longer than its
        first two windows need runs its flow in two parts: the frames those windows read
        (HEAD_FRAMES + 2 x the vocoder's context), published at once, then the rest."""
        voice = self.voice
        first = HEAD_FRAMES + 2 * self.vocoder.vocoder_context  # the frames the first two windows read
        out = []
        for phonemes in voice.phonemize(text):
            ids = voice.phoneme_ids(phonemes)
            if len(ids) <= 3:  # ^ _ $ only: nothing to say
                continue
            if count is not None:  # (the phoneme ids the model reads: a speech reply's input tokens)
                count(len(ids))
            x = torch.tensor([ids], dtype=torch.long, device=voice.device)
            z_p = voice.prior(x, length_scale=voice.config.length_scale / params.speed, generator=generator)
            if (head and not out and publish is not None and voice.device.type == "cpu"
                    and self.vocoder.device.type == "cpu" and z_p.shape[2] > first + voice.flow_context):
                with torch.inference_mode():
                    z = torch.empty_like(z_p)
                    z[:, :, :first] = voice.flow(z_p, 0, first)
                    utt = Utterance(z, made=first)
                    publish(utt)
                    z[:, :, first:] = voice.flow(z_p, first)
                utt.made = utt.frames  # after the frames are written: the codec worker reads up to made
                publish(utt, grown=True)
                out.append(utt)
                continue
            z = voice.flow(z_p).to(self.codec_device, non_blocking=True)
            ready = None
            if z.is_cuda:  # the codec lane runs on another CUDA stream: hand over with an event
                ready = torch.cuda.Event()
                ready.record()
            out.append(Utterance(z, ready=ready))
            if publish is not None:
                publish(out[-1])
        return out

    def vocode_batch(self, items: list[tuple[torch.Tensor, int, int]]) -> list[torch.Tensor]:
        return self.vocoder.vocode_batch(items)

    def warmup(self) -> None:
        """One utterance through both stages, then the vocoder lane's window shapes of one stream
        (the first window from the start edge, FIRST_WINDOW's doublings and MAX_WINDOW with
        context on both sides; one decoder call a size), on its latent repeated to be long enough.
        On the CPU the conv library builds its kernels for each new shape on first use, which
        cost a cold server's first stream ~30 ms of its first window and ~35-50 ms of each larger
        one (2-core VM). The generator's convs are small enough that PyTorch runs them on its own
        path, which builds nothing per shape: a split flow's first part took as long after this
        warm-up as without it (``bench/piper_cold.py``), so it is not warmed."""
        t0 = time.perf_counter()
        params = StartParams(voice=None, format="pcm_f32le", sample_rate=self.native_rate, chunk_ms=None)
        (utt,) = self.synthesize_latents("Warming up.", params, None)
        ctx = self.vocoder.vocoder_context
        z = torch.cat([utt.z] * -(-(MAX_WINDOW + 2 * ctx) // utt.frames), dim=2)
        sizes = sorted({FIRST_WINDOW << k for k in range(8) if FIRST_WINDOW << k <= MAX_WINDOW} | {MIN_WINDOW, MAX_WINDOW})
        self.vocode_batch([(z, 0, FIRST_WINDOW)] + [(z, ctx, ctx + n) for n in sizes])
        log.info("warmed up Piper in %.2fs", time.perf_counter() - t0)
