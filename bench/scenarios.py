"""The benchmark scenarios: one entry of ``SCENARIOS`` each.

A scenario names the gunicorn target it loads, an optional TOML fragment for
the app's config file, and a ``prepare`` function. ``prepare`` runs against
the live server just before the load and returns a ``Load``: which wrk Lua
script (in ``bench/lua``) to run and its arguments. Two scripts cover most
needs:

- ``unique.lua``: every request gets a key never sent before, put into a
  raw request template where it says ``@@KEY@@`` (``Context.template``).
- ``cycle.lua``: wrk cycles through requests prepared in Python
  (``Context.requests_file``): replays of stored keys, or anything wrk's Lua
  cannot compute, such as signed webhook deliveries and their redeliveries.

To add one (e.g. ``webhook-signed``), write its prepare function and add
``"webhook-signed": Scenario("wsgi:app", prepare_fn, config=TOML)``.
Every ratio is taken against ``baseline`` on the same database in the same run.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import requests

KEY_PLACEHOLDER = "@@KEY@@"
# unique.lua's keys: run id (8) - thread (2) - counter (10).
KEY_LENGTH = 22
# The argument of a Load that the harness replaces with a fresh id per wrk
# run, so that the warm-up and the measured run never share a key.
RUN_ID = "{run}"

EVENT_BODY = json.dumps(
    {
        "type": "order.created",
        "data": {
            "order": 42,
            "customer": {"id": "cus_123", "email": "someone@example.com"},
            "lines": [{"sku": f"sku-{i}", "qty": i, "price": "9.99"} for i in range(4)],
        },
    },
    separators=(",", ":"),
).encode()


@dataclass(frozen=True)
class Load:
    """What wrk runs: a script of ``bench/lua`` and its arguments."""

    script: str
    args: list[str]


@dataclass
class Context:
    """What a scenario's prepare function gets: the live server and a scratch folder."""

    db: str
    workdir: Path
    run_id: str
    token: str = field(default_factory=lambda: secrets.token_hex(24))
    url: str = ""

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}

    def config_toml(self, fragments: list[str] = ()) -> str:
        """The app's config file: the benchmark's API client, then the scenarios' fragments."""
        return "\n".join([f'[clients.bench]\ntoken = "{self.token}"\n', *fragments])

    def raw(self, method: str, path: str, headers: dict[str, str], body: bytes) -> bytes:
        """One raw HTTP/1.1 request to the server."""
        return _raw(self.url, method, path, headers, body, len(body))

    def template(self, method: str, path: str, headers: dict[str, str], body: bytes) -> str:
        """Write a request template for unique.lua; return its path."""
        length = len(body) + body.count(KEY_PLACEHOLDER.encode()) * (
            KEY_LENGTH - len(KEY_PLACEHOLDER)
        )
        return self._write("template", _raw(self.url, method, path, headers, body, length))

    def requests_file(self, raw_requests: list[bytes]) -> str:
        """Write requests for cycle.lua; return its path."""
        return self._write("requests", b"".join(b"%d\n%s" % (len(r), r) for r in raw_requests))

    def _write(self, kind: str, data: bytes) -> str:
        path = self.workdir / f"{kind}-{self.db}-{secrets.token_hex(4)}.bin"
        path.write_bytes(data)
        return str(path)


def _raw(
    url: str, method: str, path: str, headers: dict[str, str], body: bytes, length: int
) -> bytes:
    host = url.removeprefix("http://")
    head = [f"{method} {path} HTTP/1.1", f"Host: {host}"]
    head += [f"{name}: {value}" for name, value in headers.items()]
    head += [f"Content-Length: {length}", "", ""]
    return "\r\n".join(head).encode() + body


@dataclass(frozen=True)
class Scenario:
    """One thing to measure: the app to serve and how to load it."""

    app: str
    prepare: Callable[[Context], Load]
    about: str = ""
    config: str = ""  # a TOML fragment added to the app's config file


def baseline(ctx: Context) -> Load:
    headers = {"Content-Type": "application/json", "Idempotency-Key": KEY_PLACEHOLDER}
    return Load("unique.lua", [ctx.template("POST", "/baseline", headers, EVENT_BODY), RUN_ID])


def api_unique(ctx: Context) -> Load:
    headers = {
        **ctx.auth,
        "Content-Type": "application/json",
        "Idempotency-Key": KEY_PLACEHOLDER,
    }
    return Load("unique.lua", [ctx.template("POST", "/api/events", headers, EVENT_BODY), RUN_ID])


def floor_api_unique(ctx: Context) -> Load:
    headers = {"Content-Type": "application/json", "Idempotency-Key": KEY_PLACEHOLDER}
    return Load(
        "unique.lua", [ctx.template("POST", "/floor/api-unique", headers, EVENT_BODY), RUN_ID]
    )


REPLAY_KEYS = 200


def api_replay(ctx: Context) -> Load:
    """Create REPLAY_KEYS events first; the load then only replays them."""
    raw = []
    with requests.Session() as session:
        for i in range(REPLAY_KEYS):
            headers = {
                **ctx.auth,
                "Content-Type": "application/json",
                "Idempotency-Key": f"replay-{ctx.run_id}-{i}",
            }
            response = session.post(
                ctx.url + "/api/events", data=EVENT_BODY, headers=headers, timeout=10
            )
            if response.status_code != 201:
                raise RuntimeError(f"seeding replay keys: {response.status_code} {response.text}")
            raw.append(ctx.raw("POST", "/api/events", headers, EVENT_BODY))
    return Load("cycle.lua", [ctx.requests_file(raw)])


# Signed provider deliveries. GitHub signs only the body, so one body and
# one signature serve every request while X-GitHub-Delivery (the dedup key)
# changes: a real, verifiable unique delivery per request from wrk alone.
GITHUB_SECRET = "bench-github-secret-0123456789"
STRIPE_SECRET = "whsec_bench_stripe_secret_0123456789"
WEBHOOK_CONFIG = f"""
[sources.bench-github]
provider = "github"
secrets = ["{GITHUB_SECRET}"]

[sources.bench-stripe]
provider = "stripe"
secrets = ["{STRIPE_SECRET}"]
"""
GITHUB_BODY = json.dumps(
    {
        "action": "opened",
        "number": 7,
        "repository": {"full_name": "acme/app"},
        "issue": {"title": "a bug", "labels": ["bug", "p1"], "user": {"login": "someone"}},
    },
    separators=(",", ":"),
).encode()


def _github_headers(delivery: str) -> dict[str, str]:
    import hashlib
    import hmac

    digest = hmac.new(GITHUB_SECRET.encode(), GITHUB_BODY, hashlib.sha256).hexdigest()
    return {
        "Content-Type": "application/json",
        "X-GitHub-Event": "issues",
        "X-GitHub-Delivery": delivery,
        "X-Hub-Signature-256": f"sha256={digest}",
    }


def webhook_unique(ctx: Context) -> Load:
    """Every request a new, correctly signed GitHub delivery."""
    headers = _github_headers(KEY_PLACEHOLDER)
    return Load(
        "unique.lua",
        [ctx.template("POST", "/webhooks/bench-github", headers, GITHUB_BODY), RUN_ID],
    )


def _stripe_delivery(event_id: str, t: int) -> tuple[bytes, dict[str, str]]:
    import hashlib
    import hmac

    body = json.dumps(
        {"id": event_id, "type": "invoice.paid", "data": {"object": {"id": "in_1", "total": 990}}},
        separators=(",", ":"),
    ).encode()
    mac = hmac.new(STRIPE_SECRET.encode(), f"{t}.".encode() + body, hashlib.sha256).hexdigest()
    return body, {"Content-Type": "application/json", "Stripe-Signature": f"t={t},v1={mac}"}


def webhook_redelivery(ctx: Context) -> Load:
    """Store REPLAY_KEYS Stripe events, then load re-signed redeliveries of them."""
    import time

    raw = []
    with requests.Session() as session:
        for i in range(REPLAY_KEYS):
            event_id = f"evt_{ctx.run_id}_{i}"
            body, headers = _stripe_delivery(event_id, int(time.time()))
            response = session.post(
                ctx.url + "/webhooks/bench-stripe", data=body, headers=headers, timeout=10
            )
            if response.status_code != 200:
                raise RuntimeError(f"seeding deliveries: {response.status_code} {response.text}")
            # Stripe re-signs each retry with a new timestamp.
            body, headers = _stripe_delivery(event_id, int(time.time()) + 1)
            raw.append(ctx.raw("POST", "/webhooks/bench-stripe", headers, body))
    return Load("cycle.lua", [ctx.requests_file(raw)])


SCENARIOS: dict[str, Scenario] = {
    "baseline": Scenario(
        "bench.baseline_app:app",
        baseline,
        "bare Flask view: one INSERT ... ON CONFLICT DO NOTHING into events, one commit",
    ),
    "api-unique": Scenario(
        "wsgi:app", api_unique, "POST /api/events, a new Idempotency-Key on every request"
    ),
    "floor-api-unique": Scenario(
        "bench.baseline_app:app",
        floor_api_unique,
        "bare Flask view with a new key's statements only: the key's read, then one "
        "transaction with the event's and the record's INSERTs",
    ),
    "api-replay": Scenario(
        "wsgi:app", api_replay, f"POST /api/events replaying {REPLAY_KEYS} stored keys"
    ),
    "webhook-unique": Scenario(
        "wsgi:app",
        webhook_unique,
        "POST /webhooks/<github source>, a new signed delivery on every request",
        config=WEBHOOK_CONFIG,
    ),
    "webhook-redelivery": Scenario(
        "wsgi:app",
        webhook_redelivery,
        f"POST /webhooks/<stripe source>, re-signed redeliveries of {REPLAY_KEYS} stored events",
        config=WEBHOOK_CONFIG,
    ),
}
