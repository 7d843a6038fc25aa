#!/usr/bin/env bash
# Builds the hpsv3 reward's own environment (docs/rewards.md, "HPSv3"): a venv with hpsv3 1.0.0 and its
# transformers 4.45.2 beside solrl (installed --no-deps) and its reward service. Idempotent (a stamp newer than
# requirements.txt skips the work). Then, e.g.:
#   SOLRL_HPSV3_CHECKPOINT=/weights/HPSv3.safetensors HF_HUB_OFFLINE=1 .venv/hpsv3/bin/solrl serve reward --rewards hpsv3
# Environment: PY (the python to build from; python3), HPSV3_VENV (.venv/hpsv3: beside solrl's own environment,
# inside the directory git and the Docker build context already ignore).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-python3}
VENV=${HPSV3_VENV:-.venv/hpsv3}
STAMP=$VENV/.installed
if [ -f "$STAMP" ] && [ "$STAMP" -nt envs/hpsv3/requirements.txt ] && [ "$STAMP" -nt envs/hpsv3/install.sh ]; then
  echo "envs/hpsv3: $VENV is up to date"; exit 0
fi
"$PY" -m venv "$VENV"
B=$VENV/bin
"$B/pip" install -q --upgrade pip
# torch first and pinned, as the Makefile does (the CPU wheel here; a CUDA image brings its own), then the
# torchvision of that torch (hpsv3 imports it; its scoring path resizes PIL images with PIL)
"$B/pip" install -q torch==2.13.0
"$B/pip" install -q torchvision==0.28.0
"$B/pip" install -q -r envs/hpsv3/requirements.txt
"$B/pip" install -q --no-deps hpsv3==1.0.0
"$B/pip" install -q --no-deps -e .
# PyPI's torchvision 0.28.0 is a CUDA build: beside a CPU torch its C++ operators do not load and its module
# of meta kernels for them fails at import. hpsv3 only imports torchvision (no operator of it runs when scoring
# PIL images), so on a CPU torch that module is skipped; with a CUDA torch nothing is changed.
if ! "$B/python" -c "import torchvision" >/dev/null 2>&1 \
   && "$B/python" -c "import sys, torch; sys.exit(torch.version.cuda is not None)"; then
  site=$("$B/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  echo "import sys, types; sys.modules.setdefault('torchvision._meta_registrations', types.ModuleType('torchvision._meta_registrations'))" \
    > "$site/solrl_torchvision_cpu.pth"
fi
[ -d solrl/pb ] || "$B/python" -m solrl.protos_build
if ! out=$(OMP_NUM_THREADS=1 "$B/python" -c "from hpsv3 import HPSv3RewardInferencer; import services.reward.server" 2>&1); then
  echo "envs/hpsv3: the environment does not import hpsv3 and the reward service:" >&2; echo "$out" >&2; exit 1
fi
touch "$STAMP"
echo "envs/hpsv3: built $VENV (hpsv3 1.0.0, transformers 4.45.2)"
