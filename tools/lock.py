"""Write `kernels.lock` (the kernels 0.17 format) for the dependencies a pyproject declares, offline.

`kernels lock` resolves `[tool.kernels.dependencies]` against the Hub; this resolves them against a local
Hub cache (default `.hub/`, filled by `make hub`) through each kernel's `refs/v<N>`, so the lock flow can be
exercised without network. `kernels.load_kernel(repo_id, lockfile=...)` then loads exactly the locked commit.
"""

import argparse
import json
import sys
import tomllib
from pathlib import Path

from .common import HUB_CACHE, REPO_ROOT


def locked_commit(cache: Path, repo_id: str, version: int) -> str:
    ref = cache / f"kernels--{repo_id.replace('/', '--')}" / "refs" / f"v{version}"
    if not ref.is_file():
        raise SystemExit(f"{repo_id} version {version} is not in the Hub cache {cache} (run `make hub`)")
    return ref.read_text().strip()


def lock(pyproject: Path, cache: Path) -> str:
    from kernels._rust import KernelLocks

    deps = tomllib.loads(pyproject.read_text()).get("tool", {}).get("kernels", {}).get("dependencies", {})
    if not deps:
        raise SystemExit(f"{pyproject} declares no [tool.kernels.dependencies]")
    entries = [
        {"dependency": {"repo-id": repo_id, "version": version},
         "lock": {"commit": locked_commit(cache, repo_id, version)}}
        for repo_id, version in sorted(deps.items())
    ]
    text = json.dumps(entries, indent=2) + "\n"
    KernelLocks.from_json(text)  # the kernels package's own parser must accept what we write
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.lock", description=__doc__.split("\n\n")[0])
    parser.add_argument("--pyproject", type=Path, default=REPO_ROOT / "pyproject.toml")
    parser.add_argument("--cache", type=Path, default=HUB_CACHE, help=f"Hub cache directory (default: {HUB_CACHE})")
    parser.add_argument("--output", type=Path, help="where to write (default: kernels.lock beside the pyproject)")
    args = parser.parse_args(argv)
    output = args.output or args.pyproject.parent / "kernels.lock"
    output.write_text(lock(args.pyproject, args.cache))
    print(f"wrote {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
