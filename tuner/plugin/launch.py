"""What an SGLang server needs on its command line for the plugin (``dynspec-tuner sglang-args``).

The arms are fixed when SGLang starts: it pre-builds one runtime state (CUDA graphs, buffers)
per candidate step of ``--speculative-adaptive-config``. With the plugin the file has a
single batch-size slot, ``{"1": {"candidate_steps": ARMS}}``, so every arm gets graphs at
every captured batch size and the plugin's table does the bucketing. A tree server (top-k > 1)
has exactly two arms, 0 and its depth: the plugin switches the configured tree on and off per
batch (``tuner.plugin._tree``). Pure: no SGLang import.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from tuner._atomic import write_atomic

__all__ = [
    "ALGORITHMS",
    "DEFAULT_ALGORITHM",
    "DEFAULT_ARMS",
    "DEFAULT_MAX_RUNNING_REQUESTS",
    "MANY_ARMS",
    "adaptive_config",
    "sglang_flags",
    "validate_arms",
    "write_adaptive_config",
]

DEFAULT_ARMS = (0, 1, 2, 3, 5)
# STANDALONE (a separate small draft model) runs adaptively only with the plugin loaded.
ALGORITHMS = ("EAGLE3", "EAGLE", "STANDALONE")
DEFAULT_ALGORITHM = "EAGLE3"
# SGLang caps EAGLE servers at 48 running requests unless told otherwise, which would keep
# the large-batch buckets (where k=0 usually wins) from ever being observed.
DEFAULT_MAX_RUNNING_REQUESTS = 256
# Each arm costs CUDA-graph capture time and memory outside SGLang's memory planning.
MANY_ARMS = 6
MAX_ARM = 16


def validate_arms(arms: Iterable[int]) -> tuple[int, ...]:
    """Sorted, de-duplicated arms. Raises ValueError naming the problem."""
    out = tuple(sorted({int(a) for a in arms}))
    if not out:
        raise ValueError("arms must not be empty")
    if out[0] < 0:
        raise ValueError(f"arms must be >= 0, got {list(out)}")
    if out[-1] > MAX_ARM:
        raise ValueError(
            f"arm {out[-1]} is larger than {MAX_ARM}: every step of the largest arm is "
            "drafted at every batch size, and SGLang sizes its buffers for it"
        )
    return out


def adaptive_config(arms: Iterable[int]) -> dict[str, Any]:
    """The single-slot ``--speculative-adaptive-config`` JSON for ``arms``."""
    return {"1": {"candidate_steps": list(validate_arms(arms))}}


def write_adaptive_config(arms: Iterable[int], path: str | os.PathLike[str]) -> Path:
    """Write :func:`adaptive_config` atomically. Raises OSError if it cannot be written."""
    target = Path(path)
    return write_atomic(target, json.dumps(adaptive_config(arms)) + "\n", parents=False)


def sglang_flags(
    *,
    config_path: str | os.PathLike[str],
    algorithm: str = DEFAULT_ALGORITHM,
    max_running_requests: int | None = DEFAULT_MAX_RUNNING_REQUESTS,
    initial_steps: int | None = None,
    arms: Iterable[int] | None = None,
    topk: int = 1,
    draft_tokens: int | None = None,
) -> list[str]:
    """The speculative flags for ``sglang.launch_server`` (model, draft model and keys aside).

    Args:
        config_path: the adaptive config written by :func:`write_adaptive_config`.
        algorithm: ``EAGLE3`` or ``EAGLE`` (the only ones SGLang runs adaptively).
        max_running_requests: raise SGLang's EAGLE default of 48; None leaves it out.
        initial_steps: the arm the server starts on (SGLang's default: the middle arm);
            must be one of ``arms`` when both are given.
        arms: the arms in the config, to check ``initial_steps`` against.
        topk: ``--speculative-eagle-topk``; above 1 a tree, whose arms must be ``[0, S]``
            (``S``, its depth, becomes ``--speculative-num-steps``).
        draft_tokens: a tree's node count (``--speculative-num-draft-tokens``), required
            with ``topk > 1``; chains leave it to SGLang (steps + 1).

    Raises:
        ValueError: an unknown algorithm, an initial step that is not an arm, or a tree
            that is not switchable (arms other than ``[0, S]``, no draft-token count).
    """
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {', '.join(ALGORITHMS)}, got {algorithm!r}")
    if topk < 1:
        raise ValueError(f"top-k must be >= 1, got {topk}")
    flags = [
        "--speculative-algorithm", algorithm,
        "--speculative-eagle-topk", str(topk),
        "--speculative-adaptive",
        "--speculative-adaptive-config", os.fspath(config_path),
    ]  # fmt: skip
    if topk > 1:
        built = validate_arms(arms if arms is not None else ())
        depth = built[-1]
        if len(built) != 2 or built[0] != 0 or depth < 1:
            raise ValueError(
                f"a tree (top-k {topk}) has two arms, 0 and its depth (e.g. 0,2); "
                f"got {list(built)}"
            )
        if draft_tokens is None:
            raise ValueError("a tree needs its draft-token count (SGLang's "
                             "--speculative-num-draft-tokens)")  # fmt: skip
        # SGLang picks the N - 1 best of topk + (steps - 1) * topk^2 drafted candidates.
        most = 1 + topk + (depth - 1) * topk * topk
        if not 2 <= draft_tokens <= most:
            raise ValueError(
                f"a top-{topk} tree of depth {depth} verifies 2..{most} draft tokens, "
                f"got {draft_tokens}"
            )
        if initial_steps is not None and initial_steps != depth:
            raise ValueError(f"a tree starts on its depth {depth}, not {initial_steps}")
        flags += ["--speculative-num-steps", str(depth),
                  "--speculative-num-draft-tokens", str(draft_tokens)]  # fmt: skip
        initial_steps = None
    elif draft_tokens is not None:
        raise ValueError("draft tokens are a tree's (top-k > 1); a chain verifies steps + 1")
    if initial_steps is not None:
        if arms is not None and initial_steps not in validate_arms(arms):
            raise ValueError(f"initial steps {initial_steps} is not among the arms")
        flags += ["--speculative-num-steps", str(initial_steps)]
    if max_running_requests is not None:
        if max_running_requests < 1:
            raise ValueError(f"max running requests must be >= 1, got {max_running_requests}")
        flags += ["--max-running-requests", str(max_running_requests)]
    return flags
