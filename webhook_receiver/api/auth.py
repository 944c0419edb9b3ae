"""Bearer-token authentication of API clients."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar, cast

from flask import current_app, g, request

from ..config import FileConfig
from ..problems import Problem

F = TypeVar("F", bound=Callable[..., Any])


def require_client(view: F) -> F:
    """Authenticate the request's bearer token and set ``g.client`` to the client's name."""

    @functools.wraps(view)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        header = request.headers.get("Authorization", "")
        scheme, _, token = header.partition(" ")
        file_config: FileConfig = current_app.config["FILE_CONFIG"]
        client = file_config.client_for_token(token.strip()) if scheme.lower() == "bearer" else None
        if client is None:
            raise Problem(
                "unauthorized",
                "send Authorization: Bearer <token> with a configured client's token",
                headers={"WWW-Authenticate": 'Bearer realm="webhook-receiver"'},
            )
        g.client = client.name
        return view(*args, **kwargs)

    return cast(F, wrapper)
