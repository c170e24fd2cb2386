# tessera: `make demo` and `make test` work on a fresh clone with nothing but python3 and pip.
PY := .venv/bin/python
VENV_STAMP := .venv/.installed-$(shell sha1sum pyproject.toml | cut -c1-12)

.PHONY: help venv build hub demo test lock publish-dry-run gpu-bench clean

help:
	@echo "make demo             set up, build, lay the Hub cache, load every kernel offline and run it"
	@echo "make test             set up, build, lay the Hub cache, run the whole test suite (what CI runs)"
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

lock: hub
	$(PY) -m tools.lock

publish-dry-run: build
	$(PY) -m tools.publish --dry-run

gpu-bench:
	python3 -m tools.gpu_bench

clean:
	rm -rf .hub kernels/*/build
