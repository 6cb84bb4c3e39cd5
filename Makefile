# shufflefs: two commands on a fresh Debian machine, as root.
#   make demo   install everything, start a local cluster, mount it, read training data through it
#   make test   install what is missing, run the whole test suite
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
SHUFFLEFS := $(VENV)/bin/shufflefs
DATA_DIR ?= .shufflefs
MOUNTPOINT ?= mnt
# Debian packages: fuse3 (fusermount3, /dev/fuse tools), libfuse3-dev + pkg-config + a compiler
# (pyfuse3 builds from source), python3-venv, iproute2 (network-namespace test hosts),
# fio (bench/), kmod (modprobe fuse), psmisc (fuser, for diagnosing busy mounts), etcd-server
# (the HA control plane and its tests), chromium (headless: the status-page test).
SYSTEM_PACKAGES := fuse3 libfuse3-dev pkg-config gcc python3-dev python3-venv iproute2 fio kmod psmisc etcd-server chromium

.PHONY: demo test lint sysdeps venv bytecode down clean
PACKAGES := rpc metadata storage fuse client cluster

sysdeps:
	@missing=""; for p in $(SYSTEM_PACKAGES); do \
	  dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q "install ok installed" || missing="$$missing $$p"; \
	done; \
	if [ -n "$$missing" ]; then \
	  echo "installing system packages:$$missing"; \
	  apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q $$missing; \
	fi
	@[ -e /dev/fuse ] || modprobe fuse || { echo "/dev/fuse is missing and 'modprobe fuse' failed"; exit 1; }

$(VENV)/.installed: pyproject.toml
	@[ -x $(PY) ] || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,torch]'
	@touch $@

venv: sysdeps $(VENV)/.installed

# Every CLI call and service is a new Python process: with the bytecode cached they start
# about a fifth faster (compiled even where PYTHONDONTWRITEBYTECODE is set; stale files
# are recompiled on import as usual).
bytecode: venv
	@$(PY) -m compileall -q $(PACKAGES) >/dev/null

demo: venv bytecode
	$(SHUFFLEFS) up --data-dir $(DATA_DIR) --mountpoint $(MOUNTPOINT)
	$(PY) -m shufflefs.client.demo --mountpoint $(MOUNTPOINT)
	@echo
	@echo "shufflefs is mounted at $(abspath $(MOUNTPOINT)) (data and logs under $(abspath $(DATA_DIR)))."
	@echo "Status: $(SHUFFLEFS) status     Stop: $(SHUFFLEFS) down --data-dir $(DATA_DIR)"

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

# Two pytest workers, each test file whole on one of them (its module fixtures, its
# clusters, start once): most tests wait on processes, so two share two cores well.
# TEST_WORKERS=0 runs everything in one process.
TEST_WORKERS ?= 2

test: venv bytecode lint
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile

down:
	$(SHUFFLEFS) down --data-dir $(DATA_DIR)

clean: down
	rm -rf $(DATA_DIR)
