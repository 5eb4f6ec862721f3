"""A simulated real-time audio player: counts playback gaps (underruns) as a client would hear them.

The player starts when the first chunk arrives and consumes audio at the sample rate. Whenever the
next chunk arrives after the buffered audio has run out, that is an underrun of the difference.
Gaps while the *sender* has nothing to say (all text spoken, waiting for more) are not underruns:
call ``idle()`` when a talk spurt ends and the next chunk starts a new spurt.
Times are in seconds (monotonic clock); stats are reported in milliseconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field

UNDERRUN_EPSILON_S = 0.001  # scheduling jitter below a millisecond is not audible


@dataclass
class GapTracker:
    playing_until: float | None = None  # when the buffered audio runs out
    first_at: float | None = None
    underruns: int = 0
    underrun_s: float = 0.0
    max_underrun_s: float = 0.0
    audio_s: float = 0.0
    chunks: int = 0
    gaps_over_100ms: int = 0
    _idle: bool = field(default=False, repr=False)

    def on_chunk(self, now: float, duration_s: float) -> None:
        """A chunk of ``duration_s`` seconds of audio arrived (was sent) at ``now``."""
        if self.playing_until is None or self._idle:
            self.first_at = self.first_at if self.first_at is not None else now
            self.playing_until = max(now, self.playing_until or now)
            self._idle = False
        elif now > self.playing_until + UNDERRUN_EPSILON_S:
            gap = now - self.playing_until
            self.underruns += 1
            self.underrun_s += gap
            self.max_underrun_s = max(self.max_underrun_s, gap)
            if gap > 0.1:
                self.gaps_over_100ms += 1
            self.playing_until = now
        self.playing_until = max(self.playing_until, now) + duration_s
        self.audio_s += duration_s
        self.chunks += 1

    def idle(self) -> None:
        """The sender has spoken everything it was given; the next gap is not an underrun."""
        self._idle = True

    def buffered(self, now: float) -> float:
        """Seconds of audio the player still holds at ``now`` (0 when it ran dry)."""
        if self.playing_until is None:
            return 0.0
        return max(0.0, self.playing_until - now)

    def deadline(self) -> float | None:
        """When the player runs dry: the moment the next chunk is due."""
        return self.playing_until

    def stats(self) -> dict[str, float | int]:
        return {
            "underruns": self.underruns,
            "underrun_ms": round(self.underrun_s * 1000, 3),
            "max_underrun_ms": round(self.max_underrun_s * 1000, 3),
            "underruns_over_100ms": self.gaps_over_100ms,
            "audio_ms": round(self.audio_s * 1000, 3),
            "chunks": self.chunks,
        }
