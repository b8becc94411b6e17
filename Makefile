# Two commands: `make demo` (set up, run the main job) and `make test` (set up, run the tests).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test lint bench clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/moerl demo --overwrite

test: $(STAMP)
	$(PY) -m ruff check moerl tests benchmarks
	$(PY) -m pytest -q

bench: $(STAMP)
	$(PY) benchmarks/forward.py

clean:
	rm -rf $(VENV) runs .pytest_cache
