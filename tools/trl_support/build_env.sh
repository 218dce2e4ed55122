#!/usr/bin/env bash
# Build the separate TRL venv (default <repo>/.venv-trl; arg 1 overrides) for tools/trl_support/trl_grpo.py,
# the TRL side of tools/bench_vs_trl.py. TRL is never a dependency of the product: it lives only here.
# The CPU torch goes in first, and everything after it under constraints.txt (torch==2.13.0), so no
# dependency can pull a CUDA torch.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
VENV="${1:-$HERE/../../.venv-trl}"
PYTHON="${PYTHON:-python3}"
# shared: a fresh venv with the CPU torch first, and the check that it stayed the CPU build
source "$HERE/../cpu_venv.sh"
STAMP="$VENV/.trl_installed"
# one build at a time; a second caller waits for the first, then sees the stamp
exec 9>"$VENV.lock"
flock 9
if [ -f "$STAMP" ] && [ "$STAMP" -nt "$HERE/requirements.txt" ] && [ "$STAMP" -nt "$HERE/constraints.txt" ]; then
  exit 0
fi
start=$(date +%s)
fresh_cpu_venv "$VENV" "$PYTHON" "$STAMP"
"$VENV/bin/pip" install -q -r "$HERE/requirements.txt" -c "$HERE/constraints.txt"
check_cpu_torch "$VENV"
"$VENV/bin/python" -c "import trl, transformers, torch; print('trl', trl.__version__, 'transformers', transformers.__version__, 'torch', torch.__version__)"
touch "$STAMP"
echo "trl venv built in $(( $(date +%s) - start )) s: $VENV"
