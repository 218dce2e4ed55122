"""torchrun worker (1 process): the Megatron learner's replay-free routes and log-probs on given tokens.

argv: hf_ckpt_dir in.json out.pt. in.json: {"seqs": [[token ids], ...]}. Builds the policy from the HF
checkpoint (model.init_from_hf), runs a forward per sequence with router hooks (what the MoE layers
dispatch) and saves {"routes": [int [len, moe_layers, topk]], "logp": [float64 [len - 1]]}.
"""
import json
import sys

import torch
import torch.distributed as dist

from moe.model import load_hf_config
from rlpo_mega import distributed
from rlpo_mega.config import load_config
from rlpo_mega.model_setup import build_policy
from tests.dist import write_report
from tests.workers.bridge import megatron_logits
from tests.workers.routing_common import RouteHooks


def main():
    ckpt, inp, out = sys.argv[1:]
    hf = load_hf_config(ckpt)
    cfg = load_config(None, (f"model.init_from_hf={ckpt}",))
    layout = distributed.init(cfg.parallel, hf, cfg.seed)
    chunks, _ = build_policy(hf, layout, cfg.model, cfg.optim, routing_replay=False)
    hooks = RouteHooks(chunks, int(hf.num_experts_per_tok))
    routes, logps = [], []
    for seq in json.load(open(inp))["seqs"]:
        hooks.clear()
        toks = torch.tensor([seq])
        logits = megatron_logits(chunks, toks, hf.vocab_size)[0]
        per_layer = hooks.forward_routes(1)[0]  # [layer] -> [1, s, k]
        routes.append(torch.stack([r[0] for r in per_layer], dim=1).int())
        logps.append(torch.log_softmax(logits[:-1], -1).gather(1, toks[0, 1:, None])[:, 0])
    hooks.close()
    torch.save({"routes": routes, "logp": logps}, out)
    write_report({"n": len(routes)})
    dist.barrier()


if __name__ == "__main__":
    main()
