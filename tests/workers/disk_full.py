"""A real checkpoint save (1 process) that runs out of space: first inside megatron's shard writing (the
writer raises ENOSPC after putting part of a file down), then when `latest` is replaced (for a new step, and
for the step `latest` names). Reports the errors, what the save_dir holds afterwards, and the verification of
the step that must have survived.
argv: save_dir."""
import builtins
import errno
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from moe.model import load_hf_config  # noqa: E402
from rlpo_mega import distributed  # noqa: E402
from rlpo_mega.checkpoint.dist import CheckpointError, read_meta  # noqa: E402
from rlpo_mega.checkpoint.files import verify_files  # noqa: E402
from rlpo_mega.config import load_config  # noqa: E402
from rlpo_mega.checkpoint import run as state  # noqa: E402
from rlpo_mega.model_setup import build_policy  # noqa: E402
from tests.dist import write_report  # noqa: E402

MODEL = "configs/models/tiny_qwen3_moe.json"


def main():
    save_dir = sys.argv[1]
    cfg = load_config(None, (f"model.hf_config={MODEL}",))
    hf = load_hf_config(MODEL)
    layout = distributed.init(cfg.parallel, hf, cfg.seed)
    chunks, opt = build_policy(hf, layout, cfg.model, cfg.optim)
    meta = {"model_type": hf.model_type, "run_id": "r"}
    save = lambda step: state.save(save_dir, step, chunks, opt, {"step": step}, 2, meta)  # noqa: E731
    save(1)

    from megatron.core import dist_checkpointing

    real_save = dist_checkpointing.save

    def full_disk(sharded, path, *a, **k):
        with open(os.path.join(path, "__0_0.distcp"), "wb") as f:
            f.write(b"partial shard")
        raise OSError(errno.ENOSPC, "No space left on device", os.path.join(path, "__0_0.distcp"))

    report = {}
    dist_checkpointing.save = full_disk
    try:
        save(2)
    except CheckpointError as e:
        report["shard_error"] = str(e)
    dist_checkpointing.save = real_save

    real_open = builtins.open

    def no_room_for_latest(file, *a, **k):
        if str(file).endswith("latest.tmp"):
            real_open(file, "w").close()  # created, then the write fails
            raise OSError(errno.ENOSPC, "No space left on device", str(file))
        return real_open(file, *a, **k)

    builtins.open = no_room_for_latest
    try:
        save(2)
    except CheckpointError as e:
        report["latest_error"] = str(e)
    try:  # saving the step `latest` already names (as a stop right after a resume does) replaces that
        save(1)  # very directory: it must survive a failure to rewrite `latest`
    except CheckpointError as e:
        report["resave_error"] = str(e)
    builtins.open = real_open
    step1 = state.step_dir(save_dir, 1)
    report.update(after=sorted(os.listdir(save_dir)), latest=open(os.path.join(save_dir, "latest")).read().strip(),
                  verified=verify_files(step1, read_meta(step1)["files"]))
    write_report(report)
    distributed.destroy()


if __name__ == "__main__":
    main()
