"""Compile every candidate configuration the benchmark sweeps for sm_90 without a GPU, and report registers
and spills (ptxas -v on Triton's PTX).

    .venv/bin/python kernels/ldsa/benchmarks/compile_sm90.py

Arguments are specialized as Triton 3.6 would at those shapes: pointers 16-byte aligned, ints divisible by
16 marked so, ints equal to 1 folded into constants. Exits nonzero if any kernel spills.
"""

import argparse
import importlib
import importlib.util
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

VARIANT = Path(__file__).resolve().parents[1] / "build" / "torch-cuda"
H, DH = 8, 64
SHAPES = [(64, 3000), (32, 1024), (16, 256)]
WINDOWS = [(14, 0), (7, 7)]
DTYPES = {torch.bfloat16: "bf16", torch.float32: "fp32"}
LAUNCH_OPTIONS = ("maxnreg",)


def load_kernels():
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("unset TRITON_INTERPRET: this compiles for the GPU")
    spec = importlib.util.spec_from_file_location("ldsa", VARIANT / "__init__.py", submodule_search_locations=[str(VARIANT)])
    module = importlib.util.module_from_spec(spec)
    sys.modules["ldsa"] = module
    spec.loader.exec_module(module)
    return importlib.import_module("ldsa.ldsa_triton")


class Recorder:
    """Stands in for `_launch`: records (kernel, args, meta, num_warps) instead of launching."""

    def __init__(self):
        self.launches = []

    def __call__(self, kernel, programs, args, meta, num_warps):
        self.launches.append((kernel, args, meta, num_warps))


def compile_sm90(kernel, args, meta, num_warps):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    meta = dict(meta)
    # Launch options that are not kernel arguments go to the compiler (maxnreg becomes PTX's .maxnreg).
    options = {"num_warps": num_warps, **{name: meta.pop(name) for name in LAUNCH_OPTIONS if name in meta}}
    signature, constexprs, attrs = {}, dict(meta), {}
    for i, (name, x) in enumerate(zip(kernel.arg_names, args)):
        if isinstance(x, torch.Tensor):
            signature[name] = "*" + {torch.bfloat16: "bf16", torch.float32: "fp32", torch.float16: "fp16"}[x.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif x == 1:
            signature[name] = "constexpr"
            constexprs[name] = 1
        else:
            signature[name] = "i32"
            if x % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    for name in meta:
        signature[name] = "constexpr"
    src = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def ptxas_report(ptx: str) -> tuple[int, int]:
    """(registers, spill bytes stored) from ptxas -v on the PTX."""
    import triton

    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        out = subprocess.run([str(ptxas), "-arch=sm_90a", "-v", f.name, "-o", os.devnull], capture_output=True, text=True)
    text = out.stdout + out.stderr
    regs = int(re.search(r"Used (\d+) registers", text).group(1))
    spills = int(re.search(r"(\d+) bytes spill stores", text).group(1))
    return regs, spills


def main() -> int:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    kernels = load_kernels()
    recorder = Recorder()
    kernels._launch = recorder
    for dtype in DTYPES:
        for left, right in WINDOWS:
            for B, T in SHAPES:
                # Meta tensors: shapes and dtypes without memory; data_ptr() is 0, so 16-byte aligned.
                a = torch.empty(B, H, left + right + 1, T, dtype=dtype, device="meta")
                v = torch.empty(B, H, DH, T, dtype=dtype, device="meta")
                for config in kernels.FORWARD_CONFIGS:
                    kernels.ldsa_forward(a, v, left, right, config=config)
                for config in kernels.BACKWARD_CONFIGS:
                    kernels.ldsa_backward(a, v, torch.empty_like(v), left, right, config=config)
    seen, failed = set(), 0
    for kernel, args, meta, num_warps in recorder.launches:
        spec = tuple((x.dtype, "tensor") if isinstance(x, torch.Tensor) else (x == 1, x % 16 == 0) for x in args)
        key = (kernel.__name__, num_warps, tuple(meta.items()), spec)
        if key in seen:
            continue
        seen.add(key)
        compiled = compile_sm90(kernel, args, meta, num_warps)
        regs, spills = ptxas_report(compiled.asm["ptx"])
        failed += spills > 0
        dtypes = ",".join(sorted({DTYPES.get(x.dtype, str(x.dtype)) for x in args if isinstance(x, torch.Tensor)}))
        print(f"{'SPILLS' if spills else 'ok':6} {kernel.__name__:24} {dtypes:9} warps={num_warps} regs={regs:3} "
              f"spill_bytes={spills:5} shared={compiled.metadata.shared:6} {meta}", flush=True)  # fmt: skip
    print(f"{len(seen)} kernels compiled for sm_90, {failed} spill")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
