"""A large rollout against fake SGLang servers, then the process ends without engine.shutdown(): the engine's
finalizer must close its connections and join its workers, so the interpreter exits 0 (no abort from threads
still running at exit). argv: samples, new tokens."""
import sys
import threading

from rlpo_mega.rollout import SamplingParams
from tests.test_engine_timeouts import engine_for
from tests.test_sglang_client import Gauge, fake_sglang

samples, tokens = int(sys.argv[1]), int(sys.argv[2])
with fake_sglang(Gauge(), delay=0.0, new_tokens=tokens) as (a, _, _), \
        fake_sglang(Gauge(), delay=0.0, new_tokens=tokens) as (b, _, _):
    engine = engine_for([a, b], max_in_flight_per_server=64)
    out = engine.generate([[1, 2, 3 + i % 7] * 20 for i in range(samples)], SamplingParams(max_new_tokens=tokens))
    assert len(out) == samples and all(s.trace_checked for s in out)
    busy = sum(t.is_alive() for t in threading.enumerate() if t.name.startswith("rlpo-sglang"))
    print(f"samples={len(out)} worker_threads={busy}", flush=True)
# no shutdown(): the interpreter's exit runs the engine's finalizer
