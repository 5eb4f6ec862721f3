"""Reader for CTranslate2 ``model.bin`` files (no ctranslate2 dependency at run time).

Layout (little-endian): uint32 binary_version, string spec_name, uint32 revision,
uint32 num_variables, then per variable: string name, uint8 rank, uint32 dims[rank],
uint8 dtype, uint32 num_bytes, raw row-major data; then uint32 num_aliases and
(alias, target) string pairs. A string is a uint16 byte length that counts a trailing NUL,
the UTF-8 bytes, then the NUL. Quantized (int8/int16) weights carry ``<name>_scale``;
the float value is ``q / scale`` (per output row for int8).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from realtime.errors import ModelFormatError

# CTranslate2's DataType enum order.
DTYPES: dict[int, torch.dtype] = {
    0: torch.float32,
    1: torch.int8,
    2: torch.int16,
    3: torch.int32,
    4: torch.float16,
    5: torch.bfloat16,
}
SUPPORTED_BINARY_VERSIONS = (5, 6)


@dataclass
class Ct2File:
    binary_version: int
    spec_name: str
    revision: int
    variables: dict[str, Tensor] = field(default_factory=dict)
    aliases: dict[str, str] = field(default_factory=dict)

    def resolve(self, name: str) -> str:
        seen = set()
        while name in self.aliases:
            if name in seen:
                raise ModelFormatError(f"alias cycle at {name!r}")
            seen.add(name)
            name = self.aliases[name]
        return name

    def __contains__(self, name: str) -> bool:
        return self.resolve(name) in self.variables

    def raw(self, name: str) -> Tensor:
        key = self.resolve(name)
        if key not in self.variables:
            raise ModelFormatError(f"CTranslate2 model has no variable {name!r}")
        return self.variables[key]

    def tensor(self, name: str, dtype: torch.dtype = torch.float32) -> Tensor:
        """A float copy of a weight in ``dtype``, dequantized if the file stores it quantized."""
        t = self.raw(name)
        scale_name = self.resolve(name) + "_scale"
        if t.dtype in (torch.int8, torch.int16) and scale_name in self.variables:
            scale = self.variables[scale_name].to(torch.float32)
            w = t.to(torch.float32)
            w = w / (scale.reshape(-1, *([1] * (w.dim() - 1))) if scale.dim() > 0 else scale)
            return w.to(dtype)
        if not t.is_floating_point():
            raise ModelFormatError(f"variable {name!r} is {t.dtype} without a scale, not a weight")
        return t.to(dtype)

    def scalar(self, name: str) -> int | float:
        t = self.raw(name)
        if t.numel() != 1:
            raise ModelFormatError(f"variable {name!r} is not a scalar")
        return t.reshape(()).tolist()


class _Cursor:
    def __init__(self, buf: bytearray, path: Path) -> None:
        self.buf, self.pos, self.path = buf, 0, path

    def take(self, n: int) -> int:
        start = self.pos
        if start + n > len(self.buf):
            raise ModelFormatError(f"{self.path.name}: truncated CTranslate2 file")
        self.pos += n
        return start

    def unpack(self, fmt: str) -> tuple:
        size = struct.calcsize("<" + fmt)
        return struct.unpack_from("<" + fmt, self.buf, self.take(size))

    def string(self) -> str:
        (n,) = self.unpack("H")
        start = self.take(n)
        raw = bytes(self.buf[start:start + n])
        if n == 0 or raw[-1] != 0:
            raise ModelFormatError(f"{self.path.name}: bad string in CTranslate2 file")
        return raw[:-1].decode("utf-8")


def read_ct2(path: str | Path) -> Ct2File:
    """Parse a CTranslate2 model.bin; variable tensors share one in-memory buffer (CPU)."""
    path = Path(path)
    if path.is_dir():
        path = path / "model.bin"
    try:
        buf = bytearray(path.read_bytes())  # writable, so torch.frombuffer can share it
    except OSError as e:
        raise ModelFormatError(f"cannot read {path}: {e}") from e
    cur = _Cursor(buf, path)
    (version,) = cur.unpack("I")
    if version not in SUPPORTED_BINARY_VERSIONS:
        raise ModelFormatError(f"{path.name}: CTranslate2 binary version {version} not supported")
    spec = cur.string()
    (revision,) = cur.unpack("I")
    (n_vars,) = cur.unpack("I")
    out = Ct2File(version, spec, revision)
    for _ in range(n_vars):
        name = cur.string()
        (rank,) = cur.unpack("B")
        dims = cur.unpack("I" * rank) if rank else ()
        (code,) = cur.unpack("B")
        (nbytes,) = cur.unpack("I")
        if code not in DTYPES:
            raise ModelFormatError(f"{path.name}: variable {name!r} has unknown dtype {code}")
        dt = DTYPES[code]
        count = 1
        for d in dims:
            count *= d
        itemsize = torch.empty((), dtype=dt).element_size()
        if count * itemsize != nbytes:
            raise ModelFormatError(f"{path.name}: variable {name!r} size {nbytes} != {dims} x {dt}")
        start = cur.take(nbytes)
        t = torch.frombuffer(buf, dtype=dt, count=count, offset=start) if count else torch.empty(0, dtype=dt)
        out.variables[name] = t.reshape(dims)
    (n_alias,) = cur.unpack("I")
    for _ in range(n_alias):
        alias = cur.string()
        out.aliases[alias] = cur.string()
    if cur.pos != len(buf):
        raise ModelFormatError(f"{path.name}: {len(buf) - cur.pos} trailing bytes after aliases")
    return out
