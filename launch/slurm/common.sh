# shellcheck shell=bash
# Shared functions of launch/slurm/*.sbatch (sourced, not run). Every name is prefixed rlpo_ / RLPO_.
#
# Environment read here (all optional):
#   RLPO_ROOT        repository checkout; default: the sbatch submit directory (submit from the repo root)
#   PYTHON           interpreter; default: $RLPO_ROOT/.venv/bin/python, else python3
#   LOG_DIR          per-job log directory; default: $RLPO_ROOT/logs/<job name>-<job id>
#   MASTER_PORT      torch.distributed rendezvous port; default: 20000 + job id % 20000
#   RLPO_HOSTNAMES   space-separated node names instead of `scontrol show hostnames` (dry runs, tests)
#   DRY_RUN=1        print every command (srun, torchrun, servers, health waits) instead of running it
#
# Cluster users (H100 nodes): set NCCL and CUDA variables before `sbatch` (they are exported to every
# task) or here, e.g.
#   export NCCL_SOCKET_IFNAME=ib0,eth0        # the interface torch.distributed / NCCL bootstrap on
#   export NCCL_IB_HCA=mlx5                    # InfiniBand HCAs for NCCL (check `ibv_devices`)
#   export NCCL_DEBUG=WARN                     # INFO when diagnosing hangs
#   export TORCH_NCCL_ASYNC_ERROR_HANDLING=1   # a failed collective aborts instead of hanging
# CUDA_DEVICE_MAX_CONNECTIONS=1 is set below (Megatron-Core's TP/SP communication overlap needs it).

: "${CUDA_DEVICE_MAX_CONNECTIONS:=1}"
export CUDA_DEVICE_MAX_CONNECTIONS

rlpo_log() { printf '[rlpo %(%H:%M:%S)T %s] %s\n' -1 "${SLURMD_NODENAME:-$(hostname -s)}" "$*" >&2; }

rlpo_dry() { [[ "${DRY_RUN:-0}" != 0 ]]; }

# Print a command the way a shell would read it back.
rlpo_show() { local out; printf -v out '%q ' "$@"; printf '+ %s\n' "${out% }"; }

# Run a command (or only print it under DRY_RUN=1).
rlpo_run() { rlpo_show "$@"; rlpo_dry || "$@"; }

# Start a command in the background; its PID is RLPO_LAST_PID (empty under DRY_RUN=1, where nothing runs).
rlpo_bg() {
    local out
    printf -v out '%q ' "$@"
    printf '+ %s &\n' "${out% }"
    RLPO_LAST_PID=
    rlpo_dry && return 0
    "$@" &
    RLPO_LAST_PID=$!
}

# RLPO_ROOT, PYTHON, the job's node names (RLPO_HOSTS), MASTER_PORT, LOG_DIR, and the TERM trap.
rlpo_init() {
    if [[ -z "${RLPO_ROOT:-}" ]]; then
        if [[ -n "${SLURM_SUBMIT_DIR:-}" && -f "$SLURM_SUBMIT_DIR/launch/slurm/common.sh" ]]; then
            RLPO_ROOT=$SLURM_SUBMIT_DIR
        else  # run directly (dry run): this file's checkout
            RLPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
        fi
    fi
    export RLPO_ROOT
    cd "$RLPO_ROOT"
    if [[ -z "${PYTHON:-}" ]]; then
        if [[ -x "$RLPO_ROOT/.venv/bin/python" ]]; then PYTHON=$RLPO_ROOT/.venv/bin/python; else PYTHON=python3; fi
    fi
    export PYTHON
    RLPO_JOB_ID=${SLURM_JOB_ID:-local}
    RLPO_JOB_NAME=${SLURM_JOB_NAME:-rlpo}
    if [[ -n "${RLPO_HOSTNAMES:-}" ]]; then
        read -r -a RLPO_HOSTS <<< "$RLPO_HOSTNAMES"
    elif [[ -n "${SLURM_JOB_NODELIST:-}" ]]; then
        mapfile -t RLPO_HOSTS < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
    else
        RLPO_HOSTS=("$(hostname -s)")
    fi
    if [[ -z "${MASTER_PORT:-}" ]]; then
        MASTER_PORT=29500
        if [[ "$RLPO_JOB_ID" =~ ^[0-9]+$ ]]; then
            MASTER_PORT=$((20000 + RLPO_JOB_ID % 20000))
        fi
    fi
    export MASTER_PORT
    : "${LOG_DIR:=$RLPO_ROOT/logs/$RLPO_JOB_NAME-$RLPO_JOB_ID}"
    export LOG_DIR
    rlpo_dry || mkdir -p "$LOG_DIR"
    rlpo_log "job $RLPO_JOB_ID nodes ${RLPO_HOSTS[*]} root $RLPO_ROOT logs $LOG_DIR"
    # Pre-emption / time limit: `#SBATCH --signal=B:TERM@600` sends TERM to this batch shell only; forward it
    # to every task of every step (plain `scancel --signal` skips the batch shell), so the trainers can save.
    trap rlpo_forward_term TERM
}

rlpo_forward_term() {
    rlpo_log "batch shell got TERM: forwarding TERM to all job steps of $RLPO_JOB_ID"
    scancel --signal=TERM "$RLPO_JOB_ID" || rlpo_log "scancel --signal=TERM $RLPO_JOB_ID failed"
}

# Comma-joined host list for --nodelist.
rlpo_join() { local IFS=,; echo "$*"; }

# The training entry point after torchrun's own flags: TRAIN_ENTRY (whitespace-split, e.g. a test script)
# followed by the extra overrides given as arguments, else
# `-m rlpo_mega.cli train $CONFIG $OVERRIDES <extra overrides given as arguments>`.
rlpo_entry() {
    RLPO_ENTRY=()
    if [[ -n "${TRAIN_ENTRY:-}" ]]; then
        read -r -a RLPO_ENTRY <<< "$TRAIN_ENTRY"
        RLPO_ENTRY+=("$@")
    else
        local overrides=()
        read -r -a overrides <<< "${OVERRIDES:-}"
        RLPO_ENTRY=(-m rlpo_mega.cli train "${CONFIG:?set CONFIG to a YAML config, e.g. configs/demo_cpu.yaml}"
                    "${overrides[@]}" "$@")
    fi
}

# srun one torchrun per node on the given hosts (first = rendezvous master), in the background; the PID of srun
# is RLPO_LEARNER_PID. Per-node output: $LOG_DIR/learner-<node>.log; per-rank files: $LOG_DIR/torchrun/<node>/.
# Usage: rlpo_launch_learners HOST... -- ENTRY...
rlpo_launch_learners() {
    local hosts=() n
    while [[ $# -gt 0 && "$1" != "--" ]]; do hosts+=("$1"); shift; done
    shift
    n=${#hosts[@]}
    local srun_args=()
    read -r -a srun_args <<< "${SRUN_ARGS:-}"
    rlpo_bg srun --nodes="$n" --ntasks="$n" --ntasks-per-node=1 --nodelist="$(rlpo_join "${hosts[@]}")" \
        --kill-on-bad-exit=1 --output="$LOG_DIR/learner-%N.log" "${srun_args[@]}" \
        env NNODES="$n" NPROC_PER_NODE="${NPROC_PER_NODE:-1}" NODE_HOSTS="${hosts[*]}" MASTER_ADDR="${hosts[0]}" \
        MASTER_PORT="$MASTER_PORT" TORCHRUN_LOG_DIR="$LOG_DIR/torchrun" \
        bash "$RLPO_ROOT/launch/torchrun.sh" "$@"
    RLPO_LEARNER_PID=$RLPO_LAST_PID
    if rlpo_dry; then  # what launch/torchrun.sh runs on each node
        local h
        for h in "${hosts[@]}"; do
            echo "# on $h:"
            DRY_RUN=1 SLURMD_NODENAME=$h NNODES=$n NPROC_PER_NODE="${NPROC_PER_NODE:-1}" NODE_HOSTS="${hosts[*]}" \
                MASTER_ADDR="${hosts[0]}" MASTER_PORT="$MASTER_PORT" TORCHRUN_LOG_DIR="$LOG_DIR/torchrun" \
                bash "$RLPO_ROOT/launch/torchrun.sh" "$@"
        done
    fi
}

# Wait for a background PID, also across TERM traps (a trap interrupts `wait`); returns the PID's exit code.
rlpo_wait() {
    local pid=$1 rc=0
    while kill -0 "$pid" 2>/dev/null; do
        wait "$pid" || true
    done
    wait "$pid" || rc=$?
    return "$rc"
}

# Poll URL/health until it answers 200, the timeout (seconds) passes, or the optional PID dies.
# Usage: rlpo_wait_health URL TIMEOUT [PID]
rlpo_wait_health() {
    local url=$1 timeout=$2 pid=${3:-} deadline
    rlpo_show rlpo_wait_health "$url/health" "$timeout"
    rlpo_dry && return 0
    deadline=$((SECONDS + timeout))
    while ((SECONDS < deadline)); do
        if curl -fsS -o /dev/null --max-time 5 "$url/health" 2>/dev/null; then
            rlpo_log "healthy: $url"
            return 0
        fi
        if [[ -n "$pid" ]] && ! kill -0 "$pid" 2>/dev/null; then
            rlpo_log "server for $url exited before it became healthy"
            return 1
        fi
        sleep 5
    done
    rlpo_log "timed out after ${timeout}s waiting for $url/health"
    return 1
}

# Stop background sruns (servers) at once: TERM makes srun kill its step (SIGKILL to every task).
rlpo_stop() {
    local pid
    for pid in "$@"; do
        [[ -n "$pid" ]] && kill -TERM "$pid" 2>/dev/null || true
    done
    for pid in "$@"; do
        [[ -n "$pid" ]] && wait "$pid" 2>/dev/null || true
    done
}

# Stop the job's steps whose name starts with PREFIX (srun --job-name) gracefully: TERM to their tasks (what
# `scancel --signal=TERM` does; their TERM handlers run, e.g. launch/sglang_server.py stops its server), then
# up to TIMEOUT seconds for the given srun PIDs to end; whatever is left goes through rlpo_stop.
# Usage: rlpo_stop_steps PREFIX TIMEOUT PID...
rlpo_stop_steps() {
    local prefix=$1 timeout=$2 ids=() pid deadline
    shift 2
    mapfile -t ids < <(squeue -h -s -j "$RLPO_JOB_ID" -o "%i %j" 2>/dev/null |
                       awk -v p="$prefix" 'index($2, p) == 1 {print $1}')
    if ((${#ids[@]} > 0)); then
        rlpo_log "stopping steps ${ids[*]} (TERM)"
        scancel --signal=TERM "${ids[@]}" || rlpo_log "scancel --signal=TERM ${ids[*]} failed"
        deadline=$((SECONDS + timeout))
        for pid in "$@"; do
            while [[ -n "$pid" ]] && kill -0 "$pid" 2>/dev/null && ((SECONDS < deadline)); do
                sleep 0.5
            done
        done
    fi
    rlpo_stop "$@"
}
