"""Every hostile example runs under an address-space cap: a file declaring a huge size must not be believed."""

from __future__ import annotations

import resource
from collections.abc import Iterator

import pytest
from hostile_helpers import address_space

MEMORY_HEADROOM = 2 << 30  # a verb may map and allocate this much beyond what the test process already holds


@pytest.fixture(autouse=True)
def bounded_memory() -> Iterator[None]:
    """Cap the address space for the test; a MemoryError then fails it instead of the machine."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    cap = address_space() + MEMORY_HEADROOM
    resource.setrlimit(resource.RLIMIT_AS, (cap if hard == resource.RLIM_INFINITY else min(cap, hard), hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
