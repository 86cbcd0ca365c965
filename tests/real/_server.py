"""Start and stop real SGLang 0.5.23 servers on CPU for tests/real (imported by name).

Models have no weights: a ``config.json`` for a tiny Llama target and one for an EAGLE-3
draft, loaded with ``--load-format dummy``. The server runs in its own process group with
the kernel stand-in and the sampled-verify fixture on its PYTHONPATH only (``_stand_in/``),
and every start has a hard timeout: a crashed scheduler otherwise keeps SGLang alive 60 s.
Flags and facts: ``shared/sglang-cpu.md``.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
STAND_IN = HERE / "_stand_in"
REASON = (
    "needs a real SGLang 0.5.23 server environment: run scripts/real-sglang.sh (it builds the "
    "contract environment plus requirements/real-sglang.txt and runs this folder)"
)

VOCAB = 2000
# Every server this process created, for the tier's cost summary (conftest).
STARTED: list[RealServer] = []
START_TIMEOUT_S = float(os.environ.get("DYNSPEC_REAL_START_TIMEOUT", "240"))
ARMS = (0, 1, 3)

TARGET_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": VOCAB,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": 2,
}
DRAFT_CONFIG = {
    **TARGET_CONFIG,
    "architectures": ["LlamaForCausalLMEagle3"],
    "num_hidden_layers": 1,
    "target_hidden_size": 128,
    "draft_vocab_size": VOCAB,
}


def need_server_env() -> None:
    """Skip (saying how to run the tier) where SGLang's server path cannot be imported."""
    import pytest

    for mod in ("sglang", "uvloop", "xgrammar", "torch"):
        pytest.importorskip(mod, reason=REASON)


def write_tokenizer(folder: Path) -> None:
    """A word-level tokenizer over the target's vocabulary ("w3" ... "w1999"; anything else
    is <unk>), so text endpoints (/v1/completions, the sweep's prompts) work offline."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"w{i}": i for i in range(3, VOCAB)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    fast.save_pretrained(folder)


def write_models(root: Path) -> tuple[Path, Path]:
    """Write the weightless target (with its tokenizer) and draft model folders under
    ``root``, once."""
    paths = []
    for name, cfg in (("target", TARGET_CONFIG), ("draft", DRAFT_CONFIG)):
        folder = root / name
        paths.append(folder)
        if (folder / "config.json").exists():
            continue
        folder.mkdir(parents=True, exist_ok=True)
        if name == "target":
            write_tokenizer(folder)
        (folder / "config.json").write_text(json.dumps(cfg, indent=1))
    return paths[0], paths[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def acceptance_threshold(alpha: float) -> float:
    """``--speculative-accept-threshold-acc`` for per-position acceptance ``alpha``: with a
    near-uniform target the draft token is accepted with probability 1/(V*t)."""
    return 1.0 / (VOCAB * alpha)


@dataclass
class ServerSpec:
    """What one server is started with."""

    workdir: Path
    port: int = 0
    arms: tuple[int, ...] = ARMS
    initial_steps: int | None = None
    alpha: float | None = 0.5
    plugins: str = "dynspec"
    adaptive_config: Path | None = None
    api_key: str | None = None
    admin_api_key: str | None = None
    extra_env: Mapping[str, str] = field(default_factory=dict)
    extra_flags: tuple[str, ...] = ()
    max_running: int = 8


class RealServer:
    """One ``python -m sglang.launch_server`` process group."""

    def __init__(self, spec: ServerSpec) -> None:
        self.spec = spec
        if not spec.port:
            spec.port = free_port()
        self.proc: subprocess.Popen | None = None
        self.log_path = spec.workdir / f"server-{spec.port}.log"
        self._starts = 0
        self._spawned_at = 0.0
        # What the tier's summary reports: seconds each start took until /health answered,
        # and CPU seconds its processes used (read from /proc before each kill).
        self.start_s: list[float] = []
        self.cpu_s = 0.0
        self.leader_cpu_s = 0.0  # also in the parent's RUSAGE_CHILDREN once reaped
        STARTED.append(self)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.spec.port}"

    @property
    def url(self) -> str:
        return f"http://{self.address}"

    def command(self) -> list[str]:
        spec = self.spec
        target, draft = write_models(spec.workdir / "models")
        config = spec.adaptive_config
        if config is None:
            config = spec.workdir / "adaptive.json"
            config.write_text(json.dumps({"1": {"candidate_steps": list(spec.arms)}}))
        steps = spec.initial_steps if spec.initial_steps is not None else max(spec.arms)
        cmd = [
            sys.executable, "-m", "sglang.launch_server",
            "--model-path", str(target), "--load-format", "dummy",
            "--device", "cpu", "--host", "127.0.0.1", "--port", str(spec.port),
            "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", str(draft),
            "--speculative-draft-load-format", "dummy",
            "--speculative-eagle-topk", "1", "--speculative-num-steps", str(steps),
            "--speculative-num-draft-tokens", str(steps + 1),
            "--speculative-adaptive", "--speculative-adaptive-config", str(config),
            "--prefill-attention-backend", "intel_amx", "--decode-attention-backend", "intel_amx",
            "--speculative-draft-attention-backend", "intel_amx",
            "--disable-cuda-graph", "--enable-metrics",
            # An idle scheduler otherwise polls its sockets in a busy loop, a core each: with
            # it, servers the tier keeps for later tests cost nothing while they wait.
            "--sleep-on-idle",
            "--max-running-requests", str(spec.max_running),
            "--max-total-tokens", "8192", "--context-length", "1024",
        ]  # fmt: skip
        if spec.alpha is not None:
            cmd += ["--speculative-accept-threshold-acc", repr(acceptance_threshold(spec.alpha))]
        if spec.api_key:
            cmd += ["--api-key", spec.api_key]
        if spec.admin_api_key:
            cmd += ["--admin-api-key", spec.admin_api_key]
        return cmd + list(spec.extra_flags)

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        # The checkout under test goes before the shared venv's editable install of the
        # package, which points at whichever clone last built that venv.
        path = [str(STAND_IN), str(REPO)]
        path += [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        env.update(
            PYTHONPATH=os.pathsep.join(path),
            SGLANG_USE_CPU_ENGINE="1",
            TORCHDYNAMO_DISABLE="1",
            # One torch thread: a hidden size of 128 gains nothing from two, and on a loaded
            # 2-core machine every op of a two-thread step waits for the slower thread.
            OMP_NUM_THREADS="1",
            SGLANG_PLUGINS=self.spec.plugins,
            PYTHONUNBUFFERED="1",
        )
        env.pop("DYNSPEC_POLICY_FILE", None)
        env.update(self.spec.extra_env)
        return env

    def start(self, timeout_s: float = START_TIMEOUT_S) -> RealServer:
        """Start and wait for ``/health``; raise with the log's tail if it dies or hangs."""
        return self.spawn().wait_ready(timeout_s)

    def spawn(self) -> RealServer:
        """Launch the process group without waiting (:meth:`wait_ready` waits): servers that
        start together share the cores while each spends most of its start in one process."""
        self.spec.workdir.mkdir(parents=True, exist_ok=True)
        self._starts += 1
        log = open(self.log_path, "ab")  # noqa: SIM115 (kept open for the child)
        log.write(f"\n===== start {self._starts}\n".encode())
        log.flush()
        self.proc = subprocess.Popen(
            self.command(), env=self.env(), stdout=log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
        log.close()
        self._spawned_at = time.monotonic()
        return self

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S, *, from_now: bool = False
                   ) -> RealServer:  # fmt: skip
        """Wait for ``/health`` until ``timeout_s`` after the launch, or after now with
        ``from_now`` (a server launched ahead of its use shared the cores meanwhile)."""
        assert self.proc is not None, "spawn() first"
        deadline = (time.monotonic() if from_now else self._spawned_at) + timeout_s
        while time.monotonic() < deadline:
            if self.healthy():
                self.start_s.append(time.monotonic() - self._spawned_at)
                return self
            try:  # waits on the child: wakes at once if it exits
                code = self.proc.wait(timeout=0.5)
            except subprocess.TimeoutExpired:
                continue
            raise RuntimeError(f"SGLang exited with {code} while starting:\n{self.log_tail()}")
        self.kill()
        raise RuntimeError(f"SGLang not healthy after {timeout_s:.0f} s:\n{self.log_tail()}")

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal the whole process group (server, scheduler, detokenizer) and reap it."""
        if self.proc is None:
            return
        total, leader = group_cpu_s(self.proc.pid)
        self.cpu_s += total
        self.leader_cpu_s += leader
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
        self.wait_port_free()
        self.proc = None

    def wait_port_free(self, timeout_s: float = 30.0, poll_s: float = 0.2) -> None:
        """Block until nothing listens on the port (children die a moment after the leader)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with socket.socket() as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    s.bind(("127.0.0.1", self.spec.port))
                    return
                except OSError:
                    pass
            time.sleep(poll_s)
        raise RuntimeError(f"port {self.spec.port} still in use {timeout_s:.0f} s after kill")

    def scheduler_cpu_s(self) -> float:
        """CPU seconds the server's scheduler process (where every forward runs) has used."""
        assert self.proc is not None, "not running"
        tick = os.sysconf("SC_CLK_TCK")
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/stat") as f:
                    comm, rest = f.read().split(" (", 1)[1].rsplit(") ", 1)
            except (OSError, ValueError):
                continue
            fields = rest.split()
            if int(fields[2]) == self.proc.pid and comm.startswith("sglang::sched"):
                return (int(fields[11]) + int(fields[12])) / tick
        raise RuntimeError(f"no scheduler process in the group of {self.proc.pid}")

    def log_tail(self, n: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")


def group_cpu_s(pgid: int) -> tuple[float, float]:
    """User + system CPU seconds of the live processes of process group ``pgid`` (Linux):
    all of them, and its leader's."""
    tick = os.sysconf("SC_CLK_TCK")
    total = leader = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        if int(fields[2]) == pgid:  # fields from the state on: pgrp is the third
            used = int(fields[11]) + int(fields[12])  # utime, stime
            total += used
            leader += used if int(pid) == pgid else 0
    return total / tick, leader / tick


# --- HTTP -------------------------------------------------------------------------------


def http(
    url: str, path: str, body: Any = None, *, method: str | None = None,
    key: str | None = None, timeout: float = 120.0,
) -> tuple[int, Any]:  # fmt: skip
    """(status, parsed JSON or text) of one request; HTTP errors are returned, not raised.
    ``body``: sent as JSON, or as it is when bytes (a malformed body on purpose)."""
    data = body if body is None or isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, method=method or ("POST" if data else "GET"))
    if data is not None:
        req.add_header("Content-Type", "application/json")
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode(errors="replace")


def generate(url: str, n: int, *, max_new_tokens: int = 32, seed: int = 0,
             key: str | None = None) -> list[dict]:  # fmt: skip
    """``n`` sampled requests in one batched ``/generate`` call (token ids: no tokenizer)."""
    prompts = [[(seed * 131 + i * 17 + j) % (VOCAB - 10) + 10 for j in range(8)] for i in range(n)]
    params = {"temperature": 1.0, "max_new_tokens": max_new_tokens, "ignore_eos": True}
    status, out = http(url, "/generate", {"input_ids": prompts, "sampling_params": params}, key=key)
    if status != 200:
        raise RuntimeError(f"/generate answered {status}: {out}")
    return out


def readout(url: str, key: str | None = None) -> dict:
    status, info = http(url, "/server_info", key=key)
    if status != 200:
        raise RuntimeError(f"/server_info answered {status}: {info}")
    return info["internal_states"][0]["dynspec"]


def wait_for(predicate, timeout_s: float, what: str, step_s: float = 0.5, seen=None):
    """Poll ``predicate()`` until truthy (returned) or raise naming ``what`` (and what
    ``seen()`` says was there instead, if given): a real server's state changes in real
    time, so this is the one place the tier waits on the clock."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            got = f": {seen()}" if seen is not None else ""
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}{got}")
        time.sleep(step_s)
