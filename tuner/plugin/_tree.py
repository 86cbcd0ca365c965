"""Per-batch speculation on/off for EAGLE trees (``--speculative-eagle-topk`` > 1), SGLang 0.5.23.

SGLang's adaptive mode already switches runtime states per decode batch, and its ``steps = 0``
state is a plain target decode handed to the scheduler in the speculative format
(``speculative/eagle_worker_v2.py``, ``EAGLEWorkerV2._build_trivial_verify_input``), with the
default draft extend keeping the draft in sync. Three config-time refusals keep it from trees;
these hooks lift them, and only for the one shape that is safe to switch — candidate steps
``[0, S]`` with ``S = --speculative-num-steps``:

- AROUND ``speculative/adaptive_spec_params.py::adaptive_unsupported_reason`` (line 56; its
  ``speculative_eagle_topk != 1`` refusal at line 75): SGLang's other refusals still stand
  (they are re-asked with top-k read as 1); a tree with other candidate steps is refused with
  our own reason. Also lifts "only EAGLE/EAGLE3" for STANDALONE (a separate small draft model).
- AROUND ``arg_groups/speculative_hook.py::_init_adaptive_speculative_params`` (line 1392),
  which forces ``speculative_num_draft_tokens = steps + 1`` (line 1426): a tree keeps its
  configured node count.
- AROUND ``speculative/spec_info.py``
  ``SpeculativeAlgorithm.resolve_max_speculative_num_draft_tokens`` (line 268), which answers
  ``max(candidate_steps) + 1`` under adaptive (line 289) and so fails start-up against a
  tree's larger width (``arg_groups/overrides.py`` line 1951): the answer is at least the
  tree's width.
- AFTER ``speculative/standalone_worker_v2.py::StandaloneWorkerV2.__init__`` (line 139), which
  leaves ``adaptive_controller`` None ("TODO: Adaptive speculative", line 182): the controller
  EAGLEWorkerV2 builds, built the same way. The rest is inherited from EAGLEWorkerV2.

Then ``EAGLEWorkerV2.init_cuda_graphs`` registers the startup tree (steps S, N draft tokens)
and ``AdaptiveController.init_states`` (``speculative/adaptive_runtime_state.py`` line 103)
builds only what is missing: the ``steps = 0`` state (one draft token). The plugin's policy
class (``_sglang.build_policy_class``) picks 0 or S per batch from the table.

Plugins load before SGLang resolves its server args (``launch_server.py``), so these
config-time hooks take effect in the main process. Nothing here imports SGLang at module level.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Iterable
from typing import Any

from tuner.protocol import TreeShape

__all__ = [
    "TARGET_INIT_PARAMS",
    "TARGET_MAX_DRAFT",
    "TARGET_STANDALONE_INIT",
    "TARGET_UNSUPPORTED",
    "TREE_HOOK_TARGETS",
    "register_tree_hooks",
    "tree_refusal",
    "tree_shape_from_spec",
]

logger = logging.getLogger(__name__)

_ADAPTIVE_MOD = "sglang.srt.speculative.adaptive_spec_params"
_SPEC_HOOK_MOD = "sglang.srt.arg_groups.speculative_hook"
_SPEC_INFO_MOD = "sglang.srt.speculative.spec_info"
_STANDALONE_MOD = "sglang.srt.speculative.standalone_worker_v2"

TARGET_UNSUPPORTED = f"{_ADAPTIVE_MOD}.adaptive_unsupported_reason"
TARGET_INIT_PARAMS = f"{_SPEC_HOOK_MOD}._init_adaptive_speculative_params"
TARGET_MAX_DRAFT = (
    f"{_SPEC_INFO_MOD}.SpeculativeAlgorithm.resolve_max_speculative_num_draft_tokens"
)
TARGET_STANDALONE_INIT = f"{_STANDALONE_MOD}.StandaloneWorkerV2.__init__"
TREE_HOOK_TARGETS = (TARGET_UNSUPPORTED, TARGET_INIT_PARAMS, TARGET_MAX_DRAFT,
                     TARGET_STANDALONE_INIT)

_DECLARED_BY = "dynspec.tree"
_ADAPTIVE_ALGORITHMS = ("EAGLE", "EAGLE3")


def tree_refusal(
    topk: int | None,
    num_steps: int | None,
    num_draft_tokens: int | None,
    candidate_steps: Iterable[int],
) -> str | None:
    """Why a top-k > 1 config cannot run adaptively under dynspec, or None if it can (pure).

    The only tree shape switched is the configured one against no speculation: candidate
    steps ``[0, S]``. SGLang builds every other candidate with ``steps + 1`` draft tokens
    (``AdaptiveController.init_states``), which for a tree is a different, unmeasured shape.
    """
    if topk is None or topk == 1:
        return None
    steps = sorted({int(s) for s in candidate_steps})
    depth = num_steps if num_steps is not None else steps[len(steps) // 2]
    if depth < 1 or steps != [0, depth]:
        return (
            f"speculative_eagle_topk={topk}: dynspec switches a tree only between off and "
            f"the configured tree, so the adaptive config's candidate_steps must be [0, S] "
            f"with S = --speculative-num-steps (got candidate_steps {steps}, steps {num_steps})"
        )
    if num_draft_tokens is None or num_draft_tokens < 2:
        return (
            f"speculative_eagle_topk={topk}: set --speculative-num-draft-tokens (the tree's "
            f"node count) explicitly, got {num_draft_tokens}"
        )
    return None


def tree_shape_from_spec(arms: Iterable[int], initial_steps: int) -> TreeShape | None:
    """The tree the running server drafts, from SGLang's published spec config; None for a
    chain or where no config is published."""
    try:
        from sglang.srt.runtime_context import get_spec

        spec = get_spec()
        topk = spec.speculative_eagle_topk
        draft_tokens = spec.speculative_num_draft_tokens
    except Exception:  # no published config (unit use): a chain
        return None
    if topk is None or int(topk) == 1:
        return None
    why = tree_refusal(int(topk), int(initial_steps), draft_tokens, arms)
    if why is not None:
        raise ValueError(why)
    return TreeShape(topk=int(topk), steps=int(initial_steps), draft_tokens=int(draft_tokens))


# --- the hooks -------------------------------------------------------------------------------


class _Relaxed:
    """``server_args`` read with top-k 1 and STANDALONE as EAGLE, to ask SGLang's remaining
    refusals. SGLang's views read the declaration stash first, so one more declaration on a
    copied stash is all it takes; the record itself is untouched."""

    def __init__(self, server_args: Any, **fields: Any) -> None:
        object.__setattr__(self, "_record", server_args)
        stash = list(getattr(server_args, "_resolved_overrides", None) or ())
        stash.append((_DECLARED_BY, fields))
        object.__setattr__(self, "_resolved_overrides", stash)

    def __getattr__(self, name: str) -> Any:
        return getattr(object.__getattribute__(self, "_record"), name)


def _view(server_args: Any) -> Any:
    from sglang.srt.arg_groups.overrides import resolving_view

    return resolving_view(server_args)


def unsupported_reason_hook(original: Callable[..., Any], server_args: Any, *args: Any,
                            **kwargs: Any) -> Any:
    """AROUND ``adaptive_unsupported_reason``: lift the top-k (and STANDALONE) refusal."""
    reason = original(server_args, *args, **kwargs)
    if reason is None:
        return None
    try:
        cfg = _view(server_args)
        topk = cfg.speculative_eagle_topk
        algorithm = cfg.speculative_algorithm
        fields: dict[str, Any] = {}
        if topk is not None and topk != 1:
            fields["speculative_eagle_topk"] = 1
        if algorithm == "STANDALONE":
            fields["speculative_algorithm"] = "EAGLE"
        if not fields:
            return reason
        rest = original(_Relaxed(server_args, **fields), *args, **kwargs)
        if rest is not None:
            return rest  # another of SGLang's refusals stands
        from sglang.srt.speculative.adaptive_spec_params import (
            resolve_candidate_steps_from_config,
        )

        steps = resolve_candidate_steps_from_config(cfg_path=cfg.speculative_adaptive_config)
        ours = tree_refusal(topk, cfg.speculative_num_steps, cfg.speculative_num_draft_tokens,
                            steps)
        if ours is None:
            logger.info("dynspec: adaptive speculative decoding for %s, top-k %s, steps %s",
                        algorithm, topk, steps)
        return ours
    except Exception as exc:  # SGLang's own answer rather than a guess
        _note("tree-config", exc)
        return reason


def init_adaptive_params_hook(original: Callable[..., Any], server_args: Any, *args: Any,
                              **kwargs: Any) -> Any:
    """AROUND ``_init_adaptive_speculative_params``: a tree keeps its draft-token count."""
    try:
        cfg = _view(server_args)
        topk, configured = cfg.speculative_eagle_topk, cfg.speculative_num_draft_tokens
    except Exception as exc:
        _note("tree-config", exc)
        topk = configured = None
    out = original(server_args, *args, **kwargs)
    if topk is not None and topk != 1 and configured is not None:
        try:
            from sglang.srt.arg_groups.overrides import declare_resolution

            declare_resolution(server_args, _DECLARED_BY, speculative_num_draft_tokens=configured)
        except Exception as exc:
            _note("tree-config", exc)
    return out


def max_draft_tokens_hook(original: Callable[..., Any], self: Any, server_args: Any, *args: Any,
                          **kwargs: Any) -> Any:
    """AROUND ``SpeculativeAlgorithm.resolve_max_speculative_num_draft_tokens``: buffers are
    sized for the tree's width, not for ``max(candidate_steps) + 1``."""
    out = original(self, server_args, *args, **kwargs)
    try:
        cfg = _view(server_args)
        topk, width = cfg.speculative_eagle_topk, cfg.speculative_num_draft_tokens
        if out is not None and cfg.speculative_adaptive and topk not in (None, 1) and width:
            return max(out, int(width))
    except Exception as exc:
        _note("tree-config", exc)
    return out


def standalone_init_hook(result: Any, self: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER ``StandaloneWorkerV2.__init__``: the adaptive controller, as EAGLEWorkerV2 builds
    it (``eagle_worker_v2.py`` line 1349), deciding with the (replaced) policy class."""
    try:
        from sglang.srt.runtime_context import get_spec

        spec = get_spec()
        if getattr(self, "adaptive_controller", None) is None and spec.speculative_adaptive:
            from sglang.srt.speculative import adaptive_spec_params
            from sglang.srt.speculative.adaptive_runtime_state import AdaptiveController

            self.adaptive_controller = AdaptiveController(
                self,
                adaptive_spec_params.AdaptiveSpeculativeParams(
                    initial_steps=self.speculative_num_steps,
                    cfg_path=spec.speculative_adaptive_config,
                ),
            )
    except Exception as exc:  # the worker runs static, as stock STANDALONE does
        _note("standalone", exc)
    return None


def _note(hook: str, exc: BaseException) -> None:
    from tuner.plugin._sglang import _note_hook_error

    _note_hook_error(hook, exc)


# --- registration and liveness ---------------------------------------------------------------


def register_tree_hooks(registry: Any, hook_type: Any) -> None:
    """Register the four hooks with SGLang's ``HookRegistry`` (called by ``register``)."""
    registry.register(TARGET_UNSUPPORTED, unsupported_reason_hook, hook_type.AROUND)
    registry.register(TARGET_INIT_PARAMS, init_adaptive_params_hook, hook_type.AROUND)
    registry.register(TARGET_MAX_DRAFT, max_draft_tokens_hook, hook_type.AROUND)
    registry.register(TARGET_STANDALONE_INIT, standalone_init_hook, hook_type.AFTER)


def wraps(fn: Any, hook: Callable[..., Any]) -> bool:
    """Whether ``hook`` is in ``fn``'s wrapper chain (closures and ``__wrapped__``)."""
    for _ in range(64):
        if fn is None:
            return False
        if fn is hook:
            return True
        for cell in getattr(fn, "__closure__", None) or ():
            try:
                if cell.cell_contents is hook:
                    return True
            except ValueError:  # empty cell
                continue
        fn = getattr(fn, "__wrapped__", None)
    return False


def missing_tree_hooks() -> list[str]:
    """The config-time tree hooks not in place in this process (names for an operator)."""
    checks = (
        (_ADAPTIVE_MOD, None, "adaptive_unsupported_reason", unsupported_reason_hook),
        (_SPEC_HOOK_MOD, None, "_init_adaptive_speculative_params", init_adaptive_params_hook),
        (_SPEC_INFO_MOD, "SpeculativeAlgorithm", "resolve_max_speculative_num_draft_tokens",
         max_draft_tokens_hook),
    )
    missing = []
    for module, owner, attr, hook in checks:
        obj = sys.modules.get(module)
        if owner is not None:
            obj = getattr(obj, owner, None)
        if not wraps(getattr(obj, attr, None), hook):
            missing.append(f"{owner or module.rsplit('.', 1)[-1]}.{attr}")
    return missing
