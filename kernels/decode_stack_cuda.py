"""The decode stack as CUDA C++ (kernels/csrc/decode_stack.cu): one row, bf16, weights streamed.

Same step and arguments as ``decode_stack.decode_stack`` (Triton) for one row: x [1, DIM] ->
the final-norm output, the step's K/V written into the caches. More in the same kernel, for the
engines' one-row steps: the input row gathered from a table (an embedding) at an index on the
device; a head after the final norm (the LM head, a codebook head), whose rows stream through
the ring right behind the last layer's; and for a small vocabulary (CSM's 2051 codes) the head's
token sampled by the last SM done, as kernels/sampling.py samples it. The CUDA kernel keeps a ring of
16 KB shared-memory stages per SM that a producer warp fills with bulk copies of the SM's
weight rows, layer after layer, independent of the activations; the consumer warps poll the rows
the other SMs hand over (LL words: data and flag in one 8-byte store) instead of grid barriers.
See the .cu file's header.

The kernel is built with nvcc on first use (a few seconds) into a cache folder
(``$REALTIME_CACHE`` or ``~/.cache/realtime``) keyed by the source's hash and the GPU's
architecture, and called through ctypes on torch's current stream (CUDA graphs capture it).
It needs an sm_90 GPU (Hopper: bulk copies, mbarriers with transaction counts, PDL) and nvcc.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import math
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from torch import Tensor

from ._triton import check

__all__ = ["available", "takes", "every_fits", "every_default", "decode_stack_cuda", "errors", "default_splits", "build", "row_start", "max_rows",
           "head_chunks", "persist_l2", "STATS", "STAT_NAMES", "TRACE_EVENTS", "trace_width", "trace_stages", "L2_KEEP", "L2_AHEAD", "L2_AHEAD_DEFAULT", "BURST", "BURST_DEFAULT", "burst_of",
           "BACKOFF", "BACKOFF_DEFAULT", "backoff_of",
           "auto_l2_keep", "keep_set_aside", "l2_sizes"]

_SRC = Path(__file__).parent / "csrc" / "decode_stack.cu"
_KEYS = 32  # keys an attention block (kKeys)
_SEG = 1024  # elements a warp multiplies a stage (kSeg): K must be a multiple, dividing a stage
_STAGE_ELEMS = 8192  # bf16 elements a 16 KB stage (kStageElems)
_MAX_PARTS = 1024  # kMaxParts: float partial sums a phase
_WARPS = 8  # kConsumerWarps: consumer warps a block (one query head each when every SM attends)
_CONSUMERS = 32 * _WARPS  # kConsumers
_ROPE_IT = 3  # kRopeIt: rotated (head, pair) items a consumer thread at most


def _count_env(name: str, default: int, zero: str) -> int:
    """The count >= 0 in environment variable ``name`` (``default`` where unset or empty); a value
    that is not a count fails with a message naming the variable (``zero``: what 0 means)."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    check(raw.isascii() and raw.isdigit(), f"{name} must be a count >= 0 (0: {zero}), got {raw!r}")
    return int(raw)


def _inflight_env() -> int:
    """Weight copies in flight an SM at most (the ring's other stages hold landed bytes; see the
    .cu): 2, or REALTIME_STACK_INFLIGHT (0: the whole ring), for a GPU whose memory wants more in
    flight. H100: 916 us a 1B step at 2, 931 at 3, 946 at 4, 957 with the whole ring (same call)."""
    return _count_env("REALTIME_STACK_INFLIGHT", 2, "the whole ring")


INFLIGHT = _inflight_env()
# L2 hints on the weight copies (Params::keep in the .cu; they change no result). By default every
# stack streams its weights evict_first, so that a step's stream does not push the KV cache and
# the hand-overs out of L2, and the CSM engine keeps every k-th 16 KB stage of its depth decoder's
# layers in L2 (evict_last, in a persisting L2 set aside for them) across a frame's 31 passes,
# k from ``auto_l2_keep``. REALTIME_STACK_L2_KEEP=k sets k; 0: no hints at all; unset or "auto":
# the default. H100 (2026-12-07, same call): CSM 192.9 -> 198.2 frames/s (k = 12, the auto k),
# 196.7 with every stage evict_first; text 977 -> 988 tok/s evict_first.
def _auto_count_env(name: str, zero: str) -> int | None:
    """The count in environment variable ``name``; None (the default) where unset or "auto"."""
    raw = os.environ.get(name, "").strip().lower()
    return None if raw in ("", "auto") else _count_env(name, 0, f"{zero}; auto: the default")


L2_KEEP = _auto_count_env("REALTIME_STACK_L2_KEEP", "no L2 hints")
# Stages a producer asks into L2 past its ring while the ring is full (Params::ahead in the .cu:
# the HBM keeps streaming while the consumers wait on a hand-over; no result changes). A stack's
# ``l2_ahead`` (None: L2_AHEAD_DEFAULT) sets it; REALTIME_STACK_L2_AHEAD=n sets it for every stack
# (0: none; unset or "auto": the stacks' own). H100 (2026-12-07, same calls, alternating): text
# 997 -> 1,001 / 1,006 / 1,008 / 1,007 / 968 tok/s at 4 / 8 / 12 / 16 / 32 ahead; CSM 197.0 ->
# 199.4 / 199.6 / 198.9 / 197.7 / 189.9 frames/s at 2 / 4 / 6 / 8 / 16 (the engine takes 4).
L2_AHEAD = _auto_count_env("REALTIME_STACK_L2_AHEAD", "no prefetches")
L2_AHEAD_DEFAULT = 12
# More copies in flight while an SM's consumers are close behind its stream (Params::burst in the
# .cu: they wait on bytes, not on a hand-over, so fewer polls queue behind the extra copies; no
# result changes). A stack's ``burst`` (None: BURST_DEFAULT) sets it; REALTIME_STACK_BURST=n sets it
# for every stack (0: off, INFLIGHT always; unset or "auto": the stacks' own). H100 (2026-12-07,
# same calls, alternating, 2 in flight): text 995-997 -> 1,008-1,009 tok/s at 3 (four pairs), 990
# -> 991 / 952 at 4 / 6; CSM (both stacks) 201.1 -> 198.8 / 194.7 frames/s at 3 / 4 (it takes 0).
BURST = _auto_count_env("REALTIME_STACK_BURST", "off")
BURST_DEFAULT = 3
# ns a poll sleeps after it finds a word not yet written (Params::backoff in the .cu: fewer loads of
# the same words in flight while every SM waits on them; no result changes). A stack's ``backoff``
# (None: BACKOFF_DEFAULT) sets it; REALTIME_STACK_BACKOFF=ns sets it for every stack (0: none;
# unset or "auto": the stacks' own).
BACKOFF = _auto_count_env("REALTIME_STACK_BACKOFF", "no sleep")
BACKOFF_DEFAULT = 0
# The most of L2 that the kept stages take: on an H100 (50 MiB L2, 32.8 MB persisting at most)
# k = 7, 8, 10, 12, 16 gave 197.3, 196.9, 198.7, 198.8, 197.7 frames/s (19 % to 53 % of L2 kept)
L2_KEEP_SHARE = 0.36


def auto_l2_keep(layer_bytes: int, l2_bytes: int, most: int) -> int:
    """The k of ``L2_KEEP`` for a stack of ``layer_bytes`` on a GPU of ``l2_bytes`` of L2, of
    which ``most`` can be set aside as persisting: the smallest k whose kept bytes
    (``layer_bytes / k``) take at most ``L2_KEEP_SHARE`` of L2 and whose set-aside (1.125 x the
    kept bytes, see ``keep_set_aside``) fits in ``most``."""
    check(layer_bytes > 0 and l2_bytes > 0 and most > 0, "auto_l2_keep needs sizes > 0")
    return max(1, math.ceil(layer_bytes / (L2_KEEP_SHARE * l2_bytes)), math.ceil(keep_set_aside(layer_bytes, 1) / most))


def keep_set_aside(layer_bytes: int, k: int) -> int:
    """The persisting L2 asked for where every k-th stage of ``layer_bytes`` is kept: the kept
    bytes and an eighth (the lines of a set-aside are not all usable by one stream)."""
    return layer_bytes // k + layer_bytes // k // 8


MAX_SPLITS = 12  # kMaxSplits (the merge keeps a split's partial in registers)
# Every SM attends (to all kv heads, one split) where every_fits(), unless REALTIME_STACK_EVERY=0:
# the heads' output then feeds the SM's own o rows, with no hand-over (see the .cu's attention())
EVERY = os.environ.get("REALTIME_STACK_EVERY", "1").strip() != "0"
# A head sampled in the kernel: its order keys (rounded up to 8) and scaled logits (6 bytes a row)
# go into the ring's first two stages (there are always at least two) on the last SM
MAX_SAMPLE_V = (2 * (2 * _STAGE_ELEMS) - 14) // 6
STATS = 20  # kStats: per-SM cycle counts a probe can ask for
STAT_NAMES = ("producer waits for a free stage", "producer total", "consumers wait for a stage's bytes",
              "polls for the residual (q|k|v)", "polls for q|k|v (the attention)", "polls for the heads (o)",
              "polls for the residual (gate|up)", "polls for the activation (down)", "attention", "consumers total",
              "row loads and norms", "stages", "stage arithmetic", "phase ends", "attention to its split's partial",
              "split 0 polls for the partials", "waits for the keys copied ahead", "attention's block loop",
              "q|k|v (thread 0's) to RoPE's barrier", "the partial's stores")


def _nvcc() -> str | None:
    for cand in (os.environ.get("NVCC"), shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"):
        if cand and Path(cand).is_file():
            return cand
    return None


def available(device: torch.device | None = None) -> bool:
    """CUDA, an sm_90 (Hopper) GPU and nvcc to build the kernel."""
    if not torch.cuda.is_available() or _nvcc() is None:
        return False
    major, _ = torch.cuda.get_device_capability(device)
    return major == 9


def takes(dim: int, inter: int, n_heads: int, n_kv_heads: int, head_dim: int) -> bool:
    """Whether the kernel takes these widths: every GEMV's K one of 1024, 2048, 4096, 8192 (a 16 KB
    stage holds whole rows, each warp a 1024-wide piece of one), head dim a multiple of 16 up to
    128, at most 8 query heads a kv head and at most 1024 (head, dim) pairs a kv head."""
    ks = {dim, n_heads * head_dim, inter}
    g = n_heads // max(1, n_kv_heads)
    return (all(k in (1024, 2048, 4096, 8192) for k in ks) and n_heads % n_kv_heads == 0 and head_dim % 16 == 0
            and head_dim <= 128 and g <= 8 and g * head_dim <= 1024)


def every_fits(n_heads: int, n_kv_heads: int, head_dim: int, tmax: int) -> bool:
    """Whether every SM can attend to all the heads itself (the CSM depth decoder's layout): one
    warp a query head (at most 8), every rotated q|k pair and v value polled by the 256 consumer
    threads (3 pairs and 1 value a thread at most), at most two 32-key blocks of cache."""
    return (n_heads <= _WARPS and (n_heads + n_kv_heads) * head_dim // 2 <= _ROPE_IT * _CONSUMERS
            and n_kv_heads * head_dim <= _CONSUMERS and tmax <= 2 * _KEYS)


def every_default(n_heads: int, n_kv_heads: int, head_dim: int, tmax: int, splits: int | None = None) -> bool:
    """``decode_stack_cuda``'s choice when ``every`` is None: every SM attends where it fits and
    one split (or the default) is asked for, unless REALTIME_STACK_EVERY=0."""
    return EVERY and splits in (None, 1) and every_fits(n_heads, n_kv_heads, head_dim, tmax)


def _attended(h: int, hkv: int, every: bool) -> tuple[int, int]:
    """(query heads, kv heads) one SM attends with: all of them with ``every``, else one kv head's."""
    return (h, hkv) if every else (h // hkv, 1)


def _cache_dir() -> Path:
    root = os.environ.get("REALTIME_CACHE") or str(Path.home() / ".cache" / "realtime")
    return Path(root) / "cuda"


@functools.cache
def build(arch: str = "90") -> ctypes.CDLL:
    """Compile (once per source and architecture) and load the kernel's library."""
    nvcc = _nvcc()
    check(nvcc is not None, "decode_stack_cuda needs nvcc (the CUDA toolkit) to build its kernel")
    # REALTIME_CUDA_SRC: another copy of the source, for a probe's A/B of two versions in one device
    # call (same launcher ABI only: the library's entry points are called as this file declares them)
    path = Path(os.environ.get("REALTIME_CUDA_SRC") or _SRC)
    src = path.read_bytes()
    # REALTIME_CUDA_LINEINFO=1: source line tables in the build, for a profiler's per-line counters
    # (same code; its own cache file)
    flags = ["-lineinfo"] if os.environ.get("REALTIME_CUDA_LINEINFO", "0") == "1" else []
    key = hashlib.sha256(src + arch.encode() + " ".join(flags).encode()).hexdigest()[:16]
    lib = _cache_dir() / f"decode_stack_{key}_sm{arch}.so"
    if not lib.is_file():
        lib.parent.mkdir(parents=True, exist_ok=True)
        print(f"realtime: building {path.name} for sm_{arch} with nvcc (once, a few seconds)", file=sys.stderr, flush=True)
        with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:
            out = Path(tmp) / lib.name
            cmd = [nvcc, "-O3", "-std=c++17", f"-gencode=arch=compute_{arch},code=sm_{arch}", "-shared",
                   "-Xcompiler", "-fPIC", *flags, "-o", str(out), str(path)]
            res = subprocess.run(cmd, capture_output=True, text=True)
            if res.returncode:
                raise RuntimeError(f"nvcc failed to build {path.name}:\n{res.stderr[-4000:]}")
            os.replace(out, lib)  # atomic: a concurrent build of the same key lands one file
    dll = ctypes.CDLL(str(lib))
    dll.realtime_stack_launch.argtypes = [ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(ctypes.c_float),
                                          ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
                                          ctypes.c_int]
    dll.realtime_stack_launch.restype = ctypes.c_int
    dll.realtime_stack_fixed_smem.argtypes = [ctypes.c_int] * 4
    dll.realtime_stack_blocks_per_sm.argtypes = [ctypes.c_int]
    dll.realtime_stack_error_string.restype = ctypes.c_char_p
    dll.realtime_stack_persist_l2.argtypes = [ctypes.c_int, ctypes.c_longlong]
    dll.realtime_stack_persist_l2.restype = ctypes.c_longlong
    return dll


def persist_l2(device: torch.device, nbytes: int) -> int:
    """Set aside up to ``nbytes`` of ``device``'s L2 for evict_last (persisting) lines, capped at
    the GPU's most (a device-wide setting, for the stages a stack keeps: see ``L2_KEEP``); returns
    the bytes set aside. RuntimeError where the GPU or its runtime refuses it."""
    got = build().realtime_stack_persist_l2(_index(device), int(nbytes))
    if got < 0:
        raise RuntimeError(f"setting the persisting L2 failed: {build().realtime_stack_error_string(int(-got)).decode()}")
    return int(got)


def l2_sizes(device: torch.device) -> tuple[int, int]:
    """(L2 bytes, the most of them that can be set aside as persisting) of ``device``; leaves the
    set-aside at its most (the caller sets what it wants). RuntimeError where none can be set aside."""
    most = persist_l2(device, 1 << 40)
    if most <= 0:
        raise RuntimeError("this GPU sets no L2 aside as persisting")
    return torch.cuda.get_device_properties(device).L2_cache_size, most


def default_splits(n_kv_heads: int, tmax: int, programs: int) -> int:
    """Key splits an attention (kv head): ~32 keys a split at the longest cache, each split its own
    SM, at most ``MAX_SPLITS`` (split 0 merges the others' partials)."""
    return max(1, min(MAX_SPLITS, programs // n_kv_heads, math.ceil(tmax / _KEYS)))


class _Scratch:
    """The step's hand-over buffers, as LL words (int64: {data, flag}; see the .cu): the residual
    after o and after down, q|k|v, the heads and the activation as bf16 pairs, the attention's
    partials as floats; and the control words (epoch, SMs done, the sticky error flag)."""

    def __init__(self, w, ns: int, dev: torch.device) -> None:  # noqa: ANN001
        nl, nqkv, dim = w.qkv.shape
        h, hkv, hd = w.n_heads, w.n_kv_heads, w.head_dim
        inter = w.down.shape[2]
        words = dict(dtype=torch.int64, device=dev)
        self.reso = torch.zeros(dim // 2, **words)
        self.qkv = torch.zeros(nqkv // 2, **words)
        self.attn = torch.zeros(h * hd // 2, **words)
        self.part = torch.zeros(h * ns * (hd + 2), **words)
        self.resd = torch.zeros(dim // 2, **words)
        self.act = torch.zeros(inter // 2, **words)
        self.ctl = torch.zeros(3, device=dev, dtype=torch.int32)
        # a sampled head's logits, polled by the sampling SM: 0xFFFF (a NaN no rounding gives) where
        # not yet written; the kernel sets them back
        self.logits = torch.full(((MAX_SAMPLE_V + 7) // 8 * 8,), -1, device=dev, dtype=torch.int16)


def _smem_plan(dll, dim: int, nh: int, nkv: int, hd: int, stages: int | None,  # noqa: ANN001
               device: int) -> tuple[int, int]:
    """(stages, dynamic shared memory bytes): as many 16 KB stages as fit beside the fixed part
    (nh query heads of nkv kv heads attended by one SM)."""
    fixed = dll.realtime_stack_fixed_smem(dim, nh, nkv, hd)
    stage = dll.realtime_stack_stage_bytes()
    props = torch.cuda.get_device_properties(device)
    limit = getattr(props, "shared_memory_per_block_optin", 232448)  # (227 KB: sm_90's opt-in maximum)
    most = (limit - fixed - 16 * 64) // (stage + 16)  # (+ two mbarriers a stage, alignment slack)
    n = most if stages is None else stages
    check(2 <= n <= most, f"stages must be in [2, {most}] on this GPU, got {n}")
    return n, n * stage + fixed + 16 * n + 64


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def ring_stages(w, device: torch.device, every: bool = False) -> int:  # noqa: ANN001
    """How many 16 KB ring stages fit beside the fixed shared memory for this stack on this GPU
    (every: with every SM attending to all the heads)."""
    return _smem_plan(build(), w.qkv.shape[2], *_attended(w.n_heads, w.n_kv_heads, every), w.head_dim, None,
                      _index(device))[0]


def row_start(n: int, pid: int, programs: int, items: int, balance: int) -> int:
    """The kernel's first row of ``n`` (even) for SM ``pid`` (slice() in the .cu): ``ceil(n / programs)``
    rows an SM, rounded up to even, for balance < 0, else shares of 1000 an SM less ``balance``
    for the SMs < items, each start rounded down to even (the rows go out two to an LL word)."""
    if balance < 0:
        r = -(-n // programs)
        return min(n, pid * (r + r % 2))
    total = 1000 * programs - balance * min(items, programs)
    return n * (1000 * pid - balance * min(pid, items)) // total & ~1


@functools.cache
def _most_rows(n: int, programs: int, items: int, balance: int) -> int:
    return max(row_start(n, i + 1, programs, items, balance) - row_start(n, i, programs, items, balance)
               for i in range(programs))


def max_rows(programs: int, items: int, balance: int):  # noqa: ANN201
    """n -> the most rows of n any SM gets."""
    return lambda n: _most_rows(n, programs, items, balance)


@functools.cache
def _sms(device: int) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.cache
def _plan(dim: int, nqkv: int, h: int, hkv: int, hd: int, inter: int, p: int, ns: int, stages: int | None,
          balance: int, device: int, every: bool) -> tuple[int, int]:
    """(ring stages, dynamic shared memory bytes) of a launch, after the checks that depend only
    on the widths and settings: done once for each combination, not on every step."""
    dll = build()
    check(1 <= ns <= MAX_SPLITS, f"splits must be in [1, {MAX_SPLITS}], got {ns}")
    check(hkv * ns <= p, f"{hkv} kv heads x {ns} splits: more attention items than programs ({p})")
    check(-1 <= balance <= 500, f"balance is -1 or 0..500 per mille, got {balance}")
    check(p <= _sms(device), "at most one program an SM (every program must be resident)")
    n_stages, smem = _smem_plan(dll, dim, *_attended(h, hkv, every), hd, stages, device)
    most = max_rows(p, hkv * ns, balance)
    parts = max(2 * most(inter) * (dim // _SEG), most(nqkv) * (dim // _SEG), most(dim) * (inter // _SEG),
                most(dim) * (h * hd // _SEG))
    check(parts <= dll.realtime_stack_max_parts(), f"{p} programs leave too many rows an SM ({parts} partial sums)")
    check(most(dim) <= 512, f"{p} programs leave over 512 residual rows an SM (two a consumer thread)")
    check(dll.realtime_stack_blocks_per_sm(smem) >= 1, "the kernel's shared memory does not fit an SM")
    return n_stages, smem


def head_chunks(v: int, dim: int, programs: int, items: int, balance: int) -> int:
    """Chunks of a head's rows (``v`` rows of ``dim``) the SM with the most takes in turn: each
    chunk's partial sums fill at most the kernel's ``kMaxParts`` (head_rows() in the .cu)."""
    if v == 0:
        return 0
    rps = _STAGE_ELEMS // dim
    per = _MAX_PARTS // (dim // _SEG) // rps * rps
    return -(-max_rows(programs, items, balance)(v) // per)


def decode_stack_cuda(w, x: Tensor, pos: Tensor, k_cache: Tensor, v_cache: Tensor, slots: Tensor,  # noqa: ANN001
                      cos: Tensor, sin: Tensor, programs: int | None = None, splits: int | None = None,
                      stages: int | None = None, pdl: bool = True, stats: Tensor | None = None,
                      mode: int = 0, inflight: int | None = None, balance: int = -1,
                      backoff: int | None = None, x_index: Tensor | None = None, x_offset: int = 0,
                      head: Tensor | None = None, sample: tuple | None = None,
                      token: Tensor | None = None, every: bool | None = None,
                      keep: int | None = None, ahead: int | None = None,
                      burst: int | None = None, trace: Tensor | None = None) -> Tensor | tuple:
    """``decode_stack.decode_stack`` for one bf16 row on an sm_90 GPU (``w`` a ``StackWeights``).
    ``splits`` (key splits a kv head) and ``stages`` (the ring's 16 KB stages) default to
    ``default_splits`` and as many as fit; ``programs`` to one a SM (all must be resident).
    ``inflight`` caps the weight copies in flight an SM (default ``INFLIGHT``; 0: the whole ring).
    ``balance`` >= 0 splits every GEMV's rows by weight, that many per mille fewer for the SMs that
    also attend (-1, the default: ``ceil(N / programs)`` rows an SM, as timed; both round to row
    pairs, see ``row_start``). ``backoff``: ns a
    poll for another SM's rows sleeps before it polls again (default ``backoff_of(w)``). ``every``: every
    SM attends to all the heads and starts its o rows from them, one split (default: where
    ``every_fits`` and ``splits`` is None or 1, unless REALTIME_STACK_EVERY=0); False: the
    attention items (kv head, split) hand the heads over to every SM. ``keep`` (default the
    stack's ``l2_keep``; where that is None, -1, or 0 with REALTIME_STACK_L2_KEEP=0): L2 hints on
    the weight copies, 0 none, k > 0 every k-th stage of the layers evict_last and the rest
    evict_first, < 0 all evict_first (results are the same). ``ahead``: while an SM's ring is full, up
    to that many of its next stages are asked into L2 (0: none; results are the same); default
    ``L2_AHEAD`` where set, else the stack's ``l2_ahead``, else ``L2_AHEAD_DEFAULT``. ``burst``: the
    cap on copies in flight while the SM's consumers are close behind its stream (0 or at most
    ``inflight``: off; results are the same); default ``burst_of(w)``.

    ``x_index`` (int64 [1] on the GPU): ``x`` is then a table [rows, DIM] (an embedding) and the
    step's input its row ``x_index[0] + x_offset``, read by the kernel (clamped into the table).
    ``head`` [V, DIM] (bf16): the kernel also computes ``logits = final-norm output @ head.T``
    (float32 sums, rounded to bf16 as the GEMV does) and the call returns ``(out, logits [1, V])``.
    ``sample`` (with a head of at most ``MAX_SAMPLE_V`` rows): ``(temperature, top_k, seeds,
    steps, step_add)``, one row each on the GPU (float32, int64, int64, int64; an int): the
    kernel also samples the logits' token as ``kernels.sampling.sample(logits, temperature,
    top_k, seeds, steps + step_add)`` does, into ``token`` (int64 [1]; allocated if None), and
    the call returns ``(out, logits, token)``.

    For probes: ``stats`` (int64 [programs, STATS]) receives each SM's cycle counts (see
    ``STAT_NAMES``); ``mode`` 1 reads the rows other SMs hand over once, without polling for
    them, 2 also skips the arithmetic (the weights still stream), 3 skips the polls and the
    attention: the step's results are then wrong, and the caches must be restored. ``trace`` (int64
    [programs, trace_width(L, ts)], with ``stats``): the step's timeline (see ``TRACE_EVENTS`` and
    bench/stack_timeline.py), for its first ``ts`` stages an SM."""
    m, dim = x.shape
    nl, nqkv, wdim = w.qkv.shape
    h, hkv, hd = w.n_heads, w.n_kv_heads, w.head_dim
    inter = w.down.shape[2]
    check(x.is_cuda and (m == 1 or x_index is not None) and m >= 1 and wdim == dim and x.is_contiguous()
          and x.dtype == torch.bfloat16,
          f"decode_stack_cuda takes one contiguous bf16 CUDA row [1, {wdim}] (or a table of them with x_index), "
          f"got {tuple(x.shape)} {x.dtype}")
    if x_index is not None:
        check(x_index.shape == (1,) and x_index.dtype == torch.long and x_index.device == x.device,
              "x_index: int64 [1] on the table's GPU")
    if head is not None:
        check(head.dim() == 2 and head.shape[1] == dim and head.shape[0] >= 1 and head.dtype == torch.bfloat16
              and head.is_contiguous() and head.device == x.device and head.data_ptr() % 16 == 0,
              f"head: contiguous bf16 [V, {dim}] on the GPU, got {tuple(head.shape)} {head.dtype}")
    if sample is not None:
        check(head is not None and head.shape[0] <= MAX_SAMPLE_V,
              f"sampling in the kernel needs a head of at most {MAX_SAMPLE_V} rows")
        temp, top_k, seeds, steps, step_add = sample
        for t, dt, name in ((temp, torch.float32, "temperature"), (top_k, torch.long, "top_k"),
                            (seeds, torch.long, "seeds"), (steps, torch.long, "steps")):
            check(t.dtype == dt and t.numel() == 1 and t.device == x.device and t.is_contiguous(),
                  f"sample: {name} must be one {dt} on the GPU")
        if token is None:
            token = torch.empty(1, device=x.device, dtype=torch.long)
        check(token.dtype == torch.long and token.numel() == 1 and token.device == x.device, "token: int64 [1] on the GPU")
    check(all(t.dtype == torch.bfloat16 and t.is_cuda for t in (w.qkv, w.o, w.gate_up, w.down, w.norms, w.final,
                                                                 k_cache, v_cache, cos, sin)),
          "decode_stack_cuda: weights, caches and angle tables must be bf16 on the GPU")
    check(takes(dim, inter, h, hkv, hd), "decode_stack_cuda does not take these widths (see takes())")
    check(k_cache.shape[0] == nl and k_cache.shape[2] == hkv and k_cache.shape[4] == hd and k_cache.stride() == v_cache.stride()
          and k_cache.shape == v_cache.shape and k_cache.stride(4) == 1 and k_cache.stride(3) % 8 == 0
          and k_cache.storage_offset() % 8 == 0 and v_cache.storage_offset() % 8 == 0,
          "caches must be [L, S, HKV, TMAX, HD], one layout, rows 16-byte aligned")
    check(pos.shape == (1,) and slots.shape == (1,) and pos.dtype == slots.dtype == torch.long and pos.is_cuda,
          "pos, slots: int64 [1] on the GPU")
    check(cos.stride(1) == 1 and sin.stride() == cos.stride(), "cos/sin: [positions, HD] rows, one layout")
    for t in (w.qkv, w.o, w.gate_up, w.down):
        check(t.is_contiguous() and t.data_ptr() % 16 == 0, "stacked weights must be contiguous and 16-byte aligned")
    dll = build()
    device = _index(x.device)
    p = programs or _sms(device)
    if every is None:
        every = every_default(h, hkv, hd, k_cache.shape[3], splits)
    check(not every or (every_fits(h, hkv, hd, k_cache.shape[3]) and splits in (None, 1)),
          "every SM attending takes at most 8 query heads, at most 64 cached keys and one split")
    ns = 1 if every else splits or default_splits(hkv, k_cache.shape[3], p)
    n_stages, smem = _plan(dim, nqkv, h, hkv, hd, inter, p, ns, stages, balance, device, bool(every))
    key = ("cuda", p, ns, str(x.device))
    sc = w.scratch.get(key)
    if sc is None:  # allocated once, before any CUDA-graph capture (the capture warm-up runs the step)
        sc = w.scratch[key] = _Scratch(w, ns, x.device)
    out = torch.empty(1, dim, device=x.device, dtype=x.dtype)
    v = 0 if head is None else head.shape[0]
    logits = None if head is None else torch.empty(1, v, device=x.device, dtype=torch.bfloat16)
    ptrs = [x, out, sc.reso, sc.qkv, sc.attn, sc.part, sc.resd, sc.act, sc.ctl, w.qkv, w.o, w.gate_up, w.down, w.norms,
            w.final, k_cache, v_cache, cos, sin, pos, slots]
    if stats is not None:
        check(stats.is_cuda and stats.dtype == torch.int64 and stats.shape == (p, STATS) and stats.is_contiguous(),
              f"stats: int64 [{p}, {STATS}] on the GPU")
    check(mode in (0, 1, 2, 3), f"mode is 0, 1, 2 or 3, got {mode}")
    ts = 0
    if trace is not None:
        check(stats is not None, "a trace comes with stats (the timed build)")
        ts = trace_stages(nl, trace.shape[-1])
        check(trace.is_cuda and trace.dtype == torch.int64 and trace.dim() == 2 and trace.shape[0] == p
              and ts > 0 and trace.is_contiguous(), f"trace: int64 [{p}, trace_width(L, stages)] on the GPU")
    sp = [0] * 6 if sample is None else [*(t.data_ptr() for t in sample[:4]), int(sample[4]), token.data_ptr()]
    a = (ctypes.c_int64 * 40)(*[t.data_ptr() for t in ptrs], k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                              k_cache.stride(3), cos.stride(0), 0 if stats is None else stats.data_ptr(),
                              0 if x_index is None else x_index.data_ptr(), int(x_offset), m,
                              0 if head is None else head.data_ptr(),
                              0 if logits is None else (sc.logits if sample is not None else logits).data_ptr(), *sp,
                              0 if sample is None else logits.data_ptr(), 0 if trace is None else trace.data_ptr())
    f = (ctypes.c_float * 2)(float(w.eps), (1.0 / math.sqrt(hd)) * math.log2(math.e))
    fl = INFLIGHT if inflight is None else inflight
    check(0 <= fl, f"inflight must be >= 0, got {fl}")
    nap = backoff_of(w, backoff)
    check(0 <= nap <= 100_000, f"backoff is 0..100000 ns, got {nap}")
    kp = keep if keep is not None else w.l2_keep if w.l2_keep is not None else (0 if L2_KEEP == 0 else -1)
    pf = next(a for a in (ahead, L2_AHEAD, w.l2_ahead, L2_AHEAD_DEFAULT) if a is not None)
    check(0 <= pf <= 1 << 20, f"ahead must be a count of stages >= 0, got {pf}")
    bu = burst_of(w, burst)
    check(0 <= bu <= 1 << 20, f"burst must be a count of copies >= 0, got {bu}")
    n = (ctypes.c_int * 20)(nl, dim, h, hkv, hd, inter, k_cache.shape[3], ns, n_stages, mode, fl or n_stages, balance,
                            nap, v, head_chunks(v, dim, p, hkv * ns, balance), int(every), int(kp), int(pf), int(bu), ts)
    stream = torch.cuda.current_stream(x.device).cuda_stream
    err = dll.realtime_stack_launch(a, f, n, p, smem, ctypes.c_void_p(stream), int(pdl))
    check(err == 0, f"decode_stack_cuda launch failed: {dll.realtime_stack_error_string(err).decode()}")
    if sample is not None:
        return out, logits, token
    return out if logits is None else (out, logits)


# A trace's events a layer, in the kernel's order (Ev in the .cu): thread 0's clock and the global
# timer after each
TRACE_EVENTS = ("residual polled (q|k|v's input)", "q|k|v put", "attention done", "heads polled (o's input)",
                "residual after o put", "residual polled (gate|up's input)", "activation put",
                "activation polled (down's input)", "residual after down put", "q|k|v polled (the attention)",
                "partials polled (split 0)")


def trace_width(n_layers: int, stages: int) -> int:
    """int64 a row of a trace (one SM's): 4 per stage (the producer's room and issue, the consumers'
    ask and have), 2 per event a layer, and the SM's (clock, globaltimer) at its start and end."""
    return 4 * stages + 2 * n_layers * len(TRACE_EVENTS) + 4


def trace_stages(n_layers: int, width: int) -> int:
    """The stages a trace row of ``width`` holds (0 where the width fits none)."""
    rest = width - 2 * n_layers * len(TRACE_EVENTS) - 4
    return rest // 4 if rest > 0 and rest % 4 == 0 else 0


def burst_of(w, burst: int | None = None) -> int:  # noqa: ANN001
    """The ``burst`` a launch of stack ``w`` takes: ``burst`` where given, else ``BURST`` where set,
    else the stack's ``burst``, else ``BURST_DEFAULT``."""
    return next(b for b in (burst, BURST, w.burst, BURST_DEFAULT) if b is not None)


def backoff_of(w, backoff: int | None = None) -> int:  # noqa: ANN001
    """The ``backoff`` a launch of stack ``w`` takes: ``backoff`` where given, else ``BACKOFF`` where
    set, else the stack's ``backoff``, else ``BACKOFF_DEFAULT``."""
    return next(b for b in (backoff, BACKOFF, w.backoff, BACKOFF_DEFAULT) if b is not None)


def errors(w) -> int:  # noqa: ANN001
    """Whether any of this stack's CUDA launches hit a poll limit (a bug: 1 a scratch); a device sync."""
    return sum(int(sc.ctl[2]) for k, sc in w.scratch.items() if isinstance(k, tuple) and k and k[0] == "cuda")
