"""The trainer scenarios' shared configuration, free of side effects: importing it registers no test extension
(tests/workers/train_hooks.py registers test producers and engines into the package's registries, which a test in
the pytest process must not see: `known: async, sync` is what a user's refusal lists)."""
import json
import os

from rlpo_mega.config import load_config

BASE = (
    "train_iters=2", "prompts.prompts_per_step=4", "prompts.n_samples=4", "reward.function=test_parity",
    "rollout.max_new_tokens=6", "logging.progress_bar=false", "logging.console_every=0",
    "trainer.eval_every=0", "trainer.warmup.steps=0", "checkpoint.save_dir=null", "parallel.expert=2",
    "trainer.mini_batches=2", "rollout.temperature=1.0", "algorithm.temperature=1.0",
    # no curves.png at the end of each run (~2-4 s of matplotlib on rank 0 a run; the CLI runs of test_trainer.py
    # draw it, tests/test_logging.py checks it)
    "logging.plot=false",
)


def cfg(out, run, *extra):
    return load_config("configs/demo_cpu.yaml", BASE + (f"logging.dir={os.path.join(out, run)}",
                                                         f"logging.run_name={run}") + tuple(extra))


def history(out, run):
    with open(os.path.join(out, run, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


COLOCATE = ("train_iters=3", "model.params_dtype=bfloat16", "optim.use_distributed_optimizer=true",
            "optim.cpu_offload=true", "optim.precision_aware=true", "algorithm.kl.coef=0.01",
            "trainer.eval_every=1", "trainer.eval_path=configs/data/toy_add_test.jsonl", "trainer.eval_size=8",
            "checkpoint.save_every=1", "checkpoint.keep_last=1")
