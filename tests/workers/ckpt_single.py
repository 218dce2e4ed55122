"""One process (TP1, world 1): load what ckpt_reshard.py saved at TP2/EP2/PP2 on 8 processes, resume,
a no-optimizer-state control, and the failure modes (interrupted save, crash mid-save).
Usage: ckpt_single.py OUT_DIR FAMILY...
"""
import gc
import os
import sys
import time


def family_run(family, out, with_failures):
    from ckpt_common import LAYOUT_TP1, SEED, Run

    from rlpo_mega.checkpoint.dist import load_checkpoint

    r = {}
    big1 = os.path.join(out, family, "big1")

    run = Run(family, LAYOUT_TP1, SEED + 2)
    r["layout"] = run.describe()
    r["fresh_eval"] = run.eval()
    r["meta"] = load_checkpoint(big1, run.chunks, run.opt)
    r["eval1"] = run.eval()
    r["loss2"] = run.step("train2")
    r["eval2"] = run.eval()
    if with_failures:
        r["failures"] = failures(run, os.path.join(out, "single", family))
    del run
    gc.collect()

    # Control: same weights, fresh optimizer state -> step 2 must land elsewhere, or the resume
    # comparison above would prove nothing about the optimizer state.
    run = Run(family, LAYOUT_TP1, SEED + 3)
    load_checkpoint(big1, run.chunks)
    r["model_only_eval1"] = run.eval()
    run.step("train2")
    r["model_only_eval2"] = run.eval()
    del run
    gc.collect()
    return r


def failures(run, d):
    from megatron.core import dist_checkpointing

    from rlpo_mega.checkpoint.dist import CheckpointError, load_checkpoint, save_checkpoint

    f = {}
    ckpt = os.path.join(d, "ckpt")
    save_checkpoint(ckpt, run.chunks, run.opt, meta={"step": 2})
    f["saved_eval"] = run.eval()
    run.step("train1")  # move on, so that reloading is visible
    f["moved_eval"] = run.eval()

    real_save = dist_checkpointing.save

    def failing_save(state, directory, *args, **kwargs):
        real_save(state, directory, *args, **kwargs)  # data written, then an error (a full disk, a bug)
        raise RuntimeError("simulated failure during save")

    dist_checkpointing.save = failing_save
    try:
        save_checkpoint(ckpt, run.chunks, run.opt, meta={"step": 3})
        f["error_raised"] = None
    except CheckpointError as e:
        f["error_raised"] = str(e)
    finally:
        dist_checkpointing.save = real_save
    f["dirs_after_error"] = sorted(os.listdir(d))  # the failed save removed its own .tmp

    def crashing_save(state, directory, *args, **kwargs):
        real_save(state, directory, *args, **kwargs)  # data written, then the job dies (no clean-up runs)
        raise SystemExit("simulated crash during save")

    dist_checkpointing.save = crashing_save
    try:
        save_checkpoint(ckpt, run.chunks, run.opt, meta={"step": 3})
        f["crash_raised"] = None
    except SystemExit as e:
        f["crash_raised"] = str(e)
    finally:
        dist_checkpointing.save = real_save
    f["tmp_left"] = sorted(os.listdir(d))
    f["meta_after_crash"] = load_checkpoint(ckpt, run.chunks, run.opt)
    f["eval_after_crash"] = run.eval()

    def error_of(path, optimizer):
        try:
            load_checkpoint(path, run.chunks, optimizer)
        except CheckpointError as e:
            return str(e)
        return None

    f["interrupted_error"] = error_of(ckpt + ".tmp", run.opt)
    f["missing_error"] = error_of(os.path.join(d, "nope"), run.opt)
    save_checkpoint(os.path.join(d, "model_only"), run.chunks, None)
    f["no_optimizer_error"] = error_of(os.path.join(d, "model_only"), run.opt)
    save_checkpoint(ckpt, run.chunks, run.opt, meta={"step": 4})  # replaces the stale .tmp
    f["dirs_after_resave"] = sorted(os.listdir(d))
    f["meta_after_resave"] = load_checkpoint(ckpt, run.chunks, run.opt)
    return f


def main():
    from ckpt_common import finish, fork_checkpoint_queue

    t0 = time.time()
    manager = fork_checkpoint_queue()
    out, families = sys.argv[1], sys.argv[2:]
    report = {fam: family_run(fam, out, with_failures=i == 0) for i, fam in enumerate(families)}
    report["seconds"] = time.time() - t0
    finish(report, manager)


if __name__ == "__main__":
    main()
