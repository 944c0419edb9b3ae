"""Every payload of @octokit/webhooks-examples, signed as GitHub signs, through gunicorn.

tests/fixtures/octokit/deliveries.jsonl.gz holds the 726 example payloads of
@octokit/webhooks-examples (see VERSION and LICENSE there), each with the
signature @octokit/webhooks-methods made for it with the test secret, so the
test needs neither node nor the network (tests/fixtures/generate.mjs makes it).
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import pytest
import requests
from sqlalchemy import create_engine, text

from ..helpers import signing as s
from ..servers import gunicorn

CORPUS = Path(__file__).resolve().parents[1] / "fixtures" / "octokit" / "deliveries.jsonl.gz"
CONFIG = f"""
[sources.github]
provider = "github"
secrets = ["{s.GITHUB_SECRET}"]
"""
FORMS = 5
FORM = "application/x-www-form-urlencoded"


def corpus() -> list[dict[str, Any]]:
    with gzip.open(CORPUS, "rt", encoding="utf-8") as fh:
        return [json.loads(line) for line in fh]


def headers(item: dict[str, Any], content_type: str = "application/json") -> dict[str, str]:
    return {
        "Content-Type": content_type,
        "X-GitHub-Event": item["event"],
        "X-GitHub-Delivery": item["delivery"],
        "X-Hub-Signature-256": item["signature"],
        "User-Agent": "GitHub-Hookshot/044aadd",
    }


def expected_type(item: dict[str, Any]) -> str:
    action = json.loads(item["body"]).get("action")
    return f"{item['event']}.{action}" if isinstance(action, str) and action else item["event"]


def test_the_fixture_is_the_whole_corpus():
    items = corpus()
    assert len(items) == 726
    assert len({i["delivery"] for i in items}) == 726
    assert "726 payloads" in (CORPUS.parent / "VERSION").read_text()


@pytest.mark.slow
def test_every_octokit_example_is_accepted_once_and_replayed(db_url, tmp_path):
    items = corpus()
    # Five payloads again, sent as a webhook set to the form content type would send them.
    form_items = [
        {
            **item,
            "delivery": "form-" + item["delivery"],
            "form": urlencode({"payload": item["body"]}).encode(),
        }
        for item in sorted(items, key=lambda i: len(i["body"]))[:: len(items) // FORMS][:FORMS]
    ]
    for item in form_items:
        item["signature"] = "sha256=" + s.hmac_hex(item["form"], s.GITHUB_SECRET)
    with gunicorn(db_url, CONFIG, tmp_path) as server, requests.Session() as http:
        url = f"{server.url}/webhooks/github"
        first: dict[str, int] = {}
        for item in items:
            response = http.post(url, data=item["body"].encode(), headers=headers(item), timeout=30)
            assert response.status_code == 200, (item["origin"], response.text)
            assert "Idempotent-Replayed" not in response.headers, item["origin"]
            first[item["delivery"]] = response.json()["event_id"]
        for item in items:
            response = http.post(url, data=item["body"].encode(), headers=headers(item), timeout=30)
            assert response.status_code == 200, (item["origin"], response.text)
            assert response.headers["Idempotent-Replayed"] == "true", item["origin"]
            assert response.json()["event_id"] == first[item["delivery"]]
        for item in form_items:
            response = http.post(url, data=item["form"], headers=headers(item, FORM), timeout=30)
            assert response.status_code == 200, (item["origin"], response.text)
            assert "Idempotent-Replayed" not in response.headers
            first[item["delivery"]] = response.json()["event_id"]
            # The same content as JSON, same delivery: the event already stored.
            json_headers = {
                **headers(item),
                "X-Hub-Signature-256": "sha256="
                + s.hmac_hex(item["body"].encode(), s.GITHUB_SECRET),
            }
            again = http.post(url, data=item["body"].encode(), headers=json_headers, timeout=30)
            assert again.status_code == 200, again.text
            assert again.headers["Idempotent-Replayed"] == "true"
            assert again.json()["event_id"] == first[item["delivery"]]
    engine = create_engine(db_url)
    with engine.connect() as conn:
        stored = {
            row.dedup_key: row
            for row in conn.execute(
                text("SELECT dedup_key, event_type, content_type, body FROM events")
            )
        }
    engine.dispose()
    assert len(stored) == len(items) + FORMS
    for item in items:
        assert stored[item["delivery"]].event_type == expected_type(item), item["origin"]
    for item in form_items:
        row = stored[item["delivery"]]
        assert row.event_type == expected_type(item)
        assert (bytes(row.body), row.content_type) == (item["form"], FORM)
