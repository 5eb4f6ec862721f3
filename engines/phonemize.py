"""Text to phonemes with espeak-ng, the way Piper voices were trained.

Piper voices expect the phonemes espeak-ng produces, split into Unicode NFD code points, with the
clause punctuation kept. We call the espeak-ng build that ships inside the installed ``piper-tts``
package (``piper/espeakbridge*.so`` + ``piper/espeak-ng-data``), so our phonemes are byte-for-byte
the ones Piper itself feeds the model.

Licence: espeak-ng and piper's ``espeakbridge`` are GPL-3.0. This module only loads the installed
extension at run time (it ships nothing of it); a deployment that bundles it inherits GPL-3.0
obligations for that part.

We load the extension file directly instead of ``import piper``: ``piper/__init__.py`` pulls in
onnxruntime, which the serving path must not need.

Sentence/clause splitting for low latency is the server's job; here one call returns one phoneme
list per sentence, exactly like ``piper.PiperVoice.phonemize`` (minus its ``[[ raw ]]`` blocks).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import re
import sys
import threading
import unicodedata
from collections.abc import Iterable
from pathlib import Path
from types import ModuleType

from realtime.errors import ConfigError

__all__ = ["phonemize", "espeak_data_dir", "merge_vowel_clusters"]

# espeak-ng keeps one global voice/state per process: every call goes through this lock.
_LOCK = threading.Lock()
_BRIDGE: ModuleType | None = None

# espeak marks words it switched language for as "(en)word(fr)"; piper strips these flags.
_LANG_FLAG = re.compile(r"\([^)]+\)")


def _piper_dir() -> Path:
    spec = importlib.util.find_spec("piper")  # finds the package without executing __init__
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("espeak-ng phonemizer needs the 'piper-tts' package (piper/espeakbridge)")
    return Path(next(iter(spec.submodule_search_locations)))


def espeak_data_dir() -> Path:
    """Folder of the espeak-ng data that ships with piper-tts."""
    path = _piper_dir() / "espeak-ng-data"
    if not path.is_dir():
        raise ConfigError(f"espeak-ng data not found in the piper-tts package: {path}")
    return path


def _load_bridge() -> ModuleType:
    global _BRIDGE
    if _BRIDGE is not None:
        return _BRIDGE
    name = "piper.espeakbridge"
    mod = sys.modules.get(name)  # piper itself may have loaded it already: share one instance
    if mod is None:
        folder = _piper_dir()
        candidates = [
            folder / f"espeakbridge{suffix}" for suffix in importlib.machinery.EXTENSION_SUFFIXES
        ]
        path = next((p for p in candidates if p.is_file()), None)
        if path is None:
            raise ConfigError(f"piper's espeakbridge extension not found in {folder}")
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        sys.modules[name] = mod
    mod.initialize(str(espeak_data_dir()))
    _BRIDGE = mod
    return mod


def merge_vowel_clusters(phones: list[str], clusters: Iterable[tuple[str, ...]]) -> list[str]:
    """Greedily merge runs of code points that a voice maps as one phoneme (longest first)."""
    clusters = set(clusters)
    if not clusters:
        return phones
    longest = max(len(c) for c in clusters)
    out: list[str] = []
    i = 0
    while i < len(phones):
        for n in range(min(longest, len(phones) - i), 1, -1):
            if tuple(phones[i : i + n]) in clusters:
                out.append("".join(phones[i : i + n]))
                i += n
                break
        else:
            out.append(phones[i])
            i += 1
    return out


def phonemize(
    text: str, voice: str = "en-us", vowel_clusters: Iterable[tuple[str, ...]] = ()
) -> list[list[str]]:
    """Text -> one list of phonemes (NFD code points, punctuation kept) per sentence.

    Empty sentences are dropped, so empty or blank text gives ``[]``.
    """
    clusters = set(vowel_clusters)
    with _LOCK:
        bridge = _load_bridge()
        # Set every call, not cached: piper's own phonemizer (same process, same espeak state)
        # may have re-initialized espeak or switched voice in between.
        try:
            bridge.set_voice(voice)
        except Exception as exc:  # the C bridge raises a bare RuntimeError for unknown voices
            raise ConfigError(f"espeak-ng has no voice {voice!r}") from exc
        clauses = bridge.get_phonemes(text)

    sentences: list[list[str]] = []
    current: list[str] = []
    for phonemes, terminator, end_of_sentence in clauses:
        phonemes = _LANG_FLAG.sub("", phonemes) + terminator
        if terminator in (",", ":", ";"):
            phonemes += " "  # a clause break inside a sentence reads as a word gap
        current.extend(unicodedata.normalize("NFD", phonemes))
        if end_of_sentence:
            if current:
                sentences.append(merge_vowel_clusters(current, clusters))
            current = []
    if current:
        sentences.append(merge_vowel_clusters(current, clusters))
    return sentences
