#!/usr/bin/env bash
# Build the separate SGLang test venv (default <repo>/.venv-sglang; arg 1 overrides) for tests/test_sglang.py.
# The main venv stays lean: sglang 0.5.23 pins torch==2.14.1 and CUDA kernels, so it goes in with --no-deps,
# after the CPU torch and under a torch==2.13.0 constraint so nothing can pull a CUDA torch.
# Workarounds (shared/notes/sglang.md) live in tests/sglang_support/path, put on PYTHONPATH by the tests.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
VENV="${1:-$HERE/../../.venv-sglang}"
PYTHON="${PYTHON:-python3}"
STAMP="$VENV/.sglang_installed"
# one build at a time (`make test` starts one in the background; a test that needs the venv waits for it)
exec 9>"$VENV.lock"
flock 9
if [ -f "$STAMP" ] && [ "$STAMP" -nt "$HERE/requirements.txt" ]; then exit 0; fi
start=$(date +%s)
# it replaces only a virtual environment (an earlier build): never a directory of anything else
if [ -e "$VENV" ] && [ ! -f "$VENV/pyvenv.cfg" ]; then
  echo "build_env.sh: $VENV exists and is not a virtual environment; give another path (argument 1)" >&2
  exit 2
fi
rm -rf "$VENV"
"$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
"$VENV/bin/pip" install -q "torch==2.13.0"
"$VENV/bin/pip" install -q --no-deps "sglang==0.5.23"
"$VENV/bin/pip" install -q -r "$HERE/requirements.txt" -c "$HERE/constraints.txt"
"$VENV/bin/python" -c "import torch; assert torch.__version__.startswith('2.13.0') and torch.version.cuda is None, torch.__version__"
touch "$STAMP"
echo "sglang venv built in $(( $(date +%s) - start )) s: $VENV"
