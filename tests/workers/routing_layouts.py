"""R3 routing replay at parallel layouts: rank 0 alone holds the rollout's traces and sends every rank only
its cut (DP rows, PP stage's MoE layers, SP shard); the MoE layers must dispatch exactly the trace, and
the log-probs / gradient norm must equal the single-process replayed run (routing_single.py).

argv: rollout_dir layout[,layout...] with layouts ep2 | tp2sp | tp2ep2pp2 (recompute on). The learner's
routers are perturbed as in the single-process reference, so replay decides many routes.
"""
import os
import sys

import torch
import torch.distributed as dist

from moe.model import load_hf_config
from moe.routing.replay import RoutingReplay
from moe.routing.trace import TraceSpec, validate_batch
from moe.routing.transport import gather_recipients, local_recipient, padded_placement, scatter_routes
from rlpo_mega import distributed
from tools.batch_support import assemble_batch, prepare_micro_batches
from rlpo_mega.training.update import policy_step
from rlpo_mega.config import load_config
from rlpo_mega.model_setup import build_policy
from tests.dist import write_report
from tests.workers.routing_common import (MODEL, SEQ, RouteHooks, assemble_logp, assemble_routes, compare_to_traces,
                                          gather_to_rank0, local_forward_routes, perturb_routers)

LAYOUTS = {
    "ep2": ("parallel.expert=2",),
    "tp2sp": ("parallel.tensor=2",),
    "tp2ep2pp2": ("parallel.tensor=2", "parallel.expert=2", "parallel.pipeline=2", "model.recompute=true"),
}


def run_layout(name, data, ckpt, hf, spec):
    from megatron.core import parallel_state as ps

    cfg = load_config(None, LAYOUTS[name] + (f"model.init_from_hf={ckpt}", "optim.lr=1e-3", "routing.mode=r3",
                                             "parallel.num_micro_batches=2", "algorithm.loss.name=gspo"))
    layout = distributed.init(cfg.parallel, hf, cfg.seed)
    rank = dist.get_rank()
    chunks, opt = build_policy(hf, layout, cfg.model, cfg.optim, routing_replay=True)
    perturb_routers(chunks)
    prompts, responses = data["prompts"], data["responses"]
    lengths = [len(p) + len(r) - 1 for p, r in zip(prompts, responses)]
    traces = validate_batch(data["raw"], spec, lengths)[0] if rank == 0 else None  # only the source has them
    recipients = gather_recipients(chunks, spec)
    routes, wire = scatter_routes(traces, padded_placement(lengths), recipients, len(lengths), SEQ, spec, src=0)
    driver = RoutingReplay(chunks, spec, "r3")
    driver.set_routes(routes)
    hooks = RouteHooks(chunks, spec.topk)
    batch, _ = assemble_batch(prompts, responses, data["rewards"], data["groups"], cfg.algorithm, seq_length=SEQ,
                              rollout_logps=data["roll_logps"])
    micro = prepare_micro_batches(chunks, batch, cfg.algorithm, 2, routing=driver)
    me = local_recipient(chunks, spec)
    old_routes = gather_to_rank0((me, local_forward_routes(hooks, micro, len(me.layer_cols))))
    last_tp0 = ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0
    logp = gather_to_rank0((ps.get_data_parallel_rank(), ps.get_data_parallel_world_size(),
                            torch.cat([mb.old_logp for mb in micro])) if last_tp0 else None)
    hooks.clear()
    out = policy_step(chunks, opt, micro, cfg.algorithm, routing=driver)
    update_routes = gather_to_rank0((me, local_forward_routes(hooks, micro, len(me.layer_cols))))
    bwd = hooks.backward_routes()
    fwd = {layer: [ids for b, ids in c if not b] for layer, c in hooks.calls.items()}
    recompute = gather_to_rank0((sum(len(v) for v in bwd.values()),
                                 all(len(bwd[k]) == len(fwd[k]) and all(torch.equal(a, b) for a, b in zip(bwd[k], fwd[k]))
                                     for k in fwd if bwd[k])))
    hooks.close()
    driver.close()
    res = None
    if rank == 0:
        n = len(lengths)
        full_old = assemble_routes(old_routes, n, SEQ, spec.num_layers, spec.topk)
        full_upd = assemble_routes(update_routes, n, SEQ, spec.num_layers, spec.topk)
        lp = assemble_logp([x for x in logp if x is not None], n)
        mask = batch.loss_mask
        ref = data["ref_logp"]
        res = {"old_routes_vs_trace": compare_to_traces(full_old, traces),
               "update_routes_vs_trace": compare_to_traces(full_upd, traces),
               "logp_max_abs_vs_single": float((lp - ref)[mask].abs().max()),
               "logp_all_positions_max_abs": float((lp - ref).abs().max()),
               "grad_norm": out["grad_norm"], "ref_grad_norm": data["ref_grad_norm"],
               "update_agreement": out["routing/update/agreement"],
               "ref_update_agreement": data["ref_metrics"]["routing/update/agreement"],
               "recompute_calls": sum(c for c, _ in recompute),
               "recompute_routes_equal_forward": all(ok for _, ok in recompute),
               "wire": wire, "world": dist.get_world_size(),
               "recipients": [(r.dp_rank, r.sp_rank, r.sp_size, list(r.layer_cols)) for r in recipients]}
    del chunks, opt
    dist.barrier()
    return res


def main():
    rollout_dir, names = sys.argv[1], sys.argv[2].split(",")
    data = torch.load(os.path.join(rollout_dir, "rollout.pt"), weights_only=False)
    hf = load_hf_config(MODEL)
    spec = TraceSpec.from_hf(hf)
    report = {name: run_layout(name, data, os.path.join(rollout_dir, "hf_ckpt"), hf, spec) for name in names}
    if dist.get_rank() == 0:
        write_report(report)
    distributed.destroy()


if __name__ == "__main__":
    main()
