"""Two processes (EP2, so both ranks write megatron shards): trainer saves (rlpo_mega.checkpoint.run.save, with
trainer state, HF files and each rank's own state) watched by an audit hook that records every file opened for
reading under the step being saved, on both ranks (the writer processes megatron forks only write). Then rank 0
hashes what is on disk, and loads: intact, one byte flipped in a shard, and with the meta file of older saves
(sizes only, and no file list at all).
Usage: ckpt_digests.py OUT_DIR
"""
import json
import os
import sys
import time


def read_opens(root: str) -> tuple[list, callable]:
    """(the list the audit hook fills while on[0], on): files under root opened for reading by this process."""
    seen, on = [], [False]
    root = os.path.realpath(root)

    def hook(event, args):
        if event != "open" or not on[0] or not isinstance(args[0], (str, bytes, os.PathLike)):
            return
        path, mode, flags = args
        reading = ("r" in mode or "+" in mode) if mode else (flags & os.O_ACCMODE) != os.O_WRONLY
        path = os.path.realpath(os.fsdecode(path))
        if reading and path.startswith(root + os.sep):
            seen.append(os.path.relpath(path, root))

    sys.addaudithook(hook)
    return seen, on


def main():
    import torch
    import xxhash
    from ckpt_common import SEED, Run, finish, fork_checkpoint_queue

    manager = fork_checkpoint_queue()
    out = sys.argv[1]
    from rlpo_mega.checkpoint import run as state
    from rlpo_mega.checkpoint.dist import CheckpointError, read_meta

    run = Run("qwen3_moe", ("parallel.expert=2", "parallel.num_micro_batches=1"), SEED)
    run.step("train1")  # Adam's state exists from the first step on
    me = torch.distributed.get_rank()
    save_dir = os.path.join(out, "ck")
    seen, on = read_opens(save_dir)
    r = {"layout": run.describe()}

    def save(step, **kw):
        on[0] = True
        t0 = time.perf_counter()
        try:
            state.save(save_dir, step, run.chunks, run.opt, {"step": step}, 3, {"run_id": "r"},
                       hf_files={"config.json": b'{"model_type": "qwen3_moe"}'}, rank_state={"rank": me}, **kw)
        finally:
            on[0] = False
        every = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(every, sorted(seen))
        seen.clear()
        return {"read": every, "seconds": time.perf_counter() - t0}

    r["regular"] = save(1)
    r["sigterm"] = save(2, checksums=False)  # the trainer's save on SIGTERM today
    if me == 0:
        for step in (1, 2):
            path = state.step_dir(save_dir, step)
            on_disk = {}
            for d, _, names in os.walk(path):
                for n in names:
                    with open(os.path.join(d, n), "rb") as f:
                        data = f.read()
                    on_disk[os.path.relpath(os.path.join(d, n), path)] = [len(data), xxhash.xxh3_64_hexdigest(data)]
            r[f"step{step}"] = {"meta_files": read_meta(path)["files"], "on_disk": on_disk}
    torch.distributed.barrier()

    step1 = state.step_dir(save_dir, 1)

    def load():
        try:
            state.load(step1, run.chunks, run.opt)
            return None
        except CheckpointError as e:
            return str(e)

    r["loads"] = load()
    shard = os.path.join(step1, sorted(n for n in os.listdir(step1) if n.endswith(".distcp"))[-1])
    if me == 0:
        with open(shard, "r+b") as f:  # one byte changed, the size kept
            f.seek(100)
            byte = f.read(1)
            f.seek(100)
            f.write(bytes([byte[0] ^ 0xFF]))
    torch.distributed.barrier()
    r["corrupted"] = load()
    r["shard"] = shard
    meta_file = os.path.join(step1, "rlpo_meta.json")
    if me == 0:
        with open(shard, "r+b") as f:
            f.seek(100)
            f.write(byte)
        with open(meta_file) as f:
            meta = json.load(f)
        sizes_only = {**meta, "files": {n: [size, None] for n, (size, _) in meta["files"].items()}}
        no_files = {k: v for k, v in meta.items() if k != "files"}
    for name, older in (("sizes_only", "sizes_only"), ("no_files", "no_files")):
        if me == 0:
            with open(meta_file, "w") as f:
                json.dump(sizes_only if older == "sizes_only" else no_files, f)
        torch.distributed.barrier()
        r[f"{name}_loads"] = load()
    finish(r, manager)


if __name__ == "__main__":
    main()
