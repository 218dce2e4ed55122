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
ablation : the bf16 plain and the distributed optimizer built without the optimizer_param_types patch.
Layouts are switched by re-initialising megatron's parallel_state; the world size stays 2 (4 processes
would double the CPU time of this launch on 2 cores).
Usage: ckpt_distopt.py OUT_DIR FAMILY
"""
import gc
import os
import sys
import time

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
    from rlpo_mega.checkpoint import load_checkpoint

    r.setdefault("layout", run.describe())
    r["meta"] = load_checkpoint(path, run.chunks, run.opt)


def save(run, path, step):
    from rlpo_mega.checkpoint import save_checkpoint

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


def main():
    from ckpt_common import finish, fork_checkpoint_queue

    t0 = time.time()
    manager = fork_checkpoint_queue()
    out, family = sys.argv[1], sys.argv[2]
    report = {"float32": float32(family, os.path.join(out, "float32"))}
    report["bfloat16"] = bfloat16(family, os.path.join(out, "bfloat16"))
    report["ablation"] = ablation(family)
    report["seconds"] = time.time() - t0
    finish(report, manager)


if __name__ == "__main__":
    main()
