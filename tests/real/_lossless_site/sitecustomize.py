"""Server-side fixture of tests/real/test_lossless.py (on that server's PYTHONPATH only).

Runs the tier's own ``_stand_in/sitecustomize.py`` (Python imports one ``sitecustomize``), then
widens SGLang's dummy weights in memory to +-``DYNSPEC_DUMMY_RANGE`` with SGLang's own seed:
at its default +-1e-3 the tiny model ignores attention, so a wrong tree mask would still give
identical tokens and a losslessness test would have no power. With
``DYNSPEC_BREAK_TREE_MASK_FILE`` naming a path, the stand-in's extend attention ignores SGLang's
tree mask (causal among the draft tokens instead) while that file exists: the fault the
losslessness test must catch, switched at run time so it needs no server of its own. No SGLang
file changes.
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
_ATTENTION = "sgl_kernel.attention"


def _widen(module) -> None:
    bound = float(os.environ["DYNSPEC_DUMMY_RANGE"])
    original = module.initialize_dummy_weights

    def initialize_dummy_weights(model, low=None, high=None, seed=1234):
        return original(model, low=-bound, high=bound, seed=seed)

    module.initialize_dummy_weights = initialize_dummy_weights


def _break_mask(module) -> None:
    original = module.extend_visibility
    flag = os.environ["DYNSPEC_BREAK_TREE_MASK_FILE"]

    def extend_visibility(prefix_len, extend_len, *, is_causal=True, mask_rows=None):
        if os.path.exists(flag):  # one stat per call: cheap beside the attention itself
            mask_rows = None
        return original(prefix_len, extend_len, is_causal=is_causal, mask_rows=mask_rows)

    module.extend_visibility = extend_visibility


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    def __init__(self, name: str, patch) -> None:
        self.name, self.patch = name, patch

    def find_spec(self, name, path=None, target=None):
        if name != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return None
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            self.patch(module)

        spec.loader.exec_module = exec_and_patch
        return spec


if os.environ.get("DYNSPEC_DUMMY_RANGE"):
    sys.meta_path.insert(0, _PatchAfterImport(_LOADER, _widen))
if os.environ.get("DYNSPEC_BREAK_TREE_MASK_FILE"):
    sys.meta_path.insert(0, _PatchAfterImport(_ATTENTION, _break_mask))
