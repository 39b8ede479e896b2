"""The KV event log (server/admin/events.py): one log read by every subscriber at its own
cursor; a subscriber that stops reading is dropped once it falls a log behind."""

from __future__ import annotations

import asyncio

from kvpool.server.admin.events import SWEEP_EVERY, EventBus


def publish(bus: EventBus, n: int, kind: str = "stored") -> None:
    for i in range(n):
        bus.publish(kind, i.to_bytes(16, "big"), tier="dram")


async def test_each_subscriber_reads_what_was_published_after_it_of_its_types() -> None:
    bus = EventBus("n", queue_size=100)
    early = bus.subscribe()
    publish(bus, 3)
    late = bus.subscribe(frozenset({"evicted"}))
    publish(bus, 2, "evicted")
    assert [e.kind for e in bus.take(early)] == ["stored"] * 3 + ["evicted"] * 2
    assert [e.data["key"][-2:] for e in bus.take(late)] == ["00", "01"]
    assert bus.take(early) == [] and bus.take(late) == []
    publish(bus, 1)
    event = bus.take(early)[0]
    assert event.line.startswith(b"event: stored\ndata: {") and event.data["node"] == "n"


async def test_a_subscriber_that_stops_reading_is_dropped_and_a_reader_is_kept() -> None:
    bus = EventBus("n", queue_size=1000)
    closed: list[str] = []
    silent = bus.subscribe(on_close=lambda: closed.append("silent"))
    reader = bus.subscribe()
    taken = 0
    for _ in range(3):
        publish(bus, 999)
        taken += len(bus.take(reader))
    assert silent.closed and closed == ["silent"] and bus.dropped == 1
    assert not reader.closed and taken == 3 * 999
    assert bus.subscribers == [reader]
    assert bus.take(silent) == []  # nothing more, ever


async def test_dropping_is_found_by_the_periodic_sweep_without_a_take() -> None:
    bus = EventBus("n", queue_size=SWEEP_EVERY)
    silent = bus.subscribe()
    publish(bus, 2 * SWEEP_EVERY)
    assert silent.closed and bus.subscribers == []


async def test_wait_wakes_every_waiter_and_a_cancelled_wait_leaves_the_others() -> None:
    bus = EventBus("n")
    a, b = bus.subscribe(), bus.subscribe()
    first = asyncio.ensure_future(bus.wait(a))
    second = asyncio.ensure_future(bus.wait(b))
    third = asyncio.ensure_future(bus.wait(bus.subscribe()))
    await asyncio.sleep(0)
    third.cancel()  # a heartbeat timeout of one stream
    await asyncio.sleep(0)
    publish(bus, 1)
    got = await asyncio.wait_for(asyncio.gather(first, second), 5)
    assert [len(g) for g in got] == [1, 1]
    bus.drop(a)  # a drop wakes its waiter, which then sees it closed
    waiting = asyncio.ensure_future(bus.wait(b))
    await asyncio.sleep(0)
    bus.drop(b)
    assert await asyncio.wait_for(waiting, 5) == [] and b.closed


async def test_a_take_of_at_most_n_leaves_the_rest_for_the_next() -> None:
    bus = EventBus("n", queue_size=100)
    sub = bus.subscribe(frozenset({"evicted"}))
    publish(bus, 5, "stored")
    publish(bus, 5, "evicted")
    first = bus.take(sub, 7)  # 7 published: 5 of another type, 2 of its own
    assert [e.data["key"][-2:] for e in first] == ["00", "01"]
    assert [e.data["key"][-2:] for e in bus.take(sub)] == ["02", "03", "04"]
    assert bus.take(sub) == []
