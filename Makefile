# solrl — the two set-up commands are `make demo` and `make test`; both create .venv on first use. CI runs
# `make test-all` (both test tiers).
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
export OMP_WAIT_POLICY ?= PASSIVE

.PHONY: venv protos demo test test-slow test-all test-compose lint clean hpsv3-env perf-env

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first and pinned: the CPU wheel (an unpinned torch pulls several GB of CUDA wheels)
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

venv: $(STAMP)

# gRPC/protobuf stubs are generated (never committed) into the git-ignored solrl/pb/
protos: $(STAMP)
	$(BIN)/python -m solrl.protos_build

# One process: OpenMP's default wait policy. PASSIVE (above, for the many processes of the service tests)
# makes every parallel region wake sleeping threads, which on 2 cores doubles the demo's sampling time.
demo: protos
	rm -rf runs/demo
	env -u OMP_WAIT_POLICY $(BIN)/solrl train --preset shapes-sol-rl --out runs/demo

# ruff, then the import contracts in pyproject.toml (layers, the core not importing services, no circles;
# docs/architecture.md)
lint: $(STAMP)
	$(BIN)/ruff check solrl services tests
	$(BIN)/lint-imports

# pytest-xdist: test files spread over TEST_WORKERS processes (a file's tests stay together, in order, so a
# module's services start once; handed out in collection order, which tests/conftest.py sets: longest files first);
# 1 runs them in this process, one after another.
# Two tiers: `make test` runs every test not marked `slow` (about 11 minutes on an idle 2-core machine); `make test-slow` the
# end-to-end runs of a minute or more each (the learning run, the compose stack with a trainer restart, solrl up,
# the faults, the GPU check's dry run, the benchmarks' curves); `make test-all` both in one pass, as CI runs them.
TEST_WORKERS ?= 3
XDIST := $(if $(filter-out 1,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder)
test: protos lint
	$(BIN)/python -m pytest -q -m "not slow" $(XDIST)

test-slow: protos
	$(BIN)/python -m pytest -q -m slow $(XDIST)

# the compose tier last and alone: its four containers train on the same two cores, and beside the other tests'
# worker processes they stretch the deadlines of the timed service tests (the faults, the dashboard's run)
test-all: protos lint
	$(BIN)/python -m pytest -q -m "not compose" $(XDIST)
	$(BIN)/python -m pytest -q -m compose tests/deploy/test_compose_engine.py

# The hpsv3 reward's own environment (.venv/hpsv3: transformers 4.45.2, docs/rewards.md): tests/rewards/test_hpsv3.py
# runs its reward service from there and skips, saying so, where it was not built (CI builds it: .ci/run)
hpsv3-env: $(STAMP)
	bash envs/hpsv3/install.sh

# perf_analyzer, Triton's benchmark client (a binary in the tritonclient 2.34.0 wheel), in its own environment
# .venv/perf, with Debian's libb64-0d it links against: what `solrl bench doors` runs (services/doors.py)
perf-env: $(STAMP)
	dpkg -s libb64-0d >/dev/null 2>&1 || apt-get install -y -q libb64-0d
	$(BIN)/python -c "from services.doors import perf_env; print(perf_env()[0])"

# Images without an image registry (docs/deploy.md): the bases bootstrapped from Debian's packages (debootstrap, as
# root; services/images/bootstrap-base.sh caches the root filesystems in build/base), the wheels fetched here through
# this host's pip configuration into build/wheelhouse/$(FLAVOR) (services/images/wheelhouse.py), then the CPU
# compose file's four role images built on them with `pip install --no-index` (services/Dockerfile).
SOLRL_BASE_IMAGE  ?= solrl/base:bookworm
SOLRL_REDIS_IMAGE ?= solrl/redis:bookworm
FLAVOR ?= cpu
# the compose file refuses to interpolate without its secrets' directory; a build reads no secret
COMPOSE_BUILD_ENV := SOLRL_BASE_IMAGE=$(SOLRL_BASE_IMAGE) SOLRL_REDIS_IMAGE=$(SOLRL_REDIS_IMAGE) \
	SOLRL_SECRETS_DIR=$(or $(SOLRL_SECRETS_DIR),unused-by-the-build)
.PHONY: base-images wheelhouse images
base-images:
	docker image inspect $(SOLRL_BASE_IMAGE) >/dev/null 2>&1 || bash services/images/bootstrap-base.sh python $(SOLRL_BASE_IMAGE)
	docker image inspect $(SOLRL_REDIS_IMAGE) >/dev/null 2>&1 || bash services/images/bootstrap-base.sh redis $(SOLRL_REDIS_IMAGE)

wheelhouse: $(STAMP)
	$(BIN)/python services/images/wheelhouse.py $(FLAVOR) build/wheelhouse/$(FLAVOR)

images: base-images wheelhouse
	env $(COMPOSE_BUILD_ENV) docker-compose -f docker-compose.cpu.yml build

# The GPU images that need no Transformer Engine (reward, regenerator, trainer: PyPI's CUDA torch, no nvcc), built
# without a registry on any host, with BuildKit (the legacy builder stops at the cpu stage's check); then each one's
# smoke check without a driver: its imports, `solrl serve --help`, torch's CUDA build and no GPU seen. The explorer's
# (ENGINE=te) needs the TE binding compiled on a CUDA host: `python services/images/wheelhouse.py gpu build/wheelhouse/gpu`
# there (docs/deploy.md).
GPU_ROLES := reward:8001:8080 regenerator:8021:8092 trainer:8031:8093
# a docker client that builds with BuildKit: Docker 23+ with buildx, or Debian's 20.10 client (DOCKER=/usr/bin/docker
# where a newer client without buildx comes first on PATH)
DOCKER ?= docker
.PHONY: images-gpu
images-gpu: base-images
	$(BIN)/python services/images/wheelhouse.py gpu build/wheelhouse/gpu --engine none
	set -e; for r in $(GPU_ROLES); do role=$${r%%:*}; ports=$${r#*:}; \
	  DOCKER_BUILDKIT=1 $(DOCKER) build -q -f services/Dockerfile --target gpu --build-arg BASE=$(SOLRL_BASE_IMAGE) \
	    --build-arg FLAVOR=gpu --build-arg ROLE=$$role --build-arg GRPC_PORT=$${ports%%:*} \
	    --build-arg HTTP_PORT=$${ports#*:} -t solrl/$$role:gpu . ; \
	  $(DOCKER) run --rm --network none --entrypoint python solrl/$$role:gpu -c "import torch, torchao, diffusers, peft, \
	    transformers, grpc, solrl.engine.session, services.$$role.server; assert torch.version.cuda and not \
	    torch.cuda.is_available(); print('$$role:gpu', torch.__version__, 'CUDA', torch.version.cuda)"; \
	  $(DOCKER) run --rm --network none solrl/$$role:gpu --help >/dev/null; done

# docker-compose.cpu.yml on a real Docker engine, as a user runs it (tests/deploy/test_compose_engine.py): up, health,
# 2 epochs through a killed trainer, a killed explorer and a restarted Redis, logs, the containers' hardening, down -v
test-compose: protos images
	env SOLRL_BASE_IMAGE=$(SOLRL_BASE_IMAGE) SOLRL_REDIS_IMAGE=$(SOLRL_REDIS_IMAGE) \
		$(BIN)/python -m pytest -q -m compose tests/deploy/test_compose_engine.py

clean:
	rm -rf runs .pytest_cache

# On a GPU host (H100 / H200 / B200, no network): a preflight, a GEMM microbenchmark, the real denoisers' explore
# forward per precision backend, eager and with the repeated blocks compiled, a LoRA hot reload, one update's memory
# per row, a shapes epoch through the services (solrl/gpu_check.py), within BUDGET seconds (each section has a hard
# limit); writes $(OUT)/gpu_check.json and .md after every row. No prerequisite: a GPU host runs it in its own CUDA
# environment (GPU_PY; .venv's python where there is one); `make gpu-check DRY_RUN=1` runs it on tiny configs on the CPU.
OUT    ?= runs/gpu-check
BUDGET ?= 400
GPU_PY ?= $(if $(wildcard $(BIN)/python),$(BIN)/python,python3)
KIT    ?= runs/gpu-kit
.PHONY: gpu-check gpu-kit gpu-check-kit
gpu-check:
	$(GPU_PY) -m solrl.gpu_check --out $(OUT) --budget-s $(BUDGET) $(if $(DRY_RUN),--dry-run)

# Here, with network (pip and packaging; no venv needed): the wheels the lent GPU image lacks (solrl/gpu_kit.py;
# envs/gpu-image-packages.txt lists what it has) into $(KIT), checked to fit a run's 64 MiB with the repository, and
# its manifest.json.
gpu-kit:
	$(GPU_PY) -m solrl.gpu_kit download --dest $(KIT)

# Here: the dry run with the lent image's versions where a CPU can have them (a venv with PyPI's torch 2.11.0, which
# brings its CUDA libraries, about 5 GB, run on the CPU; transformers 5.17.0 and the image's other versions), the kit
# installed by gpu_kit as on the GPU machine (docs/testing.md's rehearsal).
IMAGE_VENV ?= runs/venv-image
.PHONY: gpu-rehearsal
gpu-rehearsal: gpu-kit
	$(PY) -m venv $(IMAGE_VENV)
	$(IMAGE_VENV)/bin/pip install -q torch==2.11.0 transformers==5.17.0 huggingface_hub==1.33.0 safetensors==0.8.0 \
		accelerate==1.15.0 scipy pillow matplotlib tqdm pyyaml psutil requests regex packaging filelock
	$(IMAGE_VENV)/bin/python -m solrl.gpu_kit check --kit $(KIT) --target $(IMAGE_VENV)/kit -- --dry-run \
		--out $(OUT)-rehearsal

# There (the image's python3, $(KIT) carried): install the kit, then `make gpu-check`'s run.
gpu-check-kit:
	python3 -m solrl.gpu_kit check --kit $(KIT) -- --out $(OUT) --budget-s $(BUDGET) $(if $(DRY_RUN),--dry-run)
