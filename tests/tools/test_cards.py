"""The generated parts of the kernel cards are current."""

import pytest

from tools import cards
from tools.common import all_kernels


def test_cards_show_their_current_table_of_fast_paths():
    for kernel in all_kernels():
        assert cards.rendered(kernel) == (kernel.path / "README.md").read_text(), (
            f"{kernel.name}: run `python -m tools.cards`")


def test_packages_with_gluon_kernels_have_a_table():
    for kernel in all_kernels():
        if (kernel.source / "gluon").is_dir():
            assert cards.fast_paths_table(kernel) is not None, kernel.name


def _row(run, case, impl, value, triton="3.6.0"):
    return dict(run=run, date="2026-12-02", sha=run[-7:], device="H200", torch="2.11", triton=triton,
                kernel="comba-bwd", case=case, impl=impl, metric="ms", value=value)


def test_results_table_takes_each_case_from_its_last_run(monkeypatch):
    kernel = next(k for k in all_kernels() if k.name == "comba-bwd")
    ours, fla = "comba-bwd step", "fla 0.6.0 chunk_comba fwd+bwd (p'=exp(g)p bf16, guard lifted)"
    monkeypatch.setitem(cards.CURRENT, "comba-bwd", (("run-aaaaaaa", "run-bbbbbbb"), (ours,), (fla,), ("step",)))
    rows = [_row("run-aaaaaaa", "A step", ours, 2.0), _row("run-aaaaaaa", "A step", fla, 4.0),
            _row("run-bbbbbbb", "B step", ours, 1.0), _row("run-bbbbbbb", "B step", fla, 3.0),
            _row("run-ccccccc", "C step", ours, 9.0), _row("run-aaaaaaa", "A forward", ours, 7.0)]
    table = cards.results_table(kernel, rows)
    assert "`run-aaaaaaa`" in table and "`run-bbbbbbb`" in table
    assert "C step" not in table and "A forward" not in table  # other runs' and other cases' rows stay out
    line = {c: next(x for x in table.splitlines() if x.startswith(f"| {c} step | {fla} |")) for c in ("A", "B")}
    assert line["A"].startswith(f"| A step | {fla} | 4 |") and line["A"].endswith("| 2 |")  # fla's ms, fla / ours
    assert line["B"].startswith(f"| B step | {fla} | 3 |") and line["B"].endswith("| 3 |")
    # A case measured again in a later run of CURRENT takes all its figures from that run.
    remeasured = cards.results_table(kernel, rows + [_row("run-bbbbbbb", "A step", ours, 1.0),
                                                     _row("run-bbbbbbb", "A step", fla, 3.5)])
    again = next(x for x in remeasured.splitlines() if x.startswith(f"| A step | {fla} |"))
    assert again.startswith(f"| A step | {fla} | 3.5 |") and again.endswith("| 3.5 |")
    assert "`run-aaaaaaa`" not in remeasured.splitlines()[0]  # run A no longer supplies a shown case
    with pytest.raises(SystemExit, match="differ"):  # runs of other machines or releases are not one table
        cards.results_table(kernel, rows[:2] + [_row("run-bbbbbbb", "B step", ours, 1.0, triton="3.8.0")])


def test_by_triton_takes_each_case_from_the_last_run_that_measured_it():
    kernel = next(k for k in all_kernels() if k.name == "comba-bwd")
    impl = "comba-bwd triton"
    rows = [_row("old-1111111", "X bf16", impl, 5.0), _row("old-1111111", "X bf16", impl, 6.0, triton="3.8.0"),
            _row("new-2222222", "X bf16", impl, 4.0)]
    table = cards.by_triton(kernel, rows)
    assert "| times from run | `new-2222222` | `old-1111111` |" in table
    assert "| X bf16, ms | 4 | 6 |" in table


def test_by_triton_gives_each_gpu_its_own_columns():
    """A run on another GPU under the same release is a column of its own, named by the GPU's short name, after
    the H200's."""
    kernel = next(k for k in all_kernels() if k.name == "comba-bwd")
    impl = "comba-bwd triton"
    rows = [dict(_row("h100-3333333", "X bf16", impl, 3.0), device="NVIDIA H100 80GB HBM3"),
            _row("h200-4444444", "X bf16", impl, 2.0)]
    table = cards.by_triton(kernel, rows)
    assert "| | H200, Triton 3.6.0 | H100, Triton 3.6.0 |" in table
    assert "| X bf16, ms | 2 | 3 |" in table


def test_by_triton_reads_only_complete_test_runs():
    """A platform's "GPU tests failed" comes from its last run of every GPU test, not from a later run of a
    selection (`gpu_bench --tests`)."""
    kernel = next(k for k in all_kernels() if k.name == "comba-bwd")
    whole = dict(_row("all-5555555", "GPU tests", "pytest -m gpu", 2), metric="failed")
    part = dict(_row("part-6666666", "GPU tests -k gluon", "pytest -m gpu", 0), metric="failed")
    table = cards.by_triton(kernel, [whole, part])
    assert "| GPU tests failed | 2 at `5555555` |" in table


def _latency(run, case, impl, us, gpu=None, kernel="log-mel"):
    rows = [dict(_row(run, case, impl, us * 1e-3), kernel=kernel),
            dict(_row(run, case, impl, us), kernel=kernel, metric="us/call")]
    return rows + ([dict(_row(run, case, impl, gpu), kernel=kernel, metric="gpu_us")] if gpu is not None else [])


def test_latency_table_shows_the_last_run_with_the_floor_of_that_run():
    kernel = next(k for k in all_kernels() if k.name == "log-mel")
    assert cards.latency_table(kernel, []).startswith("No GPU run has measured the latency table yet")
    ours, bf16 = "whisper_log_mel, fp32", "whisper_log_mel, int16 -> bf16"
    flash, flash_bf16 = "flashmel 0.1.0 + torch log/floor, fp32", "flashmel 0.1.0 + torch log/floor, int16 -> bf16"
    case = "latency B=1 N=480000 mels=80"
    old = _latency("old-1111111", cards.FLOOR_CASE, "empty kernel", 1.0) + _latency("old-1111111", case, ours, 99.0)
    new = (_latency("new-2222222", cards.FLOOR_CASE, "empty kernel", 4.0)
           + _latency("new-2222222", case, ours, 10.0, gpu=6.0) + _latency("new-2222222", case, bf16, 8.0)
           + _latency("new-2222222", case, flash, 40.0) + _latency("new-2222222", case, flash_bf16, 24.0)
           + _latency("new-2222222", case, ours, 7.0, kernel="ldsa"))  # another kernel's rows stay out
    table = cards.latency_table(kernel, old + new)
    assert "`new-2222222`" in table and "old-1111111" not in table and "4 us a call" in table
    lines = [x for x in table.splitlines() if x.startswith(f"| {case} |")]
    assert lines == [f"| {case} | {ours} | 10 | 6 | 6 |  |", f"| {case} | {bf16} | 8 |  | 4 |  |",
                     f"| {case} | {flash} | 40 |  | 36 | 4 |", f"| {case} | {flash_bf16} | 24 |  | 20 | 3 |"]
    assert cards.FLOOR_CASE not in table.split("| case |")[1]  # the floor is named above the table, not a row
