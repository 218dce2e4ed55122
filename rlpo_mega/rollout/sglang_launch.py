"""Launching SGLang servers (rollout.sglang.launch=true): this node's servers, each on its own GPUs after the
learner's (or, colocated, on the learner's own), through launch/sglang_server.py's SGLangServer."""
from __future__ import annotations

import json
import os
import shlex
import socket
from typing import Optional

import torch

from moe.bridge.fp8 import sglang_quantization_config
from moe.bridge.peft import sglang_target_modules
from rlpo_mega.engine_errors import EngineError

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _load_launcher():
    import importlib.util

    path = os.path.join(_REPO, "launch", "sglang_server.py")
    spec = importlib.util.spec_from_file_location("rlpo_launch_sglang_server", path)
    if spec is None or not os.path.exists(path):
        raise EngineError(f"rollout.sglang.launch needs {path} (the repository's launch/ directory); "
                          "start the servers yourself and set rollout.sglang.urls instead")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


_WILDCARD_HOSTS = ("0.0.0.0", "::", "")
_LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


def fp8_server_args(hf) -> dict:
    """The server arguments that make SGLang hold block-FP8 weights while it starts from the bf16 checkpoint
    (rollout.weights=fp8), serving in bf16 (the sync sends the unquantised tensors in bf16: training/sync.py): the
    checkpoint's tensors are cast into its FP8 parameters at load, meaningless until the trainer's first sync fills
    codes and scales, which every run does before its first rollout."""
    return {"quantization": "fp8", "dtype": "bfloat16",  # SGLang's fp8 serves bf16 or fp16 (model_loader/loader.py:268)
            "json_model_override_args": json.dumps({"quantization_config": sglang_quantization_config(hf)})}


def lora_server_args(lora, hf) -> dict:
    """The server arguments that let SGLang serve a LoRA run's adapter beside the base (rollout.lora_sync=adapter):
    LoRA on, one adapter of model.lora's rank on the modules its targets name (lora/utils.py matches the leaf names in
    every layer: both gate_up_proj and down_proj where the experts are adapted, or SGLang wraps no MoE layer,
    sglang PR #32376), the experts' shared factors as SGLang's shared-outer layout (mem_pool.py; auto-detection
    needs an adapter at launch, and the run loads its first at its first sync), and the triton backend on a GPU
    (the default csgmv skips MoE layers, miles' --sglang-lora-backend triton), torch_native on a CPU."""
    args = {"enable_lora": True, "max_lora_rank": int(lora.rank),
            "lora_target_modules": sglang_target_modules(hf, lora.targets), "max_loras_per_batch": 1,
            "lora_backend": "triton" if torch.cuda.is_available() else "torch_native"}
    if "experts" in lora.targets and lora.expert_layout != "per_expert":
        args["experts_shared_outer_loras"] = True
    return args


def extra_server_args(run_cfg, hf) -> dict:
    """What a launched server needs beyond rollout.sglang.server_args for what the run syncs to it: the FP8
    quantization (rollout.weights=fp8), LoRA (rollout.lora_sync=adapter)."""
    ro = run_cfg.rollout
    return {**(fp8_server_args(hf) if ro.weights == "fp8" else {}),
            **(lora_server_args(run_cfg.model.lora, hf) if ro.lora_sync == "adapter" else {})}


def server_args_cli(args: dict) -> list[str]:
    """The flags a server started by hand needs for `args` (quoted for a shell)."""
    return [shlex.quote(a) for a in _load_launcher().server_args_to_cli(args)]


def launch_node_servers(cfg, model_path: Optional[str], node: int = 0, nodes: int = 1, colocate: bool = False,
                        api_key: Optional[str] = None, extra_args: Optional[dict] = None) -> list:
    """Start this node's servers (rollout.sglang.launch=true: num_servers per node), healthy on return, as
    launch/sglang_server.SGLangServer handles. Each goes on its own GPUs, after those of this node's learner
    ranks (torchrun's LOCAL_WORLD_SIZE) and of the servers before it (`server_gpus`); colocated (rollout.colocate)
    on the learner's own GPUs from GPU 0, with SGLang's memory saver on a GPU (release/resume_memory_occupation
    free and map the memory; SGLang's CPU build has no torch_memory_saver, and its release/resume are no-ops
    there). Ports base_port +
    node * num_servers + i: distinct across nodes, so URLs stay unique where several nodes share a host. Servers
    bound to a wildcard host are addressed by this node's hostname (the other nodes' learners reach them). Each is
    started with the job's key: api_key, else the one in $rollout.sglang.api_key_env (rollout/engines.EngineSlot
    puts the run's there on every rank before it launches)."""
    if not model_path:
        raise EngineError("rollout.sglang.launch needs the model's HF directory (model.init_from_hf) "
                          "to start the servers from")
    if nodes > 1 and cfg.host in _LOOPBACK_HOSTS:
        raise EngineError(f"rollout.sglang.launch=true on {nodes} nodes: servers bound to {cfg.host} cannot be reached "
                          "from drivers on other nodes; set rollout.sglang.host=0.0.0.0 (each node's servers are then "
                          "addressed by its hostname)")
    key = api_key or os.environ.get(cfg.api_key_env)
    if not key:
        raise EngineError(f"rollout.sglang.launch: no key for the servers (${cfg.api_key_env} is unset): every launched "
                          "server is started with the job's key")
    launcher = _load_launcher()
    placed = [{}] * cfg.num_servers
    if torch.cuda.is_available():  # each server on its own GPUs, after those of this node's learner ranks
        if "base_gpu_id" in cfg.server_args:
            raise EngineError("rollout.sglang.server_args.base_gpu_id: launched servers are placed by the "
                              "engine (each after the learner ranks' GPUs and the servers before it); remove it")
        learner = 0 if colocate else int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        placed = [{"base_gpu_id": g, **({"enable_memory_saver": True} if colocate else {})}
                  for g in server_gpus(cfg.num_servers, cfg.tp_size, learner, torch.cuda.device_count())]
    advertise = socket.gethostname() if cfg.host in _WILDCARD_HOSTS else None
    servers = []
    try:
        for i in range(cfg.num_servers):
            srv = launcher.SGLangServer(model_path, cfg.host, cfg.base_port + node * cfg.num_servers + i, cfg.tp_size,
                                        server_args={**cfg.server_args, **(extra_args or {}), **placed[i]},
                                        python=cfg.python or None,
                                        log_dir=cfg.log_dir or None, env=cfg.env, advertise=advertise, api_key=key)
            servers.append(srv)
            srv.start(cfg.startup_timeout)
    except Exception as e:
        for srv in servers:
            srv.stop()
        raise EngineError(f"SGLang engine: could not start a server{f' on node {node}' if nodes > 1 else ''}: {e}") from e
    return servers


def server_gpus(num_servers: int, tp_size: int, learner_gpus: int, gpus: int) -> list[int]:
    """base_gpu_id of each server the engine launches on this node: the learner's local ranks hold GPUs
    0..learner_gpus-1 (torchrun: local rank r on GPU r), server i the tp_size GPUs after those and the servers
    before it. Servers that would not fit beside the learner are refused: they would share its GPUs."""
    need = learner_gpus + num_servers * tp_size
    if need > gpus:
        spare = gpus - num_servers * tp_size
        raise EngineError(
            f"rollout.sglang.launch=true places {num_servers} server(s) x TP{tp_size} on this node after the GPUs of "
            f"its {learner_gpus} learner rank(s): {need} GPUs needed, {gpus} here, so they would share the learner's GPUs; "
            + (f"run the learner on {spare} GPU(s) of this node (--nproc-per-node {spare}), " if spare > 0 else "")
            + "launch fewer or smaller servers, or run them on their own nodes (launch/slurm/train_disaggregated.sbatch)")
    return [learner_gpus + i * tp_size for i in range(num_servers)]
