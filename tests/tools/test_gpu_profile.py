"""`python -m tools.gpu_profile`: the one `kernels benchmark` class of each Hub benchmark it profiles."""

import pytest

from bench.harness import hub_benchmark
from tools.common import all_kernels
from tools.gpu_profile import benchmark_case


@pytest.mark.parametrize("name", [k.name for k in all_kernels()])
def test_every_benchmark_has_one_case_to_profile(name):
    """gpu_profile runs the one `kernels benchmark` class of each benchmark module, every benchmark_* method."""
    case = benchmark_case(hub_benchmark(name))
    assert [m for m in dir(case) if m.startswith("benchmark_")]
