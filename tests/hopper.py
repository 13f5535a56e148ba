"""Compile Triton kernels for Hopper (sm_90) without a GPU.

The interpreter that runs the kernels in CI ignores what only the compiler
checks (argument annotations, pointer casts, block shapes), so each kernel is
also lowered to a cubin in a fresh process, with the interpreter off and an
empty cache: a kernel that cannot compile for the GPU fails here, on the CPU.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

#: Defines ``compile(fn, types, consts, kind="cubin")``: the cubin (or
#: ``kind="ptx"``) of ``fn`` (a function still to be jitted) for sm_90, argument
#: types in Triton's signature strings; and ``programmatic(ptx)``: whether the
#: code carries the programmatic-launch wait and release.
_PRELUDE = textwrap.dedent(
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    def compile(fn, types, consts, kind="cubin"):
        fn = triton.jit(fn)
        sig = dict(zip(fn.arg_names, types))
        sig.update(dict.fromkeys(consts, "constexpr"))
        src = ASTSource(fn=fn, signature=sig, constexprs=consts)
        return triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm[kind]

    def programmatic(ptx):  # waits on its predecessor grid, releases its dependents
        return "griddepcontrol.wait" in ptx and "griddepcontrol.launch_dependents" in ptx
    """
)


def compile_for_hopper(script: str, cache_dir: Path) -> None:
    """Run ``script`` (which calls ``compile``) after the prelude in a fresh
    process; it must print ``compiled`` and exit 0."""
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(cache_dir)}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # silences a Triton default-change warning
    done = subprocess.run(
        [sys.executable, "-c", _PRELUDE + textwrap.dedent(script)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert done.returncode == 0 and done.stdout.strip() == "compiled", done.stderr[-3000:]
