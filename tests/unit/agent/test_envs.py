"""ToolEnv, HttpEnv (against a local http.server) and env_factory."""

import asyncio
import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from megarl.agent.env import Environment, StepResult
from megarl.agent.envs import HttpEnv, ToolEnv, env_factory, make_env
from megarl.agent.tools import CALCULATOR, SandboxLimits, Tool, python_tool
from megarl.data.datasets import PromptRecord

RECORD = PromptRecord("What is 17*3?", 51, "test:1", {"level": 2})


def call(name, **arguments):
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call><|im_end|>'


def run(coro):
    return asyncio.run(coro)


async def _episode(env, *messages):
    await env.reset(RECORD)
    try:
        return [await env.step(m) for m in messages]
    finally:
        await env.close()


def test_tool_env_calls_answers_and_errors():
    env = make_env("calculator")
    assert env.tools == [CALCULATOR.definition]
    good, bad_json, unknown, bad_args, failing, several, final = run(_episode(
        env, "I'll compute. " + call("calculator", expression="17*3"),
        '<tool_call>{"name": "calculator", "arguments": {"expression": "1"</tool_call>',
        call("search", query="x"),
        call("calculator", expression="1", expr="1"),
        call("calculator", expression="1/0"),
        call("calculator", expression="2+1") + call("calculator", expression="1/0"),
        "The answer is 51.<|im_end|>"))
    assert (good.observation, good.reward, good.done) == ("51", 0.0, False)
    assert good.info["tool_error"] is False and good.info["tool"] == ["calculator"] and good.info["tool_seconds"] >= 0
    assert bad_json.observation == "error: tool call 1: invalid JSON at char 54: Expecting ',' delimiter"
    assert unknown.observation == "error: unknown tool 'search'; available: calculator"
    assert bad_args.observation == "error: calculator: unexpected argument 'expr'; calculator takes: expression"
    assert failing.observation == "error: calculator: division by zero"
    assert several.observation == "[1] calculator: 3\n[2] calculator: error: calculator: division by zero"
    for result in (bad_json, unknown, bad_args, failing, several):
        assert result.info["tool_error"] is True and not result.done
    assert (final.observation, final.done, final.info) == ("", True, {})


def test_tool_env_limits_calls_per_turn_and_checks_its_arguments():
    env = ToolEnv({"calculator": CALCULATOR}, max_calls_per_turn=2)
    (result,) = run(_episode(env, call("calculator", expression="1") * 3))
    assert result.observation == "error: 3 tool calls in one turn; at most 2" and result.info["tool_error"]
    with pytest.raises(KeyError, match="unknown tool-call format 'xml'"):
        ToolEnv({"calculator": CALCULATOR}, fmt="xml")
    with pytest.raises(ValueError, match="max_calls_per_turn=0 must be >= 1"):
        ToolEnv({"calculator": CALCULATOR}, max_calls_per_turn=0)


def test_tool_env_final_reward_and_json_format():
    class Graded(ToolEnv):
        def final_reward(self, message):
            return float(message.strip() == str(self.record.answer))

    env = Graded({"calculator": CALCULATOR}, fmt="json")
    tool, final = run(_episode(env, '{"name": "calculator", "arguments": {"expression": "17*3"}}', "51"))
    assert tool.observation == "51" and (final.reward, final.done) == (1.0, True)


def test_python_env_failed_calls_and_the_episode_goes_on():
    env = ToolEnv({"python": python_tool(SandboxLimits(timeout_s=1.5))})
    start = time.monotonic()
    timeout, refused, good = run(_episode(
        env, call("python", code="while True: pass"), call("python", code="import socket; socket.socket()"),
        call("python", code="print(sum(range(10)))")))
    assert timeout.info["tool_error"] and timeout.observation.endswith("[error] timed out after 1.5 s (killed)")
    assert refused.info["tool_error"] and "[error] refused by the sandbox: socket.__new__" in refused.observation
    assert (good.observation, good.info["tool_error"]) == ("45", False)
    assert timeout.info["tool_seconds"] >= 1.5 and time.monotonic() - start < 10


def test_tool_env_steps_do_not_block_the_event_loop():
    def slow(x: int) -> str:
        time.sleep(0.5)
        return str(x)

    async def slow_async(x: int) -> str:
        await asyncio.sleep(0.5)
        return str(-x)

    schema = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
    tools = {"slow": Tool("slow", "sleeps", schema, slow), "slow_async": Tool("slow_async", "sleeps", schema, slow_async)}

    async def main():
        envs = [ToolEnv(tools) for _ in range(4)]
        return await asyncio.gather(*(_episode(env, call("slow" if i % 2 else "slow_async", x=i))
                                      for i, env in enumerate(envs)))

    start = time.monotonic()
    results = run(main())
    assert [r[0].observation for r in results] == ["0", "1", "-2", "3"]
    assert time.monotonic() - start < 1.5  # 4 x 0.5 s run concurrently, not one after another


class _Server(BaseHTTPRequestHandler):
    requests = []

    def log_message(self, *args):
        pass

    def _answer(self, status, body: bytes, chunked=False):
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        if chunked:
            self.send_header("Transfer-Encoding", "chunked")
        else:
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if chunked:
            for i in range(0, len(body), 7):
                piece = body[i:i + 7]
                self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            self.wfile.write(b"0\r\n\r\n")
        else:
            self.wfile.write(body)

    def do_POST(self):
        payload = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        _Server.requests.append((self.path, payload))
        if self.path == "/env/reset":
            answer = {"observation": f"level {payload['record']['extra']['level']}",
                      "tools": [{"type": "function", "function": {"name": "guess"}}]}
            return self._answer(200, json.dumps(answer).encode())
        if self.path == "/env/close":
            return self._answer(200, b"{}")
        message = payload.get("message")
        if message == "crash":
            return self._answer(500, b"Internal error: boom")
        if message == "garbage":
            return self._answer(200, b"<html>")
        if message == "no-done":
            return self._answer(200, b'{"observation": "x", "reward": 1}')
        if message == "slow":
            time.sleep(1.0)  # the client has given up by now: nobody reads the answer
            return
        done = message == "51"
        answer = {"observation": "" if done else "higher", "reward": float(done), "done": done, "info": {"turn": 1}}
        self._answer(200, json.dumps(answer).encode(), chunked=message == "chunked")


@pytest.fixture(scope="module")
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Server)
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/env"
    httpd.shutdown()
    httpd.server_close()


def test_http_env_protocol(server):
    _Server.requests.clear()
    env = env_factory(server)()
    assert isinstance(env, HttpEnv)

    async def main():
        first = await env.reset(RECORD)
        steps = [await env.step(m) for m in ("40", "chunked", "51")]
        await env.close()
        return first, steps

    first, (low, chunked, right) = run(main())
    assert first == "level 2" and env.tools == [{"type": "function", "function": {"name": "guess"}}]
    assert low == StepResult("higher", 0.0, False, {"turn": 1}) and chunked == low
    assert right == StepResult("", 1.0, True, {"turn": 1})
    assert [p for p, _ in _Server.requests] == ["/env/reset", "/env/step", "/env/step", "/env/step", "/env/close"]
    assert {payload["episode"] for _, payload in _Server.requests} == {env.episode}
    assert _Server.requests[0][1]["record"] == {"prompt": "What is 17*3?", "answer": 51, "source": "test:1",
                                                "extra": {"level": 2}}


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("message, error", [
    ("crash", "/step: HTTP 500: Internal error: boom"),
    ("garbage", "/step: the answer is not JSON (Expecting value at char 0)"),
    ("no-done", '/step: "done" must be true or false, got None'),
    ("slow", "/step: no answer within 0.3 s"),
])
def test_http_env_errors_end_the_episode(server, message, error):
    env = HttpEnv(server, timeout_s=30)

    async def main():
        await env.reset(RECORD)
        env.timeout_s = 0.3  # only the step is to time out, however loaded the machine
        start = time.monotonic()
        result = await env.step(message)
        return result, time.monotonic() - start

    result, seconds = run(main())
    assert result.done and result.observation == "" and result.info["env_error"] == f"POST {server}{error}"
    assert seconds < 1.0


def test_http_env_unreachable_server():
    env = HttpEnv(f"http://127.0.0.1:{_free_port()}", timeout_s=2)
    (result,) = run(_episode(env, "40"))
    assert result.done and result.info["env_error"].startswith("POST http://127.0.0.1:")
    assert "/reset: ConnectionRefusedError" in result.info["env_error"]  # the failed reset, reported by the step


class Guess(Environment):
    async def reset(self, record):
        return None

    async def step(self, message):
        return StepResult(done=True, reward=1.0)


def guess_factory():
    return Guess()


def not_an_env():
    return object()


class NeedsArgs(Guess):
    def __init__(self, secret):
        self.secret = secret


def test_env_factory_specs():
    assert isinstance(env_factory("python")(), ToolEnv) and make_env("python").tools[0]["function"]["name"] == "python"
    python = env_factory("python", sandbox_limits=SandboxLimits(timeout_s=3, memory_mb=64))()
    assert "limits: 3 s, 64 MiB" in python.tools[0]["function"]["description"]
    first, second = env_factory("calculator")(), env_factory("calculator")()
    assert first is not second  # one per episode
    assert isinstance(env_factory("tests.unit.agent.test_envs:Guess")(), Guess)
    assert isinstance(env_factory("tests.unit.agent.test_envs:guess_factory")(), Guess)
    with pytest.raises(TypeError, match="rollout.env='tests.unit.agent.test_envs:not_an_env' returned a object"):
        env_factory("tests.unit.agent.test_envs:not_an_env")()


@pytest.mark.parametrize("spec, message", [
    ("search", "rollout.env: unknown environment 'search'; available: calculator, python; or an http"),
    ("", "rollout.env='' must name an environment"),
    ("nonexistent.module:Env", "rollout.env='nonexistent.module:Env': cannot import (ModuleNotFoundError"),
    ("tests.unit.agent.test_envs:Missing", "rollout.env='tests.unit.agent.test_envs:Missing': cannot import (AttributeError"),
    ("tests.unit.agent.test_envs:RECORD", "is a PromptRecord, not an Environment subclass"),
    ("tests.unit.agent.test_envs:_Server", "is a class but not a subclass of megarl.agent.env.Environment"),
    ("tests.unit.agent.test_envs:NeedsArgs", "must be callable without arguments (missing a required argument: 'secret')"),
    ("ftp://x", "rollout.env='ftp://x': only http:// and https:// URLs are supported"),
])
def test_env_factory_errors(spec, message):
    with pytest.raises(ValueError) as err:
        env_factory(spec)
    assert message in str(err.value), str(err.value)
