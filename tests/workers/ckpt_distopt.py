"""Distributed-optimizer checkpoints (optim.use_distributed_optimizer=true) in ONE 2-process launch.

float32 (`dist`: distributed optimizer, `plain`: the default one):
  ref      : EP2 (TP1/DP2), dist: save `s0`, step 1, save `s1`, eval, steps 2, 3   (uninterrupted run)
  same     : EP2, other seed, dist: load `s0`, step 1, eval (a never-stepped save); load `s1`, steps 2, 3
  tp2      : TP2+SP (EP1, DP1), dist: load `s1`, steps 2, 3              (other TP/EP and DP size)
  to_plain : TP2/EP2 (DP1), plain: load `s1`, save `plain1`, steps 2, 3   (dist -> plain)
  from_plain: TP1 (EP1, DP2), dist: load `plain1`, steps 2, 3            (plain -> dist; the experts,
             whole on each EP2 rank when saved, are now sharded over DP2)
bfloat16 params (fp32 main params inside the optimizer, the recipes' precision), all dist:
  ref      : EP2: step 1, save `s1`, steps 2, 3
  same     : EP2, other seed: load `s1`, steps 2, 3; load `s1` again, rebuild the main params from the
             bf16 weights (what a checkpoint without them would resume to), steps 2, 3   (control)
  tp2      : TP2+SP (EP1, DP1): load `s1`, save `tp2_1`, steps 2, 3  (bf16 numerics differ by layout)
  back     : EP2: load `tp2_1`, steps 2, 3: the state went EP2/DP2 -> TP2/DP1 -> EP2/DP2 unchanged
lazy     : EP2, the distributed optimizer over a FusedAdam-like optimizer (state created at its first step, the
           step count in its param groups): saved before the first step and after it, each resumed exactly.
ablation : the bf16 plain and the distributed optimizer built without the optimizer_param_types patch.
offload  : bf16 with optimizer CPU offload (megatron's HybridDeviceOptimizer): saved offloaded before and after a
           step, loaded offloaded; loaded without offload at TP2, saved there, loaded offloaded at EP2 (`offload`).
memory   : float32 at TP1 (DP2) and bf16 at EP2 (dense DP2): the host bytes of optimizer state a save hands to dist_checkpointing and a load
           asks it for, per rank; what rlpo-mega plan predicts for the same buffers; what megatron-core's own
           fully_reshardable gather holds (the format as megatron writes it); a checkpoint megatron writes loads
           here exactly, and one written here loads through megatron's own reader.
Layouts are switched by re-initialising megatron's parallel_state; the world size stays 2 (4 processes
would double the CPU time of this launch on 2 cores).
Usage: ckpt_distopt.py OUT_DIR FAMILY
"""
import gc
import os
import sys
import time

import torch

EP2 = ("parallel.expert=2",)
TP2 = ("parallel.tensor=2",)
TP2_EP2 = ("parallel.tensor=2", "parallel.expert=2", "parallel.expert_tensor=1")
TP1 = ()
DIST = ("optim.use_distributed_optimizer=true",)
BF16 = ("model.params_dtype=bfloat16",)


def steps23(run, r, prefix=""):
    r[prefix + "loss2"] = run.step("train2")
    r[prefix + "loss3"] = run.step("train3")
    return r


def load(run, path, r):
    from rlpo_mega.checkpoint.dist import load_checkpoint

    r.setdefault("layout", run.describe())
    r["meta"] = load_checkpoint(path, run.chunks, run.opt)


def save(run, path, step):
    from rlpo_mega.checkpoint.dist import save_checkpoint

    save_checkpoint(path, run.chunks, run.opt, meta={"step": step, "layout": run.describe()})


def done(run):
    del run
    gc.collect()


def float32(family, d):
    from ckpt_common import SEED, Run

    r = {k: {} for k in ("ref", "same", "tp2", "to_plain", "from_plain")}
    s0, s1, plain1 = (os.path.join(d, n) for n in ("s0", "s1", "plain1"))

    run = Run(family, EP2 + DIST, SEED)
    t = r["ref"]
    t["layout"] = run.describe()
    save(run, s0, 0)
    t["loss1"] = run.step("train1")
    save(run, s1, 1)
    t["eval1"] = run.eval()
    done(steps23(run, t))

    run = Run(family, EP2 + DIST, SEED + 1)
    load(run, s0, r["same"])
    run.step("train1")
    r["same"]["eval1"] = run.eval()
    load(run, s1, r["same"])
    done(steps23(run, r["same"]))

    run = Run(family, TP2 + DIST, SEED + 1)
    load(run, s1, r["tp2"])
    done(steps23(run, r["tp2"]))

    run = Run(family, TP2_EP2, SEED + 1)
    load(run, s1, r["to_plain"])
    save(run, plain1, 1)
    done(steps23(run, r["to_plain"]))

    run = Run(family, TP1 + DIST, SEED + 1)
    load(run, plain1, r["from_plain"])
    done(steps23(run, r["from_plain"]))
    return r


def bfloat16(family, d):
    from ckpt_common import SEED, Run

    r = {k: {} for k in ("ref", "same", "tp2", "back")}
    s1, tp2_1 = os.path.join(d, "s1"), os.path.join(d, "tp2_1")

    run = Run(family, EP2 + DIST + BF16, SEED)
    r["ref"]["layout"] = run.describe()
    r["ref"]["loss1"] = run.step("train1")
    save(run, s1, 1)
    done(steps23(run, r["ref"]))

    run = Run(family, EP2 + DIST + BF16, SEED + 1)
    load(run, s1, r["same"])
    steps23(run, r["same"])
    load(run, s1, r["same"])
    for sub in run.opt.chained_optimizers:
        sub._copy_model_params_to_main_params()  # main = bf16 weights, as a rebuild would have it
    done(steps23(run, r["same"], "rebuilt_"))

    run = Run(family, TP2 + DIST + BF16, SEED + 1)
    load(run, s1, r["tp2"])
    save(run, tp2_1, 1)
    done(steps23(run, r["tp2"]))

    run = Run(family, EP2 + DIST + BF16, SEED + 2)
    load(run, tp2_1, r["back"])
    done(steps23(run, r["back"]))
    return r


def _optimizer_bytes(state: dict) -> int:
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedBase

    return sum(v.data.numel() * v.data.element_size() for part in ("optimizer", "critic_optimizer")
               for v in nested_values(state.get(part) or {}) if isinstance(v, ShardedBase))


def _every_rank(value):
    import torch.distributed as dist

    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def _megatron_distributed_state(sub, model_sd, is_loading):
    """rlpo_mega.checkpoint.dist._distributed_state as megatron-core 0.16.1 makes the same tensors: its fully_reshardable
    sharded_state_dict (mem_efficient: a save gathers each DP group's state on its DP rank 0 over gloo; a load reads
    the whole state of the rank's model-parallel shard on every rank)."""
    from rlpo_mega.checkpoint.dist import _zero_state

    fresh = _zero_state(sub)
    sd = sub.sharded_state_dict(model_sd, is_loading=is_loading, metadata={
        "distrib_optim_sharding_type": "fully_reshardable", "distrib_optim_fully_reshardable_mem_efficient": True})
    if fresh and not is_loading:
        sub.optimizer.state.clear()
    params = [p for buffer in sub.buffers for p in buffer.param_index_map]
    for i, entry in (sd["param_state"] or {}).items():
        if params[i].dtype == torch.float32:
            entry["param"] = params[i]
        else:
            entry["param"].key = entry["param"].key.replace("optimizer.state.param.", "optimizer.state.fp32_param.")
    return sd, float(sd["optimizer"]["param_groups"][0]["step"])


def _state_of(opt) -> list:
    """Every DistributedOptimizer's main params and Adam moments on this rank (its ranges), in order."""
    from rlpo_mega.checkpoint.dist import _sub_optimizers

    out = []
    for sub in _sub_optimizers(opt):
        for b, buffer in enumerate(sub.buffers):
            mine = {p for per in sub.gbuf_ranges[b].values() for m in per for p in m["param_map"]}
            for p in buffer.param_index_map:
                if p in mine:
                    t = sub._get_main_param_and_optimizer_states(p)
                    out += [t[k].detach().clone() for k in ("param", "exp_avg", "exp_avg_sq")]
    return out


def memory_at(family, d, overrides, hf=None):
    import torch.distributed as dist
    from ckpt_common import SEED, Run
    from megatron.core import dist_checkpointing

    import rlpo_mega.checkpoint.dist as ck
    from rlpo_mega.checkpoint.distopt import _ranks_holding
    from rlpo_mega.planning.meta_build import _describe
    from rlpo_mega.planning.plan import dp_positions, optimizer_state_bytes
    from rlpo_mega.model_setup import unwrap

    ours, theirs = os.path.join(d, "ours"), os.path.join(d, "megatron")
    run = Run(family, overrides, SEED, hf)
    run.step("train1")
    run.step("train2")  # moments unlike each other and the main params unlike the bf16 weights
    seen = {}
    real_save, real_load, real_state = dist_checkpointing.save, dist_checkpointing.load, ck._distributed_state

    def save(state, path, *a, **k):
        seen["save"] = _optimizer_bytes(state)
        return real_save(state, path, *a, **k)

    def load(state, path, *a, **k):
        seen["load"] = _optimizer_bytes(state)
        return real_load(state, path, *a, **k)

    def through(path, saving_with, loading_with):
        """(host bytes saved, loaded) on this rank; whether the state came back bit-equal."""
        before = _state_of(run.opt)
        ck._distributed_state = saving_with
        ck.save_checkpoint(path, run.chunks, run.opt, meta={"step": 2})
        saved = seen["save"]
        for sub in ck._sub_optimizers(run.opt):  # nothing left of it but what the load puts back
            for group in sub.optimizer.param_groups:
                for p in group["params"]:
                    p.data.zero_()
                    for v in sub.optimizer.state[p].values():
                        if v.dim():
                            v.zero_()
        ck._distributed_state = loading_with
        ck.load_checkpoint(path, run.chunks, run.opt)
        return saved, seen["load"], all(torch.equal(a, b) for a, b in zip(before, _state_of(run.opt)))

    dist_checkpointing.save, dist_checkpointing.load = save, load
    try:
        r = {"ours": _every_rank(through(ours, real_state, real_state)),
             "megatron_to_ours": _every_rank(through(theirs, _megatron_distributed_state, real_state)),
             "ours_to_megatron": _every_rank(through(ours, real_state, _megatron_distributed_state))}
    finally:
        dist_checkpointing.save, dist_checkpointing.load, ck._distributed_state = real_save, real_load, real_state
    dense, expert = dp_positions(run.layout)
    me = dist.get_rank()
    r["predicted"] = _every_rank(optimizer_state_bytes(_describe(run.chunks[0], unwrap(run.chunks[0]))["buffers"],
                                                       dense[me], expert[me]))
    buffers = [b for sub in ck._sub_optimizers(run.opt) for b in sub.buffers]
    r["straddling"] = [[start, end] for b in buffers for start, end, _ in b.param_index_map.values()
                       if _ranks_holding(start, end, b.bucket_indices, b.data_parallel_group.size())[0]
                       != _ranks_holding(start, end, b.bucket_indices, b.data_parallel_group.size())[1]]
    r["shard_bytes"] = _every_rank(sum(12 * b.numel_unpadded for b in buffers))
    # what megatron's save gathers here: the buffers whose DP group this rank is rank 0 of (expert DP is 1 at EP2)
    r["dp0_bytes"] = _every_rank(sum(12 * b.numel_unpadded for b in buffers if b.data_parallel_group.rank() == 0))
    done(run)
    return r


def memory(family, d):
    # float32 at TP1 (DP2; parameters straddle the DP ranges: the exchange runs), bf16 at EP2
    # (dense DP2, expert DP1; main params in the optimizer; here no parameter straddles)
    from ckpt_common import FAMILIES

    from moe.model import load_hf_config

    # the tiny models' buffers are symmetric about their middle, where DP2 cuts them: one layer more is not
    odd = load_hf_config(FAMILIES[family])
    odd.num_hidden_layers += 1
    return {"float32": memory_at(family, os.path.join(d, "float32"), TP1 + DIST, odd),
            "bfloat16": memory_at(family, os.path.join(d, "bfloat16"), EP2 + DIST + BF16)}


class LazyAdam(torch.optim.Optimizer):
    """Adam as Apex's and Transformer Engine's FusedAdam keep it: no state until the first step() creates exp_avg
    and exp_avg_sq, and the step count in each param group rather than per parameter."""

    def __init__(self, params, lr, weight_decay, betas, eps, adam_w_mode=True):
        super().__init__(params, {"lr": lr, "weight_decay": weight_decay, "betas": betas, "eps": eps})
        self.adam_w_mode = adam_w_mode

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            group["step"] = t = group.get("step", 0) + 1
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "exp_avg" not in state:
                    state["exp_avg"], state["exp_avg_sq"] = torch.zeros_like(p), torch.zeros_like(p)
                g = p.grad
                if self.adam_w_mode:
                    p.mul_(1 - group["lr"] * group["weight_decay"])
                else:
                    g = g.add(p, alpha=group["weight_decay"])
                state["exp_avg"].mul_(b1).add_(g, alpha=1 - b1)
                state["exp_avg_sq"].mul_(b2).addcmul_(g, g, value=1 - b2)
                denom = (state["exp_avg_sq"] / (1 - b2 ** t)).sqrt_().add_(group["eps"])
                p.addcdiv_(state["exp_avg"], denom, value=-group["lr"] / (1 - b1 ** t))


def lazy(family, d):
    """The distributed optimizer over a FusedAdam-like optimizer (megatron-core's Apex/TE branch, taken as it is
    with TE installed): saved before its first step, when it has no state at all."""
    import megatron.core.optimizer as mopt
    from ckpt_common import SEED, Run
    from megatron.core.optimizer import distrib_optimizer

    patched = {(mopt, "Adam"): LazyAdam, (mopt, "USING_PYTORCH_OPTIMIZER"): False,
               (distrib_optimizer, "Adam"): LazyAdam, (distrib_optimizer, "HAVE_APEX_OR_TE"): True,
               (distrib_optimizer, "USING_TE_OPTIMIZER"): True}
    saved = {k: getattr(*k) for k in patched}
    for (module, name), value in patched.items():
        setattr(module, name, value)
    s0, s1 = os.path.join(d, "s0"), os.path.join(d, "s1")
    r = {"ref": {}, "resumed": {}}
    try:
        run = Run(family, EP2 + DIST, SEED)
        inner = [sub.optimizer for sub in run.opt.chained_optimizers]
        r["optimizer"] = sorted({type(o).__name__ for o in inner})
        save(run, s0, 0)
        r["state_after_save"] = sum(bool(s) for o in inner for s in o.state.values())  # the save created none
        r["ref"]["loss1"] = run.step("train1")
        save(run, s1, 1)
        r["ref"]["loss2"] = run.step("train2")
        done(run)
        run = Run(family, EP2 + DIST, SEED + 1)
        load(run, s0, r["resumed"])
        r["resumed"]["loss1"] = run.step("train1")
        load(run, s1, r["resumed"])
        r["resumed"]["loss2"] = run.step("train2")
        done(run)
    finally:
        for (module, name), value in saved.items():
            setattr(module, name, value)
    return r


def ablation(family):
    """Each optimizer constructor the patch wraps, run without it: the error and megatron's frame."""
    import traceback

    from ckpt_common import SEED, Run
    from megatron.core.optimizer import distrib_optimizer, optimizer

    out = {}
    for cls, overrides in ((optimizer.Float16OptimizerWithFloat16Params, BF16),
                           (distrib_optimizer.DistributedOptimizer, DIST)):
        patched = cls.__init__
        cls.__init__ = patched.__wrapped__
        try:
            Run(family, TP1 + overrides, SEED)
            out[cls.__name__] = None
        except TypeError as e:
            frames = [f for f in traceback.extract_tb(e.__traceback__) if "/megatron/core/" in f.filename]
            out[cls.__name__] = {"error": str(e), "site": frames[-1].filename.split("/megatron/core/")[1]
                                 + f":{frames[-1].lineno}"}
        finally:
            cls.__init__ = patched
        gc.collect()
    return out


OFFLOAD = ("optim.cpu_offload=true", "optim.precision_aware=true", "optim.overlap_cpu_optimizer_d2h_h2d=true")


def _weights(run) -> list:
    from rlpo_mega.model_setup import unwrap

    return [p.detach().clone() for p in unwrap(run.chunks[0]).parameters()]


def offload(family, d):
    """Optimizer CPU offload (megatron's HybridDeviceOptimizer, slime's one-node flags) in the same format, bf16:
      ref   : EP2, offloaded: save `o0` before any step, step 1, save `o1`, eval, steps 2, 3
      fresh : EP2, offloaded, other seed: load `o0` (never stepped), eval, step 1; load `o1`: weights, eval
      plain : TP2+SP (EP1, DP1), not offloaded: load `o1`, save `p1`, steps 2, 3
      back  : EP2, offloaded, other seed: load `p1`: its optimizer state bit-equal to ref's after step 1, steps 2, 3
    """
    from ckpt_common import SEED, Run

    r = {k: {} for k in ("ref", "fresh", "plain", "back")}
    o0, o1, p1 = (os.path.join(d, n) for n in ("o0", "o1", "p1"))
    run = Run(family, EP2 + DIST + BF16 + OFFLOAD, SEED)
    r["optimizer"] = sorted({type(sub.optimizer).__name__ for sub in run.opt.chained_optimizers})
    t = r["ref"]
    save(run, o0, 0)
    t["eval0"] = run.eval()
    t["loss1"] = run.step("train1")
    save(run, o1, 1)
    state1, weights1 = _state_of(run.opt), _weights(run)
    t["eval1"] = run.eval()
    done(steps23(run, t))

    run = Run(family, EP2 + DIST + BF16 + OFFLOAD, SEED + 1)
    t = r["fresh"]
    load(run, o0, t)
    t["eval0"] = run.eval()
    t["loss1"] = run.step("train1")
    load(run, o1, t)
    t["weights_equal"] = all(torch.equal(a, b) for a, b in zip(weights1, _weights(run)))
    t["state_equal"] = all(torch.equal(a, b) for a, b in zip(state1, _state_of(run.opt)))
    t["eval1"] = run.eval()
    done(run)

    run = Run(family, TP2 + DIST + BF16, SEED + 1)
    r["plain"]["optimizer"] = sorted({type(sub.optimizer).__name__ for sub in run.opt.chained_optimizers})
    load(run, o1, r["plain"])
    save(run, p1, 1)
    done(steps23(run, r["plain"]))

    run = Run(family, EP2 + DIST + BF16 + OFFLOAD, SEED + 2)
    t = r["back"]
    load(run, p1, t)
    t["state_equal"] = all(torch.equal(a, b) for a, b in zip(state1, _state_of(run.opt)))
    t["weights_equal"] = all(torch.equal(a, b) for a, b in zip(weights1, _weights(run)))
    done(steps23(run, t))
    return r


def main():
    from ckpt_common import finish, fork_checkpoint_queue

    t0 = time.time()
    manager = fork_checkpoint_queue()
    out, family = sys.argv[1], sys.argv[2]
    report = {"float32": float32(family, os.path.join(out, "float32"))}
    report["bfloat16"] = bfloat16(family, os.path.join(out, "bfloat16"))
    report["memory"] = memory(family, os.path.join(out, "memory"))
    report["lazy"] = lazy(family, os.path.join(out, "lazy"))
    report["offload"] = offload(family, os.path.join(out, "offload"))
    report["ablation"] = ablation(family)
    report["seconds"] = time.time() - t0
    finish(report, manager)


if __name__ == "__main__":
    main()
