# Chorus Ops — the two commands of the README, plus their building blocks.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
HOST   ?= 127.0.0.1
PORT   ?= 8000

# Tests run against the production stack: PostgreSQL and Redis on this machine unless told otherwise.
TEST_DATABASE_URL ?= postgres://root@127.0.0.1:5432/test
TEST_REDIS_URL    ?= redis://127.0.0.1:6379/0

# The real agent CLIs the end-to-end tests drive (tests/e2e/test_real_cli*.py), pinned: bump here.
AGENT_CLIS    := @anthropic-ai/claude-code@2.1.328 @openai/codex@0.169.0
AGENT_CLI_DIR ?= .agents-cli

.PHONY: run test install install-test agent-clis demo clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet -e .
	touch $@

$(VENV)/.installed-test: pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet -e '.[test]'
	touch $(VENV)/.installed $@

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test

## agent-clis: Claude Code and Codex from the npm registry into $(AGENT_CLI_DIR)/ (nothing global).
## Their native binaries come as npm optional dependencies; nothing is downloaded when they run.
agent-clis:
	@if [ "$$(cat $(AGENT_CLI_DIR)/.installed 2>/dev/null)" != "$(AGENT_CLIS)" ]; then \
	  echo "installing $(AGENT_CLIS) into $(AGENT_CLI_DIR)/"; \
	  rm -rf $(AGENT_CLI_DIR) && mkdir -p $(AGENT_CLI_DIR) && echo '{"private": true}' > $(AGENT_CLI_DIR)/package.json && \
	  npm install --prefix $(AGENT_CLI_DIR) --save-exact --no-audit --no-fund --loglevel=error $(AGENT_CLIS) && \
	  echo "$(AGENT_CLIS)" > $(AGENT_CLI_DIR)/.installed; \
	fi

## run: embedded mode (SQLite, in-memory channel layer, in-process tasks): demo data, portal and a local daemon
run: install
	env -u DATABASE_URL -u REDIS_URL $(BIN)/python manage.py migrate --noinput -v0
	env -u DATABASE_URL -u REDIS_URL $(BIN)/python manage.py chorus_demo --quiet-logins
	env -u DATABASE_URL -u REDIS_URL $(BIN)/python manage.py chorus_serve --host $(HOST) --port $(PORT) --demo-logins

## test: the whole suite against PostgreSQL and Redis
test: install-test agent-clis
	CHORUS_AGENT_CLI_DIR="$${CHORUS_AGENT_CLI_DIR:-$(CURDIR)/$(AGENT_CLI_DIR)}" CHORUS_AGENT_CLIS="$(AGENT_CLIS)" \
	DATABASE_URL="$${DATABASE_URL:-$(TEST_DATABASE_URL)}" REDIS_URL="$${REDIS_URL:-$(TEST_REDIS_URL)}" \
	DJANGO_SECRET_KEY="$${DJANGO_SECRET_KEY:-test-only-secret}" DJANGO_HTTPS=0 \
	$(BIN)/pytest $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) var .pytest_cache $(AGENT_CLI_DIR)
