"""Batched token sampling on the device: greedy / temperature / top-k / top-p / Gumbel-max.

Everything stays on the logits' device with no host sync and no data-dependent Python branches,
so it can be captured in a CUDA graph. Randomness comes from a counter-based integer hash of
(seed, step, vocab index): a request's sample depends only on its own seed, step and logits, never
on which other requests share the batch or on a global RNG state.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

__all__ = ["sample", "greedy", "uniform_noise"]

_M32 = 0xFFFFFFFF


def _mul32(x: Tensor, c: int) -> Tensor:
    """(x * c) mod 2**32 for int64 x in [0, 2**32) without signed 64-bit overflow (c split in 16-bit halves)."""
    lo, hi = c & 0xFFFF, (c >> 16) & 0xFFFF
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _M32


def _hash32(x: Tensor) -> Tensor:
    """A well-mixing 32-bit integer hash (xor-shift-multiply, "lowbias32" constants) on int64 tensors."""
    x = x & _M32
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    x = x ^ (x >> 16)
    return x


def uniform_noise(seeds: Tensor, steps: Tensor, vocab: int) -> Tensor:
    """Uniform(0, 1) float32 noise [B, V], a pure function of (seed, step, vocab index)."""
    seeds = seeds.to(torch.long)
    steps = steps.to(torch.long)
    # Fold the 64-bit seed and the step into one 32-bit row key; each fold re-hashes so nearby
    # seeds/steps give unrelated streams.
    key = _hash32(seeds & _M32)
    key = _hash32(key ^ ((seeds >> 32) & _M32) ^ 0x9E3779B9)
    key = _hash32(key ^ (steps & _M32))
    key = _hash32(key ^ ((steps >> 32) & _M32) ^ 0x85EBCA6B)
    idx = torch.arange(vocab, device=seeds.device, dtype=torch.long)
    h = _hash32(key[:, None] ^ _hash32(idx + 0x27D4EB2F)[None, :])
    h = _hash32(h ^ 0x165667B1)
    # 24 high bits -> a float32-exact uniform strictly inside (0, 1).
    return ((h >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))


def greedy(logits: Tensor, chunked: bool | None = None) -> Tensor:
    """logits [B, V] -> argmax token ids [B] (long); the first index of the maximum, as ``argmax``.

    On CUDA a wide row is reduced in two stages: the maximum of each of C equal chunks, then the
    first chunk holding the largest. torch's argmax gives a single row one block, which took
    27 µs for a 128,256-token vocabulary on an H200; the chunked form is a few small launches.
    ``chunked``: force the two stages on (tests on the CPU) or off; default on CUDA only.
    """
    b, v = logits.shape
    c = _chunks(v) if (logits.is_cuda if chunked is None else chunked) else 0
    if not c:
        return logits.argmax(dim=-1)
    vals, idx = logits.reshape(b, c, v // c).max(dim=-1)  # [B, C]: each chunk's max, its first index
    best = vals.argmax(dim=-1, keepdim=True)  # [B, 1]: the first chunk holding the row's max
    return (best * (v // c) + idx.gather(1, best))[:, 0]


@functools.cache
def _chunks(v: int) -> int:
    """The largest chunk count in [64, 512] dividing ``v`` (0: none, or the row is short)."""
    if v < 16384:
        return 0
    return next((c for c in range(512, 63, -1) if v % c == 0), 0)


def sample(
    logits: Tensor,
    temperature: Tensor,
    top_k: Tensor,
    top_p: Tensor,
    seeds: Tensor,
    steps: Tensor,
    filtered: bool = True,
) -> Tensor:
    """Sample one token per row.

    logits [B, V]; temperature [B] (<= 0: greedy for that row); top_k [B] long (0 = off);
    top_p [B] (>= 1 = off); seeds [B] long; steps [B] long (the request's token counter).
    Order as in HF: temperature, then top-k, then top-p over the renormalised top-k set, then
    Gumbel-max over the kept tokens. Returns token ids [B] (long).
    ``filtered=False``: the caller knows no row uses top-k or top-p (the API default), so the
    vocabulary sort and the keep mask are skipped; the tokens are the same.
    """
    b, v = logits.shape
    dev = logits.device
    lg = logits.float()
    temp = temperature.to(device=dev, dtype=torch.float32)
    greedy_row = temp <= 0
    scaled = lg / torch.where(greedy_row, torch.ones_like(temp), temp)[:, None]
    u = uniform_noise(seeds.to(dev), steps.to(dev), v)
    gumbel = -torch.log(-torch.log(u))
    noisy = scaled + gumbel
    if filtered:  # (without top-k/top-p every token is kept: no sort)
        noisy = noisy.masked_fill(~_keep(scaled, top_k, top_p), float("-inf"))
    return torch.where(greedy_row, greedy(lg), greedy(noisy))


def _keep(scaled: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """The tokens top-k, then top-p over the renormalised top-k set, keep: scaled [B, V] -> bool [B, V]."""
    v = scaled.shape[1]
    dev = scaled.device
    sorted_lg, order = scaled.sort(dim=-1, descending=True)
    rank = torch.arange(v, device=dev)[None, :]
    k = top_k.to(device=dev, dtype=torch.long)
    k = torch.where(k <= 0, torch.full_like(k, v), k)
    keep_sorted = rank < k[:, None]
    # top-p over the top-k survivors: keep the smallest prefix whose mass reaches top_p (a token is
    # kept when the mass strictly before it is still below top_p; the first token always is).
    masked = sorted_lg.masked_fill(~keep_sorted, float("-inf"))
    probs = masked.softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs
    p = top_p.to(device=dev, dtype=torch.float32)
    keep_sorted = keep_sorted & ((before < p[:, None]) | (p[:, None] >= 1.0) | (rank == 0))
    return torch.zeros_like(keep_sorted).scatter(1, order, keep_sorted)
