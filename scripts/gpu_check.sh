#!/usr/bin/env bash
# One prepared check of quantgate's GPU path, for a bare machine with an NVIDIA GPU, torch and transformers, no
# network, vLLM optional. It prints a table of figures in under 8 minutes (a hard timeout stops it otherwise).
#
#   scripts/gpu_check.sh --prepare [DIR]   here, with PyPI: llmcompressor, compressed-tensors and their small
#                                          dependencies as wheels (pins from requirements/pipeline.lock) plus the demo
#                                          tokenizer into DIR (default .gpu-wheels, git-ignored, about 40 MB)
#   scripts/gpu_check.sh [DIR]             on the GPU machine: a venv over the system's packages
#                                          (--system-site-packages: torch comes from the system), the wheels the
#                                          system lacks installed into it offline, then `scripts/gpu_check.py run`:
#                                          a random model of the demo's shape, quantized to fp8-dynamic and
#                                          w4a16-gptq on the GPU, the parity reference on the GPU in the served
#                                          dtype, and where vLLM imports: baseline and candidate served, 50 eval
#                                          samples each
#
# Environment: QUANTGATE_GPU_PYTHON (the interpreter with torch; default python3), QUANTGATE_SERVE_PYTHON (one with
# vLLM; default: that same interpreter when it imports vllm), GPU_CHECK_TIMEOUT (seconds, default 470),
# GPU_CHECK_OUT (work folder, default a new temporary one), GPU_CHECK_LAYERS (fewer layers than the demo's 30).
# Exit: 0 done; 2 no NVIDIA GPU; 3 missing libraries; 124 ran past the timeout; 1 a step failed.
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
say() { printf '[gpu_check] %s\n' "$*" >&2; }
die() { local code=$1; shift; printf '[gpu_check] error: %s\n' "$*" >&2; exit "$code"; }

if [ "${1:-}" = "--prepare" ]; then
  dir=${2:-$repo/.gpu-wheels}
  py=$repo/.venv/bin/python; [ -x "$py" ] || py=python3
  exec "$py" "$repo/scripts/gpu_check.py" prepare "$dir"
fi
case "${1:-}" in -h|--help) sed -n '2,21p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;; -*) die 2 "unknown option $1 (see --help)" ;; esac

wheels=${1:-$repo/.gpu-wheels}
py=${QUANTGATE_GPU_PYTHON:-python3}
limit=${GPU_CHECK_TIMEOUT:-470}
start=$SECONDS

# refuse before anything else when no GPU is there
command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 \
  || die 2 "no NVIDIA GPU visible (nvidia-smi is missing or lists no GPU); this check needs one"
command -v "$py" >/dev/null 2>&1 || die 3 "no interpreter '$py': set QUANTGATE_GPU_PYTHON to the Python that has torch"
"$py" -c 'import torch, transformers' 2>/dev/null || die 3 "$py cannot import torch and transformers: install them, or set QUANTGATE_GPU_PYTHON"
"$py" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' \
  || die 2 "no NVIDIA GPU visible to torch ($("$py" -c 'import torch; print(torch.__version__, "CUDA", torch.version.cuda)'), CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES-unset})"
[ -d "$wheels" ] && ls "$wheels"/*.whl >/dev/null 2>&1 || die 3 "no wheels in $wheels: run 'scripts/gpu_check.sh --prepare $wheels' where PyPI is reachable and bring the folder"

out=${GPU_CHECK_OUT:-$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")}
mkdir -p "$out"
say "work folder $out; $(nvidia-smi -L | head -n 1)"
"$py" -m venv --system-site-packages "$out/venv" || die 3 "could not make a venv with $py (python3-venv missing?)"
# where $py is itself a venv's interpreter, --system-site-packages would see its base Python, not its torch: a .pth
# file adds $py's own site folders after the new venv's (whose wheels therefore win)
site=$("$out/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
"$py" -c 'import sysconfig; p = sysconfig.get_paths(); print(p["purelib"]); print(p["platlib"])' > "$site/zz-gpu-check-system.pth"
"$out/venv/bin/python" "$repo/scripts/gpu_check.py" install "$wheels" || die 3 "installing the wheels from $wheels failed (see above)"

serve=${QUANTGATE_SERVE_PYTHON:-}
if [ -z "$serve" ] && "$py" -c 'import vllm' >/dev/null 2>&1; then serve=$(command -v "$py"); fi
serve_args=(); [ -n "$serve" ] && serve_args=(--serve-python "$serve")
[ -n "$serve" ] && say "vLLM: $serve" || say "vLLM not installed: no serving and no eval"
layers=(); [ -n "${GPU_CHECK_LAYERS:-}" ] && layers=(--layers "$GPU_CHECK_LAYERS")

left=$((limit - (SECONDS - start)))
[ "$left" -gt 60 ] || die 124 "only $left s left of $limit s after set-up"
set +e
QUANTGATE_HOME="$out/home" PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}" \
  timeout --kill-after=15 "$left" "$out/venv/bin/python" "$repo/scripts/gpu_check.py" run "$out/run" \
  --wheels "$wheels" "${serve_args[@]}" "${layers[@]}"
rc=$?
set -e
[ $rc -eq 124 ] || [ $rc -eq 137 ] && die 124 "ran past ${limit} s and was stopped; figures so far: $out/run/figures.json"
[ $rc -eq 0 ] && say "done in $((SECONDS - start)) s; figures: $out/run/figures.json"
exit $rc
