# The two commands a newcomer needs: `make run` and `make test`. Both install what they need.
# The OS's python3 when there is one: what deploy/sshapi@.service runs, so the benchmarks measure
# the interpreter a deployment has (Debian's build costs ~10% less CPU per job than a plain
# source build such as pyenv's: docs/benchmarks.md). Else python3 on PATH.
PYTHON ?= $(firstword $(wildcard /usr/bin/python3) python3)
VENV := .venv
# Two stamps: `make run` needs the server alone (RUN_STAMP: its extra, ~20 s on a fresh clone);
# `make test` and the lint need the test tools, load suite and other SSH libraries too (STAMP).
RUN_STAMP := $(VENV)/.installed-run-stamp
STAMP := $(VENV)/.installed-stamp
# root installs OS packages directly; anyone else through sudo.
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
# Every OS package install goes through this. `env` sets the variables for apt-get itself: sudo
# resets the environment, so `VAR=x sudo apt-get` never passes VAR on, and `VAR=x $(SUDO) -E
# apt-get` runs a program called `-E` when $(SUDO) is empty (root).
APT_GET = $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get
# What each install recipe checks before installing: tests/test_makefile.py points these at
# absent paths to run every recipe with the tools missing.
SSHD_BIN ?= /usr/sbin/sshd
CURL_BIN ?= /usr/bin/curl
NGINX_BIN ?= /usr/sbin/nginx
SYSTEMD_ANALYZE_BIN ?= /usr/bin/systemd-analyze
ZSH_BIN ?= /bin/zsh
TCSH_BIN ?= /bin/tcsh
CHROMIUM_BIN ?= /usr/bin/chromium
CHROMEDRIVER_BIN ?= /usr/bin/chromedriver
PROMETHEUS_BIN ?= /usr/bin/prometheus
PROMTOOL_BIN ?= /usr/bin/promtool
# node and npm wherever PATH finds them (nvm, NodeSource), else Debian's.
NODE_BIN ?= $(shell command -v node || echo /usr/bin/node)
NPM_BIN ?= $(shell command -v npm || echo /usr/bin/npm)
# venv needs ensurepip, which Debian ships apart from Python (package python3-venv).
ENSUREPIP_MAIN ?= $(shell $(PYTHON) -c 'import sysconfig; print(sysconfig.get_path("stdlib"))')/ensurepip/__main__.py
# Where `sshpool.devhost.slurm install` looks for Slurm's programs; empty: its default.
SLURM_SEARCH_PATH ?=
# What `sshpool.devhost.services install` checks and where it starts the test run's own servers
# (PG_BIN_DIR empty: the newest /usr/lib/postgresql/N/bin). The tests' URLs name these ports.
PG_PORT ?= 5432
REDIS_PORT ?= 6379
PG_BIN_DIR ?=
REDIS_SERVER_BIN ?= /usr/bin/redis-server
PG_ETC ?= /etc/postgresql
SERVICES_DIR ?= /tmp/sshapi-services-$(shell id -u)
# Where `make openssh10` unpacks OpenSSH 10.0's sshd (tests/conftest.py looks there too), and the
# apt-get it downloads with.
OPENSSH10_DIR ?= /tmp/sshapi-openssh10-$(shell id -u)
OPENSSH10_APT ?= apt-get

.PHONY: run test test-fast lint unasync dashboards python-venv sshd load-tools slurm services deploy-tools shells browser node openssh10 prometheus

# Create or refresh .venv whenever pyproject.toml changes. An existing .venv keeps the interpreter
# it was made with: remove it to move to another one. scripts/pip_progress.py runs pip with a
# progress line (pip -q is silent for the whole install); it needs only the venv's python.
# The OS's pip is left as it is for the server (upgrading it costs seconds of a first `make run`),
# and --no-compile leaves the bytecode to the first import, which compiles only what the server
# imports (pip compiles every module of every package: 70-81 s against 47-48 s for the server's
# install, interleaved, load 9-12: docs/benchmarks.md).
$(RUN_STAMP): pyproject.toml | python-venv
	@echo "installing the server into $(VENV) (first run, or pyproject.toml changed)"
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python scripts/pip_progress.py "  server" -- --no-compile -e '.[server]'
	touch $(RUN_STAMP)

# The rest, on top of the server: the tests' and the load suite's tools, the other SSH libraries.
$(STAMP): $(RUN_STAMP)
	@echo "installing the test tools, load suite and SSH backends into $(VENV)"
	$(VENV)/bin/python -m pip install -q --upgrade pip
	$(VENV)/bin/python scripts/pip_progress.py "  tests" -- -e '.[server,dev,paramiko,ssh2,loadtests]'
	touch $(STAMP)

# Creating .venv with Debian's python3 needs its ensurepip (a separate package there); an existing
# .venv needs nothing.
python-venv:
	@test -x $(VENV)/bin/python -o -e $(ENSUREPIP_MAIN) || { \
	  echo "installing python3-venv (creating .venv needs ensurepip)"; \
	  $(APT_GET) update -q && \
	  $(APT_GET) install -y -q python3-venv; }

# The local HPC host and the test fixtures run a real OpenSSH sshd.
sshd:
	@test -x $(SSHD_BIN) || { \
	  echo "installing openssh-server (the local HPC host runs a real sshd)"; \
	  $(APT_GET) update -q && \
	  $(APT_GET) install -y -q openssh-server; }

# The load suite's downloads beside scp's run curl, a client in C as scp is
# (loadtests.transfer_fairness).
load-tools:
	@test -x $(CURL_BIN) || { \
	  echo "installing curl (the load suite downloads through the API with it)"; \
	  $(APT_GET) update -q && \
	  $(APT_GET) install -y -q curl; }

# The deploy/ tests run nginx in front of two replicas and check the systemd units. RUNLEVEL=1
# keeps the package from starting a system nginx on port 80.
deploy-tools:
	@test -x $(NGINX_BIN) -a -x $(SYSTEMD_ANALYZE_BIN) || { \
	  echo "installing nginx and systemd (deploy/ tests: reverse proxy, unit checks)"; \
	  $(APT_GET) update -q && \
	  $(SUDO) env RUNLEVEL=1 DEBIAN_FRONTEND=noninteractive apt-get install -y -q nginx systemd; }

# The argv round-trip tests log in through each login shell an HPC site may give its users.
shells:
	@test -x $(ZSH_BIN) -a -x $(TCSH_BIN) || { \
	  echo "installing zsh and tcsh (argv quoting is tested through every login shell)"; \
	  $(APT_GET) update -q && \
	  $(APT_GET) install -y -q zsh tcsh; }

# The offline /docs and /redoc test renders the pages in Debian's headless Chromium, driven by
# selenium through Debian's chromedriver (no browser or driver download).
browser:
	@test -x $(CHROMIUM_BIN) -a -x $(CHROMEDRIVER_BIN) || { \
	  echo "installing chromium and chromium-driver (the /docs and /redoc test uses a real browser)"; \
	  $(APT_GET) update -q && \
	  $(APT_GET) install -y -q chromium chromium-driver; }

# The deploy/prometheus and deploy/grafana tests check the rules and configuration with promtool
# and run a real Prometheus scraping the API (Debian's package brings both). RUNLEVEL=1 keeps the
# package from starting a system Prometheus on port 9090.
prometheus:
	@test -x $(PROMETHEUS_BIN) -a -x $(PROMTOOL_BIN) || { \
	  echo "installing prometheus (deploy/ tests: promtool checks, a real Prometheus scrapes the API)"; \
	  $(APT_GET) update -q && \
	  $(SUDO) env RUNLEVEL=1 DEBIAN_FRONTEND=noninteractive apt-get install -y -q prometheus; }

# The login tests and `sshapi dev --oidc` run the rig's OpenID provider (panva's oidc-provider)
# with node; its packages come from npm (`npm ci`, sshpool/devhost/oidc.py) and need node >= 18:
# Debian 12's nodejs (18.20) will do.
node:
	@test -x $(NODE_BIN) -a -x $(NPM_BIN) || { \
	  echo "installing nodejs and npm (the login tests run the rig's OpenID provider)"; \
	  $(APT_GET) update -q && \
	  $(APT_GET) install -y -q nodejs npm; }

# The batch-job tests run a real single-node Slurm (munge, slurmctld, slurmd) from the OS packages.
slurm: $(STAMP)
	$(VENV)/bin/python -m sshpool.devhost.slurm install $(if $(SUDO),--sudo,--no-sudo) \
	  $(if $(SLURM_SEARCH_PATH),--search-path $(SLURM_SEARCH_PATH))

# The API tests use PostgreSQL (postgres@127.0.0.1:5432/test) and Redis (127.0.0.1:6379). When
# they answer, nothing happens; else the packages are installed when missing and the test run
# starts its own servers under SERVICES_DIR, without systemd (sshpool/devhost/services.py).
# SSHAPI_TEST_PG (the tests' PostgreSQL URL) set: that server is its owner's, left alone.
services: $(STAMP)
	@$(VENV)/bin/python -m sshpool.devhost.services install $(if $(SUDO),--sudo,--no-sudo) \
	  --pg-port $(PG_PORT) --redis-port $(REDIS_PORT) --data-dir $(SERVICES_DIR) \
	  $(if $(PG_BIN_DIR),--pg-bin-dir $(PG_BIN_DIR)) --redis-server $(REDIS_SERVER_BIN) --pg-etc $(PG_ETC) \
	  $(if $(SSHAPI_TEST_PG),--no-postgresql) || { \
	  echo "(tests against another PostgreSQL: SSHAPI_TEST_PG=postgresql+asyncpg://USER:PASSWORD@HOST:PORT/DB make test)"; \
	  exit 1; }

# OpenSSH 10.0's sshd beside the system's (Debian 12: 9.2), for the tests of PerSourcePenalties:
# downloaded from bookworm-backports with apt-get's own lists under OPENSSH10_DIR and unpacked
# there, never installed, so it needs neither root nor sudo (sshpool/devhost/openssh.py). Without
# apt-get or a network it says why and exits 0: those tests then skip, saying the same.
openssh10: $(STAMP)
	@$(VENV)/bin/python -m sshpool.devhost.openssh fetch --dir $(OPENSSH10_DIR) --apt $(OPENSSH10_APT)

# Start the local HPC host (sshd on loopback, `tuned` profile) and the API on 127.0.0.1:PORT
# (`make run PORT=8125`; else SSHAPI_PORT, else 8000). Only a PORT given on make's command line
# counts: a PORT some other tool exported must not move the API.
run: $(RUN_STAMP) sshd
	$(VENV)/bin/sshapi dev$(if $(filter command line,$(origin PORT)), --port $(PORT))

# The Grafana dashboards (deploy/grafana/dashboards/) are generated from the panels listed in
# scripts/gen_dashboards.py: run this after editing it; tests/api/test_api_prometheus.py fails
# while the two disagree.
dashboards: $(STAMP)
	$(VENV)/bin/python scripts/gen_dashboards.py

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

# The sync client (api/client/_sync.py, _sync_files.py) is generated from the async one
# (_async.py, _async_files.py): run this after editing them; tests/test_unasync.py fails while
# they disagree.
unasync: $(STAMP)
	$(VENV)/bin/python scripts/gen_sync_client.py

# Both tiers run in TEST_WORKERS processes (pytest-xdist), a test file's tests in one of them (its
# module fixtures built once). Most of a test is waiting on sshd, Slurm or a database, so more
# processes than cores pay: on 2 cores the fast tier took 432 s with 2, 302 and 287 s with 3,
# 253 and 332 s with 4 (docs/benchmarks.md, "The test suite's time"); 3, as 4 failed a Redis job-cap
# test once. Each worker has its own rig account and Redis database (tests/conftest.py,
# tests/api/api_helpers.py). TEST_WORKERS=0: one process, as before. The files
# are handed out longest first, in the order the workers collect them (--no-loadscope-reorder:
# not xdist's most-tests-first; tests/conftest.py LONGEST_FILES).
TEST_WORKERS ?= 3
PYTEST_PARALLEL = $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder)
# The tests run with Python's bytecode cache on, whatever the environment says: the suite starts
# some hundreds of Python processes (servers, the load suite, the CLI), and with
# PYTHONDONTWRITEBYTECODE set (container images and CI runners often set it) each compiled the
# server's packages again (`make run` installs them without bytecode) and pytest rewrote every
# test module in every worker again: 1-2 s of CPU a process (docs/benchmarks.md).
PYTEST = env -u PYTHONDONTWRITEBYTECODE $(VENV)/bin/pytest

# The fast tier: lint, then the pool, the API and the client against the rig's sshd, PostgreSQL
# and Redis; no Slurm, browser, deploy, docs, load-suite or install tests (their markers:
# tests/conftest.py). For the edit-test loop; `make test` (CI) runs everything.
test-fast: $(STAMP) sshd load-tools shells services openssh10 lint
	$(PYTEST) $(PYTEST_PARALLEL) -m "not full" --durations=20 --basetemp="$$(mktemp -d /tmp/sshapi-tests.XXXXXX)"

# The whole suite: lint, then every test (SSH, API, fault and slow ones included); it ends
# with the 20 slowest tests, to keep the suite's time in view. Each run gets
# its own temp dir: pytest prunes /tmp/pytest-of-$USER to 3 runs, which would delete the sshd
# files of a run still going.
test: $(STAMP) sshd load-tools shells slurm services deploy-tools browser node openssh10 prometheus lint
	$(PYTEST) $(PYTEST_PARALLEL) --durations=20 --basetemp="$$(mktemp -d /tmp/sshapi-tests.XXXXXX)"
