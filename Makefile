# Set-up, run and test in one command each; see README.md.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
BIND ?= 127.0.0.1:8000
WORKERS ?= 2

.PHONY: run test lint bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e . --group dev
	touch $@

instance/config.toml:
	mkdir -p instance
	cp docs/config.example.toml $@

instance/secret_key:
	mkdir -p instance
	$(PY) -c 'import secrets; print(secrets.token_hex(32))' > $@

# Serve and process on the embedded SQLite default with the sample config.
run: $(VENV)/.installed instance/config.toml instance/secret_key
	SECRET_KEY=$$(cat instance/secret_key) $(VENV)/bin/flask --app wsgi db upgrade
	# One worker beside gunicorn processes the deliveries; it stops (after
	# its current delivery) when gunicorn does.
	# Both share one metrics directory, so /metrics shows the worker's counts.
	mkdir -p instance/metrics
	export SECRET_KEY=$$(cat instance/secret_key) PROMETHEUS_MULTIPROC_DIR=$(CURDIR)/instance/metrics; \
	$(VENV)/bin/flask --app wsgi worker & worker=$$!; \
	consumer=; if [ -n "$$($(VENV)/bin/flask --app wsgi consume --list)" ]; then \
		$(VENV)/bin/flask --app wsgi consume & consumer=$$!; fi; \
	trap 'kill $$worker $$consumer 2>/dev/null; wait $$worker $$consumer' EXIT; \
	$(VENV)/bin/gunicorn -c gunicorn.conf.py --bind $(BIND) --workers $(WORKERS) wsgi:app

test: $(VENV)/.installed
	$(PY) -m pytest $(PYTEST_ARGS)

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

bench: $(VENV)/.installed
	$(PY) -m bench

clean:
	rm -rf $(VENV) test-artifacts bench/results
