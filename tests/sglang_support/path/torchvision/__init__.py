"""Test-support stand-in for torchvision. PyPI's torchvision wheels are CUDA builds that crash on import
against the CPU torch (`operator torchvision::nms does not exist`), and sglang 0.5.23 imports torchvision at
import time for image processors a text-only MoE server never runs. Every `torchvision.*` module and name
resolves to a placeholder that can be subclassed and referenced (default arguments, class bodies) but
raises when used. No dist-info: transformers' is_torchvision_available() stays False.
"""
import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0.0+rlpo.stub"


def _fail(*_a, **_k):
    raise NotImplementedError("torchvision is a test stub here (tests/sglang_support/path/torchvision): "
                              "this sglang code path needs real image ops, which the text-only CI never uses")


class _Meta(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder

    def __iter__(cls):
        return iter(())


class _Placeholder(metaclass=_Meta):
    def __init__(self, *a, **k):
        pass

    def __call__(self, *a, **k):
        _fail()

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder


def _module_getattr(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return _Placeholder


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        mod = types.ModuleType(spec.name)
        mod.__path__ = []
        mod.__getattr__ = _module_getattr
        return mod

    def exec_module(self, module):
        pass


sys.meta_path.append(_StubFinder())
__getattr__ = _module_getattr
