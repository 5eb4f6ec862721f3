"""Device sampler: greedy, distribution, top-k/top-p sets, and batch-independent reproducibility."""

from __future__ import annotations

import pytest
import torch

from realtime.engines.sampling import greedy, sample, uniform_noise


def _params(b: int, temperature=1.0, top_k=0, top_p=1.0):
    return (
        torch.full((b,), float(temperature)),
        torch.full((b,), int(top_k), dtype=torch.long),
        torch.full((b,), float(top_p)),
    )


def test_greedy_equals_argmax() -> None:
    torch.manual_seed(0)
    logits = torch.randn(16, 1000)
    assert torch.equal(greedy(logits), logits.argmax(-1))
    t, k, p = _params(16, temperature=0.0, top_k=5, top_p=0.5)
    seeds = torch.arange(16)
    out = sample(logits, t, k, p, seeds, torch.zeros(16, dtype=torch.long))
    assert out.dtype == torch.long and torch.equal(out, logits.argmax(-1))
    # Mixed batch: greedy rows stay argmax while other rows sample.
    t[::2] = 1.0
    out = sample(logits, t, k, p, seeds, torch.zeros(16, dtype=torch.long))
    assert torch.equal(out[1::2], logits.argmax(-1)[1::2])


def test_noise_is_uniform_and_decorrelated() -> None:
    u = uniform_noise(torch.arange(4000), torch.zeros(4000, dtype=torch.long), 64)
    assert (u > 0).all() and (u < 1).all()
    assert abs(u.mean().item() - 0.5) < 0.005
    assert abs(u.var().item() - 1 / 12) < 0.002
    # Neighbouring vocab entries, seeds and steps are uncorrelated.
    c_vocab = torch.corrcoef(torch.stack([u[:, 0], u[:, 1]]))[0, 1]
    v2 = uniform_noise(torch.arange(4000), torch.ones(4000, dtype=torch.long), 64)
    c_step = torch.corrcoef(torch.stack([u.flatten(), v2.flatten()]))[0, 1]
    c_seed = torch.corrcoef(torch.stack([u[:-1].flatten(), u[1:].flatten()]))[0, 1]
    for c in (c_vocab, c_step, c_seed):
        assert abs(c.item()) < 0.03
    # Large and negative 64-bit seeds work and differ from their low 32 bits.
    big = torch.tensor([2**40 + 7, 7, -5], dtype=torch.long)
    w = uniform_noise(big, torch.zeros(3, dtype=torch.long), 8)
    assert not torch.equal(w[0], w[1]) and torch.isfinite(w).all()


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    n = counts.sum()
    exp = probs * n
    return float(((counts - exp) ** 2 / exp).sum())


def test_distribution_matches_softmax() -> None:
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    n = 30000
    for temperature in (1.0, 0.7):
        t, k, p = _params(n, temperature)
        out = sample(logits.expand(n, -1), t, k, p, torch.arange(n) * 7919 + 11, torch.full((n,), 3, dtype=torch.long))
        counts = torch.bincount(out, minlength=6).double()
        probs = (logits / temperature).double().softmax(-1)
        # 5 degrees of freedom: chi2 > 25 has p ~ 1e-4.
        assert _chi2(counts, probs) < 25, (temperature, counts / n, probs)
    # Same row, many steps (the per-request stream) is also softmax-distributed.
    steps = torch.arange(n)
    t, k, p = _params(n, 1.0)
    out = sample(logits.expand(n, -1), t, k, p, torch.full((n,), 42, dtype=torch.long), steps)
    assert _chi2(torch.bincount(out, minlength=6).double(), logits.double().softmax(-1)) < 25


def test_top_k_top_p_sets() -> None:
    torch.manual_seed(1)
    n, v = 4000, 50
    logits = torch.randn(v).expand(n, -1).contiguous()
    order = logits[0].argsort(descending=True)
    seeds, steps = torch.arange(n), torch.zeros(n, dtype=torch.long)

    t, k, p = _params(n, 1.5, top_k=5)
    out = sample(logits, t, k, p, seeds, steps)
    assert set(out.tolist()) == set(order[:5].tolist())  # all of the top 5 seen, nothing else
    counts = torch.bincount(out, minlength=v)[order[:5]].double()
    assert _chi2(counts, (logits[0, order[:5]] / 1.5).double().softmax(-1)) < 20

    probs = logits[0].softmax(-1)[order]
    cum = probs.cumsum(0)
    n_keep = int((cum < 0.6).sum()) + 1  # smallest prefix with mass >= 0.6
    t, k, p = _params(n, 1.0, top_p=0.6)
    out = sample(logits, t, k, p, seeds, steps)
    assert set(out.tolist()) == set(order[:n_keep].tolist())

    # top-k then top-p over the renormalised top-k set.
    t, k, p = _params(n, 1.0, top_k=3, top_p=0.8)
    out = sample(logits, t, k, p, seeds, steps)
    pk = logits[0, order[:3]].softmax(-1).cumsum(0)
    n_keep = int((pk < 0.8).sum()) + 1
    assert set(out.tolist()) == set(order[:n_keep].tolist())

    # top_p tiny keeps only the best token.
    t, k, p = _params(64, 1.0, top_p=1e-6)
    assert (sample(logits[:64], t, k, p, seeds[:64], steps[:64]) == order[0]).all()


def test_same_seed_and_step_same_token_whatever_the_batch() -> None:
    torch.manual_seed(2)
    v = 300
    rows = torch.randn(5, v)
    temp = torch.tensor([1.0, 0.8, 1.2, 0.0, 1.0])
    top_k = torch.tensor([0, 20, 0, 0, 7])
    top_p = torch.tensor([1.0, 0.9, 0.5, 1.0, 1.0])
    seeds = torch.tensor([5, 6, 7, 8, 2**33 + 1])
    steps = torch.tensor([0, 3, 9, 1, 100])
    full = sample(rows, temp, top_k, top_p, seeds, steps)
    for i in range(5):
        solo = sample(rows[i : i + 1], temp[i : i + 1], top_k[i : i + 1], top_p[i : i + 1], seeds[i : i + 1], steps[i : i + 1])
        assert solo.item() == full[i].item()
    perm = torch.tensor([3, 0, 4, 2, 1])
    shuffled = sample(rows[perm], temp[perm], top_k[perm], top_p[perm], seeds[perm], steps[perm])
    assert torch.equal(shuffled, full[perm])
    # Different seed or step generally gives different draws across many rows.
    n = 256
    flat = torch.zeros(n, v)
    t, k, p = _params(n, 1.0)
    a = sample(flat, t, k, p, torch.arange(n), torch.zeros(n, dtype=torch.long))
    b = sample(flat, t, k, p, torch.arange(n), torch.ones(n, dtype=torch.long))
    assert (a != b).float().mean() > 0.9
    assert len(set(a.tolist())) > 150  # uniform logits spread over the vocabulary


@pytest.mark.gpu
def test_cuda_equals_cpu() -> None:
    torch.manual_seed(3)
    n, v = 512, 1000
    logits = torch.randn(n, v) * 3
    temp = torch.rand(n) + 0.3
    top_k = torch.randint(0, 50, (n,))
    top_p = torch.rand(n) * 0.5 + 0.5
    seeds = torch.randint(-(2**62), 2**62, (n,))
    steps = torch.randint(0, 10_000, (n,))
    args = (logits, temp, top_k, top_p, seeds, steps)
    assert torch.equal(uniform_noise(seeds, steps, v), uniform_noise(seeds.cuda(), steps.cuda(), v).cpu())
    cpu = sample(*args)
    gpu = sample(*(a.cuda() for a in args)).cpu()
    # Same integer noise; float log/exp may differ in the last ulp, so allow a rare near-tie flip.
    assert (cpu == gpu).float().mean() > 0.995


@pytest.mark.parametrize("v", [128256, 49152, 20000])
def test_chunked_greedy_is_argmax_ties_included(v):
    """The two-stage argmax (chunk maxima, then the first chunk with the largest) = torch.argmax:
    the first index of the maximum, also when it repeats across and inside chunks; bf16 and fp32."""
    from realtime.engines.sampling import _chunks, greedy

    assert _chunks(v) > 0 and v % _chunks(v) == 0
    g = torch.Generator().manual_seed(v)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(6, v, generator=g).to(dtype)
        x[1, [7, v // 2, v - 1]] = 50.0  # a tie across chunks: the first wins
        x[2, [v - 2, v - 1]] = 50.0  # a tie inside the last chunk
        x[3] = 0.0  # all equal: index 0
        x[4, v - 1] = 50.0  # the very last index
        x[5, 0] = 50.0
        got = greedy(x, chunked=True)
        assert torch.equal(got, x.argmax(dim=-1)), (dtype, got, x.argmax(dim=-1))
        assert got[1] == 7 and got[2] == v - 2 and got[3] == 0 and got[4] == v - 1 and got[5] == 0


def test_unfiltered_path_equals_the_sorting_path() -> None:
    """``filtered=False`` (no row with top-k/top-p) skips the sort and gives the same tokens, greedy
    rows included, float32 and bf16 logits."""
    g = torch.Generator().manual_seed(3)
    for dtype in (torch.float32, torch.bfloat16):
        logits = (2 * torch.randn(12, 3000, generator=g)).to(dtype)
        t, k, p = _params(12, temperature=0.9)
        t[::3] = 0.0
        seeds, steps = torch.arange(12) * 7, torch.arange(12) + 3
        want = sample(logits, t, k, p, seeds, steps)
        assert torch.equal(sample(logits, t, k, p, seeds, steps, filtered=False), want)
        assert torch.equal(want[::3], logits.float().argmax(-1)[::3])
