"""Prompt prefixes reused on the CPU (realtime.text_service.BatchDecoder): a conversation's next turn
prefills only the chunks after what its slot holds, and gives the same K/V and the same replies,
bit for bit, as a fresh slot. The embedded SmolLM2 (cpu-native, the server's CPU default)."""

from __future__ import annotations

import pytest
import torch

from realtime.engines.llama import TextModel
from realtime.text_service import PREFIX_CHUNK, BatchDecoder, SlotPool

SYSTEM = "You are a friendly voice assistant on a phone call. Answer in one or two short, plain sentences."


@pytest.fixture(scope="module")
def model() -> TextModel:
    return TextModel.from_pretrained(cpu_native=True)


def _ids(model: TextModel, messages: list[dict]) -> list[int]:
    tok = model.tokenizer
    return tok.encode(tok.apply_chat_template(messages), add_special=False)


def _reply(eng: BatchDecoder, slot: int, ids: list[int], n: int, temperature: float = 0.0, seed: int = 0) -> list[int]:
    out = [eng.start(slot, ids, temperature, 0, 1.0, seed)]
    for _ in range(n - 1):
        out += eng.step([slot], greedy=temperature == 0.0, filtered=False)
    return out


def test_next_turn_reuses_the_slot_and_equals_a_fresh_slot(model: TextModel) -> None:
    turn1 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is the capital of France?"}]
    used = BatchDecoder(model, n_slots=2, max_seq_len=512)
    fresh = BatchDecoder(model, n_slots=2, max_seq_len=512)
    ids1 = _ids(model, turn1)
    first = _reply(used, 0, ids1, 12)
    assert used.reused_tokens == 0 and used.prefilled_tokens == len(ids1)
    turn2 = turn1 + [{"role": "assistant", "content": model.tokenizer.decode(first)},
                     {"role": "user", "content": "And what is the capital of Spain?"}]
    ids2 = _ids(model, turn2)
    keep = used.shared(0, ids2)
    assert keep >= PREFIX_CHUNK and keep % PREFIX_CHUNK == 0 and ids2[:keep] == ids1[:keep]
    assert used.shared(1, ids2) == 0  # the other slot holds nothing

    got = _reply(used, 0, ids2, 16)
    assert used.reused_tokens == keep and used.prefilled_tokens == len(ids1) + len(ids2) - keep
    want = _reply(fresh, 1, ids2, 16)  # another slot of another decoder, from nothing
    assert fresh.reused_tokens == 0
    assert got == want
    n = len(ids2)
    assert torch.equal(used.cache.k[:, 0, :, :n], fresh.cache.k[:, 1, :, :n])
    assert torch.equal(used.cache.v[:, 0, :, :n], fresh.cache.v[:, 1, :, :n])

    # the same request again (all but the last chunk reused), greedy and sampled with a seed
    assert _reply(used, 0, ids2, 16) == want
    assert used.reused_tokens == keep + (n - 1) // PREFIX_CHUNK * PREFIX_CHUNK
    assert _reply(used, 0, ids2, 12, temperature=1.0, seed=7) == _reply(fresh, 0, ids2, 12, temperature=1.0, seed=7)


def test_a_prompt_that_differs_early_is_prefilled_whole(model: TextModel) -> None:
    eng = BatchDecoder(model, n_slots=1, max_seq_len=512)
    a = _ids(model, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hello there."}])
    b = _ids(model, [{"role": "system", "content": "You are a pirate."}, {"role": "user", "content": "Hello there."}])
    _reply(eng, 0, a, 2)
    assert eng.shared(0, b) == 0  # they part before the first chunk ends
    assert _reply(eng, 0, b, 8) == _reply(BatchDecoder(model, n_slots=1, max_seq_len=512), 0, b, 8)


def test_slot_pool_takes_the_best_scoring_free_slot() -> None:
    pool = SlotPool(4)
    assert pool.take() == 0 and pool.take() == 1  # no score: the last one given back (here: in order)
    pool.give(0)
    pool.give(1)
    score = {0: 64, 1: 0, 2: 64, 3: 32}
    assert pool.take(score.get) == 2  # 0 and 2 tie at 64: the one given back longest ago (2 never was)
    assert pool.take(score.get) == 0
    assert pool.take(score.get) == 3
    assert pool.take(lambda s: 0) == 1 and pool.take(score.get) is None
    pool.give(1)
    pool.give(3)
    assert pool.take(lambda s: 0) == 1  # all tie: the least recently given back


def test_prefix_reuse_can_be_turned_off(model: TextModel, monkeypatch) -> None:  # noqa: ANN001
    """``realtime serve --no-prefix-reuse`` → ServerConfig.text_prefix_reuse False → no slot reuses a
    prefix (the default reuses)."""
    import realtime.server
    from realtime.cli import main
    from realtime.config import ServerConfig
    from realtime.errors import ConfigError
    from realtime.text_service import TextService

    seen = []

    def refuse(cfg, *a, **k):  # noqa: ANN001, ANN002, ANN003, ANN202 - stands in for the app: the config is all we need
        seen.append(cfg)
        raise ConfigError("stop here")

    monkeypatch.setattr(realtime.server, "create_app", refuse)
    assert main(["serve", "--no-prefix-reuse"]) == 2 and main(["serve"]) == 2
    assert [c.text_prefix_reuse for c in seen] == [False, True]

    for on in (False, True):
        svc = TextService(ServerConfig(text_prefix_reuse=on), n_slots=1, max_seq_len=256)
        svc.model = model  # (load() reads the embedded model again otherwise)
        svc.load()
        eng = svc.engine
        ids = _ids(model, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hello there."}])
        _reply(eng, 0, ids, 2)
        assert eng.reuse_prefix is on and (eng.shared(0, ids + [5]) > 0) is on
