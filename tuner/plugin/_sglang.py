"""The hooks that put :class:`~tuner.plugin.core.PluginCore` inside SGLang 0.5.23.

SGLang calls :func:`register` in every process it starts (entry point group
``sglang.srt.plugins``, name ``dynspec``). It registers its hooks with SGLang's
``HookRegistry``; SGLang applies them right after:

- **policy** (class REPLACE of ``AdaptiveSpeculativeParams``): ``get_steps_for_batch`` looks the
  step count up in the core's table; ``on_verify_complete`` never switches on its own. The
  core's arms are the candidate steps SGLang builds runtime state for, and every table is
  validated against them, so no unbuilt step can ever be asked for.
- **update** (AROUND ``SchedulerInternalStateController.set_internal_state``): ``dynspec_*``
  keys are validated and applied atomically; other keys go to SGLang untouched.
- **readout** (AFTER ``...get_internal_state``): adds the protocol v2 ``"dynspec"`` section.
- **telemetry** (AFTER ``SchedulerBatchResultProcessor.process_batch_result_decode``):
  folds each verify result into the acceptance estimate on every TP rank (the lookup reads
  its band: docs/protocol.md says why the ranks agree) and feeds the core's counters on TP
  rank 0; an AFTER hook on
  ``process_batch_result_prefill`` tells the core that a prefill (or mixed) forward launched,
  which ends, and so times, the decode step before it.
- **trees** (:mod:`tuner.plugin._tree`): four config-time hooks that let a top-k > 1 server
  run adaptively with the arms 0 and its configured tree.

Nothing here imports SGLang at module level, and no hook lets an exception reach SGLang:
a server with a broken hook runs as stock SGLang and its readout says why.

Mixed updates (``dynspec_*`` keys together with SGLang's own keys, e.g.
``speculative_accept_threshold_single``): all or nothing. Our keys are validated first;
if they are invalid nothing is applied and SGLang is not called. Otherwise SGLang validates
and applies its keys (its own all-or-nothing rule); only if it answers ``updated=True`` is the
table committed. Either way the reply is a single ``updated`` flag for the whole request.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any

from tuner.plugin import _tree
from tuner.plugin.core import PluginCore
from tuner.protocol import (
    COUNTED_MAX_BATCH,
    DEPTH_EVERY,
    KEY_PREFIX,
    PROTOCOL_VERSION,
    DynspecState,
    ProtocolError,
    format_band_table,
    format_table,
    has_dynspec_keys,
    sglang_start_arm,
)

__all__ = [
    "HOOK_TARGETS",
    "POLICY_FILE_ENV",
    "READOUT_KEY",
    "TARGET_DECODE",
    "TARGET_GET_STATE",
    "TARGET_POLICY",
    "TARGET_PREFILL",
    "TARGET_SET_STATE",
    "build_policy_class",
    "core_of_worker",
    "register",
]

logger = logging.getLogger(__name__)

POLICY_FILE_ENV = "DYNSPEC_POLICY_FILE"
READOUT_KEY = "dynspec"

_ADAPTIVE_MOD = "sglang.srt.speculative.adaptive_spec_params"
_STATE_MOD = "sglang.srt.managers.scheduler_components.internal_state"
_RESULT_MOD = "sglang.srt.managers.scheduler_components.batch_result_processor"
_STATE_CLS = "SchedulerInternalStateController"
_RESULT_CLS = "SchedulerBatchResultProcessor"

TARGET_POLICY = f"{_ADAPTIVE_MOD}.AdaptiveSpeculativeParams"
TARGET_SET_STATE = f"{_STATE_MOD}.{_STATE_CLS}.set_internal_state"
TARGET_GET_STATE = f"{_STATE_MOD}.{_STATE_CLS}.get_internal_state"
TARGET_DECODE = f"{_RESULT_MOD}.{_RESULT_CLS}.process_batch_result_decode"
TARGET_PREFILL = f"{_RESULT_MOD}.{_RESULT_CLS}.process_batch_result_prefill"
HOOK_TARGETS = (
    TARGET_POLICY, TARGET_SET_STATE, TARGET_GET_STATE, TARGET_DECODE, TARGET_PREFILL,
    *_tree.TREE_HOOK_TARGETS,
)

# SGLang's idle-server health check sends one-token generates with these rids; they are not
# workload and SGLang's own step accounting skips them too.
_HEALTH_CHECK_PREFIX = "HEALTH_CHECK"
_SPECULATIVE_ALGORITHMS = ("EAGLE", "EAGLE3")
# Requests of a batch the decode hook looks at one by one (see decode_step_fn).
FULL_SAMPLE = COUNTED_MAX_BATCH

# Wall-clock start of this process (the plugin is loaded first thing in a scheduler process):
# the daemon compares it across reads to notice a restart.
_STARTED_AT = time.time()


class _Runtime:
    """Per-process plugin state that outlives any one SGLang object."""

    def __init__(self) -> None:
        self.registered = False
        self.policy_class: type | None = None
        self.register_error: str | None = None
        # Updates refused while no core exists (stock SGLang behaviour underneath).
        self.stock_rejected = 0
        self.stock_last_rejection: str | None = None
        self.hook_errors: dict[str, int] = {}
        self.hook_last_error: dict[str, str] = {}


_RT = _Runtime()


def _note_hook_error(hook: str, exc: BaseException) -> None:
    # Log the first failure of each hook with its traceback, then only count: a hook that
    # fails on every decode step must not flood the log.
    n = _RT.hook_errors.get(hook, 0) + 1
    _RT.hook_errors[hook] = n
    _RT.hook_last_error[hook] = f"{type(exc).__name__}: {exc}"
    if n == 1:
        logger.error("dynspec: the %s hook failed; SGLang carries on", hook, exc_info=exc)


# --- locating the core -----------------------------------------------------------------------


def core_of_worker(worker: object) -> PluginCore | None:
    """The core of a speculative worker's live policy, or None (stock policy / no adaptive)."""
    controller = getattr(worker, "adaptive_controller", None)
    return getattr(getattr(controller, "params", None), "dynspec", None)


def _is_tp_rank0() -> bool:
    try:
        from sglang.srt.runtime_context import get_parallel

        return int(get_parallel().tp_rank) == 0
    except Exception:  # no published parallel context (unit use): behave as the only rank
        return True


def _default_arm(arms: tuple[int, ...], initial_steps: int) -> int:
    # Start where SGLang starts (the worker's startup state), so installing the plugin
    # changes nothing until a table arrives.
    if initial_steps in arms:
        return initial_steps
    return sglang_start_arm(arms)


def _new_core(arms: list[int], initial_steps: int, env: Mapping[str, str]) -> PluginCore:
    core = PluginCore(
        arms,
        started_at=_STARTED_AT,
        default_arm=_default_arm(tuple(sorted(arms)), initial_steps),
        tree=_tree.tree_shape_from_spec(arms, initial_steps),
    )
    path = env.get(POLICY_FILE_ENV)
    if path:
        _install_policy_file(core, path)
    return core


def _install_policy_file(core: PluginCore, path: str) -> None:
    """Install a policy file's table (its bands, where it has them and this core learns
    per band: protocol v2, no draft tree), or keep the default table and say why. Never
    raises."""
    from tuner import policyfile

    try:
        core.install_file(policyfile.load(path))
    except (policyfile.PolicyFileError, ProtocolError, ValueError) as exc:
        # A PolicyFileError names the file already; a table that fits no built arm does not.
        where = "" if isinstance(exc, policyfile.PolicyFileError) else f"{path}: "
        reason = f"{POLICY_FILE_ENV} refused: {where}{exc}"
        core.reject(reason)
        logger.error(
            "dynspec: %s; starting with the default table %s", reason, format_table(core.table)
        )
        return
    logger.info(
        "dynspec: installed policy v%d from %s: %s",
        core.version,
        path,
        format_band_table(core.band_table),
    )


# --- the policy class ------------------------------------------------------------------------


def stock_adaptive_params() -> type:
    """SGLang's own ``AdaptiveSpeculativeParams``, also in a process where this plugin has
    replaced it (the replacement subclasses it). Imports sglang."""
    import importlib

    mod = importlib.import_module(_ADAPTIVE_MOD)
    cls = mod.AdaptiveSpeculativeParams
    while cls.__module__ != mod.__name__:
        cls = cls.__bases__[0]
    return cls


def build_policy_class(base: type) -> type:
    """Subclass SGLang's ``AdaptiveSpeculativeParams`` so our table decides each batch.

    SGLang's constructor still parses and validates the adaptive config file (its errors stay
    SGLang's errors) and its ``candidate_steps`` — the states ``init_states`` builds — become
    the core's arms. Methods call ``super()``, never ``base.method(self)``: SGLang's patch
    propagation rebinds the base's name in every module, which would recurse.
    """

    class DynspecAdaptiveParams(base):  # type: ignore[misc, valid-type]
        """``AdaptiveSpeculativeParams`` deciding by dynspec's table (deterministic lookup)."""

        def __init__(self, initial_steps: int, cfg_path: str | None = None) -> None:
            super().__init__(initial_steps, cfg_path)
            self.dynspec: PluginCore | None = None
            self._dynspec_step: Callable[[Any, Any], None] | None = None
            self._dynspec_forward: Callable[..., None] | None = None
            try:
                arms = [int(s) for s in self.candidate_steps]
                core = _new_core(arms, int(initial_steps), os.environ)
                if len(getattr(self, "_slots", ())) > 1:
                    logger.warning(
                        "dynspec: the adaptive config has %d batch-size slots; arms have CUDA "
                        "graphs only inside their slots. Use a single slot "
                        "(dynspec-tuner sglang-args writes one).",
                        len(self._slots),
                    )
                self._dynspec_default = core.ks_for(1)[core.acceptance.band]
                rank0 = _is_tp_rank0()
                # Every rank folds verify results into the acceptance estimate (the lookup
                # needs it everywhere); only rank 0 keeps the counters the readout reports.
                self._dynspec_step = decode_step_fn(core, record=rank0)
                if rank0:
                    self._dynspec_forward = core.record_forward
                self.dynspec = core
                logger.info(
                    "dynspec: deciding speculative steps per batch; arms %s%s, table %s",
                    list(core.arms),
                    "" if core.tree is None else f" (tree {core.tree.to_json()})",
                    format_band_table(core.band_table),
                )
            except Exception as exc:  # stock behaviour rather than a dead server
                _note_hook_error("policy", exc)

        def get_steps_for_batch(self, batch_size: int) -> int:
            core = self.dynspec
            if core is None:
                return super().get_steps_for_batch(batch_size)
            try:
                # PluginCore.steps_for_batch inlined: this runs at every decode launch.
                if core.probes:
                    k = core.probe_arm(batch_size)
                    if k is not None:
                        return k
                index = core._index
                ks = index.flat[batch_size] if 0 <= batch_size < index.n_flat else \
                    index.ks_for(batch_size)
                return ks[core.acceptance.band]
            except Exception as exc:
                _note_hook_error("policy", exc)
                return self._dynspec_default

        def on_verify_complete(
            self, num_correct_drafts_per_req: list[int], batch_size: int
        ) -> int | None:
            if self.dynspec is None:
                return super().on_verify_complete(num_correct_drafts_per_req, batch_size)
            # The next launch asks get_steps_for_batch anyway; never switch from here.
            return None

    DynspecAdaptiveParams.__module__ = __name__
    DynspecAdaptiveParams.__qualname__ = "DynspecAdaptiveParams"
    return DynspecAdaptiveParams


# --- scheduler hooks -------------------------------------------------------------------------


def _stock_reject(reason: str) -> None:
    _RT.stock_rejected += 1
    _RT.stock_last_rejection = reason
    logger.warning("dynspec: update refused: %s", reason)


def set_internal_state_hook(original: Callable[..., Any], self: Any, recv_req: Any, *args: Any,
                            **kwargs: Any) -> Any:
    """AROUND ``SchedulerInternalStateController.set_internal_state`` (see module doc)."""
    try:
        plan = _plan_update(self, recv_req)
    except Exception as exc:
        _note_hook_error("update", exc)
        plan = _REFUSE
    if plan is None:
        return original(self, recv_req, *args, **kwargs)
    if plan is _REFUSE:
        return _updated(False)
    core, table, version, probes, rest = plan
    out = None
    if rest:
        # SGLang validates and applies its own keys all-or-nothing; ours wait for its verdict.
        try:
            theirs = _with_server_args(recv_req, rest)
        except Exception as exc:
            _note_hook_error("update", exc)
            return _updated(False)
        out = original(self, theirs, *args, **kwargs)
        if not getattr(out, "updated", False):
            try:
                core.reject(f"SGLang refused the other keys of this update ({', '.join(rest)})")
            except Exception as exc:
                _note_hook_error("update", exc)
            return out
    try:
        core.commit_update(table, version, probes)
        logger.info("dynspec: policy v%d applied: %s%s", version, format_band_table(table),
                    f" (probes {[list(p) for p in probes]})" if probes else "")
    except Exception as exc:  # cannot happen with a checked table; never raise regardless
        _note_hook_error("update", exc)
        return out if out is not None else _updated(False)
    return out if out is not None else _updated(True)


_REFUSE = object()


def _plan_update(controller: Any, recv_req: Any) -> Any:
    """None: not ours, pass through. _REFUSE: refused (counted). Else what to commit."""
    server_args = getattr(recv_req, "server_args", None)
    if not isinstance(server_args, Mapping) or not has_dynspec_keys(server_args):
        return None
    core = core_of_worker(getattr(controller.scheduler, "draft_worker", None))
    if core is None:
        _stock_reject(f"dynspec is not live here: {_stock_reason(controller.scheduler, None)}")
        return _REFUSE
    try:
        table, version, probes = core.check_update(server_args)
    except ProtocolError as exc:
        core.reject(str(exc))
        logger.warning("dynspec: update refused: %s", exc)
        return _REFUSE
    rest = {k: v for k, v in server_args.items() if not str(k).startswith(KEY_PREFIX)}
    return core, table, version, probes, rest


def _with_server_args(recv_req: Any, server_args: dict[str, Any]) -> Any:
    import msgspec

    return msgspec.structs.replace(recv_req, server_args=server_args)


def _updated(flag: bool) -> Any:
    from sglang.srt.managers.io_struct import SetInternalStateReqOutput

    return SetInternalStateReqOutput(updated=flag)


def get_internal_state_hook(result: Any, self: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER ``SchedulerInternalStateController.get_internal_state``: add ``"dynspec"``."""
    try:
        state = result.internal_state
        state[READOUT_KEY] = readout(self.scheduler, state)
    except Exception as exc:
        _note_hook_error("readout", exc)
    return None


def decode_result_hook(result_: Any, self: Any, batch: Any, result: Any, *args: Any,
                       **kwargs: Any) -> None:
    """AFTER ``SchedulerBatchResultProcessor.process_batch_result_decode``: the acceptance
    estimate (every TP rank) and telemetry (rank 0). Runs on every decode result, so it stays
    a few attribute reads; the rest is :func:`decode_step_fn`'s closure."""
    try:
        controller = getattr(self.draft_worker, "adaptive_controller", None)
        step = getattr(getattr(controller, "params", None), "_dynspec_step", None)
        if step is not None:  # else: stock policy
            step(batch, result)
    except Exception as exc:
        _note_hook_error("telemetry", exc)
    return None


def decode_step_fn(core: PluginCore, *, record: bool) -> Callable[[Any, Any], None]:
    """What the decode hook does with one ``(batch, result)``, its lookups bound once.

    ``k`` comes from the result (the step's own width): the worker already holds the next
    step's setting. The per-request accepted counts are SGLang's
    ``result.num_correct_drafts_per_req_cpu`` (filled before ``on_verify_complete``), the same
    list on every TP rank. With ``record`` false (TP ranks other than 0) only the estimate
    is fed.
    """
    width_arm = core.width_arm
    estimate = core.acceptance
    observe = estimate.observe_totals
    count = core.telemetry.record
    depths, every = core.record_depths, DEPTH_EVERY
    sample = FULL_SAMPLE
    health = _HEALTH_CHECK_PREFIX

    def step(batch: Any, result: Any) -> None:
        reqs = batch.reqs
        b = len(reqs)
        draft_tokens = result.speculative_num_draft_tokens
        if not b or draft_tokens is None:
            return
        rid = reqs[0].rid
        if rid.__class__ is str and rid.startswith(health):
            if all(str(r.rid).startswith(health) for r in reqs):
                return
        k = width_arm.get(draft_tokens)
        if k is None:
            k = draft_tokens - 1
        accepted = result.num_correct_drafts
        per_req = result.num_correct_drafts_per_req_cpu
        # SGLang summed the list into num_correct_drafts already; what is left is how many
        # requests accepted every draft, counted exactly up to FULL_SAMPLE requests; above,
        # the estimate takes its expectation (AcceptanceEstimate.observe_totals), which keeps
        # the hook's cost flat in the batch size.
        if per_req is None:
            band = estimate.band
        elif not accepted or accepted == b * k:  # none or all accepted every draft: no count
            band = observe(k, b, accepted, b if accepted else 0)
        elif b <= sample:
            band = observe(k, b, accepted, per_req.count(k))
        else:
            band = observe(k, b, accepted)
        if record:
            launch_ts = batch.launch_ts
            forward_iter = batch.forward_iter
            if launch_ts is None or forward_iter is None:
                return
            # Requests that accepted no draft, where the band counters keep them
            # (BandCounter.first_counted: a known band, k >= 2, up to FULL_SAMPLE requests).
            rejected = 0
            if band and k > 1 and b <= sample and per_req is not None and accepted != b * k:
                rejected = per_req.count(0) if accepted else b
            # emitted is accepted + b for EAGLE; the readout derives it.
            count(b, k, 0, accepted, launch_ts, forward_iter, batch.after_idle_gap, band,
                  rejected)
            # record_depths keeps the sampling rule; testing it here first saves the call
            # on the seven forwards in eight it would refuse.
            if not forward_iter % every and per_req is not None:
                depths(k, per_req, forward_iter)

    return step


def prefill_result_hook(result_: Any, self: Any, batch: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER ``SchedulerBatchResultProcessor.process_batch_result_prefill``: a non-decode
    forward launched. Results are processed in launch order, so it closes the pending decode
    step (timed if it launched right after it)."""
    try:
        params = getattr(getattr(self.draft_worker, "adaptive_controller", None), "params", None)
        close = getattr(params, "_dynspec_forward", None)
        if close is None:
            return None
        launch_ts, forward_iter = batch.launch_ts, batch.forward_iter
        if launch_ts is None or forward_iter is None:
            return None
        close(launch_ts, forward_iter, bool(batch.after_idle_gap))
    except Exception as exc:
        _note_hook_error("telemetry", exc)
    return None


# --- readout ---------------------------------------------------------------------------------


def _hook_in_place(module: str, owner: str, attr: str, hook: Callable[..., Any]) -> bool:
    """Whether ``hook`` is in the wrapper chain now installed at ``module.owner.attr``."""
    mod = sys.modules.get(module)
    return _tree.wraps(getattr(getattr(mod, owner, None), attr, None), hook)


def _missing_hooks() -> list[str]:
    missing = []
    checks = (
        (TARGET_SET_STATE, _STATE_MOD, _STATE_CLS, "set_internal_state", set_internal_state_hook),
        (TARGET_GET_STATE, _STATE_MOD, _STATE_CLS, "get_internal_state", get_internal_state_hook),
        (TARGET_DECODE, _RESULT_MOD, _RESULT_CLS, "process_batch_result_decode",
         decode_result_hook),
        (TARGET_PREFILL, _RESULT_MOD, _RESULT_CLS, "process_batch_result_prefill",
         prefill_result_hook),
    )
    for target, module, owner, attr, hook in checks:
        if not _hook_in_place(module, owner, attr, hook):
            missing.append(target.rsplit(".", 2)[-2] + "." + attr)
    return missing


def _stock_reason(scheduler: Any, state: Mapping[str, Any] | None) -> str:
    """Why no core is deciding in this process, in words for an operator."""
    if _RT.register_error is not None:
        return f"the plugin failed to register: {_RT.register_error}"
    if state is None:
        try:
            from sglang.srt.runtime_context import get_context

            state = get_context().resolved_server_args_dict()
        except Exception:
            state = {}
    algorithm = state.get("speculative_algorithm")
    if algorithm not in _SPECULATIVE_ALGORITHMS:
        return f"speculative_algorithm={algorithm}: dynspec needs EAGLE or EAGLE3"
    if not state.get("speculative_adaptive"):
        why = None
        try:
            from sglang.srt.runtime_context import get_context
            from sglang.srt.speculative.adaptive_spec_params import adaptive_unsupported_reason

            why = adaptive_unsupported_reason(get_context().server_args)
        except Exception:
            why = None
        if why:
            return f"SGLang refused adaptive speculative decoding: {why}"
        return "the server runs without --speculative-adaptive"
    adaptive = sys.modules.get(_ADAPTIVE_MOD)
    live_cls = getattr(adaptive, "AdaptiveSpeculativeParams", None)
    if _RT.policy_class is None or live_cls is not _RT.policy_class:
        return "the policy class hook is not in place (see 'Failed to apply hooks' in the log)"
    if getattr(scheduler, "draft_worker", None) is None:
        return "this process hosts no draft worker"
    if _RT.hook_errors.get("policy"):
        return f"the policy failed to start: {_RT.hook_last_error['policy']}"
    return "no adaptive controller in this process"


def readout(scheduler: Any, state: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The ``"dynspec"`` section for one scheduler (builtins only).

    With a live core: its table and counters, ``hooks_live`` true unless a hook is missing.
    Without one: a one-arm section (the server's static step count) with ``hooks_live``
    false and the reason, so the daemon can tell operators what to fix.
    """
    core = core_of_worker(getattr(scheduler, "draft_worker", None))
    if core is not None:
        missing = _missing_hooks()
        if core.tree is not None:
            missing += _tree.missing_tree_hooks()
        reason = f"hooks not in place: {', '.join(missing)}" if missing else None
        out = core.readout(hooks_live=not missing, reason=reason)
        if core.protocol == 1:
            # busy_s to the microsecond (SGLang's own step-time resolution), as v1 plugins
            # did; v2 writes integer microseconds.
            for row in out["counters"]:
                row[6] = round(row[6], 6)
    else:
        steps = (state or {}).get("speculative_num_steps")
        k = steps if isinstance(steps, int) and not isinstance(steps, bool) and steps >= 0 else 0
        out = DynspecState(
            arms=(k,),
            policy_version=0,
            table=((None, k),),
            counters=(),
            started_at=_STARTED_AT,
            updates_applied=0,
            updates_rejected=_RT.stock_rejected,
            hooks_live=False,
            reason=_stock_reason(scheduler, state),
            last_rejection=_RT.stock_last_rejection,
            protocol=PROTOCOL_VERSION,
        ).to_json()
    if _RT.hook_errors:
        out["hook_errors"] = dict(_RT.hook_errors)
    return out


# --- registration ----------------------------------------------------------------------------


def register() -> None:
    """SGLang's plugin entry point: register the hooks (SGLang applies them). Never raises.

    Cheap: imports SGLang's hook registry and the adaptive-params module, which SGLang would
    import anyway to apply the hooks. Calling it twice registers nothing twice.
    """
    if _RT.registered:
        return
    try:
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType
        from sglang.srt.speculative import adaptive_spec_params

        policy_class = build_policy_class(adaptive_spec_params.AdaptiveSpeculativeParams)
        HookRegistry.register(TARGET_POLICY, policy_class, HookType.REPLACE)
        HookRegistry.register(TARGET_SET_STATE, set_internal_state_hook, HookType.AROUND)
        HookRegistry.register(TARGET_GET_STATE, get_internal_state_hook, HookType.AFTER)
        HookRegistry.register(TARGET_DECODE, decode_result_hook, HookType.AFTER)
        HookRegistry.register(TARGET_PREFILL, prefill_result_hook, HookType.AFTER)
        _tree.register_tree_hooks(HookRegistry, HookType)
    except Exception as exc:
        _RT.register_error = f"{type(exc).__name__}: {exc}"
        logger.exception("dynspec: could not register the SGLang hooks; SGLang runs as stock")
        return
    _RT.policy_class = policy_class
    _RT.registered = True
