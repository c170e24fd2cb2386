"""`python -m tools.gpu_bench`: its options, and the side-by-side harness of each kernel it runs (bench/<package>.py)."""

import inspect

import pytest

from tools.gpu_bench import load_harness, load_kernel, side_by_side_kwargs


def test_bench_kwargs_name_a_kernel_and_a_json_object():
    """gpu_bench --bench-kwargs KERNEL=JSON: the keyword arguments of one kernel's side_by_side."""
    names = ["comba-bwd", "ldsa"]
    got = side_by_side_kwargs(['comba-bwd={"shapes": [[8, 4096, 16, 128, 128]], "seed_shapes": []}'], names)
    assert got == {"comba-bwd": {"shapes": [[8, 4096, 16, 128, 128]], "seed_shapes": []}}
    for bad in ('based-bwd={"shapes": []}', "comba-bwd", 'comba-bwd={"shapes": [', "comba-bwd=[1, 2]"):
        with pytest.raises(SystemExit, match="--bench-kwargs"):
            side_by_side_kwargs([bad], names)


@pytest.mark.parametrize("name, kwargs", [
    ("comba-bwd", {"shapes": [[8, 4096, 16, 128, 128]], "sweep_shapes": [], "seed_shapes": []}),
    ("ldsa", {"shapes": [[16, 256]], "backward_shapes": [[64, 3000]]}),
    ("log-mel", {"shapes": [[1, 3000, 201]], "sweep_shapes": []}),
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
