"""Lay built kernels into a local Hub cache, as `huggingface_hub` would have downloaded branch `v<N>`.

The result, `.hub/kernels--<org>--<name>/{refs/v<N>, snapshots/<sha>/{build/torch-<backend>/..., benchmarks/}}`,
holds what `tools.publish` uploads to branch `v<N>`: it is what `get_kernel("<org>/<name>", version=N)` and
`kernels benchmark <org>/<name>@v<N>` resolve with `HF_HUB_OFFLINE=1 HF_HUB_CACHE=.hub`. The snapshot sha is a
hash of the variants' digests and the benchmark scripts, so versions of one kernel sit side by side and a rebuild of
the same code lands in the same snapshot.
"""

import argparse
import hashlib
import json
import shutil
import sys
from pathlib import Path

from .common import HUB_CACHE, Kernel, resolve


def benchmark_files(kernel: Kernel) -> list[Path]:
    """The files of `kernel`'s `benchmarks/` that branch `v<N>` carries (none where it has no benchmarks)."""
    root = kernel.path / "benchmarks"
    return sorted(f for f in root.rglob("*") if f.is_file() and "__pycache__" not in f.parts and f.suffix != ".pyc")


def snapshot_sha(kernel: Kernel) -> str:
    h = hashlib.sha1(f"{kernel.repo_id}@v{kernel.version}".encode())
    for metadata in sorted(kernel.build_dir.glob("torch-*/metadata.json")):
        h.update(metadata.parent.name.encode() + json.dumps(json.loads(metadata.read_text())["digest"]).encode())
    for f in benchmark_files(kernel):
        h.update(f.relative_to(kernel.path).as_posix().encode() + hashlib.sha256(f.read_bytes()).digest())
    return h.hexdigest()


def lay(kernel: Kernel, cache: Path) -> Path:
    """Copy `kernel`'s build and benchmarks into `cache` under a snapshot and point `refs/v<version>` at it."""
    if not list(kernel.build_dir.glob("torch-*/metadata.json")):
        raise SystemExit(f"{kernel.name} has no build; run `python -m tools.build {kernel.name}` first")
    repo = cache / f"kernels--{kernel.repo_id.replace('/', '--')}"
    ref = repo / "refs" / f"v{kernel.version}"
    sha = snapshot_sha(kernel)
    snapshot = repo / "snapshots" / sha
    shutil.rmtree(snapshot, ignore_errors=True)
    shutil.copytree(kernel.build_dir, snapshot / "build", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for f in benchmark_files(kernel):
        target = snapshot / f.relative_to(kernel.path)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(f, target)
    # `kernels benchmark <org>/<name>@v<N>` looks the repo up under huggingface_hub's default repo type (model):
    # the same entry answers there.
    alias = cache / f"models--{kernel.repo_id.replace('/', '--')}"
    if not alias.is_symlink():
        alias.symlink_to(repo.name, target_is_directory=True)
    previous = ref.read_text().strip() if ref.is_file() else None
    ref.parent.mkdir(parents=True, exist_ok=True)
    ref.write_text(sha)
    still_used = {r.read_text().strip() for r in ref.parent.iterdir()}
    if previous and previous not in still_used:
        shutil.rmtree(repo / "snapshots" / previous, ignore_errors=True)
    return snapshot


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.hub", description=__doc__.split("\n\n")[0])
    parser.add_argument("kernels", nargs="*", help="kernel names, or paths to kernel repos (default: all)")
    parser.add_argument("--cache", type=Path, default=HUB_CACHE, help=f"Hub cache directory (default: {HUB_CACHE})")
    args = parser.parse_args(argv)
    for kernel in resolve(args.kernels):
        snapshot = lay(kernel, args.cache)
        print(f"{kernel.repo_id} v{kernel.version} -> {snapshot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
