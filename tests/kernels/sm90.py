"""Compiling kernels for the H200's sm_90 without a GPU, for the tests that check they build there.

Triton lowers a kernel to PTX and runs its bundled ptxas for sm_90 on any machine. A test writes a
script that calls ``compile_sm90`` for each kernel and configuration, and ``run_script`` runs it in
a fresh interpreter without TRITON_INTERPRET and with a cold kernel cache, so it really compiles.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def compile_sm90(fn, sig: dict, consts: dict, warps: int = 4, barrier: bool = False,  # noqa: ANN001, ANN201
                 divisible: tuple = ()):
    """Compile the jit'd ``fn`` for sm_90 with programmatic dependent launch: pointer/scalar types
    ``sig`` by argument name (others i32), constexprs ``consts``; assert the cubin exists, the PTX
    waits on the previous grid (PDL) and, with ``barrier``, holds a block barrier. Returns the
    compiled kernel (``.asm["ptx"]``, ``.metadata``). ``divisible`` names the arguments a real
    launch would specialise as multiples of 16 (aligned pointers, strides): without it the
    compiler can neither vectorise nor software-pipeline their loads (no cp.async stages)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    consts = {"PDL": True, **consts}  # with the griddepcontrol wait/launch the GPU path uses on sm90
    full = {a: ("constexpr" if a in consts else sig.get(a, "i32")) for a in fn.arg_names}
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in divisible}
    src = ASTSource(fn, full, constexprs={(fn.arg_names.index(c),): v for c, v in consts.items()}, attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "launch_pdl": True})
    assert k.asm["cubin"] and "griddepcontrol.wait" in k.asm["ptx"], fn.fn.__name__
    assert not barrier or "bar.sync" in k.asm["ptx"], fn.fn.__name__  # an in-place state's barrier
    return k


def run_script(script: str, cache_dir: Path) -> None:
    """Run ``script`` (which imports this module as ``sm90`` and prints "compiled" at the end) in a
    fresh interpreter, compiling for real into the empty ``cache_dir``."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(cache_dir)  # a cold cache: really compile
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent), *filter(None, [env.get("PYTHONPATH")])])
    r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "compiled" in r.stdout, r.stderr[-3000:]
