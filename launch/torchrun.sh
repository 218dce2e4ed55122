#!/bin/bash
# One node's torchrun: starts NPROC_PER_NODE ranks of the trainer on this node. Used by launch/slurm/*.sbatch
# (one srun task per node) and usable alone on a single machine:
#
#   NPROC_PER_NODE=2 CONFIG=configs/demo_cpu.yaml OVERRIDES="parallel.expert=2" launch/torchrun.sh
#   NPROC_PER_NODE=8 launch/torchrun.sh -m rlpo_mega.cli train configs/my_run.yaml parallel.expert=8
#
# Arguments: what torchrun runs (`-m module args...` or `script.py args...`); default
#   -m rlpo_mega.cli train $CONFIG $OVERRIDES
# Environment:
#   NPROC_PER_NODE   ranks on this node (GPUs per node on H100 nodes); default 1
#   NNODES           nodes of the learner group; default 1
#   NODE_RANK        this node's rank; default: position of this node ($SLURMD_NODENAME, else `hostname -s`)
#                    in NODE_HOSTS (space-separated learner hosts, first = master), else 0
#   MASTER_ADDR      rendezvous host (node rank 0); default 127.0.0.1
#   MASTER_PORT      rendezvous port; default 29500
#   TORCHRUN_LOG_DIR per-rank stdout/stderr files go to $TORCHRUN_LOG_DIR/<node>/...; console lines are
#                    prefixed [default<local rank>]: either way
#   SHUTDOWN_TIMEOUT seconds torchrun gives ranks after forwarding SIGTERM before SIGKILL; default 540
#                    (keep it below the --signal lead time of the sbatch script, 600 s: a recipe's save of
#                    0.4-1.5 TB needs ~200 s at 2 GB/s per node; `rlpo-mega plan` checks it)
#   PYTHON           interpreter; default: .venv/bin/python of this checkout, else python3
#   DRY_RUN=1        print the torchrun command instead of running it
# Pre-emption: SIGTERM to this process (torchrun, via exec) is forwarded to every rank (torchrun handles
# SIGTERM, SIGINT, SIGHUP, SIGQUIT by default); under srun, SLURM also signals every process of the step.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x "$here/.venv/bin/python" ]]; then PYTHON=$here/.venv/bin/python; else PYTHON=python3; fi
fi
node=${SLURMD_NODENAME:-$(hostname -s)}
nnodes=${NNODES:-1}
if [[ -z "${NODE_RANK:-}" ]]; then
    NODE_RANK=0
    if [[ -n "${NODE_HOSTS:-}" ]]; then
        read -r -a hosts <<< "$NODE_HOSTS"
        found=
        for i in "${!hosts[@]}"; do
            if [[ "${hosts[$i]}" == "$node" ]]; then NODE_RANK=$i; found=1; break; fi
        done
        if [[ -z "$found" ]]; then
            echo "launch/torchrun.sh: node $node is not in NODE_HOSTS ($NODE_HOSTS)" >&2
            exit 2
        fi
    fi
fi

if [[ $# -eq 0 ]]; then
    read -r -a overrides <<< "${OVERRIDES:-}"
    set -- -m rlpo_mega.cli train "${CONFIG:?set CONFIG (a YAML config) or pass the entry point as arguments}" \
        "${overrides[@]}"
fi

# torchrun's flags run by rlpo-mega's agent (torch.distributed.run in its process): a stop after which the workers
# saved exits 75, which sbatch passes on as the job's code; plain torchrun exits 1 on a TERM whatever its ranks did
cmd=("$PYTHON" -m rlpo_mega.cli torchrun
     --nnodes="$nnodes" --nproc-per-node="${NPROC_PER_NODE:-1}" --node-rank="$NODE_RANK"
     --master-addr="${MASTER_ADDR:-127.0.0.1}" --master-port="${MASTER_PORT:-29500}"
     --rdzv-id="${SLURM_JOB_ID:-local}" --max-restarts=0
     --shutdown-timeout="${SHUTDOWN_TIMEOUT:-540}" --tee=3)
if [[ -n "${TORCHRUN_LOG_DIR:-}" ]]; then
    cmd+=(--log-dir="$TORCHRUN_LOG_DIR/$node")
fi
cmd+=("$@")

printf -v shown '%q ' "${cmd[@]}"
echo "+ ${shown% }"
if [[ "${DRY_RUN:-0}" != 0 ]]; then
    exit 0
fi
echo "[rlpo torchrun.sh] node $node rank $NODE_RANK of $nnodes, ${NPROC_PER_NODE:-1} processes" >&2
exec "${cmd[@]}"
