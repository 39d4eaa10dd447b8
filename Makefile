# The two set-up commands of the README. Both work on a fresh machine with only python3.
#   make serve   -> .venv, install, fetch the default model, serve it on http://127.0.0.1:8080
#   make test    -> the same set-up, then the whole test suite
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
BENCH_STAMP := $(VENV)/.bench-stamp
PORT   ?= 8080
PYTEST_ARGS ?=

.PHONY: serve test install model bench clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test,cuda]'
	touch $(STAMP)

install: $(STAMP)

model: $(STAMP)
	$(BIN)/pantheon pull

serve: model
	$(BIN)/pantheon serve --port $(PORT)

test: model
	$(BIN)/python -m pytest -q -ra $(PYTEST_ARGS)

# The bench extra: llama-cpp-python, the side-by-side reference (built from source: a few minutes, needs a C++
# compiler and cmake). Built for the host's vector instructions (ggml's default, -march=native) but without
# AMX: the reference the CPU-speed issue names is llama.cpp on AVX2 / AVX-512, and on an AMX Xeon (2026-12-07,
# 2 threads, Q4_1) 0.3.36's AMX matmul crashed the process with a segmentation fault in its first prefill. No
# pip cache: a wheel built earlier without these flags would otherwise be taken as it is.
LLAMA_CPP_FLAGS := -mno-amx-tile -mno-amx-int8 -mno-amx-bf16
$(BENCH_STAMP): $(STAMP)
	CMAKE_ARGS="-DCMAKE_C_FLAGS='$(LLAMA_CPP_FLAGS)' -DCMAKE_CXX_FLAGS='$(LLAMA_CPP_FLAGS)'" \
		$(BIN)/python -m pip install --quiet --no-cache-dir -e '.[bench]'
	touch $(BENCH_STAMP)

bench: model $(BENCH_STAMP)
	$(BIN)/python bench/decode.py

clean:
	rm -rf $(VENV) build *.egg-info
