"""Compile, without a GPU, every Triton kernel a kernel package launches at its benchmark's shapes and
configurations for each GPU architecture asked for (`--arch`), and print what ptxas reports: registers, spills,
shared memory and the CTAs an SM of that architecture can hold.

Why: the Triton interpreter (the CPU tests) accepts code the compiler rejects, a kernel may need more shared memory
than a smaller GPU has, and spills and occupancy show only at compile time. Each kernel's harness,
`bench/<package>.py`, provides `compile_cases(kernel, spec)`, which yields (label, call) pairs: each call makes the
CUDA path's launches for one shape, configuration and dtype on meta tensors (shapes and dtypes, no memory). While
they run, this tool stands in for `JITFunction.run`: instead of launching, it specializes the arguments with
Triton's own binder for the architecture's target (so pointers, integers divisible by 16 and integers equal to 1
are specialized as a launch on such a GPU would specialize them), compiles (past Triton's cache, so that every
compile runs ptxas) and reads the -v log of the ptxas run, with Triton's flags, that made the kernel's binary. With
that specialization the sm_90a register counts match Nsight Compute's on the H200 (without it an offline compile
puts some near twice as high).

Which launches each architecture gets: the calls run with the package's meta tensors standing for a GPU of the
architecture (its `common.devices.meta_gpu`: compute capability and shared memory a CTA), so they make the launches
such a GPU makes: the portable path's on every architecture (in the variants its plans pick for that GPU), a fast
path's only where its row of `dispatch.FAST_PATHS` claims the capability and compiles under this Triton. A kernel
of a package's `hopper/` modules launched for an architecture no row claims fails the check (a harness or dispatch
would launch it where it never runs). sm_90a, where the benchmarks run, compiles every distinct
launch; the other architectures compile each kernel configuration once, at its first launch (one per kernel,
argument types, constexprs and launch options: the specializations of integer arguments change no shared memory);
`--every-launch` compiles every launch for them too, and `--each-kernel-once` each kernel only at its first launch,
on every architecture asked for (what CI's time allows for some cells of its matrix: the Makefile's).

    .venv/bin/python -m tools.compile_offline                          # every kernel, sm_90a
    .venv/bin/python -m tools.compile_offline based-bwd --arch sm_80 --arch sm_120a
    .venv/bin/python -m tools.compile_offline based-bwd --match "16, 128"

Exit status 1 when a kernel fails to compile, needs more shared memory or registers than the architecture gives a
CTA (it can never launch there), or spills more than --max-spill bytes for sm_90a where its launch leaves the
register count to ptxas; a launch that caps it (maxnreg) trades spills for occupancy on purpose, on the strength of a
GPU measurement, and shows as "capped". A kernel whose spills are such a trade made by its design rather than a cap
(one warpgroup of 255 registers, say, so that two CTAs share an SM) is named, with the bytes it may spill, in its
harness's SPILLS_BY_DESIGN (by its name, or by its name and a text of the case labels the bound covers), and shows
as "by design" within them. On the other architectures, where no GPU has
measured what a spill costs against the configuration's alternatives, spills show as "spills" and fail nothing.
"""

import argparse
import contextlib
import importlib
import io
import os
import re
import sys
import tempfile
from typing import NamedTuple

from . import specs
from .common import resolve
from .gpu_bench import build_into_hub, load_harness, load_kernel, use_hub_cache


class Arch(NamedTuple):
    """A compile target: its name (ptxas's --gpu-name), compute capability and the SM limits occupancy reads."""

    name: str
    capability: tuple[int, int]
    shared_per_sm: int  # bytes of shared memory an SM holds
    shared_per_cta: int  # the most one CTA may use (the opt-in maximum)
    warps: int  # resident warps an SM holds
    ctas: int  # resident CTAs an SM holds


KIB = 1024
# The limits of the CUDA C++ Programming Guide's table "Technical Specifications per Compute Capability", as NVIDIA's
# CCCL encodes them (libcudacxx/include/cuda/__device/arch_traits.h). Common to all of these: 64K 32-bit registers an
# SM and a CTA, at most 255 a thread, allocated per warp in units of 256; 1 KiB of shared memory the driver keeps per
# CTA besides what the kernel asks for. 8.6 GPUs have sm_89's shared memory and warps, and 16 CTAs an SM.
ARCHS = {arch.name: arch for arch in (
    Arch("sm_80", (8, 0), 164 * KIB, 163 * KIB, 64, 32),  # A100
    Arch("sm_89", (8, 9), 100 * KIB, 99 * KIB, 48, 24),  # L4, L40S, RTX 40
    Arch("sm_90a", (9, 0), 228 * KIB, 227 * KIB, 64, 32),  # H100, H200
    Arch("sm_100a", (10, 0), 228 * KIB, 227 * KIB, 64, 32),  # B200, GB200
    Arch("sm_120a", (12, 0), 100 * KIB, 99 * KIB, 48, 24),  # RTX 50, RTX PRO 6000 Blackwell
)}
BENCHMARKED = "sm_90a"  # the architecture the GPU runs measure: every launch compiled by default
SM_REGISTERS, CTA_RESERVED_SHARED = 65536, 1024


def ctas_per_sm(registers: int, warps: int, shared: int, arch: Arch = ARCHS[BENCHMARKED]) -> int:
    """The CTAs of `warps` warps, `registers` a thread and `shared` bytes of shared memory an SM of `arch` holds
    (0: the CTA never launches there)."""
    if shared > arch.shared_per_cta:
        return 0
    by_registers = SM_REGISTERS // (-(-registers * 32 // 256) * 256 * warps)
    by_shared = arch.shared_per_sm // (shared + CTA_RESERVED_SHARED)
    return min(by_registers, by_shared, arch.warps // warps, arch.ctas)


def ptxas_report(log: str) -> tuple[int, int]:
    """(registers a thread, bytes of spill stores) from a ptxas -v log: the one Triton's cubin stage prints (its
    `ptxas-blackwell` for sm_100a and up, and for every target from 3.9, whose PTX version only that one reads)."""
    registers = int(re.search(r"Used (\d+) registers", log).group(1))
    spills = int(re.search(r"(\d+) bytes spill stores", log).group(1))
    return registers, spills


# What one compile stands for (`Compiler.scope`), as the report counts it: every distinct launch, each kernel
# configuration (kernel, argument types, constexprs and launch options), or each kernel at its first launch.
SCOPES = {"launch": "distinct launches", "configuration": "kernel configurations", "kernel": "kernels"}


class Compiler:
    """Stands in for JITFunction.run: compiles each launch that is new in `scope` (a key of SCOPES) for `arch` (or
    only lists it: `list_only`) and keeps its report. `fast_paths_run`: whether the package being
    run has a fast path that runs on `arch` (else a kernel of its `hopper/` modules fails unbuilt)."""

    def __init__(self, arch: Arch, scope: str, list_only: bool = False):
        from triton import knobs
        from triton.backends.compiler import GPUTarget
        from triton.compiler import make_backend

        knobs.compilation.always_compile = True  # a kernel found in the cache would run no ptxas, so print no log
        knobs.nvidia.dump_ptxas_log = True  # the cubin stage prints ptxas's -v log to stdout

        self.arch, self.scope, self.list_only = arch, scope, list_only
        self.target = GPUTarget("cuda", arch.capability[0] * 10 + arch.capability[1], 32)
        self.backend = make_backend(self.target)
        self.reports = {}  # launch key -> report dict
        self.label = ""
        self.fast_paths_run = False

    def run(self, fn, *args, grid, warmup, **kwargs):
        import triton
        from triton.compiler import ASTSource
        from triton.runtime.jit import create_function_from_signature

        kwargs.setdefault("debug", False)
        binder = create_function_from_signature(fn.signature, fn.params, self.backend)
        bound_args, specialization, options = binder(*args, **kwargs)
        options, signature, constexprs, attrs = fn._pack_args(self.backend, kwargs, bound_args, specialization,
                                                              options)
        if self.scope == "kernel":
            key = (fn.__module__, fn.__name__)
        else:
            key = (fn.__name__, repr(sorted(signature.items())), repr(sorted(constexprs.items())),
                   repr(sorted(attrs.items())) if self.scope == "launch" else "", options.num_warps,
                   options.num_stages, options.maxnreg)
        if key in self.reports:
            return None
        pointers = sorted({t[1:] for t in signature.values() if t.startswith("*")})
        report = dict(case=self.label, kernel=fn.__name__, module=fn.__module__, warps=options.num_warps,
                      stages=options.num_stages, maxnreg=options.maxnreg, dtypes=",".join(pointers))
        self.reports[key] = report
        if ".hopper." in fn.__module__ and not self.fast_paths_run:
            report["error"] = f"a fast path's kernel launched for {self.arch.name}, which no FAST_PATHS row claims"
        if self.list_only or "error" in report:
            return None
        if fn.is_gluon():  # a Gluon kernel compiles from its own source kind
            from triton.experimental.gluon._runtime import GluonASTSource as source
        else:
            source = ASTSource
        with tempfile.TemporaryFile(mode="w+") as diagnostics, io.StringIO() as ptxas_log:
            try:
                with stderr_to(diagnostics), contextlib.redirect_stdout(ptxas_log):
                    compiled = triton.compile(source(fn, signature, constexprs, attrs), target=self.target,
                                              options=options.__dict__)
                registers, spills = ptxas_report(ptxas_log.getvalue())
                shared = compiled.metadata.shared
                report.update(registers=registers, spills=spills, shared=shared,
                              ctas=ctas_per_sm(registers, options.num_warps, shared, self.arch))
            except Exception as e:  # noqa: BLE001 - report every failing kernel, not only the first
                diagnostics.seek(0)
                report["error"] = error_text(e, diagnostics.read())
            else:  # what a compile that succeeds prints (warnings) still reaches stderr
                diagnostics.seek(0)
                sys.stderr.write(diagnostics.read())
        return None


@contextlib.contextmanager
def stderr_to(file):
    """Send this process's file descriptor 2 to `file` for the block: where MLIR prints a failed pass's diagnostics
    (the exception says only that the pass manager failed)."""
    sys.stderr.flush()
    saved = os.dup(2)
    os.dup2(file.fileno(), 2)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


def error_text(error: BaseException, diagnostics: str = "") -> str:
    """A compile error in one line: the innermost cause's message (a CompilationError's own text is the source
    around the failing line; its cause, or the MLIR diagnostics ptxas or the verifier printed, say why), and the
    first error line MLIR printed to stderr during the compile, where there is one."""
    while error.__cause__ is not None:
        error = error.__cause__
    text = str(error.args[-1] if error.args and isinstance(error.args[-1], str) else error)
    printed = next((line.split("error:", 1)[1] for line in diagnostics.splitlines() if "error:" in line), "")
    return f"{type(error).__name__}: " + " ".join(text.split())[-300:] + (f" ({printed.strip()})" if printed else "")


def status(report: dict, arch: Arch, max_spill: int, by_design: dict) -> str:
    if "error" in report:
        return "FAILED: " + report["error"]
    if "shared" not in report:
        return "listed"
    if report["shared"] > arch.shared_per_cta:
        return f"NEVER LAUNCHES: {report['shared']} B of shared memory, {arch.name} gives a CTA {arch.shared_per_cta}"
    if report["ctas"] == 0:
        return f"NEVER LAUNCHES: {report['warps']} warps of {report['registers']} registers exceed an SM's"
    if report["maxnreg"] is not None:
        return "capped"
    if report["spills"] <= max_spill:
        return "ok"
    if report["spills"] <= spills_by_design(report, by_design):
        return "by design"
    return "SPILLS" if arch.name == BENCHMARKED else "spills"


def spills_by_design(report: dict, by_design: dict) -> int:
    """The spill bytes the design of the report's kernel accepts at its case: the largest of its SPILLS_BY_DESIGN
    entries, each keyed by the kernel's name (every case) or by (name, text of the case labels it covers)."""
    def covers(key) -> bool:
        if isinstance(key, str):
            return key == report["kernel"]
        return key[0] == report["kernel"] and key[1] in report["case"]

    return max((allowed for key, allowed in by_design.items() if covers(key)), default=0)


def stand_for(package, arch: Arch) -> bool:
    """Make a loaded package's meta tensors stand for a GPU of `arch` (its `common.devices.meta_gpu`); whether a
    fast path of its `dispatch.FAST_PATHS` runs there under this Triton."""
    import torch

    devices = importlib.import_module(f"{package.__name__}.common.devices")
    devices.meta_gpu = devices.Gpu(arch.capability, arch.shared_per_cta)
    fast_paths = getattr(importlib.import_module(f"{package.__name__}.dispatch"), "FAST_PATHS", None)
    return fast_paths is not None and any(fast_paths.runs(path, torch.device("meta")) for path in fast_paths.paths)


def compile_arch(compiler: Compiler, names: list[str], match: str | None, spec) -> dict:
    """Run every named package's compile cases (those whose label contains `match`) with its meta tensors standing
    for the compiler's architecture, which compiles their launches; the spill bytes each kernel's design accepts (the
    harnesses' SPILLS_BY_DESIGN)."""
    from triton.runtime.jit import JITFunction

    by_design = {}
    original_run = JITFunction.run
    JITFunction.run = lambda fn, *a, **kw: compiler.run(fn, *a, **kw)
    try:
        for name in names:
            harness, package = load_harness(name), load_kernel(name)
            by_design.update(getattr(harness, "SPILLS_BY_DESIGN", {}))
            compiler.fast_paths_run = stand_for(package, compiler.arch)
            for label, call in harness.compile_cases(package, spec):
                if match and match not in label:
                    continue
                compiler.label = f"{name} {label}"
                call()
    finally:
        JITFunction.run = original_run
    return by_design


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.compile_offline", description=__doc__.split("\n\n")[0])
    parser.add_argument("kernels", nargs="*", help="kernel names (default: all)")
    parser.add_argument("--arch", action="append", choices=list(ARCHS),
                        help=f"a target architecture, repeatable (default: {BENCHMARKED})")
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument("--every-launch", action="store_true",
                       help=f"compile every distinct launch for each architecture, not only for {BENCHMARKED}")
    scope.add_argument("--each-kernel-once", action="store_true",
                       help="compile each kernel once, at its first launch, for each architecture")
    parser.add_argument("--match", help="only the cases whose label contains this text")
    parser.add_argument("--list", action="store_true",
                        help="list the kernels each architecture's cases launch (and their modules), without compiling")
    parser.add_argument("--no-build", action="store_true",
                        help="load the kernels as built and laid into .hub/ already (make hub), without rebuilding")
    parser.add_argument("--max-spill", type=int, default=128,
                        help=f"spill bytes above which an uncapped kernel fails the check for {BENCHMARKED} "
                             "(default: 128)")
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

    def spec(spec_name: str):
        try:
            return specs.spec(spec_name)
        except FileNotFoundError as e:
            raise SystemExit(str(e)) from None

    failures = 0
    for arch in (ARCHS[name] for name in dict.fromkeys(args.arch or [BENCHMARKED])):
        if args.each_kernel_once:
            scope = "kernel"
        else:
            scope = "launch" if args.every_launch or arch.name == BENCHMARKED else "configuration"
        compiler = Compiler(arch, scope, args.list)
        by_design = compile_arch(compiler, names, args.match, spec)
        print(f"## {arch.name}\n")
        print("| case | kernel | dtypes | warps | stages | maxnreg | registers | spill B | shared B | CTAs/SM "
              "| status |" + (" module |" if args.list else ""))
        print("|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if args.list else ""))
        failing = 0
        for r in compiler.reports.values():
            state = status(r, arch, args.max_spill, by_design)
            failing += state not in ("ok", "capped", "by design", "spills", "listed")
            cells = [r.get(x, "-") for x in ("registers", "spills", "shared", "ctas")]
            print(f"| {r['case']} | {r['kernel']} | {r['dtypes']} | {r['warps']} | {r['stages']} | {r['maxnreg']} | "
                  + " | ".join(map(str, cells)) + f" | {state} |" + (f" {r['module']} |" if args.list else ""))
        print(f"\n{len(compiler.reports)} {SCOPES[scope]} {'listed' if args.list else 'compiled'} for {arch.name} "
              f"under Triton {triton.__version__}, {failing} failing\n", flush=True)
        failures += failing
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
