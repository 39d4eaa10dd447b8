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
# compiler and cmake).
$(BENCH_STAMP): $(STAMP)
	$(BIN)/python -m pip install --quiet -e '.[bench]'
	touch $(BENCH_STAMP)

bench: model $(BENCH_STAMP)
	$(BIN)/python bench/decode.py

clean:
	rm -rf $(VENV) build *.egg-info
