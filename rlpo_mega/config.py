"""Typed configuration: one dataclass per component, loaded from YAML with dotted overrides (OmegaConf).

Unknown keys, wrong types and missing values are rejected by OmegaConf's structured-config schema;
`load_config` turns its exceptions into one message that names the key and, for a typo, a suggestion.
A closed choice is a `Literal` (validated here, with the message config_checks gives an unknown registry name);
a name looked up in an open registry (loss, advantage and KL estimators, reward, engine, transport) is a `str`
that config_checks checks against its registry.
"""
from __future__ import annotations

import dataclasses
import difflib
import os
import typing
from dataclasses import dataclass, field
from typing import Iterable, Literal, Optional

from omegaconf import OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException


class ConfigError(ValueError):
    pass


@dataclass
class ParallelConfig:
    tensor: int = 1  # TP
    pipeline: int = 1  # PP
    expert: int = 1  # EP
    expert_tensor: Optional[int] = None  # ETP; None = same as tensor (megatron's default)
    sequence_parallel: Optional[bool] = None  # None = on whenever tensor > 1 (required with MoE)
    # CP: each packed sequence split over `context` ranks (megatron-core's THD layout: padded to 2 x context
    # (x tensor), chunks r and 2cp-1-r per rank); data-parallel size = world / (tensor x pipeline x context)
    context: int = 1
    micro_batch_size: int = 1
    num_micro_batches: int = 1


@dataclass
class LoRAConfig:
    """model.lora: train low-rank adapters on a frozen base (moe/lora.py); rank 0 trains the whole model."""
    rank: int = 0
    alpha: float = 16.0  # the side path is scaled by alpha / rank
    dropout: float = 0.0  # only 0: a dropped adapter input would make the learner's log-probs differ from the sampler's
    # where: attention (qkv, output projection), experts (the routed experts' fc1/fc2), shared_experts, dense_mlp
    # (dense layers' fc1/fc2); never the router (R3 replays the learner's own routes), the embedding or the output
    targets: list[str] = field(default_factory=lambda: ["attention", "experts", "shared_experts", "dense_mlp"])
    # the routed experts' factors: each expert's own A and B, one pair shared by the layer's experts, or
    # shared_outer (fc1's A and fc2's B shared, the rest each expert's own: what SGLang serves natively)
    expert_layout: Literal["per_expert", "shared", "shared_outer"] = "shared_outer"
    # what a checkpoint holds: "adapters" the factors and their optimizer state only (MBs, where the base is GBs),
    # the base reloaded from model.init_from_hf at a resume or an export and refused there if it is not the one
    # the run trained on (its fingerprint, recorded); "full" the base too; "auto" adapters where model.init_from_hf
    # is set, else full (a base made by the run's own initialisation exists nowhere else)
    save: Literal["auto", "adapters", "full"] = "auto"


@dataclass
class ModelConfig:
    hf_config: str = "configs/models/tiny_qwen3_moe.json"  # config.json (or a directory holding it)
    init_from_hf: Optional[str] = None  # HF checkpoint directory to load weights from (weight bridge)
    params_dtype: Literal["float32", "bfloat16"] = "float32"
    vocab_divisible_by: int = 128  # megatron pads the vocabulary; independent of TP so checkpoints reshard
    token_dispatcher: Literal["alltoall", "allgather"] = "alltoall"
    recompute: bool = False
    # Sigmoid routers with a score-correction bias (glm4_moe, deepseek_v3): megatron's aux-loss-free update,
    # bias += rate * sign(mean load - expert load) per step. 0 (as slime's GLM script runs RL) keeps the
    # checkpoint's bias, so replayed batches never move it and the engine routes with the bias the learner has.
    expert_bias_update_rate: float = 0.0
    lora: LoRAConfig = field(default_factory=LoRAConfig)

    def adapters_only(self) -> bool:
        """Whether a LoRA run's checkpoints hold its adapters only (model.lora.save; "auto": where the base can be
        reloaded from model.init_from_hf)."""
        lo = self.lora
        return bool(lo.rank) and (lo.save == "adapters" or (lo.save == "auto" and bool(self.init_from_hf)))


@dataclass
class OptimConfig:
    lr: float = 1.0e-4
    min_lr: float = 0.0
    # Schedule over optimizer steps (RL steps x trainer.mini_batches x trainer.epochs), megatron-core's
    # OptimizerParamScheduler: linear warm-up from lr_warmup_init to lr, then the decay style down to min_lr.
    lr_warmup_steps: int = 0
    lr_warmup_init: float = 0.0
    lr_decay_style: Literal["constant", "linear", "cosine", "inverse-square-root"] = "constant"
    lr_decay_steps: int = 0  # 0 = every optimizer step of the run
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1.0e-8
    clip_grad: float = 1.0
    use_distributed_optimizer: bool = False
    # megatron-core's optimizer CPU offload (HybridDeviceOptimizer; needs use_distributed_optimizer): the fp32 master
    # weights and Adam moments of `offload_fraction` of each rank's optimizer shard live and step in host memory
    # (torch AdamW on the CPU), the rest on the accelerator; gradients go to the host and weights come back each step.
    cpu_offload: bool = False
    offload_fraction: float = 1.0  # megatron-core's own default is 0.0 (nothing offloaded); Megatron-LM's CLI 1.0
    overlap_cpu_optimizer_d2h_h2d: bool = False  # one host optimizer per param, copies on side streams (CUDA)
    # megatron's use_precision_aware_optimizer (needs use_distributed_optimizer): the optimizer holds the main
    # weights, so the accelerator keeps no fp32 main shard of its own: with cpu_offload the master copy is only on
    # the host (slime's one-node flags). Without cpu_offload it needs Transformer Engine's FusedAdam, which also
    # takes the moment dtypes below; the host optimizer keeps its moments in fp32.
    precision_aware: bool = False
    exp_avg_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    exp_avg_sq_dtype: Literal["float32", "bfloat16", "float16"] = "float32"


@dataclass
class CheckpointConfig:
    save_dir: Optional[str] = None  # step_<N>/ directories under it (atomic), plus `latest`
    load_dir: Optional[str] = None  # a step_<N>/ directory (or a save_dir: its latest) to start from
    resume: bool = True  # with save_dir holding a checkpoint and no load_dir: continue from its latest
    save_every: int = 0  # steps between saves (0: only at the end and on SIGTERM)
    keep_last: int = 2  # older step_<N>/ directories are deleted after a successful save
    export_hf: bool = False  # also write an HF checkpoint (step_<N>/hf_model, from_pretrained-able) at each save
    load_optimizer: bool = True  # false: weights only (e.g. an SFT checkpoint as the RL start)
    # true: this run may replace the checkpoints of another run in save_dir (or steps past the one it resumes
    # from); they are deleted after its first save. false: such a save_dir is refused at start
    overwrite: bool = False
    # check every file against the checksums recorded at save before loading (tools/bench_checkpoint.py: cost)
    verify: bool = True


@dataclass
class WarmupConfig:
    """Optional supervised warm-up before RL (the CPU demo teaches its tiny random model the answer
    format on random answers, so RL starts near zero reward and must learn the task itself)."""
    path: Optional[str] = None  # JSONL of {prompt, answer}: next-token loss on the answer + eos
    steps: int = 0
    batch_size: int = 32
    lr: Optional[float] = None  # None = optim.lr


@dataclass
class TrainerConfig:
    epochs: int = 1  # policy-update passes over each rollout batch
    mini_batches: int = 1  # optimizer steps per epoch: the rollout batch is split into this many
    eval_every: int = 0  # steps between evaluations (0: never)
    eval_path: Optional[str] = None  # prompt file for evaluation (greedy, reward mean/accuracy)
    eval_size: int = 64  # prompts evaluated (the first ones of eval_path)
    max_bad_steps: int = 3  # consecutive steps with a non-finite loss or gradient before the run stops
    engine_restarts: int = 1  # a failed rollout engine is rebuilt (and re-synced) this many times
    # packed: samples back to back in one row per micro-batch (THD), DP split balanced by tokens; padded: one
    # sample per row, padded to the step's longest (the reference layout; equal rows per rank)
    layout: Literal["packed", "padded"] = "packed"
    # packed: cut each rank's samples into micro-batches of at most this many tokens (None: exactly
    # parallel.num_micro_batches micro-batches, balanced by tokens); every rank runs as many as the busiest.
    # Under context parallelism the budget is the CP group's: the padded row (each sample padded to 2 x cp x tp)
    # that its ranks split
    max_tokens_per_micro_batch: Optional[int] = None
    # the exchange of a step's samples (training/exchange.py) runs in rounds of at most this many MB sent and
    # received per rank (a single larger sample alone): its buffers on the GPU stay this size whatever the batch
    exchange_round_mb: int = 256
    # auto: when one optimizer step consumes each rollout batch (and nothing else makes the update's forward
    # differ from an old-policy forward: training/old_logprobs.old_pass_needed), the old log-probs are the
    # update's own, detached -- no separate forward pass; recompute: always run the old-log-prob pass
    old_logprobs: Literal["auto", "recompute"] = "auto"
    # per_step: Python's automatic garbage collection is off while the run lasts and every rank collects after
    # each step, the young generations (everything every gc_full_every steps): no full collection in the middle
    # of a rollout or a collective (training/garbage.py says what it cost); automatic: Python's own collector
    gc: Literal["per_step", "automatic"] = "per_step"
    gc_full_every: int = 10
    # asynchronous RL (rollout.producer=async): a sample whose oldest token was sampled more than this many
    # policy versions (weight syncs) before the learner's is not trained on. 0: each step's groups are generated
    # on the weights of the last sync (today's synchronous step); k >= 1: generation for the next k steps runs
    # while the learner trains (rollout/producers/asynchronous.py)
    max_staleness: int = 0
    warmup: WarmupConfig = field(default_factory=WarmupConfig)


@dataclass
class LoggingConfig:
    wandb: bool = True
    project: str = "rlpo-mega"
    run_name: Optional[str] = None  # None = "run-<UTC date-time>"
    entity: Optional[str] = None
    mode: Literal["offline", "online", "disabled"] = "offline"  # the WANDB_MODE environment variable wins
    dir: Optional[str] = None  # run directory (metrics.jsonl, config.json, wandb/); None = runs/<run_name>
    console_every: int = 1  # a console line every N steps (0 = never)
    progress_bar: bool = True  # tqdm bars for rollouts and steps (rank 0, only on a terminal)
    plot: bool = True  # draw <dir>/curves.png when the run ends (rlpo-mega plot RUN draws it any time)
    # CUDA: count the host syncs of the old-log-prob pass and the update each step (perf/host_syncs_*, torch's
    # sync debug mode: a diagnostic, it slows each sync a little); ignored without CUDA
    host_syncs: bool = False


@dataclass
class PolicyLossConfig:
    name: str = "grpo"  # ppo_clip | grpo | dapo | gspo | gspo_token | sapo (rlpo_mega.algorithms.losses)
    # None = the paper's aggregation for the loss
    aggregation: Optional[Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]] = None
    strict: bool = False  # an aggregation that is a known pitfall for this loss: error instead of warning
    eps_low: Optional[float] = None  # clip range; None = the paper's (grpo 0.2/0.2, dapo 0.2/0.28, gspo 3e-4/4e-4)
    eps_high: Optional[float] = None
    dual_clip: Optional[float] = None  # c > 1: dual clip for A < 0 (token clip losses); off by default
    tau_pos: float = 1.0  # sapo temperature for A > 0
    tau_neg: float = 1.05  # sapo temperature for A <= 0
    log_ratio_clamp: float = 10.0  # gspo: clamp of the mean log-ratio before exp
    norm_length: Optional[int] = None  # L of seq-mean-token-sum-norm (Dr. GRPO's constant, e.g. max response length)


@dataclass
class AdvantageConfig:
    name: str = "grpo"  # grpo | dr_grpo | rloo | gae (PPO with a critic: turns the value model on, see `critic`)
    eps: float = 1.0e-6  # grpo: (R - mean) / (std + eps)
    std: Literal["unbiased", "biased"] = "unbiased"
    gamma: float = 1.0  # gae: discount over response tokens
    lam: float = 0.95  # gae: lambda (1: Monte-Carlo return minus V; 0: TD(0))
    whiten: bool = True  # gae: advantages -> (A - mean) / std over the rollout batch's tokens


@dataclass
class KLConfig:
    coef: float = 0.0  # off by default (DAPO, GSPO); the GRPO paper uses 0.04 with k3
    estimator: str = "k3"  # k1 | k2 | k3 | k3+
    # gae only: fold the penalty into the token rewards (RLHF-PPO: r_t -= coef * (log pi_old - log pi_ref))
    # instead of adding coef * KL to the loss
    in_reward: bool = False


@dataclass
class MismatchConfig:
    mode: Literal["none", "tis", "mis"] = "none"  # w = pi_old_train / pi_rollout
    level: Literal["token", "sequence", "geometric"] = "token"
    tis_cap: float = 2.0  # TIS: loss * min(w, C)
    mis_low: float = 0.5  # MIS: tokens with w outside [mis_low, mis_high] are masked
    mis_high: float = 2.0


@dataclass
class ShapingConfig:
    overlong_filter: bool = False  # mask truncated samples out of the loss
    soft_overlong: bool = False  # DAPO soft overlong punishment added to the reward
    max_response_length: Optional[int] = None  # L_max
    overlong_cache: Optional[int] = None  # L_cache


@dataclass
class DynamicSamplingConfig:
    enabled: bool = False  # drop groups with all-equal scores and over-sample
    # chunks of prompts each engine rank submits per step at most (each: ceil(its share of the step's groups x
    # prompts.oversample) prompts); the step ends as soon as the rank's groups are complete, the rest is aborted
    max_tries: int = 3
    # surplus complete groups (mixed rewards, beyond the step's share) carry to the next steps, marked with the
    # policy version that sampled them, and are dropped once more than this many versions old (0: never carried)
    max_carry_steps: int = 1


@dataclass
class AlgorithmConfig:
    loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    kl: KLConfig = field(default_factory=KLConfig)
    mismatch: MismatchConfig = field(default_factory=MismatchConfig)
    shaping: ShapingConfig = field(default_factory=ShapingConfig)
    dynamic_sampling: DynamicSamplingConfig = field(default_factory=DynamicSamplingConfig)
    temperature: float = 1.0  # must equal the rollout engine's sampling temperature
    logprob_chunk_size: Optional[int] = None  # tokens per chunk of the log-prob kernel; None = auto


@dataclass
class RoutingConfig:
    mode: Literal["off", "r2", "r3"] = "off"  # r2: replay the old-log-prob pass's routes; r3: the rollout's
    # fallback: bad (token, layer) entries of a route trace use the live router (counted)
    on_bad_trace: Literal["error", "fallback"] = "error"


@dataclass
class RemoteRewardConfig:
    url: Optional[str] = None  # POST {"prompts", "responses", "references"} -> {"rewards": [float]}
    timeout: float = 30.0  # seconds per HTTP attempt
    retries: int = 2  # extra attempts after a connection error, timeout, 429 or 5xx (not after a bad reply)
    backoff: float = 0.5  # seconds before the first retry, doubled each retry
    batch_size: int = 64  # samples per request


@dataclass
class RewardConfig:
    function: str = "math"  # math | exact_match | toy_sequence | toy_arith | remote (rlpo_mega.rewards)
    default: float = 0.0  # reward of a sample whose reward function raised, timed out or returned a non-number
    timeout: Optional[float] = 60.0  # seconds per call (one sample, or one remote batch); None = no limit
    num_workers: int = 4  # threads running reward calls concurrently
    ignore_case: bool = False  # exact_match
    remote: RemoteRewardConfig = field(default_factory=RemoteRewardConfig)


@dataclass
class EnvironmentConfig:
    """Multi-turn episodes (rlpo_mega.rollout.episode): after each model turn the environment answers with an
    observation appended in the chat template's turn format, a reward contribution and whether the episode is
    over; the episode's reward is the sum (reward.* is not used). name null: single-turn samples."""
    name: Optional[str] = None  # an ENVIRONMENTS entry (rlpo_mega.environments)
    max_turns: int = 4  # model turns per episode; one still going after them ends truncated ("length")
    max_tokens: int = 256  # response tokens per episode, the model's and the observations' (rollout.max_new_tokens
    # is each turn's budget); an episode that reaches it ends truncated
    timeout: Optional[float] = 30.0  # seconds per environment step; None = no limit
    num_workers: int = 8  # threads running environment steps concurrently
    failure_reward: float = 0.0  # reward of an episode whose environment step raised or timed out (flagged)
    # lockstep: each engine call carries every live episode's next turn, after all their environment steps
    # (reproducible: the calls' contents and seeds do not depend on timing); continuous: an episode's next turn
    # joins the next engine call as soon as its own environment step returns, so a slow tool holds back only its
    # episode (rollout/episode.py)
    turns: Literal["lockstep", "continuous"] = "lockstep"
    options: dict = field(default_factory=dict)  # the environment's own settings


@dataclass
class PromptDataConfig:
    path: Optional[str] = None  # .jsonl or .parquet file of prompts
    format: Literal["auto", "jsonl", "parquet"] = "auto"  # auto: by the file's extension
    prompt_key: str = "prompt"  # a string, or a list of {"role", "content"} chat messages
    answer_key: str = "answer"  # reference answer (string or number) given to the reward function
    tokenizer: Optional[str] = None  # tokenizer directory; None = the model's
    chat_template: Literal["auto", "on", "off"] = "auto"  # auto: when the tokenizer has one
    system_prompt: Optional[str] = None
    shuffle: bool = True
    seed: Optional[int] = None  # None = the run's seed
    prompts_per_step: int = 8
    n_samples: int = 4  # responses per prompt (the group size)
    oversample: float = 1.0  # dynamic sampling: a chunk holds this many times a rank's share of the step's prompts


@dataclass
class EmbeddedEngineConfig:
    # sequences per generate() forward; None: every request of the call (a step's whole rollout) at once
    batch_size: Optional[int] = None
    max_batch_tokens: Optional[int] = None  # cap rows x (longest prompt + max_new_tokens) per batch (memory)
    capture_routes: bool = True  # forward hooks on the routers (needed for R3)
    attn_implementation: Literal["sdpa", "eager"] = "sdpa"  # transformers attention backend


@dataclass
class SGLangEngineConfig:
    # attach to running servers (one per engine-TP group): the servers themselves, not a router in front of them
    # (weight sync, digests, aborts by rid and health go to each server; sglang-router 0.3.2 drops
    # return_routed_experts from /generate)
    urls: list[str] = field(default_factory=list)
    # start servers (launch/sglang_server.py) when urls is empty: one launcher per node (its local rank 0), each
    # server on its own GPUs after the node's learner ranks'; several nodes need host 0.0.0.0 (URLs name the node)
    launch: bool = False
    num_servers: int = 1  # launch: servers per node
    # learner ranks that drive the servers (evenly spaced: ranks 0, world/drivers, ...; = nodes: one per node),
    # each over its own contiguous share of the servers and of the prompts, each receiving the full weights
    drivers: int = 1
    tp_size: int = 1
    host: str = "127.0.0.1"
    base_port: int = 30000
    server_args: dict = field(default_factory=dict)  # extra sglang ServerArgs (e.g. attention_backend)
    request_timeout: float = 600.0  # seconds per generate request (a whole long-CoT generation)
    control_timeout: float = 300.0  # seconds per weight-update / digest / group call (apart from generation)
    hang_timeout: float = 120.0  # a server with requests in flight that answers no GET /health for this long
    health_interval: float = 10.0  # is hung; /health is polled this often while a rollout waits
    startup_timeout: float = 300.0  # seconds to wait for /health after launch
    max_restarts: int = 1  # a dead launched server is restarted this many times, then the run stops
    # a dead server's requests go to the driver's other servers and it leaves the weight group (rejoining at a
    # sync once it answers again); below this many live servers per driver the rollout fails (guard: rebuild/stop)
    min_servers: int = 1
    health_timeout: float = 5.0  # seconds for GET /health (and short control calls: x6)
    # how servers reach a driver on node 0 (None: MASTER_ADDR, else loopback); drivers on other nodes: their hostname
    learner_address: Optional[str] = None
    # each driver's TCP store for its servers (weight-sync group, digest reports); 0 = free; driver i: store_port + i
    store_port: int = 0
    flush_retries: int = 20  # /flush_cache refuses while requests run: retried with backoff (<= 2 s)
    max_in_flight_per_server: int = 128  # generate requests in flight per server (total: x servers)
    # answers read and decoded at once by the driver: bounds the raw bodies it holds (2 KB per token at 48 layers
    # x top-8), whatever the number in flight; more only helps while decoding lags the servers
    decode_concurrency: int = 1
    python: Optional[str] = None  # launch: interpreter of the environment that has sglang (None: this one)
    log_dir: Optional[str] = None  # launch: per-server log files (None: ./logs/sglang)
    env: dict = field(default_factory=dict)  # launch: extra environment variables for the servers
    # the environment variable holding the job's key for its servers (never the key itself: this config is logged).
    # Every request carries it; servers launched here are started with it (made for the run when unset); the
    # sbatch scripts make one per job. Unset with rollout.sglang.urls: requests go without a key (a warning: only
    # a server that answers anyone takes them). launch/README.md, "Keys".
    api_key_env: str = "RLPO_SGLANG_KEY"


@dataclass
class RolloutConfig:
    engine: str = "embedded"  # embedded | sglang (rlpo_mega.rollout ENGINES)
    producer: str = "sync"  # how a step's scored groups are made (rlpo_mega.rollout.producers PRODUCERS): sync, async
    # async: true: a weight sync aborts the running requests and each continues after it, on the new weights,
    # from the tokens it has (partial rollout; its tokens carry both versions); false: the sync waits for the
    # running engine call to finish (every sample from one version). tools/bench_async.py on a CPU SGLang server:
    # the aborts and re-prefills (partial_rollout_kv=recompute) cost more than the wait saves there; keep costs
    # neither
    partial_rollout: bool = False
    # async, partial_rollout=true: how an interrupted request continues. recompute: it is aborted and sent again as
    # prompt + its tokens, prefilled under the new weights (AReaL's interruptible generation); keep: it is held in
    # place on its server with its KV cache (SGLang's pause_generation mode=in_place) while the new weights load,
    # then goes on from there, each token tagged with the version the server held when it was sampled (PipelineRL's
    # in-flight weight update): nothing is aborted or sent again, and a continued token attends to a prefix whose
    # KV the older weights computed (its log-prob is the one it was sampled with, so the mismatch correction still
    # weighs it right). keep needs an engine that can hold requests (SGLang) and its radix cache off
    # (server_args.disable_radix_cache): a finished request's prefix, cached under older weights, must not serve a
    # later request
    partial_rollout_kv: Literal["recompute", "keep"] = "recompute"

    @property
    def holds_requests(self) -> bool:
        """A weight sync holds the running requests in place (partial rollout with partial_rollout_kv=keep)."""
        return self.partial_rollout and self.partial_rollout_kv == "keep"

    # async: Python's thread switch interval (s) while generation overlaps training (sys.setswitchinterval): how
    # long the rollout client's threads may wait for the GIL the training thread holds. At Python's 0.005 the
    # overlapped rollout ran 30% slower than alone (tools/bench_async.py); null: leave Python's
    client_switch_interval: Optional[float] = 0.0005
    # async: tokens a sample got before its last continuation (sampled by an older policy version than its last
    # tokens, rollout/producers/asynchronous.py) are left out of the loss, as slime's partial-rollout masking
    partial_rollout_mask: bool = False
    # the weights the engine serves. bf16: the learner's own, in model.params_dtype. fp8: block FP8 (moe/bridge/fp8.py):
    # each attention and expert projection quantised at every sync in 128 x 128 tiles of e4m3 with an fp32
    # weight_scale_inv per tile (the family's fp8_weights); embeddings, the output layer, norms and the router stay
    # unquantised, in bf16, which FP8 servers serve in. Needs rollout.engine=sglang (launched servers get the quantization config; servers
    # started by hand need --quantization fp8 and its --json-model-override-args: launch/README.md, FP8) and turns
    # the mismatch correction on (algorithm.mismatch.mode=tis unless set)
    weights: Literal["bf16", "fp8"] = "bf16"
    # a LoRA run's sync (model.lora). merged: W + alpha/r B A per shard, every weight, through rollout.sync_transport.
    # adapter (SGLang): the servers serve the base with the adapter, and each sync sends the adapter alone (MBs where
    # the weights are GBs): SGLang's /load_lora_adapter_from_tensors with sync_transport=in_process (servers on this
    # host: shared memory), /load_lora_adapter of a directory with sync_transport=disk (a path the servers share); the
    # base goes whole, digest-verified, at the first sync and to a restarted server; every request names the adapter.
    # Launched servers get --enable-lora and its flags (rollout/sglang_launch.lora_server_args); a server started by
    # hand without them is refused before the first sync, naming them
    lora_sync: Literal["merged", "adapter"] = "merged"
    temperature: float = 1.0  # must equal algorithm.temperature (the log-probs are of these logits)
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 16
    stop_token_ids: Optional[list[int]] = None  # None = the tokenizer's eos
    # true: the engine runs on the learner's own accelerators (training/colocate.py): each step the learner's
    # weights, gradients and accelerator optimizer state leave for the host while the engine generates, and return
    # for the update; the engine's memory is released meanwhile (rollout.engine=embedded)
    colocate: bool = False
    # a TRANSPORTS name: in_process | disk (rlpo_mega.weight_sync.transports) | sglang_distributed (rollout.engine=
    # sglang; rlpo_mega.weight_sync.sglang_distributed) | reshard (sglang, servers on their own GPUs: every learner
    # rank sends its own shards to the server ranks holding them; rlpo_mega.weight_sync.reshard)
    sync_transport: str = "in_process"
    sync_bucket_mb: int = 64
    sync_dir: Optional[str] = None  # disk transport's directory (several engine ranks: a driver_<i> subdirectory each)
    wait_timeout: float = 21600.0  # seconds ranks wait for the engine ranks' rollout (own gloo group, not NCCL's)
    embedded: EmbeddedEngineConfig = field(default_factory=EmbeddedEngineConfig)
    sglang: SGLangEngineConfig = field(default_factory=SGLangEngineConfig)


@dataclass
class CriticConfig:
    """The value model of PPO (on when algorithm.advantage.name=gae): the policy's family and layout with a
    scalar head (moe.value_head), its own optimizer and schedule, saved in the policy's checkpoints."""
    # HF checkpoint: a token-classification critic (score.weight/bias) loads whole; a causal-LM checkpoint
    # gives the trunk and the head starts fresh. None = the policy's model.init_from_hf
    init_from_hf: Optional[str] = None
    optim: OptimConfig = field(default_factory=OptimConfig)  # lr, schedule (over critic optimizer steps), clip
    vf_coef: float = 1.0  # value-loss coefficient (the critic's loss = vf_coef * token-mean value loss)
    vf_clip: Optional[float] = 0.2  # PPO2's value clip around the old values; None = no clipping
    warmup_steps: int = 0  # the first RL steps update the critic only (the policy stays as it is)
    # the critic's own adapters (moe/lora.py; rank 0: the critic trains whole): its trunk frozen, the adapters and
    # the scalar head trained; independent of the policy's model.lora. critic.lora.save: as model.lora.save, its
    # frozen trunk rebuilt at a resume (adapters_only)
    lora: LoRAConfig = field(default_factory=LoRAConfig)

    def trunk_rebuilt(self, model: ModelConfig) -> bool:
        """Whether a resume rebuilds the critic's frozen trunk as it was when RL started: from critic.init_from_hf
        (recorded by its fingerprint and checked, as the policy's base), or copied again from a LoRA policy, whose
        base (model.lora: frozen, the warm-up included) is what the critic's trunk was copied from."""
        return bool(self.init_from_hf) or bool(model.lora.rank)

    def adapters_only(self, model: ModelConfig) -> bool:
        """Whether the critic's checkpoints hold its adapters and scalar head alone (critic.lora.save; "auto": where
        its trunk is rebuilt at a resume; "adapters" is refused where it is not)."""
        lo = self.lora
        return bool(lo.rank) and lo.save != "full" and self.trunk_rebuilt(model)


@dataclass
class ClusterConfig:
    """What a recipe is sized for: `rlpo-mega plan` and `check` read it (the launchers pass their own sizes)."""
    learner_nodes: Optional[int] = None  # nodes of learner GPUs; world size = learner_nodes * gpus_per_node
    rollout_nodes: int = 0  # nodes of SGLang servers beside them (disaggregated); 0: none
    gpus_per_node: int = 8
    gpu_memory_gb: float = 80.0  # an H100's (GB = 1e9 bytes)
    host_memory_gb: float = 1000.0  # one node's RAM
    gpu_reserved_gb: float = 5.0  # CUDA context, NCCL's buffers, the allocator's fragmentation (assumed)
    storage_gb_per_s: float = 2.0  # what one node writes to (and reads from) the checkpoint file system
    # one GPU's pinned copies to and from host memory at the same time as the node's other GPUs (rollout.colocate's
    # hand-over): an H100 SXM's PCIe Gen5 x16 link is 64 GB/s each way, less when GPUs share a host bridge (assumed)
    host_device_gb_per_s: float = 25.0
    # a weight sync's links (`rlpo-mega plan`'s refit table), each direction: one H100 SXM's NVLink 4 to a GPU of
    # its node (900 GB/s both ways), and the NIC each GPU has to other nodes (a 400 Gb/s InfiniBand or RoCE port)
    nvlink_gb_per_s: float = 450.0
    nic_gb_per_s: float = 50.0


@dataclass
class RunConfig:
    seed: int = 1234
    train_iters: int = 1  # RL steps (one rollout batch each); 0: none (warm-up and the final checkpoint only)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    environment: EnvironmentConfig = field(default_factory=EnvironmentConfig)
    prompts: PromptDataConfig = field(default_factory=PromptDataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)


def _node(schema, key: str, root=None):
    """The schema's (DictConfig) node at dotted `key`, or None. root: OmegaConf.structured(schema), when the
    caller has it (building it costs ~0.1 s: once per load_config, not once per override)."""
    node = OmegaConf.structured(schema) if root is None else root
    for part in key.split(".") if key else []:
        if not hasattr(node, "keys") or part not in node:
            return None
        node = node[part]
    return node


def _suggest(bad_key: str, schema) -> str:
    parent_key, _, leaf = bad_key.rpartition(".")
    parent = _node(schema, parent_key)
    if parent is None or not hasattr(parent, "keys"):
        return ""
    known = list(parent.keys())
    prefix = parent_key + "." if parent_key else ""
    close = difflib.get_close_matches(leaf, known, n=1)
    if close:
        return f" Did you mean {prefix + close[0]!r}?"
    return f" Known keys{' under ' + repr(parent_key) if parent_key else ''}: {', '.join(known)}."


def _field_type(schema, key: str):
    """The annotation of a dotted key of a dataclass schema, None unwrapped from Optional (None if unknown),
    and whether it is Optional."""
    t = schema
    for part in key.split("."):
        if not dataclasses.is_dataclass(t):
            return None, False
        hints = typing.get_type_hints(t)
        if part not in hints:
            return None, False
        t = hints[part]
    args = [a for a in typing.get_args(t) if a is not type(None)]
    optional = typing.get_origin(t) is typing.Union and len(args) < len(typing.get_args(t))
    return (args[0] if optional and len(args) == 1 else t), optional


def _choices(t) -> Optional[tuple]:
    """The values of a Literal annotation; None for any other type."""
    return typing.get_args(t) if typing.get_origin(t) is Literal else None


def _expected_type(schema, key: str) -> str:
    """'int', 'int or null', ... for a dotted key of a dataclass schema ('' if unknown)."""
    base, optional = _field_type(schema, key)
    if base is None:
        return ""
    name = getattr(base, "__name__", str(base))
    return f"{name} or null" if optional else name


def response_budget(cfg) -> tuple[int, str]:
    """The longest response a sample can have, and the key that sets it: a multi-turn episode's whole response
    (its turns and observations: environment.max_tokens), else one generation's (rollout.max_new_tokens). What
    the context, the micro-batch budget and the plan must hold."""
    if cfg.environment.name:
        return cfg.environment.max_tokens, "environment.max_tokens"
    return cfg.rollout.max_new_tokens, "rollout.max_new_tokens"


def at_least(key: str, value, low, why: str = "") -> None:
    """ConfigError for a count below its minimum, naming the key, the value and what the count is."""
    if value < low:
        raise ConfigError(f"{key}={value} must be >= {low}" + (f" ({why})" if why else ""))


def unknown_choice(key: str, value, known: Iterable[str]) -> str:
    """`key='value' is not known; known: a, b. Did you mean 'a'?`: the one message for a value outside a closed
    set, a Literal key's (load_config) or a registry's names (config_checks)."""
    known = sorted(known)
    close = difflib.get_close_matches(str(value), known, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return f"{key}={value!r} is not known; known: {', '.join(known)}.{hint}"


def _unbool(node, schema):
    """YAML 1.1 reads `off`/`on` (also no/yes) as booleans; for a string-typed key (routing.mode: off,
    prompts.chat_template: on) the user meant the word, not "False". Rewrites such values in place."""
    if not dataclasses.is_dataclass(schema) or not hasattr(node, "keys"):
        return
    hints = typing.get_type_hints(schema)
    for key in list(node.keys()):
        t = hints.get(key)
        if t is None:
            continue
        args = [a for a in typing.get_args(t) if a is not type(None)]
        base = args[0] if typing.get_origin(t) is typing.Union and len(args) == 1 else t
        value = node._get_node(key)._value() if hasattr(node, "_get_node") else node[key]
        if (base is str or _choices(base) is not None) and isinstance(value, bool):
            node[key] = "on" if value else "off"
        elif dataclasses.is_dataclass(base):
            _unbool(node[key], base)


def _merge(into, layer, source: str, schema):
    _unbool(layer, schema)
    try:
        return OmegaConf.merge(into, layer)
    except (ConfigAttributeError, ConfigKeyError) as e:
        key = e.full_key or ""
        raise ConfigError(f"{source}: unknown config key {key!r}.{_suggest(key, schema)}") from None
    except OmegaConfBaseException as e:
        key = e.full_key
        detail = str(e.msg if getattr(e, "msg", None) else e).splitlines()[0]
        if not key:
            raise ConfigError(f"{source}: {detail}") from None
        choices = _choices(_field_type(schema, key)[0])
        if choices is not None and getattr(e, "value", None) not in choices:
            raise ConfigError(f"{source}: bad value for config key {key!r} (expected one of its known values): "
                              f"{unknown_choice(key, e.value, choices)}") from None
        expected = _expected_type(schema, key)
        expected = f" (expected {expected})" if expected else ""
        raise ConfigError(f"{source}: bad value for config key {key!r}{expected}: {detail}") from None


def load_config(path: Optional[str] = None, overrides: tuple[str, ...] = (), schema=RunConfig):
    """YAML file (optional) + dotted `key=value` overrides, validated against `schema`.

    Every problem is a ConfigError naming its source (file or override), the key and, for a typo,
    the closest known key.
    """
    blank = OmegaConf.structured(schema)
    merged = blank
    if path:
        if not os.path.isfile(path):
            raise ConfigError(f"config file {path!r} does not exist")
        try:
            loaded = OmegaConf.load(path)
        except Exception as e:  # YAML syntax errors
            raise ConfigError(f"config file {path!r} could not be parsed: {e}") from None
        merged = _merge(merged, loaded, f"config file {path!r}", schema)
    layers = []
    for item in overrides:
        key, eq, _ = item.partition("=")
        if not eq or not key.strip():
            raise ConfigError(f"override {item!r} is not of the form key=value (e.g. parallel.tensor=2)")
        node = _node(schema, key.strip(), blank)
        if node is not None and hasattr(node, "keys"):
            raise ConfigError(
                f"override {item!r}: {key.strip()!r} is a config section, not a value; set one of its "
                f"keys ({', '.join(f'{key.strip()}.{k}' for k in node.keys())})")
        try:
            layer = OmegaConf.from_dotlist([item])
        except OmegaConfBaseException as e:
            raise ConfigError(f"override {item!r} could not be parsed: {e}") from None
        _unbool(layer, schema)
        layers.append((item, layer))
    # one merge of every override (each OmegaConf.merge deep-copies the whole config: ~0.1 s an override); where
    # it fails, one at a time, so that the error names the override
    try:
        merged = OmegaConf.merge(merged, *(layer for _, layer in layers)) if layers else merged
    except OmegaConfBaseException:
        for item, layer in layers:
            merged = _merge(merged, layer, f"override {item!r}", schema)
    try:
        cfg = OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:  # e.g. a mandatory value (???) left unset
        raise ConfigError(f"config key {e.full_key!r}: {str(e).splitlines()[0]}") from None
    if isinstance(cfg, RunConfig) and cfg.rollout.weights == "fp8":
        # FP8 rollout's default correction: token-level TIS (slime's and verl's with FP8, C = tis_cap), unless the
        # file or an override chose a mode, none included
        given = (path and OmegaConf.select(loaded, "algorithm.mismatch.mode") is not None) or any(
            OmegaConf.select(layer, "algorithm.mismatch.mode") is not None for _, layer in layers)
        if not given:
            cfg.algorithm.mismatch.mode = "tis"
    return cfg


def to_dict(cfg) -> dict:
    return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)
