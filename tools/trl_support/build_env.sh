#!/usr/bin/env bash
# Build the separate TRL venv (default <repo>/.venv-trl; arg 1 overrides) for tools/trl_support/trl_grpo.py,
# the TRL side of tools/bench_vs_trl.py. TRL is never a dependency of the product: it lives only here.
# The CPU torch goes in first, and everything after it under constraints.txt (torch==2.13.0), so no
# dependency can pull a CUDA torch.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
VENV="${1:-$HERE/../../.venv-trl}"
PYTHON="${PYTHON:-python3}"
STAMP="$VENV/.trl_installed"
# one build at a time; a second caller waits for the first, then sees the stamp
exec 9>"$VENV.lock"
flock 9
if [ -f "$STAMP" ] && [ "$STAMP" -nt "$HERE/requirements.txt" ] && [ "$STAMP" -nt "$HERE/constraints.txt" ]; then
  exit 0
fi
start=$(date +%s)
# it replaces only a virtual environment (an earlier build): never a directory of anything else
if [ -e "$VENV" ] && [ ! -f "$VENV/pyvenv.cfg" ]; then
  echo "build_env.sh: $VENV exists and is not a virtual environment; give another path (argument 1)" >&2
  exit 2
fi
rm -rf "$VENV"
"$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
"$VENV/bin/pip" install -q "torch==2.13.0" -c "$HERE/constraints.txt"
"$VENV/bin/pip" install -q -r "$HERE/requirements.txt" -c "$HERE/constraints.txt"
"$VENV/bin/python" -c "import torch; assert torch.__version__.startswith('2.13.0') and torch.version.cuda is None, torch.__version__"
"$VENV/bin/python" -c "import trl, transformers, torch; print('trl', trl.__version__, 'transformers', transformers.__version__, 'torch', torch.__version__)"
touch "$STAMP"
echo "trl venv built in $(( $(date +%s) - start )) s: $VENV"
