"""Shared by the routing workers: a rollout from an HF "engine" with router hooks, megatron route capture
(what the MoE layers actually dispatch), router perturbation and gathering per-rank pieces to rank 0."""
import torch
import torch.distributed as dist

from moe.routing.decoders import HFRouteCapture
from moe.routing.trace import TraceSpec

MODEL = "configs/models/tiny_qwen3_moe.json"
SEQ = 18  # model input length (divisible by TP2 for sequence parallelism)
PLEN = [3, 5, 2, 4, 6, 3, 2, 5]
RLEN = [10, 4, 12, 7, 3, 9, 13, 6]


def make_rollout(vocab):
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, vocab, (p,), generator=g).tolist() for p in PLEN]
    responses = [torch.randint(3, vocab, (r,), generator=g).tolist() for r in RLEN]
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.0, 0.0, 1.0, 1.0, 0.2])
    return prompts, responses, rewards, torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])


def hf_engine(ckpt, hf, prompts, responses):
    """The embedded engine's contract from an HF model: per sample routes [P+R-1, L, k] (router hooks)
    and the response tokens' log-probs."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    spec = TraceSpec.from_hf(hf)
    traces, logps = [], []
    with HFRouteCapture(model, spec) as cap, torch.no_grad():
        for p, r in zip(prompts, responses):
            ids = torch.tensor([p + r])
            logits = model(ids).logits[0].double()
            traces.append(cap.sample(0)[:-1])  # the last token's forward never happens in an engine
            cap.clear()
            lp = torch.log_softmax(logits[:-1], -1).gather(1, ids[0, 1:, None])[:, 0]
            logps.append(lp[len(p) - 1:].float())
    return traces, logps


def perturb_routers(chunks, scale=0.3, seed=3):
    """Same perturbation on every rank (router weights are replicated): routes change for many tokens."""
    from moe.routing.transport import local_routers

    for layer, router in local_routers(chunks):
        g = torch.Generator().manual_seed(seed * 1000 + layer)
        with torch.no_grad():
            router.weight.add_(scale * torch.randn(router.weight.shape, generator=g))


class RouteHooks:
    """The routes the MoE layers dispatch (the routers' routing_map), per router call, with whether the
    call ran inside a backward (activation recompute)."""

    def __init__(self, chunks, topk):
        from moe.routing.transport import local_routers

        self.topk = topk
        self.calls = {layer: [] for layer, _ in local_routers(chunks)}
        self.live = {layer: [] for layer, _ in local_routers(chunks)}
        self.handles = [r.register_forward_hook(self._hook(layer)) for layer, r in local_routers(chunks)]

    def _hook(self, layer):
        def hook(module, args, output):
            routing_map = output[1]
            ids = torch.sort(routing_map.int(), dim=1, descending=True, stable=True).indices[:, :self.topk]
            self.calls[layer].append((torch._C._current_graph_task_id() != -1, ids.sort(dim=1).values))
            # the live router's own choice in this same pass (softmax-after-top-k routers: top-k logits)
            with torch.no_grad():
                logits = args[0].reshape(-1, module.weight.shape[1]).float() @ module.weight.float().t()
            self.live[layer].append(logits.topk(self.topk, dim=1).indices.sort(dim=1).values)

        return hook

    def forward_routes(self, b, live=False):
        """[micro-batch][layer] -> [b, s_local, k] of the forward calls (the router order is s-major);
        live=True: what the live router would have chosen in those calls."""
        out = []
        layers = sorted(self.calls)
        fwd = {layer: [ids for (bwd, used), ids in zip(self.calls[layer], (self.live if live else {})
                                                       .get(layer, [u for _, u in self.calls[layer]]))
                       if not bwd] for layer in layers}
        n = len(fwd[layers[0]]) if layers else 0
        for i in range(n):
            out.append([fwd[layer][i].reshape(-1, b, self.topk).transpose(0, 1) for layer in layers])
        return out

    def backward_routes(self):
        return {layer: [ids for bwd, ids in c if bwd] for layer, c in self.calls.items()}

    def clear(self):
        for c in list(self.calls.values()) + list(self.live.values()):
            c.clear()

    def close(self):
        for h in self.handles:
            h.remove()


def local_forward_routes(hooks, micro, n_layers_local, live=False):
    """This rank's dispatched (or live=True: live-router) routes [rows, s_local, L_local, k] over its
    micro-batches (forward calls)."""
    b = micro[0].tokens.shape[0]
    per_mb = hooks.forward_routes(b, live)
    if not per_mb:
        s = micro[0].tokens.shape[1]
        return torch.zeros(len(micro) * b, s, 0, hooks.topk, dtype=torch.long)
    return torch.cat([torch.stack(layers, dim=2) for layers in per_mb])


def gather_to_rank0(obj):
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, obj)
    return every if dist.get_rank() == 0 else None


def assemble_routes(pieces, n_rows, seq, n_layers, topk):
    """Rank pieces (recipient, [rows, s_local, L_local, k]) -> the global [n, s, L, k] (-9: nobody's)."""
    full = torch.full((n_rows, seq, n_layers, topk), -9, dtype=torch.long)
    for rc, part in pieces:
        r0, r1 = rc.rows(n_rows)
        a, b = rc.shard(seq)
        for j, col in enumerate(rc.layer_cols):
            full[r0:r1, a:b, col] = part[:, :, j].long()
    return full


def compare_to_traces(full, traces):
    """Fraction of (sample, token, layer) routes equal (as sets) to the trace; padded layout (row = sample)."""
    agree = total = 0
    for i, tr in enumerate(traces):
        t = tr.ids.long().sort(dim=-1).values
        got = full[i, :t.shape[0]].sort(dim=-1).values
        agree += int((got == t).all(dim=-1).sum())
        total += t.shape[0] * t.shape[1]
    return agree / total


def assemble_logp(pieces, n_rows):
    """Last-stage TP-rank-0 pieces (dp_rank, dp_size, [rows, s]) -> [n, s]."""
    out = None
    for dp_rank, dp_size, lp in pieces:
        if out is None:
            out = torch.zeros(n_rows, lp.shape[1], dtype=lp.dtype)
        n = n_rows // dp_size
        out[dp_rank * n:(dp_rank + 1) * n] = lp
    return out
