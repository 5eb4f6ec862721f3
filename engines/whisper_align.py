"""Word timestamps for Whisper: where each word of a known transcript lies in its audio.

The method is openai-whisper's (``timing.py``) as faster-whisper runs it through CTranslate2's
``align``, so that the times equal faster-whisper's ``word_timestamps=True``:

1. One forced decoder pass over ``sot sequence, <|notimestamps|>, text, <|endoftext|>`` on the
   encoder output of the audio. The cross-attention logits of the model's alignment heads
   (``Whisper.alignment_heads``) are kept for the encoder frames that hold audio; the rest of the
   30 s window is padding. As in both references, that padding is zeros in the log-mel window,
   not the log-mel of silence that ``Whisper.log_mel`` gives (and the decoder is given): the
   encoder output over the speech differs between the two, and so do the times (by up to 60 ms
   on the tests' recording).
2. Per head: softmax over those frames; each frame standardised across the tokens (mean 0,
   variance 1); a median filter of width 7 along time. Then the mean over the heads.
3. Dynamic time warping over minus that matrix, in the rows from <|notimestamps|> to the last text
   token (the row of token i is the query that predicts token i + 1): a monotonic path of (row,
   frame) pairs. Row i starts at the first frame the path gives it.
4. Tokens grouped into words: a new word at a leading space or a punctuation mark (or at every
   whole character, for languages written without spaces). A word starts where its first token's
   row starts and ends where the next word's starts. An encoder frame is 20 ms: two 10 ms mel
   hops, the encoder's second convolution having stride 2.
5. faster-whisper's corrections: with the median word duration capped at 0.7 s, a word longer than
   twice that median at a sentence end is shortened; punctuation is merged into the neighbouring
   word; the first word after a pause is shortened the same way.

faster-whisper also clamps a segment's first and last word to the segment's timestamp tokens.
Here the audio is decoded without timestamps, so the segment is the whole audio, and those clamps
can never apply: no word starts before the audio or ends after it.

Times are in seconds, rounded to 10 ms as faster-whisper rounds them. Shapes: A alignment heads,
T tokens of the forced sequence, S encoder positions, F encoder frames that hold audio.
"""

from __future__ import annotations

import string
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from realtime.errors import ConfigError

if TYPE_CHECKING:
    from realtime.engines.whisper import KVCache, Whisper

MEDIAN_WIDTH = 7  # encoder frames in the median filter along time
MAX_MEDIAN_S = 0.7  # cap on the median word duration used by the corrections
PREPEND = "\"'“¿([{-"  # marks that join the word after them
APPEND = "\"'.。,，!！?？:：”)]}、"  # marks that join the word before them
SENTENCE_END = ".。!！?？"
NO_SPACE_LANGUAGES = frozenset({"zh", "ja", "th", "lo", "my", "yue"})  # words split per character
REPLACEMENT = "\ufffd"  # what the tokenizer decodes an incomplete UTF-8 sequence to


@dataclass(frozen=True)
class Word:
    word: str  # as the tokenizer decodes it, leading space included (" table.")
    start: float  # seconds, in the caller's time (``offset_s`` added)
    end: float


@dataclass
class _Timing:
    """A word while the corrections edit it; times in seconds from the start of the audio."""

    word: str
    start: float
    end: float


@torch.inference_mode()
def word_timestamps(w: "Whisper", audio, tokens: Sequence[int], *, offset_s: float = 0.0,
                    last_speech_s: float = 0.0, language: str | None = None,
                    cache: "KVCache | None" = None) -> list[Word]:
    """The words of ``tokens`` (the transcript of ``audio``) with their times in ``audio``.

    audio: mono float32 at 16 kHz, numpy or tensor [N], at most 30 s (longer is cut).
    tokens: the transcript's token ids; special and timestamp ids (>= end of text) are dropped.
    offset_s: where the audio starts in the caller's time; every time returned has it added.
    last_speech_s: where the speech before this audio ended, in the caller's time (0 at the start
    of a stream, never below); a first word far after it may be shortened.
    language: the transcript's language on a multilingual model; None detects it from the audio.
    cache: a decoder cache to reuse (its slot 0 is overwritten); None allocates one.
    """
    if last_speech_s < 0:
        raise ConfigError(f"last_speech_s must be >= 0, got {last_speech_s}")
    text = [int(t) for t in tokens if int(t) < w.tokens.eot]
    x = torch.as_tensor(np.asarray(audio, np.float32) if not torch.is_tensor(audio) else audio)
    mel, n_mel_frames = _reference_mel(w, x.reshape(-1).float())
    if not text or n_mel_frames < 2:
        return []
    cache = cache if cache is not None else w.new_cache(1)
    cache.reset()
    w.model.decoder.fill_cross(w.encode(mel), cache)
    if w.is_multilingual and language is None:
        lang_id = int(w._detect_language(cache, 1)[0])
        language = next(code for code, i in w.tokens.languages.items() if i == lang_id)
    starts = _token_starts(w, text, w.sot_sequence(language), n_mel_frames // 2, cache)
    words = _split_words(w, text, language)
    bounds = np.cumsum([0] + [n for _, n in words])
    timings = [_Timing(word, float(starts[a]), float(starts[b]))
               for (word, _), a, b in zip(words, bounds[:-1], bounds[1:])]
    return _corrected(timings, offset_s, last_speech_s)


# ---------------------------------------------------------------------------------------------
# Attention -> alignment path


def _reference_mel(w: "Whisper", x: Tensor) -> tuple[Tensor, int]:
    """Audio [N] -> the log-mel window the references align on, [1, n_mels, 3000], and the number
    of its frames that hold the audio: the audio's frames, computed with silence after the audio,
    then zeros (not the log-mel of silence that ``Whisper.log_mel`` pads with)."""
    cfg = w.mel.cfg
    x = x[: cfg.n_samples]
    n = x.numel() // cfg.hop_length
    # A hop of silence after the audio, as faster-whisper's features have: the last frames' windows
    # and the floor (8 decades under the peak) then equal theirs.
    mel = w.mel(F.pad(x, (0, cfg.hop_length))[None])[..., :n]
    return F.pad(mel, (0, cfg.n_frames - n)), n


def _token_starts(w: "Whisper", text: list[int], sot: list[int], n_frames: int, cache: "KVCache") -> np.ndarray:
    """Seconds from the audio's start at which each text token, then the end of text, begins
    [len(text) + 1]; the encoder output is in ``cache``, ``n_frames`` of its frames hold audio."""
    seq = sot + [w.tokens.no_timestamps] + text + [w.tokens.eot]
    if len(seq) > w.cfg.n_text_ctx:
        raise ConfigError(f"{len(text)} text tokens do not fit the decoder's {w.cfg.n_text_ctx} positions")
    matrix = _alignment_matrix(_cross_logits(w, seq, cache), n_frames)
    # rows from <|notimestamps|> (which predicts the first text token) to the last text token
    rows, frames = _dtw(-matrix[len(sot): len(sot) + len(text) + 1].cpu().numpy())
    frame_rate = w.mel.cfg.sample_rate / (2 * w.mel.cfg.hop_length)  # 50 encoder frames a second
    return frames[np.diff(rows, prepend=-1) > 0] / frame_rate


def _cross_logits(w: "Whisper", seq: list[int], cache: "KVCache") -> Tensor:
    """The forced pass over ``seq`` (cross keys already in ``cache``) -> float32 [A, T, S]:
    the alignment heads' scaled query-key products, before the softmax."""
    heads: dict[int, list[int]] = {}
    for layer, head in w.alignment_heads:
        heads.setdefault(layer, []).append(head)
    kept: list[Tensor] = []

    def keep(layer: int, q: Tensor, k: Tensor) -> None:
        for h in heads.get(layer, ()):
            kept.append((q[0, h] @ k[0, h].T).float() * q.shape[-1] ** -0.5)

    ids = torch.tensor([seq], dtype=torch.long, device=w.device)
    pos = torch.arange(len(seq), device=w.device)[None]
    w.model.decoder(ids, pos, len(seq), cache, on_cross=keep)
    assert kept, "the model has no alignment heads"
    return torch.stack(kept)


def _alignment_matrix(logits: Tensor, n_frames: int) -> Tensor:
    """Logits [A, T, S] -> [T, F]: softmax over the first F = ``n_frames`` frames, each frame
    standardised across the T tokens, median-filtered along time, averaged over the heads."""
    p = logits[:, :, :n_frames].softmax(-1)
    std, mean = torch.std_mean(p, dim=-2, correction=0, keepdim=True)
    return _median_filter((p - mean) / std, MEDIAN_WIDTH).mean(0)


def _median_filter(x: Tensor, width: int) -> Tensor:
    """Median over ``width`` (odd) neighbours along the last axis, mirrored at the edges (the edge
    value not repeated). Rows too short to mirror are returned as they are."""
    half = width // 2
    if x.shape[-1] <= half:
        return x
    return F.pad(x, (half, half), mode="reflect").unfold(-1, width, 1).median(-1).values


def _dtw(cost: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Least-cost monotonic path through ``cost`` [N, M] from (0, 0) to (N-1, M-1) -> (rows,
    columns) of its cells, in order.

    Float32 throughout with CTranslate2's tie order (diagonal, then up, then left), so the path
    equals its ``negative_dtw``. The cells of one anti-diagonal depend only on the two before it,
    so each anti-diagonal is one vector step.
    """
    n, m = cost.shape
    cost = cost.astype(np.float32, copy=False)
    acc = np.full((n + 1, m + 1), np.inf, np.float32)  # acc[i, j]: best path to cell (i-1, j-1)
    acc[0, 0] = 0
    step = np.zeros((n + 1, m + 1), np.int8)  # 0: came diagonally, 1: from above, 2: from the left
    for k in range(2, n + m + 1):
        i = np.arange(max(1, k - m), min(n, k - 1) + 1)
        j = k - i
        diag, up, left = acc[i - 1, j - 1], acc[i - 1, j], acc[i, j - 1]
        s = np.where((diag < up) & (diag < left), 0, np.where((up < diag) & (up < left), 1, 2))
        acc[i, j] = cost[i - 1, j - 1] + np.choose(s, [diag, up, left])
        step[i, j] = s
    path = []
    i, j = n, m
    while i > 0 and j > 0:
        path.append((i - 1, j - 1))
        s = int(step[i, j])
        i, j = (i - 1, j - 1) if s == 0 else (i - 1, j) if s == 1 else (i, j - 1)
    path.reverse()
    rows, cols = np.array(path, dtype=np.int64).reshape(-1, 2).T
    return rows, cols


# ---------------------------------------------------------------------------------------------
# Tokens -> words, and faster-whisper's corrections


def _split_words(w: "Whisper", text: list[int], language: str | None) -> list[tuple[str, int]]:
    """Text tokens -> [(word, its number of tokens)] covering them in order."""
    eot = w.tokens.eot
    runs = _whole_characters(w.tokenizer, text + [eot])[:-1]  # end of text closes the last run
    if language in NO_SPACE_LANGUAGES:
        return [(s, len(run)) for s, run in runs]
    words: list[tuple[str, int]] = []
    for s, run in runs:
        # ``in string.punctuation`` is a substring test, as in Whisper: "" and "()" count too.
        if s.startswith(" ") or s.strip() in string.punctuation or not words:
            words.append((s, len(run)))
        else:
            words[-1] = (words[-1][0] + s, words[-1][1] + len(run))
    return words


def _whole_characters(tokenizer, tokens: list[int]) -> list[tuple[str, list[int]]]:
    """Tokens -> the shortest runs that decode to whole characters, [(text, run)]: a character
    whose UTF-8 bytes span several tokens stays in one run. Special tokens decode to ""."""
    full = tokenizer.decode(tokens)
    runs: list[tuple[str, list[int]]] = []
    run: list[int] = []
    at = 0  # characters of ``full`` decoded by the runs so far
    for t in tokens:
        run.append(t)
        s = tokenizer.decode(run)
        bad = s.find(REPLACEMENT)
        # a replacement character that the whole text also has is in the text, not a cut character
        if bad < 0 or (at + bad < len(full) and full[at + bad] == REPLACEMENT):
            runs.append((s, run))
            run = []
            at += len(s)
    return runs


def _corrected(timings: list[_Timing], offset_s: float, last_speech_s: float) -> list[Word]:
    """faster-whisper's corrections of the words' raw timings (edited in place) -> the words, empty
    ones dropped, in the caller's time (``offset_s`` added, rounded to 10 ms)."""
    median = _median_duration(timings)
    _shorten_at_sentence_ends(timings, 2 * median)
    _merge_punctuation(timings)
    out = [Word(t.word, round(offset_s + t.start, 2), round(offset_s + t.end, 2)) for t in timings if t.word]
    return _shorten_after_pause(out, last_speech_s, median)


def _median_duration(timings: list[_Timing]) -> float:
    """The median of the words' non-zero durations, capped at MAX_MEDIAN_S (0 without any)."""
    d = np.array([t.end - t.start for t in timings])
    d = d[d.nonzero()]
    return min(MAX_MEDIAN_S, float(np.median(d))) if len(d) else 0.0


def _shorten_at_sentence_ends(timings: list[_Timing], longest: float) -> None:
    """A word longer than ``longest`` that ends a sentence loses its end, one after a sentence end
    its start. (A substring test, as faster-whisper's: an empty word counts as a mark.)"""
    for prev, cur in zip(timings, timings[1:]):
        if cur.end - cur.start > longest:
            if cur.word in SENTENCE_END:
                cur.end = cur.start + longest
            elif prev.word in SENTENCE_END:
                cur.start = cur.end - longest


def _merge_punctuation(timings: list[_Timing]) -> None:
    """Opening marks (PREPEND, after a space) join the word after them and closing marks (APPEND)
    the word before them; the merged word keeps that word's times and the mark's entry is left
    empty."""
    j = len(timings) - 1
    for i in range(len(timings) - 2, -1, -1):
        prev, nxt = timings[i], timings[j]
        if prev.word.startswith(" ") and prev.word.strip() in PREPEND:
            nxt.word = prev.word + nxt.word
            prev.word = ""
        else:
            j = i
    i = 0
    for j in range(1, len(timings)):
        prev, nxt = timings[i], timings[j]
        if not prev.word.endswith(" ") and nxt.word in APPEND:
            prev.word += nxt.word
            nxt.word = ""
        else:
            i = j


def _shorten_after_pause(words: list[Word], last_speech_s: float, median: float) -> list[Word]:
    """After a pause of more than four median words, a first word (or first two) longer than twice
    the median is cut to that length, keeping its end. Times are the caller's, as faster-whisper's.

    faster-whisper also keeps the shared boundary at or after half the second word's end time and
    the first start at or after 0; neither bound binds when ``last_speech_s >= 0``, as the pause
    puts both ends past four medians.
    """
    longest = 2 * median
    if not words:
        return words
    first = words[0]
    two_long = len(words) > 1 and words[1].end - first.start > 2 * longest
    if not (first.end - last_speech_s > 4 * median and (first.end - first.start > longest or two_long)):
        return words
    out = list(words)
    if len(out) > 1 and out[1].end - out[1].start > longest:
        boundary = out[1].end - longest
        out[0] = Word(first.word, first.start, boundary)
        out[1] = Word(out[1].word, boundary, out[1].end)
    out[0] = Word(out[0].word, out[0].end - longest, out[0].end)
    return out
