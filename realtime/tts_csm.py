"""CSM-1B on the scheduler: a batched frame generator and a batched streaming Mimi decoder.

GENERATOR lane ``csm.frame`` (worker "generator"): for every ready stream, prefill its cache slot
when it starts a new text segment, then ONE batched step for all of them → codes [B, K] (one audio
frame each). CODEC lane ``mimi.decode`` (worker "codec"): one frame per ready stream through the
streaming Mimi decoder, batched over slots → 1920 samples at 24 kHz each. The two lanes meet in a
per-stream bounded queue of codes (host tensors: a few hundred bytes a frame), so the decoder of
frame n overlaps the generator of frame n+1 and PCM never crosses the host twice.

Each text segment is one CSM utterance. The voice reference (``start.reference``) and the last
spoken segment are passed as context turns, so the voice stays the same across segments.
"""

from __future__ import annotations

import io
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from realtime.errors import OverloadedError, RealtimeError, UnsupportedError
from realtime.protocol.tts import StartParams
from realtime.scheduler import Job, Lane
from realtime.tts import OUTPUT_RESERVE, TTSBackend, TTSJob, emit_pcm_rows

if TYPE_CHECKING:
    from realtime.engines.csm import CSMPrompt

log = logging.getLogger("realtime.csm")

MAX_CODES_AHEAD = 64  # frames generated but not yet decoded, per stream (~5 s)
MAX_FRAMES_PER_CHAR = 2.0  # 12.5 frames/s: a generous cap on runaway utterances (~6 chars/s speech)
MIN_FRAMES = 25


@dataclass
class CSMState:
    slot: int
    seed: int
    temperature: float
    top_k: int
    codes: deque = field(default_factory=deque)  # host int64 [K] frames (numpy) for the codec; None = utterance end
    generating: bool = False  # a segment is prefilled and its frames are being produced
    segment: str | None = None
    frames_in_segment: int = 0
    max_frames: int = 0
    inflight: int = 0  # a segment being prefilled or a frame being decoded: work not visible in the queues
    ref_codes: torch.Tensor | None = None  # [F, K] of the voice reference, encoded once per session
    last_turn: tuple[str, list] | None = None  # previous segment and its frames, as context
    frames_log: list = field(default_factory=list)
    all_frames: list | None = None  # every frame of the session ([K] each) when the backend keeps codes
    decoded: int = 0

    def busy(self) -> bool:
        return self.generating or bool(self.codes) or self.inflight > 0


class SlotPool:
    """Fixed cache slots shared by the generator (KV cache) and the codec (decoder state)."""

    def __init__(self, n: int) -> None:
        self.free = list(range(n))[::-1]
        self.lock = threading.Lock()
        self.dirty: set[int] = set()  # slots whose decoder state the codec worker must reset

    def take(self) -> int:
        with self.lock:
            if not self.free:
                raise OverloadedError("all speech slots are in use; try again shortly")
            slot = self.free.pop()
            self.dirty.add(slot)
            return slot

    def give(self, slot: int) -> None:
        with self.lock:
            self.free.append(slot)


class _CSMLane(Lane):
    """A lane of the CSM backend: one batch may hold every slot."""

    def __init__(self, backend: "CSMBackend") -> None:
        super().__init__()
        self.b = backend
        self.max_batch = backend.n_slots


class CSMFrameLane(_CSMLane):
    name = "csm.frame"
    worker = "generator"

    def is_ready(self, job: TTSJob) -> bool:  # type: ignore[override]
        st: CSMState = job.engine_state
        if not (st.generating or job.segments) or len(st.codes) >= MAX_CODES_AHEAD:
            return False
        return job.can_produce(time.monotonic())

    def run(self, jobs: list[TTSJob]) -> None:  # type: ignore[override]
        b = self.b
        t0 = time.perf_counter()
        stepping: list[TTSJob] = []
        starting: list[tuple[TTSJob, str, CSMPrompt]] = []  # streams beginning a text segment
        for job in jobs:
            st: CSMState = job.engine_state
            if st.generating:
                stepping.append(job)
                continue
            seg = job.take_segment()
            if seg is None:
                continue
            try:
                prompt = self._prompt(job, st, seg)
            except RealtimeError as exc:  # this stream's input: fail it alone, not its batch mates
                with job.lock:
                    st.inflight -= 1
                job.fail(exc)
                continue
            starting.append((job, seg, prompt))
        try:
            # One batched (graphed, on CUDA) prefill per group instead of one eager pass per stream:
            # a burst of new streams no longer queues behind each other's prefills.
            for i in range(0, len(starting), b.prefill_batch):
                group = starting[i:i + b.prefill_batch]
                b.prefill([j.engine_state.slot for j, _, _ in group], [p for _, _, p in group])
            for job, seg, prompt in starting:
                self._begin(job.engine_state, seg, prompt)
                stepping.append(job)
        finally:
            for job, _, _ in starting:
                with job.lock:
                    job.engine_state.inflight -= 1
        if not stepping:
            return
        slots = torch.tensor([j.engine_state.slot for j in stepping], dtype=torch.long)
        temp = torch.tensor([j.engine_state.temperature for j in stepping], dtype=torch.float32)
        top_k = torch.tensor([j.engine_state.top_k for j in stepping], dtype=torch.long)
        seeds = torch.tensor([j.engine_state.seed for j in stepping], dtype=torch.long)
        codes = b.frame_step(slots, temp, top_k, seeds)  # [B, K] on the host: the one sync per frame
        eos = b.csm.is_eos(codes).tolist()
        rows = codes.numpy()  # numpy row views: cheaper to hold and stack per stream than tensors
        share = (time.perf_counter() - t0) / len(stepping)
        limit = b.state.max_seq_len - 2
        lengths = b.state.lengths
        for job, frame, end in zip(stepping, rows, eos, strict=True):
            st = job.engine_state
            job.compute_s += share
            st.frames_in_segment += 1
            over = end or lengths[st.slot] >= limit or st.frames_in_segment >= st.max_frames
            with job.lock:
                if not end:
                    st.codes.append(frame)
                    st.frames_log.append(frame)
                    if st.all_frames is not None:
                        st.all_frames.append(frame)
                if over:
                    st.generating = False
                    st.codes.append(None)  # utterance boundary for the codec lane
        self.wake(MimiDecodeLane.worker)  # the new frames: decode them now

    def _prompt(self, job: TTSJob, st: CSMState, seg: str) -> "CSMPrompt":
        """The backbone prompt of a new segment: [voice reference turn] [last segment] segment."""
        b = self.b
        if job.params.reference_audio is not None and st.ref_codes is None:
            st.ref_codes = b.encode_reference(job.params.reference_audio)
        context = []
        if st.ref_codes is not None:
            context.append((job.params.speaker, job.params.reference_text or "", st.ref_codes))
        if st.last_turn is not None and st.last_turn[1]:
            context.append((job.params.speaker, st.last_turn[0], torch.from_numpy(np.stack(st.last_turn[1]))))
        prompt = b.csm.build_prompt(seg, job.params.speaker, context)
        if self._room(prompt) < MIN_FRAMES and context:
            prompt = b.csm.build_prompt(seg, job.params.speaker, context[:1])  # drop the history
        if self._room(prompt) < 1:
            raise UnsupportedError("the text segment does not fit the model's context")
        job.count_input(len(prompt))
        return prompt

    def _room(self, prompt: "CSMPrompt") -> int:
        """Frames the slot's cache holds after this prompt."""
        return self.b.state.max_seq_len - len(prompt) - 1

    def _begin(self, st: CSMState, seg: str, prompt: "CSMPrompt") -> None:
        """The segment's prompt is in the slot: frames may follow."""
        room = self._room(prompt)
        st.generating = True
        st.segment = seg
        st.frames_in_segment = 0
        st.max_frames = min(room, max(MIN_FRAMES, int(len(seg) * MAX_FRAMES_PER_CHAR)))
        st.last_turn = (seg, [])  # filled as frames come, used as context by the next segment
        st.frames_log = st.last_turn[1]


class MimiDecodeLane(_CSMLane):
    name = "mimi.decode"
    worker = "codec"

    def is_ready(self, job: TTSJob) -> bool:  # type: ignore[override]
        st: CSMState = job.engine_state
        return bool(st.codes) and job.output.has_room(OUTPUT_RESERVE)

    def run(self, jobs: list[TTSJob]) -> None:  # type: ignore[override]
        b = self.b
        t0 = time.perf_counter()
        b.reset_dirty_slots()
        decode: list[TTSJob] = []
        frames: list[np.ndarray] = []
        generator_held = False  # a stream's code queue was full: the generator waits for this step
        for job in jobs:
            st: CSMState = job.engine_state
            with job.lock:
                generator_held |= len(st.codes) >= MAX_CODES_AHEAD
                item = st.codes.popleft() if st.codes else None
                if item is not None:
                    st.inflight += 1  # until emitted: a stop() meanwhile must not end the stream early
            if item is None:
                job.finish_spurt()
                continue
            decode.append(job)
            frames.append(item)
        if decode:
            try:
                slots = torch.tensor([j.engine_state.slot for j in decode], dtype=torch.long)
                codes = torch.from_numpy(np.stack(frames))[:, :, None]  # [B, K, 1]
                pcm = b.pcm_to_host(b.decode_slots(slots, codes))  # [B, 1920]
                share = (time.perf_counter() - t0) / len(decode)
                for job in decode:
                    job.compute_s += share
                    job.engine_state.decoded += 1
                emit_pcm_rows(decode, pcm, frames=1)
            finally:
                for job in decode:
                    with job.lock:
                        job.engine_state.inflight -= 1
        if generator_held:
            self.wake(CSMFrameLane.worker)
        for job in jobs:  # an utterance may end right after its last frame
            st = job.engine_state
            if st.codes and st.codes[0] is None and not st.generating:
                with job.lock:
                    st.codes.popleft()
                job.finish_spurt()

    def release(self, job: Job) -> None:
        self.b.pool.give(job.engine_state.slot)  # type: ignore[attr-defined]


class CSMBackend(TTSBackend):
    """A CSM checkpoint folder (HF layout, Mimi weights under codec_model.*) on the scheduler."""

    default_chunk_ms = 80  # one Mimi frame

    def __init__(self, path: str, generator_device: str = "cpu", codec_device: str = "cpu",
                 dtype: torch.dtype = torch.float32, n_slots: int = 16, max_seq_len: int = 2048,
                 cuda_graphs: bool | None = None) -> None:
        from realtime.codecs.mimi import Mimi
        from realtime.engines.csm import CSM

        t0 = time.perf_counter()
        self.csm = CSM.from_pretrained(path, device=generator_device, dtype=dtype)
        log.info("loaded CSM backbone+depth from %s in %.1fs", path, time.perf_counter() - t0)
        self.mimi = Mimi.from_pretrained(path, device=codec_device, dtype=dtype,
                                         num_codebooks=self.csm.num_codebooks)
        log.info("loaded Mimi (%d codebooks) in %.1fs", self.mimi.num_codebooks, time.perf_counter() - t0)
        self.n_slots = n_slots
        self.state = self.csm.new_batch(n_slots, min(max_seq_len, self.csm.config.backbone.max_seq_len))
        # The state's extra scratch row (no session owns it) pads CUDA-graph batches; the decoder
        # gets the same extra row.
        self.scratch = self.state.scratch
        self.decoder = self.mimi.streaming_decoder(n_slots + 1)
        self.pool = SlotPool(n_slots)
        on_cuda = str(generator_device).startswith("cuda") and str(codec_device).startswith("cuda")
        self.cuda_graphs = on_cuda if cuda_graphs is None else (cuda_graphs and on_cuda)
        self.step_graphs = self.decode_graphs = self.prefill_graphs = None
        self.prefill_batch = 16  # streams prefilled together (the largest prefill graph's batch)
        self.native_rate = int(self.mimi.sample_rate)
        self.codebook_size = int(self.mimi.cfg.codebook_size)
        self.name = "csm"
        self.voices = ()
        self.codec_device = codec_device
        self.last_job: TTSJob | None = None
        self.keep_codes = False  # keep every stream's frames for last_codes (`realtime say --save-codes`)
        self._host_pcm: torch.Tensor | None = None  # pinned decoder output on the host (CUDA codec)

    def lanes(self) -> list[Lane]:
        return [CSMFrameLane(self), MimiDecodeLane(self)]

    def describe(self) -> dict:
        d = super().describe()
        d.update({"codebooks": self.csm.num_codebooks, "frame_rate": self.csm.frame_rate,
                  "reference_audio": True})
        return d

    def check(self, params: StartParams) -> None:
        if params.voice not in (None, "default"):
            raise UnsupportedError("CSM takes a voice reference ('reference' in start), not a voice name")
        if params.speed != 1.0:
            raise UnsupportedError("CSM does not support speed")
        if self.csm.tokenizer is None:
            raise UnsupportedError("this CSM checkpoint has no tokenizer.json; it cannot speak text")

    def prepare(self, job: TTSJob) -> None:
        seed = job.params.seed if job.params.seed is not None else int(torch.randint(0, 2**31 - 1, ()).item())
        temp = 0.9 if job.params.temperature is None else job.params.temperature
        job.engine_state = CSMState(slot=-1, seed=seed, temperature=temp, top_k=50,
                                    all_frames=[] if self.keep_codes else None)
        self.last_job = job

    def submit(self, scheduler, job: TTSJob) -> TTSJob:  # noqa: ANN001
        job.engine_state.slot = self.pool.take()
        try:
            super().submit(scheduler, job)
        except Exception:
            self.pool.give(job.engine_state.slot)
            raise
        return job

    def frame_step(self, slots: torch.Tensor, temp: torch.Tensor, top_k: torch.Tensor,
                   seeds: torch.Tensor) -> torch.Tensor:
        """One CSM frame for host tensors of B slots → host codes [B, K]. Graphed, the codes come
        back while the backbone step that feeds the frame back is still running (the codec's stream
        can start on them at once)."""
        if self.step_graphs is None:
            return self.csm.step(self.state, slots, temp, top_k, seeds).cpu()
        return self.step_graphs(slots, temp, top_k, seeds, to_host=True)

    def prefill(self, slots: list[int], prompts: list["CSMPrompt"]) -> None:
        """Prompts into their slots in one batched pass (a CUDA graph when a bucket holds them)."""
        self.csm.prefill_many(self.state, slots, prompts, graphs=self.prefill_graphs)

    def reset_dirty_slots(self) -> None:
        with self.pool.lock:
            dirty, self.pool.dirty = self.pool.dirty, set()
        if dirty:
            mask = torch.zeros(self.n_slots + 1, dtype=torch.bool)  # + the scratch row
            mask[list(dirty)] = True
            self.decoder.reset(mask.to(self.codec_device))

    def decode_slots(self, slots: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        """One streaming decoder step for the given slots only: slots [B], codes [B, K, 1] (host
        tensors) → float32 PCM [B, 1, 1920] on the codec device.

        Graphed: slots and codes are packed on the host into one pinned [1 + K, bucket] buffer
        (slots first, so the kernels read them as one contiguous row; padding columns point at the
        scratch slot) and reach the graph's input in one copy."""
        # The generator's vocabulary has a few non-audio ids above the codec's codebook (pad and
        # friends); a trained model never emits them mid-speech, random weights can. Clamp so a
        # stray id is a click, not a device-side assert.
        if self.decode_graphs is not None and codes.shape[1] == self.csm.num_codebooks:
            n = len(slots)
            host = self._dec_host[self.decode_graphs.bucket(n)]
            self._dec_copied.synchronize()  # the previous call's copy has left the pinned buffer
            h = host.numpy()
            h[0] = self.scratch
            h[0, :n] = slots.cpu().numpy()
            h[1:, n:] = 0
            np.clip(codes.cpu().reshape(n, -1).numpy().T, 0, self.codebook_size - 1, out=h[1:, :n])

            def fill(inp: list[torch.Tensor]) -> None:
                inp[0].copy_(host, non_blocking=True)
                self._dec_copied.record(torch.cuda.current_stream(inp[0].device))

            return self.decode_graphs.run(n, fill)[:n]
        codes = codes.clamp(0, self.codebook_size - 1).to(self.codec_device, non_blocking=True)
        return self._decode_subset(slots.to(self.codec_device), codes).float()

    def pcm_to_host(self, pcm: torch.Tensor) -> np.ndarray:
        """Decoder output [B, 1, N] → float32 [B, N] on the host, one copy for the batch. On CUDA the
        copy goes into a reused pinned buffer (the array is valid until the next call: the codec
        worker packs it into chunks before its next step)."""
        pcm = pcm.reshape(pcm.shape[0], -1).float()
        if pcm.device.type != "cuda":
            return pcm.numpy()
        n, t = pcm.shape
        if self._host_pcm is None or self._host_pcm.shape[1] != t:
            self._host_pcm = torch.empty(self.n_slots + 1, t, dtype=torch.float32, pin_memory=True)
        out = self._host_pcm[:n]
        out.copy_(pcm, non_blocking=True)
        torch.cuda.current_stream(pcm.device).synchronize()
        return out.numpy()

    def _decode_subset(self, idx: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        """The slots' decoder step: their state gathered, stepped and written back (graph-capturable)."""
        return self.decoder.step(codes, slots=idx)

    def _decode_packed(self, packed: torch.Tensor) -> torch.Tensor:
        """The graphed decode: packed [1 + K, B] = slots, then codes -> float32 PCM [B, 1, 1920]."""
        return self._decode_subset(packed[0], packed[1:].t()[:, :, None]).float()

    def encode_reference(self, wav: bytes) -> torch.Tensor:
        """A WAV file's bytes → Mimi codes [F, K] (mono, resampled to 24 kHz)."""
        import soundfile as sf

        from realtime.codecs.resample import resample

        try:
            audio, rate = sf.read(io.BytesIO(wav), dtype="float32", always_2d=True)
        except Exception:
            raise UnsupportedError("reference audio must be a WAV (or FLAC/OGG) file") from None
        mono = audio.mean(axis=1)
        if len(mono) < rate // 4 or len(mono) > rate * 60:
            raise UnsupportedError("reference audio must be between 0.25 and 60 seconds")
        x = resample(mono, int(rate), self.native_rate)
        t = torch.from_numpy(x)[None, None].to(self.codec_device, self.mimi_dtype)
        with torch.no_grad():
            codes = self.mimi.encode(t)[0]  # [K, F]
        return codes.t().cpu()

    @property
    def last_codes(self) -> np.ndarray | None:
        """Codes [frames, K] of the most recent stream (for ``realtime say --save-codes``)."""
        if self.last_job is None or not self.last_job.engine_state.all_frames:
            return None
        return np.stack(self.last_job.engine_state.all_frames)

    @property
    def mimi_dtype(self) -> torch.dtype:
        return next(self.mimi.parameters()).dtype

    def capture_graphs(self) -> None:
        from realtime.cuda_graphs import BucketGraphs, buckets_up_to

        cdev = self.codec_device
        k = self.csm.num_codebooks
        buckets = buckets_up_to(self.n_slots)
        t0 = time.perf_counter()
        self.step_graphs = self.csm.capture_step(self.state, sizes=buckets)
        log.info("captured csm.step for batches %s in %.1fs", buckets, time.perf_counter() - t0)
        t0 = time.perf_counter()
        self.prefill_graphs = self.csm.capture_prefill(self.state, batches=[n for n in (1, 4, 16) if n <= self.n_slots] or [1])
        self.prefill_batch = self.prefill_graphs.batches[-1]
        log.info("captured csm.prefill for batches %s x lengths %s in %.1fs", self.prefill_graphs.batches,
                 self.prefill_graphs.lengths, time.perf_counter() - t0)

        def dec_inputs(b: int) -> list[torch.Tensor]:
            packed = torch.zeros(1 + k, b, dtype=torch.long, device=cdev)
            packed[0] = self.scratch
            return [packed]

        self.decode_graphs = BucketGraphs("mimi.decode", self._decode_packed, dec_inputs, buckets)
        self.decode_graphs.capture()
        # decode_slots' pinned staging buffer per bucket, and the event of its last copy out
        self._dec_host = {b: torch.zeros(1 + k, b, dtype=torch.long, pin_memory=True) for b in buckets}
        with torch.cuda.device(cdev):
            self._dec_copied = torch.cuda.Event()

    def warmup(self) -> None:
        t0 = time.perf_counter()
        if self.cuda_graphs and self.step_graphs is None:
            self.capture_graphs()
        slot = self.pool.take()
        try:
            self.prefill([slot], [self.csm.build_prompt("Warm up.", 0)])
            s = torch.tensor([slot])
            codes = self.csm.step(self.state, s, torch.tensor([0.0]), torch.tensor([50]), torch.tensor([0]))
            self.decode_slots(s, codes.cpu()[:, :, None])
        finally:
            self.pool.give(slot)
        log.info("warmed up CSM + Mimi in %.2fs", time.perf_counter() - t0)
