# `make demo` and `make test` create the virtual environment on a fresh machine, then run.
PYTHON ?= python3
VENV ?= .venv
# CPU wheel on this machine; installed before the package so no dependency can pull a CUDA build.
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.rlpo_installed
# The python tool's sandbox uses bubblewrap >= 0.7 where installed, else makes the same namespaces itself
# (rlpo_mega/environments/sandbox.py); tests/test_sandbox.py runs both, so the venv's set-up installs bubblewrap
# where it can (root with apt-get or dnf: Debian 12 has 0.8, Ubuntu 24.04 0.9), quietly, never failing the build.
APT_BWRAP = DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends bubblewrap >/dev/null 2>&1
INSTALL_BWRAP = command -v bwrap >/dev/null || { [ "$$(id -u)" = 0 ] && \
	{ { command -v apt-get >/dev/null && { $(APT_BWRAP) || { apt-get update -q >/dev/null 2>&1 && $(APT_BWRAP); }; }; } || \
	  { command -v dnf >/dev/null && dnf install -y -q bubblewrap >/dev/null 2>&1; }; }; } || \
	echo "bubblewrap not installed: the python tool makes its sandbox's namespaces itself; tests/test_sandbox.py needs it (apt-get install bubblewrap)"

.PHONY: venv venv-sglang sandbox-deps demo demo-ppo demo-tools demo-lora test gpu-smoke clean

$(STAMP): setup.py
	@$(INSTALL_BWRAP)
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q "$(TORCH_SPEC)"
	$(VENV)/bin/pip install -q -e ".[test]"
	touch $(STAMP)

venv: $(STAMP)

# bubblewrap for a venv made before it was part of the set-up
sandbox-deps:
	@$(INSTALL_BWRAP)

demo: $(STAMP)
	$(VENV)/bin/rlpo-mega train configs/demo_cpu.yaml --nproc-per-node 2

# PPO with a critic (GAE, value model) on the same task
demo-ppo: $(STAMP)
	$(VENV)/bin/rlpo-mega train configs/demo_ppo_cpu.yaml --nproc-per-node 2

# Multi-turn episodes with a tool (environment "lookup"): RL teaches the model to call the tool and use its answer
demo-tools: $(STAMP)
	$(VENV)/bin/rlpo-mega train configs/demo_tools_cpu.yaml --nproc-per-node 2

# LoRA (configs/demo_lora_cpu.yaml): the demo's warm-up alone makes the base (the whole model, exported to HF), then
# rank-16 adapters learn the task on it, the base frozen
demo-lora: $(STAMP)
	$(VENV)/bin/rlpo-mega train configs/demo_cpu.yaml --nproc-per-node 2 train_iters=0 trainer.eval_every=0 \
		logging.run_name=demo_lora_base logging.dir=runs/demo_lora/base_log checkpoint.save_dir=runs/demo_lora/base \
		checkpoint.save_every=0 checkpoint.export_hf=true
	$(VENV)/bin/rlpo-mega train configs/demo_lora_cpu.yaml --nproc-per-node 2

# Separate venv for the real-SGLang tests (tests/test_sglang.py): sglang 0.5.23 --no-deps on the CPU torch.
venv-sglang:
	PYTHON=$(PYTHON) bash tests/sglang_support/build_env.sh

# The SGLang env builds in the background while the suite starts (its first user, tests/test_recipes.py, comes
# late; build_env.sh holds a lock, so a test that needs it first waits for it). A failed build does not stop
# the suite: tests/test_sglang.py retries it, then skips naming why. Its output: .venv-sglang.build.log.
# Two pytest workers, a test file per worker at a time, the longest files first (tests/conftest.py): a launch
# leaves part of the 2 cores idle while it waits on sockets and servers, which the other worker fills (measured:
# pytest 4262 s against 4760 s in one process). TEST_WORKERS=0: one process, as before. Most of a launch's CPU
# was imports: tests/dist.py forks the ranks from a launcher that imported them once (tests/warm_launch.py;
# pytest 2947 s, 787 passed). Files that share launches (tests/layout_runs.py, distopt_launch) run on one worker
# (tests/conftest.py, SHARED_LAUNCHES; pytest 2424 s, 808 passed).
# The repository's own modules are compiled once first: where PYTHONDONTWRITEBYTECODE is set (CI's machines set it),
# every process the suite starts (CLI launches, their ranks, servers) would compile them from source again.
TEST_WORKERS ?= 2
test: $(STAMP)
	$(VENV)/bin/python -m compileall -q rlpo_mega moe launch tests tools > /dev/null
	PYTHON=$(PYTHON) bash tests/sglang_support/build_env.sh > .venv-sglang.build.log 2>&1 & \
	$(VENV)/bin/python -m pytest tests -q -p no:cacheprovider --durations=40 -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder; rc=$$?; wait; \
	tail -n 1 .venv-sglang.build.log; exit $$rc

# One GPU, the checklist of what a CPU cannot settle, as one table (tools/gpu_checklist.py, ~10 minutes): the real
# trainer path (tools/gpu_smoke.py: CUDA, NCCL, bf16 + distributed optimizer, GSPO + R3, embedded engine on the GPU,
# digest-checked sync, checkpoint + resume), set_device before anything touches CUDA, the first colocated offload's
# pinned allocation, each phase's CUDA peak against `rlpo-mega plan` at a model filling most of the GPU, the
# learner's MFU. Runs in the current environment (a CUDA torch and `pip install -e .`), never in the CPU .venv.
gpu-smoke:
	$(PYTHON) tools/gpu_checklist.py

clean:
	rm -rf $(VENV) .venv-sglang *.egg-info
