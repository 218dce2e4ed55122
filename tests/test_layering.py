"""The layout shows the architecture: moe/ sits below rlpo_mega/ and imports nothing from it; algorithms/ is
tensor math (no trainer, no megatron schedule); engines and transports are built through their registries."""
import ast
import os

from tests.dist import ROOT


def _imports(folder):
    for base, _, files in os.walk(os.path.join(ROOT, folder)):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(base, name)
            with open(path) as f:
                tree = ast.parse(f.read(), path)
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    for a in node.names:
                        yield os.path.relpath(path, ROOT), a.name
                elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                    yield os.path.relpath(path, ROOT), node.module


def test_moe_imports_nothing_from_rlpo_mega():
    bad = [(f, m) for f, m in _imports("moe") if m == "rlpo_mega" or m.startswith("rlpo_mega.")]
    assert bad == []


def test_algorithms_are_tensor_math():
    bad = [(f, m) for f, m in _imports("rlpo_mega/algorithms")
           if m.startswith(("rlpo_mega.training", "rlpo_mega.rollout", "megatron.core.pipeline_parallel"))]
    assert bad == []


def test_engines_and_transports_come_from_their_registries():
    from rlpo_mega.rollout import ENGINES
    from rlpo_mega.weight_sync.transports import TRANSPORTS

    for name in ENGINES.names():
        cls = ENGINES.get(name)
        assert callable(getattr(cls, "from_config", None)) and callable(getattr(cls, "ranks", None)), name
    assert TRANSPORTS.get("sglang_distributed").from_config
