#!/usr/bin/env bash
# Build the separate SGLang test venv (default <repo>/.venv-sglang; arg 1 overrides) for tests/test_sglang.py.
# The main venv stays lean: sglang 0.5.23 pins torch==2.14.1 and CUDA kernels, so it goes in with --no-deps,
# after the CPU torch and under a torch==2.13.0 constraint so nothing can pull a CUDA torch.
# Workarounds (shared/notes/sglang.md) live in tests/sglang_support/path, put on PYTHONPATH by the tests.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
VENV="${1:-$HERE/../../.venv-sglang}"
PYTHON="${PYTHON:-python3}"
# shared: a fresh venv with the CPU torch first, and the check that it stayed the CPU build
source "$HERE/../../tools/cpu_venv.sh"
STAMP="$VENV/.sglang_installed"
# one build at a time (`make test` starts one in the background; a test that needs the venv waits for it)
exec 9>"$VENV.lock"
flock 9
if [ -f "$STAMP" ] && [ "$STAMP" -nt "$HERE/requirements.txt" ]; then exit 0; fi
start=$(date +%s)
fresh_cpu_venv "$VENV" "$PYTHON" "$STAMP"
"$VENV/bin/pip" install -q --no-deps "sglang==0.5.23"
"$VENV/bin/pip" install -q -r "$HERE/requirements.txt" -c "$HERE/constraints.txt"
check_cpu_torch "$VENV"
touch "$STAMP"
echo "sglang venv built in $(( $(date +%s) - start )) s: $VENV"
