# Set-up, run and test in one command each; see README.md.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
BIND ?= 127.0.0.1:8000
WORKERS ?= 2
PIDFILE := instance/run.pid

.PHONY: run stop test lint bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

# What the app needs to run: all make run installs, so a first run is quick.
$(VENV)/.runtime: pyproject.toml | $(PY)
	if [ $(VENV)/.installed -nt pyproject.toml ]; then :; else $(PY) -m pip install -q -e .; fi
	touch $@

# With the test and development tools too (make test, lint, bench).
$(VENV)/.installed: pyproject.toml | $(PY)
	$(PY) -m pip install -q -e . --group dev
	touch $(VENV)/.runtime $@

instance/config.toml:
	mkdir -p instance
	cp docs/config.example.toml $@

# Every entry point (gunicorn, each flask command) reads the key from here.
instance/secret_key:
	mkdir -p instance
	umask 077 && $(PYTHON) -c 'import secrets; print(secrets.token_hex(32))' > $@

# The processes `make run` supervises, one command each: add a line to add one.
RUN_PROCESSES = \
	-- "$(VENV)/bin/gunicorn -c gunicorn.conf.py --bind $(BIND) --workers $(WORKERS) wsgi:app" \
	-- "$(VENV)/bin/flask --app wsgi worker"
# A broker consumer too, when the config has broker sources (docs/brokers.md);
# expanded only when `run` starts, once the config file is in place.
RUN_PROCESSES += $(if $(shell $(VENV)/bin/flask --app wsgi consume --list 2>/dev/null),\
	-- "$(VENV)/bin/flask --app wsgi consume")

# Serve and process on the embedded SQLite default with the sample config.
# One SIGTERM or Ctrl-C (to make, or to the pid it prints) stops every process;
# so does `make stop` from another shell. Both share one metrics directory,
# so /metrics shows the worker's counts. While one runs, another refuses
# before it migrates or starts anything (bin/supervise.py holds the pidfile).
run: $(VENV)/.runtime instance/config.toml instance/secret_key
	@$(PY) bin/supervise.py --pidfile $(PIDFILE) --check
	$(VENV)/bin/flask --app wsgi db upgrade
	mkdir -p instance/metrics
	PROMETHEUS_MULTIPROC_DIR=$(CURDIR)/instance/metrics \
	exec $(PY) bin/supervise.py --pidfile $(PIDFILE) $(RUN_PROCESSES)

stop:
	@if [ -f $(PIDFILE) ]; then $(PY) bin/supervise.py --pidfile $(PIDFILE) --stop; \
	else echo "not running (no $(PIDFILE))"; fi

# In parallel processes (pytest-xdist: each has its own PostgreSQL database
# and starts its own test brokers), then, alone, the tests that measure a rate
# or a latency (marked serial), so that the others' load cannot skew them.
TEST_WORKERS ?= 4
test: $(VENV)/.installed
	$(PY) -m pytest -n $(TEST_WORKERS) -m "not serial" --durations=40 $(PYTEST_ARGS)
	$(PY) -m pytest -m serial $(PYTEST_ARGS)

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

bench: $(VENV)/.installed
	$(PY) -m bench

clean:
	rm -rf $(VENV) test-artifacts bench/results
