"""What every tool needs: where the repo is, which kernels it holds, and their build.toml settings."""

import os
import subprocess
import tomllib
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
KERNELS_DIR = REPO_ROOT / "kernels"
HUB_CACHE = REPO_ROOT / ".hub"
# The Hub organisation every kernel is published under; build.toml's repo-id must agree with it.
HUB_ORG = os.environ.get("TESSERA_HUB_ORG", "tessera")
BACKENDS = ("cuda", "cpu")


@dataclass(frozen=True)
class Kernel:
    """One kernel repo under kernels/: its Hub name, Python package, major version and license."""

    path: Path
    name: str
    version: int
    license: str
    backends: tuple[str, ...]
    declared_repo_id: str | None  # build.toml's [general.hub] repo-id; the build checks it is `repo_id`

    @property
    def package(self) -> str:
        return self.name.replace("-", "_")

    @property
    def repo_id(self) -> str:
        return f"{HUB_ORG}/{self.name}"

    @property
    def source(self) -> Path:
        return self.path / "torch-ext" / self.package

    @property
    def build_dir(self) -> Path:
        return self.path / "build"


def read_kernel(path: Path) -> Kernel:
    general = tomllib.loads((path / "build.toml").read_text())["general"]
    return Kernel(
        path=path,
        name=general["name"],
        version=int(general["version"]),
        license=general["license"],
        backends=tuple(general["backends"]),
        declared_repo_id=general.get("hub", {}).get("repo-id"),
    )


def all_kernels() -> list[Kernel]:
    return [read_kernel(p.parent) for p in sorted(KERNELS_DIR.glob("*/build.toml"))]


def select(names: list[str] | None) -> list[Kernel]:
    """The kernels named (all when none are), with a clear error for an unknown name."""
    kernels = all_kernels()
    if not names:
        return kernels
    by_name = {k.name: k for k in kernels}
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise SystemExit(f"unknown kernel(s) {unknown}; known: {sorted(by_name)}")
    return [by_name[n] for n in names]


def resolve(args: list[str]) -> list[Kernel]:
    """Command-line kernel arguments: names under kernels/ or paths to kernel repos (none: all kernels)."""
    if not args:
        return all_kernels()
    return [read_kernel(Path(a).resolve()) if Path(a, "build.toml").is_file() else select([a])[0] for a in args]


def git(*args: str, cwd: Path = REPO_ROOT) -> str:
    out = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True)
    return out.stdout.strip() if out.returncode == 0 else ""
