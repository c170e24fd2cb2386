"""Publishing: the dry run prints every upload, to the kernel-type repo, build on v<N> and card on main,
and touches no network."""

import pytest

from tools import publish
from tools.common import all_kernels

KERNELS = all_kernels()


@pytest.fixture(autouse=True)
def no_hub(monkeypatch):
    import huggingface_hub

    def refuse(*args, **kwargs):
        raise AssertionError("the dry run must not call the Hub")

    for method in ("create_repo", "create_branch", "upload_folder", "upload_file"):
        monkeypatch.setattr(huggingface_hub.HfApi, method, refuse)


@pytest.mark.parametrize("kernel", KERNELS, ids=lambda k: k.name)
def test_plan(kernel):
    steps = publish.plan(kernel)
    assert [s.method for s in steps] == ["create_repo", "create_branch", "upload_folder", "upload_folder",
                                         "upload_file"]
    assert all(s.kwargs["repo_id"] == f"tessera/{kernel.name}" and s.kwargs["repo_type"] == "kernel" for s in steps)
    upload, benchmarks, card = steps[2], steps[3], steps[4]
    assert benchmarks.kwargs["revision"] == f"v{kernel.version}" and benchmarks.kwargs["path_in_repo"] == "benchmarks"
    assert ("benchmarks/benchmark.py", (kernel.path / "benchmarks" / "benchmark.py").stat().st_size) in benchmarks.files
    assert steps[1].kwargs["branch"] == upload.kwargs["revision"] == f"v{kernel.version}"
    assert upload.kwargs["path_in_repo"] == "build" and upload.kwargs["delete_patterns"] == ["*"]
    sent = {path for path, _ in upload.files}
    for backend in ("cuda", "cpu"):
        assert {f"build/torch-{backend}/{f}" for f in ("__init__.py", "_ops.py", "metadata.json", "layers.py")} <= sent
    assert card.kwargs["revision"] == "main" and card.kwargs["path_in_repo"] == "README.md"


def test_dry_run_prints_everything(capsys):
    assert publish.main(["--dry-run"]) == 0
    out = capsys.readouterr().out
    for kernel in KERNELS:
        assert f"# tessera/{kernel.name}: build -> branch v1, card -> main" in out
        assert "build/torch-cuda/metadata.json" in out
    assert out.count("HfApi.upload_folder(") == 2 * len(KERNELS)
