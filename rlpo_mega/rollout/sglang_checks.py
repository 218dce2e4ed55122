"""`rlpo-mega check` for the SGLang engine's settings (rollout.sglang.*): its limits and timeouts, launched servers,
colocated servers, and the driver ranks (SGLangEngine.ranks) with their shares of the servers. Called through the
engine (SGLangEngine.check_config), so the checks live with the engine, not behind its name."""
from __future__ import annotations

import re
from typing import Optional

from rlpo_mega.config import ConfigError, at_least

LOCAL_HOSTS = ("127.0.0.1", "localhost", "0.0.0.0", "::1")


def check_sglang(cfg, warns: list[str], world_size: Optional[int] = None, nodes: Optional[int] = None) -> None:
    ro = cfg.rollout
    sg = ro.sglang
    if sg.tp_size < 1 or sg.num_servers < 1:
        raise ConfigError(f"rollout.sglang.tp_size={sg.tp_size} and num_servers={sg.num_servers} must be >= 1")
    at_least("rollout.sglang.max_in_flight_per_server", sg.max_in_flight_per_server, 1,
             "generate requests sent to each server at once")
    at_least("rollout.sglang.decode_concurrency", sg.decode_concurrency, 1,
             "answers the driver reads and decodes at once")
    for key in ("request_timeout", "control_timeout", "hang_timeout", "health_interval", "health_timeout",
                "startup_timeout"):
        if not getattr(sg, key) > 0:
            raise ConfigError(f"rollout.sglang.{key}={getattr(sg, key)} must be > 0 (seconds)")
    if sg.health_interval >= sg.hang_timeout:
        raise ConfigError(f"rollout.sglang.health_interval={sg.health_interval} must be below hang_timeout="
                          f"{sg.hang_timeout}: /health is polled every health_interval to detect a hang")
    if not ro.wait_timeout >= sg.request_timeout:
        raise ConfigError(f"rollout.wait_timeout={ro.wait_timeout} is shorter than rollout.sglang.request_timeout="
                          f"{sg.request_timeout}: the other ranks would give up on a rollout the drivers still "
                          "wait for")
    _check_keys(sg)
    if not sg.urls and not sg.launch:
        warns.append("rollout.engine=sglang with no rollout.sglang.urls and launch=false: give the servers' "
                     "URLs (launch/slurm/train_disaggregated.sbatch adds rollout.sglang.urls=[...]) or set "
                     "rollout.sglang.launch=true")
    if sg.launch and not sg.urls:
        if not cfg.model.init_from_hf:
            raise ConfigError("rollout.sglang.launch=true starts the servers from the model's HF directory: "
                              "set model.init_from_hf")
        if ro.holds_requests and not sg.server_args.get("disable_radix_cache"):
            raise ConfigError("rollout.partial_rollout_kv=keep updates the servers' weights under running requests, "
                              "without a flush: a prefix cached under older weights would serve later requests; add "
                              "rollout.sglang.server_args.disable_radix_cache=true")
        if cfg.routing.mode == "r3" and not sg.server_args.get("enable_return_routed_experts"):
            raise ConfigError("routing.mode=r3 with launched SGLang servers needs their routes: add "
                              "rollout.sglang.server_args.enable_return_routed_experts=true")
        c = cfg.cluster
        if ro.colocate and c.learner_nodes and sg.num_servers * sg.tp_size > c.gpus_per_node:
            raise ConfigError(f"rollout.colocate=true: {sg.num_servers} server(s) x TP{sg.tp_size} per node need "
                              f"{sg.num_servers * sg.tp_size} GPUs, a node has {c.gpus_per_node} "
                              "(cluster.gpus_per_node): launch fewer or smaller servers")
        if c.learner_nodes and not ro.colocate:  # full learner nodes (rlpo-mega plan): no GPU left for servers
            raise ConfigError(
                f"rollout.sglang.launch=true starts the servers on the learner's node, on the GPUs its ranks leave "
                f"free, but cluster.learner_nodes={c.learner_nodes} x gpus_per_node={c.gpus_per_node} are all "
                f"learner ranks: {sg.num_servers} server(s) x TP{sg.tp_size} would share their GPUs; run the "
                "servers on their own nodes (launch/slurm/train_disaggregated.sbatch sets rollout.sglang.urls)")
    remote = [u for u in sg.urls if (u.split("://", 1)[-1].split("/", 1)[0].rsplit(":", 1)[0]
                                     .strip("[]") not in LOCAL_HOSTS)]
    if ro.sync_transport == "in_process" and remote:
        warns.append(f"rollout.sync_transport=in_process sends SGLang weights through shared memory of this "
                     f"host, but {', '.join(remote)} may be on other nodes: use sglang_distributed there")
    if ro.colocate:
        if ro.sync_transport not in ("in_process", "reshard"):
            # NCCL refuses two ranks of one communicator on one GPU: the weights go by update_weights_from_tensor
            raise ConfigError(f"rollout.colocate=true with rollout.sync_transport={ro.sync_transport}: servers on the "
                              "learner's own GPUs take the weights by update_weights_from_tensor (CUDA IPC), not an "
                              "NCCL group with the learner: set rollout.sync_transport=in_process (or reshard: each "
                              "server rank's own shard, packed on its GPU)")
        if ro.sglang.urls or not ro.sglang.launch:
            raise ConfigError("rollout.colocate=true with SGLang: the trainer launches the servers on its own GPUs "
                              "(rollout.sglang.launch=true, no rollout.sglang.urls)")
    nodes = nodes or cfg.cluster.learner_nodes or None  # `rlpo-mega check`/`plan` know the nodes from the cluster
    if ro.colocate:
        _check_colocated_drivers(sg, nodes)
    _check_drivers(sg, world_size, nodes)


def _check_keys(sg) -> None:
    """The servers' key: named by an environment variable, never written in the config (which is logged, to W&B too),
    and SGLang able to check it (its multi-tokenizer mode checks no key: SGLang 0.5.23 refuses keys there)."""
    if not isinstance(sg.api_key_env, str) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", sg.api_key_env):
        raise ConfigError(f"rollout.sglang.api_key_env={sg.api_key_env!r}: the name of the environment variable that "
                          "holds the servers' key (default RLPO_SGLANG_KEY), not the key itself")
    given = [k for k in ("api_key", "admin_api_key") if k in sg.server_args]
    if given:
        raise ConfigError(f"rollout.sglang.server_args.{given[0]}: a key in the config is logged (W&B too) and visible "
                          "on the server's command line; launched servers are started with the job's key from "
                          f"${sg.api_key_env} (made for the run when unset): remove it (launch/README.md, Keys)")
    if int(sg.server_args.get("tokenizer_worker_num") or 1) > 1:
        raise ConfigError("rollout.sglang.server_args.tokenizer_worker_num > 1: SGLang's multi-tokenizer mode checks no "
                          "key (0.5.23 refuses --api-key there), and every launched server needs the job's key: remove it")


def _check_colocated_drivers(sg, nodes: Optional[int]) -> None:
    """rollout.colocate: each driver sends its servers CUDA IPC handles of its own node's GPUs, which open on that
    node only (torch's rebuild_cuda_tensor opens the handle on the device it names). Drivers are evenly spaced
    ranks (one node's ranks are consecutive) and take contiguous shares of the servers in node order
    (SGLangEngine.ranks, shares.share_of), so every driver's servers are on its own node exactly when each node has
    the same number of drivers and they split its servers evenly."""
    if not nodes or nodes < 2:
        return
    per_node = sg.drivers // nodes
    if sg.drivers % nodes or sg.num_servers % max(per_node, 1):
        fits = [d * nodes for d in range(1, sg.num_servers + 1) if sg.num_servers % d == 0]
        raise ConfigError(f"rollout.colocate=true on {nodes} nodes with rollout.sglang.drivers={sg.drivers} and "
                          f"num_servers={sg.num_servers} per node: a driver would send CUDA IPC handles to servers "
                          f"on another node, which cannot open them; set rollout.sglang.drivers={nodes} (one per "
                          f"node" + (f"; or {', '.join(map(str, fits[1:]))}" if fits[1:] else "") + ")")


def _check_drivers(sg, world_size: Optional[int], nodes: Optional[int]) -> None:
    """rollout.sglang.drivers: evenly spaced learner ranks (SGLangEngine.ranks), each with its own share of the
    servers (so at least one server each)."""
    if sg.drivers < 1:
        raise ConfigError(f"rollout.sglang.drivers={sg.drivers} must be >= 1 (the learner ranks that drive the "
                          "SGLang servers; e.g. 1, or one per learner node)")
    if world_size is not None and (sg.drivers > world_size or world_size % sg.drivers):
        fits = [d for d in range(1, world_size + 1) if world_size % d == 0][:8]
        raise ConfigError(f"rollout.sglang.drivers={sg.drivers} does not divide the world size {world_size} (driver "
                          f"ranks are evenly spaced, one per node when it equals the node count): set it to one of "
                          f"{', '.join(map(str, fits))}")
    servers, where = None, ""
    if sg.urls:
        servers, where = len(sg.urls), "in rollout.sglang.urls"
    elif sg.launch and nodes:
        servers = sg.num_servers * nodes
        where = f"launched (rollout.sglang.num_servers={sg.num_servers} x {nodes} node(s))"
    if servers is not None and sg.drivers > servers:
        raise ConfigError(f"rollout.sglang.drivers={sg.drivers} but {servers} SGLang server(s) {where}: each driver "
                          f"drives its own servers; set rollout.sglang.drivers <= {servers} or add servers")
    fewest = servers // sg.drivers if servers is not None else None  # the smallest driver's share
    if sg.min_servers < 1 or (fewest is not None and sg.min_servers > fewest):
        raise ConfigError(f"rollout.sglang.min_servers={sg.min_servers}: each driver keeps generating while at least "
                          f"this many of its servers live, so it must be between 1 and the servers of its share"
                          + (f" ({fewest}: {servers} server(s) {where} over {sg.drivers} driver(s))" if fewest else ""))
