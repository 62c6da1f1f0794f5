# eagle3-ops — every target bootstraps .venv by itself.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.setup-done

.PHONY: setup test demo bench drills lint clean

setup: $(STAMP)

# torch is pinned in the same install so that the `train` extra never pulls a multi-GB GPU build (this
# machine's pip takes the CPU wheel already on disk); one pip run, with the venv's own pip (it installs
# editable pyproject packages), spares a resolver start and a pip upgrade per fresh clone. pip compiles what it
# installs on one core; compileall on every core does the same in half the time (measured: 52 s → 44 s in all).
# A file a package ships that does not compile is skipped, as pip skips it.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --no-compile "torch==2.13.0" -e ".[train,dev,prepare,tensorboard]"
	$(PY) -m compileall -q -j 0 "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" > /dev/null || true
	touch $(STAMP)

# This machine sets PYTHONDONTWRITEBYTECODE: without bytecode cached first, each of the suite's ~600 interpreter
# starts would compile the project's modules again (half a second here, once).
test: $(STAMP)
	$(PY) -m compileall -q -j 0 bot handlers pipeline tests bench > /dev/null
	$(PY) -m pytest

demo: $(STAMP)
	$(VENV)/bin/eagle3 demo

bench: $(STAMP)
	$(PY) -m bench.run

# The reliability drills with more trials (DRILL_TRIALS, default 20; about 15 minutes on 2 cores).
drills: $(STAMP)
	$(PY) -m bench.drills

# ruff, then mypy over pipeline/, handlers/ and bot/ (pyproject's [tool.mypy]; its packages installed once)
LINT_STAMP := $(VENV)/.lint-done
$(LINT_STAMP): $(STAMP) pyproject.toml
	$(PY) -m pip install -q -e ".[lint]"
	touch $(LINT_STAMP)

lint: $(LINT_STAMP)
	$(VENV)/bin/ruff check bot handlers pipeline tests bench
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache
