"""Tests for the Nix flake files (flake.nix / flake.lock) via tools/check_flakes.py."""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CHECKER = REPO / "tools" / "check_flakes.py"
KERNELS = ["ldsa", "log-mel", "based-bwd", "comba-bwd"]

_spec = importlib.util.spec_from_file_location("check_flakes", CHECKER)
cf = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("check_flakes", cf)
_spec.loader.exec_module(cf)


def _copy_flakes(dst: Path) -> Path:
    """Copy only the flake files of the repo into ``dst``."""
    for rel in ["flake.nix", "flake.lock"] + [
        f"kernels/{k}/{f}" for k in KERNELS for f in ("flake.nix", "flake.lock")
    ]:
        (dst / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / rel, dst / rel)
    return dst


def test_repo_flakes_pass():
    errors, summary = cf.check_repo(REPO)
    assert errors == []
    assert sorted(summary["kernels"]) == sorted(KERNELS)
    assert set(summary["locks"]) >= {"flake.lock"} | {f"kernels/{k}/flake.lock" for k in KERNELS}
    pin = summary["pin"]
    assert (pin["owner"], pin["repo"]) == ("huggingface", "kernels")
    assert cf.REV_RE.match(pin["rev"])
    assert cf._is_valid_sri_sha256(pin["narHash"])
    assert "kernel-builder/nixpkgs" in summary["nodes"]


@pytest.mark.parametrize("kernel", KERNELS)
def test_kernel_flake_nix_template_form(kernel):
    assert cf.check_kernel_flake_nix(REPO / "kernels" / kernel / "flake.nix") == []


def test_locks_are_identical():
    texts = {(REPO / "kernels" / k / "flake.lock").read_text() for k in KERNELS}
    texts.add((REPO / "flake.lock").read_text())
    assert len(texts) == 1


def test_follows_resolution():
    data = json.loads((REPO / "flake.lock").read_text())
    nodes = data["nodes"]
    assert cf.resolve_follows(nodes, "root", ["kernel-builder", "nixpkgs"]) == "nixpkgs"
    with pytest.raises(cf.CheckError):
        cf.resolve_follows(nodes, "root", ["kernel-builder", "no-such-input"])


def test_nar_hash_known_answer(tmp_path):
    # Expected value computed with `nix hash path` (Nix 2.8.0) on the same tree.
    (tmp_path / "d" / "e").mkdir(parents=True)
    (tmp_path / "a").write_bytes(b"hello\n")
    (tmp_path / "b").write_bytes(b"#!/bin/sh\n")
    os.chmod(tmp_path / "b", 0o755)
    os.symlink("a", tmp_path / "c")
    (tmp_path / "d" / "e" / "empty").write_bytes(b"")
    (tmp_path / "d" / "thirteen").write_bytes(b"x" * 13)
    assert cf.nar_hash_sri(tmp_path) == "sha256-UNh1um+zeTqwaGMAhoQbBaieeFs35DSBezhmFC9t7II="


def test_copy_passes(tmp_path):
    root = _copy_flakes(tmp_path)
    assert cf.check_repo(root)[0] == []


def _edit_lock(path: Path, fn) -> None:
    data = json.loads(path.read_text())
    fn(data)
    path.write_text(json.dumps(data, indent=2))


CORRUPTIONS = {
    "version": (lambda d: d.update(version=6), "lock version"),
    "narhash": (
        lambda d: d["nodes"]["kernel-builder"]["locked"].update(narHash="sha256-deadbeef"),
        "narHash",
    ),
    "rev": (lambda d: d["nodes"]["kernel-builder"]["locked"].update(rev="main"), "rev"),
    "dangling-follows": (
        lambda d: d["nodes"]["rust-overlay"]["inputs"].update(nixpkgs=["kernel-builder", "nixpkgz"]),
        "no input 'nixpkgz'",
    ),
    "missing-node": (lambda d: d["nodes"].pop("systems"), "missing node 'systems'"),
    "other-owner": (
        lambda d: d["nodes"]["kernel-builder"]["locked"].update(owner="someone-else"),
        "owner",
    ),
}


@pytest.mark.parametrize("name", sorted(CORRUPTIONS))
def test_corrupted_lock_fails(tmp_path, name):
    root = _copy_flakes(tmp_path)
    fn, needle = CORRUPTIONS[name]
    _edit_lock(root / "kernels" / "ldsa" / "flake.lock", fn)
    errors, _ = cf.check_repo(root)
    assert errors, name
    assert any("kernels/ldsa/flake.lock" in e and needle in e for e in errors), errors


def test_disagreeing_pin_fails(tmp_path):
    root = _copy_flakes(tmp_path)
    _edit_lock(
        root / "kernels" / "log-mel" / "flake.lock",
        lambda d: d["nodes"]["kernel-builder"]["locked"].update(rev="0" * 40),
    )
    errors, _ = cf.check_repo(root)
    assert any("disagrees" in e for e in errors), errors


def test_bad_kernel_flake_nix_fails(tmp_path):
    root = _copy_flakes(tmp_path)
    f = root / "kernels" / "comba-bwd" / "flake.nix"
    f.write_text(f.read_text().replace("path = ./.;", "path = ./..;").replace("inherit self;", ""))
    errors, _ = cf.check_repo(root)
    assert any("path = ./." in e for e in errors), errors
    assert any("inherit self" in e for e in errors), errors


def test_cli_exit_codes(tmp_path):
    ok = subprocess.run([sys.executable, str(CHECKER), "--root", str(REPO), "-q"],
                        capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    helped = subprocess.run([sys.executable, str(CHECKER), "--help"], capture_output=True, text=True)
    assert helped.returncode == 0 and "--verify-src" in helped.stdout

    root = _copy_flakes(tmp_path)
    (root / "flake.lock").write_text("{ not json")
    bad = subprocess.run([sys.executable, str(CHECKER), "--root", str(root)],
                         capture_output=True, text=True)
    assert bad.returncode == 1
    assert "FAIL" in bad.stderr and "flake.lock" in bad.stderr
