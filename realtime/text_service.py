"""Text generation on the one scheduler: continuous batching over a static KV cache.

Lanes (both on the "generator" worker, priority INTERACTIVE):

- ``text.prefill``: a new request takes a free cache slot, its prompt is prefilled into that
  slot and its first token sampled (jobs wait here, queued, while every slot is busy).
- ``text.decode``: ONE batched ``decode_step`` for every active slot, then one batched sample.
  Requests join after their prefill and leave when they stop, between steps.

Per-slot decode state (last token, position, step counter, sampling parameters) lives in device
tensors owned by ``BatchDecoder``, so a step copies nothing to the device except the slot list
when the batch changes, and reads back exactly one thing: the sampled tokens [B]. Sampling uses
``engines.sampling.sample`` with each request's seed and token counter, so a seeded request gives
the same text alone or beside others. On CUDA the step can be captured as a CUDA graph per
batch-size bucket (padding rows use a scratch slot); ``cuda_graphs=False`` keeps it eager.

Python API (used by the voice agent)::

    job = service.submit([{"role": "user", "content": "Hi"}], GenParams(max_tokens=64))
    async for ev in job.stream():     # TextDelta(text, tokens) ..., then TextDone(...)
        ...                           # (or: done = await job.result())
    service.cancel(job)
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from realtime.errors import InternalError, OverloadedError, ProtocolError, RealtimeError
from realtime.protocol import text as tp
from realtime.protocol.text import GenParams, Request
from realtime.scheduler import Job, JobState, Lane, OutputChannel, Priority
from realtime.service import Service

if TYPE_CHECKING:
    from realtime.config import ServerConfig
    from realtime.engines.llama import TextModel
    from realtime.scheduler import Scheduler
    from realtime.server import AppState

log = logging.getLogger("realtime.text")

TOKEN_SLACK_S = 0.2  # a reader needs the next token within this; speech due sooner wins the worker
MIN_ROOM = 4  # output channel items kept free before a decode step (back-pressure)
MAX_QUEUED_PER_SLOT = 4  # requests waiting for a slot, per slot, before submit refuses
BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# A CUDA step picks its tokens and advances its slots in one launch (kernels/sampling.advance_rows),
# not by torch ops; the same tokens either way. REALTIME_TEXT_ADVANCE=0 keeps the torch ops.
_ADVANCE = os.environ.get("REALTIME_TEXT_ADVANCE", "1") != "0"
# CPU prefill runs on a grid of chunks of this many positions (see BatchDecoder): a prompt prefix a
# slot holds is reused in whole chunks. 32 rows a pass cost ~25 % more a token than one pass over a
# 500-token prompt (2-core VM), and a reused turn saves all of its history's chunks.
PREFIX_CHUNK = 32


# ---- the batched decoder (engine-side, no scheduler knowledge) -----------------------------------

def _logprobs(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """log_softmax of logits [B, V] (float32): the tokens' values [B], the top k's values and ids [B, k]."""
    lsm = torch.log_softmax(logits.float(), dim=-1)
    chosen = lsm.gather(1, tokens.view(-1, 1).to(torch.long))[:, 0]
    vals, ids = lsm.topk(k, dim=-1)  # (k = 0: empty)
    return chosen, vals, ids


def _logprob_lists(lp: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> list[tuple[float, list[tuple[int, float]]]]:
    """``_logprobs``' tensors -> each row's (its token's value, [(id, value)] of the top k)."""
    chosen, vals, ids = (t.tolist() for t in lp)
    return [(c, list(zip(i, v))) for c, v, i in zip(chosen, vals, ids)]


class StepResult:
    """The tokens of a launched decode step: on CUDA a pinned host copy and an event, so the host can
    launch the next step (which reads its tokens on the device) before it waits for this one."""

    __slots__ = ("_host", "_event", "_n", "_tokens", "_lp", "_lp_host")

    def __init__(self, tokens: list[int] | None = None, host: torch.Tensor | None = None,
                 event: Any = None, n: int = 0, logprobs: Any = None) -> None:
        self._tokens, self._host, self._event, self._n = tokens, host, event, n
        self._lp = logprobs  # (chosen [B], top values [B, k], top ids [B, k]) on the device, or None
        self._lp_host: list[tuple[float, list[tuple[int, float]]]] | None = None

    def logprobs(self) -> list[tuple[float, list[tuple[int, float]]]] | None:
        """Each row's (log probability of its token, [(id, log probability)] of the top k), when the
        step was launched with ``logprobs``; else None."""
        if self._lp is not None:
            self.result()
            self._lp_host, self._lp = _logprob_lists(self._lp), None  # (the device tensors freed)
        return self._lp_host

    def result(self) -> list[int]:
        if self._tokens is None:
            assert self._host is not None and self._event is not None
            self._event.synchronize()
            self._tokens = self._host[:self._n].tolist()
            self._host = self._event = None
        return self._tokens


class BatchDecoder:
    """A static KV cache of ``n_slots`` (+1 scratch slot) and the batched prefill/decode/sample.

    Device state per slot s: tok[s] (last sampled token, not yet in the cache), pos[s] (where it
    goes), step[s] (its index in the reply: the RNG counter), temp/top_k/top_p/seed[s], and for
    OpenAI's penalties freq/pres[s] and counts[s] (how often each token came in the reply so far).
    """

    def __init__(self, model: "TextModel", n_slots: int, max_seq_len: int, cuda_graphs: bool = False) -> None:
        self.model = model
        self.n_slots = n_slots
        self.max_seq_len = max_seq_len
        self.scratch = n_slots  # padding rows of a graphed step read/write only this slot
        self.cache = model.new_cache(n_slots + 1, max_seq_len)
        dev = model.device
        # On the CPU, prefill is compute-bound (SmolLM2 on a 2-core VM: 60 / 200 / 500 prompt
        # tokens took 125 / 376 / 993 ms), and a conversation's next turn (or another session with
        # the same system prompt) starts with a prompt a slot has already run. There a slot keeps
        # the prompt ids whose K/V it holds, and a new prompt prefills only from the last chunk
        # boundary they share. Prompts run in chunks on a fixed grid of absolute positions
        # (PREFIX_CHUNK), so a position's K/V and every logit come from the same computation
        # whether the chunks below were reused or not: replies stay the same bit for bit. Not on
        # CUDA (one pass there; no GPU run has checked reuse).
        self.reuse_prefix = dev.type == "cpu"
        self.held: list[list[int]] = [[] for _ in range(n_slots)]
        self.prefilled_tokens = 0  # prompt tokens run through prefill, and those whose K/V a slot already held
        self.reused_tokens = 0
        n = n_slots + 1
        self.tok = torch.zeros(n, dtype=torch.long, device=dev)
        self.pos = torch.zeros(n, dtype=torch.long, device=dev)
        self.step_no = torch.zeros(n, dtype=torch.long, device=dev)
        self.temp = torch.zeros(n, dtype=torch.float32, device=dev)
        self.top_k = torch.zeros(n, dtype=torch.long, device=dev)
        self.top_p = torch.ones(n, dtype=torch.float32, device=dev)
        self.seed = torch.zeros(n, dtype=torch.long, device=dev)
        self.freq = torch.zeros(n, dtype=torch.float32, device=dev)
        self.pres = torch.zeros(n, dtype=torch.float32, device=dev)
        # [slots + 1, V] float32 (129 x 128,256: 66 MB on a GPU; 9 x 49,152: 1.8 MB for SmolLM2 on the
        # CPU), made when a request first asks for a penalty; counted only by "penalize" steps,
        # the only ones that read it (and that run only with a penalised slot in the batch)
        self.counts: torch.Tensor | None = None
        self.start_logprobs: tuple[float, list[tuple[int, float]]] | None = None  # start()'s, when asked
        self._step_lp: Any = None  # _eager's log probabilities, when asked
        self.fused_advance = False  # see use_fused_advance, set below
        self._out: torch.Tensor | None = None  # advance_rows' tokens and scratch, made on first use
        self._work: tuple[torch.Tensor, torch.Tensor] | None = None
        self.cuda_graphs = bool(cuda_graphs) and dev.type == "cuda"
        if self.cuda_graphs and n_slots > BUCKETS[-1]:
            from realtime.errors import ConfigError

            raise ConfigError(f"CUDA-graphed decode supports at most {BUCKETS[-1]} slots, got {n_slots}")
        self._idx_key: tuple[int, ...] | None = None
        self._idx: torch.Tensor | None = None
        self._graphs: dict[tuple[int, str], tuple[Any, torch.Tensor, torch.Tensor]] = {}  # (bucket, mode)
        self._host: list[torch.Tensor] | None = None  # two pinned token buffers (launch/result)
        self._events: list[Any] = []  # one CUDA event per pinned buffer, recorded again at each use
        self._next_host = 0
        self._host_owner: list[StepResult | None] = [None, None]
        self._graph_idx: dict[tuple[int, str], tuple[int, ...]] = {}  # rows last copied into each graph's idx_buf
        # On CUDA with the kernels on (REALTIME_TEXT_ADVANCE=0 turns it off), a greedy or temperature-only
        # step's tokens and its slots' tok / pos / step_no come from one launch (advance_rows), not
        # a dozen torch ops; tests set it on the CPU (TRITON_INTERPRET=1) to compare the two.
        from realtime.engines.transformer import use_kernels

        self.use_fused_advance(dev.type == "cuda" and use_kernels() and _ADVANCE)

    @property
    def device(self) -> torch.device:
        return self.model.device

    def use_fused_advance(self, on: bool) -> None:
        """Pick a step's tokens and advance its slots in one launch (``advance_rows``), or by torch ops."""
        from realtime.kernels.sampling import advance_work

        if bool(on) != self.fused_advance:  # (graphs captured the other way are captured again)
            self._graphs.clear()
            self._graph_idx.clear()
        self.fused_advance = bool(on)
        if on and self._work is None:
            rows = max(BUCKETS[-1], self.n_slots + 1)
            self._out = torch.zeros(rows, dtype=torch.long, device=self.device)
            self._work = advance_work(rows, self.device)

    def _advances(self, mode: str) -> bool:
        """Whether a step of ``mode`` ends in advance_rows (its tokens and the slots' bookkeeping)."""
        return self.fused_advance and mode in ("greedy", "sample")

    @torch.inference_mode()
    def start(self, slot: int, ids: Sequence[int], temperature: float, top_k: int, top_p: float, seed: int,
              frequency_penalty: float = 0.0, presence_penalty: float = 0.0, logprobs: int | None = None) -> int:
        """Prefill prompt ids [T] into ``slot`` and sample the reply's first token (returned). The
        slot is reset first, unless it holds K/V of a prefix of ``ids`` (``shared``, in whole
        chunks): then only the chunks after it are run. The penalties count the reply's tokens
        (not the prompt's) in the steps that ask for them (``penalized``). ``logprobs`` (top k):
        the first token's log probabilities go to ``start_logprobs``."""
        assert 0 <= slot < self.n_slots and 0 < len(ids) <= self.max_seq_len
        from realtime.engines.sampling import sample

        ids = list(ids)
        keep = self.shared(slot, ids)
        self.held[slot] = []  # until the prefill is through (a failed one leaves nothing to reuse)
        if keep == 0:
            self.cache.reset([slot])
        if self.reuse_prefix:  # the fixed grid: chunk c covers positions [c * PREFIX_CHUNK, (c + 1) * PREFIX_CHUNK)
            for at in range(keep, len(ids), PREFIX_CHUNK):
                logits = self.model.prefill(self.cache, slot, ids[at:at + PREFIX_CHUNK], start_pos=at)
            self.held[slot] = ids
        else:
            logits = self.model.prefill(self.cache, slot, ids)
        self.prefilled_tokens += len(ids) - keep
        self.reused_tokens += keep
        self.temp[slot] = float(temperature)
        self.top_k[slot] = int(top_k)
        self.top_p[slot] = float(top_p)
        self.seed[slot] = int(seed)
        self.freq[slot] = float(frequency_penalty)
        self.pres[slot] = float(presence_penalty)
        self.step_no[slot] = 0
        s = slice(slot, slot + 1)
        first = sample(logits[None], self.temp[s], self.top_k[s], self.top_p[s], self.seed[s], self.step_no[s])
        self.tok[s] = first
        if frequency_penalty or presence_penalty:  # (the reply's first token: nothing to penalise yet)
            if self.counts is None:
                self.counts = torch.zeros(self.n_slots + 1, self.model.vocab_size, dtype=torch.float32,
                                          device=self.device)
            self.counts[slot].zero_()
            self.counts[slot, first] = 1.0
        self.start_logprobs = None
        if logprobs is not None:
            self.start_logprobs = _logprob_lists(_logprobs(logits[None], first, logprobs))[0]
        self.pos[slot] = len(ids)
        self.step_no[slot] = 1
        return int(first.item())  # one read per new request

    def shared(self, slot: int, ids: Sequence[int]) -> int:
        """How many leading ids of ``ids`` the slot holds K/V of, down to a whole number of chunks
        and short of the last id (whose logits the prefill makes); 0 where prefixes are not reused."""
        if not self.reuse_prefix:
            return 0
        held, n = self.held[slot], min(len(self.held[slot]), len(ids) - 1)
        i = 0
        while i < n and held[i] == ids[i]:
            i += 1
        return i // PREFIX_CHUNK * PREFIX_CHUNK

    def _eager(self, idx: torch.Tensor, mode: str, logprobs: int | None = None) -> torch.Tensor:
        from realtime.engines.sampling import greedy as argmax
        from realtime.engines.sampling import sample
        from realtime.engines.transformer import use_kernels

        pos = self.pos[idx]
        fused = self._advances(mode) and logprobs is None
        logits = self.model.decode_step(self.cache, idx, self.tok[idx], pos, float32=not fused)
        raw = logits  # (logprobs are the model's, before penalties and temperature)
        if fused:  # the tokens and the slots' tok / pos / step_no in one launch (kernels/sampling.py)
            from realtime.kernels.sampling import advance_rows

            sampled = dict(temperature=self.temp, seeds=self.seed) if mode == "sample" else {}
            return advance_rows(logits, idx, self.tok, self.pos, self.step_no, self._out, self.scratch,
                                work=self._work, **sampled)
        if mode == "penalize":  # OpenAI's: logit - frequency * count - presence * (count > 0), then sample
            assert self.counts is not None, "a penalize step with no penalised request started"
            c = self.counts[idx]
            logits = logits - self.freq[idx, None] * c - self.pres[idx, None] * (c > 0).to(c.dtype)
        if mode == "greedy":
            nxt = argmax(logits)
        elif mode == "sample" and logits.is_cuda and use_kernels():  # one Triton pass, chunked rows
            from realtime.kernels.sampling import gumbel_argmax

            nxt = gumbel_argmax(logits, self.temp[idx], self.seed[idx], self.step_no[idx])
        else:
            nxt = sample(logits, self.temp[idx], self.top_k[idx], self.top_p[idx], self.seed[idx], self.step_no[idx],
                         filtered=mode in ("filter", "penalize"))
        if mode == "penalize":  # (padding rows count into the scratch slot, whose penalties are 0)
            self.counts.index_put_((idx, nxt), torch.ones_like(nxt, dtype=self.counts.dtype), accumulate=True)
        self.tok[idx] = nxt
        self.pos[idx] = pos + 1
        self.step_no[idx] = self.step_no[idx] + 1
        if logprobs is not None:
            self._step_lp = _logprobs(raw, nxt, logprobs)
        return nxt

    @torch.inference_mode()
    def step(self, slots: Sequence[int], greedy: bool = False, filtered: bool = True,
             penalized: bool = False, logprobs: int | None = None) -> list[int]:
        """One token for each slot in ``slots`` (each at its own position) → the sampled ids.

        ``greedy``: every row has temperature 0 (argmax only; the host knows this, the device need
        not branch). ``filtered=False``: no row uses top-k or top-p (no vocabulary sort).
        ``penalized``: some row has a frequency or presence penalty (then the step applies and
        counts them for every row, greedy or not). ``logprobs`` (top k, 0..20): the step also
        computes each row's log probabilities (``StepResult.logprobs``): such a step runs eagerly,
        not from a CUDA graph. The caller keeps every pos < max_seq_len.
        """
        return self.launch(slots, greedy, filtered, penalized, logprobs).result()

    @staticmethod
    def _mode(greedy: bool, filtered: bool, penalized: bool = False) -> str:
        if penalized:
            return "penalize"
        return "greedy" if greedy else "filter" if filtered else "sample"

    @torch.inference_mode()
    def launch(self, slots: Sequence[int], greedy: bool = False, filtered: bool = True,
               penalized: bool = False, logprobs: int | None = None) -> StepResult:
        """``step`` without the wait: the step is queued, its tokens come from ``.result()``. Each
        slot's next input token stays on the device, so the next step may be launched first and the
        host's work (reading, detokenising) overlaps the GPU's."""
        if not slots:
            return StepResult([])
        mode = self._mode(greedy, filtered, penalized)
        # Steps with logprobs run eagerly (their log probabilities are not a graph's output); the
        # "penalize" steps are graphed like the others, each bucket captured at its first use (the
        # counts they read are made when a request first asks for a penalty)
        if self.cuda_graphs and logprobs is None:
            return self._to_host(self._graphed(slots, mode), len(slots))
        key = tuple(slots)
        if key != self._idx_key:  # the batch changed: one small host→device copy
            self._idx = self._to_device(key)
            self._idx_key = key
        nxt = self._eager(self._idx, mode, logprobs)
        lp, self._step_lp = self._step_lp, None
        if nxt.is_cuda:
            return self._to_host(nxt, len(slots), lp)
        return StepResult(nxt.tolist(), logprobs=lp)

    def _to_host(self, out: torch.Tensor, n: int, logprobs: Any = None) -> StepResult:
        """Queue the copy of out[:n] into the next of two pinned buffers, with an event."""
        if self._host is None:
            cap = max(BUCKETS[-1], self.n_slots + 1)
            self._host = [torch.empty(cap, dtype=torch.long, pin_memory=True) for _ in range(2)]
            self._events = [torch.cuda.Event() for _ in range(2)]
        i = self._next_host
        self._next_host ^= 1
        if self._host_owner[i] is not None:  # still unread: read it before its buffer and event are reused
            self._host_owner[i].result()
        buf = self._host[i]
        buf[:n].copy_(out[:n], non_blocking=True)
        event = self._events[i]
        event.record()
        res = StepResult(host=buf, event=event, n=n, logprobs=logprobs)
        self._host_owner[i] = res
        return res

    def _to_device(self, values: Sequence[int]) -> torch.Tensor:
        host = torch.tensor(values, dtype=torch.long)
        if self.device.type == "cuda":  # pinned + async: the copy does not wait for the device
            return host.pin_memory().to(self.device, non_blocking=True)
        return host

    def _bucket(self, b: int) -> int:
        for size in BUCKETS:
            if size >= b:
                return size
        raise AssertionError(f"batch {b} above the largest bucket")

    def _graphed(self, slots: Sequence[int], mode: str) -> torch.Tensor:
        b = len(slots)
        size = min(self._bucket(b), self._bucket(self.n_slots))
        entry = self._graphs.get((size, mode))
        if entry is None:
            entry = self._capture(size, mode)
        graph, idx_buf, out = entry
        padded = tuple(slots) + (self.scratch,) * (size - b)
        if self._graph_idx.get((size, mode)) != padded:  # the batch changed: one small host→device copy
            idx_buf.copy_(self._to_device(padded), non_blocking=True)
            self._graph_idx[(size, mode)] = padded
        graph.replay()
        return out

    def _capture(self, size: int, mode: str) -> tuple[Any, torch.Tensor, torch.Tensor]:
        """Capture one step for a static slot buffer of ``size`` rows (warm-up runs on the scratch slot)."""
        from realtime.cuda_graphs import capture

        idx_buf = torch.full((size,), self.scratch, dtype=torch.long, device=self.device)
        saved = [t[self.scratch].clone() for t in (self.tok, self.pos, self.step_no)]

        def step() -> torch.Tensor:
            out = self._eager(idx_buf, mode)
            if not self._advances(mode):  # (advance_rows puts the scratch slot back itself)
                self._reset_scratch()
            return out

        # Each graph keeps its own memory pool: simpler to reason about than a shared one, and the
        # intermediates of one step are small next to the weights and the KV cache.
        graph, out = capture(step, None, warmups=2, device=self.device, error_mode="thread_local")
        for t, v in zip((self.tok, self.pos, self.step_no), saved, strict=True):
            t[self.scratch] = v
        self._graphs[(size, mode)] = (graph, idx_buf, out)
        return self._graphs[(size, mode)]

    def _reset_scratch(self) -> None:
        # Padding rows advance the scratch slot's position; pin it at 0 so it never runs off the cache.
        # (a slice's zero_: a Python-scalar setitem would copy a CPU tensor, which graph capture refuses)
        self.pos[self.scratch:].zero_()
        self.step_no[self.scratch:].zero_()

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Capture every bucket up to n_slots (CUDA graphs only; warm-up). ("penalize" steps are
        captured at their first use: their counts do not exist before a request asks for a penalty.)"""
        if not self.cuda_graphs:
            return
        for size in BUCKETS:
            for mode in ("greedy", "sample", "filter"):
                if (size, mode) not in self._graphs:
                    self._capture(size, mode)
            if size >= self.n_slots:
                break


# ---- jobs ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TextDelta:
    text: str
    tokens: int  # completion tokens this delta covers (text may be held back across tokens)
    logprobs: list[dict[str, Any]] | None = None  # OpenAI's token entries of the tokens whose text this is


@dataclass(frozen=True)
class TextDone:
    finish_reason: str  # "stop" (eos or a stop string), "length" (max_tokens or context full), "cancelled"
    prompt_tokens: int
    completion_tokens: int
    ttft_ms: float | None
    tokens_per_s: float | None
    text: str  # the whole reply as emitted
    logprobs: list[dict[str, Any]] | None = None  # every delta's entries, when the request asked


class TextJob(Job):
    """One request: prompt ids, sampling settings, stop conditions, and its output channel."""

    priority = Priority.INTERACTIVE

    def __init__(self, ids: list[int], params: GenParams, seed: int, max_new: int,
                 tokenizer: Any, eos_ids: set[int]) -> None:
        from realtime.engines.tokenizer import StreamDecoder

        super().__init__()
        self.ids = ids
        self.params = params
        self.seed = seed
        self.max_new = max_new
        self.eos_ids = eos_ids
        self.tokenizer = tokenizer
        self.decoder = StreamDecoder(tokenizer)
        self.matcher = tp.StopMatcher(params.stop)
        # with logprobs: the entries of tokens whose text is not out yet (held bytes or a possible
        # stop string), and all the entries sent
        self.lp_pending: list[dict[str, Any]] = []
        self.lp_sent: list[dict[str, Any]] | None = [] if params.logprobs else None
        self.output = OutputChannel(capacity=256)
        self.slot: int | None = None
        self.prefilled = False
        self.completion_tokens = 0
        self.pending_tokens = 0
        self.text_parts: list[str] = []
        self.t_submit = time.monotonic()
        self.t_first: float | None = None
        self.t_last = self.t_submit
        self.finish_reason: str | None = None
        self._event: asyncio.Event | None = None
        self.wake: Callable[[], None] | None = None  # set by TextService.submit: the scheduler's wake

    def deadline(self, now: float) -> float:
        if not self.prefilled:
            return self.created  # first token first, as for first audio
        return self.t_last + TOKEN_SLACK_S

    def notify(self) -> None:
        self.output.close()

    @property
    def prompt_tokens(self) -> int:
        return len(self.ids)

    @property
    def text(self) -> str:
        return "".join(self.text_parts)

    def summary(self, reason: str | None = None) -> TextDone:
        ttft = None if self.t_first is None else (self.t_first - self.t_submit) * 1000
        rate = None
        if self.t_first is not None and self.completion_tokens > 1 and self.t_last > self.t_first:
            rate = (self.completion_tokens - 1) / (self.t_last - self.t_first)
        return TextDone(reason or self.finish_reason or "cancelled", self.prompt_tokens, self.completion_tokens,
                        ttft, rate, self.text, None if self.lp_sent is None else list(self.lp_sent))

    # ---- asyncio side ----
    def bind(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Deliver output wake-ups to ``loop`` (default: the running loop). Idempotent."""
        if self._event is None:
            self._event = asyncio.Event()
            self.output.bind(loop or asyncio.get_running_loop(), self._event)

    async def stream(self, wake: Callable[[], None] | None = None) -> AsyncIterator[TextDelta | TextDone]:
        """Yield TextDelta ..., then one TextDone (finish_reason "cancelled" when cancelled).
        Raises the job's RealtimeError if it failed (an InternalError for engine bugs).
        ``wake`` (default: the scheduler's, set at submit) is called when items were taken, so a
        job held back by a full channel steps again."""
        self.bind()
        wake = wake or self.wake
        assert self._event is not None
        while True:
            items = self.output.take()
            if items and wake is not None:
                wake()  # room in the channel again: the decode lane may step this job
            for item in items:
                yield item  # type: ignore[misc]
                if isinstance(item, TextDone):
                    return
            if not items:
                if self.state is JobState.FAILED:
                    err = self.error
                    raise err if isinstance(err, RealtimeError) else InternalError("text generation failed")
                if self.state is JobState.CANCELLED or (self.output.closed and not self.output.items):
                    yield self.summary("cancelled")
                    return
                await self._event.wait()
                self._event.clear()

    async def result(self, wake: Callable[[], None] | None = None) -> TextDone:
        """Wait for the whole reply."""
        done = None
        async for ev in self.stream(wake):
            if isinstance(ev, TextDone):
                done = ev
        assert done is not None
        return done

    # ---- worker side ----
    def on_token(self, tok: int, now: float, context_full: bool,
                 lp: tuple[float, list[tuple[int, float]]] | None = None) -> bool:
        """Account one sampled token (``lp``: its log probability and the top alternatives', when the
        request asked); put deltas/done on the channel. Returns True when the job ended. The
        entries go out with the delta that carries the token's text; those of tokens whose text
        never comes out (eos, a stop string) are not sent."""
        self.completion_tokens += 1
        self.pending_tokens += 1
        if self.t_first is None:
            self.t_first = now
        self.t_last = now
        if tok in self.eos_ids:
            self._finish("stop")
            return True
        if lp is not None and self.lp_sent is not None:
            tb = self.tokenizer.token_bytes
            self.lp_pending.append(tp.logprob_entry(tb(tok), lp[0], [(tb(i), v) for i, v in lp[1]]))
        out = self.matcher.push(self.decoder.push(tok))
        if self.matcher.stopped:
            self._put(out)
            self._finish("stop", flush=False)
            return True
        if self.completion_tokens >= self.max_new or context_full:
            self._put(out)
            self._finish("length")
            return True
        self._put(out)
        return False

    def _put(self, text: str) -> None:
        if text:
            self.text_parts.append(text)
            entries = None
            if self.lp_sent is not None:
                entries, self.lp_pending = self.lp_pending, []
                self.lp_sent.extend(entries)
            self.output.put(TextDelta(text, self.pending_tokens, entries))
            self.pending_tokens = 0

    def _finish(self, reason: str, flush: bool = True) -> None:
        if flush and not self.matcher.stopped:
            tail = self.matcher.push(self.decoder.flush())
            self._put(tail if self.matcher.stopped else tail + self.matcher.flush())
        self.pending_tokens = 0  # tokens that made no text (eos, held bytes) count in usage only
        self.finish_reason = "stop" if self.matcher.stopped else reason
        with self.lock:
            if self.active:
                self.output.put(self.summary())
                self.state = JobState.FINISHED
        self.output.close()


# ---- lanes ---------------------------------------------------------------------------------------

class SlotPool:
    def __init__(self, n: int) -> None:
        self.free = list(range(n))[::-1]
        self.lock = threading.Lock()

    def take(self, score: Callable[[int], int] | None = None) -> int | None:
        """A free slot (None: none): the last one given back, or with ``score`` the free slot that
        scores highest. Ties go to the one given back longest ago: the most recent ones likely hold
        conversations whose next turn is coming."""
        with self.lock:
            if not self.free:
                return None
            if score is None:
                return self.free.pop()
            best = max(range(len(self.free)), key=lambda i: (score(self.free[i]), -i))
            return self.free.pop(best)

    def give(self, slot: int) -> None:
        with self.lock:
            assert slot not in self.free
            self.free.append(slot)

    def available(self) -> int:
        return len(self.free)


class TextPrefillLane(Lane):
    name = "text.prefill"
    worker = "generator"
    max_batch = 4  # prefills per step (each its own forward): bounds the pause seen by decoding streams

    def __init__(self, service: "TextService") -> None:
        super().__init__()
        self.svc = service
        self.pool = SlotPool(service.engine.n_slots)

    def is_ready(self, job: TextJob) -> bool:  # type: ignore[override]
        return not job.prefilled and self.pool.available() > 0

    def run(self, jobs: list[TextJob]) -> None:  # type: ignore[override]
        eng = self.svc.engine
        for job in jobs:
            if not job.active or job.prefilled:
                continue
            if job.slot is None:  # the free slot that holds the longest prefix of the prompt
                job.slot = self.pool.take(lambda slot, ids=job.ids: eng.shared(slot, ids))
                if job.slot is None:
                    return  # every slot busy: the rest wait for a release
            p = job.params
            try:
                tok = eng.start(job.slot, job.ids, p.temperature, p.top_k, p.top_p, job.seed,
                                p.frequency_penalty, p.presence_penalty, p.top_logprobs if p.logprobs else None)
            except RealtimeError as exc:  # fail only this request
                job.fail(exc)
                continue
            job.prefilled = True
            now = time.monotonic()
            self.svc.observe_ttft(now - job.t_submit)
            job.on_token(tok, now, context_full=len(job.ids) >= eng.max_seq_len, lp=eng.start_logprobs)

    def release(self, job: Job) -> None:
        slot = getattr(job, "slot", None)
        if slot is not None:
            self.pool.give(slot)


class TextDecodeLane(Lane):
    name = "text.decode"
    worker = "generator"

    def __init__(self, service: "TextService") -> None:
        super().__init__()
        self.svc = service
        self.max_batch = service.engine.n_slots
        self.tokens = 0  # tokens produced by decode steps (for stats/tests)
        self.dropped = 0  # tokens of a step in flight when its reply ended (pipelined only)
        # One step in flight on CUDA (REALTIME_TEXT_PIPELINE=0: read each step before the next).
        self.pipelined = service.engine.device.type == "cuda" and os.environ.get("REALTIME_TEXT_PIPELINE", "1") != "0"
        self._inflight: tuple[list[TextJob], StepResult] | None = None
        self._inflight_jobs: frozenset[TextJob] = frozenset()

    def is_ready(self, job: TextJob) -> bool:  # type: ignore[override]
        if not job.prefilled or job.finish_reason is not None:
            return False
        return job.output.room() > MIN_ROOM or job in self._inflight_jobs  # (its token waits to be read)

    def run(self, jobs: list[TextJob]) -> None:  # type: ignore[override]
        """Launch this step, then read the previous one (pipelined on CUDA: the GPU runs step n+1 while
        the host detokenises step n). A job whose in-flight token may end it by length or context
        is not stepped again; one that stops on eos/stop text had one extra token computed, dropped."""
        eng = self.svc.engine
        prev, prev_jobs = self._inflight, self._inflight_jobs
        step = [j for j in jobs if j.active and j.finish_reason is None and j.output.room() > MIN_ROOM
                and self._room_after(j, 1 if j in prev_jobs else 0)]
        cur = None
        if step:
            step.sort(key=lambda j: j.slot)  # a stable slot order keeps the device slot list cached
            greedy = all(j.params.temperature <= 0 for j in step)
            filtered = any(j.params.filtered for j in step)
            penalized = any(j.params.penalized for j in step)
            asks = [j.params.top_logprobs for j in step if j.params.logprobs]
            cur = (step, eng.launch([j.slot for j in step], greedy=greedy, filtered=filtered, penalized=penalized,
                                    logprobs=max(asks) if asks else None))
        if self.pipelined:
            self._inflight, self._inflight_jobs = cur, frozenset(step)
        else:
            self._inflight, self._inflight_jobs = None, frozenset()
        if prev is not None:
            self._deliver(*prev)
        if cur is not None and not self.pipelined:
            self._deliver(*cur)

    def _room_after(self, job: TextJob, inflight: int) -> bool:
        """May ``job`` take another step with ``inflight`` tokens not yet read? (No when one of those
        could end it by max tokens, or the step would write past the cache.)"""
        done = job.completion_tokens + inflight
        # the step writes the last sampled token at pos = prompt + done - 1
        return done < job.max_new and len(job.ids) + done <= self.svc.engine.max_seq_len

    def _deliver(self, jobs: list[TextJob], result: "StepResult") -> None:
        toks = result.result()
        lps = result.logprobs()
        now = time.monotonic()
        max_seq = self.svc.engine.max_seq_len
        for i, (job, tok) in enumerate(zip(jobs, toks, strict=True)):
            if not job.active or job.finish_reason is not None:
                self.dropped += 1  # ended (eos, stop, cancel) after this step was launched
                continue
            self.tokens += 1
            # pos of the token just sampled = prompt + tokens so far - 1; it needs a cache row too
            full = len(job.ids) + job.completion_tokens >= max_seq
            job.on_token(tok, now, context_full=full, lp=lps[i] if lps is not None and job.params.logprobs else None)


# ---- the service ---------------------------------------------------------------------------------

class TextService(Service):
    """Chat/text completion over the scheduler: /v1/text (WebSocket) and /v1/chat/completions."""

    name = "text"

    def __init__(self, config: "ServerConfig", *, n_slots: int | None = None, max_seq_len: int | None = None,
                 model: "TextModel | None" = None, cuda_graphs: bool | None = None) -> None:
        self.config = config
        self.model = model
        self.n_slots = n_slots
        self.max_seq_len = max_seq_len
        self.cuda_graphs = cuda_graphs
        self.engine: BatchDecoder | None = None
        self.scheduler: "Scheduler | None" = None
        self.prefill_lane: TextPrefillLane | None = None
        self.decode_lane: TextDecodeLane | None = None
        self._state: Callable[[], "AppState"] | None = None
        self._seed_lock = threading.Lock()
        self._seed_gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(8), "little") >> 1)

    # ---- lifecycle ----
    def load(self) -> None:
        if self.engine is not None:
            return  # loaded already (a service reused across apps in tests)
        from realtime.engines.llama import TextModel

        t0 = time.perf_counter()
        cuda = self.config.generator_device.startswith("cuda")
        if self.model is None:
            self.model = TextModel.from_pretrained(self.config.text_model, device=self.config.generator_device,
                                                   dtype=getattr(torch, self.config.dtype),
                                                   cpu_native=not cuda and not self.config.text_exact)
        if self.model.tokenizer is None:
            from realtime.errors import ConfigError

            raise ConfigError("the text model has no tokenizer")
        # text_slots / text_context: ServerConfig fields proposed to the lead (absent: defaults)
        n = self.n_slots or getattr(self.config, "text_slots", None) or (64 if cuda else 16)
        seq = self.max_seq_len or getattr(self.config, "text_context", None) or (4096 if cuda else 2048)
        seq = min(seq, self.model.max_seq_len)
        graphs = cuda if self.cuda_graphs is None else self.cuda_graphs
        self.engine = BatchDecoder(self.model, n, seq, cuda_graphs=graphs)
        self.engine.reuse_prefix &= self.config.text_prefix_reuse
        log.info("text model %s: %d slots x %d tokens on %s in %.1fs", self.model.name, n, seq,
                 self.config.generator_device, time.perf_counter() - t0)

    def attach(self, scheduler: "Scheduler") -> None:
        assert self.engine is not None, "load() first"
        self.scheduler = scheduler
        self.prefill_lane = scheduler.add_lane(TextPrefillLane(self))  # type: ignore[assignment]
        self.decode_lane = scheduler.add_lane(TextDecodeLane(self))  # type: ignore[assignment]

    def warmup(self) -> None:
        eng = self.engine
        assert eng is not None
        t0 = time.perf_counter()
        slot = eng.n_slots - 1  # not yet handed out: the scheduler has not started
        eng.start(slot, self.tokenizer.encode("Hello"), 0.0, 0, 1.0, 0)
        eng.step([slot], greedy=True)
        eng.capture_all()
        log.info("warmed up text model in %.2fs", time.perf_counter() - t0)

    def describe(self) -> list[dict[str, Any]]:
        if self.model is None or self.engine is None:
            return []
        return [{"id": self.model.name, "object": "model", "kind": "text",
                 "context_tokens": self.engine.max_seq_len, "slots": self.engine.n_slots}]

    @property
    def tokenizer(self) -> Any:
        assert self.model is not None
        return self.model.tokenizer

    @property
    def model_name(self) -> str:
        return self.model.name if self.model is not None else "text"

    def observe_ttft(self, seconds: float) -> None:
        if self._state is not None:
            try:
                self._state().metrics.text_ttft.observe(seconds)
            except KeyError:  # app not started (Python API use without the server)
                pass

    # ---- Python API ----
    def encode(self, request: Request) -> list[int]:
        tok = self.tokenizer
        if request.messages is not None:
            # The template writes BOS itself where the model wants one.
            return tok.encode(tok.apply_chat_template(list(request.messages)), add_special=False)
        assert request.prompt is not None
        return tok.encode(request.prompt, add_special=True)

    def free_slots(self) -> int:
        """KV-cache slots no request holds now (a new prompt starts at once while there is one)."""
        return self.prefill_lane.pool.available() if self.prefill_lane is not None else 0

    def submit(self, request: "Request | Sequence[dict[str, str]] | str", params: GenParams | None = None) -> TextJob:
        """Queue a request: a Request, chat messages, or a raw prompt string (+ params).

        Raises ProtocolError (bad messages, prompt longer than the context) and OverloadedError
        (server full). Call from the event loop thread (the job's channel binds to it) or any
        thread (then call ``job.bind(loop)`` before consuming).
        """
        assert self.engine is not None and self.scheduler is not None, "load() and attach() first"
        if not isinstance(request, Request):
            params = params or GenParams()
            if isinstance(request, str):
                request = Request(None, request, params)
            else:
                request = Request(tp.parse_messages(list(request)), None, params)
        ids = self.encode(request)
        limit = self.engine.max_seq_len
        if not ids:
            raise ProtocolError("the prompt is empty", code="bad_field")
        if len(ids) >= limit:
            raise ProtocolError(f"the prompt has {len(ids)} tokens; this model's context is {limit}",
                                code="context_length_exceeded")
        p = request.params
        room = limit - len(ids)
        max_new = room if p.max_tokens is None else min(p.max_tokens, room)
        if p.seed is None:
            with self._seed_lock:
                seed = int(torch.randint(0, 2**62, (), generator=self._seed_gen))
        else:
            seed = p.seed
        assert self.prefill_lane is not None and self.decode_lane is not None
        waiting = sum(1 for j in list(self.prefill_lane.jobs) if not getattr(j, "prefilled", True))
        if waiting >= MAX_QUEUED_PER_SLOT * self.engine.n_slots:
            raise OverloadedError("too many text requests are waiting; try again shortly")
        job = TextJob(ids, p, seed, max_new, self.tokenizer, set(self.tokenizer.eos_ids))
        try:
            job.bind()
        except RuntimeError:  # no running loop in this thread: the caller binds
            pass
        job.wake = self.scheduler.wake
        self.scheduler.submit(job, [self.prefill_lane, self.decode_lane])
        return job

    def cancel(self, job: TextJob) -> None:
        assert self.scheduler is not None
        self.scheduler.cancel(job)

    def wake(self) -> None:
        if self.scheduler is not None:
            self.scheduler.wake()

    # ---- routes ----
    def routes(self, state: Callable[[], "AppState"]) -> list:
        from starlette.routing import Route, WebSocketRoute

        self._state = state

        async def text_ws(ws):  # noqa: ANN001, ANN202
            from realtime.server import run_websocket

            await run_websocket(state(), ws, lambda st, conn: TextSession(self, st, conn).run())

        async def chat(request):  # noqa: ANN001, ANN202
            return await chat_completions(self, state(), request)

        async def completions(request):  # noqa: ANN001, ANN202
            return await chat_completions(self, state(), request, legacy=True)

        return [WebSocketRoute("/v1/text", text_ws), Route("/v1/chat/completions", chat, methods=["POST"]),
                Route("/v1/completions", completions, methods=["POST"])]


class TextSession:
    """One /v1/text connection: many sequential requests, each streamed as deltas and a done."""

    def __init__(self, svc: TextService, app: "AppState", conn: Any) -> None:
        self.svc, self.app, self.conn = svc, app, conn
        self.proto = tp.TextProtocol()
        self.id = uuid.uuid4().hex[:16]
        self.job: TextJob | None = None
        self.pump: asyncio.Task[None] | None = None

    async def run(self) -> None:
        try:
            await self._loop()
        except RealtimeError as exc:
            self.proto.fail()
            self.app.metrics.errors.inc()
            await self.conn.fail(exc)
        except Exception:
            log.exception("text session %s crashed", self.id)
            self.proto.fail()
            await self.conn.fail(InternalError("internal error"))
        finally:
            if self.job is not None and self.job.active:
                self.svc.cancel(self.job)
            if self.pump is not None:
                if not self.pump.done():
                    self.pump.cancel()
                await asyncio.gather(self.pump, return_exceptions=True)

    async def _loop(self) -> None:
        while True:
            recv = asyncio.ensure_future(self.conn.recv())
            while True:
                waits: set[asyncio.Future[Any]] = {recv}
                if self.pump is not None and not self.pump.done():
                    waits.add(self.pump)
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                if self.pump is not None and self.pump.done():
                    pump, self.pump = self.pump, None
                    exc = pump.exception()
                    if exc is not None:
                        recv.cancel()
                        raise exc
                if recv.done():
                    break
            msg = recv.result()
            if msg is None or self.conn.closed:
                return
            event = self.proto.receive(msg)
            if isinstance(event, tp.Start):
                job = self.svc.submit(event.request)
                self.job = job
                self.app.metrics.streams.inc()
                await self.conn.send({**tp.ready(self.id, self.svc.model_name, self.svc.engine.max_seq_len),
                                      "prompt_tokens": job.prompt_tokens})
                self.pump = asyncio.ensure_future(self._pump(job))
            elif isinstance(event, tp.Cancel):
                assert self.job is not None
                self.svc.cancel(self.job)
                if self.pump is not None:
                    await asyncio.gather(self.pump, return_exceptions=True)
                    self.pump = None

    async def _pump(self, job: TextJob) -> None:
        async for ev in job.stream(self.svc.wake):
            if isinstance(ev, TextDelta):
                await self.conn.send(tp.delta(ev.text, ev.tokens, ev.logprobs))
            else:
                await self.conn.send(tp.done(ev.finish_reason, ev.prompt_tokens, ev.completion_tokens,
                                             ev.ttft_ms, ev.tokens_per_s))
                self.proto.finished()


async def chat_completions(svc: TextService, state: "AppState", request: Any, legacy: bool = False) -> Any:
    """POST /v1/chat/completions (OpenAI-compatible; streaming as server-sent events), or with
    ``legacy`` POST /v1/completions (a raw prompt; OpenAI's text_completion shapes)."""
    from starlette.responses import JSONResponse, StreamingResponse

    from realtime.errors import AuthError
    from realtime.server import authorized, http_error, json_body

    if not authorized(state.config, request.headers, request.query_params):
        return http_error(AuthError("missing or bad API key"), 401)
    try:
        body = await json_body(request, state.config.max_frame_bytes)
        req = tp.parse_completion(body) if legacy else tp.parse_chat_completion(body)
        job = svc.submit(req.request)
    except OverloadedError as exc:
        return http_error(exc, 503)
    except RealtimeError as exc:
        return http_error(exc, 400)
    state.metrics.streams.inc()
    cid = ("cmpl-" if legacy else "chatcmpl-") + uuid.uuid4().hex[:24]
    created = int(time.time())
    model = svc.model_name
    offset = 0  # (legacy logprobs: the completion text's characters so far)

    def legacy_lp(entries: list[dict[str, Any]] | None, text: str) -> dict[str, Any] | None:
        nonlocal offset
        out = None if entries is None else tp.legacy_logprobs(entries, offset)
        offset += len(text)
        return out

    if not req.stream:
        try:
            done = await job.result(svc.wake)
        except RealtimeError as exc:
            return http_error(exc, 500 if isinstance(exc, InternalError) else 400)
        finally:
            if job.active:
                svc.cancel(job)
        use = tp.usage(done.prompt_tokens, done.completion_tokens)
        if legacy:
            return JSONResponse(tp.completion(cid, model, created, done.text, done.finish_reason,
                                              legacy_lp(done.logprobs, done.text), use))
        return JSONResponse(tp.chat_completion(cid, model, done.text, done.finish_reason, done.prompt_tokens,
                                               done.completion_tokens, created, logprobs=done.logprobs))

    async def events() -> AsyncIterator[bytes]:
        try:
            if not legacy:
                yield tp.sse(tp.chat_chunk(cid, model, created, "", role=True))
            async for ev in job.stream(svc.wake):
                if isinstance(ev, TextDelta):
                    yield tp.sse(tp.completion(cid, model, created, ev.text, None, legacy_lp(ev.logprobs, ev.text))
                                 if legacy else tp.chat_chunk(cid, model, created, ev.text, logprobs=ev.logprobs))
                    continue
                use = tp.usage(ev.prompt_tokens, ev.completion_tokens)
                yield tp.sse(tp.completion(cid, model, created, "", ev.finish_reason) if legacy
                             else tp.chat_chunk(cid, model, created, finish_reason=ev.finish_reason))
                if req.include_usage:
                    yield tp.sse(tp.completion(cid, model, created, None, usage_=use) if legacy
                                 else tp.chat_chunk(cid, model, created, empty_choices=True, usage_=use))
            yield tp.sse("[DONE]")
        except RealtimeError as exc:
            yield tp.sse({"error": {"message": exc.message, "type": "server_error", "code": exc.code}})
        finally:
            if job.active:
                svc.cancel(job)

    return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


# ---- CLI: realtime chat --------------------------------------------------------------------------

def add_cli(subparsers: Any) -> None:
    c = subparsers.add_parser("chat", help="chat with the text model (interactive, or one-shot with -p)")
    c.add_argument("-p", "--prompt", default=None, help="one-shot: send PROMPT, print the reply, exit")
    c.add_argument("--url", default="ws://127.0.0.1:8000/v1/text")
    c.add_argument("--local", action="store_true", help="run the model in this process (no server)")
    c.add_argument("--model", default=None, help="with --local: a Llama/Qwen3 folder or .gguf (default: embedded)")
    c.add_argument("--system", default=None, help="a system message")
    c.add_argument("--max-tokens", type=int, default=512)
    c.add_argument("--temperature", type=float, default=0.0)
    c.add_argument("--top-p", type=float, default=None)
    c.add_argument("--seed", type=int, default=None)
    c.add_argument("--frequency-penalty", type=float, default=None, help="-2..2: less of the reply's frequent tokens")
    c.add_argument("--presence-penalty", type=float, default=None, help="-2..2: less of any token the reply used")
    c.add_argument("--api-key", default=None)
    c.add_argument("--generator-device", default="cpu")
    c.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    c.add_argument("--exact", action="store_true", help="with --local on the CPU: every weight dequantized to float32")
    c.set_defaults(fn=_chat)


def _chat(args: argparse.Namespace) -> int:
    history: list[dict[str, str]] = []
    if args.system:
        history.append({"role": "system", "content": args.system})
    params: dict[str, Any] = {"max_tokens": args.max_tokens, "temperature": args.temperature}
    if args.top_p is not None:
        params["top_p"] = args.top_p
    for name in ("seed", "frequency_penalty", "presence_penalty"):
        if getattr(args, name) is not None:
            params[name] = getattr(args, name)
    try:
        turn = _local_turn(args) if args.local else _remote_turn(args)
    except (RealtimeError, OSError) as exc:
        print(f"realtime chat: {getattr(exc, 'message', exc)}", file=sys.stderr)
        return 1
    interactive = args.prompt is None
    lines = [args.prompt] if not interactive else None
    tty = sys.stdin.isatty()
    while True:
        if lines is not None:
            if not lines:
                return 0
            line = lines.pop()
        else:
            if tty:
                print("> ", end="", flush=True)
            line = sys.stdin.readline()
            if not line:
                return 0
            line = line.rstrip("\n")
            if not line.strip():
                continue
        history.append({"role": "user", "content": line})
        try:
            reply, done = turn(history, params)
        except RealtimeError as exc:
            print(f"\nrealtime chat: {exc.message}", file=sys.stderr)
            return 1
        except OSError as exc:
            print(f"\nrealtime chat: {exc}", file=sys.stderr)
            return 1
        history.append({"role": "assistant", "content": reply})
        print(flush=True)
        if done.get("ttft_ms") is not None:
            print(f"[{done.get('finish_reason')}, {done['usage']['completion_tokens']} tokens, "
                  f"ttft {done['ttft_ms']:.0f} ms]", file=sys.stderr)


def _remote_turn(args: argparse.Namespace) -> Callable[[list, dict], tuple[str, dict]]:
    import json

    from websockets.exceptions import WebSocketException
    from websockets.sync.client import connect

    url = args.url.replace("http://", "ws://", 1).replace("https://", "wss://", 1)
    if not url.rstrip("/").endswith("/v1/text"):
        url = url.rstrip("/") + "/v1/text"
    key = args.api_key or os.environ.get("REALTIME_API_KEY")
    try:
        ws = connect(url, additional_headers={"Authorization": f"Bearer {key}"} if key else None, open_timeout=10)
    except (WebSocketException, OSError, TimeoutError) as exc:
        raise OSError(f"cannot connect to {url}: {exc}") from None

    def turn(history: list, params: dict) -> tuple[str, dict]:
        try:
            ws.send(json.dumps({"type": "start", "messages": history, **params}))
            parts = []
            while True:
                msg = json.loads(ws.recv(timeout=300))
                kind = msg.get("type")
                if kind == "delta":
                    parts.append(msg["text"])
                    print(msg["text"], end="", flush=True)
                elif kind == "done":
                    return "".join(parts), msg
                elif kind == "error":
                    raise RealtimeError(msg.get("message", "error"), code=msg.get("code"))
        except (WebSocketException, TimeoutError) as exc:
            raise OSError(f"connection lost: {exc}") from None

    return turn


def _local_turn(args: argparse.Namespace) -> Callable[[list, dict], tuple[str, dict]]:
    from realtime.engines.llama import TextModel
    from realtime.engines.tokenizer import StreamDecoder

    cpu = not args.generator_device.startswith("cuda")
    model = TextModel.from_pretrained(args.model, device=args.generator_device, dtype=getattr(torch, args.dtype),
                                      cpu_native=cpu and not args.exact)
    tok = model.tokenizer
    eng = BatchDecoder(model, 1, min(model.max_seq_len, 4096))

    def turn(history: list, params: dict) -> tuple[str, dict]:
        ids = tok.encode(tok.apply_chat_template(history), add_special=False)
        if len(ids) >= eng.max_seq_len:
            raise ProtocolError("the conversation no longer fits the model's context")
        p = tp.parse_params(params)
        dec, parts = StreamDecoder(tok), []
        t0 = time.perf_counter()
        t = eng.start(0, ids, p.temperature, p.top_k, p.top_p, p.seed or 0, p.frequency_penalty, p.presence_penalty)
        ttft = (time.perf_counter() - t0) * 1000
        n, reason = 1, "length"
        limit = min(p.max_tokens or eng.max_seq_len, eng.max_seq_len - len(ids))
        while True:
            if t in tok.eos_ids:
                reason = "stop"
                break
            s = dec.push(t)
            parts.append(s)
            print(s, end="", flush=True)
            if n >= limit:
                break
            t = eng.step([0], greedy=p.temperature <= 0, filtered=p.filtered, penalized=p.penalized)[0]
            n += 1
        tail = dec.flush()
        parts.append(tail)
        print(tail, end="", flush=True)
        return "".join(parts), {"finish_reason": reason, "usage": {"completion_tokens": n}, "ttft_ms": ttft}

    return turn
