"""The HTTP headers an adapter travels with, shared by both ends: the trainer serves its current adapter with
them (GET /v1/adapter/current), the rollout services read them from a push (PUT /v1/adapter) and a fetch.
Light: names only."""

from __future__ import annotations

VERSION_HEADER = "X-Adapter-Version"
SHA256_HEADER = "X-Adapter-Sha256"
