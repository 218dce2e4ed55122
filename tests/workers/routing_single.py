"""Routing replay at TP1 (1 process): R3 with identical weights, after perturbing the routers (replay vs
off), with activation recompute, R2 (record -> replay, GSPO ratio), per-token fallback, refusals.

argv: out_dir. The "engine" is the HF model of a tiny checkpoint with router hooks; the learner loads the
same weights. Writes out_dir/rollout.pt (rollout, traces and the replayed reference for the layout
worker) and reports JSON.
"""
import os
import sys

import torch

from moe.bridge.megatron_io import ExportStream
from moe.model import load_hf_config
from moe.routing.replay import RoutingReplay, RoutingReplayError
from moe.routing.trace import TraceSpec, validate_batch
from moe.routing.transport import gather_recipients, padded_placement, scatter_routes
from rlpo_mega import distributed
from rlpo_mega.algorithms.logprobs import vocab_parallel_logprobs
from rlpo_mega.algorithms.objective import policy_objective
from rlpo_mega.training.update import model_forward as _model_out, policy_step
from tools.batch_support import assemble_batch, prepare_micro_batches
from rlpo_mega.config import load_config
from rlpo_mega.model_setup import build_policy
from rlpo_mega.reductions import Stat, stat
from rlpo_mega.training.update import forward_backward
from tests.dist import write_report
from tests.workers.bridge import make_hf_checkpoint
from tests.workers.routing_common import (MODEL, SEQ, RouteHooks, compare_to_traces, hf_engine, local_forward_routes,
                                          make_rollout, perturb_routers)

NMB = 2


class Run:
    def __init__(self, out_dir, model=MODEL):
        self.model, self.hf = model, load_hf_config(model)
        self.ckpt = os.path.join(out_dir, "hf_ckpt")
        make_hf_checkpoint(self.hf, self.ckpt)
        self.spec = TraceSpec.from_hf(self.hf)
        self.prompts, self.responses, self.rewards, self.groups = make_rollout(self.hf.vocab_size)
        self.raw, self.roll_logps = hf_engine(self.ckpt, self.hf, self.prompts, self.responses)
        self.lengths = [len(p) + len(r) - 1 for p, r in zip(self.prompts, self.responses)]
        self.traces, self.vstats = validate_batch(self.raw, self.spec, self.lengths)

    def build(self, mode, recompute=False, replay=True, bias_rate=0.0):
        cfg = load_config(None, (f"model.init_from_hf={self.ckpt}", "optim.lr=1e-3", f"routing.mode={mode}",
                                 f"model.recompute={recompute}", f"parallel.num_micro_batches={NMB}",
                                 "algorithm.loss.name=gspo", f"model.hf_config={self.model}",
                                 f"model.expert_bias_update_rate={bias_rate}"))
        layout = distributed.init(cfg.parallel, self.hf, cfg.seed)
        chunks, opt = build_policy(self.hf, layout, cfg.model, cfg.optim, routing_replay=replay)
        batch, _ = assemble_batch(self.prompts, self.responses, self.rewards, self.groups, cfg.algorithm,
                                  seq_length=SEQ, rollout_logps=self.roll_logps)
        return cfg, chunks, opt, batch

    def routes(self, chunks, traces=None):
        recipients = gather_recipients(chunks, self.spec)
        return scatter_routes(traces or self.traces, padded_placement(self.lengths), recipients,
                              len(self.lengths), SEQ, self.spec)



# test-only helpers (they measure; the trainer computes its mismatch metrics in policy_step/objective)
def logprob_mismatch(train_logp, rollout_logp, mask, prefix: str) -> dict:
    """Train/rollout mismatch over response tokens (k3 KL, mean and max |w - 1|), keys under `prefix`."""
    from rlpo_mega.algorithms.mismatch import mismatch_metrics

    m = mismatch_metrics(train_logp, rollout_logp, mask.bool())
    kl, dev = m["mismatch/k3_kl"], m["mismatch/ratio_dev_mean"]
    return {f"{prefix}/k3_kl": float(kl[0] / kl[1].clamp(min=1)),
            f"{prefix}/ratio_dev_mean": float(dev[0] / dev[1].clamp(min=1)),
            f"{prefix}/ratio_dev_max": float(m[Stat("mismatch/ratio_dev_max", "max")].max())}


def mismatch_report(self, model_chunks, micro: list[dict], algo_cfg) -> dict:
    """Train/rollout log-prob mismatch with replay (the micro-batches' old_logp) and without it (one
    extra forward-only pass routing live; also gives `routing/no_replay/agreement`). Needs rollout_logp.
    Collective; every rank gets the global values."""
    from rlpo_mega.algorithms.mismatch import mismatch_metrics
    from rlpo_mega.training.old_logprobs import compute_log_probs
    from rlpo_mega.training.update import reduce_report

    live = compute_log_probs(model_chunks, micro, algo_cfg, wrap_step=lambda s: self.wrap(s, "observe", "no_replay"))
    reports = []
    for mb, lp in zip(micro, live or []):
        mask = mb.loss_mask.bool()
        rep = {}
        for tag, logp in (("replay", mb.old_logp), ("no_replay", lp)):
            for k, v in mismatch_metrics(logp, mb.rollout_logp, mask).items():
                k = stat(k)
                rep[Stat(k.name.replace("mismatch/", f"routing/mismatch_{tag}/"), k.how)] = v
        reports.append(rep)
    out = reduce_report(reports)
    out.update(self.stats.reduce(phases=["no_replay"]))
    return out

def old_logp(micro):
    return torch.cat([mb.old_logp for mb in micro])


def mismatch(micro, prefix):
    m = torch.cat([mb.loss_mask for mb in micro])
    return logprob_mismatch(old_logp(micro), torch.cat([mb.rollout_logp for mb in micro]), m, prefix)


def router_grad_norms(chunks):
    from moe.routing.transport import local_routers

    return [float(r.weight.main_grad.norm()) for _, r in local_routers(chunks)]


def expert_biases(chunks):
    from moe.routing.transport import local_routers

    return [r.expert_bias.detach().clone() for _, r in local_routers(chunks) if r.expert_bias is not None]


def r3_case(run, perturb, recompute=False, traces=None, mode="r3", bias_rate=0.0):
    cfg, chunks, opt, batch = run.build(mode, recompute, bias_rate=bias_rate)
    bias_before = expert_biases(chunks)
    if perturb:
        perturb_routers(chunks)
    routes, wire = run.routes(chunks, traces)
    driver = RoutingReplay(chunks, run.spec, mode)
    driver.set_routes(routes)
    hooks = RouteHooks(chunks, run.spec.topk)
    micro = prepare_micro_batches(chunks, batch, cfg.algorithm, NMB, routing=driver)
    old_routes = local_forward_routes(hooks, micro, run.spec.num_layers)
    hooks.clear()
    with_without = mismatch_report(driver, chunks, micro, cfg.algorithm) if mode == "r3" else {}
    hooks.clear()
    out = policy_step(chunks, opt, micro, cfg.algorithm, step_optimizer=False, routing=driver)
    res = {"old_routes_vs_trace": compare_to_traces(old_routes, run.traces),
           "update_routes_vs_trace": compare_to_traces(local_forward_routes(hooks, micro, run.spec.num_layers), run.traces),
           "metrics": {k: v for k, v in out.items() if k.startswith("routing/") and "layer" not in k},
           "router_grad_norms": router_grad_norms(chunks), **mismatch(micro, f"mismatch_{mode}"),
           "wire": wire, "with_without": {k: v for k, v in with_without.items() if "layer" not in k}}
    bwd = hooks.backward_routes()
    fwd = {layer: [ids for b, ids in c if not b] for layer, c in hooks.calls.items()}
    res["recompute_calls"] = sum(len(v) for v in bwd.values())
    res["recompute_routes_equal_forward"] = all(
        len(bwd[layer]) == len(fwd[layer]) and all(torch.equal(a, b) for a, b in zip(bwd[layer], fwd[layer]))
        for layer in fwd) if res["recompute_calls"] else None
    res["replay_queues_empty"] = all(not rr.replay_backward_list for rr in driver._replays)
    ok, grad_norm, _ = opt.step()
    res["grad_norm"] = float(grad_norm)
    if bias_before:  # megatron updates the bias in finalize_model_grads, from the loads the layers dispatched
        res["bias_change"] = [(a - b).tolist() for a, b in zip(expert_biases(chunks), bias_before)]
    hooks.close()
    driver.close()
    return res, old_logp(micro), old_routes


def export_buckets(run):
    """The weight sync's buckets at a 1-byte bucket size: every tensor alone but those an engine loads together."""
    _, chunks, _, _ = run.build("off")
    return [[name for name, _ in bucket] for bucket in ExportStream(chunks, bucket_bytes=1, dst=0) if bucket]


def r2_case(run):
    """Record in the old-log-prob pass, replay in the update: ratio 1 exactly without an optimizer step;
    after the routers change (as an optimizer step would change them), the recorded routes still rule."""
    cfg, chunks, opt, batch = run.build("r2", recompute=True)
    driver = RoutingReplay(chunks, run.spec, "r2")
    micro = prepare_micro_batches(chunks, batch, cfg.algorithm, NMB, routing=driver)
    recorded = torch.cat([mb.routes.long() for mb in micro])
    hooks = RouteHooks(chunks, run.spec.topk)
    ratios = []

    def probe(data_iterator, model):
        mb = next(data_iterator)
        out = _model_out(model, mb)

        def loss_func(logits):
            logp, _ = vocab_parallel_logprobs(logits, mb.labels, real_vocab=run.hf.vocab_size, with_entropy=False)
            m = mb.loss_mask
            lr = torch.where(m, logp - mb.old_logp, torch.zeros_like(logp)).sum(1) / m.sum(1)
            ratios.append(torch.exp(lr).detach())  # GSPO's s_i
            return policy_objective(logp, mb, cfg.algorithm)

        return out, loss_func

    def update():
        ratios.clear()
        hooks.clear()
        forward_backward(chunks, opt, micro, driver.wrap_update(probe))
        routes = local_forward_routes(hooks, micro, run.spec.num_layers)
        m = driver.metrics()
        return torch.cat(ratios), routes, m

    s1, routes1, m1 = update()
    res = {"ratio_exactly_one": bool((s1 == 1.0).all()), "ratio_max_dev": float((s1 - 1).abs().max()),
           "update_equals_recorded": bool(torch.equal(routes1.sort(-1).values, recorded.sort(-1).values)),
           "live_agreement_same_router": m1.get("routing/update/agreement"),
           "recompute_calls": sum(len(v) for v in hooks.backward_routes().values())}
    perturb_routers(chunks)  # the router moves between the old pass and this update
    s2, routes2, m2 = update()
    res.update(after_router_change_equals_recorded=bool(torch.equal(routes2.sort(-1).values,
                                                                    recorded.sort(-1).values)),
               after_router_change_live_agreement=m2["routing/update/agreement"],
               after_router_change_ratio_max_dev=float((s2 - 1).abs().max()),
               router_grad_norms=router_grad_norms(chunks))
    hooks.close()
    driver.close()
    return res


def fallback_case(run):
    """Bad entries (duplicates, missing rows) fall back to the live router, counted; the rest replays."""
    raw = [t.clone() for t in run.raw]
    raw[2][3:6, 1] = torch.tensor([1, 1])  # duplicates in MoE layer 1, tokens 3..5
    raw[5] = raw[5][:-2]  # the last two rows missing
    traces, stats = validate_batch(raw, run.spec, run.lengths, on_error="fallback")
    cfg, chunks, opt, batch = run.build("r3")
    perturb_routers(chunks)
    routes, _ = run.routes(chunks, traces)
    driver = RoutingReplay(chunks, run.spec, "r3")
    hooks = RouteHooks(chunks, run.spec.topk)
    driver.set_routes(routes)
    micro = prepare_micro_batches(chunks, batch, cfg.algorithm, NMB, routing=driver)
    got = local_forward_routes(hooks, micro, run.spec.num_layers)
    live = local_forward_routes(hooks, micro, 2, live=True)  # the live router's choice in the same pass
    m = driver.metrics()
    ok_fallback = ok_replayed = True
    for i, tr in enumerate(traces):
        n = tr.num_tokens
        rep = tr.replaced if tr.replaced is not None else torch.zeros(n, 2, dtype=torch.bool)
        g, lv, want = got[i, :n].sort(-1).values, live[i, :n].sort(-1).values, tr.ids.long().sort(-1).values
        ok_fallback &= bool((g == lv).all(-1)[rep].all())
        ok_replayed &= bool((g == want).all(-1)[~rep].all())
    hooks.close()
    driver.close()
    return {"stats": stats, "metric_fallback_entries": m["routing/old/fallback_entries"],
            "fallback_entries_use_live_router": ok_fallback, "other_entries_replayed": ok_replayed,
            "live_differs_at_fallback": bool((live[2, 3:6, 1].sort(-1).values
                                              != run.traces[2].ids[3:6, 1].long().sort(-1).values).any())}


def refusals(run):
    out = {}
    cfg, chunks, opt, batch = run.build("r3")
    chunks[0].module.config.moe_router_fusion = True
    try:
        RoutingReplay(chunks, run.spec, "r3")
    except RoutingReplayError as e:
        out["fused"] = str(e)
    chunks[0].module.config.moe_router_fusion = False
    driver = RoutingReplay(chunks, run.spec, "r3")
    try:
        prepare_micro_batches(chunks, batch, cfg.algorithm, NMB, routing=driver)
    except RoutingReplayError as e:
        out["no_routes"] = str(e)
    driver.close()
    cfg, chunks, opt, batch = run.build("r3", replay=False)
    try:
        RoutingReplay(chunks, run.spec, "r3")
    except RoutingReplayError as e:
        out["not_enabled"] = str(e)
    return out


def main():
    out_dir = sys.argv[1]
    if len(sys.argv) > 2:  # other families (argv: out_dir model_configs,...): R3 vs off with perturbed routers
        reports = {}
        for model in sys.argv[2].split(","):
            family_dir = os.path.join(out_dir, os.path.basename(model)[:-5])
            os.makedirs(family_dir, exist_ok=True)
            run = Run(family_dir, model)
            report = {"validation": run.vstats}
            report["identical"], _, _ = r3_case(run, perturb=False)
            report["perturbed_off"], _, _ = r3_case(run, perturb=True, mode="off")
            report["perturbed_r3"], _, _ = r3_case(run, perturb=True)
            report["r3_bias_rate"], _, _ = r3_case(run, perturb=True, bias_rate=0.01)
            report["r2"] = r2_case(run)
            report["export_buckets"] = export_buckets(run)
            reports[run.hf.model_type] = report
        write_report(reports)
        distributed.destroy()
        return
    run = Run(out_dir)
    report = {"validation": run.vstats}
    report["identical"], _, _ = r3_case(run, perturb=False)
    report["perturbed_off"], off_logp, _ = r3_case(run, perturb=True, mode="off")
    report["perturbed_r3"], ref_logp, _ = r3_case(run, perturb=True)
    report["perturbed_r3_recompute"], rc_logp, _ = r3_case(run, perturb=True, recompute=True)
    report["recompute_logp_max_abs"] = float((rc_logp - ref_logp).abs().max())
    report["r2"] = r2_case(run)
    report["fallback"] = fallback_case(run)
    report["refusals"] = refusals(run)
    torch.save({"prompts": run.prompts, "responses": run.responses, "rewards": run.rewards, "groups": run.groups,
                "raw": run.raw, "roll_logps": run.roll_logps, "ref_logp": ref_logp,
                "ref_grad_norm": report["perturbed_r3"]["grad_norm"],
                "ref_metrics": report["perturbed_r3"]["metrics"]}, os.path.join(out_dir, "rollout.pt"))
    write_report(report)
    distributed.destroy()


if __name__ == "__main__":
    main()
