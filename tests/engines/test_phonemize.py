"""espeak-ng phonemizer: same phonemes as piper's own EspeakPhonemizer, NFD, punctuation kept."""

from __future__ import annotations

import unicodedata

import pytest

from realtime.engines.phonemize import merge_vowel_clusters, phonemize
from realtime.errors import ConfigError

TEXTS = [
    "Hello world. How are you today?",
    "Wait, what; really: yes!",
    "The year 1984 cost $5. Dr. Smith lives at 42 St. James",
    "Ça va? naïve café",
    '(quoted) "text" - dash',
]


@pytest.fixture(scope="module")
def piper_phonemizer():
    # The reference: piper-tts's own wrapper around the same espeakbridge (imports onnxruntime,
    # which is fine in tests).
    from piper.phonemize_espeak import EspeakPhonemizer

    return EspeakPhonemizer()


@pytest.mark.parametrize("text", TEXTS)
def test_matches_piper(piper_phonemizer, text: str) -> None:
    ref = [s for s in piper_phonemizer.phonemize("en-us", text) if s]
    assert phonemize(text, "en-us") == ref
    # And ours still works after piper re-initialized the shared espeak state.
    assert phonemize(text) == ref


def test_sentences_and_punctuation() -> None:
    sents = phonemize("Hello world. How are you?")
    assert len(sents) == 2
    assert "".join(sents[0]) == "həlˈoʊ wˈɜːld."
    assert sents[1][-1] == "?"
    (clauses,) = phonemize("Wait, what; really: yes!")
    s = "".join(clauses)
    # Clause punctuation is kept; a clause break inside a sentence is followed by a space.
    assert ", " in s and "; " in s and ": " in s and s.endswith("!")


def test_nfd_code_points() -> None:
    (fr,) = phonemize("bonjour garçon", voice="fr")
    assert all(len(p) == 1 for p in fr)  # one code point per phoneme
    assert all(unicodedata.normalize("NFD", p) == p for p in fr)
    assert "\u0303" in fr  # nasal vowel: the combining tilde is its own phoneme


def test_empty_text() -> None:
    assert phonemize("") == []
    assert phonemize("   \n ") == []


def test_unknown_voice() -> None:
    with pytest.raises(ConfigError):
        phonemize("hello", voice="zz-not-a-voice")
    assert phonemize("hi")  # the bridge still works afterwards


def test_vowel_clusters() -> None:
    assert merge_vowel_clusters(list("haɪb"), {("a", "ɪ")}) == ["h", "aɪ", "b"]
    assert merge_vowel_clusters(list("ab"), set()) == ["a", "b"]
    plain = phonemize("my time")[0]
    merged = phonemize("my time", vowel_clusters={("a", "ɪ")})[0]
    assert "aɪ" in merged and len(merged) == len(plain) - merged.count("aɪ")
