"""Packed vs padded parity at one layout, both families, R3 on: the trainer's data path end to end.

Every rank makes the same synthetic rollout (long-tailed lengths, random valid routes that the live router
would not choose); each rank owns a contiguous share as an engine rank would. For each layout of the
micro-batches (trainer.layout=padded, packed, and packed cut by a token budget), the real path runs: gather_scalars -> prepare_step
(advantages, plan, exchange, micro-batches) -> old log-probs with R3 -> one policy_step (no optimizer
step). Same weights every time. Reported: the largest relative difference of every gradient and of the
loss metrics, the R3 route placement (the attached routes at each sample's positions vs its trace), and
the packing efficiency and bytes of both.
argv: model json=loss pairs (comma-separated; each family runs with its own loss to keep CI short), then
config overrides.
"""
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from moe.model import load_hf_config  # noqa: E402
from moe.routing.trace import TraceSpec  # noqa: E402
from moe.routing.transport import gather_recipients  # noqa: E402
from rlpo_mega import distributed  # noqa: E402
from rlpo_mega.training.old_logprobs import attach_old_logprobs  # noqa: E402
from rlpo_mega.training.update import policy_step  # noqa: E402
from rlpo_mega.config import load_config  # noqa: E402
from tools.batch_support import prepare_step  # noqa: E402
from rlpo_mega.rollout.gather import gather_scalars  # noqa: E402
from rlpo_mega.model_setup import build_policy, unwrap  # noqa: E402
from rlpo_mega.rollout import Sample as Scored  # noqa: E402
from rlpo_mega.rollout.producers import share  # noqa: E402
from tests.dist import write_report  # noqa: E402

N, GROUP = 16, 4
BUDGET = 48  # tokens per packed micro-batch: the longest sample (prompt <= 6 + response <= 40) fits


def rollout(hf, spec):
    g = torch.Generator().manual_seed(11)
    plen = torch.randint(2, 7, (N,), generator=g).tolist()
    rlen = (torch.distributions.LogNormal(2.0, 0.8).sample((N,)).clamp(1, 40).long()).tolist()
    return make_samples(hf, spec, plen, rlen, g)


def make_samples(hf, spec, plen, rlen, g):
    """Samples of these prompt and response lengths: random tokens, valid random routes, log-probs, rewards."""
    out = []
    for i in range(len(plen)):
        p = torch.randint(3, hf.vocab_size, (plen[i],), generator=g).tolist()
        r = torch.randint(3, hf.vocab_size, (rlen[i],), generator=g).tolist()
        span = plen[i] + rlen[i] - 1
        routes = torch.rand(span, spec.num_layers, spec.num_experts, generator=g).argsort(-1)[..., :spec.topk]
        lp = -torch.rand(rlen[i], generator=g)
        reward = float(torch.rand((), generator=g) > 0.5)
        out.append(Scored(p, r, lp, "stop", routes, reward=reward, failed=False, correct=reward >= 1))
    return out


def make_stale(micro, offsets):
    """Subtract `staleness`'s offsets from the micro-batches' old log-probs (last stage), by sample index."""
    for mb in micro:
        if mb.old_logp is not None:
            off = torch.zeros_like(mb.old_logp)
            for k, i in enumerate(mb.samples):
                w = min(off.shape[1], offsets.shape[1])
                off[k, :w] = offsets[i, :w]
            mb.old_logp = mb.old_logp - off


def staleness(loss, samples):
    """A fixed per-(sample, position) offset of the old log-probs: GSPO clips some sequences, SAPO's gates
    move off 1; the same for both layouts (keyed by sample index)."""
    g = torch.Generator().manual_seed(9)
    width = max(len(s.prompt_ids) + len(s.response_ids) - 1 for s in samples)
    if loss == "gspo":
        seq = torch.linspace(-3e-3, 3e-3, N)
        return seq[:, None] + 1e-4 * torch.randn(N, width, generator=g)
    return 0.3 * torch.randn(N, width, generator=g)


def placement_agreement(micro, samples, received, rcpt, tp_rank, sp):
    """Fraction of (sample, position, local layer) whose attached route is the sample's trace row."""
    good = total = 0
    for mb in micro:
        routes = mb.routes.cpu()
        shard = routes.shape[1]
        a = tp_rank * shard if sp else 0
        for k, i in enumerate(mb.samples):
            trace = received[i].routes.long()
            if mb.index is not None:
                positions = mb.index[k, :samples[i].span].cpu()
                got_rows = [(0, int(p)) for p in positions]
            else:
                got_rows = [(k, j) for j in range(samples[i].span)]
            for j, (row, p) in enumerate(got_rows):
                if a <= p < a + shard:
                    got = routes[row, p - a].long()
                    good += int((got.sort(-1).values == trace[j].sort(-1).values).all(-1).sum())
                    total += got.shape[0]
    return good, total


def run(model_json, losses, overrides):
    hf = load_hf_config(model_json)
    out = {}
    for loss in losses:
        cfg = load_config(None, overrides + (f"model.hf_config={model_json}", f"algorithm.loss.name={loss}",
                                             "routing.mode=r3", "optim.lr=1e-3"))
        layout = distributed.init(cfg.parallel, hf, cfg.seed)
        spec = TraceSpec.from_hf(hf)
        chunks, opt = build_policy(hf, layout, cfg.model, cfg.optim, routing_replay=True)
        from moe.routing.replay import RoutingReplay

        routing = RoutingReplay(chunks, spec, mode="r3")
        recipients = gather_recipients(chunks, spec)
        rcpt = recipients[dist.get_rank()]
        from megatron.core import parallel_state as ps

        tp_rank, sp = ps.get_tensor_model_parallel_rank(), bool(unwrap(chunks[0]).config.sequence_parallel)
        everything = rollout(hf, spec)
        offsets = staleness(loss, everything)
        res = {}
        # budget: packed micro-batches cut by tokens (trainer.max_tokens_per_micro_batch), several per rank
        # and of different lengths (pipeline stages exchange each one's shape)
        for mode, budget in (("padded", None), ("packed", None), ("budget", BUDGET)):
            cfg.trainer.layout = "padded" if mode == "padded" else "packed"
            cfg.trainer.max_tokens_per_micro_batch = budget
            mine = share(everything, list(range(dist.get_world_size())))
            samples = gather_scalars([Scored(**vars(s)) for s in mine], spec, "error", None)
            gids = torch.arange(N) // GROUP
            minis, adv, stats = prepare_step(samples, gids, cfg, layout.data, layout.tensor, recipients, spec, 0)
            # the received payloads, to check the route placement against
            from rlpo_mega.training.exchange import exchange

            received, _ = exchange(samples, _dp_of(cfg, samples, layout), recipients, spec)
            micro = attach_old_logprobs(chunks, [mb.to() for mb in minis[0]], cfg.algorithm, routing=routing)
            good, total = placement_agreement(micro, samples, received, rcpt, tp_rank, sp)
            make_stale(micro, offsets)
            report = policy_step(chunks, opt, micro, cfg.algorithm, step_optimizer=False, routing=routing)
            grads = {n: p.main_grad.detach().clone() for n, p in unwrap(chunks[0]).named_parameters()}
            res[mode] = {"report": report, "grads": grads, "placement": (good, total), "stats": stats}
        g_rel = max(float((res[m]["grads"][n] - a).norm() / a.norm().clamp(min=1e-30))
                    for m in ("packed", "budget") for n, a in res["padded"]["grads"].items())
        zero = sum(int(a.norm() == 0) for a in res["padded"]["grads"].values())
        t = torch.tensor([g_rel, float(zero)], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        counts = torch.tensor([*res["packed"]["placement"], *res["padded"]["placement"], *res["budget"]["placement"]],
                              dtype=torch.float64)
        dist.all_reduce(counts)
        keys = [k for k, v in res["padded"]["report"].items()
                if isinstance(v, float) and not k.startswith("routing/")]
        metrics = {f"{m}:{k}": [res[m]["report"][k], res["padded"]["report"][k]] for k in keys
                   for m in ("packed", "budget")}
        out[loss] = {"grad_rel_max": float(t[0]), "zero_grads": int(t[1]), "metrics": metrics,
                     "policy_loss": res["padded"]["report"]["policy_loss"],
                     "clip_frac": res["padded"]["report"].get("clip_frac_high", 0.0)
                     + res["padded"]["report"].get("clip_frac_low", 0.0),
                     "placement_packed": [counts[0].item(), counts[1].item()],
                     "placement_padded": [counts[2].item(), counts[3].item()],
                     "placement_budget": [counts[4].item(), counts[5].item()],
                     "micro_batches": {m: res[m]["stats"]["data/micro_batches"] for m in res},
                     "efficiency": {m: res[m]["stats"]["data/packing_efficiency"] for m in res},
                     "bytes_over_own_share": res["packed"]["stats"]["data/bytes_over_own_share"]}
        routing.close()
        del chunks, opt
        distributed.destroy(keep_world=True)
    return out


def _dp_of(cfg, samples, layout):
    from rlpo_mega.data.packing import plan_step

    t = cfg.trainer
    return plan_step([s.span for s in samples], t.mini_batches, layout.data, cfg.parallel.num_micro_batches,
                     t.max_tokens_per_micro_batch, t.layout, align=layout.tensor).dp_of()


def main(run_model=run):
    """argv: model json=loss[+loss] pairs, then overrides -> rank 0 reports run_model's result per model (also
    tests/workers/cp_parity.py's entry point)."""
    models, *overrides = sys.argv[1:]
    pairs = [m.split("=") for m in models.split(",")]
    report = {os.path.basename(m): run_model(m, loss.split("+"), tuple(overrides)) for m, loss in pairs}
    if dist.get_rank() == 0:
        write_report(report)
    distributed.destroy()


if __name__ == "__main__":
    main()
