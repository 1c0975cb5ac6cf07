"""Fixtures: the built engine (skipping everything when it can't be built here), one parametrization over the
ISA paths this CPU runs, and thread-count control restored after each test."""

from __future__ import annotations

import pytest

from flowspec_p2p.model import native

ISAS_HERE = []
if native.library() is not None:
    ISAS_HERE = native.available_isas()


@pytest.fixture(scope="session")
def lib():
    lib = native.library()
    if lib is None:
        pytest.skip("the native engine could not be built here (see the logged warning)")
    return lib


@pytest.fixture(params=ISAS_HERE or ["none"])
def isa(request, lib):
    """Runs the test once per ISA path available on this CPU, forcing it."""
    native.set_isa(request.param)
    yield request.param
    native.set_isa(None)


@pytest.fixture(autouse=True)
def one_thread():
    """Each test starts (and ends) with one thread."""
    if native.library() is not None:
        native.set_threads(1)
    yield
    if native.library() is not None:
        native.set_threads(1)
