#!/usr/bin/env bash
# The server's (and its GPU test's) Python dependencies for a GPU host that cannot reach a package
# index. The H200 image (Python 3.12, torch+cu130) already holds torch, numpy, safetensors, tokenizers,
# jinja2/markupsafe and tqdm, in versions onegraph accepts; it lacks fastapi, starlette, pydantic, uvicorn
# and openai (and may hold older anyio/idna/typing-extensions than they need), so those travel as wheels; so
# does flash-linear-attention, the GDN kernels' GPU oracle.
#
#   scripts/gpu_wheels.sh fetch [DIR]          on a machine with network: cp312 manylinux wheels into DIR (.whl)
#   scripts/gpu_wheels.sh install DIR SITE     on the GPU host: unpack them into SITE, check the imports;
#                                            then `export PYTHONPATH=SITE` (SITE shadows the image's copies)
#
# The pins are one mutually consistent set (the CPU test environment's); bump them together. --no-deps
# everywhere: the set is the closure itself, and pip must not resolve against the image's torch stack.
set -euo pipefail

WHEELS=(
  # server: HTTP app, request models, ASGI server, metrics
  fastapi==0.165.0 starlette==1.10.0 annotated-doc==0.0.7 opentelemetry-api==1.45.2
  pydantic==2.13.4 pydantic-core==2.46.4 typing-inspection==0.4.2 annotated-types==0.7.0
  uvicorn==0.54.0 click==8.5.1 h11==0.16.0 prometheus-client==0.26.0
  anyio==4.16.0 idna==3.20 typing-extensions==4.16.0
  # tests: the official openai client (over httpx2) and raw httpx
  openai==3.57.0 jiter==0.19.0 sniffio==1.3.1 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5
  httpx==0.28.1 httpcore==1.0.9 certifi==2026.5.20
  # the GDN oracle (tests/test_fla_oracle.py, scripts/bench_gdn_prefill.py): flash-linear-attention's kernels
  fla-core==0.6.0 einops==0.8.2
)
PY=${PYTHON:-python3}

case "${1:-}" in
  fetch)
    dir=${2:-.whl}
    # pip matches manylinux_2_N exactly: list the tags the compiled wheels (pydantic-core, jiter) use
    "$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      -d "$dir" "${WHEELS[@]}"
    ls "$dir"/*.whl | wc -l
    du -ch "$dir"/*.whl | tail -1
    ;;
  install)
    dir=${2:?usage: $0 install DIR SITE}
    site=${3:?usage: $0 install DIR SITE}
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "$dir"/*.whl
    PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" "$PY" -c \
      "import fastapi, uvicorn, pydantic, openai, httpx, prometheus_client, tokenizers, jinja2; print('server deps ok:', fastapi.__version__, pydantic.__version__, openai.__version__)"
    ;;
  *)
    echo "usage: $0 fetch [DIR] | install DIR SITE" >&2
    exit 2
    ;;
esac
