"""Build the part of FlashInfer's SM90 CUTLASS fused-MoE module (``fused_moe_90``) that the ``flashinfer_cutlass``
peers call, with FlashInfer's own JIT generator and build rules, and place it where FlashInfer loads prebuilt
modules from (``<flashinfer>/data/aot/fused_moe_90/fused_moe_90.so``), so that the first call loads instead of
compiling.

    FLASHINFER_WORKSPACE_BASE=/tmp/fi-ws python3 benchmarks/flashinfer_prebuild.py --jobs 16 [--install]

Needs ``flashinfer`` importable (0.7.2.post1), ``nvcc`` (CUDA 12.8+; the device and the build machine both have
13.0), ``ninja``, and the cuBLAS, NVRTC and cuRAND headers and ``libnvrtc`` / ``libcuda`` to link against
(``--cuda-extra``: a folder with ``include/`` and ``lib/``; ``flashinfer_carry.sh`` carries the headers and links the
libraries). No GPU: the target is fixed to ``sm_90a`` (``FLASHINFER_CUDA_ARCH_LIST=9.0a``).

Why a subset: FlashInfer's module compiles 248 translation units (every activation / weight type pair the
TensorRT-LLM MoE runner knows: fp16, fp32, int4, int8, FP4 and MXFP4 weights, the dense fpA-intB GEMMs), about 3
CPU-minutes each. The peers need two type pairs only: bf16 x bf16 and the FP8 pairs (per-tensor FP8 x FP8 with bf16
output, DeepSeek-style 128x128 block-scaled FP8 weights with bf16 activations). :func:`selected_sources` keeps the
generated CUTLASS instantiations that name bf16 and no 4-bit type, and FlashInfer's hand-written sources except the
per-type GEMM files of the other pairs. The instantiations left out are then undefined symbols of the ``.so``; the
library is opened lazily (``RTLD_LAZY``, as ``tvm_ffi.load_module`` does), so they bind only if called, which the
bf16 / FP8 paths never do. Those that kept code takes the address of (dispatch tables: bound at load time) get
weak definitions that abort (:func:`abort_stubs`); :func:`undefined_kernel_symbols` then checks that no undefined
one is left that would stop the library from loading.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

# per-type GEMM sources of the runner's other type pairs (activation_weight): not needed by bf16 / FP8 calls
UNUSED_TYPE_PAIRS = ("fp8_uint4", "fp8_fp4", "fp4_fp4", "fp32_fp32", "fp16_uint8", "fp16_uint4", "fp16_fp16",
                     "bf16_uint8", "bf16_uint4", "bf16_fp4", "fp16_fp4")
BF16_NAMES = ("__nv_bfloat16", "cutlass::bfloat16_t")
FOUR_BIT_NAMES = ("uint4b_t", "SafeFP4", "Fp4", "fp4")
MODULE = "fused_moe_90"


def keeps_generated(path: Path, text: str) -> bool:
    """A generated CUTLASS instantiation file is kept if it is a grouped (MoE) GEMM that names bf16 and no 4-bit
    or 8-bit-integer weight type (the dense ``gemm/`` files are the fpA-intB GEMMs: never used by the MoE peers)."""
    if "gemm_grouped" not in path.parts or "Mixed" in path.name:
        return False
    return any(name in text for name in BF16_NAMES) and not any(name in text for name in FOUR_BIT_NAMES)


def keeps_handwritten(path: Path) -> bool:
    match = re.fullmatch(r"moe_gemm_kernels_(\w+)\.cu", path.name)
    return match is None or match.group(1) not in UNUSED_TYPE_PAIRS


def selected_sources(sources: list[Path]) -> list[Path]:
    return [s for s in sources if (keeps_generated(s, s.read_text()) if s.name.endswith(".generated.cu")
                                   else keeps_handwritten(s))]


def undefined_kernel_symbols(library: Path) -> tuple[list[str], list[str]]:
    """``(undefined tensorrt_llm symbols, those of them referenced by a non-call relocation)``."""
    dynsym = subprocess.run(["nm", "-D", "--undefined-only", str(library)], capture_output=True, text=True,
                            check=True).stdout.split()
    ours = sorted({s for s in dynsym if "tensorrt_llm" in s or s.startswith("_ZN12tensorrt_llm")})
    relocs = subprocess.run(["readelf", "-rW", str(library)], capture_output=True, text=True, check=True).stdout
    eager = sorted({line.split()[4] for line in relocs.splitlines()
                    if len(line.split()) > 4 and line.split()[4] in ours and "JUMP_SLOT" not in line})
    return ours, eager


def abort_stubs(symbols: list[str]) -> str:
    """x86-64 assembly defining each of ``symbols`` as a weak function that calls ``abort``. For the left-out
    instantiations that the kept sources take the address of (dispatch tables): such a reference is bound when the
    library is opened, so without a definition it would not open. The bf16 / FP8 paths never call them; a call
    would abort the process rather than run a wrong kernel."""
    lines = ["    .text"]
    for symbol in symbols:
        lines += [f"    .weak {symbol}", f"    .type {symbol}, @function", f"{symbol}:", "    jmp abort@PLT"]
    return "\n".join(lines + ['    .section .note.GNU-stack,"",@progbits', ""])


def relink_with_abort_stubs(ninja: str, build_dir: Path, ninja_path: Path, library: Path, symbols: list[str]) -> None:
    """Link ``library`` again (ninja's own link command) with :func:`abort_stubs` for ``symbols`` added."""
    stubs = build_dir / "unused_instantiations.S"
    stubs.write_text(abort_stubs(symbols))
    subprocess.run(["cc", "-c", "-fPIC", str(stubs), "-o", str(stubs.with_suffix(".o"))], check=True)
    commands = subprocess.run([ninja, "-C", str(build_dir), "-f", str(ninja_path), "-t", "commands", str(library)],
                              capture_output=True, text=True, check=True).stdout.strip().splitlines()
    subprocess.run(f"{commands[-1]} {stubs.with_suffix('.o')}", shell=True, check=True, cwd=build_dir)


def ninja_binary() -> str:
    """``ninja`` on PATH, else the binary of the ``ninja`` wheel that flashinfer_carry.sh unpacked next to the
    ``ninja`` package (``ninja-*.data/scripts/ninja``: unpacked, not pip-installed, so not on PATH)."""
    found = shutil.which("ninja")
    if found:
        return found
    import ninja

    unpacked = sorted(Path(ninja.__file__).parent.parent.glob("ninja-*.data/scripts/ninja"))
    if not unpacked:
        raise SystemExit("no ninja on PATH and none unpacked next to the ninja package")
    return str(unpacked[0])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=2, help="parallel compile jobs (default 2)")
    parser.add_argument("--cuda-extra", type=Path, default=None,
                        help="folder with include/ (cublasLt.h, nvrtc.h) and lib/ (libnvrtc.so, libcuda.so) where "
                             "the CUDA toolkit lacks them")
    parser.add_argument("--out", type=Path, default=None, help="also copy the built library here")
    parser.add_argument("--install", action="store_true",
                        help="copy it into the importable flashinfer's data/aot/ (where FlashInfer looks first)")
    parser.add_argument("--list", action="store_true", help="print the selected sources and exit")
    args = parser.parse_args(argv)

    os.environ.setdefault("FLASHINFER_CUDA_ARCH_LIST", "9.0a")
    if args.cuda_extra:
        extra = args.cuda_extra.resolve()
        for var, sub in (("CPATH", "include"), ("LIBRARY_PATH", "lib")):
            os.environ[var] = os.pathsep.join(p for p in (str(extra / sub), os.environ.get(var)) if p)
    from flashinfer.jit import env as jit_env
    from flashinfer.jit.fused_moe import gen_cutlass_fused_moe_sm90_module

    full = gen_cutlass_fused_moe_sm90_module()
    if full.name != MODULE:
        raise SystemExit(f"FlashInfer chose module {full.name!r} (an H20?): only {MODULE!r} is prebuilt here")
    spec = dataclasses.replace(full, sources=selected_sources(full.sources))
    print(f"{MODULE}: {len(spec.sources)} of {len(full.sources)} sources", file=sys.stderr)
    if args.list:
        print("\n".join(str(s) for s in spec.sources))
        return 0
    spec.write_ninja()
    started = time.perf_counter()
    ninja = ninja_binary()
    subprocess.run(["nice", "-n", "10", ninja, "-C", str(spec.build_dir), "-f", str(spec.ninja_path),
                    "-j", str(args.jobs)], check=True)
    print(f"built in {time.perf_counter() - started:.0f} s: {spec.jit_library_path}", file=sys.stderr)
    undefined, eager = undefined_kernel_symbols(spec.jit_library_path)
    if eager:
        print(f"{len(eager)} left-out instantiations are referenced by address: linked to aborting stubs",
              file=sys.stderr)
        relink_with_abort_stubs(ninja, spec.build_dir, spec.ninja_path, spec.jit_library_path, eager)
        undefined, eager = undefined_kernel_symbols(spec.jit_library_path)
        if eager:
            raise SystemExit(f"undefined symbols referenced other than by calls (would fail at load): {eager[:5]}")
    print(f"{len(undefined)} kernel instantiations left undefined (bound lazily, never called by bf16 / FP8)",
          file=sys.stderr)
    targets = ([args.out] if args.out else []) + ([jit_env.FLASHINFER_AOT_DIR / MODULE] if args.install else [])
    for folder in targets:
        folder.mkdir(parents=True, exist_ok=True)
        shutil.copy2(spec.jit_library_path, folder / f"{MODULE}.so")
        print(f"copied to {folder / f'{MODULE}.so'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
