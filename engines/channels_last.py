"""1-D convolutions run as 2-D ones over a height of 1, on channels-last activations and weights.

Activations are [B, C, 1, T] stored time-major (``to_cl``). With the weight channels-last too, the
convolution library takes both as they are: cuDNN without its layout transposes (the Mimi decoder
step on the H200: 260 → 136 µs of convs), and oneDNN on the CPU without reordering every call
(the Piper vocoder's convs on a 2-core VM: 142 → 94 ms an utterance). Elementwise ops keep the
layout, so a conv stack stays channels-last between its convs. The weight's channels-last copy is
cached on the module and made again only when the weight changes (load, move, cast).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["to_cl", "from_cl", "cl_weight", "conv1d_cl", "conv_transpose1d_cl", "conv"]


def to_cl(x: Tensor) -> Tensor:
    """[B, C, T] -> channels-last [B, C, 1, T] (a copy unless x is already stored time-major)."""
    return x.unsqueeze(2).contiguous(memory_format=torch.channels_last)


def from_cl(x: Tensor) -> Tensor:
    """Channels-last [B, C, 1, T] -> [B, C, T] (a view; time-major strides)."""
    return x.squeeze(2)


def cl_weight(conv: nn.Conv1d | nn.ConvTranspose1d) -> Tensor:
    """The conv's weight [A, B, k] as a channels-last [A, B, 1, k], cached on the module."""
    w = conv.weight
    key = (w.data_ptr(), w._version, w.dtype, w.device)
    if getattr(conv, "_cl_key", None) != key:
        conv._cl_weight = w.detach().unsqueeze(2).contiguous(memory_format=torch.channels_last)
        conv._cl_key = key
    return conv._cl_weight


def conv1d_cl(conv: nn.Conv1d, x: Tensor, padding: int | None = None, bias: bool = True) -> Tensor:
    """``conv(x)`` for channels-last x [B, C, 1, T] -> [B, C', 1, T']. ``padding`` (both sides)
    defaults to the module's own; padding modes other than zeros are not supported; ``bias=False``
    leaves the bias out."""
    assert conv.padding_mode == "zeros" and not isinstance(conv.padding, str)
    pad = conv.padding[0] if padding is None else padding
    return F.conv2d(x, cl_weight(conv), conv.bias if bias else None, (1, conv.stride[0]), (0, pad),
                    (1, conv.dilation[0]), conv.groups)


def conv(m: nn.Conv1d | nn.ConvTranspose1d, x: Tensor, bias: bool = True) -> Tensor:
    """``m(x)`` in x's layout: [B, C, T] as the module runs it, channels-last [B, C, 1, T] as above
    (``bias=False``: without the module's bias; a consumer adds it, fused with its own work)."""
    if x.dim() == 3:
        if bias:
            return m(x)
        assert isinstance(m, nn.Conv1d) and m.padding_mode == "zeros"
        return F.conv1d(x, m.weight, None, m.stride, m.padding, m.dilation, m.groups)
    return conv1d_cl(m, x, bias=bias) if isinstance(m, nn.Conv1d) else conv_transpose1d_cl(m, x, bias=bias)


def conv_transpose1d_cl(conv: nn.ConvTranspose1d, x: Tensor, bias: bool = True, padding: int | None = None) -> Tensor:
    """``conv(x)`` for channels-last x [B, C, 1, T] -> [B, C', 1, T'] (``bias=False`` leaves the
    bias out; ``padding`` defaults to the module's own)."""
    assert conv.output_padding[0] == 0 and conv.dilation[0] == 1
    pad = conv.padding[0] if padding is None else padding
    return F.conv_transpose2d(x, cl_weight(conv), conv.bias if bias else None, (1, conv.stride[0]), (0, pad),
                              groups=conv.groups)
