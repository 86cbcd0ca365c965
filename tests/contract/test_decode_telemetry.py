"""SGLang's own decode-result processing feeds the plugin's counters.

``SchedulerBatchResultProcessor.process_batch_result_decode`` runs for real on real ``Req``,
``ScheduleBatch`` and ``GenerationBatchResult`` objects (CPU tensors); only its collaborators
that need a GPU server (KV allocator, metrics reporter, output streamer) are stand-ins.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from _contract_env import need, publish, spec_worker, write_config

need()

import torch  # noqa: E402
from sglang.srt.disaggregation.utils import DisaggregationMode  # noqa: E402
from sglang.srt.managers.schedule_batch import Req, ScheduleBatch  # noqa: E402
from sglang.srt.managers.scheduler_components.batch_result_processor import (  # noqa: E402
    SchedulerBatchResultProcessor,
)
from sglang.srt.managers.utils import GenerationBatchResult  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import ForwardMode  # noqa: E402
from sglang.srt.runtime_context import get_parallel  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402
from sglang.srt.speculative import adaptive_spec_params as asp  # noqa: E402
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm  # noqa: E402

from tuner.plugin.launch import adaptive_config  # noqa: E402
from tuner.protocol import CounterRow, encode_update  # noqa: E402

pytestmark = pytest.mark.contract

ARMS = [0, 1, 3, 5]


class Server:
    """One scheduler's result path: our policy in a real controller, SGLang's processor."""

    def __init__(self, cfg: str) -> None:
        self.policy = asp.AdaptiveSpeculativeParams(initial_steps=3, cfg_path=cfg)
        self.worker = spec_worker(self.policy, initial_steps=3, graph_bs=None)
        self.streamed: list[list[str]] = []
        self.processor = SchedulerBatchResultProcessor(
            is_generation=True,
            disaggregation_mode=DisaggregationMode.NULL,
            enable_overlap=True,
            enable_overlap_mlx=False,
            model_config=SimpleNamespace(self_opened_think_start_ids=None, think_end_ids=None),
            token_to_kv_pool_allocator=SimpleNamespace(
                free_group_begin=lambda: None, free_group_end=lambda: None
            ),
            tree_cache=SimpleNamespace(checkpoint=lambda req, up_to=None: None),
            hisparse_coordinator=None,
            req_to_token_pool=None,
            decode_offload_manager=None,
            metrics_collector=None,
            metrics_reporter=SimpleNamespace(
                snapshot_spec_decode_metrics=lambda batch, result: None,
                num_generated_tokens=0,
                update_spec_metrics=lambda *a, **kw: None,
                forward_ct_decode=0,
                report_decode_stats=lambda *a, **kw: None,
            ),
            draft_worker=self.worker,
            model_worker=self.worker,
            logprob_result_processor=None,
            output_streamer=SimpleNamespace(
                stream_output=lambda reqs, _lp, *_: self.streamed.append([r.rid for r in reqs])
            ),
            beam_coordinator=None,
            abort_request=lambda *a, **kw: None,
        )

    def step(self, *, k: int, accept_lens: list[int], it: int, ts: float,
             after_idle_gap: bool = False, rid: str = "req") -> list[Req]:
        """One decode result as the scheduler hands it over (launched with ``k`` drafts)."""
        reqs = []
        for i in range(len(accept_lens)):
            sampling = SamplingParams(max_new_tokens=1000)
            sampling.normalize(None)
            reqs.append(Req(f"{rid}-{it}-{i}", "", [1, 2, 3], sampling))
        batch = ScheduleBatch(reqs=reqs, spec_algorithm=SpeculativeAlgorithm.EAGLE3)
        batch.forward_iter, batch.launch_ts, batch.after_idle_gap = it, ts, after_idle_gap
        width = k + 1  # topk=1: draft tokens = steps + 1, one output row per request
        result = GenerationBatchResult(
            next_token_ids=torch.arange(len(reqs) * width),
            accept_lens=torch.tensor(accept_lens),
            speculative_num_draft_tokens=width,
        )
        self.processor.process_batch_result_decode(batch, result)
        return reqs

    def prefill(self, *, it: int, ts: float, after_idle_gap: bool = False) -> Req:
        """One prefill result (a new request's first token) through SGLang's processing."""
        sampling = SamplingParams(max_new_tokens=1000)
        sampling.normalize(None)
        req = Req(f"prefill-{it}", "", [1, 2, 3], sampling)
        batch = ScheduleBatch(reqs=[req], spec_algorithm=SpeculativeAlgorithm.EAGLE3,
                              forward_mode=ForwardMode.EXTEND)
        batch.forward_iter, batch.launch_ts, batch.after_idle_gap = it, ts, after_idle_gap
        self.processor.process_batch_result_prefill(
            batch, GenerationBatchResult(next_token_ids=torch.tensor([7]))
        )
        return req

    def rows(self) -> list[CounterRow]:
        return list(self.policy.dynspec.telemetry.rows())


@pytest.fixture
def server(sglang_plugin, published, tmp_path):
    return Server(write_config(tmp_path, adaptive_config(ARMS)))


def test_counts_at_k_above_zero(server):
    # accept_lens include the bonus token: drafts accepted per request = len - 1.
    reqs = server.step(k=3, accept_lens=[3, 1, 4], it=1, ts=100.0)
    server.step(k=3, accept_lens=[4, 4, 2], it=2, ts=100.020)
    server.step(k=3, accept_lens=[1, 1, 1], it=3, ts=100.045)
    # SGLang's own processing ran: tokens committed and streamed.
    assert [len(r.output_ids) for r in reqs] == [3, 1, 4]
    assert server.streamed[0] == [r.rid for r in reqs]
    # Two steps are timed (the third waits for its successor's launch).
    [row] = server.rows()
    assert (row.b, row.k, row.decode_steps) == (3, 3, 2)
    assert row.accepted_drafts == (2 + 0 + 3) + (3 + 3 + 1)
    assert row.emitted_tokens == row.accepted_drafts + 2 * 3
    assert row.drafted_tokens == 2 * 3 * 3
    assert row.busy_s == pytest.approx(0.045)


def test_counts_at_k_zero_with_all_zero_accept_lists(server):
    for it in range(1, 5):
        server.step(k=0, accept_lens=[1, 1, 1, 1], it=it, ts=100.0 + 0.01 * it)
    [row] = server.rows()
    assert (row.b, row.k, row.decode_steps) == (4, 0, 3)
    assert (row.emitted_tokens, row.accepted_drafts, row.drafted_tokens) == (12, 0, 0)
    assert row.busy_s == pytest.approx(0.03)


def test_a_prefill_launch_times_the_decode_step_before_it(server):
    # Under load a prefill follows most decode steps; its launch ends the step before it.
    server.step(k=3, accept_lens=[2, 3], it=1, ts=5.0)
    req = server.prefill(it=2, ts=5.03)
    server.step(k=3, accept_lens=[1, 1], it=3, ts=5.05)
    server.prefill(it=5, ts=5.2)  # not the next forward: that step stays untimed
    assert list(req.output_ids) == [7]  # SGLang's own prefill processing ran
    [row] = server.rows()
    assert (row.b, row.k, row.decode_steps, row.emitted_tokens) == (2, 3, 1, 5)
    assert row.busy_s == pytest.approx(0.03)
    assert server.policy.dynspec.telemetry.untimed_steps == 1


def test_k_comes_from_the_result_not_the_worker(server):
    # The overlap scheduler processes step N after N+1 launched at another width.
    assert server.policy.dynspec.apply_update(encode_update(((None, 5),), 1))[0]
    server.worker.activate_step_by_batch(2)
    assert server.worker.speculative_num_steps == 5
    server.step(k=1, accept_lens=[2, 1], it=1, ts=1.0)
    server.step(k=5, accept_lens=[6, 3], it=2, ts=1.01)
    server.step(k=5, accept_lens=[1, 1], it=3, ts=1.03)
    assert [(r.b, r.k, r.decode_steps, r.emitted_tokens) for r in server.rows()] == [
        (2, 1, 1, 3),
        (2, 5, 1, 9),
    ]


def test_gaps_idle_passes_and_health_checks_are_not_busy_time(server):
    server.step(k=3, accept_lens=[2], it=1, ts=10.0)
    server.step(k=3, accept_lens=[2], it=3, ts=10.02)  # a prefill ran at it=2
    server.step(k=3, accept_lens=[2], it=4, ts=10.5, after_idle_gap=True)
    server.step(k=3, accept_lens=[2], it=5, ts=10.52)
    server.step(k=0, accept_lens=[1], it=6, ts=10.54, rid="HEALTH_CHECK")
    server.step(k=3, accept_lens=[2], it=7, ts=10.56)
    [row] = server.rows()
    assert (row.b, row.k, row.decode_steps) == (1, 3, 1)
    assert row.busy_s == pytest.approx(0.02)
    assert server.policy.dynspec.telemetry.untimed_steps == 3


def test_only_tp_rank_zero_counts(sglang_plugin, tmp_path):
    with publish(tp_size=2), get_parallel().override(tp_rank=1):
        server = Server(write_config(tmp_path, adaptive_config(ARMS)))
        for it in range(1, 4):
            reqs = server.step(k=3, accept_lens=[2, 2], it=it, ts=float(it))
    assert server.rows() == [] and len(reqs[0].output_ids) == 2
    assert server.policy.dynspec.telemetry._pending is None


def test_a_failing_telemetry_hook_leaves_sglangs_processing_intact(server, sglang_plugin):
    errors = sglang_plugin._RT.hook_errors.get("telemetry", 0)
    server.step(k=3, accept_lens=[2], it=1, ts=1.0)
    reqs = server.step(k=3, accept_lens=[3], it=2, ts="not a time")  # type: ignore[arg-type]
    assert len(reqs[0].output_ids) == 3 and server.streamed[-1] == [reqs[0].rid]
    assert sglang_plugin._RT.hook_errors["telemetry"] == errors + 1
