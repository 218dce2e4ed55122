"""The job's key on the trainer's side: where it comes from, and the seals of the servers' reports.

Every SGLang server of a job is started with the job's key (launch/rlpo_sglang_keys.py: --api-key and
--admin-api-key, never on a command line), and every request the engine sends carries it
(`Authorization: Bearer <key>`). The key is read from the environment variable that rollout.sglang.api_key_env names
(default RLPO_SGLANG_KEY; the config names the variable, never the key: the config is logged, to W&B too):
launch/slurm/*.sbatch make one per job and every step inherits it. Servers the trainer launches itself get that
key, or one made for the run when the variable is unset (rank 0 makes it, every rank learns it:
rollout/engines.EngineSlot). The reports the servers' hooks write into the driver's TCP store are sealed with it
(an HMAC: launch/rlpo_sglang_keys.py); `unseal` refuses any other.
"""
from __future__ import annotations

import importlib.util
import os
import secrets

from rlpo_mega.engine_errors import EngineError

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_KEYS_FILE = os.path.join(_REPO, "launch", "rlpo_sglang_keys.py")
_module = None


def keys_module():
    """launch/rlpo_sglang_keys.py (the server side's seals and key rules), loaded once from its file."""
    global _module
    if _module is None:
        spec = importlib.util.spec_from_file_location("rlpo_sglang_keys", _KEYS_FILE)
        if spec is None or not os.path.exists(_KEYS_FILE):
            raise EngineError(f"the SGLang engine needs {_KEYS_FILE} (the repository's launch/ directory)")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        _module = mod
    return _module


def new_key() -> str:
    """A fresh job key: 32 random bytes as hex (what SGLang compares and an HTTP header carries; never starts with
    "-", which a command line's parser would read as a flag: launch/slurm/common.sh makes the same)."""
    return secrets.token_hex(32)


def checked(key: str, where: str) -> str:
    problem = keys_module().key_problem(key)
    if problem:
        raise EngineError(f"the SGLang key in {where} is {problem}: SGLang cannot check it; use e.g. "
                          "`python -c 'import secrets; print(secrets.token_hex(32))'`")
    return key


def env_key(name: str):
    """The key in the environment variable `name`, checked; None when it is unset or empty."""
    key = os.environ.get(name) or None
    return checked(key, f"${name}") if key else None


def unseal(key, store_key: str, raw) -> dict:
    """The report in a store value, its seal checked against `key` (None: servers without a key, nothing to check);
    ReportAuthError (a ValueError) when it is not the job's."""
    return keys_module().unseal(key, store_key, raw)


def report_auth_error():
    return keys_module().ReportAuthError
