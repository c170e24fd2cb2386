# tessera: `make demo` and `make test` work on a fresh clone with nothing but python3 and pip.
PY := .venv/bin/python
# The environment is set up again when what pip installs from changes: pyproject.toml's [project] and
# [build-system] tables (not the tools' settings below them).
VENV_STAMP := .venv/.installed-$(shell sed -n '/^\[project\]/,/^\[tool\./p' pyproject.toml | sha1sum | cut -c1-12)
# A target that depends on its inputs is a no-op when they have not changed: each kernel is built again when its
# torch-ext/, its build.toml, the build tool or the commit (the builds' op namespace) changes, and laid into .hub/
# again when its build or its benchmarks change.
KERNELS := $(patsubst kernels/%/build.toml,%,$(wildcard kernels/*/build.toml))
HEAD := $(shell git rev-parse --short=7 HEAD 2>/dev/null || echo none)
BUILT := $(KERNELS:%=kernels/%/build/.built-$(HEAD))
LAID := $(KERNELS:%=.hub/.laid-%)

# The Triton releases the packages support besides the pinned one (3.6.0): each CUDA torch wheel pins one
# (2.12 -> 3.7.0, 2.13 -> 3.7.1, 2.14 -> 3.8, 2.15 -> 3.9). Each is installed alone under .triton/<version>/ and put
# ahead of .venv's on PYTHONPATH, so that the same torch and tools run under it.
TRITONS := 3.7.1 3.8.0 3.9.0
RELEASES := 3.6.0 $(TRITONS)
# The GPU architectures the metadata admits: every launch of the benchmarks for sm_90a (H100 / H200), each kernel
# configuration once for the others (A100, Ada, B200, RTX 50): `tools.compile_offline`.
ARCHS := sm_90a sm_80 sm_89 sm_100a sm_120a
# The compile matrix: one target a (release, architecture) cell, compile-<release>-<arch>, so that `make -j2` keeps
# both cores busy; compile-<release>-<arch>-once compiles each kernel of the cell once (`--each-kernel-once`). The
# whole matrix does not fit CI's 90 minutes on two cores (a cell takes 3 to 12 minutes there). CI compiles 8 cells
# whole: sm_90a, where the fast paths are release-gated and the benchmarks run, under every release; the pre-Hopper
# architectures under the pinned release and Blackwell's under the newest, which is what their users' torch most
# likely pins; and the other 12 cells each kernel once. `make compile-matrix` compiles every cell whole.
MATRIX := $(foreach r,$(RELEASES),$(ARCHS:%=compile-$(r)-%))
CI_MATRIX := $(RELEASES:%=compile-%-sm_90a) compile-3.6.0-sm_80 compile-3.6.0-sm_89 compile-3.9.0-sm_100a \
	compile-3.9.0-sm_120a
CI_ONCE := $(patsubst %,%-once,$(filter-out $(CI_MATRIX),$(MATRIX)))
NEWEST_TRITON := 3.9.0

.PHONY: help venv build hub demo test lint bench-cpu compile-matrix $(MATRIX) $(MATRIX:%=%-once) test-newest-triton \
	ci lock publish-dry-run gpu-bench clean

help:
	@echo "make demo             set up, build, lay the Hub cache, load every kernel offline and run it"
	@echo "make test             set up, build, lay the Hub cache, run the whole test suite"
	@echo "make compile-matrix   compile every shipped kernel for $(ARCHS) under each of Triton $(RELEASES)"
	@echo "make compile-R-A      one cell of it: release R, architecture A (make compile-3.9.0-sm_100a);"
	@echo "                      compile-R-A-once: each kernel of the cell once"
	@echo "make test-newest-triton  the kernels' CPU (interpreter) tests under Triton $(NEWEST_TRITON)"
	@echo "make lint             the house rules the build does not check (python -m tools.lint)"
	@echo "make ci               lint, then test, test-newest-triton and CI's cells of the matrix two at a time:"
	@echo "                      what CI's .ci/run calls"
	@echo "make bench-cpu        run ldsa's \`kernels benchmark\` workloads on the CPU from the local Hub cache"
	@echo "make build            build kernels/<name>/build/torch-{cuda,cpu} for every kernel that changed"
	@echo "make hub              lay the builds and benchmarks into .hub/ (HF_HUB_CACHE layout, refs/v<N>)"
	@echo "make lock             write kernels.lock from [tool.kernels.dependencies] and .hub/"
	@echo "make publish-dry-run  print what publishing every kernel to the Hub would upload, and where"
	@echo "make gpu-bench        on a CUDA machine: GPU correctness tests + the side-by-side benchmark"

$(VENV_STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q '.[dev]'
	rm -f .venv/.installed-* && touch $@

venv: $(VENV_STAMP)

.SECONDEXPANSION:
kernels/%/build/.built-$(HEAD): $(VENV_STAMP) kernels/%/build.toml tools/build.py tools/common.py \
		$$(shell find kernels/$$*/torch-ext -type f ! -name '*.pyc')
	rm -f kernels/$*/build/.built-*
	$(PY) -m tools.build $*
	touch $@

.hub/.laid-%: kernels/%/build/.built-$(HEAD) tools/hub.py $$(shell find kernels/$$*/benchmarks -type f ! -name '*.pyc')
	$(PY) -m tools.hub $*
	touch $@

build: $(BUILT)

hub: $(LAID)

demo: hub
	$(PY) -m tools.demo

test: hub
	$(PY) -m pytest -q -p no:cacheprovider

lint: venv
	$(PY) -m tools.lint

bench-cpu: hub
	HF_HUB_OFFLINE=1 HF_HUB_CACHE=$(CURDIR)/.hub .venv/bin/kernels benchmark tessera/ldsa@v1 \
		--iterations 5 --warmup 1

.triton/%/.installed:
	$(PY) -m pip install -q --no-deps --target .triton/$* triton==$*
	touch $@

compile-matrix: $(MATRIX)

# A cell's release, architecture and scope (release-arch[-once]); the pinned release is .venv's own, the others
# come from .triton/<release>/.
cell = $(word $(2),$(subst -, ,$(1)))
triton_of = $(if $(filter 3.6.0,$(1)),,.triton/$(1)/.installed)
$(MATRIX) $(MATRIX:%=%-once): compile-%: hub $$(call triton_of,$$(call cell,$$*,1))
	@echo "== Triton $(call cell,$*,1), $(call cell,$*,2)$(if $(call cell,$*,3), each kernel once)"
	$(if $(call triton_of,$(call cell,$*,1)),PYTHONPATH=.triton/$(call cell,$*,1) )$(PY) -m tools.compile_offline \
		--no-build --arch $(call cell,$*,2)$(if $(call cell,$*,3), --each-kernel-once)

test-newest-triton: hub .triton/$(NEWEST_TRITON)/.installed
	PYTHONPATH=.triton/$(NEWEST_TRITON) $(PY) -m pytest -q -p no:cacheprovider kernels

# The longest jobs first (the tests, then the sm_90a cells), so that the two cores finish together.
ci: lint
	$(MAKE) --jobs=2 --output-sync=target test test-newest-triton $(CI_MATRIX) $(CI_ONCE)

lock: hub
	$(PY) -m tools.lock

publish-dry-run: build
	$(PY) -m tools.publish --dry-run

gpu-bench:
	python3 -m tools.gpu_bench

clean:
	rm -rf .hub kernels/*/build .triton
