"""LocalAgreement-2 streaming policy, driven by scripted hypotheses."""

from __future__ import annotations

import pytest

from realtime.engines.asr_policy import AsrEvent, LocalAgreementPolicy, PolicyConfig, normalize
from realtime.errors import ConfigError, StateError


def _feed(p: LocalAgreementPolicy, script):
    events = []
    for t, text in script:
        events += p.on_hypothesis(text.split(), t)
    return events


def test_commits_longest_common_prefix_of_two_hypotheses():
    p = LocalAgreementPolicy()
    p.start(1000)
    ev = p.on_hypothesis("he turned".split(), 1500)
    assert ev == [AsrEvent("partial", "he turned", 1000, 1500, "")]  # nothing agreed yet
    ev = p.on_hypothesis("he turned sharp".split(), 2000)
    assert ev[0].committed == "he turned" and ev[0].text == "he turned sharp"
    # "sharp" is revised to "sharply": it was never committed, so that is allowed.
    ev = p.on_hypothesis("He turned sharply, and".split(), 2500)
    assert ev[0].text == "he turned sharply, and" and ev[0].committed == "he turned"
    ev = p.on_hypothesis("he turned sharply and faced".split(), 3000)
    # Punctuation and case do not block agreement; the newer spelling is committed.
    assert ev[0].committed == "he turned sharply and"
    assert p.committed_text == "he turned sharply and"


def test_committed_words_are_never_revised_and_final_extends_them():
    p = LocalAgreementPolicy()
    p.start(0)
    _feed(p, [(500, "the cat sat"), (1000, "the cat sat on")])
    assert p.committed_text == "the cat sat"
    # A later hypothesis that rewrites a committed word cannot change it.
    ev = p.on_hypothesis("the bat sat on the".split(), 1500)
    assert ev[0].text.startswith("the cat sat") and ev[0].committed.startswith("the cat sat")
    ev = p.end("the cat sat on the mat.".split(), 2000)
    assert ev == [AsrEvent("final", "the cat sat on the mat.", 0, 2000, "the cat sat on the mat.")]
    assert not p.active


def test_final_after_rephrased_prefix_aligns_on_committed_words():
    p = LocalAgreementPolicy()
    p.start(0)
    _feed(p, [(500, "so we went"), (1000, "so we went home")])
    assert p.committed_text == "so we went"
    # The final decode adds a filler word in front; alignment keeps only the new tail.
    (ev,) = p.end("um so we went home early".split(), 1600)
    assert ev.text == "so we went home early"


def test_partials_only_when_text_changes_and_cadence():
    p = LocalAgreementPolicy(PolicyConfig(decode_every_ms=500, min_decode_ms=300))
    assert not p.should_decode(1000)
    p.start(1000)
    assert not p.should_decode(1200)  # buffer shorter than min_decode_ms
    assert not p.should_decode(1400)  # cadence not reached
    assert p.should_decode(1500)
    assert p.on_hypothesis(["hello"], 1500)
    assert not p.should_decode(1900) and p.should_decode(2000)
    assert p.on_hypothesis(["hello"], 2000) == []  # same text: no new partial
    assert p.committed_text == "hello"


def test_long_utterance_is_cut_at_last_committed_word_and_carries_the_rest():
    cfg = PolicyConfig(decode_every_ms=1000, max_segment_ms=30000, cut_margin_ms=1000)
    p = LocalAgreementPolicy(cfg)
    p.start(0)
    words = [f"w{i}" for i in range(60)]
    events = []
    # Two words per second; each decode sees the words spoken so far, plus one unstable word.
    for t in range(1000, 29001, 1000):
        n = 2 * t // 1000
        events += p.on_hypothesis(words[:n] + [f"x{t}"], t)
    finals = [e for e in events if e.kind == "final"]
    assert len(finals) == 1
    cut = finals[0]
    # Committed at t=29000: w0..w55 (agreed by the 28 s and 29 s decodes); w55 first appeared
    # in the 28 s decode, so the carried audio starts there.
    assert cut.text == " ".join(words[:56]) and cut.start_ms == 0 and cut.end_ms == 28000
    assert p.segment_start_ms == 28000 and p.committed == []
    assert p.prompt_words == words[:56]
    # The next segment decodes only the carried audio; its partials start at the cut.
    ev = p.on_hypothesis(["w56", "w57"], 30000)
    assert ev[0].start_ms == 28000 and ev[0].text == "w56 w57"
    (final,) = p.end(["w56", "w57", "w58"], 30500)
    assert final.text == "w56 w57 w58" and final.start_ms == 28000 and final.end_ms == 30500


def test_cut_without_agreement_finalizes_current_hypothesis():
    p = LocalAgreementPolicy(PolicyConfig(decode_every_ms=500, max_segment_ms=3000, cut_margin_ms=500))
    p.start(0)
    ev = _feed(p, [(1000, "a b"), (2000, "c d"), (2500, "e f")])
    finals = [e for e in ev if e.kind == "final"]
    assert [f.text for f in finals] == ["e f"] and finals[0].end_ms == 2500
    assert p.segment_start_ms == 2500


def test_word_end_times_are_used_for_the_cut():
    p = LocalAgreementPolicy(PolicyConfig(decode_every_ms=500, max_segment_ms=3000, cut_margin_ms=500))
    p.start(0)
    p.on_hypothesis([("one", 400), ("two", 900), ("thr", 1900)], 2000)
    ev = p.on_hypothesis([("one", 400), ("two", 950), ("three", 2300)], 2500)
    final = [e for e in ev if e.kind == "final"][0]
    assert final.text == "one two" and final.end_ms == 900


def test_state_errors_reset_and_config_validation():
    p = LocalAgreementPolicy()
    with pytest.raises(StateError):
        p.on_hypothesis(["x"], 100)
    p.start(0)
    with pytest.raises(StateError):
        p.start(10)
    p.on_hypothesis(["x", "y"], 500)
    assert p.end(None, 800) == [AsrEvent("final", "x y", 0, 800, "x y")]
    with pytest.raises(StateError):
        p.end(None, 900)
    p.start(1000)
    assert p.end([], 1200) == []  # an utterance with no words gives no final
    p.reset()
    assert not p.active and p.prompt_words == []
    with pytest.raises(ConfigError):
        PolicyConfig(cut_margin_ms=30000)
    assert normalize("Table.") == normalize("table") == "table"
