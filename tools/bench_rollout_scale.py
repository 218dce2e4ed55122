"""The rollout driver at the recipes' size, against fake SGLang servers that answer at wire speed.

Each fake server is its own process (its CPU is not the driver's): real HTTP, SGLang's /generate reply (output
ids, `output_token_logprobs`, `routed_experts` as base64 of int32 [prompt + response - 1, hidden layers, top-k])
at the size a real one sends, answered from a body made once per shape (or after `--latency` seconds). The
driver is the real engine (rlpo_mega.rollout.sglang_engine.SGLangEngine) generating S samples of L new tokens
(each answer decoded and its trace checked as it arrives) in the steady state of a run (after one rollout of the
same size: connections, the I/O thread and receive buffers made; the trainer's garbage collection, --gc), then
what its rank does with them, as the trainer does: the scalars' gather (rollout/gather.py) and
the exchange of the payloads in bounded rounds (training/exchange.exchange, a one-rank gloo group whose rank
trains every MoE layer).

Per size, one line:
  rollout-scale: samples=S tokens=L servers=N cpu_us_per_row=X extra_bytes_per_row=Y tail_frac=Z
cpu_us_per_row: the driver process's CPU (user + system, every thread) from the first request to the exchanged
payloads, per route row (a token position with routes: prompt + response - 1 per sample); extra_bytes_per_row:
its peak resident memory over the resident memory before the rollout (Linux VmHWM after clear_refs), per route
row (the compact form is layers x top-k bytes: 384 for Qwen3-30B-A3B); tail_frac: the time from the last answer
(generate's return) to the exchanged payloads, over the rollout's wall time. Also printed: rows/s, the exchange's
rounds, the rollout's user and system CPU per row and per answer (with tiny answers, --tokens 1 --prompt-tokens 16:
the per-answer fixed cost) and context switches, and the engine's I/O threads (idle between rollouts; none left
after its shutdown).

  .venv/bin/python tools/bench_rollout_scale.py                       512 x 1k and 256 x 4k, 4 servers
  .venv/bin/python tools/bench_rollout_scale.py --samples 64 --tokens 256 --servers-count 2
  .venv/bin/python tools/bench_rollout_scale.py --servers URL[,URL...]  drive running servers instead
  .venv/bin/python tools/bench_rollout_scale.py --gc automatic        Python's own garbage collection (before)
"""
from __future__ import annotations

import argparse
import base64
import json
import multiprocessing as mp
import os
import resource
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def _reply(prompt_len: int, new_tokens: int, layers: int, topk: int, experts: int) -> bytes:
    """One /generate answer as SGLang 0.5.23 sends it (finish reason length)."""
    import numpy as np

    rows = prompt_len + new_tokens - 1
    rng = np.random.default_rng(prompt_len * 7919 + new_tokens)
    routes = np.argsort(rng.random((rows, layers, experts), dtype=np.float32), -1)[..., :topk].astype("<i4")
    ids = [int(t) for t in rng.integers(3, 1000, new_tokens)]
    meta = {"id": "x", "finish_reason": {"type": "length", "length": new_tokens}, "prompt_tokens": prompt_len,
            "completion_tokens": new_tokens, "weight_version": "default",
            "output_token_logprobs": [[float(-0.5 - (t % 7) / 8), i, None] for t, i in enumerate(ids)],
            "routed_experts": base64.b64encode(routes.tobytes()).decode()}
    return json.dumps({"text": "", "output_ids": ids, "meta_info": meta}).encode()


def serve(port_out, prompt_tokens: int, new_tokens: int, layers: int, topk: int, experts: int, latency: float,
          port: int = 0):
    """A fake SGLang server (run in its own process): /generate at wire speed, /health, /server_info. The body of
    the bench's shape is made before the server listens; another shape once, under a lock."""
    import threading

    bodies = {(prompt_tokens, new_tokens): _reply(prompt_tokens, new_tokens, layers, topk, experts)}
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        disable_nagle_algorithm = True  # as uvicorn (SGLang's server) does: no 40 ms wait on an answer's last segment

        def log_message(self, *args):
            pass

        def _send(self, body: bytes):
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            self._send(json.dumps({"tp_size": 1} if self.path == "/server_info" else {}).encode())

        def do_POST(self):
            req = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            if self.path != "/generate":
                return self._send(b"{}")
            n = int(req.get("sampling_params", {}).get("max_new_tokens", new_tokens))
            key = (len(req["input_ids"]), n)
            with lock:
                if key not in bodies:
                    bodies[key] = _reply(*key, layers, topk, experts)
            if latency:
                time.sleep(latency)
            self._send(bodies[key])

    class Server(ThreadingHTTPServer):
        request_queue_size = 4096  # the driver opens up to max_in_flight_per_server connections at once
        daemon_threads = True

    server = Server(("127.0.0.1", port), Handler)
    port_out.put(server.server_address[1])
    server.serve_forever()


def _rss(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _reset_peak():
    """Reset VmHWM to the current resident size (Linux >= 4.0); without it the peak would include the set-up's."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError as e:
        raise SystemExit(f"bench_rollout_scale: cannot reset the peak resident size (/proc/self/clear_refs: {e}); "
                         "extra_bytes_per_row needs Linux >= 4.0") from None


def run_size(urls, hf, samples: int, tokens: int, prompt_tokens: int, round_mb: int, gc: str, kill=None,
             **engine) -> dict:
    """kill: called once half of the samples have come back (one server SIGKILLed: its requests are sent again to
    the others); the rows/s before and after it are reported."""
    import torch
    import torch.distributed as dist

    from moe.routing.transport import Recipient
    from rlpo_mega.config import SGLangEngineConfig
    from rlpo_mega.rollout import SamplingParams
    from rlpo_mega.rollout.sglang_engine import SGLangEngine
    from rlpo_mega.rollout.gather import gather_scalars
    from rlpo_mega.training.exchange import exchange
    from rlpo_mega.training.garbage import StepCollector

    collector = StepCollector(gc)

    engine = SGLangEngine(SGLangEngineConfig(urls=list(urls), **engine), hf)
    prompts = [[5 + (i % 50)] * prompt_tokens for i in range(samples)]
    params = SamplingParams(max_new_tokens=tokens)
    spec = engine.spec
    # the steady state of a run's steps: one rollout of the same size first (its connections, I/O thread and
    # receive buffers are the next step's; a trainer makes them at its first step, once per run)
    engine.generate(prompts, params, n=1)
    torch.set_num_threads(1)
    collector.start()  # the trainer's garbage collection (trainer.gc), from its set-up's end
    me = [Recipient(0, 0, 1, 0, 1, tuple(range(spec.num_layers)))]  # one rank training every MoE layer
    _reset_peak()
    base = _rss("VmRSS")
    wall0, cpu0, ru0 = time.perf_counter(), time.process_time(), resource.getrusage(resource.RUSAGE_SELF)
    if kill is None:
        out = engine.generate(prompts, params, n=1)
    else:
        out, killed_at, rows_before = [None] * len(prompts), None, 0
        for i, group in engine.stream(prompts, params, n=1):
            out[i] = group[0]
            if killed_at is None and sum(x is not None for x in out) >= len(prompts) // 2:
                rows_before, killed_at = sum(x.span for x in out if x is not None), time.perf_counter()
                kill()
    wall1, ru1 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
    # what the rank does next, as the trainer does it: the scalars' gather (checking the traces the engine did
    # not), then the exchange of the payloads in bounded rounds (training/exchange.py)
    out = gather_scalars(out, spec, "error", None)
    received, xstats = exchange(out, {i: 0 for i in range(len(out))}, me, spec, round_bytes=round_mb << 20)
    wall2, cpu1 = time.perf_counter(), time.process_time()
    peak = _rss("VmHWM")
    collector.close()
    idle = sum(t.is_alive() for t in engine._io.threads)  # reused by the next rollout: idle, holding nothing
    engine.shutdown()
    left = sum(t.is_alive() for t in threading.enumerate() if t.name.startswith("rlpo-sglang"))
    rows = sum(s.span for s in out)
    assert len(received) == samples and dist.get_world_size() == 1
    faults = {}
    if kill is not None:
        faults = {"rows_per_s_before_kill": rows_before / (killed_at - wall0),
                  "rows_per_s_after_kill": (rows - rows_before) / (wall1 - killed_at),
                  "servers_alive": len(engine.live), **engine.faults}
    return {**faults, "delivered": len(received), "samples": samples, "tokens": tokens, "servers": len(urls), "rows": rows,
            "cpu_us_per_row": (cpu1 - cpu0) / rows * 1e6, "extra_bytes_per_row": (peak - base) / rows,
            "tail_frac": (wall2 - wall1) / (wall2 - wall0), "rows_per_s": rows / (wall1 - wall0),
            "rollout_s": wall1 - wall0, "tail_s": wall2 - wall1, "exchange_rounds": xstats["rounds"],
            "compact_bytes_per_row": spec.num_layers * spec.topk,
            "rollout_user_us_per_row": (ru1.ru_utime - ru0.ru_utime) / rows * 1e6,
            "rollout_sys_us_per_row": (ru1.ru_stime - ru0.ru_stime) / rows * 1e6,
            "rollout_cpu_us_per_answer": (ru1.ru_utime + ru1.ru_stime - ru0.ru_utime - ru0.ru_stime) / samples * 1e6,
            "context_switches": (ru1.ru_nvcsw - ru0.ru_nvcsw, ru1.ru_nivcsw - ru0.ru_nivcsw), "workers": idle, "workers_after_shutdown": left}


def main():
    from rlpo_mega.config import SGLangEngineConfig, TrainerConfig

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=os.path.join(ROOT, "configs", "models", "qwen3_30b_a3b.json"))
    ap.add_argument("--samples", type=int, nargs="*", default=None, help="samples per size (default 512 256)")
    ap.add_argument("--tokens", type=int, nargs="*", default=None, help="new tokens per size (default 1024 4096)")
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--servers-count", type=int, default=4, help="fake servers to start")
    ap.add_argument("--servers", default=None, help="URL[,URL...] of running servers to drive instead")
    ap.add_argument("--latency", type=float, default=0.0, help="seconds each fake answer waits")
    ap.add_argument("--exchange-round-mb", type=int, default=TrainerConfig.exchange_round_mb,
                    help="the exchange's round (trainer.exchange_round_mb)")
    ap.add_argument("--max-in-flight", type=int, default=SGLangEngineConfig.max_in_flight_per_server,
                    help="rollout.sglang.max_in_flight_per_server")
    ap.add_argument("--decode-concurrency", type=int, default=SGLangEngineConfig.decode_concurrency,
                    help="rollout.sglang.decode_concurrency")
    ap.add_argument("--gc", choices=["per_step", "automatic"], default=TrainerConfig.gc,
                    help="the trainer's garbage collection (trainer.gc) while the driver runs")
    ap.add_argument("--kill-one-half-way", action="store_true",
                    help="SIGKILL one fake server once half of the samples are back: its requests go to the others")
    ap.add_argument("--json", help="also write the results to this file")
    args = ap.parse_args()
    samples, tokens = args.samples or [512, 256], args.tokens or [1024, 4096]
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # the exchange's collectives
    if len(samples) != len(tokens):
        raise SystemExit("bench_rollout_scale: --samples and --tokens need the same number of values")
    from moe.model import load_hf_config

    hf = load_hf_config(args.model)
    layers, topk, experts = int(hf.num_hidden_layers), int(hf.num_experts_per_tok), int(hf.num_experts)
    results = []
    for s, t in zip(samples, tokens):
        procs = []
        if args.servers:
            if args.kill_one_half_way:
                raise SystemExit("bench_rollout_scale: --kill-one-half-way kills a fake server it started; "
                                 "leave out --servers")
            urls = args.servers.split(",")
        else:
            ctx = mp.get_context("spawn")
            q = ctx.Queue()
            procs = [ctx.Process(target=serve, args=(q, args.prompt_tokens, t, layers, topk, experts, args.latency), daemon=True)
                     for _ in range(args.servers_count)]
            for p in procs:
                p.start()
            urls = [f"http://127.0.0.1:{q.get(timeout=300)}" for _ in procs]
        try:
            r = run_size(urls, hf, s, t, args.prompt_tokens, args.exchange_round_mb, args.gc,
                         kill=procs[-1].kill if args.kill_one_half_way else None,
                         max_in_flight_per_server=args.max_in_flight, decode_concurrency=args.decode_concurrency)
        finally:
            for p in procs:
                p.terminate()
                p.join(10)
        results.append(r)
        print(f"rollout-scale: samples={s} tokens={t} servers={r['servers']} cpu_us_per_row={r['cpu_us_per_row']:.2f} "
              f"extra_bytes_per_row={r['extra_bytes_per_row']:.0f} tail_frac={r['tail_frac']:.3f}", flush=True)
        print(f"  rows={r['rows']} rows/s={r['rows_per_s']:.0f} rollout {r['rollout_s']:.1f} s, after the last answer "
              f"{r['tail_s']:.1f} s ({r['exchange_rounds']} exchange rounds); during the rollout "
              f"{r['rollout_user_us_per_row']:.2f} us user + {r['rollout_sys_us_per_row']:.2f} us system per row, "
              f"{r['rollout_cpu_us_per_answer']:.0f} us per answer, "
              f"{r['context_switches'][0]} + {r['context_switches'][1]} context switches (voluntary + not); compact {r['compact_bytes_per_row']} B "
              f"per row; {r['workers']} I/O threads, "
              f"{r['workers_after_shutdown']} left after shutdown", flush=True)
        if args.kill_one_half_way:
            print(f"  one of {r['servers']} servers killed half-way: {r['delivered']} of {s} samples delivered, "
                  f"{r['requests_resent']} requests sent again, {r['servers_alive']} servers alive; rows/s "
                  f"{r['rows_per_s_before_kill']:.0f} before the kill, {r['rows_per_s_after_kill']:.0f} after "
                  f"({r['rows_per_s_after_kill'] / r['rows_per_s_before_kill']:.2f}x)", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
