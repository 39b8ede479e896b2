"""The sync client's loop-free calls: the op plans on a blocking connection, no event loop.

A sync call that runs the client's event loop costs ~80 us more than the
request itself on this 2-core VM (``run_until_complete`` sets up and tears
down uvloop's signal socketpair on every run, and the reply crosses a
protocol callback and a future). :class:`BlockingNode` runs the same op
plans (:mod:`kvpool.client._plans`) as the async pool, over a blocking
connection the client's transport opens for the sync client
(:meth:`Transport.open_blocking <kvpool.client.transport.Transport.open_blocking>`:
a socket of its own over TCP, :mod:`kvpool.client._socket`; the handler, in the
calling thread, on a mock transport).

:func:`run_parallel` runs one plan on each of several nodes, their first frames all
sent before any reply is read (a cluster's round of EXISTS, as the loop's ``gather``);
with ``settle``, replies are read as they come and stragglers are left behind, as the
loop's fan-out leaves them (``kvpool.client._routing``).

One request is in flight at a time on a connection (a batch larger than the node's
``max_batch`` goes frame by frame): the sync client serialises its calls
anyway, and a blocking writer that pipelined big frames while the node
paused reading could wait forever.
"""

from __future__ import annotations

import logging
import select
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, TypeVar, cast

from kvpool.client import _plans as plans
from kvpool.client._node import NodeClient
from kvpool.client._plans import Call, Plan, Sink
from kvpool.client._routing import FIRST_ANSWER, Coverage, LeftBehind, Settle, grace
from kvpool.client._routing import IntArray as Rows
from kvpool.client._shm import Ahead
from kvpool.client._socket import busy_poll
from kvpool.protocol.frames import KEY_SIZE, Op
from kvpool.protocol.parsers import Reply

if TYPE_CHECKING:
    from kvpool.client.transport import BlockingLink

__all__ = ["BlockingNode", "run_parallel"]

T = TypeVar("T")
log = logging.getLogger("kvpool.client")


class BlockingNode:
    """Runs op plans against one node over a blocking connection it (re)opens.

    ``node`` is the async client's ``NodeClient`` for the same node: its settings
    (token, TLS, timeouts, scope), limits, counters and reply checks are shared, so a
    call gives the same results and errors whichever transport carried it.
    """

    def __init__(self, node: NodeClient) -> None:
        self.node = node
        self._conn: BlockingLink | None = None
        self._idle_s = 0.0
        #: the node granted the link its arena for writing (PUT_SHM, COMMIT): a same-host
        #: client of the node's user, whose loop connection mapped the arena writable
        self.shm_write = False
        #: arena slots the node reserved for the link's next puts of the same sizes, and
        #: those given up, released with the next put (``client/_shm_put.py``)
        self.put_ahead: list[Ahead] = []
        self.put_unwanted: list[Ahead] = []
        #: the region the node granted as it was when the link said HELLO (None: none was)
        self._grant: object | None = None

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        # the node ends the link's leases with it
        self.shm_write = False
        self.put_ahead, self.put_unwanted = [], []

    @property
    def is_open(self) -> bool:
        return self._conn is not None

    @property
    def linked(self) -> bool:
        """Whether it holds a connection (which said HELLO): a call on it need not open
        one first, whose HELLO, in this thread, would wait out a hung node's timeout."""
        return self._conn is not None

    def run(self, plan: Plan[T]) -> T:
        conn = self._connection()
        try:
            calls = next(plan)
        except StopIteration as done:
            return cast(T, done.value)
        return self._rounds(plan, calls, conn)

    def _rounds(self, plan: Plan[T], calls: list[Call], conn: BlockingLink) -> T:
        """Run ``plan`` on from its round ``calls``, frame by frame."""
        node = self.node
        while True:
            replies = [node.check(conn.call(op, count, body, sinks, epoch=node.epoch))
                       for op, count, body, sinks in calls]
            try:
                calls = plan.send(replies)
            except StopIteration as done:
                return cast(T, done.value)

    def _resume(self, plan: Plan[T], replies: list[Reply], conn: BlockingLink) -> T:
        """Run ``plan`` on from the replies to its first round."""
        try:
            calls = plan.send(replies)
        except StopIteration as done:
            return cast(T, done.value)
        return self._rounds(plan, calls, conn)

    def get(self, blob: bytes, sinks: Sequence[Sink] | None) -> list[Sink | None]:
        """GET: :func:`plans.get_tcp`'s results; a batch that fits one frame (every
        call but the largest) is asked without stepping the plan."""
        node = self.node
        count = len(blob) // KEY_SIZE
        if count > int(node.server_info["max_batch"]):
            return self.run(plans.get_tcp(node, blob, sinks))
        reply = node.check(self._connection().call(Op.GET, count, [blob], sinks,
                                                    epoch=node.epoch))
        out, corrupt = plans.received(node, blob, sinks, [range(count)], [reply])
        if corrupt:
            self.run(plans.drop_corrupt(node, corrupt))
        return out

    def _connection(self) -> BlockingLink:
        conn = self._conn
        node = self.node
        if conn is not None and not conn.stale(self._idle_s) \
                and self._grant is node.path.grant:
            return conn
        # (a new arena mapped since its HELLO, as after a node's restart: a new link, whose
        # HELLO asks for a grant of it, so that puts go through it again)
        self.close()
        options = node.options
        conn = options.connector.open_blocking(node.host, node.port, options)
        # a standalone node (epoch 0) whose region the loop's connection was granted for
        # writes: this link puts through it too (a cluster's puts run on the loop: its links
        # ask no grant)
        path = node.path
        writes = path.writable and path.asks_grant and node.epoch == 0
        try:
            hello = plans.hello(node, options.client_name, options.token, arena=writes)
            info = self._rounds(hello, next(hello), conn)
            conn.limit_values(info["max_value_bytes"])
            self.shm_write = writes and path.link_grant(info)
        except BaseException:
            conn.close()
            raise
        self._grant = path.grant
        self._idle_s = float(info.get("idle_timeout_s") or 0)
        if not node.server_info:  # a cluster's node this client has not yet said HELLO to
            node.server_info = info  # on its loop: the plans read its limits
        self._conn = conn
        return conn

def run_parallel(runs: Sequence[tuple[BlockingNode, Plan[T]]], *,
                 settle: list[Rows] | None = None, rule: Settle = FIRST_ANSWER
                 ) -> list[T | Exception]:
    """One plan on each node, as the loop's ``gather`` runs them: the first frame of every
    plan sent before any reply is read, so the nodes answer in one round trip together.
    Each outcome, in order: the plan's result, or the Exception it ended with
    (``gather``'s ``return_exceptions``). A plan whose first round is several frames (a
    batch past the node's ``max_batch``) runs after the others, frame by frame.

    ``settle``: the rows each node was asked about; once every row has the answers
    ``rule`` asks for (counting the trusted nodes), the nodes still silent get
    :func:`~kvpool.client._routing.grace` more, then are left behind (their link closed,
    the node marked slow, their outcome a ``LeftBehind``)."""
    outcomes: list[T | Exception | None] = [None] * len(runs)
    coverage = Coverage(settle, rule, [driver.node.trusted for driver, _ in runs]) \
        if settle is not None else None
    sent: list[tuple[int, BlockingNode, Plan[T], BlockingLink]] = []
    later: list[tuple[int, BlockingNode, Plan[T], list[Call]]] = []
    start = time.monotonic()
    try:
        for i, (driver, plan) in enumerate(runs):
            try:
                conn = driver._connection()
                calls = next(plan)
                if len(calls) != 1:
                    later.append((i, driver, plan, calls))
                    continue
                op, count, body, sinks = calls[0]
                conn.begin(op, count, body, sinks, epoch=driver.node.epoch)
                sent.append((i, driver, plan, conn))
            except StopIteration as done:
                outcomes[i] = cast(T, done.value)
                if coverage is not None:
                    coverage.add(i)
            except Exception as exc:
                outcomes[i] = exc
                if coverage is not None:
                    coverage.fail(i)
        order = _as_they_come(sent, outcomes, coverage, start) if coverage is not None else sent
        while order:
            i, driver, plan, conn = order.pop(0)
            try:
                outcomes[i] = driver._resume(plan, [driver.node.check(conn.finish())], conn)
            except Exception as exc:
                outcomes[i] = exc
        for i, driver, plan, calls in later:
            try:
                outcomes[i] = driver._rounds(plan, calls, driver._connection())
            except Exception as exc:
                outcomes[i] = exc
    finally:
        for _, driver, _, _ in sent:  # interrupted (Ctrl-C): replies not read are left
            driver.close()            # on these links, which must not carry another call
    return cast("list[T | Exception]", outcomes)


def _as_they_come(sent: list[tuple[int, BlockingNode, Plan[T], BlockingLink]],
                  outcomes: list[T | Exception | None], coverage: Coverage, start: float
                  ) -> list[tuple[int, BlockingNode, Plan[T], BlockingLink]]:
    """:func:`run_parallel`'s replies read in the order they arrive (each taken off
    ``sent``), until ``coverage`` is full and the grace after it ends;
    what is left is returned to be read in turn (each waits its deadline) if no reply
    came within the timeout, else left behind."""
    if not sent:
        return sent
    poller = select.poll()
    by_fd: dict[int, tuple[int, BlockingNode, Plan[T], BlockingLink]] = {}
    for entry in sent:
        fd = entry[3].fileno()
        if fd < 0:  # no socket to wait on: the reply is there at once
            return sent
        by_fd[fd] = entry
        poller.register(fd, select.POLLIN)
    options = sent[0][1].node.options
    timeout, spin_ns = options.timeout, int(options.busy_poll_us * 1000)
    until: float | None = None
    while sent:
        now = time.monotonic()
        left = (start + timeout if until is None else until) - now
        ready = busy_poll(poller, min(spin_ns, int(left * 1e9))) if left > 0 else []
        if not ready:
            ready = poller.poll(max(0.0, left) * 1000) if left > 0 else poller.poll(0)
        if not ready:
            break
        for fd, _ in ready:
            entry = by_fd.pop(fd)
            poller.unregister(fd)
            sent.remove(entry)
            i, driver, plan, conn = entry
            try:
                outcomes[i] = driver._resume(plan, [driver.node.check(conn.finish())], conn)
                coverage.add(i)
            except Exception as exc:
                outcomes[i] = exc
                coverage.fail(i)
        if until is None and coverage.full:
            now = time.monotonic()
            until = now + grace(now - start, timeout)
    if until is None:  # no reply within the timeout: each is read (and fails) in turn
        return sent
    for i, driver, _, _ in sent:
        outcomes[i] = LeftBehind()
        driver.close()  # its reply, if it comes, is not read on that link
        driver.node.mark_slow()
    sent.clear()
    return sent
