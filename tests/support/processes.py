"""kvrelay router and worker processes for tests: start them, read their output, stop them.

``kvrelay(...)`` runs ``python -m kvrelay.cli.main ...`` as a
``launch.child.ChildProcess`` (stdout and stderr merged, every line kept;
``wait_for(pattern)`` returns the first matching line after a mark, or fails
with the output's tail when the timeout passes or the process exits). ``wait_until`` polls a predicate (e.g.
an HTTP endpoint) with a timeout. Every child gets the test's shared secret
and its own cache and data directories.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import httpx

from kvrelay.launch.child import ChildProcess
from kvrelay.launch.cluster import ROUTER_READY, status_url

SECRET = "kvrelay-test-secret-0123456789abcdef"
T = TypeVar("T")


def stop_all(children: list[ChildProcess], timeout: float = 20.0) -> None:
    """SIGTERM every child at once, then wait for each (``ChildProcess.stop``)."""
    for child in children:
        if child.process.poll() is None:
            child.signal(signal.SIGTERM)
            child.signal(signal.SIGCONT)
    for child in children:
        child.stop(timeout)


def child_env(home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVRELAY_")}
    env.update(
        KVRELAY_SECRET=SECRET,
        KVRELAY_CACHE_DIR=str(home / "cache"),
        KVRELAY_DATA_DIR=str(home / "data"),
        PYTHONUNBUFFERED="1",
        **extra,
    )
    return env


def kvrelay(
    name: str, command: str, args: list[str], env: dict[str, str], python: str = sys.executable
) -> ChildProcess:
    argv = [python, "-m", "kvrelay.cli.main", "--log-level", "INFO", command, *args]
    return ChildProcess(name, argv, env)


CLUSTER_READY = r"kvrelay cluster ready http=(\S+) workers=w1,w2"
"""The ready line of ``two_worker_cluster``'s child, its router's HTTP URL as group 1."""


def two_worker_cluster(home: Path, model_dir: Path, *flags: str) -> ChildProcess:
    """``kvrelay cluster`` with workers w1 and w2 serving ``model_dir`` in float32 (4,096 KV tokens, 4 lanes),
    its fact store in ``home``; ``flags`` are added to the command line."""
    args = ["--workers", "2", "--port", "0", "--model", str(model_dir), "--dtype", "float32"]
    args += ["--kv-tokens", "4096", "--lanes", "4", *flags, "--db", f"sqlite:///{home / 'facts.sqlite3'}"]
    return kvrelay("cluster", "cluster", args, child_env(home))


class Router:
    """A ``kvrelay router`` child with its URLs (learned from its ready line); ``python`` runs it (vLLM's, for
    engines in its process) and it has ``ready_s`` to start."""

    def __init__(
        self,
        home: Path,
        model_dir: Path,
        *flags: str,
        port: int = 0,
        worker_port: int = 0,
        python: str = sys.executable,
        ready_s: float = 60.0,
    ) -> None:
        self.home = home
        self.model_dir = model_dir
        self.child = kvrelay(
            "router",
            "router",
            [
                "--port",
                str(port),
                "--worker-port",
                str(worker_port),
                "--model",
                str(model_dir),
                "--db",
                f"sqlite:///{home / 'facts.sqlite3'}",
                *flags,
            ],
            child_env(home),
            python,
        )
        ready = self.child.wait_for(ROUTER_READY, ready_s)
        self.http_url, self.workers_url = ready.group(1), ready.group(2)
        self.status_url = status_url(ready.string)
        self.port = int(self.http_url.rsplit(":", 1)[1])
        self.worker_port = int(self.workers_url.rsplit(":", 1)[1].split("/")[0])

    def cluster(self) -> dict[str, Any]:
        return httpx.get(self.http_url + "/cluster", timeout=10).json()

    def live_workers(self) -> dict[str, Any]:
        return self.cluster()["workers"]

    def status(self) -> dict[str, Any]:
        """The router's read-only status view (``launch.router.router_status``)."""
        return httpx.get(self.status_url, timeout=10).json()


def start_worker(home: Path, worker_id: str, router_url: str, model_dir: Path, *flags: str) -> ChildProcess:
    return kvrelay(
        worker_id,
        "worker",
        [
            "--worker-id",
            worker_id,
            "--router",
            router_url,
            "--model",
            str(model_dir),
            "--dtype",
            "float32",
            "--kv-tokens",
            "4096",
            "--lanes",
            "4",
            "--heartbeat-s",
            "0.2",
            *flags,
        ],
        child_env(home),
    )


def wait_until(probe: Callable[[], T | None], timeout: float, what: str, every_s: float = 0.05) -> T:
    """Poll ``probe`` until it returns something truthy; fail naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    last: T | None = None
    while time.monotonic() < deadline:
        last = probe()
        if last:
            return last
        threading.Event().wait(every_s)
    raise AssertionError(f"timed out after {timeout} s waiting for {what} (last: {last!r})")


def stream_completion(http_url: str, model: str, prompt: list[int], max_tokens: int) -> Iterator[dict[str, Any]]:
    """The SSE chunks of a greedy streaming completion, parsed; the last one carries the usage."""
    import json

    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream("POST", http_url + "/v1/completions", json=body, timeout=120) as response:
        if response.status_code != 200:
            raise AssertionError(f"HTTP {response.status_code}: {response.read().decode(errors='replace')}")
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                yield json.loads(line[len("data: ") :])


def complete(http_url: str, model: str, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    response = httpx.post(http_url + "/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


class StreamingRequest:
    """A streaming greedy completion consumed on a thread: ``first`` is set at the first token, ``done`` at the end."""

    def __init__(self, http_url: str, model: str, prompt: list[int], max_tokens: int) -> None:
        self.pieces: list[str] = []
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None
        self.error_event: dict[str, Any] | None = None
        """The ``error`` object of an SSE error event, when the stream ended with one."""
        self.error: BaseException | None = None
        self.first = threading.Event()
        self.done = threading.Event()
        self._thread = threading.Thread(
            target=self._consume, args=(http_url, model, prompt, max_tokens), name="stream", daemon=True
        )
        self._thread.start()

    def _consume(self, http_url: str, model: str, prompt: list[int], max_tokens: int) -> None:
        try:
            for chunk in stream_completion(http_url, model, prompt, max_tokens):
                if "error" in chunk:
                    self.error_event = chunk["error"]
                if chunk.get("usage"):
                    self.usage = chunk["usage"]
                for choice in chunk.get("choices", ()):
                    if choice.get("text"):
                        self.pieces.append(choice["text"])
                        self.first.set()
                    if choice.get("finish_reason"):
                        self.finish_reason = choice["finish_reason"]
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            self.error = exc
        finally:
            self.first.set()
            self.done.set()

    def result(self, timeout: float) -> str:
        """The whole text; fails if the stream did not end within ``timeout`` or raised."""
        if not self.done.wait(timeout):
            raise AssertionError(f"the streaming request did not finish within {timeout} s")
        if self.error is not None:
            raise AssertionError(f"the streaming request failed: {self.error!r}") from self.error
        return "".join(self.pieces)


class OpenAIStream:
    """A greedy streaming completion read by the official ``openai`` client on a thread: ``text`` its pieces,
    ``error`` what the client raised (an ``openai.APIError`` for an error event in the stream)."""

    def __init__(self, http_url: str, model: str, prompt: list[int], max_tokens: int) -> None:
        import openai

        self.text: list[str] = []
        self.error: BaseException | None = None
        self.first, self.done = threading.Event(), threading.Event()
        client = openai.OpenAI(base_url=http_url + "/v1", api_key="unused", max_retries=0, timeout=120)
        args = (client, model, prompt, max_tokens)
        threading.Thread(target=self._read, args=args, name="openai-stream", daemon=True).start()

    def _read(self, client: Any, model: str, prompt: list[int], max_tokens: int) -> None:
        try:
            stream = client.completions.create(
                model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True
            )
            for chunk in stream:
                self.text.append(chunk.choices[0].text if chunk.choices else "")
                self.first.set()
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            self.error = exc
        finally:
            self.first.set()
            self.done.set()


def children_of(pid: int) -> dict[int, str]:
    """Command lines of the live child processes of ``pid``."""
    import re

    found = {}
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            text = status.read_text()
            cmdline = (status.parent / "cmdline").read_bytes()
        except OSError:
            continue
        parent = re.search(r"^PPid:\s+(\d+)", text, re.MULTILINE)
        state = re.search(r"^State:\s+(\S)", text, re.MULTILINE)
        if parent and int(parent.group(1)) == pid and state and state.group(1) != "Z":
            found[int(status.parent.name)] = cmdline.replace(b"\0", b" ").decode()
    return found
