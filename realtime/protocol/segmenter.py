"""Incremental text segmentation for low-latency TTS.

Text arrives in arbitrary pieces (an LLM's tokens, a user's keystrokes). A segment is released as
soon as it is safe to speak: at a sentence end, or at a clause boundary once enough text has piled
up (the first segment of a turn is cut earlier, because time to first audio matters most there).
Segments never split a word, and ``flush()`` releases whatever is left.
"""

from __future__ import annotations

import re

# A sentence ends at . ! ? … (optionally followed by closing quotes/brackets) then whitespace.
_SENTENCE_END = re.compile(r"[.!?…]+[\"'”’)\]]*(?=\s)")
_CLAUSE_END = re.compile(r"[,;:—–]+(?=\s)|\s-\s")
_ABBREVIATIONS = frozenset(
    "mr mrs ms dr prof sr jr st vs etc e.g i.e inc ltd co no fig mt approx dept".split()
)


class Segmenter:
    """Feed text with ``push``; get back the segments that are ready to speak."""

    def __init__(self, first_clause_chars: int = 24, clause_chars: int = 80, max_chars: int = 300) -> None:
        self.buf = ""
        self.first = True
        self.first_clause_chars = first_clause_chars
        self.clause_chars = clause_chars
        self.max_chars = max_chars

    def push(self, text: str) -> list[str]:
        self.buf += text
        out: list[str] = []
        while (seg := self._next()) is not None:
            out.append(seg)
        return out

    def flush(self) -> list[str]:
        rest, self.buf = self.buf.strip(), ""
        if rest:
            self.first = False
            return [rest]
        return []

    def reset_turn(self) -> None:
        """The next segment starts a new turn: cut it early again."""
        self.first = True

    def _take(self, end: int) -> str | None:
        seg, self.buf = self.buf[:end].strip(), self.buf[end:]
        if not seg:
            return None if not self.buf.strip() else self._next()
        self.first = False
        return seg

    def _next(self) -> str | None:
        for m in _SENTENCE_END.finditer(self.buf):
            word = self.buf[: m.start()].rsplit(None, 1)
            last = word[-1].lower().rstrip(".") if word else ""
            if m.group().startswith(".") and (last in _ABBREVIATIONS or len(last) == 1 and last.isalpha()):
                continue  # "Dr. Smith", "J. R. R."
            if m.group().startswith(".") and last.replace(",", "").isdigit() and self.buf[m.end():m.end() + 1] == "":
                continue
            return self._take(m.end())
        limit = self.first_clause_chars if self.first else self.clause_chars
        if len(self.buf) >= limit:
            cut = None
            for m in _CLAUSE_END.finditer(self.buf):
                if m.end() >= limit // 2:
                    cut = m.end()
                    break
            if cut is not None:
                return self._take(cut)
        if len(self.buf) >= self.max_chars:
            # No punctuation in a long run: cut at the last space so no word is split.
            space = self.buf.rfind(" ", 0, self.max_chars)
            if space > 0:
                return self._take(space)
        return None
