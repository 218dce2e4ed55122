# shellcheck shell=bash
# Shared functions of launch/slurm/*.sbatch (sourced, not run). Every name is prefixed rlpo_ / RLPO_.
#
# Environment read here (all optional):
#   RLPO_ROOT        repository checkout; default: the sbatch submit directory (submit from the repo root)
#   PYTHON           interpreter; default: $RLPO_ROOT/.venv/bin/python, else python3
#   LOG_DIR          per-job log directory; default: $RLPO_ROOT/logs/<job name>-<job id>
#   MASTER_PORT      torch.distributed rendezvous port; default: 20000 + job id % 20000
#   RLPO_HOSTNAMES   space-separated node names instead of `scontrol show hostnames` (dry runs, tests)
#   RLPO_SGLANG_KEY  the job's key for its SGLang servers; default: made here, once per job (rlpo_init). Every step
#                    inherits it (srun exports the environment; /proc/PID/environ is readable by its owner only); the
#                    servers are started with it (launch/rlpo_sglang_keys.py adds --api-key/--admin-api-key inside the
#                    server's process, never on a command line) and the trainer sends it with every request. Nothing
#                    here prints it; LOG_DIR is made 0700 (SGLang prints its arguments, the key included, at start).
#   DRY_RUN=1        print every command (srun, torchrun, servers, health waits) instead of running it
#
# Cluster users (H100 nodes): set NCCL and CUDA variables before `sbatch` (they are exported to every
# task) or here, e.g.
#   export NCCL_SOCKET_IFNAME=ib0,eth0        # the interface torch.distributed / NCCL bootstrap on
#   export NCCL_IB_HCA=mlx5                    # InfiniBand HCAs for NCCL (check `ibv_devices`)
#   export NCCL_DEBUG=WARN                     # INFO when diagnosing hangs
#   export TORCH_NCCL_ASYNC_ERROR_HANDLING=1   # a failed collective aborts instead of hanging
# CUDA_DEVICE_MAX_CONNECTIONS reaches the learner steps only (default 1: Megatron-Core's TP/SP communication
# overlap needs it); the SGLang server steps start without it, since one hardware queue per GPU would serialize
# the streams SGLang overlaps (set it in SGLANG_ENV to give them one). Servers the trainer launches itself (colocated,
# rollout.sglang.launch) drop it too (launch/sglang_server.py server_environment; rollout.sglang.env may set it).

# srun takes options from its environment (srun(1), "INPUT ENVIRONMENT VARIABLES"; a command-line option wins
# only over its own variable), and sbatch exports the job's GPU request there: --gpus-per-node=8 as
# SLURM_GPUS_PER_NODE, --gpus=16 as SLURM_GPUS, --gpus-per-task as a gres/gpu entry of SLURM_TRES_PER_TASK
# (SLURM_GPUS_PER_TASK up to 23.02); --gres=gpu:8 as none of them. Every step of this script would ask for the
# job's GPUs again: a server step's --gres=gpu:N beside an inherited --gpus-per-node is refused by Slurm 26.05+
# ("--gpus-per-node and --gres=gpu are mutually exclusive."), and a job-wide --gpus=16 asks a step on fewer
# nodes for all 16. So each step starts without them (rlpo_step_env) and states its own GPUs: a server step one
# --gres=gpu:N, a learner step none, and Slurm gives it every GPU the job has on its nodes (srun(1) --gres: "By
# default, a job step is allocated all of the generic resources that have been requested by the job").
RLPO_GPU_ENV=(SLURM_GPUS SLURM_GPUS_PER_NODE SLURM_GPUS_PER_SOCKET SLURM_GPUS_PER_TASK SLURM_GRES SLURM_STEP_GRES)

# The trainer's exit code after a stop (SIGTERM/SIGINT: last completed step saved; rlpo_mega/errors.py
# EXIT_STOPPED); also this script's when a stop comes before the learners started.
RLPO_EXIT_STOPPED=75
RLPO_STOP=          # the signal that asked this job to stop, once one did
RLPO_STOP_SENT=     # set once the learner step was sent TERM
RLPO_LEARNER_PID=   # the learner step's srun, once started

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
    # owner-only: the server logs hold the job's key (SGLang prints its server_args at start)
    rlpo_dry || { mkdir -p "$LOG_DIR" && chmod 700 "$LOG_DIR"; }
    # the job's key for its SGLang servers (made here: inside the job, not at submission; never printed)
    if [[ -z "${RLPO_SGLANG_KEY:-}" ]]; then
        RLPO_SGLANG_KEY=$(od -An -N32 -tx1 /dev/urandom | tr -d ' \n')
    fi
    export RLPO_SGLANG_KEY
    rlpo_log "job $RLPO_JOB_ID nodes ${RLPO_HOSTS[*]} root $RLPO_ROOT logs $LOG_DIR"
    # Pre-emption / time limit: `#SBATCH --signal=B:TERM@600` signals this batch shell only (USR1/USR2 if a
    # user picks those; INT: Ctrl-C on a direct run). TERM goes to the learner step only: the rollout servers
    # stay up while the learners finish the step, sync or save, and are stopped once the learner step has ended
    # (the scripts run rlpo_stop_steps after rlpo_wait; a server stopped earlier fails the learners' sync).
    local sig
    for sig in TERM INT USR1 USR2; do
        # shellcheck disable=SC2064  # the signal's name is fixed here, at set time
        trap "rlpo_on_stop $sig" "$sig"
    done
}

rlpo_on_stop() {
    if [[ -n "$RLPO_STOP" ]]; then
        rlpo_log "batch shell got $1 (already stopping on $RLPO_STOP)"
        return 0
    fi
    RLPO_STOP=$1
    if [[ -z "$RLPO_LEARNER_PID" ]]; then
        rlpo_log "batch shell got $1 before the learners started"
    elif kill -0 "$RLPO_LEARNER_PID" 2>/dev/null; then
        rlpo_log "batch shell got $1: TERM to the learner step only (rollout servers are stopped once it has exited)"
    fi
    rlpo_stop_learners
}

# TERM to the learner step's tasks (torchrun and its ranks: they save and exit), once; nothing before the step
# started (rlpo_launch_learners calls this again then) or after it ended.
rlpo_stop_learners() {
    [[ -n "$RLPO_STOP_SENT" || -z "$RLPO_LEARNER_PID" ]] && return 0
    kill -0 "$RLPO_LEARNER_PID" 2>/dev/null || return 0
    RLPO_STOP_SENT=1
    rlpo_signal_steps rlpo-learner TERM "$RLPO_LEARNER_PID"
}

# The job's running steps whose name starts with PREFIX (srun --job-name) as RLPO_STEP_IDS (job.step).
rlpo_step_ids() {
    mapfile -t RLPO_STEP_IDS < <(squeue -h -s -j "$RLPO_JOB_ID" -o "%i %j" 2>/dev/null |
                                 awk -v p="$1" 'index($2, p) == 1 {print $1}')
}

# Send SIGNAL to every task of the steps named PREFIX* (`scancel --signal`: their handlers run). A step just
# started by srun PID may not be registered yet: look again for up to 10 s while PID lives; if it never shows,
# TERM to srun itself, which kills its step at once (no graceful stop, said in the log).
# Usage: rlpo_signal_steps PREFIX SIGNAL PID
rlpo_signal_steps() {
    local prefix=$1 sig=$2 pid=$3 deadline=$((SECONDS + 10))
    while :; do
        rlpo_step_ids "$prefix"
        if ((${#RLPO_STEP_IDS[@]} > 0)); then
            scancel --signal="$sig" "${RLPO_STEP_IDS[@]}" || rlpo_log "scancel --signal=$sig ${RLPO_STEP_IDS[*]} failed"
            return 0
        fi
        kill -0 "$pid" 2>/dev/null || return 0
        ((SECONDS < deadline)) || break
        sleep 0.2
    done
    rlpo_log "no running step named $prefix* found: TERM to its srun (PID $pid), which kills the step at once"
    kill -TERM "$pid" 2>/dev/null || true
}

# `env -u NAME ...` that srun runs under: without the set ones of RLPO_GPU_ENV and of the given names, and with
# SLURM_TRES_PER_TASK less its GPU entries (cpu=96 and the like stay), as RLPO_STEP_ENV; empty when nothing is to
# change (so a CPU job's commands read as before). Usage: rlpo_step_env [NAME...]; then
# "${RLPO_STEP_ENV[@]}" srun ...
rlpo_step_env() {
    local name t tres=() kept=() args=()
    for name in "${RLPO_GPU_ENV[@]}" "$@"; do
        [[ -n "${!name+x}" ]] && args+=(-u "$name")
    done
    if [[ -n "${SLURM_TRES_PER_TASK:-}" ]]; then
        IFS=, read -r -a tres <<< "$SLURM_TRES_PER_TASK"
        for t in "${tres[@]}"; do
            [[ "$t" == gres/gpu* || "$t" == gpu* ]] || kept+=("$t")
        done
        if ((${#kept[@]} == 0)); then
            args+=(-u SLURM_TRES_PER_TASK)
        elif ((${#kept[@]} < ${#tres[@]})); then
            args+=("SLURM_TRES_PER_TASK=$(rlpo_join "${kept[@]}")")
        fi
    fi
    RLPO_STEP_ENV=()
    ((${#args[@]} == 0)) || RLPO_STEP_ENV=(env "${args[@]}")
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

# srun one torchrun per node on the given hosts (first = rendezvous master), in the background, as the step
# rlpo-learner (the stop signal finds it by that name); the PID of srun is RLPO_LEARNER_PID. The step holds every
# GPU of the job on its nodes (rlpo_step_env). Per-node output: $LOG_DIR/learner-<node>.log; per-rank files:
# $LOG_DIR/torchrun/<node>/. Usage: rlpo_launch_learners HOST... -- ENTRY...
rlpo_launch_learners() {
    local hosts=() n
    while [[ $# -gt 0 && "$1" != "--" ]]; do hosts+=("$1"); shift; done
    shift
    n=${#hosts[@]}
    local srun_args=()
    read -r -a srun_args <<< "${SRUN_ARGS:-}"
    rlpo_step_env
    rlpo_bg "${RLPO_STEP_ENV[@]}" srun --job-name=rlpo-learner --nodes="$n" --ntasks="$n" --ntasks-per-node=1 \
        --nodelist="$(rlpo_join "${hosts[@]}")" --kill-on-bad-exit=1 --output="$LOG_DIR/learner-%N.log" \
        "${srun_args[@]}" \
        env CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-1}" NNODES="$n" \
        NPROC_PER_NODE="${NPROC_PER_NODE:-1}" NODE_HOSTS="${hosts[*]}" MASTER_ADDR="${hosts[0]}" \
        MASTER_PORT="$MASTER_PORT" TORCHRUN_LOG_DIR="$LOG_DIR/torchrun" \
        bash "$RLPO_ROOT/launch/torchrun.sh" "$@"
    RLPO_LEARNER_PID=$RLPO_LAST_PID
    # a stop that came while srun was starting found no PID to act on
    [[ -n "$RLPO_STOP" && -n "$RLPO_LEARNER_PID" ]] && rlpo_stop_learners
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
        [[ -n "$RLPO_STOP" ]] && return 1  # the caller stops the servers
        sleep "${SGLANG_HEALTH_POLL:-5}"
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
    rlpo_step_ids "$prefix"
    ids=("${RLPO_STEP_IDS[@]}")
    if ((${#ids[@]} > 0)); then
        rlpo_log "stopping steps ${ids[*]} (TERM)"
        scancel --signal=TERM "${ids[@]}" || rlpo_log "scancel --signal=TERM ${ids[*]} failed"
        deadline=$((SECONDS + timeout))
        for pid in "$@"; do
            while [[ -n "$pid" ]] && kill -0 "$pid" 2>/dev/null && ((SECONDS < deadline)); do
                sleep 0.2
            done
        done
    fi
    rlpo_stop "$@"
}
