"""EAGLE trees (top-k > 1) switched on and off per batch, against SGLang 0.5.23's own code.

Config time: SGLang's refusal, its draft-token rewrite and its buffer bound, each with and
without the plugin. Run time: SGLang's ``AdaptiveController`` builds only the ``steps = 0``
state beside the startup tree, switches between them from our table, and
``EAGLEWorkerV2.apply_runtime_state`` (SGLang's own method) swaps the tree's width in and out
of the published spec config. Telemetry names the tree's steps by the arm, not by the width.
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
from _contract_env import FakeSpecWorker, need, publish, write_config

need()

from sglang.srt.arg_groups import speculative_hook  # noqa: E402
from sglang.srt.arg_groups.overrides import resolving_view  # noqa: E402
from sglang.srt.server_args import prepare_server_args  # noqa: E402
from sglang.srt.speculative import adaptive_spec_params as asp  # noqa: E402
from sglang.srt.speculative.adaptive_runtime_state import SpecRuntimeState  # noqa: E402
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm  # noqa: E402

from tuner.plugin import _tree  # noqa: E402
from tuner.plugin.launch import adaptive_config  # noqa: E402
from tuner.protocol import DynspecState, TreeShape, encode_update  # noqa: E402

pytestmark = pytest.mark.contract

TOPK, STEPS, WIDTH = 4, 2, 8
GRAPH_BS = [1, 2, 4, 8, 16, 32]
TARGET = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128,
          "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
          "num_hidden_layers": 2, "vocab_size": 2000, "max_position_embeddings": 2048,
          "rms_norm_eps": 1e-5, "torch_dtype": "float32", "tie_word_embeddings": False}
DRAFT = {**TARGET, "architectures": ["LlamaForCausalLMEagle3"], "num_hidden_layers": 1,
         "draft_vocab_size": 2000, "target_hidden_size": 128}


@pytest.fixture
def models(tmp_path):
    for name, cfg in (("target", TARGET), ("draft", DRAFT)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(cfg))
    return tmp_path


def argv(models, candidate_steps, *, topk=TOPK, algorithm="EAGLE3"):
    cfg = write_config(models, {"1": {"candidate_steps": candidate_steps}})
    return [
        "--model-path", str(models / "target"), "--load-format", "dummy",
        "--skip-tokenizer-init", "--device", "cpu",
        "--speculative-algorithm", algorithm,
        "--speculative-draft-model-path", str(models / "draft"),
        "--speculative-eagle-topk", str(topk), "--speculative-num-steps", str(STEPS),
        "--speculative-num-draft-tokens", str(WIDTH),
        "--speculative-adaptive", "--speculative-adaptive-config", cfg,
    ]  # fmt: skip


def raw(models, candidate_steps, **kw):
    """A ServerArgs record as the launcher has it before resolution."""
    return prepare_server_args(argv(models, candidate_steps, **kw))


# --- config time -----------------------------------------------------------------------------


def test_the_topk_refusal_is_lifted_only_for_the_tree_against_off(sglang_plugin, models):
    stock = inspect.unwrap(asp.adaptive_unsupported_reason)
    tree = raw(models, [0, STEPS])
    assert "only topk=1 is supported" in stock(tree)  # SGLang's own answer
    assert asp.adaptive_unsupported_reason(tree) is None  # ours
    # Other candidate steps would be built as narrow trees SGLang never sized: refused, saying so.
    why = asp.adaptive_unsupported_reason(raw(models, [0, 1, STEPS]))
    assert "candidate_steps must be [0, S]" in why and "[0, 1, 2]" in why
    # A chain is untouched; a refusal other than top-k still stands.
    assert asp.adaptive_unsupported_reason(raw(models, [0, 1, 3], topk=1)) is None
    two_batch = raw(models, [0, STEPS])
    two_batch.enable_two_batch_overlap = True
    assert "enable_two_batch_overlap" in asp.adaptive_unsupported_reason(two_batch)


def test_the_tree_keeps_its_configured_draft_tokens(sglang_plugin, models):
    stock = inspect.unwrap(speculative_hook._init_adaptive_speculative_params)
    theirs = raw(models, [0, STEPS])
    stock(theirs)
    assert resolving_view(theirs).speculative_num_draft_tokens == STEPS + 1  # SGLang's rewrite
    ours = raw(models, [0, STEPS])
    speculative_hook._init_adaptive_speculative_params(ours)
    assert resolving_view(ours).speculative_num_draft_tokens == WIDTH
    chain = raw(models, [0, 1, STEPS], topk=1)
    speculative_hook._init_adaptive_speculative_params(chain)
    assert resolving_view(chain).speculative_num_draft_tokens == STEPS + 1  # chains as stock


def test_the_draft_token_bound_covers_the_tree(sglang_plugin, models):
    resolve = SpeculativeAlgorithm.EAGLE3.resolve_max_speculative_num_draft_tokens
    stock = inspect.unwrap(SpeculativeAlgorithm.resolve_max_speculative_num_draft_tokens)
    args = raw(models, [0, STEPS])
    assert stock(SpeculativeAlgorithm.EAGLE3, args) == STEPS + 1  # start-up would fail on 8
    assert resolve(args) == WIDTH
    assert resolve(raw(models, [0, 1, 5], topk=1)) == 6  # chains: max(candidates) + 1, as stock


_RESOLVE = """
import json, sys
from sglang.srt.plugins import load_plugins
load_plugins()
from sglang.srt.arg_groups.overrides import max_speculative_num_draft_tokens, resolved_view
from sglang.srt.server_args import prepare_server_args
args = prepare_server_args(sys.argv[1:])
args.resolve_once()
view = resolved_view(args)
out = {k: getattr(view, k) for k in ("speculative_adaptive", "speculative_eagle_topk",
                                     "speculative_num_steps", "speculative_num_draft_tokens")}
out["max_draft_tokens"] = max_speculative_num_draft_tokens(args)
print(json.dumps(out))
"""


@pytest.mark.parametrize("plugins", ["dynspec", "someone_else"])
def test_sglang_resolves_a_tree_server_adaptive_only_with_the_plugin(sglang_plugin, models,
                                                                     plugins):
    # SGLang's whole server-args resolution, in a fresh process as the launcher runs it.
    out = subprocess.run(
        [sys.executable, "-c", _RESOLVE, *argv(models, [0, STEPS])],
        env={**os.environ, "SGLANG_PLUGINS": plugins}, capture_output=True, text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    shape = {"speculative_eagle_topk": TOPK, "speculative_num_steps": STEPS,
             "speculative_num_draft_tokens": WIDTH, "max_draft_tokens": WIDTH}
    if plugins == "dynspec":
        assert got == {"speculative_adaptive": True, **shape}
    else:  # stock: warns and falls back to the static tree
        assert got == {"speculative_adaptive": False, **shape}
        assert "only topk=1 is supported" in out.stderr


# --- run time --------------------------------------------------------------------------------


class TreeWorker(FakeSpecWorker):
    """The fake worker with a tree as its startup state (its width is not steps + 1)."""

    def __init__(self, policy, *, initial_steps: int) -> None:
        super().__init__(policy, initial_steps=initial_steps)
        self.speculative_num_draft_tokens = WIDTH

    def startup_state(self):
        return SpecRuntimeState(self.speculative_num_steps, WIDTH, None, None, object(), None,
                                None, None)


@pytest.fixture
def tree_server(sglang_plugin, tmp_path):
    cfg = write_config(tmp_path, adaptive_config([0, STEPS]))
    with publish(speculative_eagle_topk=TOPK, speculative_num_steps=STEPS,
                 speculative_num_draft_tokens=WIDTH):
        from _contract_env import _borrow_worker_methods

        _borrow_worker_methods()
        policy = asp.AdaptiveSpeculativeParams(initial_steps=STEPS, cfg_path=cfg)
        worker = TreeWorker(policy, initial_steps=STEPS)
        # What EAGLEWorkerV2.init_cuda_graphs does: register the startup tree, then init_states.
        worker.adaptive_controller.register(worker.startup_state())
        worker.adaptive_controller.init_states(cuda_graph_bs=GRAPH_BS)
        yield policy, worker


def test_init_states_builds_only_the_off_state_beside_the_tree(tree_server):
    policy, worker = tree_server
    assert policy.dynspec.arms == (0, STEPS)
    assert policy.dynspec.tree == TreeShape(topk=TOPK, steps=STEPS, draft_tokens=WIDTH)
    assert worker.built == [(0, GRAPH_BS)]  # one draft token: SGLang's one-node verify
    states = worker.adaptive_controller._states
    assert {k: s.speculative_num_draft_tokens for k, s in states.items()} == {0: 1, STEPS: WIDTH}


def test_the_table_switches_the_tree_on_and_off_per_batch(tree_server):
    policy, worker = tree_server
    ok, why = policy.dynspec.apply_update(encode_update(((4, STEPS), (16, 0), (None, STEPS)), 1))
    assert ok, why
    widths = []
    for b in (1, 4, 5, 16, 17, 3, 12):
        worker.activate_step_by_batch(b)
        widths.append((worker.speculative_num_steps, worker.speculative_num_draft_tokens))
    on, off = (STEPS, WIDTH), (0, 1)
    assert widths == [on, on, off, off, on, on, off]
    for _ in range(100):  # acceptance feedback never switches on its own
        worker.on_verify_complete_cpu([0, 0, 0], batch_size=3)
    assert worker.speculative_num_steps == 0
    # An update naming a depth that is not built is refused.
    ok, why = policy.dynspec.apply_update(encode_update(((None, 1),), 2))
    assert not ok and "k=1 is not a built arm" in why


def test_the_readout_describes_the_tree(tree_server):
    policy, _ = tree_server
    state = DynspecState.from_json(json.loads(json.dumps(policy.dynspec.readout())))
    assert state.arms == (0, STEPS)
    assert state.tree == TreeShape(TOPK, STEPS, WIDTH)
    # A step is named by its arm: the tree's width maps to its depth, one token to 0.
    assert policy.dynspec.arm_of_width(WIDTH) == STEPS and policy.dynspec.arm_of_width(1) == 0


def test_eagle_worker_v2_swaps_the_tree_width_in_and_out(sglang_plugin):
    """SGLang's own ``apply_runtime_state`` on a tree worker (no graphs, CPU objects)."""
    from sglang.srt.runtime_context import get_spec
    from sglang.srt.speculative.base_spec_worker import EagleDraftWorkerBase
    from sglang.srt.speculative.eagle_worker_v2 import EAGLEWorkerV2

    with publish(speculative_eagle_topk=TOPK, speculative_num_steps=STEPS,
                 speculative_num_draft_tokens=WIDTH):
        draft = SimpleNamespace(topk=TOPK, draft_runner=SimpleNamespace())
        draft._rebuild_topk1_chain_buffers = (
            # SGLang's own method; it returns at once for top-k > 1.
            lambda: EagleDraftWorkerBase._rebuild_topk1_chain_buffers(draft)
        )
        worker = EAGLEWorkerV2.__new__(EAGLEWorkerV2)
        worker.topk, worker.speculative_num_steps = TOPK, STEPS
        worker.speculative_num_draft_tokens = WIDTH
        worker._draft_worker = draft
        worker._target_worker = SimpleNamespace(model_runner=SimpleNamespace())
        off = SpecRuntimeState(0, 1, "draft0", None, "target0", None, "extend0", None)
        tree = SpecRuntimeState(STEPS, WIDTH, "draft2", None, "target2", None, "extend2", None)
        worker.apply_runtime_state(off)
        spec = get_spec()
        assert (spec.speculative_num_steps, spec.speculative_num_draft_tokens) == (0, 1)
        assert worker._target_worker.model_runner.attn_backend == "target0"
        assert (draft.speculative_num_draft_tokens, draft.draft_attn_backend) == (1, "draft0")
        worker.apply_runtime_state(tree)
        assert get_spec().speculative_num_draft_tokens == WIDTH
        assert (worker.speculative_num_steps, draft.draft_runner.attn_backend) == (STEPS,
                                                                                  "extend2")


def test_steps_zero_under_a_tree_keeps_sglangs_default_draft_extend():
    """The off arm still runs the draft extend (keeps the draft in sync) unless an operator
    sets SGLang's experimental skip flag; the plugin sets nothing."""
    from sglang.srt.speculative.eagle_worker_v2 import EAGLEWorkerV2

    src = inspect.getsource(EAGLEWorkerV2.forward_batch_generation)
    assert "self._build_trivial_verify_input(batch)" in src
    assert "SGLANG_SPEC_SKIP_ZERO_STEP_DRAFT_EXTEND.get()" in src
    assert "SGLANG_SPEC_SKIP_ZERO_STEP_DRAFT_EXTEND" not in os.environ
    trivial = inspect.getsource(EAGLEWorkerV2._build_trivial_verify_input)
    assert "topk=self.topk" in trivial and "draft_token_num=1" in trivial


def test_standalone_drafts_pass_the_refusal_and_get_the_controller(sglang_plugin, models,
                                                                    tmp_path):
    from sglang.srt.speculative.standalone_worker_v2 import StandaloneWorkerV2

    stock = inspect.unwrap(asp.adaptive_unsupported_reason)
    args = raw(models, [0, STEPS], algorithm="STANDALONE")
    assert "only EAGLE/EAGLE3 are supported" in stock(args)
    assert asp.adaptive_unsupported_reason(args) is None
    # Stock STANDALONE builds no controller ("TODO: Adaptive speculative"); the hook adds
    # EAGLEWorkerV2's, deciding with our policy class.
    assert "self.adaptive_controller: Optional[AdaptiveController] = None" in inspect.getsource(
        inspect.unwrap(StandaloneWorkerV2.__init__)
    )
    assert _tree.missing_tree_hooks() == []
    cfg = write_config(tmp_path, adaptive_config([0, STEPS]))
    with publish(speculative_algorithm="STANDALONE", speculative_eagle_topk=TOPK,
                 speculative_num_steps=STEPS, speculative_num_draft_tokens=WIDTH,
                 speculative_adaptive_config=cfg):
        worker = SimpleNamespace(speculative_num_steps=STEPS, adaptive_controller=None)
        _tree.standalone_init_hook(None, worker)
    params = worker.adaptive_controller.params
    assert isinstance(params, sglang_plugin._RT.policy_class)
    assert params.dynspec.tree == TreeShape(TOPK, STEPS, WIDTH)


def test_what_more_tree_shapes_would_take():
    """Why only [0, S] is offered, and the room SGLang leaves (issue 18, part 1's "more tree
    shapes"). ``AdaptiveController.init_states`` builds every candidate step not registered
    yet with ``steps + 1`` draft tokens (``adaptive_runtime_state.py`` line 114, a different
    shape under top-k > 1), skips any step registered before it (line 108), and keys states by
    steps alone (one shape per depth); top-k is worker-wide (``EAGLEWorkerV2._override_worker_
    state`` overrides steps and draft tokens only), so every tree arm shares the server's."""
    from sglang.srt.speculative import adaptive_runtime_state as ars
    from sglang.srt.speculative.adaptive_runtime_state import AdaptiveController
    from sglang.srt.speculative.eagle_worker_v2 import EAGLEWorkerV2

    src, start = inspect.getsourcelines(AdaptiveController.init_states)
    lines = {start + i: line.strip() for i, line in enumerate(src)}
    assert lines[108] == "if steps in self._states:"
    assert lines[114] == "speculative_num_draft_tokens=steps + 1,"
    override = inspect.getsource(EAGLEWorkerV2._override_worker_state)
    assert "speculative_num_draft_tokens=speculative_num_draft_tokens" in override
    assert "topk" not in override.replace("_rebuild_topk1_chain_buffers", "")

    built: list[tuple[int, int]] = []

    def build(speculative_num_steps, speculative_num_draft_tokens, cuda_graph_bs=None):
        built.append((speculative_num_steps, speculative_num_draft_tokens))
        return SpecRuntimeState(speculative_num_steps, speculative_num_draft_tokens, None,
                                None, object(), None, None, None)

    worker = SimpleNamespace(speculative_num_steps=STEPS, build_adaptive_runtime_state=build,
                             apply_runtime_state=lambda state: None)
    policy = asp.AdaptiveSpeculativeParams(initial_steps=STEPS, cfg_path=None)
    policy.candidate_steps = [0, STEPS, STEPS + 1]
    controller = ars.AdaptiveController(worker, policy)
    controller.register(build(STEPS, WIDTH))  # the startup tree, as init_cuda_graphs does
    controller.register(build(STEPS + 1, 2 * WIDTH))  # a second tree, registered beforehand
    built.clear()
    controller.init_states(None)
    # Only the unregistered candidate is built, with steps + 1 tokens; both trees are kept.
    assert built == [(0, 1)]
    widths = {k: s.speculative_num_draft_tokens for k, s in controller._states.items()}
    assert widths == {0: 1, STEPS: WIDTH, STEPS + 1: 2 * WIDTH}
    # A second shape of the same depth replaces the first: one tree per depth.
    controller.register(build(STEPS, 2 * WIDTH))
    assert controller._states[STEPS].speculative_num_draft_tokens == 2 * WIDTH
