"""Server-Sent Events, both ways: the framing the lab's app writes
(`sse_event`, `sse_comment`) and the one parser the client, the app and the
delivery experiments read streams with (`pop_sse_blocks`, `sse_data`,
`pop_sse_data`), following the WHATWG parsing rules: CRLF, CR and LF all end
a line, a blank line dispatches the event, `data:` lines join with newlines
and lose one leading space, comment lines (`:`) carry no data. To check a
stream against another implementation of those rules, `decode_events` runs
the `openai` SDK's own decoder over it."""
from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any


def sse_event(data: str | Mapping[str, Any], event: str | None = None) -> bytes:
    """One Server-Sent Event: optional `event:` line, one `data:` line per line
    of `data` (dicts are JSON-encoded on one line), and the blank line that
    ends the event. Without that blank line a client never dispatches it."""
    text = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"),
                                                         ensure_ascii=False)
    lines = [f"event: {event}"] if event else []
    lines += [f"data: {line}" for line in text.replace("\r\n", "\n").replace("\r", "\n")
              .split("\n")]
    return ("\n".join(lines) + "\n\n").encode()


def sse_comment(text: str) -> bytes:
    """An SSE comment line (`: text`): clients ignore it; proxies see traffic."""
    return "".join(f": {line}\n" for line in text.split("\n")).encode() + b"\n"


def pop_sse_blocks(buffer: bytearray) -> Iterable[str]:
    """Pop complete events (the text before each blank line) from `buffer`;
    an incomplete tail stays for the next read. CRLF and CR become LF."""
    if b"\r" in buffer:
        buffer[:] = buffer.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
    while True:
        cut = buffer.find(b"\n\n")
        if cut < 0:
            return
        block = bytes(buffer[:cut]).decode("utf-8", errors="replace")
        del buffer[:cut + 2]
        yield block


def sse_data(block: str) -> str | None:
    """The data of one event (its `data:` lines joined by newlines), as the SSE
    spec's parser dispatches it; None for an event without data (comments)."""
    data = []
    for line in block.split("\n"):
        if line.startswith(":"):
            continue
        name, _, value = line.partition(":")
        if name == "data":
            data.append(value.removeprefix(" "))
    return "\n".join(data) if data else None


def pop_sse_data(buffer: bytearray) -> Iterable[str]:
    """Pop complete events from `buffer` and yield the data of each (events
    without data, e.g. comments, are skipped)."""
    for block in pop_sse_blocks(buffer):
        data = sse_data(block)
        if data is not None:
            yield data


def decode_events(raw: bytes) -> list[str]:
    """The `data` of every event a spec-following SSE client dispatches for
    `raw`: the `openai` SDK's own decoder (it implements the WHATWG rules)."""
    from openai._streaming import SSEDecoder
    return [e.data for e in SSEDecoder().iter_bytes(iter([raw]))]


__all__ = ["decode_events", "pop_sse_blocks", "pop_sse_data", "sse_comment", "sse_data",
           "sse_event"]
