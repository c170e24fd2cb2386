"""Copy the helpers written once in `common/` into the kernel packages that use them, as `<pkg>/common/`.

kernel-builder uploads `torch-ext/<pkg>/` alone, so a helper shared by packages lives in each package as a
committed copy, generated from its one source here and marked so at its top; `tests/tools/test_vendor.py` fails when a
copy differs from what this tool writes.

    .venv/bin/python -m tools.vendor          # write the copies
    .venv/bin/python -m tools.vendor --check  # exit 1 if a copy is stale
"""

import argparse
import sys
from pathlib import Path

from .common import REPO_ROOT, read_kernel

COMMON_DIR = REPO_ROOT / "common"
# common/ file -> the kernels whose packages take a copy of it
VENDORED = {
    "gluon_compat.py": ("ldsa", "log-mel", "comba-bwd"),
    "fast_paths.py": ("ldsa", "log-mel", "based-bwd", "comba-bwd"),
    "tf32.py": ("ldsa", "comba-bwd"),
    "checks.py": ("ldsa", "log-mel", "based-bwd", "comba-bwd"),
    "devices.py": ("ldsa", "log-mel", "based-bwd", "comba-bwd"),
    "direct_calls.py": ("ldsa", "log-mel", "based-bwd", "comba-bwd"),
    "launch.py": ("ldsa", "log-mel", "based-bwd", "comba-bwd"),
    "autocast.py": ("ldsa", "log-mel", "based-bwd", "comba-bwd"),
    "differentiation.py": ("ldsa", "based-bwd", "comba-bwd"),
    "finite.py": ("based-bwd", "comba-bwd"),
}
HEADER = "# Generated from common/{name} by `python -m tools.vendor`: edit that file, not this copy.\n"
INIT = ("# Generated from common/ by `python -m tools.vendor`.\n"
        '"""Helpers shared by the tessera kernel packages, written once in the '
        'repository\'s common/ and copied here."""\n')


def copies() -> dict[Path, str]:
    """Each vendored copy's path and the text it must hold."""
    out = {}
    for name, kernels in VENDORED.items():
        text = HEADER.format(name=name) + (COMMON_DIR / name).read_text()
        for kernel in kernels:
            package_common = read_kernel(REPO_ROOT / "kernels" / kernel).source / "common"
            out[package_common / name] = text
            out[package_common / "__init__.py"] = INIT
    return out


def stale() -> list[Path]:
    return [path for path, text in copies().items() if not path.exists() or path.read_text() != text]


def write() -> list[Path]:
    """Write the copies that differ; returns their paths."""
    changed = stale()
    texts = copies()
    for path in changed:
        path.parent.mkdir(exist_ok=True)
        path.write_text(texts[path])
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.vendor", description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only report stale copies (exit 1 if any)")
    args = parser.parse_args(argv)
    paths = stale() if args.check else write()
    for path in paths:
        print(("stale: " if args.check else "wrote ") + str(path.relative_to(REPO_ROOT)))
    return 1 if args.check and paths else 0


if __name__ == "__main__":
    sys.exit(main())
