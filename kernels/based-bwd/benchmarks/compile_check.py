"""Compile the based-bwd Triton kernels for Hopper (sm_90a) on a machine without a GPU, for every shipped
launch configuration, and print the resources ptxas reports.

Why: the Triton interpreter (the CPU tests) accepts code that the compiler rejects, and register spills only
show at compile time. This finds both before the GPU run. Triton lowers to PTX offline; the resource line
comes from the ptxas that Triton bundles, run with `-v` on that PTX.

    .venv/bin/python kernels/based-bwd/benchmarks/compile_check.py            # every config, K, dtype, V
    .venv/bin/python kernels/based-bwd/benchmarks/compile_check.py --k 16 --dtype bf16 --v 128

Exit status 1 when a kernel fails to compile, or when a bf16 kernel spills more than --max-spill bytes where
its plan leaves the register count to ptxas; a plan that caps it (maxnreg) trades spills for occupancy on
purpose, on the strength of a GPU measurement, and shows as "capped". fp32 inputs are the exact-arithmetic
test path (IEEE fp32 matmuls, not tensor cores): there only compiling counts.
"""

import argparse
import importlib
import re
import subprocess
import sys
import tempfile
import types
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

SOURCE = Path(__file__).resolve().parents[1] / "torch-ext" / "based_bwd"
TARGET = GPUTarget("cuda", 90, 32)
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
# pointer arguments that hold the inputs' dtype (the states too: bf16 for 16-bit inputs, fp32 for fp32);
# every other pointer is an fp32 scratch
INPUT_DTYPE_ARGS = {"q", "k", "v", "do", "dq", "dk", "dv", "x", "y", "g_out", "g_in", "states"}
SCALAR_TYPES = {"T": "i32", "H": "i32", "V": "i32", "N": "i32", "scale": "fp32"}
# Integers Triton's launcher marks as multiples of 16 at the measure shapes (T, V and the chunk count there
# are; H is 24 at one), as the GPU compile specializes them: without this the offline address arithmetic
# is scalar and the register counts come out near twice what Nsight Compute reports on the H200.
DIVISIBLE_SCALARS = {"T", "V", "N"}


def load_source_module():
    """triton_backward from the source tree, without the package __init__ (which needs the built _ops)."""
    pkg = types.ModuleType("based_bwd_source")
    pkg.__path__ = [str(SOURCE)]
    sys.modules[pkg.__name__] = pkg
    return importlib.import_module(f"{pkg.__name__}.triton_backward")


def compile_kernel(fn, dtype_name: str, constexprs: dict, num_warps: int, maxnreg: int | None):
    """The compiled kernel for sm_90a, with pointer arguments marked 16-byte aligned as torch allocates them."""
    signature, attrs = {}, {}
    for i, param in enumerate(fn.params):
        name = param.name
        if param.is_constexpr:
            signature[name] = "constexpr"
        elif name in SCALAR_TYPES:
            signature[name] = SCALAR_TYPES[name]
            if name in DIVISIBLE_SCALARS:
                attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            signature[name] = "*" + (dtype_name if name in INPUT_DTYPE_ARGS else "fp32")
            attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=TARGET, options={"num_warps": num_warps, "num_stages": 1, "maxnreg": maxnreg})


def ptxas_resources(ptx: str) -> dict:
    """Registers per thread and spill bytes, from `ptxas -v` on the kernel's PTX."""
    ptxas = triton.knobs.nvidia.ptxas.path
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "kernel.ptx"
        src.write_text(ptx)
        log = subprocess.run([ptxas, "-v", f"--gpu-name=sm_{TARGET.arch}a", str(src), "-o", str(Path(tmp) / "k.cubin")],
                             check=True, capture_output=True, text=True).stderr
    regs = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    return {"regs": int(regs.group(1)), "spill_st": int(spills.group(1)), "spill_ld": int(spills.group(2))}


def occupancy(regs: int, warps: int, shared: int) -> int:
    """Resident CTAs per SM on an H100/H200: 64K registers, 228 KiB shared memory (1 KiB reserved per CTA),
    64 warps; registers are allocated per warp in units of 256."""
    regs_per_warp = -(-regs * 32 // 256) * 256
    by_regs = 65536 // (regs_per_warp * warps)
    by_smem = (233472 // (shared + 1024)) if shared else 32
    return min(by_regs, by_smem, 64 // warps, 32)


def cases(mod, ks, dtypes, vs):
    """(config, K, dtype name, V) for every config the package ships: CONFIG_CHOICES (which the benchmark
    times and the GPU tests check at every K) and the default of each K."""
    for K in ks:
        for config in sorted(set(mod.CONFIG_CHOICES) | {mod.DEFAULT_CONFIG[K]}, key=str):
            for dtype_name in dtypes:
                for V in vs:
                    yield config, K, dtype_name, V


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--k", type=int, nargs="+", default=[8, 16], help="feature sizes K (default: 8 16)")
    parser.add_argument("--dtype", nargs="+", choices=sorted(DTYPES), default=["bf16", "fp32"],
                        help="input dtypes (default: bf16 fp32)")
    parser.add_argument("--v", type=int, nargs="+", default=[64, 128], help="value sizes V (default: 64 128)")
    parser.add_argument("--max-spill", type=int, default=128,
                        help="spill bytes (stores) above which a bf16 kernel counts as failing (default: 128)")
    args = parser.parse_args(argv)

    mod = load_source_module()
    print("| config | K | dtype | V | kernel | regs | spill st/ld B | smem B | CTAs/SM | status |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    failures = 0
    seen = {}
    for config, K, dtype_name, V in cases(mod, args.k, args.dtype, args.v):
        for name, (fn, constexprs, warps, maxnreg) in mod.launch_plan(K, V, DTYPES[dtype_name], config).items():
            key = (fn.__name__, dtype_name, warps, maxnreg, tuple(sorted((k, str(v)) for k, v in constexprs.items())))
            if key not in seen:  # V only matters through BV: compile each distinct kernel once
                try:
                    compiled = compile_kernel(fn, dtype_name, constexprs, warps, maxnreg)
                    res = ptxas_resources(compiled.asm["ptx"])
                    res["smem"] = compiled.metadata.shared
                    res["ctas"] = occupancy(res["regs"], warps, res["smem"])
                    spills_too_much = dtype_name == "bf16" and maxnreg is None and res["spill_st"] > args.max_spill
                    res["status"] = "SPILLS" if spills_too_much else "capped" if maxnreg else "ok"
                except Exception as e:  # noqa: BLE001 - report every failing kernel, not just the first
                    res = {"status": "FAILED: " + " ".join(str(e).split())[-300:]}
                seen[key] = res
            res = seen[key]
            failures += res["status"] not in ("ok", "capped")
            if "regs" in res:
                cells = [res["regs"], f"{res['spill_st']}/{res['spill_ld']}", res["smem"], res["ctas"]]
            else:
                cells = ["-"] * 4
            row = [tuple(config), K, dtype_name, V, name, *cells, res["status"]]
            print("| " + " | ".join(str(c) for c in row) + " |", flush=True)
    print(f"\n{failures} failing kernel launch(es)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
