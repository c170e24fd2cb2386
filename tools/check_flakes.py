#!/usr/bin/env python3
"""Check the Nix flake files of the tessera monorepo.

Verifies, without needing Nix or network access:

* every ``flake.lock`` in the repository is lock format version 7, has a
  ``root`` node, and every ``inputs`` reference resolves (a plain string must
  name an existing node; a list is a ``follows`` path that must resolve,
  starting from the root node, to an existing node); no node is orphaned;
* ``root`` reaches ``kernel-builder``, pinned to ``github:huggingface/kernels``
  with a 40-hex ``rev``, an SRI ``sha256-`` ``narHash`` and an integer
  ``lastModified``; every github node is likewise fully pinned;
* all locks agree on the kernel-builder pin and on its transitive nodes;
* every ``kernels/<name>/flake.nix`` has the kernel-builder template form
  (``kernel-builder.url = "github:huggingface/kernels"`` and
  ``genKernelFlakeOutputs { inherit self; path = ./.; }``), and has a
  ``flake.lock`` next to it;
* the top-level ``flake.nix`` calls ``genKernelFlakeOutputs`` with
  ``inherit self`` and a path under ``./kernels``, and names every kernel.

Optionally (``--verify-src DIR``) recomputes the NAR sha256 of an exported
kernel-builder source tree (``git archive <rev> | tar -x -C DIR``) in pure
Python and compares it with the pinned ``narHash``.

Exit status: 0 when everything checks out, 1 on any failure (each problem
is printed on stderr), 2 on usage errors.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import re
import stat
import sys
from pathlib import Path
from typing import Any

LOCK_VERSION = 7
KB_INPUT = "kernel-builder"
KB_OWNER = "huggingface"
KB_REPO = "kernels"
KB_URL = "github:huggingface/kernels"
REV_RE = re.compile(r"^[0-9a-f]{40}$")
SRI_SHA256_RE = re.compile(r"^sha256-[A-Za-z0-9+/]{43}=$")
SKIP_DIRS = {".git", ".venv", "venv", "node_modules", "__pycache__", ".direnv", ".pytest_cache"}


class CheckError(Exception):
    pass


# --------------------------------------------------------------------------
# Discovery


def repo_root_default() -> Path:
    return Path(__file__).resolve().parent.parent


def find_files(root: Path, name: str) -> list[Path]:
    """All files called ``name`` under ``root``, skipping VCS/venv dirs."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and not d.startswith("result"))
        if name in filenames:
            found.append(Path(dirpath) / name)
    return sorted(found)


def find_lock_files(root: Path) -> list[Path]:
    return find_files(root, "flake.lock")


def kernel_dirs(root: Path) -> list[Path]:
    kdir = root / "kernels"
    if not kdir.is_dir():
        return []
    return sorted(p for p in kdir.iterdir() if p.is_dir() and (p / "flake.nix").is_file())


# --------------------------------------------------------------------------
# flake.lock checks


def _is_valid_sri_sha256(value: Any) -> bool:
    if not isinstance(value, str) or not SRI_SHA256_RE.match(value):
        return False
    try:
        return len(base64.b64decode(value[len("sha256-"):], validate=True)) == 32
    except ValueError:
        return False


def resolve_follows(nodes: dict, root_name: str, path: list, _seen: frozenset = frozenset()) -> str:
    """Resolve a ``follows`` path (list of input names, from the root) to a node name."""
    key = tuple(path)
    if key in _seen:
        raise CheckError(f"follows cycle at {'/'.join(path)}")
    seen = _seen | {key}
    current = root_name
    for i, name in enumerate(path):
        if not isinstance(name, str):
            raise CheckError(f"follows path {path!r} has a non-string element")
        inputs = nodes.get(current, {}).get("inputs", {})
        if name not in inputs:
            raise CheckError(f"follows path {'/'.join(path)}: node {current!r} has no input {name!r}")
        ref = inputs[name]
        if isinstance(ref, list):
            current = resolve_follows(nodes, root_name, ref, seen)
        elif isinstance(ref, str):
            if ref not in nodes:
                raise CheckError(f"follows path {'/'.join(path[: i + 1])}: points to missing node {ref!r}")
            current = ref
        else:
            raise CheckError(f"follows path {'/'.join(path)}: bad reference {ref!r}")
    return current


def check_lock_data(data: Any, label: str = "flake.lock") -> tuple[list[str], dict | None]:
    """Check one parsed lock file.

    Returns ``(errors, info)``; ``info`` holds the kernel-builder pin and the
    ``locked`` attrs of its transitive closure (None if the lock is unusable).
    """
    errs: list[str] = []

    def err(msg: str) -> None:
        errs.append(f"{label}: {msg}")

    if not isinstance(data, dict):
        err("top level is not a JSON object")
        return errs, None
    if data.get("version") != LOCK_VERSION:
        err(f"lock version is {data.get('version')!r}, expected {LOCK_VERSION}")
    nodes = data.get("nodes")
    root_name = data.get("root")
    if not isinstance(nodes, dict) or not nodes:
        err("missing or empty 'nodes'")
        return errs, None
    if not isinstance(root_name, str) or root_name not in nodes:
        err(f"root node {root_name!r} is not in 'nodes'")
        return errs, None

    # Every inputs reference resolves.
    resolved: dict[tuple[str, str], str] = {}
    for name, node in nodes.items():
        if not isinstance(node, dict):
            err(f"node {name!r} is not an object")
            continue
        inputs = node.get("inputs", {})
        if not isinstance(inputs, dict):
            err(f"node {name!r}: 'inputs' is not an object")
            continue
        for inp, ref in inputs.items():
            if isinstance(ref, str):
                if ref not in nodes:
                    err(f"node {name!r}: input {inp!r} refers to missing node {ref!r}")
                else:
                    resolved[(name, inp)] = ref
            elif isinstance(ref, list):
                try:
                    resolved[(name, inp)] = resolve_follows(nodes, root_name, ref)
                except CheckError as e:
                    err(f"node {name!r}: input {inp!r}: {e}")
            else:
                err(f"node {name!r}: input {inp!r} has invalid reference {ref!r}")
        if name == root_name:
            continue
        locked, original = node.get("locked"), node.get("original")
        if not isinstance(locked, dict) or not isinstance(original, dict):
            err(f"node {name!r}: missing 'locked' or 'original'")
            continue
        if not _is_valid_sri_sha256(locked.get("narHash")):
            err(f"node {name!r}: narHash {locked.get('narHash')!r} is not an SRI sha256 hash")
        if locked.get("type") == "github":
            if not isinstance(locked.get("rev"), str) or not REV_RE.match(locked["rev"]):
                err(f"node {name!r}: rev {locked.get('rev')!r} is not 40 hex digits")
            if not isinstance(locked.get("lastModified"), int):
                err(f"node {name!r}: lastModified {locked.get('lastModified')!r} is not an integer")
            if not locked.get("owner") or not locked.get("repo"):
                err(f"node {name!r}: github node without owner/repo")

    # Reachability: every node must be reachable from the root.
    reachable, stack = set(), [root_name]
    while stack:
        n = stack.pop()
        if n in reachable:
            continue
        reachable.add(n)
        for (src, _), dst in resolved.items():
            if src == n:
                stack.append(dst)
    for orphan in sorted(set(nodes) - reachable):
        err(f"node {orphan!r} is not reachable from the root")

    # root -> kernel-builder pin.
    kb_name = resolved.get((root_name, KB_INPUT))
    if kb_name is None:
        err(f"root node has no (resolvable) input {KB_INPUT!r}")
        return errs, None
    kb = nodes[kb_name]
    locked = kb.get("locked", {}) if isinstance(kb, dict) else {}
    want = {"type": "github", "owner": KB_OWNER, "repo": KB_REPO}
    for k, v in want.items():
        if locked.get(k) != v:
            err(f"{KB_INPUT}: locked.{k} is {locked.get(k)!r}, expected {v!r}")
    orig = kb.get("original", {}) if isinstance(kb, dict) else {}
    if (orig.get("type"), orig.get("owner"), orig.get("repo")) != ("github", KB_OWNER, KB_REPO):
        err(f"{KB_INPUT}: original is {orig!r}, expected github:{KB_OWNER}/{KB_REPO}")
    if not isinstance(locked.get("rev"), str) or not REV_RE.match(locked.get("rev", "")):
        err(f"{KB_INPUT}: rev {locked.get('rev')!r} is not 40 hex digits")
    if not _is_valid_sri_sha256(locked.get("narHash")):
        err(f"{KB_INPUT}: narHash {locked.get('narHash')!r} is not an SRI sha256 hash")

    # Transitive closure of kernel-builder, by input path, for cross-lock comparison.
    closure: dict[str, Any] = {}
    stack2 = [(KB_INPUT, kb_name)]
    seen2 = set()
    while stack2:
        p, n = stack2.pop()
        if (p, n) in seen2 or p.count("/") > 16:
            continue
        seen2.add((p, n))
        closure[p] = nodes[n].get("locked") if isinstance(nodes[n], dict) else None
        for (src, inp), dst in resolved.items():
            if src == n:
                stack2.append((f"{p}/{inp}", dst))
    pin = {k: locked.get(k) for k in ("owner", "repo", "rev", "narHash", "lastModified")}
    return errs, {"pin": pin, "closure": closure}


def check_lock_file(path: Path, root: Path | None = None) -> tuple[list[str], dict | None]:
    label = str(path.relative_to(root)) if root else str(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        return [f"{label}: cannot parse JSON: {e}"], None
    return check_lock_data(data, label)


# --------------------------------------------------------------------------
# flake.nix checks (textual; Nix itself is not required)


def strip_nix_comments(text: str) -> str:
    """Remove ``# ...`` and ``/* ... */`` comments, keeping string literals."""
    out, i, n = [], 0, len(text)
    while i < n:
        c = text[i]
        if c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            out.append(text[i : j + 1])
            i = j + 1
        elif text.startswith("''", i):
            j = text.find("''", i + 2)
            while j != -1 and (text.startswith("'''", j) or text.startswith("''$", j) or text.startswith("''\\", j)):
                j = text.find("''", j + 3)
            j = n if j == -1 else j + 2
            out.append(text[i:j])
            i = j
        elif c == "#":
            j = text.find("\n", i)
            i = n if j == -1 else j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            i = n if j == -1 else j + 2
        else:
            out.append(c)
            i += 1
    return "".join(out)


_KB_URL_RE = re.compile(r'kernel-builder(\s*\.\s*url\s*=|\s*=\s*\{[^}]*\burl\s*=)\s*"' + re.escape(KB_URL) + r'"\s*;')
_GEN_CALL_RE = re.compile(r"kernel-builder\s*\.\s*lib\s*\.\s*genKernelFlakeOutputs\s*\{")


def gen_kernel_calls(text: str) -> list[str]:
    """Argument-set bodies of every ``kernel-builder.lib.genKernelFlakeOutputs { ... }`` call."""
    calls = []
    for m in _GEN_CALL_RE.finditer(text):
        depth, i = 1, m.end()
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            calls.append(text[m.end() : i - 1])
    return calls
_OUTPUTS_SELF_RE = re.compile(r"outputs\s*=\s*\{\s*self\s*,\s*kernel-builder\b")


def _common_flake_errors(path: Path, label: str) -> tuple[list[str], list[str], str]:
    """The checks every flake.nix gets (and whether a flake.lock sits beside it), its genKernelFlakeOutputs
    argument blocks, and its text without comments."""
    try:
        text = strip_nix_comments(path.read_text())
    except OSError as e:
        return [f"{label}: cannot read: {e}"], [], ""
    errs = []
    if not (path.parent / "flake.lock").is_file():
        errs.append(f"{label}: no flake.lock next to it")
    if not _KB_URL_RE.search(text):
        errs.append(f'{label}: input kernel-builder.url = "{KB_URL}" not found')
    if not _OUTPUTS_SELF_RE.search(text):
        errs.append(f"{label}: outputs must take {{ self, kernel-builder, ... }}")
    calls = gen_kernel_calls(text)
    if not calls:
        errs.append(f"{label}: no kernel-builder.lib.genKernelFlakeOutputs {{ ... }} call found")
    for args in calls:
        if not re.search(r"\binherit\s+self\s*;", args):
            errs.append(f"{label}: genKernelFlakeOutputs call without 'inherit self;'")
    return errs, calls, text


def check_kernel_flake_nix(path: Path, label: str | None = None) -> list[str]:
    label = label or str(path)
    errs, calls, _ = _common_flake_errors(path, label)
    if calls and not all(re.search(r"\bpath\s*=\s*\./\.\s*;", a) for a in calls):
        errs.append(f"{label}: genKernelFlakeOutputs must be called with 'path = ./.;'")
    return errs


def check_top_flake_nix(path: Path, kernel_names: list[str], label: str | None = None) -> list[str]:
    label = label or str(path)
    errs, calls, text = _common_flake_errors(path, label)
    if calls and not all(re.search(r"\bpath\s*=\s*\./kernels\b", a) for a in calls):
        errs.append(f"{label}: genKernelFlakeOutputs must be called with a path under ./kernels")
    for name in kernel_names:
        if f'"{name}"' not in text and f"./kernels/{name}" not in text:
            errs.append(f"{label}: kernel {name!r} (kernels/{name}/flake.nix) is not exposed")
    return errs


# --------------------------------------------------------------------------
# NAR hashing (what `nix hash path` / `nix-hash --type sha256` compute)


def _nar_str(h, s: bytes) -> None:
    h.update(len(s).to_bytes(8, "little"))
    h.update(s)
    h.update(b"\0" * (-len(s) % 8))


def _nar_node(h, path: Path) -> None:
    st = os.lstat(path)
    _nar_str(h, b"(")
    _nar_str(h, b"type")
    if stat.S_ISLNK(st.st_mode):
        _nar_str(h, b"symlink")
        _nar_str(h, b"target")
        _nar_str(h, os.fsencode(os.readlink(path)))
    elif stat.S_ISDIR(st.st_mode):
        _nar_str(h, b"directory")
        for name in sorted(os.listdir(path), key=os.fsencode):
            _nar_str(h, b"entry")
            _nar_str(h, b"(")
            _nar_str(h, b"name")
            _nar_str(h, os.fsencode(name))
            _nar_str(h, b"node")
            _nar_node(h, path / name)
            _nar_str(h, b")")
    elif stat.S_ISREG(st.st_mode):
        _nar_str(h, b"regular")
        if st.st_mode & stat.S_IXUSR:
            _nar_str(h, b"executable")
            _nar_str(h, b"")
        _nar_str(h, b"contents")
        size = st.st_size
        h.update(size.to_bytes(8, "little"))
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        h.update(b"\0" * (-size % 8))
    else:
        raise CheckError(f"{path}: unsupported file type for NAR")
    _nar_str(h, b")")


def nar_hash_sri(path: Path | str) -> str:
    """SRI sha256 of the NAR serialisation of ``path`` (as ``nix hash path``)."""
    h = hashlib.sha256()
    _nar_str(h, b"nix-archive-1")
    _nar_node(h, Path(path))
    return "sha256-" + base64.b64encode(h.digest()).decode()


# --------------------------------------------------------------------------
# Whole-repo check


def check_repo(root: Path, verify_src: Path | None = None) -> tuple[list[str], dict]:
    """Run all checks on the repository at ``root``; returns ``(errors, summary)``."""
    root = Path(root)
    errors: list[str] = []
    locks = find_lock_files(root)
    flakes = find_files(root, "flake.nix")
    if not locks:
        errors.append(f"{root}: no flake.lock found")
    infos: dict[str, dict] = {}
    for lock in locks:
        errs, info = check_lock_file(lock, root)
        errors.extend(errs)
        if info is not None:
            infos[str(lock.relative_to(root))] = info
        if not (lock.parent / "flake.nix").is_file():
            errors.append(f"{lock.relative_to(root)}: no flake.nix next to it")

    # All locks agree on the pin and on the kernel-builder closure.
    if infos:
        ref_label, ref = next(iter(sorted(infos.items())))
        for label, info in sorted(infos.items()):
            if info["pin"] != ref["pin"]:
                errors.append(
                    f"{label}: kernel-builder pin {info['pin']} disagrees with {ref_label}: {ref['pin']}"
                )
            elif info["closure"] != ref["closure"]:
                diff = sorted(
                    k for k in set(info["closure"]) | set(ref["closure"])
                    if info["closure"].get(k) != ref["closure"].get(k)
                )
                errors.append(f"{label}: transitive inputs {diff} disagree with {ref_label}")

    kdirs = kernel_dirs(root)
    for kd in kdirs:
        f = kd / "flake.nix"
        errors.extend(check_kernel_flake_nix(f, str(f.relative_to(root))))
    top = root / "flake.nix"
    if top.is_file():
        errors.extend(check_top_flake_nix(top, [kd.name for kd in kdirs], "flake.nix"))
    else:
        errors.append("flake.nix: top-level flake.nix missing")
    for f in flakes:
        rel = f.relative_to(root)
        if f != top and f.parent.parent != root / "kernels":
            errors.append(f"{rel}: unexpected flake.nix (not top level, not kernels/<name>/)")

    pin = next(iter(infos.values()))["pin"] if infos else None
    if verify_src is not None:
        if pin is None:
            errors.append("--verify-src: no usable pin to compare with")
        elif not Path(verify_src).is_dir():
            errors.append(f"--verify-src: {verify_src} is not a directory")
        else:
            got = nar_hash_sri(verify_src)
            if got != pin["narHash"]:
                errors.append(f"--verify-src: NAR hash of {verify_src} is {got}, lock pins {pin['narHash']}")

    summary = {
        "locks": sorted(infos),
        "kernels": [kd.name for kd in kdirs],
        "pin": pin,
        "nodes": sorted(next(iter(infos.values()))["closure"]) if infos else [],
    }
    return errors, summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="check_flakes.py",
        description=(
            "Check every flake.lock / flake.nix of the tessera repo: lock version 7, root -> "
            "kernel-builder pinned to github:huggingface/kernels (40-hex rev, SRI sha256 narHash), "
            "all locks agree, all inputs/follows resolve, kernel flakes use "
            "genKernelFlakeOutputs { inherit self; path = ./.; }."
        ),
    )
    parser.add_argument("--root", type=Path, default=repo_root_default(),
                        help="repository root (default: the parent of tools/)")
    parser.add_argument("--verify-src", type=Path, metavar="DIR",
                        help="exported kernel-builder source tree (git archive <rev> | tar -x -C DIR); "
                             "its NAR sha256 is recomputed and compared with the pinned narHash")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    parser.add_argument("-q", "--quiet", action="store_true", help="print nothing on success")
    args = parser.parse_args(argv)

    if not args.root.is_dir():
        parser.error(f"--root {args.root} is not a directory")
    errors, summary = check_repo(args.root, args.verify_src)
    if errors:
        for e in errors:
            print(f"check_flakes: FAIL: {e}", file=sys.stderr)
        print(f"check_flakes: {len(errors)} problem(s) found", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(summary, indent=2, sort_keys=True))
    elif not args.quiet:
        pin = summary["pin"]
        print(f"check_flakes: OK: {len(summary['locks'])} lock(s) {summary['locks']}")
        print(f"  kernel-builder = github:{pin['owner']}/{pin['repo']}/{pin['rev']}")
        print(f"  narHash = {pin['narHash']}  lastModified = {pin['lastModified']}")
        print(f"  kernels = {summary['kernels']}")
        if args.verify_src:
            print(f"  NAR hash of {args.verify_src} matches the pin")
    return 0


if __name__ == "__main__":
    sys.exit(main())
