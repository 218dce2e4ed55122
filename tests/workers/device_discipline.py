"""Real trainer runs under DeviceTracker (tests/workers/device_tracker.py), 2 processes, one launch.

Each run builds the Trainer inside the tracker (platform.device() is the emulated accelerator from the
start), runs the supervised warm-up (training/step.py's train step and loss reduction) and 2 RL steps
through Trainer.run: rollout, plan and exchange, micro-batches, routes, old/reference log-probs, policy
steps, every metric reduction, weight sync. argv: out_dir. Rank 0 reports every rank's violations.
"""
import os
import sys

import torch.distributed as dist

import tests.workers.train_hooks  # noqa: F401  (registers the test_parity reward)
from rlpo_mega import distributed
from rlpo_mega.config import load_config
from rlpo_mega.training.trainer import Trainer
from tests.dist import write_report
from tests.workers.device_tracker import DeviceTracker

BASE = (
    "train_iters=2", "prompts.prompts_per_step=4", "prompts.n_samples=4", "reward.function=test_parity",
    "rollout.max_new_tokens=6", "logging.progress_bar=false", "logging.console_every=0", "logging.wandb=false",
    "logging.plot=false", "trainer.eval_every=0", "trainer.warmup.steps=0", "trainer.warmup.batch_size=4",
    "checkpoint.save_dir=null", "rollout.temperature=1.0", "algorithm.temperature=1.0",
)

RUNS = {
    # DP2 x EP2: reference-model pass (KL), R3 routes, TIS on the rollout log-probs, Dr. GRPO's constant
    # normaliser (its count is made by the loss, not the batch), 2 mini-batches x 2 micro-batches
    "ep2_grpo_kl_r3": ("parallel.expert=2", "algorithm.loss.name=grpo", "algorithm.kl.coef=0.04",
                       "routing.mode=r3", "algorithm.mismatch.mode=tis", "trainer.mini_batches=2",
                       "parallel.num_micro_batches=2", "algorithm.loss.aggregation=seq-mean-token-sum-norm",
                       "algorithm.loss.norm_length=6"),
    # PP2: the last stage's reductions broadcast to the first; R2 records routes in the old pass
    "pp2_gspo_r2": ("parallel.pipeline=2", "parallel.expert=1", "algorithm.loss.name=gspo", "routing.mode=r2",
                    "parallel.num_micro_batches=2"),
    # PPO with a critic at PP2: its value pass, GAE (KL folded into the rewards from the reference pass), the
    # batch-wide whitening and its statistics (reduced on the last stage, broadcast), R2 in both models
    "pp2_ppo_gae_r2": ("parallel.pipeline=2", "parallel.expert=1", "algorithm.loss.name=ppo_clip",
                       "algorithm.advantage.name=gae", "algorithm.kl.coef=0.04", "algorithm.kl.in_reward=true",
                       "routing.mode=r2", "parallel.num_micro_batches=2", "trainer.mini_batches=2"),
}


def run(out, name, overrides):
    cfg = load_config("configs/demo_cpu.yaml", BASE + overrides + (f"logging.dir={os.path.join(out, name)}",
                                                                   f"logging.run_name={name}"))
    history = []
    with DeviceTracker() as tracker:
        t = Trainer(cfg)
        ok = False
        try:
            tracker.watch(t.policy.chunks + (t.policy.ref_chunks or []) + (t.critic.chunks if t.critic else []))
            t.cfg.trainer.warmup.steps = 2  # run's warm-up phase, with the warm-up file read there
            history = t.run()
            ok = True
        finally:
            t.close(ok)
            distributed.destroy(keep_world=True)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, tracker.violations())
    return {"steps": len(history), "violations": {str(r): v for r, v in enumerate(every) if v}}


def selfcheck():
    """The tracker itself (1 process): what it must flag and what it must let through. Returns the number
    of violations each case recorded."""
    import torch
    from megatron.core.transformer.moe.router_replay import RouterReplay

    from rlpo_mega import platform
    from rlpo_mega.algorithms.mismatch import mismatch_metrics
    from rlpo_mega.training.warmup import _batch as _warmup_batch
    from tests.workers.device_tracker import origin

    distributed.init_process_group()
    cases = {}
    with DeviceTracker() as tr:
        def count(name, fn):
            before = sum(tr.found.values())
            fn()
            cases[name] = sum(tr.found.values()) - before

        dev = platform.device()
        acc = torch.zeros(2, 3, device=dev)
        host, mask = acc.cpu(), torch.ones(2, 3, dtype=torch.bool, device=dev)
        count("mix_in_learner_code", lambda: mismatch_metrics(acc, host, mask))
        count("same_device_in_learner_code", lambda: mismatch_metrics(acc, acc + 1, mask))
        batch = _warmup_batch([([1, 2], [3])], [0], 1, 0)  # a batch the learner builds (on the host)
        cases["learner_batch_is_host"] = int(origin(batch.tokens) is not None)
        moved = batch.to(dev).tensors()
        cases["moved_batch_is_device"] = int(all(origin(t) is None for t in moved.values()))
        lin = torch.nn.Linear(3, 3).to(dev)
        tr.watch([lin])
        count("model_input_host", lambda: lin(host))
        count("model_input_device", lambda: lin(acc))
        count("collective_host", lambda: dist.all_reduce(host))
        count("collective_device", lambda: dist.all_reduce(acc))
        gloo = dist.new_group(backend="gloo")
        count("collective_host_on_gloo", lambda: dist.all_reduce(host, group=gloo))
        replay = RouterReplay()
        count("router_host", lambda: replay.set_target_indices(host.long()))
        RouterReplay.global_router_replay_instances.remove(replay)
    return cases


if __name__ == "__main__":
    out = sys.argv[1]
    only = sys.argv[2:] or list(RUNS)
    if only == ["selfcheck"]:
        result = selfcheck()
    else:
        result = {name: run(out, name, RUNS[name]) for name in only}
    if dist.get_rank() == 0:
        write_report(result)
