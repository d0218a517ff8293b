# ragkv — the two set-up commands are `make demo` and `make test`.
BUILD      ?= build
ASAN_BUILD ?= build-asan
JOBS       ?= $(shell nproc)
CMAKE_FLAGS ?=
SHARED     ?= ../shared

.PHONY: all deps build demo test test-fast test-asan bench fuzz clean format format-check layers

all: build

deps:
	@bash scripts/install-deps.sh

build: deps
	@cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=Release $(CMAKE_FLAGS) >/dev/null
	@cmake --build $(BUILD) -j $(JOBS)

# The main job on the embedded default model.
demo: build
	@bash scripts/demo.sh $(BUILD)/ragkv

# Every test: the optimised build, then the sanitizer build on the suites that
# do not run large models; finally the CUDA build compiles when nvcc exists.
test: build format-check layers
	@mkdir -p $(BUILD)/testtmp
	@cd $(BUILD) && ctest --output-on-failure -j 1
	@$(MAKE) --no-print-directory test-asan
	@bash scripts/cuda-build-check.sh

test-asan: deps
	@cmake -S . -B $(ASAN_BUILD) -DCMAKE_BUILD_TYPE=Debug -DRAGKV_SANITIZE=ON $(CMAKE_FLAGS) >/dev/null
	@cmake --build $(ASAN_BUILD) -j $(JOBS)
	@mkdir -p $(ASAN_BUILD)/testtmp
	@# Criterion reports a test before its process exits, so a leak found at exit
	@# does not fail the test: the full log is kept and searched for reports.
	@cd $(ASAN_BUILD) && ASAN_OPTIONS=detect_leaks=1 RAGKV_TEST_LIGHT=1 \
		ctest -V -j 1 > sanitizer.log 2>&1; rc=$$?; \
		grep -E "tests passed|tests failed|Test +#" sanitizer.log; \
		if grep -qE "ERROR: (Address|Leak)Sanitizer|runtime error:" sanitizer.log; then \
			grep -E -B2 -A20 "ERROR: (Address|Leak)Sanitizer|runtime error:" sanitizer.log | head -200; \
			echo "sanitizer reports found (full log: $(ASAN_BUILD)/sanitizer.log)"; exit 1; fi; \
		if [ $$rc -ne 0 ]; then grep -E -A30 "\[FAIL\]|Assertion Failed" sanitizer.log | head -200; exit $$rc; fi

# Fuzz the HTTP request parsers with libFuzzer for FUZZ_SECONDS (default 60).
fuzz: deps
	@FUZZ_BUILD=build-fuzz JOBS=$(JOBS) bash scripts/fuzz.sh

bench: build
	@for b in $(BUILD)/bench_*; do echo "== $$b"; $$b || exit 1; done

format:
	@clang-format -i $$(git ls-files '*.c' '*.h' '*.cu')

# Fails when a folder includes a header of a folder above it (docs/architecture.md).
layers:
	@bash scripts/check-layers.sh

# Fails on any file `make format` would change (.clang-format is the source of truth).
format-check: deps
	@clang-format --dry-run --Werror $$(git ls-files '*.c' '*.h' '*.cu') && echo "format: ok"

clean:
	rm -rf $(BUILD) $(ASAN_BUILD) build-cuda
