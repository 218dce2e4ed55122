"""Checkpoint resharding in ONE 8-process launch: TP2/EP2/PP2 <-> TP1 (DP8), model + optimizer.

Per family:
  big  : TP2/EP2/PP2, seed S: step 1, save `big1`, eval, step 2, eval          (continuing = reference)
  tp1  : TP1/DP8,     seed S: step 1, save `tp1_1`, eval, step 2, eval          (reference for reverse)
         then load `big1` (model + optimizer) into it: eval, step 2, eval    (big -> TP1)
  big' : TP2/EP2/PP2, seed S+1 (different init): eval, load `tp1_1`: eval, step 2, eval   (TP1 -> big)
Layouts are switched by re-initialising megatron's parallel_state; the world size stays 8.
Usage: ckpt_reshard.py OUT_DIR FAMILY...
"""
import gc
import os
import sys
import time

# Imports of torch/megatron live in functions, not at the top: should dist_checkpointing spawn a
# helper process, it re-runs this file's top level.


def family_run(family, out):
    from ckpt_common import LAYOUT_BIG, LAYOUT_TP1, SEED, Run

    from rlpo_mega.checkpoint.dist import load_checkpoint, save_checkpoint

    r = {}
    d = os.path.join(out, family)

    run = Run(family, LAYOUT_BIG, SEED)
    r["big_layout"] = run.describe()
    r["big_loss1"] = run.step("train1")
    save_checkpoint(os.path.join(d, "big1"), run.chunks, run.opt, meta={"step": 1, "layout": run.describe()})
    r["big_eval1"] = run.eval()
    r["big_loss2"] = run.step("train2")
    r["big_eval2"] = run.eval()
    del run
    gc.collect()

    run = Run(family, LAYOUT_TP1, SEED)
    r["tp1_layout"] = run.describe()
    r["tp1_loss1"] = run.step("train1")
    save_checkpoint(os.path.join(d, "tp1_1"), run.chunks, run.opt, meta={"step": 1, "layout": run.describe()})
    r["tp1_eval1"] = run.eval()
    r["tp1_loss2"] = run.step("train2")
    r["tp1_eval2"] = run.eval()
    r["tp1_from_big_meta"] = load_checkpoint(os.path.join(d, "big1"), run.chunks, run.opt)
    r["tp1_from_big_eval1"] = run.eval()
    r["tp1_from_big_loss2"] = run.step("train2")
    r["tp1_from_big_eval2"] = run.eval()
    del run
    gc.collect()

    run = Run(family, LAYOUT_BIG, SEED + 1)
    r["big_fresh_eval"] = run.eval()
    r["big_from_tp1_meta"] = load_checkpoint(os.path.join(d, "tp1_1"), run.chunks, run.opt)
    r["big_from_tp1_eval1"] = run.eval()
    r["big_from_tp1_loss2"] = run.step("train2")
    r["big_from_tp1_eval2"] = run.eval()
    del run
    gc.collect()
    return r


def main():
    from ckpt_common import finish, fork_checkpoint_queue

    t0 = time.time()
    manager = fork_checkpoint_queue()
    out, families = sys.argv[1], sys.argv[2:]
    report = {f: family_run(f, out) for f in families}
    report["seconds"] = time.time() - t0
    finish(report, manager)


if __name__ == "__main__":
    main()
