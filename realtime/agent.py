"""The full-duplex voice agent pipeline: one ``AgentSession`` per connection, transport-neutral.

Audio in (any of our wire formats and rates) → resampled to 16 kHz → one live ASR job (Silero VAD
+ Whisper on the scheduler). The VAD's end of speech and the ASR final that follows end the user's
turn: the conversation history (system prompt + bounded turns) goes to the text service, and the
LLM's deltas stream into one TTS job as they arrive (the TTS segmenter cuts at clauses, so the
first clause is spoken while the LLM still writes the rest). TTS chunks go out as
``ResponseAudio`` events in the client's output format.

Barge-in: an ASR ``speech_started`` while the agent speaks (``interrupt_response``) cancels the
text and TTS jobs at once, tells the transport to drop buffered audio (``PlaybackInterrupted``)
and keeps in the history only what the caller could have heard: the simulated player position
(audio sent minus what a real-time player could not yet have played), mapped to characters of
the reply. A transport that learns the real position (OpenAI ``conversation.item.truncate``,
Twilio mark echoes) corrects it with ``truncate`` / ``playback_reached_end``.

The transports (realtime/agent_service.py: OpenAI Realtime, Twilio Media Streams) read the
session's events from ``next_events()`` and translate them to their wire format.

Metrics per turn (in ``ResponseFinished.metrics`` and ``AgentSession.turns``): ``turn_latency_ms``
(end of user speech → first agent audio sent: the number users feel, including the VAD's
silence wait), ``asr_final_ms`` (end of speech → final transcript), ``llm_ttft_ms``,
``tts_ttfa_ms`` (first text into TTS → first audio), underruns of the simulated player.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
import uuid
from collections import deque
from dataclasses import dataclass, field, replace
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from realtime.codecs.resample import StreamResampler, unpack_pcm
from realtime.errors import InternalError, ProtocolError, RealtimeError
from realtime.protocol.player import GapTracker
from realtime.protocol.tts import StartParams
from realtime.scheduler import JobState

if TYPE_CHECKING:
    from realtime.asr_service import ASRJob, ASRService
    from realtime.metrics import Metrics
    from realtime.scheduler import Scheduler
    from realtime.text_service import TextJob, TextService
    from realtime.tts import TTSBackend, TTSJob

log = logging.getLogger("realtime.agent")

ASR_RATE = 16000
DEFAULT_INSTRUCTIONS = ("You are a friendly voice assistant on a phone call. Answer in one or two short, "
                        "plain sentences without lists or markup.")
MAX_TURNS_KEPT = 200  # per-turn metrics kept on a session
COMMIT_TIMEOUT_S = 15.0
PREEMPT_FREE_SLOTS = 2  # a preemptive reply starts only while the text service has this many slots free
DEFAULT_CHARS_PER_MS = 0.015  # ~15 characters a second: English at a conversational pace


@dataclass(frozen=True)
class AgentConfig:
    instructions: str = DEFAULT_INSTRUCTIONS
    voice: str | None = None
    max_tokens: int = 96  # per reply (a reply is spoken: long ones only delay the next turn)
    temperature: float = 0.7
    top_p: float = 0.9
    seed: int | None = None
    in_format: str = "pcm_s16le"
    in_rate: int = 24000
    out_format: str = "pcm_s16le"
    out_rate: int = 24000
    chunk_ms: int = 40  # output audio per ResponseAudio event
    turn_detection: bool = True  # server VAD ends turns (False: the client commits)
    create_response: bool = True  # reply automatically at the end of a turn
    interrupt_response: bool = True  # barge-in cancels the reply
    silence_duration_ms: int = 500  # end-of-turn silence; values above the ASR VAD's add a wait
    interim_transcripts: bool = False  # ASR partials as transcript deltas (costs decodes)
    asr_prompt: str | None = None  # text before the user's speech in every decode (ASRParams.prompt)
    asr_language: str | None = None  # the user's language (ASRParams.language; None: the model's choice)
    # Start the reply when silence begins, on the ASR's decode made then (the likely final), and
    # hold it until the VAD ends the turn with that transcript; dropped unheard if the user goes
    # on or the final differs. Saves the LLM's first segment + TTS from the turn latency.
    preemptive: bool = True
    max_history_messages: int = 24
    max_history_chars: int = 6000


# ---- events to the transport ----------------------------------------------------------------------

@dataclass(frozen=True)
class UserSpeechStarted:
    item_id: str
    audio_start_ms: int


@dataclass(frozen=True)
class UserSpeechStopped:
    item_id: str
    audio_end_ms: int


@dataclass(frozen=True)
class UserTranscriptDelta:
    item_id: str
    delta: str


@dataclass(frozen=True)
class UserTurn:
    """The user's turn is committed with this transcript (VAD end + ASR final, or a commit)."""

    item_id: str
    transcript: str
    audio_ms: int
    committed_by_client: bool = False


@dataclass(frozen=True)
class ResponseStarted:
    response_id: str
    item_id: str
    voice: str


@dataclass(frozen=True)
class ResponseText:
    response_id: str
    item_id: str
    delta: str


@dataclass(frozen=True)
class ResponseAudio:
    response_id: str
    item_id: str
    data: bytes  # out_format at out_rate
    start_ms: float
    duration_ms: float


@dataclass(frozen=True)
class PlaybackInterrupted:
    """Barge-in: drop the agent audio the client still buffers (Twilio ``clear``)."""

    response_id: str
    played_ms: float
    sent_ms: float


@dataclass(frozen=True)
class ResponseFinished:
    response_id: str
    item_id: str
    status: str  # completed | cancelled | incomplete | failed
    reason: str | None  # turn_detected (barge-in), client_cancelled, max_output_tokens, error
    transcript: str  # the whole reply text generated
    spoken_transcript: str  # what the caller heard (cut at the player position on barge-in)
    audio_ms: float
    prompt_tokens: int
    completion_tokens: int
    metrics: dict[str, Any]
    metadata: dict[str, str] | None = None
    conversation: str = "auto"
    # The text the audio sent covers (= spoken_transcript unless cut): a client's truncate at any
    # position it received can only shorten it, so the item it sees never grows afterwards.
    audio_transcript: str = ""


@dataclass(frozen=True)
class AgentError:
    error: RealtimeError


AgentEvent = (UserSpeechStarted | UserSpeechStopped | UserTranscriptDelta | UserTurn | ResponseStarted
              | ResponseText | ResponseAudio | PlaybackInterrupted | ResponseFinished | AgentError)


# ---- conversation --------------------------------------------------------------------------------

class History:
    """System prompt + turns, bounded by message count and characters (oldest dropped first)."""

    def __init__(self, max_messages: int, max_chars: int) -> None:
        self.max_messages = max_messages
        self.max_chars = max_chars
        self.items: list[dict[str, str]] = []  # mutable dicts: truncation edits them in place
        self.ids: list[str | None] = []  # each item's conversation item id (None: none given)
        self.spoken: list[bool] = []  # whether it was speech (an audio item) or text

    def add(self, role: str, content: str, item_id: str | None = None, spoken: bool = False) -> dict[str, str]:
        msg = {"role": role, "content": content}
        self.items.append(msg)
        self.ids.append(item_id)
        self.spoken.append(spoken)
        self._trim()
        return msg

    def _index(self, item_id: str) -> int | None:
        return self.ids.index(item_id) if item_id in self.ids else None

    def get(self, item_id: str) -> tuple[dict[str, str], bool] | None:
        """The held item with this id and whether it was speech (None: not held)."""
        i = self._index(item_id)
        return None if i is None else (self.items[i], self.spoken[i])

    def delete(self, item_id: str) -> tuple[bool, str | None]:
        """Removes the item with this id: (whether it was held, the id of the item before it, or
        None). An item the bounds already dropped is not held."""
        i = self._index(item_id)
        if i is None:
            return False, None
        del self.items[i], self.ids[i], self.spoken[i]
        # (no trim: an assistant item left first stays, for the client; messages() skips it)
        return True, next((x for x in reversed(self.ids[:i]) if x), None)

    def _trim(self) -> None:
        while len(self.items) > self.max_messages or (
                len(self.items) > 1 and sum(len(m["content"]) for m in self.items) > self.max_chars):
            self._drop_first()
        # a chat template wants a user turn first after the system prompt
        while self.items and self.items[0]["role"] == "assistant":
            self._drop_first()

    def _drop_first(self) -> None:
        del self.items[0], self.ids[0], self.spoken[0]

    def messages(self, system: str, extra: tuple[dict[str, str], ...] = ()) -> list[dict[str, str]]:
        msgs = [{"role": "system", "content": system}]
        kept = [m for m in self.items if m["content"].strip()]
        while kept and kept[0]["role"] == "assistant":  # (a chat template wants a user turn first)
            kept.pop(0)
        msgs += [dict(m) for m in kept]
        msgs += [dict(m) for m in extra]
        if len(msgs) == 1:  # nothing said yet (a response.create on an empty conversation)
            msgs.append({"role": "user", "content": "Hello."})
        return msgs


def _item_not_found(item_id: str) -> ProtocolError:
    return ProtocolError(f"no conversation item '{item_id[:40]}' (unknown, or no longer in the kept history)",
                         code="item_not_found")


def _cut_words(text: str, chars: float) -> str:
    """The prefix of ``text`` with about ``chars`` characters, cut back to a word boundary."""
    n = int(chars)
    if n >= len(text):
        return text
    if n <= 0:
        return ""
    cut = text.rfind(" ", 0, n + 1)
    return text[:cut].rstrip() if cut > 0 else ""


def _same_words(a: str, b: str) -> bool:
    def words(t: str) -> list[str]:
        return [w for w in (re.sub(r"[^\w']+", "", x.lower()) for x in t.split()) if w]

    return words(a) == words(b)


@dataclass
class _Response:
    id: str
    item_id: str
    t_turn_end: float | None  # monotonic end of the user's speech (None: text / client-created)
    t_final: float | None
    max_tokens: int
    instructions: str | None = None
    metadata: dict[str, str] | None = None
    conversation: str = "auto"
    extra: tuple[dict[str, str], ...] = ()
    text_job: "TextJob | None" = None
    tts_job: "TTSJob | None" = None
    task: asyncio.Task[None] | None = None
    text: str = ""
    pushed_chars: int = 0
    audio_ms: float = 0.0
    first_audio_at: float | None = None
    tracker: GapTracker = field(default_factory=GapTracker)
    status: str | None = None
    reason: str | None = None
    done_ev: Any = None  # TextDone
    finished: bool = False
    played_all: bool = False  # the client told us its player reached the end (Twilio mark echo)
    history_msg: dict[str, str] | None = None
    # preemptive (started before the turn ended): its events wait in ``held`` until committed
    speculative: bool = False
    held: list[Any] = field(default_factory=list)
    finish_deferred: bool = False
    user_text: str = ""
    started_at: float = 0.0

    def played_ms(self, now: float) -> float:
        if self.played_all:
            return self.audio_ms
        return max(0.0, self.audio_ms - self.tracker.buffered(now) * 1000.0)

    def text_at(self, ms: float, chars_per_ms: float) -> str:
        """The reply text heard by audio position ``ms``. A finished reply's audio covers all its
        text, so the position maps proportionally; a cut one uses the speaking rate
        ``chars_per_ms`` (measured on this session's finished replies), capped at the text the
        LLM produced. An estimate, cut back to a word boundary."""
        text = self.text.strip()
        if self.status in ("completed", "incomplete") and self.audio_ms > 0:
            if ms >= self.audio_ms:
                return text
            return _cut_words(text, len(text) * ms / self.audio_ms)
        return _cut_words(text, min(len(text), ms * chars_per_ms))


class AgentSession:
    """One conversation. Call from the event loop: ``start()``, ``push_audio(bytes)``, …, and read
    ``next_events()``; ``close()`` at the end (cancels every job)."""

    def __init__(self, *, scheduler: "Scheduler", asr: "ASRService", text: "TextService", tts: "TTSBackend",
                 config: AgentConfig | None = None, metrics: "Metrics | None" = None, session: str = "") -> None:
        self.scheduler = scheduler
        self.asr = asr
        self.text = text
        self.tts = tts
        self.cfg = config or AgentConfig()
        self.metrics = metrics
        self.id = session or uuid.uuid4().hex[:16]
        self.history = History(self.cfg.max_history_messages, self.cfg.max_history_chars)
        self.turns: deque[dict[str, Any]] = deque(maxlen=MAX_TURNS_KEPT)
        self._events: asyncio.Queue[AgentEvent] = asyncio.Queue()
        self._asr_job: ASRJob | None = None
        self._asr_task: asyncio.Task[None] | None = None
        self._resampler = StreamResampler(self.cfg.in_rate, ASR_RATE)
        self._in_samples = 0  # 16 kHz samples given to the ASR (stream position)
        self._arrivals: deque[tuple[int, float]] = deque(maxlen=4096)  # (end sample, monotonic)
        self._user_item: str | None = None  # the user item of the utterance in progress
        self._speaking = False  # VAD says the user is speaking
        self._speech_end_t: float | None = None
        self._speech_end_ms = 0
        self._pending_text: list[str] = []  # finals not yet a turn (client-commit mode)
        self._commit_waiter: asyncio.Future[None] | None = None
        self.response: _Response | None = None  # the one reply in flight
        self._spec: _Response | None = None  # a preemptive reply, not yet the turn's (unheard)
        self.spec_stats = {"started": 0, "committed": 0, "dropped": 0}
        self.last_response: _Response | None = None
        self._responses: dict[str, _Response] = {}  # by assistant item id (truncate) and response id
        self._reply_pending = False  # a turn ended while a reply was in flight (no barge-in)
        self._delay_task: asyncio.Task[None] | None = None
        self.closed = False
        self.audio_in_ms = 0.0
        # The transport acknowledges playback (Twilio mark echoes): a reply counts as playing until
        # its ack, whatever the simulated player says.
        self.playback_acks = False
        self.on_turn: Callable[[dict[str, Any]], None] | None = None  # per-turn metrics hook (service)
        self._rate_chars = 0  # speaking rate of finished replies (text_at estimates)
        self._rate_ms = 0.0

    # ---- lifecycle ----
    async def start(self) -> None:
        self._new_asr_job()

    def _new_asr_job(self) -> None:
        from realtime.protocol.asr import ASRParams

        # preview: final_preview / speech_resumed, for preemptive replies
        job = self.asr.new_job(ASRParams(sample_rate=ASR_RATE, format="pcm_f32le", preview=True,
                                         interim=self.cfg.interim_transcripts, prompt=self.cfg.asr_prompt,
                                         language=self.cfg.asr_language), live=True, session=self.id)
        if self.metrics is not None:
            job.on_final = self.metrics.asr_final.observe
        wake = asyncio.Event()
        job.output.bind(asyncio.get_running_loop(), wake)
        self.asr.submit(self.scheduler, job)
        self._asr_job = job
        self._asr_task = asyncio.create_task(self._asr_loop(job, wake), name=f"agent-asr-{self.id}")

    async def close(self) -> None:
        self.closed = True
        await self._drop_spec()
        if self.response is not None:
            await self._cancel_response(self.response, "client_gone", notify=False)
        for t in (self._delay_task, self._asr_task):
            if t is not None and not t.done():
                t.cancel()
                await asyncio.gather(t, return_exceptions=True)
        if self._asr_job is not None and self._asr_job.active:
            self.scheduler.cancel(self._asr_job)

    def configure(self, **changes: Any) -> None:
        """Change settings mid-session (formats apply to the next audio / the next reply)."""
        old = self.cfg
        self.cfg = replace(old, **changes)
        if (self.cfg.in_rate, self.cfg.in_format) != (old.in_rate, old.in_format):
            self._resampler = StreamResampler(self.cfg.in_rate, ASR_RATE)
        self.history.max_messages = self.cfg.max_history_messages
        self.history.max_chars = self.cfg.max_history_chars
        asr = (self.cfg.asr_prompt, self.cfg.asr_language)
        if asr != (old.asr_prompt, old.asr_language) and self._asr_job is not None:
            # (the decode lane reads them at each decode: the next one takes them)
            self._asr_job.params = replace(self._asr_job.params, prompt=asr[0], language=asr[1])

    def emit(self, ev: AgentEvent) -> None:
        self._events.put_nowait(ev)

    async def next_events(self) -> list[AgentEvent]:
        """Wait for at least one event; return all queued (in order)."""
        out = [await self._events.get()]
        while not self._events.empty():
            out.append(self._events.get_nowait())
        return out

    # ---- audio in ----
    def asr_backlog(self) -> bool:
        """True while the ASR inbox is full: the transport should stop reading (back-pressure)."""
        return self._asr_job is not None and self._asr_job.inbox_full() and self._asr_job.active

    def push_audio(self, data: bytes) -> None:
        try:
            x = unpack_pcm(data, self.cfg.in_format)
        except ValueError as exc:
            raise ProtocolError(str(exc), code="bad_audio") from None
        self.push_pcm(x)

    def push_pcm(self, x: np.ndarray) -> None:
        """float32 samples at ``in_rate``."""
        if self._asr_job is None or not len(x):
            return
        y = self._resampler.process(np.asarray(x, np.float32))
        self.audio_in_ms += len(x) * 1000.0 / self.cfg.in_rate
        if len(y):
            self._in_samples += len(y)
            self._arrivals.append((self._in_samples, time.monotonic()))
            self._asr_job.push_audio(y)
            self.scheduler.wake()

    def _arrival(self, ms: int) -> float:
        sample = ms * ASR_RATE // 1000
        for end, t in self._arrivals:
            if end >= sample:
                return t
        return self._arrivals[-1][1] if self._arrivals else time.monotonic()

    def finalize_utterance(self) -> None:
        """End the utterance in progress now (an explicit commit while the server VAD runs)."""
        if self._asr_job is not None:
            self._asr_job.push_finalize()
            self.scheduler.wake()

    async def commit(self) -> str:
        """Client commit (no server VAD): end the utterance now, wait for its final, make it a turn.
        Returns the user item id."""
        job = self._asr_job
        assert job is not None
        item = self._user_item or f"item_{uuid.uuid4().hex[:20]}"
        self._user_item = item
        job.push_finalize()
        self.scheduler.wake()
        t0 = time.monotonic()
        while job.active and (job.inbox or job.utts) and time.monotonic() - t0 < COMMIT_TIMEOUT_S:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0)  # let the ASR loop hand over the last final
        for _ in range(50):
            if not job.output.items:
                break
            await asyncio.sleep(0.01)
        text = " ".join(self._pending_text).strip()
        self._pending_text.clear()
        self._user_item = None
        if text:
            self.history.add("user", text, item, spoken=True)
        self.emit(UserTurn(item, text, int(self.audio_in_ms), committed_by_client=True))
        return item

    async def clear_audio(self) -> None:
        """Drop the audio not yet made into a turn (a fresh ASR stream)."""
        if self._asr_task is not None:
            self._asr_task.cancel()
            await asyncio.gather(self._asr_task, return_exceptions=True)
        await self._drop_spec()
        if self._asr_job is not None and self._asr_job.active:
            self.scheduler.cancel(self._asr_job)
        self._pending_text.clear()
        self._user_item = None
        self._speaking = False
        self._resampler = StreamResampler(self.cfg.in_rate, ASR_RATE)
        self._in_samples = 0
        self._arrivals.clear()
        self._new_asr_job()

    # ---- text in ----
    def add_item(self, role: str, text: str, item_id: str | None = None) -> None:
        self.history.add(role, text, item_id)

    def get_item(self, item_id: str) -> tuple[str, str, bool]:
        """A held conversation item: (role, text, whether it was speech); ProtocolError where none
        has this id (unknown, or no longer in the kept history)."""
        got = self.history.get(item_id)
        if got is None:
            raise _item_not_found(item_id)
        msg, spoken = got
        return msg["role"], msg["content"], spoken

    def delete_item(self, item_id: str) -> str | None:
        """Takes a conversation item out of what the model sees; returns the id of the item before
        it (None: none). ProtocolError where no held item has this id: unknown, already dropped by
        the history's bounds, or the reply still being spoken (cancel it first)."""
        r = self.response
        if r is not None and r.item_id == item_id:
            raise ProtocolError(f"item '{item_id[:40]}' is the response in progress: cancel it first",
                                code="item_in_progress")
        held, before = self.history.delete(item_id)
        if not held:
            raise _item_not_found(item_id)
        return before

    # ---- ASR events ----
    async def _asr_loop(self, job: "ASRJob", wake: asyncio.Event) -> None:
        from realtime.asr_service import END

        try:
            while True:
                items = await job.output.drain(self.scheduler.wake)
                for item in items:
                    if item is END:
                        return
                    await self._on_asr(item)  # type: ignore[arg-type]
                if job.state is JobState.FAILED:
                    err = job.error if isinstance(job.error, RealtimeError) else InternalError("recognition failed")
                    self.emit(AgentError(err))
                    return
                if job.state is JobState.CANCELLED:
                    return
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("agent %s: ASR loop crashed", self.id)
            self.emit(AgentError(InternalError("internal error")))

    async def _on_asr(self, msg: dict[str, Any]) -> None:
        kind = msg.get("type")
        vad = self.cfg.turn_detection
        if kind in ("speech_started", "speech_resumed"):
            await self._drop_spec()  # the user goes on: the previewed turn was not the turn
        if kind == "final_preview":
            self._maybe_speculate(str(msg.get("text", "")).strip())
        elif kind == "speech_started":
            self._speaking = True
            if self._user_item is None:
                self._user_item = f"item_{uuid.uuid4().hex[:20]}"
            if self._delay_task is not None and not self._delay_task.done():
                self._delay_task.cancel()  # the user goes on: not the end of the turn after all
            if vad:
                self.emit(UserSpeechStarted(self._user_item, int(msg.get("at_ms", 0))))
                if self.cfg.interrupt_response:
                    await self.barge_in()
        elif kind == "speech_stopped":
            self._speaking = False
            self._speech_end_ms = int(msg.get("at_ms", 0))
            self._speech_end_t = self._arrival(self._speech_end_ms)
            if vad and self._user_item is not None:
                self.emit(UserSpeechStopped(self._user_item, self._speech_end_ms))
        elif kind == "partial":
            if vad and self._user_item is not None and msg.get("text"):
                self.emit(UserTranscriptDelta(self._user_item, str(msg["text"])))
        elif kind == "final":
            text = str(msg.get("text", "")).strip()
            if not vad:
                if text:
                    self._pending_text.append(text)
                return
            item = self._user_item or f"item_{uuid.uuid4().hex[:20]}"
            self._user_item = None
            if not text:
                await self._drop_spec()
                return  # noise the VAD took for speech: no turn
            t_final = time.monotonic()
            spec = self._spec
            self.history.add("user", text, item, spoken=True)
            self.emit(UserTurn(item, text, self._speech_end_ms))
            if spec is not None:
                if (_same_words(spec.user_text, text) and self.response is None
                        and self._extra_silence_s(t_final) <= 0 and self.cfg.create_response):
                    self._commit_spec(spec, t_final)
                    return
                await self._drop_spec()
            if self.cfg.create_response:
                wait = self._extra_silence_s(t_final)
                if wait > 0:
                    self._delay_task = asyncio.create_task(self._reply_after(wait, t_final))
                else:
                    await self._turn_reply(t_final)

    # ---- preemptive replies ----
    def _maybe_speculate(self, text: str) -> None:
        """The ASR's hypothesis when silence began: start the reply to it now, unheard."""
        cfg = self.cfg
        if not (cfg.preemptive and cfg.turn_detection and cfg.create_response) or not text:
            return
        if self.response is not None or self._reply_pending or self.closed:
            return
        if self.text.free_slots() < PREEMPT_FREE_SLOTS:
            return  # a guess must not hold the slot that another caller's real reply needs
        if cfg.silence_duration_ms > self._asr_silence_ms():
            return  # the turn ends later than the VAD says: a preemptive reply would wait anyway
        if self._spec is not None:
            if _same_words(self._spec.user_text, text):
                return
            self._spec_drop_now()
        r = _Response(id=f"resp_{uuid.uuid4().hex[:20]}", item_id=f"item_{uuid.uuid4().hex[:20]}",
                      t_turn_end=None, t_final=None, max_tokens=cfg.max_tokens,
                      extra=({"role": "user", "content": text},), speculative=True, user_text=text,
                      started_at=time.monotonic())
        self._spec = r
        self.spec_stats["started"] += 1
        r.task = asyncio.create_task(self._run_response(r), name=f"agent-preemptive-{r.id}")

    def _commit_spec(self, r: _Response, t_final: float) -> None:
        """The turn ended as previewed: the preemptive reply becomes the reply; what it has made so
        far goes out now, in order (audio as if it all arrived now)."""
        self._spec = None
        self.spec_stats["committed"] += 1
        r.speculative = False
        for job in (r.text_job, r.tts_job):
            if job is not None:
                job.speculative = False  # wanted now: its own deadline again
        self.scheduler.wake()
        r.extra = ()  # the user message is in the history now (the prompt had it as extra)
        r.t_turn_end, r.t_final = self._speech_end_t, t_final
        self._register(r)
        held, r.held = r.held, []
        for ev in held:
            self._out(r, ev)
        if r.finish_deferred:
            self._finish(r, time.monotonic())

    def _spec_drop_now(self) -> _Response | None:
        """Forget the preemptive reply and cancel its jobs (nothing of it was sent); the task is
        returned for the caller to await."""
        r, self._spec = self._spec, None
        if r is None:
            return None
        self.spec_stats["dropped"] += 1
        r.status, r.reason, r.finished = "cancelled", "preempted", True
        self._cancel_jobs(r)
        if r.task is not None and not r.task.done():
            r.task.cancel()
        return r

    async def _drop_spec(self) -> None:
        r = self._spec_drop_now()
        if r is not None and r.task is not None and r.task is not asyncio.current_task():
            await asyncio.gather(r.task, return_exceptions=True)

    def _out(self, r: _Response, ev: AgentEvent) -> None:
        """A reply's event: held while the reply is preemptive, else sent (audio starts the
        simulated player's clock when it is sent)."""
        if r.speculative:
            r.held.append(ev)
            return
        if isinstance(ev, ResponseAudio):
            now = time.monotonic()
            if r.first_audio_at is None:
                r.first_audio_at = now
            r.tracker.on_chunk(now, ev.duration_ms / 1000.0)
        self.emit(ev)

    def _asr_silence_ms(self) -> int:
        """The silence after which the ASR's VAD ends an utterance (its final)."""
        return getattr(self.asr.cfg, "min_silence_ms", 500)

    def _extra_silence_s(self, now: float) -> float:
        """silence_duration_ms above the ASR VAD's own silence: wait the rest before replying."""
        asr_sil = self._asr_silence_ms()
        extra = (self.cfg.silence_duration_ms - asr_sil) / 1000.0
        if extra <= 0 or self._speech_end_t is None:
            return 0.0
        return max(0.0, self._speech_end_t + asr_sil / 1000.0 + extra - now)

    async def _reply_after(self, wait: float, t_final: float) -> None:
        await asyncio.sleep(wait)
        if not self._speaking:
            await self._turn_reply(t_final)

    async def _turn_reply(self, t_final: float) -> None:
        if self.response is not None:
            self._reply_pending = True  # no barge-in: answer once the current reply is done
            return
        self.create_response(t_turn_end=self._speech_end_t, t_final=t_final)

    # ---- barge-in / truncation ----
    async def barge_in(self) -> None:
        now = time.monotonic()
        r = self.response
        if r is not None:
            await self._cancel_response(r, "turn_detected")
            return
        last = self.last_response
        if last is not None and not last.played_all and (self.playback_acks or last.tracker.buffered(now) > 0.0):
            played = last.played_ms(now)
            self.emit(PlaybackInterrupted(last.id, played, last.audio_ms))
            self._set_spoken(last, last.text_at(played, self.chars_per_ms()))
            last.played_all = True  # the rest is dropped: later barge-ins have nothing to clear
            self._update_turn_metrics(last, played_ms=round(played, 1), interrupted=True)

    def _set_spoken(self, r: _Response, text: str) -> None:
        if r.history_msg is not None:
            r.history_msg["content"] = text

    def chars_per_ms(self) -> float:
        if self._rate_ms >= 1000.0:
            return self._rate_chars / self._rate_ms
        return DEFAULT_CHARS_PER_MS

    def _update_turn_metrics(self, r: _Response, **fields: Any) -> None:
        for t in self.turns:
            if t.get("response_id") == r.id:
                t.update(fields)

    def truncate(self, item_id: str, audio_end_ms: int) -> str:
        """The client played ``audio_end_ms`` of the assistant item: keep only what was heard.
        Returns the truncated transcript. Raises ProtocolError for unknown items / positions."""
        r = self._responses.get(item_id)
        if r is None or r.item_id != item_id:
            raise ProtocolError(f"no assistant audio item '{item_id[:40]}'", code="item_not_found")
        if audio_end_ms > r.audio_ms + 1.0 and r.finished:
            raise ProtocolError(f"audio_end_ms {audio_end_ms} is past the item's audio ({r.audio_ms:.0f} ms)",
                                code="invalid_value")
        text = r.text_at(float(audio_end_ms), self.chars_per_ms())
        self._set_spoken(r, text)
        r.played_all = True  # the client owns the position now
        self._update_turn_metrics(r, played_ms=float(audio_end_ms), spoken_chars=len(text))
        return text

    def playback_reached_end(self, response_id: str) -> None:
        """The client's player reached the end of the reply (e.g. a Twilio mark echo)."""
        r = self._responses.get(response_id)
        if r is not None:
            r.played_all = True

    # ---- responses ----
    def create_response(self, *, t_turn_end: float | None = None, t_final: float | None = None,
                        instructions: str | None = None, max_tokens: int | None = None,
                        metadata: dict[str, str] | None = None, conversation: str = "auto",
                        extra: tuple[dict[str, str], ...] = ()) -> str:
        """Start a reply to the conversation so far; returns its response id. One at a time."""
        if self.response is not None:
            raise ProtocolError("a response is already in progress; cancel it first",
                                code="conversation_already_has_active_response")
        r = _Response(id=f"resp_{uuid.uuid4().hex[:20]}", item_id=f"item_{uuid.uuid4().hex[:20]}",
                      t_turn_end=t_turn_end, t_final=t_final, max_tokens=max_tokens or self.cfg.max_tokens,
                      instructions=instructions, metadata=metadata, conversation=conversation, extra=extra)
        self._register(r)
        r.task = asyncio.create_task(self._run_response(r), name=f"agent-reply-{r.id}")
        return r.id

    def _register(self, r: _Response) -> None:
        """``r`` is the reply in flight, found by its ids (truncate) for a while."""
        self.response = r
        self._responses[r.id] = r
        self._responses[r.item_id] = r
        while len(self._responses) > 64:  # bounded: old items can no longer be truncated
            self._responses.pop(next(iter(self._responses)))

    async def cancel_response(self, response_id: str | None = None) -> bool:
        r = self.response
        if r is None or (response_id is not None and response_id != r.id):
            return False
        await self._cancel_response(r, "client_cancelled")
        return True

    def _cancel_jobs(self, r: _Response) -> None:
        """Take the reply's LLM and TTS jobs off the scheduler now (before their next step)."""
        if r.text_job is not None and r.text_job.active:
            self.text.cancel(r.text_job)
        if r.tts_job is not None and r.tts_job.active:
            self.scheduler.cancel(r.tts_job)

    async def _cancel_response(self, r: _Response, reason: str, notify: bool = True) -> None:
        if r.finished:
            return
        now = time.monotonic()
        r.status, r.reason = "cancelled", reason
        self._cancel_jobs(r)
        if r.task is not None and not r.task.done() and r.task is not asyncio.current_task():
            r.task.cancel()
            await asyncio.gather(r.task, return_exceptions=True)
        if notify and r.audio_ms > 0 and not r.played_all:
            # Even when the simulated player ran dry the client may buffer more (network, jitter
            # buffers): dropping nothing is harmless, hearing stale speech is not.
            self.emit(PlaybackInterrupted(r.id, r.played_ms(now), r.audio_ms))
        self._finish(r, now)

    async def _run_response(self, r: _Response) -> None:
        from realtime.protocol.text import GenParams
        from realtime.text_service import TextDelta, TextDone
        from realtime.tts import END, SPURT_END, AudioChunk

        cfg = self.cfg
        self._out(r, ResponseStarted(r.id, r.item_id, cfg.voice or ""))
        audio_task: asyncio.Task[None] | None = None
        try:
            msgs = self.history.messages(r.instructions or cfg.instructions, r.extra)
            params = GenParams(max_tokens=r.max_tokens, temperature=cfg.temperature, top_p=cfg.top_p,
                               seed=cfg.seed)
            r.text_job = self.text.submit(msgs, params)
            r.text_job.speculative = r.speculative  # a guess runs in the gaps until committed
            tts_job = self.tts.new_job(StartParams(voice=cfg.voice, format=cfg.out_format,
                                                   sample_rate=cfg.out_rate, chunk_ms=cfg.chunk_ms),
                                       session=self.id)
            wake = asyncio.Event()
            tts_job.output.bind(asyncio.get_running_loop(), wake)
            tts_job.speculative = r.speculative
            self.tts.submit(self.scheduler, tts_job)
            r.tts_job = tts_job

            async def pump_audio() -> None:
                while True:
                    items = await tts_job.output.drain(self.scheduler.wake)
                    for item in items:
                        if item is END:
                            return
                        if item is SPURT_END:
                            continue  # the LLM is slower than speech here: a pause, not an underrun
                        assert isinstance(item, AudioChunk)
                        r.audio_ms += item.duration_ms
                        self._out(r, ResponseAudio(r.id, r.item_id, item.data, item.start_ms, item.duration_ms))
                    if tts_job.state is JobState.FAILED:
                        err = tts_job.error
                        raise err if isinstance(err, RealtimeError) else InternalError("speech generation failed")
                    if tts_job.state is JobState.CANCELLED:
                        return

            audio_task = asyncio.create_task(pump_audio())
            async for ev in r.text_job.stream(self.text.wake):
                if isinstance(ev, TextDelta):
                    if not ev.text:
                        continue
                    r.text += ev.text
                    r.pushed_chars += len(ev.text)
                    tts_job.push_text(ev.text)
                    self.scheduler.wake()
                    self._out(r, ResponseText(r.id, r.item_id, ev.text))
                elif isinstance(ev, TextDone):
                    r.done_ev = ev
            if not r.text.strip():
                tts_job.push_text("Sorry, could you say that again?")  # never a silent reply
                r.text = "Sorry, could you say that again?"
                r.pushed_chars = len(r.text)
            tts_job.stop()
            self.scheduler.wake()
            await audio_task
            if r.status is None:
                reason = getattr(r.done_ev, "finish_reason", "stop")
                r.status, r.reason = ("incomplete", "max_output_tokens") if reason == "length" else ("completed", None)
        except asyncio.CancelledError:
            if r.status is None:
                r.status, r.reason = "cancelled", "client_gone"
        except RealtimeError as exc:
            r.status, r.reason = "failed", exc.code
            self._out(r, AgentError(exc))
        except Exception:
            log.exception("agent %s: reply %s crashed", self.id, r.id)
            r.status, r.reason = "failed", "internal"
            self._out(r, AgentError(InternalError("internal error")))
        finally:
            if audio_task is not None and not audio_task.done():
                audio_task.cancel()
                await asyncio.gather(audio_task, return_exceptions=True)
            for job in (r.text_job, r.tts_job):
                if job is not None and job.active:
                    self.scheduler.cancel(job)
            if r.status != "cancelled":
                self._finish(r, time.monotonic())

    def _finish(self, r: _Response, now: float) -> None:
        if r.finished:
            return
        if r.speculative:  # done before the turn ended: finishes when committed
            r.finish_deferred = True
            return
        r.finished = True
        if self.response is r:
            self.response = None
        self.last_response = r
        interrupted = r.status == "cancelled"
        played = r.played_ms(now) if interrupted else r.audio_ms
        spoken = r.text_at(played, self.chars_per_ms()) if interrupted else r.text.strip()
        if not interrupted and r.audio_ms > 0 and spoken:
            self._rate_chars += len(spoken)
            self._rate_ms += r.audio_ms
        if r.conversation == "auto":
            # kept even when empty (not sent to the LLM then): a later truncate edits it in place
            r.history_msg = self.history.add("assistant", spoken, r.item_id, spoken=True)
        done = r.done_ev
        tts = r.tts_job
        st = r.tracker.stats()
        ttfa = None
        if r.first_audio_at is not None and tts is not None and tts.first_text_at is not None:
            ttfa = round((r.first_audio_at - tts.first_text_at) * 1000.0, 1)
        metrics = {
            "response_id": r.id,
            "turn_latency_ms": (round((r.first_audio_at - r.t_turn_end) * 1000.0, 1)
                                if r.first_audio_at is not None and r.t_turn_end is not None else None),
            "asr_final_ms": (round((r.t_final - r.t_turn_end) * 1000.0, 1)
                             if r.t_final is not None and r.t_turn_end is not None else None),
            "llm_ttft_ms": (round(done.ttft_ms, 1) if done is not None and done.ttft_ms is not None
                            else (round((r.text_job.t_first - r.text_job.t_submit) * 1000.0, 1)
                                  if r.text_job is not None and r.text_job.t_first is not None else None)),
            "llm_tokens": (done.completion_tokens if done is not None
                           else (r.text_job.completion_tokens if r.text_job is not None else 0)),
            "llm_tokens_per_s": (round(done.tokens_per_s, 1) if done is not None and done.tokens_per_s else None),
            "tts_ttfa_ms": ttfa,
            "audio_ms": round(r.audio_ms, 1),
            "played_ms": round(played, 1),
            "underruns": st["underruns"],
            "underrun_ms": st["underrun_ms"],
            "interrupted": interrupted,
            # started on the ASR's preview when silence began, this long before the final
            "preemptive_ms": (round((r.t_final - r.started_at) * 1000.0, 1)
                              if r.user_text and r.t_final is not None else None),
        }
        self.turns.append(metrics)
        if self.metrics is not None:
            if ttfa is not None:
                self.metrics.ttfa.observe(ttfa / 1000.0)
            self.metrics.underruns.inc(st["underruns"])
            self.metrics.underrun_s.inc(st["underrun_ms"] / 1000.0)
            self.metrics.audio_s.inc(r.audio_ms / 1000.0)
        if self.on_turn is not None:
            self.on_turn(metrics)
        prompt = r.text_job.prompt_tokens if r.text_job is not None else 0
        completion = metrics["llm_tokens"] or 0
        sent = r.text_at(r.audio_ms, self.chars_per_ms()) if interrupted else spoken
        self.emit(ResponseFinished(r.id, r.item_id, r.status or "completed", r.reason, r.text.strip(), spoken,
                                   r.audio_ms, prompt, completion, metrics, r.metadata, r.conversation, sent))
        if self._reply_pending and not self.closed:
            self._reply_pending = False
            self.create_response(t_turn_end=self._speech_end_t, t_final=time.monotonic())
