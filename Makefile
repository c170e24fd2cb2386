# tessera: `make demo` and `make test` work on a fresh clone with nothing but python3 and pip.
PY := .venv/bin/python
VENV_STAMP := .venv/.installed-$(shell sha1sum pyproject.toml | cut -c1-12)

# The Triton releases the packages support besides the pinned one (3.6.0): each CUDA torch wheel pins one
# (2.12 -> 3.7.0, 2.13 -> 3.7.1, 2.14 -> 3.8, 2.15 -> 3.9). Each is installed alone under .triton/<version>/ and put
# ahead of .venv's on PYTHONPATH, so that the same torch and tools run under it.
TRITONS := 3.7.1 3.8.0 3.9.0
NEWEST_TRITON := 3.9.0

.PHONY: help venv build hub demo test lint compile-matrix test-newest-triton ci lock publish-dry-run gpu-bench clean

help:
	@echo "make demo             set up, build, lay the Hub cache, load every kernel offline and run it"
	@echo "make test             set up, build, lay the Hub cache, run the whole test suite"
	@echo "make compile-matrix   compile every shipped kernel for sm_90a under Triton 3.6.0 and each of $(TRITONS)"
	@echo "make test-newest-triton  the kernels' CPU (interpreter) tests under Triton $(NEWEST_TRITON)"
	@echo "make lint             the house rules the build does not check (python -m tools.lint)"
	@echo "make ci               lint, test, compile-matrix and test-newest-triton: what CI's .ci/run calls"
	@echo "make build            build kernels/<name>/build/torch-{cuda,cpu} for every kernel"
	@echo "make hub              lay the builds into .hub/ (HF_HUB_CACHE layout, refs/v<N>)"
	@echo "make lock             write kernels.lock from [tool.kernels.dependencies] and .hub/"
	@echo "make publish-dry-run  print what publishing every kernel to the Hub would upload, and where"
	@echo "make gpu-bench        on a CUDA machine: GPU correctness tests + the side-by-side benchmark"

$(VENV_STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	rm -f .venv/.installed-* && touch $@

venv: $(VENV_STAMP)

build: venv
	$(PY) -m tools.build

hub: build
	$(PY) -m tools.hub

demo: hub
	$(PY) -m tools.demo

test: hub
	$(PY) -m pytest -q -p no:cacheprovider

lint: venv
	$(PY) -m tools.lint

.triton/%/.installed:
	$(PY) -m pip install -q --no-deps --target .triton/$* triton==$*
	touch $@

compile-matrix: hub $(TRITONS:%=.triton/%/.installed)
	$(PY) -m tools.compile_sm90 --no-build
	set -e; for v in $(TRITONS); do echo "== Triton $$v"; PYTHONPATH=.triton/$$v $(PY) -m tools.compile_sm90 --no-build; done

test-newest-triton: hub .triton/$(NEWEST_TRITON)/.installed
	PYTHONPATH=.triton/$(NEWEST_TRITON) $(PY) -m pytest -q -p no:cacheprovider kernels

ci: lint test compile-matrix test-newest-triton

lock: hub
	$(PY) -m tools.lock

publish-dry-run: build
	$(PY) -m tools.publish --dry-run

gpu-bench:
	python3 -m tools.gpu_bench

clean:
	rm -rf .hub kernels/*/build .triton
