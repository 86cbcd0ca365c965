"""Policies by name: ``POLICIES`` maps a name to its class, ``make_policy`` builds one.

A policy class carries its parameter dataclass in ``params_class``; ``make_policy`` turns
keyword parameters into it, so a bad name or value fails here, naming it, before anything runs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import fields
from typing import Any

from policies._base import BasePolicy, Buckets
from policies._model import ModelPolicy
from policies._optuna import OptunaPolicy
from policies._static import (
    AlwaysPolicy,
    NeverPolicy,
    SGLangDefaultPolicy,
    TablePolicy,
    ThresholdPolicy,
)
from policies._thompson import ThompsonPolicy
from policies._ucb import UCBPolicy

__all__ = ["DEFAULT_POLICY", "POLICIES", "make_policy", "policy_parameters"]

POLICIES: dict[str, Callable[..., BasePolicy]] = {
    cls.name: cls
    for cls in (
        NeverPolicy,
        AlwaysPolicy,
        ThresholdPolicy,
        TablePolicy,
        SGLangDefaultPolicy,
        ThompsonPolicy,
        UCBPolicy,
        ModelPolicy,
        OptunaPolicy,
    )
}

# Chosen by the bench (README, "bench"): the policy closest to the oracle across profiles,
# with the least exploration.
DEFAULT_POLICY = "model"


def policy_parameters(name: str) -> tuple[str, ...]:
    """The keyword parameters policy ``name`` accepts (besides arms, buckets and seed)."""
    cls = _lookup(name)
    params_class = getattr(cls, "params_class", None)
    return tuple(f.name for f in fields(params_class)) if params_class is not None else ()


def _lookup(name: str) -> Callable[..., BasePolicy]:
    try:
        return POLICIES[name]
    except KeyError:
        raise ValueError(
            f"unknown policy {name!r}; known: {', '.join(sorted(POLICIES))}"
        ) from None


def make_policy(
    name: str,
    *,
    arms: Iterable[int],
    buckets: Buckets | None = None,
    seed: int = 0,
    **params: Any,
) -> BasePolicy:
    """Build policy ``name`` with its parameters given as keywords.

    Args:
        name: a key of :data:`POLICIES`.
        arms: the arms the server built.
        buckets: the batch-size buckets (default :class:`Buckets`).
        seed: seeds the policy's random generator.
        **params: fields of the policy's parameter dataclass.

    Raises:
        ValueError: unknown policy, unknown parameter, or a parameter out of range (the
            message names it).
    """
    cls = _lookup(name)
    known = policy_parameters(name)
    unknown = sorted(set(params) - set(known))
    if unknown:
        raise ValueError(
            f"unknown parameter {unknown[0]!r} for policy {name!r}; "
            f"known: {', '.join(known) or '(none)'}"
        )
    params_class = getattr(cls, "params_class", None)
    if params_class is None:
        return cls(arms=arms, buckets=buckets, seed=seed)
    try:
        p = params_class(**params)
    except TypeError as exc:  # e.g. a positional mix-up; report as a parameter error
        raise ValueError(f"bad parameters for policy {name!r}: {exc}") from exc
    return cls(arms=arms, buckets=buckets, seed=seed, params=p)
