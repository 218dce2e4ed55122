"""TRL side of tools/bench_vs_trl.py: GSPO on the toy addition task with TRL's GRPOTrainer, on CPU, fp32.

Runs INSIDE .venv-trl (tools/trl_support/build_env.sh) and never imports rlpo_mega: TRL is no dependency of the
product. The settings transcribe configs/demo_cpu.yaml's RL phase so the two step times compare like for like.

  .venv-trl/bin/python tools/trl_support/trl_grpo.py --model HF_DIR --data JSONL --out steps.jsonl
  OMP_NUM_THREADS=1 .venv-trl/bin/torchrun --nproc-per-node 2 tools/trl_support/trl_grpo.py ...   # DDP, gloo

--out gets a first line {"meta": {...versions, world size, threads, settings}}, then one line per optimizer
step: {"step", "time_s", "reward_mean"}. time_s is rank 0's wall time from on_step_begin to on_step_end; TRL
generates (and scores) inside training_step, which runs between the two (transformers Trainer's inner loop), so
a step's time holds generation + reward + the loss forward/backward + DDP all-reduce + clip + Adam.
"""
import argparse
import json
import os
import re
import sys
import time


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", help="HF model dir, with its tokenizer and chat template")
    p.add_argument("--data", help="JSONL of {prompt, answer, ...} records")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--prompts-per-step", type=int, default=64)
    p.add_argument("--n-samples", type=int, default=8)
    p.add_argument("--threads", type=int, default=0,
                   help="torch threads per process; 0: $OMP_NUM_THREADS, else cores // processes")
    p.add_argument("--out", help="JSONL written by rank 0")
    p.add_argument("--meta", action="store_true", help="print the versions as JSON and exit")
    a = p.parse_args(argv)
    if not a.meta and not (a.model and a.data and a.out):
        p.error("--model, --data and --out are required")
    return a


args = parse_args()
WORLD = int(os.environ.get("WORLD_SIZE", "1"))
# threads are fixed before torch starts its OpenMP pool: 2 cores here, so 2 for 1 process and 1 each for 2
THREADS = args.threads or int(os.environ.get("OMP_NUM_THREADS", "0")) or max(1, (os.cpu_count() or 1) // WORLD)
os.environ["OMP_NUM_THREADS"] = str(THREADS)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
import transformers  # noqa: E402
import trl  # noqa: E402

torch.set_num_threads(THREADS)
VERSIONS = {"trl": trl.__version__, "transformers": transformers.__version__, "torch": torch.__version__}
if args.meta:
    print(json.dumps(VERSIONS))
    sys.exit(0)

from datasets import Dataset  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

tok = AutoTokenizer.from_pretrained(args.model)
# fp32 like the demo (params_dtype: float32); output_router_logits stays as the config has it (false): no aux loss
model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
assert not model.config.output_router_logits, "the demo trains without the MoE aux loss"

# conversational prompts: TRL renders them with the tokenizer's chat template and add_generation_prompt=True,
# which gives the same ids as our framework's tok(apply_chat_template(..., tokenize=False), add_special_tokens=False)
# (checked once on this data with TRL 1.16 / transformers 5.19: identical ids for all 512 prompts)
with open(args.data) as f:
    records = [json.loads(line) for line in f if line.strip()]
dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": r["prompt"]}], "answer": str(r["answer"])}
                             for r in records])

_INT = re.compile(r"-?\d+")


def toy_arith(prompts, completions, completion_ids, answer, **_):
    """Our toy_arith: 1.0 if the first integer of the completion is the answer, else 0.0. The text is the
    completion's ids decoded with skip_special_tokens=True (TRL passes the ids cut after the first EOS)."""
    out = []
    for ids, want in zip(completion_ids, answer):
        m = _INT.search(tok.decode(ids, skip_special_tokens=True))
        out.append(float(m is not None and int(m.group()) == int(want.strip())))
    return out


n_completions = args.prompts_per_step * args.n_samples  # 64 x 8 = 512 per optimizer step
assert n_completions % WORLD == 0, (n_completions, WORLD)
cfg = GRPOConfig(
    output_dir=os.path.join(os.path.dirname(os.path.abspath(args.out)), "trl_output"),  # nothing is saved there
    seed=args.seed,
    max_steps=args.steps,
    # one optimizer step per rollout batch: each process takes its 512/world share in one micro-batch, and the
    # generation batch is that same global batch (steps_per_generation=1), used once (num_iterations=1)
    per_device_train_batch_size=n_completions // WORLD,
    gradient_accumulation_steps=1,
    steps_per_generation=1,
    num_iterations=1,
    num_generations=args.n_samples,
    shuffle_dataset=True,
    # GSPO as the demo: sequence-level ratio, the paper's clip range, no KL (so no reference model is loaded)
    importance_sampling_level="sequence",
    epsilon=3e-4,
    epsilon_high=4e-4,
    beta=0.0,
    # "grpo" = per sequence, the mean over its completion tokens, then the mean over the sequences: the demo's
    # seq-mean-token-mean. ("dapo", TRL's default, is a global token mean; "dr_grpo" divides by max length.)
    # DDP averages the per-process means; every process has the same number of sequences, so this is the global one.
    loss_type="grpo",
    # (r - group mean) / (group std + 1e-4), unbiased std: the demo's grpo advantage, but for its eps (1e-6; TRL's
    # 1e-4 is hard-coded). It only matters for groups whose rewards are all equal, whose advantages are 0 either way.
    scale_rewards="group",
    # sampling: the demo's tempered distribution, no top-p/top-k truncation, 4 new tokens
    temperature=1.5,
    top_p=1.0,
    top_k=0,
    max_completion_length=4,
    # optimizer: Adam(W) with wd 0 = Adam, betas (0.9, 0.999), eps 1e-8; constant lr, no warm-up; clip 1.0
    learning_rate=2e-3,
    lr_scheduler_type="constant",
    warmup_steps=0,
    weight_decay=0.0,
    adam_beta1=0.9,
    adam_beta2=0.999,
    adam_epsilon=1e-8,
    max_grad_norm=1.0,
    # no MoE load-balancing loss, as the demo: TRL adds one whenever the config HAS output_router_logits (even
    # false) and router_aux_loss_coef != 0 (this config: 0.001), turning the router logits on; 0.0 keeps it off
    router_aux_loss_coef=0.0,
    disable_dropout=True,
    # CPU, fp32 (GRPOConfig defaults bf16 to True), DDP over gloo; the experts are 3-D parameters that every step
    # uses, so DDP need not search for unused parameters (that search costs a graph walk per step)
    use_cpu=True,
    bf16=False,
    fp16=False,
    ddp_backend="gloo" if WORLD > 1 else None,
    ddp_find_unused_parameters=False,
    # reward_mean comes from TRL's own per-step log (the mean over all processes' completions): log every step;
    # no wandb/tensorboard, no checkpoints, no eval
    logging_steps=1,
    report_to=[],
    save_strategy="no",
    eval_strategy="no",
    dataloader_num_workers=0,
)


class StepTimer(TrainerCallback):
    """Wall time of each optimizer step (generation included, see the module doc); rank 0 writes one line per step
    when TRL logs that step's metrics, right after on_step_end (so the log gathering is outside the interval)."""

    def __init__(self, path):
        self.path, self.t0, self.time_s, self.end = path, None, None, None

    def on_step_begin(self, a, state, control, **kw):
        self.t0 = time.perf_counter()

    def on_step_end(self, a, state, control, **kw):
        self.time_s = time.perf_counter() - self.t0
        self.end = time.time()  # wall clock: the bench also compares the interval between consecutive step ends

    def on_log(self, a, state, control, logs=None, **kw):
        if state.is_world_process_zero and logs and "reward" in logs and self.time_s is not None:
            with open(self.path, "a") as f:
                f.write(json.dumps({"step": state.global_step, "time_s": round(self.time_s, 4), "end": self.end,
                                    "reward_mean": logs["reward"]}) + "\n")
            self.time_s = None


if int(os.environ.get("RANK", "0")) == 0:
    meta = dict(VERSIONS, world_size=WORLD, threads=THREADS, model=args.model, data=args.data, seed=args.seed,
                prompts_per_step=args.prompts_per_step, n_samples=args.n_samples, loss_type=cfg.loss_type)
    with open(args.out, "w") as f:
        f.write(json.dumps({"meta": meta}) + "\n")

trainer = GRPOTrainer(model=model, reward_funcs=toy_arith, args=cfg, train_dataset=dataset,
                      processing_class=tok, callbacks=[StepTimer(args.out)])
trainer.train()
