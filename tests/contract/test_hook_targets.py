"""Every hook target resolves in SGLang 0.5.23 with the signature the hooks expect, and SGLang's
own ``load_plugins()`` finds the plugin through its installed entry point and applies it."""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import subprocess
import sys
from importlib.metadata import entry_points

import pytest
from _contract_env import need

need()

from sglang.srt.plugins.hook_registry import HookRegistry, HookType  # noqa: E402

from tuner.plugin import _sglang  # noqa: E402

pytestmark = pytest.mark.contract


def params(fn) -> list[str]:
    return list(inspect.signature(fn).parameters)


def original(fn):
    """The function under SGLang's hook wrappers (``functools.wraps`` keeps ``__wrapped__``)."""
    return inspect.unwrap(fn)


def test_policy_class_target_and_its_protocol():
    from sglang.srt.speculative import adaptive_spec_params as asp
    from sglang.srt.speculative.adaptive_runtime_state import AdaptiveController

    from _contract_env import stock_adaptive_params

    stock = stock_adaptive_params()
    assert params(stock.__init__) == ["self", "initial_steps", "cfg_path"]
    assert params(stock.get_steps_for_batch) == ["self", "batch_size"]
    assert params(stock.on_verify_complete) == ["self", "num_correct_drafts_per_req", "batch_size"]
    assert params(stock.cuda_graph_bs_for_step) == ["self", "step"]
    assert params(stock.set_cuda_graph_bs) == ["self", "cuda_graph_bs"]
    assert "candidate_steps" in vars(stock)
    assert params(asp.adaptive_unsupported_reason) == ["server_args"]
    assert params(asp._load_adaptive_config) == ["cfg_path"]
    # The controller calls exactly these on the policy, and _activate is the unbuilt-step trap.
    assert params(AdaptiveController.__init__) == ["self", "worker", "policy"]
    assert params(AdaptiveController.activate_step_by_batch) == ["self", "batch_size"]
    assert params(AdaptiveController.init_states) == ["self", "cuda_graph_bs"]
    assert params(AdaptiveController._activate) == ["self", "speculative_num_steps"]


def test_scheduler_hook_targets():
    from sglang.srt.managers.io_struct import SetInternalStateReq, SetInternalStateReqOutput
    from sglang.srt.managers.scheduler_components.batch_result_processor import (
        SchedulerBatchResultProcessor,
    )
    from sglang.srt.managers.scheduler_components.internal_state import (
        SchedulerInternalStateController,
    )
    from sglang.srt.managers.utils import GenerationBatchResult

    ctl = SchedulerInternalStateController
    assert params(ctl.__init__) == ["self", "scheduler", "record_step_time"]
    assert params(original(ctl.set_internal_state)) == ["self", "recv_req"]
    assert params(original(ctl.get_internal_state)) == ["self", "recv_req"]
    assert SetInternalStateReq.__struct_fields__[-1] == "server_args"
    assert "updated" in SetInternalStateReqOutput.__struct_fields__

    proc = SchedulerBatchResultProcessor
    assert params(original(proc.process_batch_result_decode)) == ["self", "batch", "result"]
    assert params(original(proc.process_batch_result_prefill)) == ["self", "batch", "result"]
    fields = {f.name for f in dataclasses.fields(proc)}
    assert {"draft_worker", "model_worker"} <= fields
    result_fields = {f.name for f in dataclasses.fields(GenerationBatchResult)}
    assert {"speculative_num_draft_tokens", "num_correct_drafts", "accept_lens"} <= result_fields
    assert params(GenerationBatchResult.get_num_generated_tokens) == ["self", "batch_size"]


def test_scheduler_and_worker_modules_do_what_the_hooks_assume():
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.speculative.eagle_worker_v2 import EAGLEWorkerV2

    batch_fields = {f.name for f in dataclasses.fields(ScheduleBatch)}
    assert {"reqs", "launch_ts", "forward_iter", "after_idle_gap"} <= batch_fields
    # run_batch stamps every launch (the telemetry's clock and contiguity check).
    run_batch = inspect.getsource(original(Scheduler.run_batch))
    assert "batch.forward_iter = self.forward_ct" in run_batch
    assert "batch.launch_ts = time.monotonic()" in run_batch
    # The scheduler's draft worker is where the controller (and so our core) lives.
    assert "self.draft_worker = DraftWorkerClass(" in inspect.getsource(
        Scheduler.maybe_init_draft_worker
    )
    init = inspect.getsource(EAGLEWorkerV2.__init__)
    assert "self.adaptive_controller = AdaptiveController(" in init
    assert "AdaptiveSpeculativeParams(" in init
    assert params(EAGLEWorkerV2.activate_step_by_batch) == ["self", "batch_size"]
    assert params(EAGLEWorkerV2.on_verify_complete_cpu) == [
        "self", "num_correct_drafts_per_req", "batch_size"
    ]
    assert "self.activate_step_by_batch(batch.seq_lens.shape[0])" in inspect.getsource(
        EAGLEWorkerV2.forward_batch_generation
    )


def test_hook_registry_api():
    assert params(HookRegistry.register) == ["target", "hook", "hook_type", "source"]
    assert {t.name for t in HookType} >= {"BEFORE", "AFTER", "AROUND", "REPLACE"}


def test_entry_point_is_installed():
    [ep] = [ep for ep in entry_points(group="sglang.srt.plugins") if ep.name == "dynspec"]
    assert ep.value == "tuner.plugin:register"


def test_load_plugins_applies_every_hook(sglang_plugin):
    from sglang.srt.speculative import adaptive_spec_params as asp
    from sglang.srt.speculative import eagle_worker_v2

    policy_class = sglang_plugin._RT.policy_class
    assert asp.AdaptiveSpeculativeParams is policy_class
    # SGLang's propagation rebinds the name the EAGLE worker imported at module level.
    assert eagle_worker_v2.AdaptiveSpeculativeParams is policy_class
    assert sglang_plugin._missing_hooks() == []
    for target in _sglang.HOOK_TARGETS:
        assert target in HookRegistry._patched, target


# One fresh interpreter per case: load_plugins() patches process-global classes once.
_PROBE = """
import json
from sglang.srt.plugins import load_plugins
from sglang.srt.plugins.hook_registry import HookRegistry
from sglang.srt.speculative import adaptive_spec_params as asp
load_plugins()
print(json.dumps({"cls": asp.AdaptiveSpeculativeParams.__module__, "patched": sorted(HookRegistry._patched)}))
"""


@pytest.mark.parametrize("whitelist", ["dynspec", "someone_else"])
def test_sglang_plugins_whitelist(sglang_plugin, whitelist):
    env = {**os.environ, "SGLANG_PLUGINS": whitelist}
    out = subprocess.run(
        [sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    probe = json.loads(out.stdout.strip().splitlines()[-1])
    if whitelist == "dynspec":
        assert probe == {"cls": "tuner.plugin._sglang", "patched": sorted(_sglang.HOOK_TARGETS)}
    else:  # excluded: SGLang runs untouched
        assert probe == {"cls": "sglang.srt.speculative.adaptive_spec_params", "patched": []}
