#!/usr/bin/env bash
# A virtual environment in which the benches' DeepSpeed contenders run (`deepspeed` is never a dependency
# of infinity): this machine's torch, transformers, accelerate and infinity, plus DeepSpeed 0.19.8.
#
#   bench/deepspeed_venv.sh [DIR]             # default .venv-deepspeed
#   .venv-deepspeed/bin/python bench/inference.py ...   # the deepspeed contender is then importable
#
# DeepSpeed ships a source tarball whose setup imports torch: built without isolation and without its
# dependencies, so that pip can never pull another (multi-GB) torch. Its aio op is built at first use
# (a few minutes, cached under ~/.cache/torch_extensions) and needs libaio's headers.
set -euo pipefail
venv=${1:-.venv-deepspeed}
dpkg -s libaio-dev >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq libaio-dev >/dev/null; }
python3 -m venv --system-site-packages "$venv"
"$venv/bin/pip" install -q --no-build-isolation --no-deps deepspeed==0.19.8
"$venv/bin/pip" install -q einops hjson msgpack ninja numpy packaging psutil py-cpuinfo "pydantic>=2" tqdm
"$venv/bin/python" -c "import deepspeed, torch; print('deepspeed', deepspeed.__version__, 'on torch', torch.__version__)"
