"""moerl's one command dispatcher: the engine server and the trainer ranks' server call only their allowlisted
methods by name, and an error keeps its type (moerl's own) or its name across the boundary; the server stays up."""

import pytest

from moerl.errors import ConfigError, EngineError
from moerl.rollout.server import EngineServer
from moerl.rollout.spec import EngineSpec
from moerl.rpc import Dispatcher, check_reply
from moerl.trainer.driver import ANNOUNCED


def test_only_allowlisted_methods_are_called_and_errors_become_replies(tmp_path):
    from moerl.presets import init_model

    init_model("qwen3_moe", "tiny", tmp_path / "m", seed=0)
    server = EngineServer()
    try:
        for op in ("shutdown_now", "close", "handle", "_tensors_out"):  # unknown, or methods that are no command
            reply = server.handle({"op": op})
            assert not reply["ok"] and reply["type"] == "ValueError", reply
            allowed = "add_adapter, commit, compile_decode, decode_seconds, discard, generate"
            assert f"engine: unknown call {op!r}; allowed: {allowed}" in reply["message"]
            with pytest.raises(EngineError, match=rf"engine 0: ValueError: engine: unknown call {op!r}"):
                check_reply("engine 0", reply)
        spec = EngineSpec(str(tmp_path / "m"), dtype="float32")
        assert server.handle({"op": "init", "spec": spec.to_json()})["ok"]  # still up, and serving
        reply = server.handle({"op": "add_adapter", "name": "a", "path": str(tmp_path / "none")})
        with pytest.raises(ConfigError, match="max_loras=0: this engine has no adapter slots"):  # moerl's own type
            check_reply("engine 0", reply)
        assert server.handle({"op": "read_weights", "names": ["norm.weight"]})["ok"]
    finally:
        server.close()


def test_a_trainer_rank_refuses_a_call_it_does_not_serve():
    calls = Dispatcher(None, ANNOUNCED, "trainer rank 1")
    with pytest.raises(ValueError, match=r"trainer rank 1: unknown call '_announced'; allowed: forward_logprobs"):
        calls.call("_announced", None, path=None)
    reply = calls.reply("policy", None)  # an attribute, not a call it serves
    assert reply["ok"] is False and reply["type"] == "ValueError" and "unknown call 'policy'" in reply["message"]
