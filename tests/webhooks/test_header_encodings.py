"""Header values as senders write them, bytes and all, through a real gunicorn on both databases.

HTTP header values reach the app decoded as Latin-1 (PEP 3333): a sender
that writes UTF-8 (Ruby's Net::HTTP, which GitLab uses, writes a string's
bytes as they are) must be compared by those bytes, not by their Latin-1
reading.
"""

from __future__ import annotations

import requests

from ..servers import gunicorn

TOKEN = "jeton-secret-été-0123456789"
CONFIG = f"""
[sources.gitlab]
provider = "gitlab"
secrets = ["{TOKEN}"]
"""


def test_gitlab_token_with_non_ascii_characters_is_accepted(db_url, tmp_path):
    body = b'{"object_kind": "push"}'
    headers = {
        "Content-Type": "application/json",
        "X-Gitlab-Event": "Push Hook",
        "Idempotency-Key": "gl-utf8-1",
    }
    with gunicorn(db_url, CONFIG, tmp_path, workers=1) as server:
        url = f"{server.url}/webhooks/gitlab"
        sent = requests.post(
            url, data=body, headers={**headers, "X-Gitlab-Token": TOKEN.encode()}, timeout=30
        )
        assert sent.status_code == 200, sent.text
        assert sent.json()["status"] == "accepted"
        # The same characters in Latin-1 are other bytes: not the token.
        latin = requests.post(
            url,
            data=body,
            headers={**headers, "X-Gitlab-Token": TOKEN.encode("latin-1")},
            timeout=30,
        )
        assert latin.status_code == 401, latin.text
        assert latin.headers["Content-Type"] == "application/problem+json"
