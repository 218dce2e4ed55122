# Sourced by the build scripts of the side venvs (tests/sglang_support/build_env.sh: real SGLang for the tests;
# tools/trl_support/build_env.sh: TRL for tools/bench_vs_trl.py). Neither is a dependency of the product.

# fresh_cpu_venv VENV PYTHON: a new virtual environment at VENV holding the CPU torch==2.13.0, installed first so
# that nothing installed after it (under a torch==2.13.0 constraint) can pull a CUDA torch. It replaces only a
# virtual environment (an earlier build), never a directory of anything else.
fresh_cpu_venv() {
  local venv="$1" python="$2"
  if [ -e "$venv" ] && [ ! -f "$venv/pyvenv.cfg" ]; then
    echo "build_env.sh: $venv exists and is not a virtual environment; give another path (argument 1)" >&2
    exit 2
  fi
  rm -rf "$venv"
  "$python" -m venv "$venv"
  "$venv/bin/pip" install -q --upgrade pip
  "$venv/bin/pip" install -q "torch==2.13.0"
}

# check_cpu_torch VENV: the venv's torch is still the CPU 2.13.0 build.
check_cpu_torch() {
  "$1/bin/python" -c "import torch; assert torch.__version__.startswith('2.13.0') and torch.version.cuda is None, torch.__version__"
}
