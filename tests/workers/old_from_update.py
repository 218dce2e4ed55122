"""The skipped old-log-prob pass equals the separate one: identical losses, metrics and gradients.

Every rank makes the same synthetic rollout (tests/workers/packed_parity.rollout: long-tailed lengths,
random routes the live router would not choose, rollout log-probs that differ from the policy's), then runs
the trainer's data path twice on the same weights: (a) the old-log-prob pass (forward-only, eval mode) then
the update with those old log-probs; (b) no old pass, the update taking its own detached log-probs
(policy_step.old_pass_needed: one optimizer step per rollout batch). Both with routing r3 (replayed rollout
routes) and off (live routing), GSPO with a TIS mismatch correction (the mismatch metrics come from the
update's forward in (b)). Reported: the largest absolute difference of every gradient, of every float metric,
and the routing agreement of each path.
argv: config overrides (the layout).
"""
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from moe.model import load_hf_config  # noqa: E402
from moe.routing.replay import RoutingReplay  # noqa: E402
from moe.routing.trace import TraceSpec  # noqa: E402
from moe.routing.transport import gather_recipients  # noqa: E402
from rlpo_mega import distributed  # noqa: E402
from rlpo_mega.config import load_config  # noqa: E402
from tools.batch_support import prepare_step  # noqa: E402
from rlpo_mega.rollout.gather import gather_scalars  # noqa: E402
from rlpo_mega.model_setup import build_policy, unwrap  # noqa: E402
from rlpo_mega.training.old_logprobs import attach_old_logprobs, old_pass_needed  # noqa: E402
from rlpo_mega.training.update import policy_step  # noqa: E402
from rlpo_mega.rollout import Sample as Scored  # noqa: E402
from rlpo_mega.rollout.producers import share  # noqa: E402
from tests.dist import write_report  # noqa: E402
from tests.workers.packed_parity import N, rollout  # noqa: E402

MODEL = "configs/models/tiny_qwen3_moe.json"


def one_path(chunks, opt, cfg, routing, samples, recipients, spec, layout, skip):
    gids = torch.arange(N) // 4
    minis, _, _ = prepare_step(samples, gids, cfg, layout.data, layout.tensor, recipients, spec, 0)
    micro = attach_old_logprobs(chunks, [mb.to() for mb in minis[0]], cfg.algorithm, routing=routing,
                                old_pass=not skip)
    report = policy_step(chunks, opt, micro, cfg.algorithm, step_optimizer=False, routing=routing,
                         old_from_update=skip)
    grads = {n: p.main_grad.detach().clone() for n, p in unwrap(chunks[0]).named_parameters()}
    return report, grads


def run(mode, overrides):
    hf = load_hf_config(MODEL)
    cfg = load_config(None, overrides + (f"model.hf_config={MODEL}", "algorithm.loss.name=gspo",
                                         f"routing.mode={mode}", "algorithm.mismatch.mode=tis"))
    assert old_pass_needed(cfg, hf) is None
    layout = distributed.init(cfg.parallel, hf, cfg.seed)
    spec = TraceSpec.from_hf(hf)
    chunks, opt = build_policy(hf, layout, cfg.model, cfg.optim, routing_replay=True)
    routing = RoutingReplay(chunks, spec, mode=mode)
    recipients = gather_recipients(chunks, spec)
    everything = rollout(hf, spec)
    res = {}
    for skip in (False, True):
        mine = share(everything, list(range(dist.get_world_size())))
        samples = gather_scalars([Scored(**vars(s)) for s in mine], spec, "error", None)
        res[skip] = one_path(chunks, opt, cfg, routing, samples, recipients, spec, layout, skip)
    (rep_a, g_a), (rep_b, g_b) = res[False], res[True]
    grad_diff = max(float((g_a[n] - g_b[n]).abs().max()) for n in g_a)
    zero = sum(int(g.norm() == 0) for g in g_a.values())
    t = torch.tensor([grad_diff, float(zero)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    keys = sorted(k for k, v in rep_a.items() if isinstance(v, float) and not k.startswith("routing/"))
    out = {"grad_abs_diff": float(t[0]), "zero_grads": int(t[1]),
           "metrics": {k: [rep_a[k], rep_b.get(k)] for k in keys},
           "agreement": [rep_a.get("routing/old/agreement"), rep_b.get("routing/update/agreement")]}
    routing.close()
    del chunks, opt
    distributed.destroy(keep_world=True)
    return out


def main():
    overrides = tuple(sys.argv[1:])
    report = {mode: run(mode, overrides) for mode in ("r3", "off")}
    if dist.get_rank() == 0:
        write_report(report)
    distributed.destroy()


if __name__ == "__main__":
    main()
