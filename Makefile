# Two commands for a newcomer: `make demo` and `make test`. Both create .venv when missing and
# reinstall only when a requirements file changed.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
# Where pip finds torch's CPU build on a machine without a local wheel cache, e.g.
#   make test PIP_EXTRA="--extra-index-url https://download.pytorch.org/whl/cpu"
PIP_EXTRA ?=
STAMP := $(VENV)/.installed

.PHONY: demo test lint install clean

$(STAMP): requirements.txt requirements-cpu.txt requirements-dev.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q $(PIP_EXTRA) -r requirements-dev.txt
	# PyPI's torchvision/torchaudio/torchcodec do not match vLLM's CPU torch and break
	# transformers' model imports; text models need none of them.
	$(PIP) uninstall -y -q torchvision torchaudio torchcodec || true
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) manage.py demo

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy .

test: lint
	$(VENV)/bin/pytest

clean:
	rm -rf .llmqueue
