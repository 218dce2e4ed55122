"""The layout shows the architecture, floor by floor: the CLI; training/ (the RL step); rollout/ (engines, the
rollout side); below it weight_sync/, environments/, rewards/ and data/; moe/ at the bottom, importing nothing of
rlpo_mega/. algorithms/ is tensor math (no trainer, no megatron schedule); engines and transports are built through
their registries; tools/ (benchmarks) import no test module."""
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


def test_training_sits_above_everything_but_the_cli():
    """rlpo_mega/training/ (the RL step) is the top floor of the package under the CLI: nothing else imports it,
    in-function imports included (checkpointing, conversion, config checks, the engines, the planner build the
    model through rlpo_mega.model_setup and read checkpoints through rlpo_mega.checkpoint.run)."""
    bad = [(f, m) for f, m in _imports("rlpo_mega") if (m == "rlpo_mega.training" or m.startswith("rlpo_mega.training."))
           and not f.startswith(os.path.join("rlpo_mega", "training")) and f != os.path.join("rlpo_mega", "cli.py")]
    assert bad == []


def test_the_rollout_side_lives_in_rollout():
    """Every producer (a schedule over a task through filters), the engine ranks' slot and guard and the scalars'
    gather are the rollout side's: the trainer only calls a producer through its interface."""
    from rlpo_mega.rollout.producers import PRODUCERS

    assert {PRODUCERS.get(n).__module__.rsplit(".", 1)[0] for n in PRODUCERS.names()} == {"rlpo_mega.rollout.producers"}
    assert sorted(f for f in os.listdir(os.path.join(ROOT, "rlpo_mega", "training"))
                  if f in ("collect.py", "async_collect.py", "engines.py")) == []


def _under(module, *packages):
    return any(module == p or module.startswith(p + ".") for p in packages)


def test_rollout_sits_above_weight_sync_environments_rewards_and_data():
    """Every import statement, in functions too: what the rollout side uses (transports, environments, rewards,
    datasets) never reaches back up to it or to the training step; the engines' failure types, which transports
    raise too, are at the bottom (rlpo_mega/engine_errors.py)."""
    graph = _module_graph()
    below = ("rlpo_mega.weight_sync", "rlpo_mega.environments", "rlpo_mega.rewards", "rlpo_mega.data")
    bad = sorted((m, d) for m, deps in graph.items() if _under(m, *below) for d in deps
                 if _under(d, "rlpo_mega.rollout", "rlpo_mega.training"))
    assert bad == []
    assert sorted((m, d) for m, deps in graph.items() if _under(m, "rlpo_mega.rollout") for d in deps
                  if _under(d, "rlpo_mega.training")) == []


def test_tools_import_no_test_module():
    bad = [(f, m) for f, m in _imports("tools") if m == "tests" or m.startswith("tests.")]
    assert bad == []


def _module_graph():
    """{module: modules it imports} over moe/ and rlpo_mega/ (every import statement, in functions too; relative
    imports resolved; `from pkg import name` counts as pkg.name when that is a module)."""
    paths = {}
    for top in ("moe", "rlpo_mega"):
        for base, _, files in os.walk(os.path.join(ROOT, top)):
            for name in files:
                if name.endswith(".py"):
                    rel = os.path.relpath(os.path.join(base, name), ROOT)[:-3].replace(os.sep, ".")
                    paths[rel[:-len(".__init__")] if rel.endswith(".__init__") else rel] = os.path.join(base, name)

    def known(name):
        while name and name not in paths:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for mod, path in paths.items():
        package = mod if path.endswith("__init__.py") else mod.rpartition(".")[0]
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        deps = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                    base = up + ("." + node.module if node.module else "")
                names = [base] + [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            deps |= {known(n) for n in names} - {None, mod}
        graph[mod] = deps
    return graph


def test_no_import_circles():
    """No two modules import each other, directly or around a loop (in-function imports included: they hid
    errors <-> checkpoint and convert <-> the trainer's checkpoint state). A package's __init__ re-exporting
    its own submodules, which register into it, is the registry pattern, not a circle."""
    graph = _module_graph()
    graph = {m: {d for d in deps if not m.startswith(d + ".")} for m, deps in graph.items()}
    index, low, stack, on, circles, counter = {}, {}, [], set(), [], [0]

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                circles.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    assert circles == []


def test_moe_is_imported_before_megatron_core_by_every_module_of_ours():
    """moe/__init__.py settles megatron-core's import on a CPU (its fusions eager, not torch.compile'd): a module
    of rlpo_mega/ that imports megatron-core at its top must come after `moe`, by its own package's __init__
    (the package is imported before the module) or by an earlier import of its own."""
    def first(path, names):
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        for node in tree.body:
            mods = ([a.name for a in node.names] if isinstance(node, ast.Import)
                    else [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else [])
            for m in mods:
                if m.split(".")[0] in names:
                    return m.split(".")[0]
        return None

    bad = []
    for base, _, files in os.walk(os.path.join(ROOT, "rlpo_mega")):
        if not os.path.isfile(os.path.join(base, "__init__.py")):  # __pycache__ (compileall) and data folders
            continue
        parts = os.path.relpath(base, ROOT).split(os.sep)  # rlpo_mega/training/x.py: rlpo_mega, rlpo_mega/training
        packages = [os.path.join(ROOT, *parts[:k]) for k in range(1, len(parts) + 1)]
        package_has_moe = any(first(os.path.join(p, "__init__.py"), {"moe"}) for p in packages)
        for name in files:
            path = os.path.join(base, name)
            if name.endswith(".py") and not package_has_moe and first(path, {"moe", "megatron"}) == "megatron":
                bad.append(os.path.relpath(path, ROOT))
    assert bad == []
