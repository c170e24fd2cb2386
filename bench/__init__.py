"""The side-by-side harness of each kernel against its anchors (ANCHORS.md), for the GPU run: `bench/<package>.py`
gives `side_by_side(kernel, bench)` (the rows `python -m tools.gpu_bench` times and `tools.results` keeps) and
`compile_cases(kernel, spec)` (the launches `python -m tools.compile_offline` compiles for each GPU architecture);
`harness.py` holds what they share. None of it ships: a kernel's Hub benchmark is its own
`benchmarks/benchmark.py`, whose workload helpers these modules import. `results.jsonl` is the one results table (`python -m tools.results`).
"""
