# Set-up is part of each target: a fresh clone needs only `make demo` or `make test`.
# torch is pinned (pyproject) to 2.13.0, whose CPU build pip takes from this machine's disk.
PYTHON ?= python3
VENV   ?= .venv
STAMP  := $(VENV)/.installed-$(shell cksum pyproject.toml | cut -d' ' -f1)

.PHONY: demo test test-all bench install

$(STAMP): pyproject.toml
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -e '.[test]'
	rm -f $(VENV)/.installed-*; touch $@

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/gigadecode demo

test: $(STAMP)
	$(VENV)/bin/pytest -q

test-all: $(STAMP)
	$(VENV)/bin/pytest -q -m ''

bench: $(STAMP)
	$(VENV)/bin/python bench/decode.py
