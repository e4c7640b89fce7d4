# The two commands a newcomer needs: `make run` and `make test`. Both install what they need.
PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed-stamp
# root installs OS packages directly; anyone else through sudo.
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: run test lint sshd slurm deploy-tools shells

# Create or refresh .venv whenever pyproject.toml changes.
$(STAMP): pyproject.toml
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	$(VENV)/bin/python -m pip install -q -e '.[dev,paramiko,ssh2,loadtests]'
	touch $(STAMP)

# The local HPC host and the test fixtures run a real OpenSSH sshd.
sshd:
	@test -x /usr/sbin/sshd || { \
	  echo "installing openssh-server (the local HPC host runs a real sshd)"; \
	  $(SUDO) apt-get update -q && \
	  DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -q openssh-server; }

# The deploy/ tests run nginx in front of two replicas and check the systemd units. RUNLEVEL=1
# keeps the package from starting a system nginx on port 80.
deploy-tools:
	@test -x /usr/sbin/nginx && command -v systemd-analyze >/dev/null || { \
	  echo "installing nginx and systemd (deploy/ tests: reverse proxy, unit checks)"; \
	  $(SUDO) apt-get update -q && \
	  RUNLEVEL=1 DEBIAN_FRONTEND=noninteractive $(SUDO) -E apt-get install -y -q nginx systemd; }

# The argv round-trip tests log in through each login shell an HPC site may give its users.
shells:
	@test -x /bin/zsh -a -x /bin/tcsh || { \
	  echo "installing zsh and tcsh (argv quoting is tested through every login shell)"; \
	  $(SUDO) apt-get update -q && \
	  DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -q zsh tcsh; }

# The batch-job tests run a real single-node Slurm (munge, slurmctld, slurmd) from the OS packages.
slurm: $(STAMP)
	$(VENV)/bin/python -m sshpool.devhost.slurm install

# Start the local HPC host (sshd on loopback, `tuned` profile) and the API on 127.0.0.1:8000.
run: $(STAMP) sshd
	$(VENV)/bin/sshapi dev

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

# The whole suite: lint, then every test (SSH, API, fault and slow ones included). Each run gets
# its own temp dir: pytest prunes /tmp/pytest-of-$USER to 3 runs, which would delete the sshd
# files of a run still going.
test: $(STAMP) sshd shells slurm deploy-tools lint
	$(VENV)/bin/pytest --basetemp="$$(mktemp -d /tmp/sshapi-tests.XXXXXX)"
