"""The job's key on the server side: SGLang started with it, and the reports its hooks send back sealed with it.
Standard library only: it runs in the SGLang server's environment, and the trainer loads it from this file
(rlpo_mega/rollout/sglang_auth.py).

1. The key shim. `python -m rlpo_sglang_keys MODULE [FLAG...]` (or `python launch/rlpo_sglang_keys.py MODULE ...`)
   runs MODULE (sglang.launch_server, or any launcher that takes SGLang's flags) as __main__, with
   `--api-key=K --admin-api-key=K` added to its sys.argv inside this process, K read from $RLPO_SGLANG_KEY. The
   key never appears on a command line: /proc/PID/cmdline is readable by every user of the node, the environment
   (/proc/PID/environ) by the process's owner only. One key for both flags: SGLang 0.5.23 asks the admin key (when
   set) on its control endpoints (update_weights_*, pause_generation, abort_request, ...) and the API key on
   generation and /server_info, which returns both keys to whoever holds the API key -- two keys would add
   nothing, and the admin flag covers endpoints a later SGLang makes admin-only. Without the variable MODULE runs
   as it is: a server without a key (launch/sglang_server.py always gives it one).
   SGLang prints its server_args, the keys included, in its log at start: launch/sglang_server.py writes that log
   with mode 0600, and launch/slurm/common.sh makes the job's log directory 0700.

2. Report seals. What a server's hook writes into the driver's TCP store (launch/rlpo_sglang_hooks.py: the weight
   digests, its environment) travels over a store that anyone who reaches its port may write to. So the hook seals
   each report with an HMAC-SHA256 keyed by a key derived from the job's key, over the store key the driver chose
   for that request (random, sent only inside the keyed HTTP request: an old report cannot answer a new request)
   and the report's bytes; the driver accepts only a report whose HMAC it recomputes (`unseal`).
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os
import runpy
import sys

KEY_ENV = "RLPO_SGLANG_KEY"  # the server side's variable (the trainer's is rollout.sglang.api_key_env)
KEY_FLAGS = ("--api-key", "--admin-api-key")
_MAC_PURPOSE = b"rlpo-mega/report-mac/v1"  # the job's key is never used as an HMAC key itself
_REPORT_DOMAIN = b"rlpo-report/1\n"


class ReportAuthError(ValueError):
    """A report that does not carry a valid seal of the job's key."""


def key_problem(key: str) -> str | None:
    """Why `key` cannot be an SGLang key (None when it can): SGLang compares keys with secrets.compare_digest,
    which takes ASCII only, and an HTTP header holds no spaces or control characters."""
    if len(key) < 16:
        return "shorter than 16 characters"
    if not all(33 <= ord(c) < 127 for c in key):
        return "not printable ASCII without spaces"
    return None


def _mac_key(job_key: str) -> bytes:
    return hmac.new(job_key.encode(), _MAC_PURPOSE, hashlib.sha256).digest()


def report_mac(job_key: str, store_key: str, body: str) -> str:
    return hmac.new(_mac_key(job_key), _REPORT_DOMAIN + store_key.encode() + b"\n" + body.encode(),
                    hashlib.sha256).hexdigest()


def seal(job_key: str | None, store_key: str, report: dict) -> str:
    """The store value of one report: {"v": 1, "report": its JSON, "mac": its HMAC} (mac null without a key)."""
    body = json.dumps(report, sort_keys=True)
    return json.dumps({"v": 1, "report": body, "mac": report_mac(job_key, store_key, body) if job_key else None})


def unseal(job_key: str | None, store_key: str, raw) -> dict:
    """The report inside a store value, once its seal checks out against `job_key`; ReportAuthError otherwise.
    job_key None (servers without a key, which anyone may drive anyway): nothing to check, any report is read."""
    try:
        envelope = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise ReportAuthError("not JSON") from None
    sealed = isinstance(envelope, dict) and envelope.get("v") == 1 and isinstance(envelope.get("report"), str)
    if job_key is None:
        if not sealed:
            return envelope
    elif not sealed or not isinstance(envelope.get("mac"), str):
        raise ReportAuthError("it carries no HMAC")
    elif not hmac.compare_digest(envelope["mac"].encode(errors="replace"),
                                 report_mac(job_key, store_key, envelope["report"]).encode()):
        raise ReportAuthError("its HMAC does not match")
    try:
        return json.loads(envelope["report"])
    except ValueError:
        raise ReportAuthError("its report is not JSON") from None


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0].startswith("-"):
        print("usage: python -m rlpo_sglang_keys MODULE [FLAG...]: runs MODULE with --api-key and --admin-api-key "
              f"from ${KEY_ENV}", file=sys.stderr)
        return 2
    module, rest = argv[0], argv[1:]
    key = os.environ.get(KEY_ENV)
    if key:
        given = sorted({a.split("=", 1)[0] for a in rest} & set(KEY_FLAGS))  # the names only: no key echoed
        if given:
            print(f"rlpo_sglang_keys: {', '.join(given)} on the command line: the job's key comes from ${KEY_ENV} "
                  "(a key on a command line is readable by every user of the node); remove the flag", file=sys.stderr)
            return 2
        problem = key_problem(key)
        if problem:
            print(f"rlpo_sglang_keys: ${KEY_ENV} is {problem}: SGLang cannot check it", file=sys.stderr)
            return 2
        # one token each, `--flag=KEY`: a key that starts with "-" would read as a flag of its own to argparse
        rest += [f"{flag}={key}" for flag in KEY_FLAGS]
    sys.argv = [module, *rest]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
