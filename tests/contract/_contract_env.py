"""Shared pieces of the contract tests (imported by name: pytest puts this folder on sys.path).

Only what SGLang cannot build on a CPU is faked here: the speculative worker (its runtime
states hold CUDA graphs) and the scheduler around the controllers (model, memory pools).
Everything the plugin touches is SGLang's own class.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

REASON = (
    "needs the contract environment (SGLang 0.5.23 on CPU): build it with "
    "scripts/contract-env.sh, then run `$(scripts/contract-env.sh)/bin/python -m pytest "
    "tests/contract`"
)


def need() -> None:
    """Skip (with how to build the environment) where SGLang is not installed."""
    pytest.importorskip("sglang", reason=REASON)


def stock_adaptive_params() -> type:
    """SGLang's own ``AdaptiveSpeculativeParams``, even after the plugin replaced it."""
    from tuner.plugin._sglang import stock_adaptive_params as stock

    return stock()


def write_config(tmp_path: Path, cfg: dict[str, Any], name: str = "adaptive.json") -> str:
    path = tmp_path / name
    path.write_text(json.dumps(cfg))
    return str(path)


@contextlib.contextmanager
def publish(**fields: Any) -> Iterator[Any]:
    """Publish a dummy SGLang config as a scheduler process has one, then restore."""
    from sglang.srt.runtime_context import get_context

    defaults = dict(
        speculative_algorithm="EAGLE3",
        speculative_adaptive=True,
        speculative_eagle_topk=1,
        speculative_num_steps=2,
    )
    override = get_context().override_server_args(**{**defaults, **fields})
    server_args = override.install()
    try:
        yield server_args
    finally:
        override.restore()


class FakeSpecWorker:
    """Stands in for ``EAGLEWorkerV2`` (which needs a GPU model): the adaptive worker protocol
    plus the two entry points the scheduler calls, borrowed from ``EAGLEWorkerV2`` itself."""

    def __init__(self, policy: Any, *, initial_steps: int) -> None:
        from sglang.srt.speculative.adaptive_runtime_state import AdaptiveController

        self.speculative_num_steps = initial_steps
        self.speculative_num_draft_tokens = initial_steps + 1
        self.built: list[tuple[int, list[int] | None]] = []
        self.applied: list[int] = []
        self.graph_memory_usage = {"draft_decode": 0.0}
        self.adaptive_controller = AdaptiveController(self, policy)

    def startup_state(self) -> Any:
        return self._state(self.speculative_num_steps)

    @staticmethod
    def _state(steps: int) -> Any:
        from sglang.srt.speculative.adaptive_runtime_state import SpecRuntimeState

        return SpecRuntimeState(steps, steps + 1, None, None, object(), None, None, None)

    def build_adaptive_runtime_state(
        self, speculative_num_steps: int, speculative_num_draft_tokens: int, cuda_graph_bs=None
    ) -> Any:
        assert speculative_num_draft_tokens == speculative_num_steps + 1
        self.built.append((speculative_num_steps, cuda_graph_bs))
        return self._state(speculative_num_steps)

    def apply_runtime_state(self, state: Any) -> None:
        if state.speculative_num_steps != self.speculative_num_steps:
            self.applied.append(state.speculative_num_steps)
        self.speculative_num_steps = state.speculative_num_steps
        self.speculative_num_draft_tokens = state.speculative_num_draft_tokens


def _borrow_worker_methods() -> None:
    from sglang.srt.speculative.eagle_worker_v2 import EAGLEWorkerV2

    FakeSpecWorker.activate_step_by_batch = EAGLEWorkerV2.activate_step_by_batch
    FakeSpecWorker.on_verify_complete_cpu = EAGLEWorkerV2.on_verify_complete_cpu


def spec_worker(policy: Any, *, initial_steps: int, graph_bs: list[int] | None) -> FakeSpecWorker:
    """A worker whose real ``AdaptiveController`` has run ``init_states`` as at startup."""
    _borrow_worker_methods()
    worker = FakeSpecWorker(policy, initial_steps=initial_steps)
    worker.adaptive_controller.register(worker.startup_state())
    worker.adaptive_controller.init_states(cuda_graph_bs=graph_bs)
    return worker


def fake_scheduler(draft_worker: Any, *, algorithm: str = "EAGLE3") -> Any:
    """The attributes ``SchedulerInternalStateController`` reads from its scheduler."""
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    return SimpleNamespace(
        draft_worker=draft_worker,
        spec_algorithm=SpeculativeAlgorithm.from_string(algorithm),
        startup_time=1764400000.0,
        max_running_requests=256,
        metrics_reporter=SimpleNamespace(
            last_gen_throughput=0.0,
            spec_total_num_accept_tokens=0,
            spec_total_num_forward_ct=0,
            step_time_dict={},
        ),
        tp_worker=SimpleNamespace(
            model_runner=SimpleNamespace(weight_load_mem_usage=1.0),
            graph_memory_usage={"decode": 0.0},
        ),
        token_to_kv_pool_allocator=SimpleNamespace(
            get_kvcache=lambda: SimpleNamespace(mem_usage=2.0)
        ),
        startup_available_gpu_memory_gb=80.0,
        max_total_num_tokens=100000,
        swa_tokens_per_layer=None,
        rust_server=None,
    )
