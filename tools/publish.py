"""Publish built kernels to their kernel-type Hub repos: the build and `benchmarks/` on branch `v<version>` (where
`kernels benchmark` reads them), the card on `main`.

This is what `kernel-builder upload` does: stale files under `build/` on the branch are deleted, so the
branch holds exactly this build. `--dry-run` prints every call and file instead of making it (these
machines cannot reach the Hub, so the dry run is what the tests exercise). A real upload needs a token
(`HF_TOKEN` or `hf auth login`) with kernel-creation access for the organisation.
"""

import argparse
import sys
from dataclasses import dataclass, field

from .common import Kernel, resolve


@dataclass
class Step:
    """One Hub API call: the method of `huggingface_hub.HfApi`, its arguments, and the files it sends."""

    method: str
    kwargs: dict
    files: list[tuple[str, int]] = field(default_factory=list)

    def describe(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.kwargs.items())
        lines = [f"HfApi.{self.method}({args})"]
        lines += [f"    {path}  ({size} bytes)" for path, size in self.files]
        return "\n".join(lines)


def plan(kernel: Kernel) -> list[Step]:
    from huggingface_hub.constants import REPO_TYPE_KERNEL

    variants = sorted(p.parent for p in kernel.build_dir.glob("torch-*/metadata.json"))
    if not variants:
        raise SystemExit(f"{kernel.name} has no build; run `make build` first")
    card = kernel.path / "README.md"
    if not card.is_file():
        raise SystemExit(f"{kernel.name} has no card at {card}")
    branch = f"v{kernel.version}"
    repo = {"repo_id": kernel.repo_id, "repo_type": REPO_TYPE_KERNEL}
    build_files = sorted(
        (f"build/{f.relative_to(kernel.build_dir).as_posix()}", f.stat().st_size)
        for v in variants
        for f in v.rglob("*")
        if f.is_file() and "__pycache__" not in f.parts
    )
    benchmarks = kernel.path / "benchmarks"
    bench_files = sorted((f"benchmarks/{f.relative_to(benchmarks).as_posix()}", f.stat().st_size)
                         for f in benchmarks.rglob("*.py") if "__pycache__" not in f.parts)
    return [
        Step("create_repo", {**repo, "exist_ok": True}),
        Step("create_branch", {**repo, "branch": branch, "exist_ok": True}),
        Step(
            "upload_folder",
            {
                **repo,
                "folder_path": str(kernel.build_dir),
                "path_in_repo": "build",
                "revision": branch,
                "ignore_patterns": ["**/__pycache__/**", "*.pyc"],
                "delete_patterns": ["*"],
                "commit_message": f"Build {kernel.name} v{kernel.version}",
            },
            build_files,
        ),
        Step(
            "upload_folder",
            {
                **repo,
                "folder_path": str(benchmarks),
                "path_in_repo": "benchmarks",
                "revision": branch,
                "ignore_patterns": ["**/__pycache__/**", "*.pyc"],
                "delete_patterns": ["*"],
                "commit_message": f"Benchmarks of {kernel.name} v{kernel.version}",
            },
            bench_files,
        ),
        Step(
            "upload_file",
            {
                **repo,
                "path_or_fileobj": str(card),
                "path_in_repo": "README.md",
                "revision": "main",
                "commit_message": f"Card for {kernel.name} v{kernel.version}",
            },
            [("README.md", card.stat().st_size)],
        ),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.publish", description=__doc__.split("\n\n")[0])
    parser.add_argument("kernels", nargs="*", help="kernel names, or paths to kernel repos (default: all)")
    parser.add_argument("--dry-run", action="store_true", help="print what would be uploaded where; upload nothing")
    args = parser.parse_args(argv)
    steps = [(k, plan(k)) for k in resolve(args.kernels)]
    if args.dry_run:
        for kernel, kernel_steps in steps:
            print(f"# {kernel.repo_id}: build -> branch v{kernel.version}, card -> main (dry run: nothing sent)")
            for step in kernel_steps:
                print(step.describe())
        return 0
    from huggingface_hub import HfApi

    api = HfApi()
    for kernel, kernel_steps in steps:
        for step in kernel_steps:
            getattr(api, step.method)(**step.kwargs)
        print(f"published {kernel.repo_id} v{kernel.version}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
