"""Streaming ASR policy: LocalAgreement-2 over re-decodes of a growing utterance buffer.

Pure Python (no torch): the serving loop owns the audio and the model; this state machine
only decides *what text to show*. Per VAD utterance:

1. ``start(t_ms)`` when the VAD opens speech; the audio buffer to decode starts at
   ``segment_start_ms``.
2. Whenever ``should_decode(t_ms)`` says so (a short cadence), the caller decodes the buffer
   [segment_start_ms, t_ms) and calls ``on_hypothesis(words, t_ms)``.
   The longest common word prefix of this hypothesis and the previous one is *committed*
   (LocalAgreement-2: two successive decodes over growing audio agree). Committed words are
   never revised. A ``partial`` event carries committed + the unconfirmed tail.
3. ``end(words, t_ms)`` at the VAD end with the decode of the whole buffer: one ``final``
   event (committed words + the final hypothesis' tail after them). Finals are never revised.
4. Whisper sees at most 30 s. When the buffer reaches ``max_segment_ms``, the committed words
   become a ``final`` and the buffer is cut at the last committed word; the rest of the audio
   is carried into the next segment of the same utterance.

Words are compared case- and punctuation-insensitively ("table." agrees with "Table"); the
newer hypothesis' spelling is kept. A hypothesis word may be ``(text, end_ms)`` when the
decoder has word times; otherwise a word's end is estimated as the audio time of the first
decode in which it appeared at its position unchanged (an upper bound: the word was already
in that audio).
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, field
from typing import Sequence, Union

from realtime.errors import ConfigError, StateError

WordIn = Union[str, tuple[str, int]]


@dataclass(frozen=True)
class PolicyConfig:
    decode_every_ms: int = 500  # re-decode cadence within an utterance
    min_decode_ms: int = 300  # do not decode a buffer shorter than this
    max_segment_ms: int = 30000  # Whisper's window; cut before the buffer exceeds it
    cut_margin_ms: int = 1000  # cut this long before the limit, so the next decode still fits

    def __post_init__(self) -> None:
        if self.decode_every_ms <= 0 or self.min_decode_ms < 0:
            raise ConfigError("decode cadence must be positive")
        if not 0 <= self.cut_margin_ms < self.max_segment_ms:
            raise ConfigError("cut_margin_ms must be below max_segment_ms")


@dataclass(frozen=True)
class AsrEvent:
    kind: str  # "partial" | "final"
    text: str
    start_ms: int
    end_ms: int
    committed: str = ""  # the stable prefix of ``text`` (equal to ``text`` for finals)


@dataclass
class _Word:
    text: str
    key: str  # normalized for comparison
    seen_ms: int  # audio time of the first decode that had this word here (or its end time)


def normalize(word: str) -> str:
    return re.sub(r"[^\w']+", "", word.lower())


def _join(words: Sequence[_Word]) -> str:
    return " ".join(w.text for w in words)


@dataclass
class LocalAgreementPolicy:
    """One stream's policy state (one utterance at a time); ``reset()`` for a new stream."""

    cfg: PolicyConfig = field(default_factory=PolicyConfig)
    active: bool = False
    utterance_start_ms: int = 0
    segment_start_ms: int = 0
    last_decode_ms: int = 0
    committed: list[_Word] = field(default_factory=list)
    previous: list[_Word] = field(default_factory=list)  # last hypothesis (after committed)
    last_partial: str | None = None
    context: list[str] = field(default_factory=list)  # finalized words of this utterance

    def reset(self) -> None:
        self.active = False
        self.utterance_start_ms = self.segment_start_ms = self.last_decode_ms = 0
        self.committed = []
        self.previous = []
        self.last_partial = None
        self.context = []

    # -- driving ---------------------------------------------------------------------------------

    def start(self, t_ms: int) -> None:
        """A VAD utterance starts at t_ms (stream time)."""
        if self.active:
            raise StateError("utterance already active")
        self.reset()
        self.active = True
        self.utterance_start_ms = self.segment_start_ms = self.last_decode_ms = int(t_ms)

    def should_decode(self, t_ms: int) -> bool:
        """True when the buffer [segment_start_ms, t_ms) is due for another decode."""
        return (self.active and t_ms - self.segment_start_ms >= self.cfg.min_decode_ms
                and t_ms - self.last_decode_ms >= self.cfg.decode_every_ms)

    def on_hypothesis(self, words: Sequence[WordIn], t_ms: int) -> list[AsrEvent]:
        """The decode of [segment_start_ms, t_ms) gave ``words`` -> partial (and cut) events."""
        if not self.active:
            raise StateError("no active utterance")
        self.last_decode_ms = int(t_ms)
        hyp = self._tail_after_committed(self._words(words, t_ms))
        # LocalAgreement-2: commit the common prefix of this and the previous tail.
        n = 0
        while n < min(len(hyp), len(self.previous)) and hyp[n].key == self.previous[n].key:
            hyp[n].seen_ms = min(hyp[n].seen_ms, self.previous[n].seen_ms)
            n += 1
        self.committed += hyp[:n]
        # Keep first-seen times for tail words that stayed at their position.
        tail = hyp[n:]
        for i, w in enumerate(tail):
            j = n + i
            if j < len(self.previous) and self.previous[j].key == w.key:
                w.seen_ms = min(w.seen_ms, self.previous[j].seen_ms)
        self.previous = tail
        events = self._partial(t_ms)
        if t_ms - self.segment_start_ms >= self.cfg.max_segment_ms - self.cfg.cut_margin_ms:
            events += self._cut(t_ms)
        return events

    def end(self, words: Sequence[WordIn] | None, t_ms: int) -> list[AsrEvent]:
        """VAD end of utterance at t_ms; ``words`` decode the whole remaining buffer (or None
        to finalize what is known: committed + the last tail)."""
        if not self.active:
            raise StateError("no active utterance")
        tail = self.previous if words is None else self._tail_after_committed(self._words(words, t_ms))
        final = self.committed + tail
        events = []
        if final:
            events.append(AsrEvent("final", _join(final), self.segment_start_ms, int(t_ms), _join(final)))
        self.context += [w.text for w in final]
        self.active = False
        self.committed, self.previous, self.last_partial = [], [], None
        return events

    # -- helpers -----------------------------------------------------------------------------------

    @property
    def committed_text(self) -> str:
        return _join(self.committed)

    @property
    def hypothesis_text(self) -> str:
        """Committed words + the last tail: the final's text if the utterance ended now."""
        return _join(self.committed + self.previous)

    @property
    def prompt_words(self) -> list[str]:
        """Text already final in this utterance plus the committed words: a decoder prompt."""
        return self.context + [w.text for w in self.committed]

    def _words(self, words: Sequence[WordIn], t_ms: int) -> list[_Word]:
        out = []
        for w in words:
            text, seen = (w, int(t_ms)) if isinstance(w, str) else (w[0], int(w[1]))
            text = text.strip()
            if normalize(text):
                out.append(_Word(text, normalize(text), seen))
        return out

    def _tail_after_committed(self, hyp: list[_Word]) -> list[_Word]:
        """Drop the part of a full-buffer hypothesis that repeats the committed words.

        Usually the hypothesis starts with them; if the decoder rephrased, align the two
        sequences and keep what follows the last committed word that matched.
        """
        c = self.committed
        if not c:
            return hyp
        if [w.key for w in hyp[: len(c)]] == [w.key for w in c]:
            return hyp[len(c):]
        sm = difflib.SequenceMatcher(a=[w.key for w in c], b=[w.key for w in hyp], autojunk=False)
        blocks = [b for b in sm.get_matching_blocks() if b.size]
        if not blocks:
            return hyp[len(c):]  # no overlap at all: fall back to position
        last = blocks[-1]
        return hyp[last.b + last.size + (len(c) - last.a - last.size):]

    def _partial(self, t_ms: int) -> list[AsrEvent]:
        text = _join(self.committed + self.previous)
        if not text or text == self.last_partial:
            return []
        self.last_partial = text
        return [AsrEvent("partial", text, self.segment_start_ms, int(t_ms), self.committed_text)]

    def _cut(self, t_ms: int) -> list[AsrEvent]:
        """Buffer near 30 s: finalize committed words, restart the buffer after the last one."""
        if self.committed:
            words, cut = self.committed, self.committed[-1].seen_ms
            self.previous = []  # the tail is re-decoded from the carried audio
        else:
            # Nothing agreed in ~30 s (e.g. noise or a decoder loop): take what we have.
            words, cut = self.previous, int(t_ms)
            self.previous = []
        cut = max(self.segment_start_ms + 1, min(int(cut), int(t_ms)))
        events = []
        if words:
            events.append(AsrEvent("final", _join(words), self.segment_start_ms, cut, _join(words)))
        self.context += [w.text for w in words]
        self.committed = []
        self.segment_start_ms = cut
        self.last_partial = None
        return events
