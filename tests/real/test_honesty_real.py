"""Keep the look-alike honest: what the daemon reads from and sends to a real SGLang 0.5.23
server with the plugin, against what tuner/sim/server.py answers to the same requests.

Compared: ``/server_info`` keys and JSON types (the simulator's keys must exist in SGLang's,
its own ``sim_*`` aside; null on either side is a value, not a type), ``internal_states``
entries, the ``"dynspec"`` section, the ``/metrics`` families, and ``/set_internal_state``
status codes, replies and error-body shapes for an applied, a refused, an unsupported and a
malformed update. The wrong-key case is in test_daemon_real.py (it needs a keyed server).
"""

from __future__ import annotations

import json
import re

import pytest
from _server import ARMS, generate, http, readout

from tuner.protocol import encode_update

_FAMILY = re.compile(r"^# TYPE (\S+) (\S+)$", re.M)
# internal_states keys SGLang reports only in some states: avg_spec_accept_length appears once
# --decode-log-interval speculative batches have run since the accept counters were reset.
CONDITIONAL = {"avg_spec_accept_length"}


def jtype(value) -> str:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)):
        return "number"
    return {dict: "object", list: "array", str: "string", type(None): "null"}[type(value)]


def type_differences(where: str, sim: dict, real: dict, *, ignore=()) -> list[str]:
    out = []
    for key, value in sim.items():
        if key in ignore:
            continue
        if key not in real:
            out.append(f"{where}: {key!r} is in the simulator's, not in SGLang's")
        elif "null" not in (jtype(value), jtype(real[key])) and jtype(value) != jtype(real[key]):
            out.append(f"{where}: {key!r} is {jtype(value)} in the simulator, "
                       f"{jtype(real[key])} in SGLang")  # fmt: skip
    return out


def shape(body) -> object:
    """An answer with values reduced to their types (error messages differ in wording)."""
    if isinstance(body, dict):
        return {k: jtype(v) for k, v in sorted(body.items())}
    return body if isinstance(body, list) else jtype(body)


def update_probes(url: str) -> dict[str, tuple[int, object]]:
    version = readout(url)["policy_version"] + 1
    applied = encode_update(((4, 1), (None, 0)), version)
    stale = encode_update(((None, 1),), version)  # the same version again: refused
    probes = {
        "applied": json.dumps({"server_args": applied}).encode(),
        "refused (stale version)": json.dumps({"server_args": stale}).encode(),
        "unsupported key": b'{"server_args": {"no_such_key": 1}}',
        "nested value": b'{"server_args": {"dynspec_version": {"a": 1}}}',
        "null value": b'{"server_args": {"dynspec_version": null}}',
        "not JSON": b"{not json",
    }
    out = {}
    for name, data in probes.items():
        status, body = http(url, "/set_internal_state", data, timeout=60)
        out[name] = (status, shape(body))
    return out


def families(url: str) -> dict[str, str]:
    status, text = http(url, "/metrics")
    assert status == 200
    return dict(_FAMILY.findall(text))


@pytest.fixture(scope="module")
def sim():
    from tuner.sim.server import SimServer

    with SimServer(arms=ARMS, load="none", speed=1.0) as server:
        generate_sim(server.url)
        yield server


def generate_sim(url: str) -> None:
    status, _ = http(url, "/generate", {"text": "w5 w6", "sampling_params": {
        "max_new_tokens": 8, "temperature": 1.0, "ignore_eos": True}})  # fmt: skip
    assert status == 200


def test_the_simulator_answers_as_sglang_does(plugin_server, sim):
    real_url = plugin_server.url
    generate(real_url, 2, max_new_tokens=8)
    differences = []
    _, real_info = http(real_url, "/server_info")
    _, sim_info = http(sim.url, "/server_info")
    sim_only = {k for k in sim_info if k.startswith("sim_")}
    differences += type_differences("/server_info", sim_info, real_info, ignore=sim_only)
    real_state, sim_state = real_info["internal_states"][0], sim_info["internal_states"][0]
    differences += type_differences("internal_states[0]", sim_state, real_state,
                                    ignore=CONDITIONAL - set(real_state))  # fmt: skip
    # Both have refused one update by now (the probes below run once before this read).
    real_updates, sim_updates = update_probes(real_url), update_probes(sim.url)
    real_dyn, sim_dyn = readout(real_url), readout(sim.url)
    differences += type_differences('"dynspec"', sim_dyn, real_dyn)
    differences += [f'"dynspec": {k!r} is in SGLang\'s, not in the simulator\'s'
                    for k in real_dyn if k not in sim_dyn]  # fmt: skip
    for name, real_answer in real_updates.items():
        if sim_updates[name] != real_answer:
            differences.append(f"/set_internal_state, {name}: simulator {sim_updates[name]}, "
                               f"SGLang {real_answer}")  # fmt: skip
    real_families, sim_families = families(real_url), families(sim.url)
    for name, kind in sim_families.items():
        if name not in real_families:
            differences.append(f"/metrics: {name} ({kind}) is not among SGLang's families")
        elif real_families[name] != kind:
            differences.append(f"/metrics: {name} is a {kind} in the simulator, "
                               f"a {real_families[name]} in SGLang")  # fmt: skip
    print("\n".join(["differences:", *differences]) if differences else "no differences")
    assert not differences, "\n".join(differences)
