#!/usr/bin/env bash
# Regenerate requirements/*.lock from requirements/*.in by resolving each in a scratch venv and freezing it.
#   scripts/lock.sh pipeline|serve-cpu|lmeval|mlflow|s3|docs
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
name=${1:?usage: scripts/lock.sh pipeline|serve-cpu|lmeval}
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
python3 -m venv "$tmp/env"
"$tmp/env/bin/python" -m pip install --quiet --upgrade pip==25.3
"$tmp/env/bin/python" -m pip install -r "$repo/requirements/$name.in"
head -n 3 "$repo/requirements/$name.lock" | grep '^#' > "$tmp/head" || true
{ cat "$tmp/head"; "$tmp/env/bin/python" -m pip freeze --all | grep -v "^pip==" | grep -vE '^(-e |torchvision==|torchaudio==|torchcodec==)'; } > "$repo/requirements/$name.lock"
echo "wrote requirements/$name.lock"
