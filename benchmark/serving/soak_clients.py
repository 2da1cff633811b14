"""The soak test's clients: concurrent users of a running `vllm serve`, each sending a mix of requests until a
deadline and recording how each one went.

Request kinds (`KINDS`, weighted): streaming and non-streaming completions and chats with random sampling parameters,
aborts (a stream the client closes after a few events), logprobs, ``n > 1``, structured output (JSON: a chat with a
``json_schema`` response format; or, for a model whose tokenizer cannot write JSON such as the tiny test models' word
tokenizer, a ``choice`` among words: the same grammar-bitmask path), penalties, long prompts (several prefill chunks),
and greedy checks (a fixed greedy request whose tokens must equal the same request sent alone before the load).
"""

from __future__ import annotations

import json
import random
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

from benchmark.serving.server import SERVED_NAME

TIMEOUT_S = 900
"""A request may wait that long for a KV slot under load before the client counts it failed."""
KINDS = {
    "completion": 3,
    "chat-stream": 3,
    "abort": 2,
    "logprobs": 2,
    "n>1": 1,
    "structured": 1,
    "penalties": 2,
    "long-prompt": 1,
    "greedy-check": 2,
}
"""Request kind -> weight in each client's random choice."""
CHOICES = ["hello", "thanks", "world"]
"""The ``choice`` constraint of a model whose tokenizer cannot write JSON: single words of the tiny models' vocabulary
(their word-level tokens carry no spaces, so a grammar asking for ``"hello world"`` can never be followed)."""
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "count": {"type": "integer"}},
    "required": ["name", "count"],
}


@dataclass(frozen=True)
class Shape:
    """What the served artifact holds, so every request fits it."""

    sequence_length: int
    max_topk: int
    max_tokens: int
    """The most new tokens a request asks."""
    long_words: int
    """Words of a long prompt (several chunks of the artifact)."""
    json_output: bool = True
    """Structured output as JSON (a ``json_schema``); False: a ``choice`` among `CHOICES`."""


@dataclass
class Outcome:
    """How one request went."""

    kind: str
    ok: bool
    latency_s: float
    detail: str = ""
    tokens: int = 0
    """Completion tokens (from the response's usage, or the events counted)."""


class Client:
    """One user: a seeded random mix of requests against ``base`` until ``deadline`` (``time.monotonic``)."""

    def __init__(self, base: str, index: int, shape: Shape, corpus: list[str], greedy: list[list[int]]) -> None:
        self.base, self.shape, self.corpus, self.greedy = base, shape, corpus, greedy
        self.rng = random.Random(1000 + index)
        self.outcomes: list[Outcome] = []
        self.greedy_seen: list[tuple[int, list[int]]] = []
        """``(index of the greedy prompt, tokens)`` of every greedy check sent under load."""

    def run(self, deadline: float) -> None:
        """Send requests of random kinds until ``deadline``."""
        kinds, weights = zip(*KINDS.items(), strict=True)
        while time.monotonic() < deadline:
            self.send(self.rng.choices(kinds, weights)[0])

    def send(self, kind: str) -> Outcome:
        """Send one request of ``kind`` and record how it went (a failure is recorded, never raised)."""
        start = time.monotonic()
        try:
            ok, detail, tokens = getattr(self, "_" + kind.replace("-", "_").replace(">", "_gt_"))()
        except Exception as err:
            ok, detail, tokens = False, f"{type(err).__name__}: {err}"[:300], 0
        self.outcomes.append(Outcome(kind, ok, time.monotonic() - start, detail, tokens))
        return self.outcomes[-1]

    # --- the request kinds (each returns ok, detail, completion tokens) ---------------------------------------

    def _completion(self) -> tuple[bool, str, int]:
        return self._complete({"prompt": self._text(self.rng.randint(4, 40)), **self._sampling()})

    def _chat_stream(self) -> tuple[bool, str, int]:
        body = {"messages": self._messages(), **self._sampling(), "stream": True}
        events = self._stream("/v1/chat/completions", body)
        return _stream_ok(events)

    def _abort(self) -> tuple[bool, str, int]:
        body = {"prompt": self._text(20), **self._sampling(), "max_tokens": self.shape.max_tokens, "stream": True}
        events = self._stream("/v1/completions", body, stop_after=self.rng.randint(1, 3))
        return bool(events), f"closed after {len(events)} events", 0

    def _logprobs(self) -> tuple[bool, str, int]:
        ok, detail, tokens = self._complete({"prompt": self._text(12), **self._sampling(), "logprobs": 3})
        return ok, detail, tokens

    def _n_gt_1(self) -> tuple[bool, str, int]:
        n = self.rng.randint(2, 3)
        body = {"prompt": self._text(10), **self._sampling(greedy=False), "n": n}
        reply = self._post("/v1/completions", body)
        if len(reply["choices"]) != n:
            return False, f"{len(reply['choices'])} choices for n={n}", 0
        return _finished(reply)

    def _structured(self) -> tuple[bool, str, int]:
        if not self.shape.json_output:
            choice = {"structured_outputs": {"choice": CHOICES}}
            return self._complete({"prompt": self._text(8), **choice, **self._sampling()})
        response_format = {"type": "json_schema", "json_schema": {"name": "item", "schema": SCHEMA}}
        body = {"messages": self._messages("Describe one item as JSON."), "response_format": response_format}
        reply = self._post("/v1/chat/completions", {**body, **self._sampling()})
        ok, detail, tokens = _finished(reply)
        if ok and reply["choices"][0]["finish_reason"] == "stop":  # a JSON the grammar closed must parse
            json.loads(reply["choices"][0]["message"]["content"])
        return ok, detail, tokens

    def _penalties(self) -> tuple[bool, str, int]:
        penalties = {
            "presence_penalty": round(self.rng.uniform(-1, 1), 2),
            "frequency_penalty": round(self.rng.uniform(-1, 1), 2),
            "repetition_penalty": round(self.rng.uniform(0.8, 1.3), 2),
        }
        return self._complete({"prompt": self._text(16), **self._sampling(), **penalties})

    def _long_prompt(self) -> tuple[bool, str, int]:
        return self._complete({"prompt": self._text(self.shape.long_words), **self._sampling()})

    def _greedy_check(self) -> tuple[bool, str, int]:
        index = self.rng.randrange(len(self.greedy))
        reply = self._post("/v1/completions", greedy_body(self.greedy[index], self.shape))
        tokens = reply["choices"][0]["token_ids"]
        self.greedy_seen.append((index, tokens))
        return True, "", len(tokens)

    # --- helpers -------------------------------------------------------------------------------------------

    def _sampling(self, greedy: bool | None = None) -> dict[str, Any]:
        """Random sampling parameters within the artifact's limits (greedy one time in three, unless told)."""
        params: dict[str, Any] = {"max_tokens": self.rng.randint(4, self.shape.max_tokens)}
        params["truncate_prompt_tokens"] = self.shape.sequence_length - self.shape.max_tokens - 2
        if greedy if greedy is not None else self.rng.random() < 1 / 3:
            return {**params, "temperature": 0.0}
        params.update(temperature=round(self.rng.uniform(0.3, 1.2), 2), top_p=round(self.rng.uniform(0.5, 1.0), 2))
        params["top_k"] = self.rng.choice([0, 1, 5, self.shape.max_topk])
        params["seed"] = self.rng.randrange(2**31)
        return params

    def _text(self, words: int) -> str:
        start = self.rng.randrange(max(1, len(self.corpus) - words))
        return " ".join(self.corpus[start : start + words])

    def _messages(self, ask: str | None = None) -> list[dict[str, str]]:
        return [{"role": "user", "content": ask or self._text(self.rng.randint(4, 30))}]

    def _complete(self, body: dict[str, Any]) -> tuple[bool, str, int]:
        return _finished(self._post("/v1/completions", body))

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        data = json.dumps({"model": SERVED_NAME, **body}).encode()
        request = urllib.request.Request(self.base + path, data, {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=TIMEOUT_S) as reply:
                return dict(json.loads(reply.read()))
        except urllib.error.HTTPError as err:
            raise RuntimeError(f"HTTP {err.code}: {err.read().decode()[:200]}") from err

    def _stream(self, path: str, body: dict[str, Any], stop_after: int | None = None) -> list[str]:
        """The ``data:`` payloads of a streaming request (``[DONE]`` included); closes the connection after
        ``stop_after`` events (the server sees a client that went away and aborts the request)."""
        data = json.dumps({"model": SERVED_NAME, **body}).encode()
        request = urllib.request.Request(self.base + path, data, {"Content-Type": "application/json"})
        events: list[str] = []
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as reply:
            for raw in reply:
                line = raw.decode().strip()
                if line.startswith("data: "):
                    events.append(line[len("data: ") :])
                    if stop_after is not None and len(events) >= stop_after:
                        break
        return events


def greedy_body(prompt: list[int], shape: Shape) -> dict[str, Any]:
    """The greedy check request for ``prompt`` (token ids): fixed length, its tokens returned."""
    fixed = {"max_tokens": shape.max_tokens, "temperature": 0.0, "ignore_eos": True}
    return {"prompt": prompt, **fixed, "return_token_ids": True}


def _finished(reply: dict[str, Any]) -> tuple[bool, str, int]:
    """A non-streaming reply is ok when every choice finished normally (``stop`` or ``length``)."""
    reasons = [c.get("finish_reason") for c in reply["choices"]]
    ok = all(r in ("stop", "length") for r in reasons)
    return ok, "" if ok else f"finish reasons {reasons}", int(reply.get("usage", {}).get("completion_tokens", 0))


def _stream_ok(events: list[str]) -> tuple[bool, str, int]:
    """A stream is ok when it ends with ``[DONE]``, holds no error event and its last choice finished normally."""
    if not events or events[-1] != "[DONE]":
        return False, "stream ended without [DONE]", 0
    payloads = [json.loads(e) for e in events[:-1]]
    errors = [p["error"] for p in payloads if "error" in p]
    if errors:
        return False, f"error event: {errors[0]}"[:300], 0
    reasons = [c.get("finish_reason") for p in payloads for c in p.get("choices", []) if c.get("finish_reason")]
    ok = bool(reasons) and all(r in ("stop", "length") for r in reasons)
    return ok, "" if ok else f"finish reasons {reasons}", sum(1 for p in payloads if p.get("choices"))
