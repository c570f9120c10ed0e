# Two commands for a newcomer: `make demo` and `make test`. Both create .venv when missing and
# reinstall only when a requirements file changed.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
# Where pip finds torch's CPU build on a machine without a local wheel cache, e.g.
#   make test PIP_EXTRA="--extra-index-url https://download.pytorch.org/whl/cpu"
PIP_EXTRA ?=
STAMP := $(VENV)/.installed

.PHONY: demo test lint install clean bench bench-full

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
	$(PY) -m devtools.demo

# Every benchmark under bench/ (quick forms, ~12 min on 2 cores; bench-full: each bench's
# defaults), one table of figures vs goals, then docs/BENCHMARKS.md rendered from the results.
# A failed bench fails the target, after the page is rendered with it marked failed.
# BENCH_ARGS="--only latency,admission" re-runs those (the others keep their latest figures,
# each shown with the commit that measured it); the
# commands without running them: .venv/bin/python -m bench.suite --dry-run [--full].
BENCH_ARGS ?=

bench: $(STAMP)
	$(PY) -m bench.suite $(BENCH_ARGS); status=$$?; $(PY) -m bench.render && exit $$status

bench-full: $(STAMP)
	$(PY) -m bench.suite --full $(BENCH_ARGS); status=$$?; $(PY) -m bench.render && exit $$status

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy .
	$(VENV)/bin/lint-imports

test: lint
	$(VENV)/bin/pytest

clean:
	rm -rf .llmqueue
