"""Check the house rules the build does not: what kernel-builder would accept but this repo does not.

    .venv/bin/python -m tools.lint              # every kernel, tools/ and bench/
    .venv/bin/python -m tools.lint based-bwd    # one kernel's shipped files (and tools/, bench/)

- Shipped code carries no run history: `torch-ext/<pkg>/` and `benchmarks/` reach the Hub, where the results
  table and the commit bodies do not, so they name no results file, probe, git sha, timing or branch.
- The tools and the harness do not import test helpers: `tools/` and `bench/` import neither `testkit` nor the
  tests (what both need, such as the specs loader, lives in tools/).
- The kernels' `common/` folders are the copies `python -m tools.vendor` writes.

Exit status 1 with one line a violation; the build's own checks (metadata, layout, imports, op namespaces) are
`python -m tools.build`'s.
"""

import argparse
import ast
import re
import sys
from pathlib import Path

from . import vendor
from .common import REPO_ROOT, Kernel, resolve

# Each pattern's name says what it catches.
HISTORY_PATTERNS = {
    "a results file or probe": re.compile(r"bench/results|\.log\b(?!\()|\bprobes?\b"),
    "a git sha": re.compile(r"\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b"),
    "a timing or throughput": re.compile(r"\d\s?(ms|us|µs)\b|\d\s?(TB/s|GB/s|TFLOP/s)"),
    "a branch": re.compile(r"\btried/"),
}
# Modules the tools and the harness must not import: the test helpers.
TEST_MODULES = {"testkit", "tests", "conftest"}


def history_violations(path: Path) -> list[str]:
    """Lines of `path` that name a results file, a probe, a sha, a timing or a branch."""
    found = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        for what, pattern in HISTORY_PATTERNS.items():
            if pattern.search(line):
                found.append(f"{path.relative_to(REPO_ROOT)}:{number}: {what} in shipped code: {line.strip()[:100]}")
                break
    return found


def shipped_files(kernel: Kernel) -> list[Path]:
    """The Python files of `kernel` that reach the Hub: its package and its Hub benchmark."""
    return sorted([*kernel.source.rglob("*.py"), *(kernel.path / "benchmarks").rglob("*.py")])


def test_import_violations(path: Path) -> list[str]:
    """Imports of a test helper in `path`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            roots = [a.name.split(".")[0] for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            roots = [node.module.split(".")[0]]
        else:
            continue
        found += [f"{path.relative_to(REPO_ROOT)}:{node.lineno}: imports the test helper {root!r}"
                  for root in roots if root in TEST_MODULES]
    return found


def test_name_violations() -> list[str]:
    """Test modules sharing a file name: pytest imports each test folder's modules by their bare names (the
    folders are not packages), so the second one of a name fails to collect."""
    seen: dict[str, Path] = {}
    found = []
    for path in sorted([*(REPO_ROOT / "tests").rglob("test_*.py"), *(REPO_ROOT / "kernels").glob("*/tests/test_*.py")]):
        first = seen.setdefault(path.name, path)
        if first is not path:
            found.append(f"{path.relative_to(REPO_ROOT)}: a test module of the same name as "
                         f"{first.relative_to(REPO_ROOT)}: pytest collects only one of them")
    return found


def violations(kernels: list[Kernel]) -> list[str]:
    found = [v for k in kernels for f in shipped_files(k) for v in history_violations(f)]
    found += test_name_violations()
    for folder in ("tools", "bench"):
        found += [v for f in sorted((REPO_ROOT / folder).rglob("*.py")) for v in test_import_violations(f)]
    found += [f"{p.relative_to(REPO_ROOT)}: stale vendored copy: run `python -m tools.vendor`" for p in vendor.stale()]
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.lint", description=__doc__.split("\n\n")[0])
    parser.add_argument("kernels", nargs="*", help="kernel names, or paths to kernel repos (default: all)")
    args = parser.parse_args(argv)
    found = violations(resolve(args.kernels))
    for line in found:
        print(line)
    print(f"lint: {len(found)} violation{'s' * (len(found) != 1)}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
