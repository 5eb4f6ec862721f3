"""The elementwise glue around the convolutions of a streaming SEANet step, one kernel each.

Mimi's streaming decoder step runs ~250 kernels in a CUDA graph on the H200 and is latency-bound:
each small kernel costs ~2 µs whatever it does. Around every cuDNN conv of the SEANet step sit
several tiny ones, which these two kernels replace:

* ``state_concat`` before a causal conv with left context P > 0: the ELU that precedes the conv,
  the ``cat([state, x])`` and the copy of the buffer's last P samples back into the state
  (3 kernels; 2 without the ELU) become one. It writes buf = [state, act(x)] (act = ELU with
  alpha 1, or identity) and the new state buf[..., T:] in place.
* ``overlap_add`` after a transposed conv run without bias: the overlap-tail add, the copy of the
  new tail, the ``cat`` of head and body and the bias add (4 kernels) become one.
* ``bias_act`` after a conv run without bias: its bias add, the residual add of a res block and
  the ELU after either (2-3 kernels) become one, act(y + bias (+ residual)) rounded once.

Race-freedom of the in-place state (both kernels read the old state and write the new one): the
grid is (row, channel block, time block), and only the programs of time block 0 touch the state;
each owns its row and channels, reads all of its old state, passes a block barrier, then writes.
No other program reads or writes those addresses.

With ``rows`` [B] (int64, on the device) row b of the input steps the state of row rows[b] of a
bigger state tensor [S, C, ·], read and written in place: the server's step over a subset of its
slots then needs no gather of their states before the step and no write-back after it. Rows must
be distinct, except for padding rows (whose state is garbage anyway).

Both kernels take any strides, so they serve the plain [B, C, T] layout and the channels-last 4-D
[B, C, 1, T] one (``engines.channels_last``: stored time-major; the conv states are views of one flat
buffer). The output is allocated in the layout its consumer convolves without a transpose:
channels-last for 4-D input, contiguous for 3-D.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor

from ._triton import check, pdl_jit, pdl_launch, state_row_jit, use_triton

__all__ = ["state_concat", "state_concat_ref", "overlap_add", "overlap_add_ref", "bias_act", "bias_act_ref"]

_ELEMS = 1024  # elements per program: small tiles, many programs (the step has B of 1 to a few dozen)
_MAX_BLOCK_C = 64


def bias_act_ref(y: Tensor, bias: Tensor, residual: Tensor | None = None, elu: bool = False) -> Tensor:
    """PyTorch reference: act(y + bias[c] (+ residual)) in float32, rounded once to y's dtype."""
    out = y.float() + bias.float().view(-1, *[1] * (y.dim() - 2))
    if residual is not None:
        out = out + residual.float()
    return (F.elu(out) if elu else out).to(y.dtype)


def _store_rows(state: Tensor, rows: Tensor | None, new: Tensor) -> None:
    if rows is None:
        state.copy_(new)
    else:
        state[rows] = new


def state_concat_ref(x: Tensor, state: Tensor, elu: bool, rows: Tensor | None = None) -> Tensor:
    """PyTorch reference: buf = cat([state, elu(x) if elu else x]) along time; state <- buf[..., T:]
    (with ``rows``: the state rows ``rows``)."""
    buf = torch.cat([state if rows is None else state[rows], F.elu(x) if elu else x], dim=-1)
    _store_rows(state, rows, buf[..., buf.shape[-1] - state.shape[-1]:])
    return buf


def overlap_add_ref(y: Tensor, tail: Tensor, bias: Tensor | None, n_out: int, rows: Tensor | None = None) -> Tensor:
    """PyTorch reference: out = y[..., :n_out] with tail added to its first V samples and bias to
    all; tail <- y[..., n_out:] (V = tail length; with ``rows``: the tail rows ``rows``)."""
    v = tail.shape[-1]
    head = y[..., :v] + (tail if rows is None else tail[rows])
    _store_rows(tail, rows, y[..., n_out:])
    out = torch.cat([head, y[..., v:n_out]], dim=-1)
    if bias is not None:
        out = out + bias.view(-1, *[1] * (y.dim() - 2))
    return out


@functools.cache
def _kernels():
    global triton, tl, libdevice, _act, _pdl_enter, _state_row  # the jit'd functions resolve these through module globals
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
    _pdl_enter = pdl_jit()
    _state_row = state_row_jit()

    @triton.jit
    def _act(x, ELU: tl.constexpr, LIBDEVICE: tl.constexpr):
        if ELU:
            xf = x.to(tl.float32)
            if LIBDEVICE:  # the accurate expm1f PyTorch's CUDA ELU uses
                neg = libdevice.expm1(xf)
            else:  # the CPU interpreter has no libdevice
                neg = tl.exp(xf) - 1.0
            return tl.where(xf > 0, xf, neg).to(x.dtype)
        return x

    @triton.jit
    def _state_concat_kernel(
        x_ptr,  # *x [B, C, T], strides sx_b, sx_c, sx_t
        s_ptr,  # *state [B or S, C, P], strides ss_b, ss_c, ss_t: old state read, new state written
        o_ptr,  # *buf [B, C, P + T] output, strides so_b, so_c, so_t
        rows_ptr,  # *rows [B] int64: the state row of each input row (read only when HAS_ROWS)
        C, T, P,
        sx_b, sx_c, sx_t,
        ss_b, ss_c, ss_t,
        so_b, so_c, so_t,
        ELU: tl.constexpr,  # act = ELU (alpha 1), else identity
        LIBDEVICE: tl.constexpr,
        HAS_ROWS: tl.constexpr,
        BLOCK_C: tl.constexpr,
        BLOCK_T: tl.constexpr,
        BLOCK_P: tl.constexpr,  # >= P
        PDL: tl.constexpr = False,
    ):
        _pdl_enter(PDL)
        b = tl.program_id(0).to(tl.int64)
        sb = _state_row(b, rows_ptr, HAS_ROWS)
        c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        cm = c < C
        x_row = x_ptr + b * sx_b + c[None, :] * sx_c
        o_row = o_ptr + b * so_b + c[None, :] * so_c
        # Body: buf[P + t] = act(x[t]).
        t = tl.program_id(2) * BLOCK_T + tl.arange(0, BLOCK_T)
        m = (t < T)[:, None] & cm[None, :]
        xv = tl.load(x_row + t[:, None] * sx_t, mask=m)
        tl.store(o_row + (P + t)[:, None] * so_t, _act(xv, ELU, LIBDEVICE), mask=m)
        if tl.program_id(2) == 0:
            # Head and new state: this program alone reads and writes the state of its channels.
            p = tl.arange(0, BLOCK_P)
            pm = (p < P)[:, None] & cm[None, :]
            s_row = s_ptr + sb * ss_b + c[None, :] * ss_c
            head = tl.load(s_row + p[:, None] * ss_t, mask=pm)
            # new state[p] = buf[T + p]: the old state's samples T.. while T + p < P, then act(x).
            q = T + p
            from_old = (q < P)[:, None]
            old = tl.load(s_row + q[:, None] * ss_t, mask=pm & from_old)
            new = tl.load(x_row + (q - P)[:, None] * sx_t, mask=pm & ~from_old)
            new = tl.where(from_old, old, _act(new, ELU, LIBDEVICE))
            tl.store(o_row + p[:, None] * so_t, head, mask=pm)
            tl.debug_barrier()  # every thread's old-state reads are done before any overwrite
            tl.store(s_row + p[:, None] * ss_t, new, mask=pm)

    @triton.jit
    def _overlap_add_kernel(
        y_ptr,  # *y [B, C, N + V] transposed-conv output without bias, strides sy_b, sy_c, sy_t
        v_ptr,  # *tail [B or S, C, V], strides sv_b, sv_c, sv_t: old tail read, new tail written
        bias_ptr,  # *bias [C] (read only when HAS_BIAS)
        o_ptr,  # *out [B, C, N] output, strides so_b, so_c, so_t
        rows_ptr,  # *rows [B] int64: the tail row of each input row (read only when HAS_ROWS)
        C, N, V,
        sy_b, sy_c, sy_t,
        sv_b, sv_c, sv_t,
        so_b, so_c, so_t,
        HAS_BIAS: tl.constexpr,
        HAS_ROWS: tl.constexpr,
        BLOCK_C: tl.constexpr,
        BLOCK_T: tl.constexpr,  # >= V, so only time block 0 reads the old tail
        BLOCK_V: tl.constexpr,  # >= V
        PDL: tl.constexpr = False,
    ):
        _pdl_enter(PDL)
        b = tl.program_id(0).to(tl.int64)
        sb = _state_row(b, rows_ptr, HAS_ROWS)
        c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        cm = c < C
        y_row = y_ptr + b * sy_b + c[None, :] * sy_c
        v_row = v_ptr + sb * sv_b + c[None, :] * sv_c
        t = tl.program_id(2) * BLOCK_T + tl.arange(0, BLOCK_T)
        m = (t < N)[:, None] & cm[None, :]
        yv = tl.load(y_row + t[:, None] * sy_t, mask=m)
        tv = tl.load(v_row + t[:, None] * sv_t, mask=m & (t < V)[:, None], other=0.0)
        h = (yv.to(tl.float32) + tv.to(tl.float32)).to(yv.dtype)  # rounded as the unfused head add stores it
        if HAS_BIAS:
            h = (h.to(tl.float32) + tl.load(bias_ptr + c, mask=cm, other=0.0).to(tl.float32)[None, :]).to(yv.dtype)
        tl.store(o_ptr + b * so_b + c[None, :] * so_c + t[:, None] * so_t, h, mask=m)
        if tl.program_id(2) == 0:
            j = tl.arange(0, BLOCK_V)
            jm = (j < V)[:, None] & cm[None, :]
            new = tl.load(y_row + (N + j)[:, None] * sy_t, mask=jm)
            tl.debug_barrier()  # every thread's old-tail reads are done before any overwrite
            tl.store(v_row + j[:, None] * sv_t, new, mask=jm)

    @triton.jit
    def _bias_act_kernel(
        y_ptr,  # *y [B, C, T], strides sy_b, sy_c, sy_t
        bias_ptr,  # *bias [C]
        r_ptr,  # *residual [B, C, T], strides sr_b, sr_c, sr_t (read only when HAS_RES)
        o_ptr,  # *out [B, C, T], strides so_b, so_c, so_t
        C, T,
        sy_b, sy_c, sy_t,
        sr_b, sr_c, sr_t,
        so_b, so_c, so_t,
        HAS_RES: tl.constexpr,
        ELU: tl.constexpr,
        LIBDEVICE: tl.constexpr,
        BLOCK_C: tl.constexpr,
        BLOCK_T: tl.constexpr,
        PDL: tl.constexpr = False,
    ):
        _pdl_enter(PDL)
        b = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        t = tl.program_id(2) * BLOCK_T + tl.arange(0, BLOCK_T)
        cm = c < C
        m = (t < T)[:, None] & cm[None, :]
        h = tl.load(y_ptr + b * sy_b + c[None, :] * sy_c + t[:, None] * sy_t, mask=m).to(tl.float32)
        h += tl.load(bias_ptr + c, mask=cm, other=0.0).to(tl.float32)[None, :]
        if HAS_RES:
            h += tl.load(r_ptr + b * sr_b + c[None, :] * sr_c + t[:, None] * sr_t, mask=m).to(tl.float32)
        out_t = o_ptr.dtype.element_ty
        tl.store(o_ptr + b * so_b + c[None, :] * so_c + t[:, None] * so_t, _act(h, ELU, LIBDEVICE).to(out_t), mask=m)

    return _state_concat_kernel, _overlap_add_kernel, _bias_act_kernel


def _bct(t: Tensor, name: str) -> tuple[int, int, int, tuple[int, int, int]]:
    """(B, C, T, strides of B, C, T) of a [B, C, T] or channels-last-style [B, C, 1, T] tensor."""
    if t.dim() == 4:
        check(t.shape[2] == 1, f"{name}: a 4-D tensor must be [B, C, 1, T], got {tuple(t.shape)}")
        return t.shape[0], t.shape[1], t.shape[3], (t.stride(0), t.stride(1), t.stride(3))
    check(t.dim() == 3, f"{name} must be [B, C, T] or [B, C, 1, T], got {tuple(t.shape)}")
    return t.shape[0], t.shape[1], t.shape[2], (t.stride(0), t.stride(1), t.stride(2))


def _empty(like: Tensor, b: int, c: int, n: int) -> Tensor:
    """[B, C, n] contiguous, or for a 4-D ``like`` [B, C, 1, n] channels-last (what cuDNN convolves as is)."""
    if like.dim() == 4:
        return torch.empty((b, c, 1, n), device=like.device, dtype=like.dtype, memory_format=torch.channels_last)
    return torch.empty((b, c, n), device=like.device, dtype=like.dtype)


def _check_rows(rows: Tensor | None, b: int, bs: int, what: str, like: Tensor) -> None:
    """The state of x's B rows: the first B rows of a [B, ...] state, or rows ``rows`` [B] of any."""
    if rows is None:
        check(bs == b, f"{what} has {bs} rows for {b} input rows (pass rows= to step a subset of them)")
        return
    check(rows.shape == (b,) and rows.dtype == torch.long and rows.device == like.device and rows.stride(0) == 1,
          f"rows must be a contiguous [{b}] int64 on {like.device}, got {tuple(rows.shape)} {rows.dtype} on {rows.device}")


def _blocks(c: int, t: int, min_t: int = 1) -> tuple[int, int]:
    block_c = min(triton.next_power_of_2(c), _MAX_BLOCK_C)
    block_t = max(min(triton.next_power_of_2(t), max(1, _ELEMS // block_c)), min_t)
    return block_c, block_t


def state_concat(x: Tensor, state: Tensor, elu: bool, rows: Tensor | None = None) -> Tensor:
    """x [B, C, T], state [B, C, P] (P >= 1; updated in place) -> buf [B, C, P + T] = [state, act(x)]
    with act = ELU (alpha 1) when ``elu``, else identity; the new state is buf[..., T:] (any T >= 1,
    also T < P). Or all 4-D [B, C, 1, ·] (then buf is channels-last). With ``rows`` [B] the state
    is [S, C, P] and row b of x steps state row rows[b]. Any strides; x and state must not overlap."""
    tensors = [x, state] + ([rows] if rows is not None else [])
    if not use_triton("state_concat", *tensors):
        return state_concat_ref(x, state, elu, rows)
    check(x.dim() == state.dim(), f"x and state must have the same rank, got {x.dim()} and {state.dim()}")
    b, c, t, sx = _bct(x, "x")
    bs, cs, p, ss = _bct(state, "state")
    check(cs == c, f"state {tuple(state.shape)} does not fit x {tuple(x.shape)}")
    _check_rows(rows, b, bs, "state", x)
    check(t >= 1 and p >= 1, f"need T >= 1 and P >= 1, got T={t}, P={p}")
    check(x.dtype == state.dtype, f"x and state must share a dtype, got {x.dtype}, {state.dtype}")
    kernel = _kernels()[0]
    buf = _empty(x, b, c, p + t)
    if b == 0 or c == 0:
        return buf
    _, _, _, so = _bct(buf, "buf")
    block_c, block_t = _blocks(c, t)
    kernel[(b, triton.cdiv(c, block_c), triton.cdiv(t, block_t))](
        x, state, buf, rows if rows is not None else x, c, t, p, *sx, *ss, *so,
        ELU=bool(elu), LIBDEVICE=x.is_cuda, HAS_ROWS=rows is not None, BLOCK_C=block_c, BLOCK_T=block_t,
        BLOCK_P=triton.next_power_of_2(p), num_warps=4, **pdl_launch(x),
    )
    return buf


def bias_act(y: Tensor, bias: Tensor, residual: Tensor | None = None, elu: bool = False) -> Tensor:
    """y [B, C, T] (a conv's output without bias), bias [C], residual like y or None -> act(y + bias
    + residual) with act = ELU (alpha 1) when ``elu``, else identity, in float32 and rounded once to
    y's dtype. Or all 4-D [B, C, 1, T] (then out is channels-last). Any strides."""
    tensors = [y, bias] + ([residual] if residual is not None else [])
    if not use_triton("bias_act", *tensors):
        return bias_act_ref(y, bias, residual, elu)
    b, c, t, sy = _bct(y, "y")
    check(bias.shape == (c,), f"bias must be [{c}], got {tuple(bias.shape)}")
    sr = sy
    if residual is not None:
        check(residual.shape == y.shape and residual.dtype == y.dtype,
              f"residual must be y's shape and dtype, got {tuple(residual.shape)} {residual.dtype}")
        sr = _bct(residual, "residual")[3]
    kernel = _kernels()[2]
    out = _empty(y, b, c, t)
    if b == 0 or c == 0 or t == 0:
        return out
    _, _, _, so = _bct(out, "out")
    block_c, block_t = _blocks(c, t)
    kernel[(b, triton.cdiv(c, block_c), triton.cdiv(t, block_t))](
        y, bias, residual if residual is not None else y, out, c, t, *sy, *sr, *so,
        HAS_RES=residual is not None, ELU=bool(elu), LIBDEVICE=y.is_cuda, BLOCK_C=block_c, BLOCK_T=block_t,
        num_warps=4, **pdl_launch(y),
    )
    return out


def overlap_add(y: Tensor, tail: Tensor, bias: Tensor | None, n_out: int, rows: Tensor | None = None) -> Tensor:
    """y [B, C, n_out + V] (a transposed conv's output without bias), tail [B, C, V] (V <= n_out;
    updated in place), bias [C] or None -> out [B, C, n_out] = y[..., :n_out] + [tail, 0, ...] + bias,
    the head sum rounded to y's dtype before the bias is added (as the unfused ops do); the new tail
    is y[..., n_out:]. Or all 4-D [B, C, 1, ·] (then out is channels-last). With ``rows`` [B] the
    tail is [S, C, V] and row b of y steps tail row rows[b]. Any strides; y and tail must not overlap."""
    tensors = [y, tail] + ([bias] if bias is not None else []) + ([rows] if rows is not None else [])
    if not use_triton("overlap_add", *tensors):
        return overlap_add_ref(y, tail, bias, n_out, rows)
    check(y.dim() == tail.dim(), f"y and tail must have the same rank, got {y.dim()} and {tail.dim()}")
    b, c, ny, sy = _bct(y, "y")
    bt, ct, v, sv = _bct(tail, "tail")
    check(ct == c, f"tail {tuple(tail.shape)} does not fit y {tuple(y.shape)}")
    _check_rows(rows, b, bt, "tail", y)
    check(0 <= v <= n_out and ny == n_out + v, f"need y of length n_out + V with V <= n_out, got {ny}, n_out={n_out}, V={v}")
    check(y.dtype == tail.dtype, f"y and tail must share a dtype, got {y.dtype}, {tail.dtype}")
    if bias is not None:
        check(bias.shape == (c,) and bias.dtype == y.dtype, f"bias must be [{c}] of y's dtype, got {tuple(bias.shape)} {bias.dtype}")
    kernel = _kernels()[1]
    out = _empty(y, b, c, n_out)
    if b == 0 or c == 0 or n_out == 0:
        return out
    _, _, _, so = _bct(out, "out")
    block_v = triton.next_power_of_2(max(v, 1))
    block_c, block_t = _blocks(c, n_out, block_v)
    kernel[(b, triton.cdiv(c, block_c), triton.cdiv(n_out, block_t))](
        y, tail, bias if bias is not None else y, out, rows if rows is not None else y, c, n_out, v, *sy, *sv, *so,
        HAS_BIAS=bias is not None, HAS_ROWS=rows is not None, BLOCK_C=block_c, BLOCK_T=block_t, BLOCK_V=block_v, num_warps=4,
        **pdl_launch(y),
    )
    return out
