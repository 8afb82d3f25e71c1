"""The byte table: additions from many threads without a lock, folded on read, old steps in the total."""

from __future__ import annotations

import threading

from sylvie_comm.collectives.accounting import Meter, Stats


def test_additions_from_many_threads_are_all_counted():
    stats = Stats(keep=4)
    per_thread, threads = 3000, 4  # past the fold threshold, so additions fold while others append

    def add(rank: int) -> None:
        meter = Meter(2, stats, step=rank % 2)
        for _ in range(per_thread):
            stats.add(rank % 2, bytes_sent=1, collectives=1)
            meter.uncompressed(8)  # 8 bytes of fp32 all-reduced by 2 ranks: 8 on the wire

    workers = [threading.Thread(target=add, args=(r,)) for r in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    summary = stats.summary(2)
    assert summary["bytes_sent"] == threads * per_thread
    assert summary["collectives"] == threads * per_thread
    assert summary["bytes_uncompressed"] == 8 * threads * per_thread
    assert stats.step(1).bytes_sent == 2 * per_thread  # threads 1 and 3
    assert summary["last_step"]["bytes_sent"] == 2 * per_thread
    assert len(stats._log) == 0  # folded by the read


def test_steps_older_than_keep_fold_into_the_total_in_order():
    stats = Stats(keep=2)
    for step in range(5):
        stats.add(step, bytes_sent=10 * (step + 1))
    assert stats.step(4).bytes_sent == 50 and stats.step(3).bytes_sent == 40
    assert stats.step(2).bytes_sent == 0  # folded into the total, no longer apart
    assert stats.summary(5)["bytes_sent"] == 150
    stats.add(1, bytes_sent=7)  # a late addition for a folded step still reaches the total
    assert stats.summary(5)["bytes_sent"] == 157


def test_log_stays_bounded_without_reads():
    stats = Stats()
    for i in range(3 * Stats._FOLD_AT):
        stats.add(i % 8, collectives=1)
    assert len(stats._log) <= Stats._FOLD_AT
    assert stats.summary(8)["collectives"] == 3 * Stats._FOLD_AT
