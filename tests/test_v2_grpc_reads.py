"""The gRPC door's reads (issue 23's leftover regression): grpc tells no message size before a
read, so each read counts as the largest message until it is read, against the door's read pool
(``server.max_grpc_read_bytes``, all callers together), not against the caller's budget; one
caller's reads hold at most half the pool.

Fast: the pool's rules in-process (``ReadPool``).  Through a real server at its default limits
(64 MiB requests, so a 129 MiB largest message; 256 MiB per caller; a 1 GiB pool: 7 reads, 3 per
caller): one caller's messages are read at once (was: one at a time, the budget held two of them
in full), counted by a hostile HTTP/2 peer whose streams the server lets send past the unread
64 KiB window only once it reads them; callers flooding reads hold their share, the pool holds
all of them, and other callers are served, or refused with a clear error once the pool is full.
"""

from __future__ import annotations

import asyncio
import signal

import numpy as np
import pytest

pytest.importorskip("tritonclient.grpc")
import tritonclient.grpc as grpcclient  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

from helpers.h2_peer import Flood  # noqa: E402
from helpers.server import wait_for  # noqa: E402
from helpers.v2_server import auth, authed, python_model, still_serving, v2_serving  # noqa: E402
from shmserve.errors import ErrorCode  # noqa: E402
from shmserve.v2.auth import Authenticator  # noqa: E402
from shmserve.v2.messages import V2Error  # noqa: E402
from shmserve.v2.service import ReadPool  # noqa: E402

MODELS = python_model("identity", "shmserve.models:identity")
METHOD = "/inference.GRPCInferenceService/ModelInfer"
MESSAGE = 2 * (64 << 20) + (1 << 20)  # the largest message at the default max_request_bytes
POOL = (1 << 30) // MESSAGE  # reads at once in the default max_grpc_read_bytes: 7
SHARE = (1 << 30) // 2 // MESSAGE  # one caller's: 3
# The server's own default request size (the test servers' is 20 MiB); the budget and the pool at
# their defaults; messages may take a minute to arrive, so the floods' reads are held throughout.
DEFAULTS = f"max_request_bytes = {64 << 20}\nupload_timeout_s = 60\n"
UNREAD_WINDOW = 64 << 10  # an unread stream's HTTP/2 window (BDP probing off): a stream past it is being read


# -- the pool's rules ------------------------------------------------------------------------------------------

def callers(n: int):
    auth = Authenticator(allowed=lambda uid, gids: True, is_admin=lambda uid, gids: False, tokens={})
    return [auth.peer(1000 + i, frozenset()) for i in range(n)]


def test_the_read_pool_bounds_all_callers_and_each_ones_share_and_a_full_share_holds_up_no_one():
    a, b, c = callers(3)

    async def scenario():
        pool = ReadPool(lambda: 100, "server.max_grpc_read_bytes")
        await pool.take(a, 30, 1)
        await pool.take(a, 20, 1)  # a holds its share: half the pool
        a_more = asyncio.ensure_future(pool.take(a, 30, 5))  # past it: waits...
        await asyncio.sleep(0.01)
        await asyncio.wait_for(pool.take(b, 40, 5), 1)  # ...and holds up no other caller (total 90)
        c_wait = asyncio.ensure_future(pool.take(c, 20, 5))  # no room in the pool: waits
        b_small = asyncio.ensure_future(pool.take(b, 5, 5))  # would fit, but waits its turn behind c
        await asyncio.sleep(0.01)
        assert not (a_more.done() or c_wait.done() or b_small.done())
        pool.give(b, 40)  # room: c, then b, in order; a is still at its share
        await asyncio.wait_for(asyncio.gather(c_wait, b_small), 5)
        assert not a_more.done() and pool.total == 75
        pool.give(a, 30)
        await asyncio.wait_for(a_more, 5)
        assert pool.held[a.key] == 50 and pool.total == 75
        with pytest.raises(V2Error) as info:
            await pool.take(a, 1, 0.05)  # its share is full until its deadline
        assert info.value.code == ErrorCode.OVERLOADED and "server.max_grpc_read_bytes" in info.value.message
        assert pool.held[a.key] == 50 and not pool.waiting
        waiting = asyncio.ensure_future(pool.take(c, 30, 5))  # no room (105)
        behind = asyncio.ensure_future(pool.take(b, 20, 5))
        await asyncio.sleep(0.01)
        waiting.cancel()  # its caller left: nothing taken, and the one behind it moves up
        await asyncio.wait_for(behind, 5)
        assert pool.total == 95 and not pool.waiting
        for who, n in ((a, 20), (a, 30), (b, 5), (b, 20), (c, 20)):
            pool.give(who, n)
        assert pool.total == 0 and not pool.held
        small = ReadPool(lambda: 10, "server.max_grpc_read_bytes")
        await small.take(a, 50, 1)  # one read always fits, whatever its size...
        second = asyncio.ensure_future(small.take(b, 50, 5))  # ...but only alone
        await asyncio.sleep(0.01)
        assert not second.done()
        small.give(a, 50)
        await asyncio.wait_for(second, 5)
        small.give(b, 50)
        assert small.total == 0 and not small.held and not small.waiting

    asyncio.run(scenario())


# -- through a real server at its default limits -------------------------------------------------------------------

def being_read(*floods: Flood) -> int:
    """How many of the floods' streams the server is reading now (each run a moment first): it let
    them send past the unread window, and has not ended them."""
    for flood in floods:
        flood.run(0.05)
    return sum(1 for flood in floods for sent in flood.progress.values()
               if sent is not None and sent > UNREAD_WINDOW)


def one_mib_infer(address: str, role: str, timeout: float = 60):
    """tritonclient's infer of 1 MiB through ``identity`` as ``role``; its output."""
    x = np.arange(1 << 20, dtype=np.uint32).astype(np.uint8)
    tensor = grpcclient.InferInput("x", [x.size], "UINT8")
    tensor.set_data_from_numpy(x)
    client = authed(grpcclient.InferenceServerClient(address), role)
    try:
        y = client.infer("identity", [tensor], client_timeout=timeout).as_numpy("y")
    finally:
        client.close()
    assert np.array_equal(y, x)


def test_one_callers_grpc_messages_are_read_at_once_at_the_default_limits(tmp_path):
    """One token's two unfinished messages are both being read, and its third call, through
    tritonclient, is read and answered meanwhile: three of its reads at once.  Was: each read
    counted the largest message (129 MiB) against the caller's 256 MiB budget, so only one of
    its messages was read at a time (the door's throughput at 8 clients of one token: ~1.4x down)."""
    with v2_serving(tmp_path, models=MODELS, extra=DEFAULTS, deadlines=60) as srv:
        still_serving(srv)
        flood = Flood(srv.grpc, METHOD, SHARE - 1, 100 << 20, metadata=auth("client"))
        try:
            wait_for(lambda: being_read(flood) == SHARE - 1, "two of one caller's messages read at once")
            one_mib_infer(srv.grpc, "client")
            assert being_read(flood) == SHARE - 1  # still being read: three at once
        finally:
            flood.close()
        still_serving(srv)


def test_callers_flooding_reads_hold_their_share_the_pool_holds_them_all_and_others_are_served(tmp_path):
    """A token floods 12 unfinished 100 MiB messages on two connections: 3 are read (its share),
    the rest wait.  All anonymous callers flood 6 more: 3 read.  Another token is served
    meanwhile.  A third token's 6: 1 read (the pool's 7th).  Then the pool is full: a fourth
    caller waits and is refused RESOURCE_EXHAUSTED [overloaded] naming the key, within its
    upload_timeout_s (lowered by a reload, so the floods' reads are still held)."""
    with v2_serving(tmp_path, models=MODELS, extra=DEFAULTS, deadlines=60) as srv:
        still_serving(srv)
        floods: list[Flood] = []
        try:
            hostile = [Flood(srv.grpc, METHOD, 6, 100 << 20, metadata=auth("client")) for _ in range(2)]
            floods += hostile
            wait_for(lambda: being_read(*hostile) >= SHARE, "the flooding token's reads")
            for _ in range(5):
                assert being_read(*hostile) == SHARE
            anonymous = Flood(srv.grpc, METHOD, 6, 100 << 20)
            floods.append(anonymous)
            wait_for(lambda: being_read(anonymous) >= SHARE, "the anonymous callers' reads")
            one_mib_infer(srv.grpc, "admin")  # one read left in the pool: served
            other = Flood(srv.grpc, METHOD, 6, 100 << 20, metadata=auth("other"))
            floods.append(other)
            wait_for(lambda: being_read(other) >= 1, "the third token's read")
            for _ in range(5):
                assert (being_read(*hostile), being_read(anonymous), being_read(other)) == \
                       (SHARE, SHARE, POOL - 2 * SHARE)
            done = srv.log().count("reload: done")
            srv.config_path.write_text(srv.config_path.read_text().replace("upload_timeout_s = 60",
                                                                           "upload_timeout_s = 2"))
            srv.proc.send_signal(signal.SIGHUP)
            wait_for(lambda: srv.log().count("reload: done") > done, "the reload")
            with pytest.raises(InferenceServerException) as info:
                one_mib_infer(srv.grpc, "admin")
            assert info.value.status() == "StatusCode.RESOURCE_EXHAUSTED", info.value
            assert "[overloaded]" in info.value.message() and "server.max_grpc_read_bytes" in info.value.message()
            assert being_read(*floods) == POOL  # the floods' reads were held throughout
        finally:
            for flood in floods:
                flood.close()
        still_serving(srv)
