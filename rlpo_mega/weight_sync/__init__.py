"""Weight sync (one registry, TRANSPORTS): in_process and disk (transports.py), sglang_distributed, reshard."""
from . import transports  # noqa: F401  TRANSPORTS, in_process, disk
from . import sglang_distributed  # noqa: F401  registers TRANSPORTS "sglang_distributed"
from . import reshard  # noqa: F401  registers TRANSPORTS "reshard" (every learner rank sends its own shards)
