"""A stand-in engine process for the distributed transport: an HF model joined to the update group."""
import sys

import torch
from transformers import AutoModelForCausalLM

from moe.model import load_hf_config
from rlpo_mega.weight_sync.transports import HFModelReceiver
from tests.weight_sync_support import WeightUpdateGroup, serve_distributed


def main():
    port, model_cfg, corrupt, probe_file = int(sys.argv[1]), sys.argv[2], sys.argv[3] == "1", sys.argv[4]
    model = AutoModelForCausalLM.from_config(load_hf_config(model_cfg))
    group = WeightUpdateGroup("127.0.0.1", port, rank=1, world_size=2, backend="gloo")

    def flip(name, t):
        if corrupt and name.endswith("layers.1.self_attn.o_proj.weight"):
            t = t.clone()
            t.view(-1)[7] += 1e-3  # a single element changed in transit
        return t

    serve_distributed(group, HFModelReceiver(model), corrupt=flip)
    # What the engine computes with the weights it received, for the learner to compare.
    probe = torch.load(probe_file)
    with torch.no_grad():
        torch.save(model(probe).logits.double(), probe_file + ".logits")


if __name__ == "__main__":
    main()
