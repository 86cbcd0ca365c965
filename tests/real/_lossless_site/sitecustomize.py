"""Server-side fixture of tests/real/test_lossless.py (on that server's PYTHONPATH only).

Runs the tier's own ``_stand_in/sitecustomize.py`` (Python imports one ``sitecustomize``), then
widens SGLang's dummy weights in memory to +-``DYNSPEC_DUMMY_RANGE`` with SGLang's own seed:
at its default +-1e-3 the tiny model ignores attention, so a wrong tree mask would still give
identical tokens and a losslessness test would have no power. No SGLang file changes.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys

_tier = os.path.join(os.environ["DYNSPEC_STAND_IN"], "sitecustomize.py")
_spec = importlib.util.spec_from_file_location("_tier_sitecustomize", _tier)
_mod = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_mod)

_LOADER = "sglang.srt.model_loader.loader"


def _widen(module) -> None:
    bound = float(os.environ["DYNSPEC_DUMMY_RANGE"])
    original = module.initialize_dummy_weights

    def initialize_dummy_weights(model, low=None, high=None, seed=1234):
        return original(model, low=-bound, high=bound, seed=seed)

    module.initialize_dummy_weights = initialize_dummy_weights


class _PatchLoader(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != _LOADER:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return None
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            _widen(module)

        spec.loader.exec_module = exec_and_patch
        return spec


if os.environ.get("DYNSPEC_DUMMY_RANGE"):
    sys.meta_path.insert(0, _PatchLoader())
