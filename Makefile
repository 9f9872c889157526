# Set-up on a fresh machine is `make demo` or `make test`: both create .venv first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: install demo test bench-core clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(VENV)/bin/warmroute up

test: install
	$(PY) -m pytest -q

bench-core: install
	$(PY) -m extproc.bench_core

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
