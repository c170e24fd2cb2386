"""Compile, for Hopper (sm_90a) and without a GPU, every Triton kernel a kernel package launches at its
benchmark's shapes and configurations, and print what ptxas reports: registers, spills, shared memory and
the CTAs an SM can hold.

Why: the Triton interpreter (the CPU tests) accepts code the compiler rejects, and spills and occupancy show
only at compile time. Each kernel's harness, `bench/<package>.py`, provides `compile_cases(kernel, spec)`, which
yields (label, call) pairs: each call makes the CUDA path's launches for one shape, configuration and dtype
on meta tensors (shapes and dtypes, no memory). While they run, this tool stands in for `JITFunction.run`:
instead of launching, it specializes the arguments with Triton's own binder for an sm_90a target (so
pointers, integers divisible by 16 and integers equal to 1 are specialized as a launch on the H200 would
specialize them), compiles, and runs the ptxas the installed Triton uses with -v. With that specialization
the register counts match Nsight Compute's on the H200 (without it an offline compile puts some near twice as
high).

    .venv/bin/python -m tools.compile_sm90                    # every kernel
    .venv/bin/python -m tools.compile_sm90 based-bwd --match "16, 128"

Exit status 1 when a kernel fails to compile, or when it spills more than --max-spill bytes where its launch
leaves the register count to ptxas; a launch that caps it (maxnreg) trades spills for occupancy on purpose,
on the strength of a GPU measurement, and shows as "capped". A kernel whose spills are such a trade made by its
design rather than a cap (one warpgroup of 255 registers, say, so that two CTAs share an SM) is named, with the bytes
it may spill, in its harness's SPILLS_BY_DESIGN, and shows as "by design" within them.
"""

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from . import specs
from .common import resolve
from .gpu_bench import build_into_hub, load_harness, load_kernel, use_hub_cache

TARGET_ARCH = 90
# An H100/H200 SM: 64K 32-bit registers (allocated per warp in units of 256), 228 KiB of shared memory of
# which a CTA may use 227 KiB and the driver keeps 1 KiB per CTA, at most 64 warps and 32 CTAs.
SM_REGISTERS, SM_SHARED, SM_WARPS, SM_CTAS = 65536, 233472, 64, 32


def ctas_per_sm(registers: int, warps: int, shared: int) -> int:
    by_registers = SM_REGISTERS // (-(-registers * 32 // 256) * 256 * warps)
    by_shared = SM_SHARED // (shared + 1024)
    return min(by_registers, by_shared, SM_WARPS // warps, SM_CTAS)


def ptxas(ptx: str) -> tuple[int, int]:
    """(registers a thread, bytes of spill stores) from ptxas -v on the kernel's PTX: the ptxas the installed
    Triton compiles sm_90a with (from 3.9 its `ptxas-blackwell`, which alone reads the PTX version it emits)."""
    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "kernel.ptx"
        source.write_text(ptx)
        log = subprocess.run([get_ptxas(TARGET_ARCH).path, "-v", f"--gpu-name=sm_{TARGET_ARCH}a", str(source),
                              "-o", str(Path(tmp) / "kernel.cubin")], check=True, capture_output=True, text=True).stderr
    registers = int(re.search(r"Used (\d+) registers", log).group(1))
    spills = int(re.search(r"(\d+) bytes spill stores", log).group(1))
    return registers, spills


class Compiler:
    """Stands in for JITFunction.run: compiles each distinct launch for sm_90a once and keeps its report."""

    def __init__(self):
        from triton.backends.compiler import GPUTarget
        from triton.compiler import make_backend

        self.target = GPUTarget("cuda", TARGET_ARCH, 32)
        self.backend = make_backend(self.target)
        self.reports = {}  # launch key -> report dict
        self.label = ""

    def run(self, fn, *args, grid, warmup, **kwargs):
        import triton
        from triton.compiler import ASTSource
        from triton.runtime.jit import create_function_from_signature

        kwargs.setdefault("debug", False)
        binder = create_function_from_signature(fn.signature, fn.params, self.backend)
        bound_args, specialization, options = binder(*args, **kwargs)
        options, signature, constexprs, attrs = fn._pack_args(self.backend, kwargs, bound_args, specialization,
                                                              options)
        key = (fn.__name__, repr(sorted(signature.items())), repr(sorted(constexprs.items())),
               repr(sorted(attrs.items())), options.num_warps, options.num_stages, options.maxnreg)
        if key in self.reports:
            return None
        report = dict(case=self.label, kernel=fn.__name__, warps=options.num_warps, stages=options.num_stages,
                      maxnreg=options.maxnreg, dtypes=",".join(sorted({t[1:] for t in signature.values()
                                                                        if t.startswith("*")})))
        try:
            if fn.is_gluon():  # a Gluon kernel compiles from its own source kind
                from triton.experimental.gluon._runtime import GluonASTSource as source
            else:
                source = ASTSource
            compiled = triton.compile(source(fn, signature, constexprs, attrs), target=self.target,
                                      options=options.__dict__)
            registers, spills = ptxas(compiled.asm["ptx"])
            shared = compiled.metadata.shared
            report.update(registers=registers, spills=spills, shared=shared,
                          ctas=ctas_per_sm(registers, options.num_warps, shared))
        except Exception as e:  # noqa: BLE001 - report every failing kernel, not only the first
            report["error"] = error_text(e)
        self.reports[key] = report
        return None


def error_text(error: BaseException) -> str:
    """A compile error in one line: the innermost cause's message (a CompilationError's own text is the source
    around the failing line; its cause, or the MLIR diagnostics ptxas or the verifier printed, say why)."""
    while error.__cause__ is not None:
        error = error.__cause__
    text = str(error.args[-1] if error.args and isinstance(error.args[-1], str) else error)
    return f"{type(error).__name__}: " + " ".join(text.split())[-300:]


def status(report: dict, max_spill: int, by_design: dict) -> str:
    if "error" in report:
        return "FAILED: " + report["error"]
    if report["maxnreg"] is not None:
        return "capped"
    if report["spills"] <= max_spill:
        return "ok"
    return "by design" if report["spills"] <= by_design.get(report["kernel"], 0) else "SPILLS"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.compile_sm90", description=__doc__.split("\n\n")[0])
    parser.add_argument("kernels", nargs="*", help="kernel names (default: all)")
    parser.add_argument("--match", help="only the cases whose label contains this text")
    parser.add_argument("--no-build", action="store_true",
                        help="load the kernels as built and laid into .hub/ already (make hub), without rebuilding")
    parser.add_argument("--max-spill", type=int, default=128,
                        help="spill bytes above which an uncapped kernel fails the check (default: 128)")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("unset TRITON_INTERPRET: this compiles for the GPU", file=sys.stderr)
        return 2
    names = [k.name for k in resolve(args.kernels)]
    if args.no_build:
        use_hub_cache()
    else:
        build_into_hub(names)
    import triton
    from triton.runtime.jit import JITFunction

    def spec(spec_name: str):
        try:
            return specs.spec(spec_name)
        except FileNotFoundError as e:
            raise SystemExit(str(e)) from None

    compiler = Compiler()
    by_design = {}  # kernel name -> the spill bytes its design accepts (the harnesses' SPILLS_BY_DESIGN)
    original_run = JITFunction.run
    JITFunction.run = lambda fn, *a, **kw: compiler.run(fn, *a, **kw)
    try:
        for name in names:
            harness, package = load_harness(name), load_kernel(name)
            by_design.update(getattr(harness, "SPILLS_BY_DESIGN", {}))
            for label, call in harness.compile_cases(package, spec):
                if args.match and args.match not in label:
                    continue
                compiler.label = f"{name} {label}"
                call()
    finally:
        JITFunction.run = original_run

    print("| case | kernel | dtypes | warps | stages | maxnreg | registers | spill B | shared B | CTAs/SM | status |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    failures = 0
    for r in compiler.reports.values():
        state = status(r, args.max_spill, by_design)
        failures += state not in ("ok", "capped", "by design")
        cells = [r.get(x, "-") for x in ("registers", "spills", "shared", "ctas")]
        print(f"| {r['case']} | {r['kernel']} | {r['dtypes']} | {r['warps']} | {r['stages']} | {r['maxnreg']} | "
              + " | ".join(map(str, cells)) + f" | {state} |")
    print(f"\n{len(compiler.reports)} distinct kernels compiled for sm_{TARGET_ARCH}a under Triton {triton.__version__}, "
          f"{failures} failing")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
