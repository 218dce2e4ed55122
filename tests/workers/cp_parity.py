"""Context parallelism against the same layout without it, on the trainer's data path end to end.

One launch; every rank makes the same synthetic rollout (mixed lengths, one sample shorter than 2 x cp, random
valid routes the live router would not choose, observation spans in some responses as multi-turn episodes have)
and owns a contiguous share of it, as an engine rank would. Two
runs from the same initial weights: the reference (parallel.context=1, so data-parallel over the ranks that CP
will take; every such layout is itself tested equal to the single process: tests/test_parity.py) and the CP run
(parallel.context=2). Each: gather_scalars -> prepare_step (advantages, plan, exchange, packed micro-batches cut
by a token budget) -> old log-probs with R3 replayed -> one policy step (loss, gradients) -> one optimizer step.

Reported per model and loss: the largest relative difference of every gradient, of the parameters after the
step's update, of the grad norm and of the loss metrics; the old log-probs of every sample (gathered per sample, so the
micro-batch split does not matter); the R3 placement (each CP rank's attached routes against the engine's
record for the positions it holds: PAD only on padding); the routing metrics of the CP run.
argv: model json=loss[+loss] pairs (comma-separated), then config overrides for both runs.
"""
import os
import sys
import zlib

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from moe import context_parallel  # noqa: E402
from moe.lora import is_lora_param  # noqa: E402
from moe.model import load_hf_config  # noqa: E402
from moe.routing.replay import RoutingReplay  # noqa: E402
from moe.routing.trace import TraceSpec  # noqa: E402
from moe.routing.transport import PAD, gather_recipients  # noqa: E402
from rlpo_mega import distributed  # noqa: E402
from rlpo_mega.config import load_config  # noqa: E402
from rlpo_mega.model_setup import build_policy, unwrap  # noqa: E402
from rlpo_mega.rollout import Sample as Scored  # noqa: E402
from rlpo_mega.rollout.gather import gather_scalars  # noqa: E402
from rlpo_mega.rollout.producers import share  # noqa: E402
from rlpo_mega.training.critic import Critic  # noqa: E402
from rlpo_mega.training.old_logprobs import attach_old_logprobs  # noqa: E402
from rlpo_mega.training.update import optimizer_step, policy_step  # noqa: E402
from tests.workers.packed_parity import main, make_samples, make_stale, staleness  # noqa: E402

CRITIC = ("algorithm.advantage.name=gae", "algorithm.loss.name=ppo_clip", "algorithm.advantage.gamma=0.99",
          "algorithm.advantage.lam=0.9", "critic.optim.lr=1e-3", "critic.vf_clip=0.05", "critic.vf_coef=0.5")
N, GROUP = 16, 4
# "lora": GSPO on adapters (model.lora, the attention's and the experts' factors) over the frozen base;
# "critic_lora": PPO's critic with its own adapters (critic.lora: its trunk frozen, the adapters and the head trained)
LORA = ("algorithm.loss.name=gspo", "model.lora.rank=4", "model.lora.alpha=8")
CRITIC_LORA = CRITIC + ("critic.lora.rank=4", "critic.lora.alpha=8")
BUDGET = 64  # tokens per micro-batch (the CP run's: the padded row of its CP group): several micro-batches per rank


def rollout(hf, spec):
    g = torch.Generator().manual_seed(5)
    plen = torch.randint(2, 7, (N,), generator=g).tolist()
    rlen = (2.0 + 0.8 * torch.randn(N, generator=g)).exp().clamp(1, 40).long().tolist()  # long-tailed
    plen[3], rlen[3] = 2, 1  # span 2: below 2 x cp, so one CP rank holds no token of its loss
    out = make_samples(hf, spec, plen, rlen, g)
    for s in out[5:16:4]:  # multi-turn episodes: an observation inside the response, conditioned on, not trained on
        if s.response_len > 8:
            s.obs_spans = ((3, 4),)
    return out


def placement(micro, everything, cols, cp, cp_rank, sp_rank, sp):
    """(routes equal to the engine's record, (position, layer) pairs compared, non-PAD routes on padding) over
    this rank's attached rows and MoE layers (cols: their trace columns): each local row's place in the padded
    row, its sample and position there."""
    good = total = stray = 0
    for mb in micro:
        routes = mb.routes[0].cpu().long()  # [local rows (this SP shard), layers, topk]
        cu = mb.cu_seqlens_padded.long() if mb.cu_seqlens_padded is not None else mb.cu_seqlens.long()
        local = mb.tokens.shape[1]
        rows = context_parallel.local_rows(cu, cp, cp_rank, local) if cp > 1 else torch.arange(local)
        shard = routes.shape[0]
        rows = rows[sp_rank * shard:(sp_rank + 1) * shard] if sp else rows
        seq = torch.searchsorted(cu[1:], rows, right=True)
        for j, (p, k) in enumerate(zip(rows.tolist(), seq.tolist())):
            at = p - int(cu[k])
            trace = everything[mb.samples[k]].routes if k < len(mb.samples) else None
            if trace is not None and at < trace.shape[0]:
                want = trace[at][list(cols)].long()
                total += want.shape[0]
                good += int((routes[j].sort(-1).values == want.sort(-1).values).all(-1).sum())
            else:
                stray += int((routes[j] != PAD).any())
    return good, total, stray


def one_run(hf, model_json, loss, context, overrides, everything, spec):
    # "critic": PPO with GAE and the value model (training/critic.py), its old values, GAE and one update too
    with_critic = loss in ("critic", "critic_lora")
    settings = {"critic": CRITIC, "critic_lora": CRITIC_LORA, "lora": LORA}.get(loss, (f"algorithm.loss.name={loss}",))
    cfg = load_config(None, overrides + settings + (f"model.hf_config={model_json}", "routing.mode=r3",
                                                    "optim.lr=1e-3", f"parallel.context={context}",
                                                    f"trainer.max_tokens_per_micro_batch={BUDGET}"))
    layout = distributed.init(cfg.parallel, hf, cfg.seed)
    from megatron.core import parallel_state as ps

    chunks, opt = build_policy(hf, layout, cfg.model, cfg.optim, routing_replay=True)
    if loss == "lora":
        draw_b(chunks)
    routing = RoutingReplay(chunks, spec, mode="r3")
    recipients = gather_recipients(chunks, spec)
    from tools.batch_support import prepare_step

    mine = share(everything, list(range(dist.get_world_size())))
    samples = gather_scalars([Scored(**vars(s)) for s in mine], spec, "error", None)
    minis, _, stats = prepare_step(samples, torch.arange(N) // GROUP, cfg, layout.data, layout.tensor, recipients,
                                   spec, 0)
    micro = attach_old_logprobs(chunks, [mb.to() for mb in minis[0]], cfg.algorithm, routing=routing)
    critic = critic_stats = None
    if with_critic:  # phase 4 (values and GAE) before the policy's update, as the trainer runs it
        critic = Critic(cfg, hf, layout, spec)
        if loss == "critic_lora":
            draw_b(critic.chunks)
        critic_micro, critic_stats = critic.prepare([micro])
    sp = bool(unwrap(chunks[0]).config.sequence_parallel)
    place = placement(micro, everything, recipients[dist.get_rank()].layer_cols,
                      ps.get_context_parallel_world_size(), ps.get_context_parallel_rank(),
                      ps.get_tensor_model_parallel_rank(), sp)
    old = {}  # sample -> its old log-probs over its positions (last stage)
    offsets = staleness(loss, everything)
    for mb in micro:
        for k, i in enumerate(mb.samples if mb.old_logp is not None else ()):
            old[i] = mb.old_logp[k, :len(everything[i].prompt_ids) + len(everything[i].response_ids) - 1].cpu()
    make_stale(micro, offsets)
    report = policy_step(chunks, opt, micro, cfg.algorithm, step_optimizer=False, routing=routing)
    named = list(unwrap(chunks[0]).named_parameters())
    # LoRA: the base and the router frozen (no gradient buffer, out of the optimizer); the factors compared
    base_trainable = sum(int(p.requires_grad or getattr(p, "main_grad", None) is not None)
                         for n, p in named if not is_lora_param(n)) if loss == "lora" else 0
    named = [(n, p) for n, p in named if p.requires_grad]
    grads = {n: p.main_grad.detach().clone() for n, p in named}
    before = {n: p.detach().clone() for n, p in named}
    _, grad_norm = optimizer_step(opt, strict=True)
    moved = {n: p.detach() - before[n] for n, p in named}
    critic_out = critic_grads = None
    if with_critic:
        critic_out = critic.update(critic_micro[0])
        named_critic = list(unwrap(critic.chunks[0]).named_parameters())
        if loss == "critic_lora":  # only its adapters and its head train
            base_trainable += sum(int(p.requires_grad) for n, p in named_critic
                                  if not is_lora_param(n) and not n.startswith("output_layer."))
        critic_grads = {n: p.main_grad.detach().clone() for n, p in named_critic if p.requires_grad}
        critic.close()
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, old)
    merged = {i: v for d in every for i, v in d.items()}
    cp_size = ps.get_context_parallel_world_size()
    routing.close()
    del chunks, opt
    distributed.destroy(keep_world=True)
    return {"critic": (critic_stats, critic_out, critic_grads), "cp": cp_size,
            "rows": [[mb.tokens.shape[1], int(mb.cu_seqlens[-1])] for mb in micro], "report": report,
            "grads": grads, "moved": moved, "grad_norm": grad_norm, "old": merged,
            "placement": place, "base_trainable": base_trainable, "micro_batches": stats["data/micro_batches"],
            "bytes_over_own_share": stats["data/bytes_over_own_share"]}


def draw_b(chunks):
    """Every adapter's B non-zero (it starts at zero, where A's gradient is zero and proves nothing), the same in
    both runs and a valid model in each: drawn per parameter name and this rank's place in what the two runs share
    (the pipeline stage; for an expert's own factor the EP rank, whose local experts it names; for a factor split
    over (expert-)TP the (expert-)TP rank). A factor whole on every rank of a group (a row-parallel linear's B, a
    layer's shared expert factors) is the same on each."""
    from megatron.core import parallel_state as ps

    for chunk in chunks:
        for name, p in unwrap(chunk).named_parameters():
            if not (is_lora_param(name) and name.rsplit(".", 1)[-1] in ("b", "lora_fc1_b", "lora_fc2_b")):
                continue
            expert = getattr(p, "allreduce", True) is False
            split = getattr(p, "tensor_model_parallel", False)
            place = (ps.get_pipeline_model_parallel_rank(), ps.get_expert_model_parallel_rank() if expert else None,
                     (ps.get_expert_tensor_parallel_rank() if expert else ps.get_tensor_model_parallel_rank())
                     if split else None)
            g = torch.Generator().manual_seed(zlib.crc32(f"{name}/{place}".encode()))
            with torch.no_grad():
                p.copy_(0.1 * torch.randn(p.shape, generator=g))


def rel(a, b):
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def run(model_json, losses, overrides):
    hf = load_hf_config(model_json)
    spec = TraceSpec.from_hf(hf)
    everything = rollout(hf, spec)
    out = {}
    for loss in losses:
        ref = one_run(hf, model_json, loss, 1, overrides, everything, spec)
        got = one_run(hf, model_json, loss, 2, overrides, everything, spec)
        worst = torch.tensor([max(rel(got["grads"][n], g) for n, g in ref["grads"].items()),
                              max(rel(got["moved"][n], m) for n, m in ref["moved"].items()),
                              sum(int(g.norm() == 0) for g in ref["grads"].values())], dtype=torch.float64)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        counts = torch.tensor(got["placement"], dtype=torch.float64)
        dist.all_reduce(counts)
        assert set(ref["old"]) == set(got["old"]) == set(range(N)), (sorted(ref["old"]), sorted(got["old"]))
        logp_rel = max(float((got["old"][i] - ref["old"][i]).abs().max() / ref["old"][i].abs().max().clamp(min=1e-30))
                       for i in range(N))
        keys = [k for k, v in ref["report"].items() if isinstance(v, float) and not k.startswith("routing/")]
        critic = {}
        if ref["critic"][0] is not None:
            (s_ref, o_ref, g_ref), (s_got, o_got, g_got) = ref["critic"], got["critic"]
            g = torch.tensor([max(rel(g_got[n], a) for n, a in g_ref.items())], dtype=torch.float64)
            dist.all_reduce(g, op=dist.ReduceOp.MAX)
            critic = {"grad_rel_max": float(g[0]), "lora_grads": sum(is_lora_param(n) for n in g_ref),
                      "other_grads": sorted(n for n in g_ref if not is_lora_param(n)),
                      "metrics": {k: [s_got[k], v] for k, v in s_ref.items()}
                      | {k: [o_got[k], o_ref[k]] for k in ("value_loss", "vf_clip_frac", "grad_norm")}}
        out[loss] = {"grad_rel_max": float(worst[0]), "update_rel_max": float(worst[1]),
                     "zero_grads": int(worst[2]), "logp_rel_max": logp_rel,
                     "grad_norm": [got["grad_norm"], ref["grad_norm"]],
                     "metrics": {k: [got["report"][k], ref["report"][k]] for k in keys},
                     "routing": {k: v for k, v in got["report"].items() if k.startswith("routing/")},
                     "placement": counts.tolist(),
                     "micro_batches": [got["micro_batches"], ref["micro_batches"]],
                     "cp": [got["cp"], ref["cp"]], "base_trainable": [got["base_trainable"], ref["base_trainable"]],
                     "trained": len(ref["grads"]), "local_rows": got["rows"], "critic": critic,
                     "bytes_over_own_share": [got["bytes_over_own_share"], ref["bytes_over_own_share"]]}
    return out


if __name__ == "__main__":
    main(run)
