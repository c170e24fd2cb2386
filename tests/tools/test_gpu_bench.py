"""`python -m tools.gpu_bench`: its options, and the side-by-side harness of each kernel it runs (bench/<package>.py)."""

import inspect
import time

import pytest

from tools.gpu_bench import load_harness, load_kernel, outcomes_before_cut, side_by_side_kwargs


def test_bench_kwargs_name_a_kernel_and_a_json_object():
    """gpu_bench --bench-kwargs KERNEL=JSON: the keyword arguments of one kernel's side_by_side."""
    names = ["comba-bwd", "ldsa"]
    got = side_by_side_kwargs(['comba-bwd={"shapes": [[8, 4096, 16, 128, 128]], "seed_shapes": []}'], names)
    assert got == {"comba-bwd": {"shapes": [[8, 4096, 16, 128, 128]], "seed_shapes": []}}
    for bad in ('based-bwd={"shapes": []}', "comba-bwd", 'comba-bwd={"shapes": [', "comba-bwd=[1, 2]"):
        with pytest.raises(SystemExit, match="--bench-kwargs"):
            side_by_side_kwargs([bad], names)


def test_a_cut_test_run_reports_what_its_log_holds():
    """A test run cut by its timeout: the outcomes its `pytest -v` log reported before the cut, not the summary
    lines after them."""
    log = "\n".join([
        "[gw7] [  0%] PASSED kernels/comba-bwd/tests/test_a.py::test_one[shape0] ",
        "[gw3] [ 12%] SKIPPED kernels/ldsa/tests/test_b.py::test_two ",
        "[gw1] [ 40%] FAILED kernels/based-bwd/tests/test_c.py::test_three ",
        "[gw2] [ 41%] PASSED kernels/based-bwd/tests/test_c.py::test_four ",
        "[gw0] [ 93%] ERROR kernels/log-mel/tests/test_d.py::test_five ",
        "[gw5] [ 92%] PASSED kernels/log-mel/tests/test_d.py::test_six ",
        "FAILED kernels/based-bwd/tests/test_c.py::test_three - AssertionError",
    ])
    assert outcomes_before_cut(log) == {
        "passed_before_cut": 3, "skipped_before_cut": 1, "percent_done": 93,
        "failed_before_cut": ["kernels/based-bwd/tests/test_c.py::test_three", "kernels/log-mel/tests/test_d.py::test_five"],
    }
    assert outcomes_before_cut("collecting ...")["percent_done"] == 0


@pytest.mark.parametrize("name, kwargs", [
    ("comba-bwd", {"shapes": [[8, 4096, 16, 128, 128]], "sweep_shapes": [], "seed_shapes": []}),
    ("ldsa", {"shapes": [[16, 256]], "backward_shapes": [[64, 3000]], "latency_shapes": [[16, 256]]}),
    ("log-mel", {"shapes": [[1, 3000, 201]], "sweep_shapes": [], "latency_batches": [1, 16]}),
    ("based-bwd", {"decode_shapes": [[64, 1, 16, 16, 64]], "decode_latency_shape": [1, 1, 16, 16, 64]}),
])
def test_side_by_side_takes_cut_down_kwargs(name, kwargs):
    """The cut-down runs `--bench-kwargs` makes bind to each harness's side_by_side (not run here)."""
    inspect.signature(load_harness(name).side_by_side).bind(load_kernel(name), object(), **kwargs)


@pytest.mark.parametrize("name", ["ldsa", "log-mel", "based-bwd", "comba-bwd"])
def test_the_harness_lives_in_bench_and_not_in_the_shipped_benchmark(name):
    """bench/<package>.py has side_by_side and compile_cases; the Hub benchmark it takes workloads from has
    neither."""
    from bench.harness import hub_benchmark

    harness = load_harness(name)
    assert callable(harness.side_by_side) and callable(harness.compile_cases)
    hub = hub_benchmark(name)
    assert not hasattr(hub, "side_by_side") and not hasattr(hub, "compile_cases")


@pytest.fixture
def quick_latency(monkeypatch):
    """bench.harness with latency passes of a few milliseconds, for dry runs on the CPU."""
    from bench import harness

    monkeypatch.setattr(harness, "LATENCY_WARMUP_S", 0.01)
    monkeypatch.setattr(harness, "LATENCY_PASS_S", 0.005)
    return harness


def test_host_latency_is_per_call_wall_clock(quick_latency):
    """The best pass's time a call, calls back to back: a call that sleeps 2 ms measures 2 ms, not a pass's time."""
    us = quick_latency.host_latency_us(lambda: time.sleep(0.002), "cpu")
    assert 2000 <= us < 4000


def test_floor_row_launches_the_empty_kernel(quick_latency):
    """On the CPU under the interpreter: a latency row of the floor's case, wall-clock only."""
    row = quick_latency.floor_row("cpu")
    assert (row["case"], row["impl"], row["metric"]) == (quick_latency.FLOOR_CASE, quick_latency.FLOOR_IMPL, "us/call")
    assert row["value"] > 0 and row["ms"] == row["value"] * 1e-3 and row["gpu_us"] is None


class _NoAnchors:
    @staticmethod
    def optional(module):
        return None


@pytest.mark.parametrize("name, kwargs", [
    ("ldsa", {"shapes": [(1, 16)]}),
    ("log-mel", {"batches": (1, 2), "n_samples": 1600}),
])
def test_latency_rows_dry_run(quick_latency, name, kwargs):
    """Each harness's latency table rows on the CPU (the references run): the floor first, then every case's rows of
    our public function and its registered op, each a wall-clock a call."""
    harness = load_harness(name)
    args = (load_kernel(name),) if name == "ldsa" else (load_kernel(name), _NoAnchors())
    rows = harness.latency_rows(*args, **kwargs)
    assert rows[0]["case"] == quick_latency.FLOOR_CASE
    assert all(r["metric"] == "us/call" and r["value"] > 0 and r["case"].startswith("latency") for r in rows)
    cases = {r["case"] for r in rows[1:]}
    assert len(cases) == (1 if name == "ldsa" else 4)
    for case in cases:
        impls = {r["impl"] for r in rows if r["case"] == case}
        assert "registered custom op" in " ".join(impls) and len(impls) >= 2
