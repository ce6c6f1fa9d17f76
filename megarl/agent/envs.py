"""The environments of agentic rollouts: :class:`ToolEnv` (the model calls local tools),
:class:`HttpEnv` (an environment served over HTTP), and :func:`env_factory`, which resolves
``rollout.env`` to a factory that the agent loop calls once per episode.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import ssl
import time
import uuid
from dataclasses import asdict, replace
from typing import Any, Callable, Dict, List, Optional, Tuple
from urllib.parse import urlsplit

from megarl.agent.env import Environment, StepResult
from megarl.agent.tool_calls import TOOL_CALL_FORMATS, ToolCall, ToolCallError, parse_tool_calls
from megarl.agent.tools import CALCULATOR, SandboxLimits, Tool, ToolError, confinement_error, python_tool
from megarl.config.schema import Sandbox
from megarl.data.datasets import PromptRecord
from megarl.registry import Registry, load_object

EnvFactory = Callable[[], Environment]

log = logging.getLogger(__name__)


class ToolEnv(Environment):
    """The model calls ``tools`` in format ``fmt``; each turn's calls are run in order and their
    answers are the observation. A turn without a tool call ends the episode with
    :meth:`final_reward` (0 here; a task subclasses it, or scores the final answer with a verifier).

    A malformed call, an unknown tool, bad arguments or a failing tool give an observation that
    starts with ``error:`` and ``info["tool_error"] = True``; the episode goes on so the model may
    correct itself (the loop's ``max_turns`` bounds it).
    """

    def __init__(self, tools: Dict[str, Tool], fmt: str = "hermes", max_calls_per_turn: int = 4) -> None:
        TOOL_CALL_FORMATS.get(fmt)  # an unknown format fails here, with the names that exist
        if max_calls_per_turn < 1:
            raise ValueError(f"max_calls_per_turn={max_calls_per_turn} must be >= 1")
        for name, tool in tools.items():
            assert name == tool.name, f"tool registered as {name!r} is named {tool.name!r}"
        self._tools = dict(tools)
        self.fmt = fmt
        self.max_calls_per_turn = max_calls_per_turn
        self.tools = [tool.definition for tool in self._tools.values()]
        self.record: Optional[PromptRecord] = None

    async def reset(self, record: PromptRecord) -> Optional[str]:
        self.record = record
        return None

    def final_reward(self, message: str) -> float:
        """The reward of the turn that calls no tool (the final answer)."""
        return 0.0

    async def step(self, message: str) -> StepResult:
        try:
            calls = parse_tool_calls(message, self.fmt)
        except ToolCallError as err:
            return StepResult(f"error: {err}", info={"tool_error": True, "tool": [], "tool_seconds": 0.0})
        if not calls:
            return StepResult("", self.final_reward(message), done=True)
        if len(calls) > self.max_calls_per_turn:
            return StepResult(f"error: {len(calls)} tool calls in one turn; at most {self.max_calls_per_turn}",
                              info={"tool_error": True, "tool": [c.name for c in calls], "tool_seconds": 0.0})
        start = time.monotonic()
        answers = [await self._call(call) for call in calls]
        seconds = time.monotonic() - start
        if len(calls) == 1:
            observation = answers[0][1]
        else:  # one answer per call, in order, each saying which call it answers
            observation = "\n".join(f"[{i}] {call.name}: {text}" for i, (call, (_, text)) in
                                    enumerate(zip(calls, answers), 1))
        return StepResult(observation, info={"tool_error": not all(ok for ok, _ in answers),
                                             "tool": [c.name for c in calls], "tool_seconds": seconds})

    async def _call(self, call: ToolCall) -> Tuple[bool, str]:
        tool = self._tools.get(call.name)
        if tool is None:
            return False, f"error: unknown tool {call.name!r}; available: {', '.join(self._tools)}"
        try:
            tool.check_arguments(call.arguments)
            if inspect.iscoroutinefunction(tool.fn):
                answer = await tool.fn(**call.arguments)
            else:  # blocking work (a subprocess, a computation) must not hold the event loop
                answer = await asyncio.to_thread(tool.fn, **call.arguments)
        except ToolError as err:
            return False, f"error: {call.name}: {err}"
        except Exception as err:  # a bug in a user's tool is the model's failed call, not the run's end
            return False, f"error: {call.name}: {type(err).__name__}: {err}"
        return True, str(answer)


class EnvError(Exception):
    """An environment server failed (unreachable, timed out, an HTTP error, a bad answer)."""


async def _post_json(url: str, payload: Dict[str, Any], timeout_s: float) -> Any:
    """POST ``payload`` as JSON and decode the JSON answer: a minimal HTTP/1.1 client on asyncio
    streams (one connection per request), so that waiting holds no thread."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise EnvError(f"bad URL {url!r}")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    body = json.dumps(payload).encode()
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    request = (f"POST {path} HTTP/1.1\r\nHost: {parts.netloc}\r\nContent-Type: application/json\r\n"
               f"Accept: application/json\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode() + body

    async def exchange() -> Tuple[int, bytes]:
        reader, writer = await asyncio.open_connection(
            parts.hostname, port, ssl=ssl.create_default_context() if parts.scheme == "https" else None)
        try:
            writer.write(request)
            await writer.drain()
            status_line = await reader.readline()
            try:
                status = int(status_line.split()[1])
            except (IndexError, ValueError):
                raise EnvError(f"not an HTTP answer: {status_line[:80]!r}") from None
            headers = {}
            while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
                key, _, value = line.decode("latin-1").partition(":")
                headers[key.strip().lower()] = value.strip()
            if headers.get("transfer-encoding", "").lower() == "chunked":
                data = b""
                while (size := int((await reader.readline()).split(b";")[0], 16)) > 0:
                    data += await reader.readexactly(size)
                    await reader.readline()
            elif "content-length" in headers:
                data = await reader.readexactly(int(headers["content-length"]))
            else:
                data = await reader.read()
            return status, data
        finally:
            writer.close()

    try:
        status, data = await asyncio.wait_for(exchange(), timeout_s)
    except asyncio.TimeoutError:
        raise EnvError(f"POST {url}: no answer within {timeout_s:g} s") from None
    except (OSError, asyncio.IncompleteReadError, ValueError) as err:
        raise EnvError(f"POST {url}: {type(err).__name__}: {err}") from None
    if status != 200:
        raise EnvError(f"POST {url}: HTTP {status}: {data[:200].decode('utf-8', 'replace')}")
    try:
        return json.loads(data)
    except json.JSONDecodeError as err:
        raise EnvError(f"POST {url}: the answer is not JSON ({err.msg} at char {err.pos})") from None


class HttpEnv(Environment):
    """An environment served over HTTP. Each episode has an id; the server gets JSON POSTs:

    - ``{url}/reset`` ``{"episode", "record": {"prompt", "answer", "source", "extra"}}``, answers
      ``{}`` or ``{"observation": text for the first user message, "tools": [definitions]}``;
    - ``{url}/step`` ``{"episode", "message"}``, answers ``{"observation", "reward", "done"}``
      (and optionally ``"info"``, a JSON object merged into the step's info);
    - ``{url}/close`` ``{"episode"}`` when the episode ends (best effort: errors are ignored).

    A failure (unreachable, timeout, HTTP error, bad JSON or fields) ends the episode: the step
    answers ``done=True`` with ``info["env_error"]`` naming it; a failed reset is reported by the
    first step, so that the loop sees every failure the same way.
    """

    def __init__(self, url: str, timeout_s: float = 30.0) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"HttpEnv url={url!r} must start with http:// or https://")
        if timeout_s <= 0:
            raise ValueError(f"HttpEnv timeout_s={timeout_s} must be > 0")
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self.episode = uuid.uuid4().hex
        self.tools: List[Dict[str, Any]] = []
        self._reset_error: Optional[str] = None

    async def reset(self, record: PromptRecord) -> Optional[str]:
        try:
            answer = await _post_json(f"{self.url}/reset", {"episode": self.episode, "record": asdict(record)},
                                      self.timeout_s)
            if not isinstance(answer, dict):
                raise EnvError(f"POST {self.url}/reset: expected a JSON object, got {type(answer).__name__}")
            observation, tools = answer.get("observation"), answer.get("tools", [])
            if observation is not None and not isinstance(observation, str):
                raise EnvError(f"POST {self.url}/reset: \"observation\" must be a string or null")
            if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
                raise EnvError(f"POST {self.url}/reset: \"tools\" must be a list of JSON objects")
        except EnvError as err:
            self._reset_error = str(err)
            return None
        self.tools = tools
        return observation

    async def step(self, message: str) -> StepResult:
        if self._reset_error is not None:
            return StepResult(done=True, info={"env_error": self._reset_error})
        try:
            answer = await _post_json(f"{self.url}/step", {"episode": self.episode, "message": message},
                                      self.timeout_s)
            return self._step_result(answer)
        except EnvError as err:
            return StepResult(done=True, info={"env_error": str(err)})

    def _step_result(self, answer: Any) -> StepResult:
        where = f"POST {self.url}/step"
        if not isinstance(answer, dict):
            raise EnvError(f"{where}: expected a JSON object, got {type(answer).__name__}")
        observation, reward, done = answer.get("observation", ""), answer.get("reward", 0.0), answer.get("done")
        info = answer.get("info", {})
        if not isinstance(observation, str):
            raise EnvError(f"{where}: \"observation\" must be a string")
        if isinstance(reward, bool) or not isinstance(reward, (int, float)) or reward != reward:
            raise EnvError(f"{where}: \"reward\" must be a number, got {reward!r:.40}")
        if not isinstance(done, bool):
            raise EnvError(f"{where}: \"done\" must be true or false, got {done!r:.40}")
        if not isinstance(info, dict):
            raise EnvError(f"{where}: \"info\" must be a JSON object")
        return StepResult(observation, float(reward), done, info)

    async def close(self) -> None:
        try:
            await _post_json(f"{self.url}/close", {"episode": self.episode}, self.timeout_s)
        except EnvError:
            pass


ENVIRONMENTS: Registry[Callable[[SandboxLimits], EnvFactory]] = Registry("environment")
"""Built-in environments by name: ``fn(sandbox_limits)`` returns the per-episode factory."""
ENVIRONMENTS.register("calculator")(lambda limits: lambda: ToolEnv({"calculator": CALCULATOR}))
ENVIRONMENTS.register("python")(lambda limits: lambda: ToolEnv({"python": python_tool(limits)}))


SANDBOX_MODES = tuple(Sandbox)
"""``rollout.sandbox``: whether the ``python`` environment's code must run confined (its own
user, network and mount namespaces; see :func:`megarl.agent.tools.run_python`)."""


def _check_sandbox_mode(sandbox: Sandbox) -> None:
    if sandbox not in SANDBOX_MODES:
        raise ValueError(f"rollout.sandbox={sandbox!r} must be one of {', '.join(SANDBOX_MODES)}")


def check_sandbox(spec: str, sandbox: Sandbox) -> None:
    """Refuse a bad ``rollout.sandbox``, and ``rollout.env=python`` on a machine that cannot
    confine the tool's code (one probing call, :func:`confinement_error`) unless
    ``rollout.sandbox=unconfined``, which then runs with a warning. Call it before workers start."""
    _check_sandbox_mode(sandbox)
    if spec != "python":
        if sandbox != Sandbox.confined:
            log.warning("rollout.sandbox=%s is ignored: it applies to rollout.env=python only", sandbox)
        return
    why = confinement_error()
    if why is None:
        return
    if sandbox == Sandbox.confined:
        raise ValueError(f"rollout.env=python: this machine cannot confine the tool's code ({why}); it needs "
                         f"unprivileged user and mount namespaces (e.g. sysctl user.max_user_namespaces > 0, "
                         f"kernel.apparmor_restrict_unprivileged_userns=0, no seccomp profile refusing unshare). "
                         f"rollout.sandbox=unconfined runs it anyway, with the audit hook and limits only: the "
                         f"model's code can then read every file the trainer can (the host's /etc and /root, the "
                         f"project, run directories and checkpoints) and its output goes into the training data")
    log.warning("rollout.sandbox=unconfined on a machine that cannot confine the python tool's code (%s): the "
                "model's code can read every file the trainer can (the host's /etc and /root, the project, run "
                "directories and checkpoints)", why)


def env_factory(spec: str, http_timeout_s: float = 30.0, sandbox_limits: Optional[SandboxLimits] = None,
                sandbox: Sandbox = Sandbox.confined) -> EnvFactory:
    """What ``rollout.env=spec`` names, as a factory the loop calls once per episode (episodes run
    concurrently and must not share state): a built-in name (``calculator``, ``python``, which runs
    under ``sandbox_limits``, confined unless ``sandbox`` (``rollout.sandbox``) is
    ``unconfined``), an ``http(s)://`` URL (:class:`HttpEnv`), or ``package.module:Name``, an
    :class:`Environment` subclass or a zero-argument function returning one. Checked here, so a bad
    value fails before the run starts (whether this machine can confine code: :func:`check_sandbox`)."""
    _check_sandbox_mode(sandbox)
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"rollout.env={spec!r} must name an environment: {', '.join(ENVIRONMENTS.names())}, "
                         f"an http(s):// URL or package.module:Name")
    if spec.startswith(("http://", "https://")):
        HttpEnv(spec, http_timeout_s)  # checks the arguments
        return lambda: HttpEnv(spec, http_timeout_s)
    if "://" in spec:
        raise ValueError(f"rollout.env='{spec}': only http:// and https:// URLs are supported")
    if ":" not in spec:
        try:
            limits = replace(sandbox_limits or SandboxLimits(), confined=sandbox == Sandbox.confined)
            return ENVIRONMENTS.get(spec)(limits)
        except KeyError as err:
            raise ValueError(f"rollout.env: {err.args[0]}; or an http(s):// URL, or package.module:Name") from None
    try:
        target = load_object(spec)
    except Exception as err:  # the user's module may fail in any way as it is imported
        raise ValueError(f"rollout.env='{spec}': cannot import ({type(err).__name__}: {err})") from None
    if isinstance(target, type) and not issubclass(target, Environment):
        raise ValueError(f"rollout.env='{spec}' is a class but not a subclass of megarl.agent.env.Environment")
    if not callable(target):
        raise ValueError(f"rollout.env='{spec}' is a {type(target).__name__}, not an Environment subclass "
                         f"or a function returning one")
    try:
        inspect.signature(target).bind()
    except TypeError as err:
        raise ValueError(f"rollout.env='{spec}' must be callable without arguments ({err})") from None
    except ValueError:  # no signature (some builtins): found out when called
        pass
    if isinstance(target, type):
        return target

    def make() -> Environment:
        env = target()
        if not isinstance(env, Environment):
            raise TypeError(f"rollout.env='{spec}' returned a {type(env).__name__}, not an Environment")
        return env

    return make


def make_env(spec: str) -> Environment:
    """One environment of ``spec`` (see :func:`env_factory`)."""
    return env_factory(spec)()
