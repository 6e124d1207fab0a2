"""The error the modules that talk to servers share (here, so that `server`,
`http` and `counters` can all raise it without importing each other)."""
from __future__ import annotations


class ServerError(RuntimeError):
    """A server failed to start, died, or answered an HTTP error; the message
    names the URL and status, or carries the server log's tail."""
