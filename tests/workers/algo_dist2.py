"""Two-process checks (gloo), one launch:

1. Vocab-parallel log-probs and entropy at TP2 (the world as the TP group) vs float64 log_softmax of the
   gathered logits, values and gradients (fp32 and bf16 logits, padded vocabulary, temperature, chunks).
2. The old / reference log-prob passes (forward-only schedule) vs the direct forward, KL term at step 1.
3. DP2 through megatron's schedule: the policy-loss gradient of the whole batch (computed directly on
   every rank) equals the one megatron produces from 2 micro-batches on each of 2 DP ranks
   (finalize_model_grads: all-reduce + division by the global count), for every aggregation mode.
"""
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from tests.dist import write_report  # noqa: E402


def logprobs_tp2():
    from rlpo_mega.algorithms.logprobs import vocab_parallel_logprobs

    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for dtype, real_vocab, temperature, chunk in [(torch.float32, 90, 0.8, 5), (torch.float32, 96, 1.0, None),
                                                  (torch.float32, 40, 1.3, 7), (torch.bfloat16, 90, 0.7, 4)]:
        g = torch.Generator().manual_seed(3)
        v_local, n = 48, 37
        full = (torch.randn(n, v_local * world, generator=g) * 4).to(dtype)
        labels = torch.randint(0, real_vocab, (n,), generator=g)
        g_lp, g_h = torch.randn(n, generator=g), torch.randn(n, generator=g)
        shard = full[:, rank * v_local:(rank + 1) * v_local].clone().requires_grad_()
        lp, h = vocab_parallel_logprobs(shard.view(1, n, v_local), labels.view(1, n), temperature=temperature,
                                        real_vocab=real_vocab, group=dist.group.WORLD, chunk_size=chunk)
        ((lp.view(-1) * g_lp).sum() + (h.view(-1) * g_h).sum()).backward()
        grads = [torch.empty_like(shard.grad) for _ in range(world)]
        dist.all_gather(grads, shard.grad)
        grad = torch.cat(grads, dim=1)
        # float64 reference on the gathered logits (the same low-precision values, upcast)
        x = full.double()[:, :real_vocab].requires_grad_()
        lsm = torch.log_softmax(x / temperature, dim=-1)
        lp_ref = lsm.gather(1, labels[:, None])[:, 0]
        h_ref = -(lsm.exp() * lsm).sum(-1)
        ((lp_ref * g_lp.double()).sum() + (h_ref * g_h.double()).sum()).backward()
        gref = torch.zeros(n, v_local * world, dtype=torch.float64)
        gref[:, :real_vocab] = x.grad

        def err(a, b):
            a, b = a.double(), b.double()
            return {"abs": float((a - b).abs().max()), "rel": float((a - b).abs().max() / b.abs().max())}

        out[f"{str(dtype).split('.')[-1]}_V{real_vocab}_T{temperature}"] = {
            "logp": err(lp.view(-1), lp_ref), "entropy": err(h.view(-1), h_ref), "grad": err(grad, gref),
            "pad_grad_zero": bool((grad[:, real_vocab:] == 0).all())}
    return out


def dp2_invariance():
    from dataclasses import replace

    from megatron.core import parallel_state

    from moe.model import load_hf_config
    from rlpo_mega import distributed
    from rlpo_mega.algorithms.logprobs import vocab_parallel_logprobs
    from rlpo_mega.algorithms.objective import policy_objective
    from rlpo_mega.training.batches import MicroBatch
    from rlpo_mega.training.update import make_policy_forward_step, policy_step
    from tools.batch_support import prepare_micro_batches
    from rlpo_mega.training.warmup import shard_and_split
    from rlpo_mega.config import load_config
    from rlpo_mega.model_setup import build_policy, unwrap
    from rlpo_mega.training.update import forward_backward

    cfg = load_config(None, ())
    hf = load_hf_config("configs/models/tiny_qwen3_moe.json")
    layout = distributed.init(cfg.parallel, hf, cfg.seed)
    assert parallel_state.get_data_parallel_world_size() == 2
    chunks, opt = build_policy(hf, layout, cfg.model, cfg.optim)
    inner = unwrap(chunks[0])

    g = torch.Generator().manual_seed(11)
    n, s = 8, 12
    tokens = torch.randint(0, hf.vocab_size, (n, s + 1), generator=g)
    starts = torch.tensor([1, 3, 2, 5, 1, 4, 2, 7])
    ends = torch.tensor([12, 9, 12, 6, 3, 12, 10, 12])
    pos = torch.arange(s)
    batch = MicroBatch(tokens=tokens[:, :-1].contiguous(), labels=tokens[:, 1:].contiguous(),
                       loss_mask=(pos >= starts[:, None]) & (pos < ends[:, None]), advantages=torch.randn(n, generator=g))

    def full_logp(grad):
        position_ids = pos.unsqueeze(0).expand(n, s)
        with torch.set_grad_enabled(grad):
            logits = inner(input_ids=batch.tokens, position_ids=position_ids, attention_mask=None)
            lp, _ = vocab_parallel_logprobs(logits, batch.labels, real_vocab=hf.vocab_size)
        return lp

    base = full_logp(False)
    batch.old_logp = base + 0.2 * torch.randn(n, s, generator=g)  # a stale policy: clipping happens

    def grads():
        return {name: p.main_grad.detach().clone() for name, p in inner.named_parameters()}

    results = {}
    # old / reference log-prob passes (forward-only schedule) == the direct forward; with the policy as
    # its own reference the KL term is exactly 0 and so are its metrics
    kl_algo = load_config(None, ("algorithm.kl.coef=0.04", "algorithm.kl.estimator=k3")).algorithm
    micro = prepare_micro_batches(chunks, replace(batch, old_logp=None), kl_algo, 2,
                                  ref_chunks=chunks)
    mine = shard_and_split(MicroBatch(old_logp=base), 2)
    results["logprob_pass_max_abs"] = max(float((getattr(mb, k) - m.old_logp).abs().max()) for mb, m in zip(micro, mine)
                                          for k in ("old_logp", "ref_logp"))
    for c in chunks:
        c.zero_grad_buffer()
    results["kl_first_step"] = policy_step(chunks, opt, micro, kl_algo, step_optimizer=False)
    for loss in ("dapo", "sapo"):
        for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
            algo = load_config(None, (f"algorithm.loss.name={loss}", f"algorithm.loss.aggregation={mode}",
                                      "algorithm.loss.norm_length=16")).algorithm
            for c in chunks:
                c.zero_grad_buffer()
            num, count, _ = policy_objective(full_logp(True), batch, algo)
            (num / count).backward()  # whole batch on this rank: DDP hooks accumulate into main_grad
            want = grads()
            forward_backward(chunks, opt, shard_and_split(batch, 2), make_policy_forward_step(algo, chunks))
            got = grads()
            num_err = max(float((got[k] - want[k]).abs().max()) for k in want)
            scale = max(float(want[k].abs().max()) for k in want)
            norm_rel = max(float((got[k] - want[k]).norm() / want[k].norm()) for k in want if want[k].norm() > 0)
            results[f"{loss}/{mode}"] = {"max_abs": num_err, "max_rel_to_scale": num_err / scale,
                                         "worst_param_norm_rel": norm_rel, "loss": float(num / count)}
    return results


def main():
    from rlpo_mega import distributed

    distributed.init_process_group()
    report = {"logprobs_tp2": logprobs_tp2()}
    report["dp2_invariance"] = dp2_invariance()
    if dist.get_rank() == 0:
        write_report(report)
    distributed.destroy()


if __name__ == "__main__":
    main()
