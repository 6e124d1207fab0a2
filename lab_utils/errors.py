"""The errors the modules share: `ConfigError` (re-exported by `profiles`, and
raised by `machine` too), `ServerError` (here, so that `server`, `http`
and `counters` can all raise it without importing each other), and
`NotebookSkipped`, by which a notebook stops because the target cannot serve
what it needs (runall reports it "skipped", with the message, not "failed")."""
from __future__ import annotations


class ConfigError(ValueError):
    """A profile, flag or parameter is wrong; the message names the fix."""


class ServerError(RuntimeError):
    """A server failed to start, died, or answered an HTTP error; the message
    names the URL and status, or carries the server log's tail."""


class NotebookSkipped(RuntimeError):
    """This target cannot serve what the notebook needs (e.g. both tiers, every
    replica): the notebook stops here and `runall` reports it "skipped", with
    this message as the reason. The results keep the skipped arms' reasons."""
