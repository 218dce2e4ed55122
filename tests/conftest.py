import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


@pytest.fixture(scope="session")
def distopt_launch(tmp_path_factory):
    """tests/workers/ckpt_distopt.py's one 2-process launch (distributed-optimizer checkpoints), shared by
    test_checkpoint.py and test_gpu_path.py."""
    from tests.dist import torchrun

    return torchrun("ckpt_distopt.py", 2, str(tmp_path_factory.mktemp("distopt")), "qwen3_moe")
