"""In-memory fixtures for a real SGLang server of tests/real (never installed).

The tier puts this folder on the server's PYTHONPATH only, so Python runs this in every
process SGLang starts (they are spawned). It registers a post-import patch: when SGLang's
``speculative.eagle_utils`` is first imported, its verify takes the sampled path for sampled
requests as on CUDA, with the pure-torch kernel ports in ``sampled_verify``. No SGLang file
changes; torch and SGLang are not imported here.
"""

from __future__ import annotations

import importlib.abc
import sys

_PATCHES = {"sglang.srt.speculative.eagle_utils": "_patch_eagle_utils"}


def _patch_eagle_utils(module) -> None:
    import sampled_verify

    module._verify_uses_greedy = sampled_verify.verify_uses_greedy
    module.tree_speculative_sampling_target_only = (
        sampled_verify.tree_speculative_sampling_target_only
    )
    module.top_k_renorm_prob = sampled_verify.top_k_renorm_prob
    module.top_p_renorm_prob = sampled_verify.top_p_renorm_prob


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name not in _PATCHES:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return None
        loader = spec.loader
        exec_module = loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            globals()[_PATCHES[name]](module)

        loader.exec_module = exec_and_patch
        return spec


import importlib.util  # noqa: E402  (after the class: importlib.abc alone does not load it)

sys.meta_path.insert(0, _PatchAfterImport())
