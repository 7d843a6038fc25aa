"""Request bodies read with a bound: the declared Content-Length is checked before a byte is read, the body
is read as a stream and refused as soon as it passes the limit, and a gzip / deflate body is decompressed
as a stream with the limit on what it decompresses to (a few KiB of gzip can stand for GiBs of zeros).

Shared by the REST doors (services.kserve.http) and the adapter pushes (services.rollout.adapter_endpoint).
What a body decompresses to is charged, piece by piece before it is kept, to the request's lease on the service's
budget for the requests in flight (services.common.budget; OverloadedError when it does not fit).
Written by hand over zlib's `decompressobj(...).decompress(data, max_length)`: Starlette and uvicorn
decompress no request bodies, and the decoders of HTTP clients (httpx, urllib3) are for responses.
"""

from __future__ import annotations

import asyncio
import json
import sys
import zlib
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request

from services.common.budget import scope_lease
from services.common.errors import BodyTimeoutError, TooLargeError

# Content-Encoding -> zlib wbits: gzip's header and trailer, or the zlib format HTTP calls "deflate"
# (RFC 9110 8.4.1.2; what tritonclient's `request_compression_algorithm="deflate"` sends: zlib.compress)
WBITS = {"gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}
# The whole body must arrive within this (from the first byte asked for): the largest body a door takes (the
# reward's 256 MiB, services/common/args.py) needs about 2 s at the 1 Gb/s a cluster link gives at the least,
# so 120 s only ever stops a stalled or trickling client, which would otherwise hold its connection for ever.
BODY_TIMEOUT_S = 120.0


async def _chunks(request: Request, timeout_s: float, what: str) -> AsyncIterator[bytes]:
    """`request.stream()`, refused with BodyTimeoutError once `timeout_s` has passed."""
    loop = asyncio.get_running_loop()
    deadline, chunks = loop.time() + timeout_s, request.stream().__aiter__()
    while True:
        try:
            yield await asyncio.wait_for(chunks.__anext__(), max(deadline - loop.time(), 0.0))
        except StopAsyncIteration:
            return
        except TimeoutError:
            raise BodyTimeoutError(f"{what}: not received within {timeout_s:g} s") from None


async def read_body(request: Request, max_bytes: int, *, decode: bool = False, what: str = "request body",
                    timeout_s: float = BODY_TIMEOUT_S) -> bytes:
    """The body of `request`, at most `max_bytes` (TooLargeError past it, before reading further), all of it
    within `timeout_s` (BodyTimeoutError). With `decode`, a gzip or deflate Content-Encoding is undone with
    `max_bytes` bounding the decompressed bytes too (ValueError for any other encoding, or bytes that do not
    decompress), each piece charged to the request's budget lease first (OverloadedError: the service's budget
    for the requests in flight is full)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise TooLargeError(f"{what}: Content-Length {declared} is over the limit of {max_bytes} bytes")
    encoding = request.headers.get("content-encoding", "").strip().lower() if decode else ""
    if encoding in ("", "identity"):
        inflate = None
    elif encoding in WBITS:
        inflate = zlib.decompressobj(WBITS[encoding])
    else:
        raise ValueError(f"Content-Encoding: {encoding!r} is not supported (gzip, deflate)")
    lease = scope_lease(request.scope)
    # the pieces, joined once at the end: a bytearray grown piece by piece is reallocated (copied) as it grows,
    # which under many bodies at once took the peak well past the bytes held (issue 58's burst)
    received, size, parts = 0, 0, []
    async for chunk in _chunks(request, timeout_s, what):
        received += len(chunk)
        if received > max_bytes:
            raise TooLargeError(f"{what}: over the limit of {max_bytes} bytes")
        if inflate is None:
            parts.append(chunk)
            size += len(chunk)
            continue
        try:
            while chunk:   # at most one byte past the limit per call: stop as soon as the output passes it
                cap = max_bytes + 1 - size
                if lease is not None:   # nor past the budget's room: a piece that does not fit is never kept
                    cap = max(1, min(cap, lease.room() + 1 - size))
                piece = inflate.decompress(chunk, cap)
                if size + len(piece) > max_bytes:
                    raise TooLargeError(f"{what}: decompresses to over the limit of {max_bytes} bytes "
                                        f"(Content-Encoding {encoding})")
                if lease is not None:   # the request holds what it inflated to (its compressed bytes are dropped)
                    lease.cover(size + len(piece), what)
                parts.append(piece)
                size += len(piece)
                chunk = inflate.unconsumed_tail
        except zlib.error as exc:
            raise ValueError(f"Content-Encoding {encoding}: the body does not decompress ({exc})") from None
    if inflate is not None and not inflate.eof:
        raise ValueError(f"Content-Encoding {encoding}: the body does not decompress (truncated stream)")
    if inflate is not None and inflate.unused_data:
        raise ValueError(f"Content-Encoding {encoding}: {len(inflate.unused_data)} bytes after the compressed stream")
    return b"".join(parts)


def parse_json(data: bytes, what: str = "request body") -> Any:
    """`data` as JSON; ValueError naming `what` for bytes that are not JSON or nest too deeply (the parser
    recurses per level: past the interpreter's recursion limit it raises RecursionError, a client's fault)."""
    try:
        return json.loads(data)
    except RecursionError:
        raise ValueError(f"{what}: JSON nested deeper than {sys.getrecursionlimit()} levels") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{what}: not JSON ({exc})") from None
