"""Every code block of the front page, the contributor guide, docs/ and the kernel cards works as written.

A ```python block runs on its own (nothing carries over from the block before it), in a subprocess from the repo
root with the local Hub cache `make hub` lays (`HF_HUB_OFFLINE=1 HF_HUB_CACHE=<repo>/.hub`), on the CPU; a block
whose first line is `# needs CUDA` runs only where CUDA is. In a ```bash block each command must exist: a make
target of the Makefile, a module for `python -m`, or an executable (`.venv/bin` first); a block whose first line is
`# needs <something>` (Nix, a GPU machine) is held to its make targets and modules only."""

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tools.common import HUB_CACHE, KERNELS_DIR, REPO_ROOT

DOCS = [REPO_ROOT / "README.md", REPO_ROOT / "CONTRIBUTING.md", *sorted((REPO_ROOT / "docs").glob("*.md")),
        *sorted(KERNELS_DIR.glob("*/README.md"))]
BLOCK = re.compile(r"^( *)```(\w+)\n(.*?)^\1```", re.MULTILINE | re.DOTALL)
NEEDS_CUDA = "# needs CUDA"

# Runs each block given on the command line (file:line, source) in a fresh namespace, stopping at the first failure.
RUNNER = """
import sys, traceback
for where, source in zip(sys.argv[1::2], sys.argv[2::2]):
    try:
        exec(compile(source, where, "exec"), {"__name__": "__main__"})
    except BaseException:
        traceback.print_exc()
        sys.exit(f"block at {where} failed")
"""


def blocks(path: Path, language: str) -> list[tuple[int, str]]:
    """(first line number, source) of every ```language block of `path`, indented ones (in a list) dedented."""
    text = path.read_text()
    return [(text[: m.start()].count("\n") + 2, textwrap.dedent(m.group(3)))
            for m in BLOCK.finditer(text) if m.group(2) == language]


def _name(path: Path) -> str:
    return path.relative_to(REPO_ROOT).as_posix()


def has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.mark.parametrize("doc", DOCS, ids=_name)
def test_python_blocks_run(doc):
    runnable = [(line, src) for line, src in blocks(doc, "python") if has_cuda() or not src.startswith(NEEDS_CUDA)]
    if not runnable:
        pytest.skip(f"{_name(doc)} has no python block this machine runs")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(HUB_CACHE))
    args = [a for line, src in runnable for a in (f"{_name(doc)}:{line}", src)]
    out = subprocess.run([sys.executable, "-c", RUNNER, *args], cwd=REPO_ROOT, env=env, capture_output=True,
                         text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-4000:]


def make_targets() -> set[str]:
    text = (REPO_ROOT / "Makefile").read_text()
    return set(re.findall(r"^([A-Za-z][\w.-]*):", text, re.MULTILINE))


def commands(source: str):
    """Each command of a bash block, as its words without leading VAR=value assignments."""
    for line in source.replace("\\\n", " ").splitlines():
        line = line.split(" #", 1)[0].strip()
        if not line or line.startswith("#"):
            continue
        for command in re.split(r"&&|;|\|\|", line):
            words = command.split()
            while words and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0]):
                words = words[1:]
            if words and words[0] != "export":
                yield words


@pytest.mark.parametrize("doc", DOCS, ids=_name)
def test_bash_commands_exist(doc):
    targets, path = make_targets(), os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    for line, source in blocks(doc, "bash"):
        checked_only = source.startswith("# needs ")
        for words in commands(source):
            where = f"{_name(doc)}:{line}: {' '.join(words)}"
            if words[0] == "make":
                missing = [w for w in words[1:] if not w.startswith("-") and "=" not in w and w not in targets]
                assert not missing, f"{where}: no make target {missing}"
            elif "-m" in words[:-1]:
                module = words[words.index("-m") + 1]
                assert importlib.util.find_spec(module) is not None, f"{where}: no module {module}"
            elif not checked_only and words[0] != "cd":
                assert shutil.which(words[0], path=path) or (REPO_ROOT / words[0]).is_file(), f"{where}: not found"


def test_the_docs_have_blocks_to_check():
    """The block pattern still matches the docs: the front page and every card hold python blocks."""
    for doc in DOCS:
        if doc.name == "README.md":
            assert blocks(doc, "python"), f"{_name(doc)}: no python block found"
