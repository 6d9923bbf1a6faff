# Set-up and entry points. `make demo` and `make test` install whatever is missing first (Debian/Ubuntu, as
# root): system packages through apt, Python packages into .venv. Re-running is cheap: each step checks first.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# Extra pip options, e.g. TORCH_INDEX=https://download.pytorch.org/whl/cpu on a host whose pip would
# otherwise fetch the multi-GB CUDA build of torch.
TORCH_INDEX ?=
PIP_EXTRA := $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX),)
# openssh-server: the multi-machine tests run real sshd in namespaces (its service is never started: see below);
# vagrant: the suite runs `vagrant validate` on the Vagrantfile (no provider needed);
# clang, libbpf-dev, bpftool: the bpf engine's tc program is compiled on first use (testbed/engine/bpf/)
APT_PACKAGES := iproute2 iptables ethtool iperf3 iputils-ping tcpdump util-linux procps kmod openssh-server vagrant \
	clang libbpf-dev bpftool
PYTEST_ARGS ?=
# The shell's $missing packages installed from Debian, none of their services started (a policy-rc.d while apt
# runs, unless the host has one): one install step for every *-deps target.
define install_missing
if [ -n "$$missing" ]; then \
  echo "installing system packages:$$missing"; \
  noservice=; [ -e /usr/sbin/policy-rc.d ] || { printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d; \
    chmod +x /usr/sbin/policy-rc.d; noservice=1; }; \
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing; \
  rc=$$?; [ -z "$$noservice" ] || rm -f /usr/sbin/policy-rc.d; [ $$rc -eq 0 ] || exit $$rc; \
fi
endef
# The Slurm tests (tests/test_slurm.py: a two-node cluster made of Debian's slurm-wlm and munge on this host;
# acl: a traverse-only ACL lets `nobody` reach the venv's interpreter where it lies under /root). No service of
# theirs is started (policy-rc.d); Slurm is only needed for `testbed run --executor slurm` and its tests.
SLURM_PACKAGES := slurm-wlm munge acl

.PHONY: deps system-deps python-deps slurm-deps vm-deps vagrant-deps vagrant-box test-vagrant docker-engine image demo test test-all test-vm bench clean-testbed help

help:
	@echo "make demo   install what is missing, then run the main job"
	@echo "make test   install what is missing, then run the test suite"
	@echo "make test-all   the suite and its slow tests; make test-vm: two qemu VMs carrying a topology"
	@echo "make bench  run the benchmarks in benchmarks/"

deps: system-deps python-deps

system-deps:
	@missing=""; \
	for p in $(APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	$(PYTHON) -c 'import sys, venv, ensurepip; sys.exit(sys.version_info < (3, 11))' 2>/dev/null \
	  || missing="$$missing python3 python3-venv python3-pip"; \
	$(install_missing); \
	$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' || { \
	  echo "testbed needs Python >= 3.11; $(PYTHON) is $$($(PYTHON) -V 2>&1). Use e.g. make PYTHON=python3.11" >&2; exit 1; }

python-deps: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml constraints.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q $(PIP_EXTRA) -c constraints.txt -e '.[test]'
	@touch $@

slurm-deps:
	@missing=""; for p in $(SLURM_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	$(install_missing)

# A Docker engine for the docker runtime (and its tests): Debian's docker.io and a dockerd that never touches
# the host's network (containers/ensure-docker.sh). Without one, the docker tests are skipped with a reason.
docker-engine:
	@containers/ensure-docker.sh >/dev/null || echo "warning: no Docker engine: docker-runtime tests will be skipped" >&2

image: deps docker-engine
	$(VENV)/bin/testbed image build

# The main job: experiments/quick.yaml (tiny GPT-2, DDP and PP, two recipes, three BERs, the fix/keep latency
# comparison), about 1-2 minutes on 2 cores. Re-running resumes: finished points are kept.
DEMO_OUT ?= demo-out
demo: deps
	$(VENV)/bin/testbed doctor || true
	$(VENV)/bin/testbed run experiments/quick.yaml --out $(DEMO_OUT)
	@echo; echo "report: $(abspath $(DEMO_OUT))/report.md (plots and summary.csv beside it)"

test: deps docker-engine slurm-deps
	$(PY) -m pytest -q $(PYTEST_ARGS) tests

# Everything: the tests marked slow too (GPT-2 124M ~1 min, DDP on ring4 for 5 seeds, the deviation-vs-BER
# runs) and those moved out of `make test` to keep it under 15 min (tests/conftest.py, MOVED_TO_TEST_ALL).
test-all: deps docker-engine slurm-deps
	$(PY) -m pytest -q -m "not vm and not vagrant" $(PYTEST_ARGS) tests

# Two qemu VMs from a Debian image built here (testbed/machines/vm.py; the first run builds it, ~2-3 min) carrying a
# topology across them through --machines: ~4-5 min with the image cached, ~7 min with the build.
VM_PACKAGES := qemu-system-x86 debootstrap e2fsprogs debian-archive-keyring
vm-deps:
	@missing=""; for p in $(VM_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	$(install_missing)

test-vm: deps vm-deps
	$(PY) -m pytest -q -rA -m vm $(PYTEST_ARGS) tests/test_vms.py

# Vagrant under libvirt (issue 24): Debian's libvirt and vagrant-libvirt (services kept from starting: the testbed
# starts its own libvirtd inside a network namespace), and a libvirt box built here from Debian packages
# (testbed/machines/vagrantbox.py; ~5 min the first time), registered as testbed/bookworm-local.
VAGRANT_PACKAGES := $(VM_PACKAGES) qemu-utils libvirt-daemon-system libvirt-daemon-driver-qemu libvirt-clients \
	dnsmasq-base vagrant vagrant-libvirt rsync
vagrant-deps:
	@missing=""; for p in $(VAGRANT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	$(install_missing)

vagrant-box: deps vagrant-deps
	$(PY) -m testbed.machines.vagrantbox build --add

# Issue 24 end to end: that box, libvirt in a namespace of its own, `vagrant up` of two VMs (TCG where KVM does not
# work) with shared provisioning (this checkout and its Python over 9p: nothing installed, no way out needed), a
# topology with netem across them, and a small experiment in the VMs compared with the same one on this host;
# everything removed afterwards. ~15-25 min on 2 cores with the box cached (docs/machines.md). Outside `make test`.
test-vagrant: deps vagrant-deps
	$(PY) -m pytest -q -rA -s -m vagrant $(PYTEST_ARGS) tests/test_vagrant_up.py

bench: deps
	@for b in benchmarks/bench_*.py; do echo "== $$b"; $(PY) $$b || exit 1; done

clean-testbed: deps
	$(VENV)/bin/testbed down --all
