"""Compile the Triton kernels a layer launches for an H100 (sm_90a) on a machine without a GPU, and read what ptxas
made of them: registers, stack, local-memory (spill) instructions.

Two steps, two processes. :func:`capture` runs a callable under Triton's interpreter (the tests' CPU setting) and
records every kernel launch: the kernel, and each argument as the runtime would specialise it -- a tensor as its
element type and whether its address is 16-byte aligned, an integer equal to 1 as a constant, one divisible by 16
marked so, ``tl.constexpr`` parameters by value (``INTERPRET`` turned off), ``num_warps`` / ``num_stages``.
:func:`compile_launches` then
compiles each record with ``triton.compile`` for ``cuda:90`` in a subprocess without the interpreter (there the
kernels are ``JITFunction`` objects again) and reads ``cuobjdump``'s resource usage and SASS. Without those
specialisations ptxas sees unknown strides and spills where the GPU build does not, so a hand-written signature
is not a substitute.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]

_TRITON_TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64",
                 torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8",
                 torch.bool: "i1", torch.float8_e4m3fn: "fp8e4nv", torch.float8_e5m2: "fp8e5"}


def _describe(value):
    if isinstance(value, torch.Tensor):
        return {"tensor": _TRITON_TYPES[value.dtype], "aligned": value.data_ptr() % 16 == 0}
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return {"value": value}
    if isinstance(value, int):
        return {"int": value}
    if isinstance(value, float):
        return {"float": value}
    if hasattr(value, "value"):  # tl.constexpr and dtypes passed as constants
        return _describe(value.value)
    raise TypeError(f"sm90_offline: cannot describe a kernel argument of type {type(value).__name__}")


def capture(run) -> list[dict]:
    """Every kernel launch ``run()`` makes under the interpreter, in order (the kernels still run)."""
    from triton.runtime import interpreter

    launches = []
    original = interpreter.InterpretedFunction.run

    def recording(self, *args, grid, warmup, **kwargs):
        names = list(self.arg_names)
        values = dict(zip(names, args))
        options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
        values.update(kwargs)
        launches.append({"module": self.fn.__module__, "kernel": self.fn.__name__,
                         "args": {name: _describe(values[name]) for name in names if name in values},
                         "options": options})
        return original(self, *args, grid=grid, warmup=warmup, **kwargs)

    interpreter.InterpretedFunction.run = recording
    try:
        run()
    finally:
        interpreter.InterpretedFunction.run = original
    return launches


def compile_launches(launches: list[dict], timeout: float = 600) -> list[dict]:
    """Each launch compiled for sm_90a: ``{"kernel", "registers", "stack", "spill_loads", "spill_stores",
    "instructions"}`` (the counts are static SASS instructions)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "tests"), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, str(Path(__file__).resolve())], input=json.dumps(launches), env=env,
                          capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"sm90_offline: the compile step failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout)


def _compile(launch: dict) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = getattr(importlib.import_module(launch["module"]), launch["kernel"])
    signature, constexprs, attrs = {}, {}, {}
    for index, param in enumerate(kernel.params):
        name = param.name
        described = launch["args"].get(name)
        if described is None:  # a defaulted parameter the launch left out
            constexprs[name] = param.default
            signature[name] = "constexpr"
            continue
        if "tensordesc" in described:
            signature[name] = described["tensordesc"]
            continue
        value = described.get("value", described.get("int", described.get("float")))
        if name == "INTERPRET":  # the kernels' switch to their interpreter-only code: off, as on a GPU
            value = False
        if param.is_constexpr or "value" in described:
            constexprs[name] = value
            signature[name] = "constexpr"
        elif "tensor" in described:
            signature[name] = "*" + described["tensor"]
            if described["aligned"]:
                attrs[(index,)] = [["tt.divisibility", 16]]
        elif "int" in described:
            if value == 1 and not param.do_not_specialize:
                constexprs[name] = 1
                signature[name] = "constexpr"
            else:
                signature[name] = "i32" if -2**31 <= value < 2**31 else "i64"
                if value % 16 == 0 and not param.do_not_specialize:
                    attrs[(index,)] = [["tt.divisibility", 16]]
        else:
            signature[name] = "fp32"
    compiled = triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                              options=dict(launch["options"]))
    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    cubin = Path(os.environ.get("TMPDIR", "/tmp")) / f"sm90_offline_{os.getpid()}.cubin"
    cubin.write_bytes(compiled.asm["cubin"])
    try:
        usage = subprocess.run([str(tools / "cuobjdump"), "-res-usage", str(cubin)], capture_output=True, text=True,
                               check=True).stdout
        sass = subprocess.run([str(tools / "cuobjdump"), "-sass", str(cubin)], capture_output=True, text=True,
                              check=True).stdout
    finally:
        cubin.unlink()
    registers = int(re.search(r"REG:(\d+)", usage).group(1))
    stack = int(re.search(r"STACK:(\d+)", usage).group(1))
    opcodes = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", sass)
    return {"kernel": launch["kernel"], "registers": registers, "stack": stack,
            "spill_loads": opcodes.count("LDL"), "spill_stores": opcodes.count("STL"), "instructions": len(opcodes)}


if __name__ == "__main__":
    print(json.dumps([_compile(launch) for launch in json.loads(sys.stdin.read())]))
