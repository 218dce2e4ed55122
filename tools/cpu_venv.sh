# Sourced by the build scripts of the side venvs (tests/sglang_support/build_env.sh: real SGLang for the tests;
# tools/trl_support/build_env.sh: TRL for tools/bench_vs_trl.py). Neither is a dependency of the product.

# fresh_cpu_venv VENV PYTHON STAMP: a new virtual environment at VENV holding the CPU torch==2.13.0, installed
# first so that nothing installed after it (under a torch==2.13.0 constraint) can pull a CUDA torch. It replaces
# only what one of these scripts built (its marker, or its STAMP from before the marker existed): never another
# directory, nor a virtual environment of the user's (say the product's .venv given as argument 1).
fresh_cpu_venv() {
  local venv="$1" python="$2" stamp="$3"
  if [ -e "$venv" ] && [ ! -f "$venv/.rlpo_side_venv" ] && [ ! -f "$stamp" ]; then
    echo "build_env.sh: $venv exists and was not built by this script; give another path (argument 1)" >&2
    exit 2
  fi
  rm -rf "$venv"
  "$python" -m venv "$venv"
  touch "$venv/.rlpo_side_venv"  # at once: a build that fails later can still be replaced by the next one
  "$venv/bin/pip" install -q --upgrade pip
  "$venv/bin/pip" install -q "torch==2.13.0"
}

# check_cpu_torch VENV: the venv's torch is still the CPU 2.13.0 build.
check_cpu_torch() {
  "$1/bin/python" -c "import torch; assert torch.__version__.startswith('2.13.0') and torch.version.cuda is None, torch.__version__"
}
