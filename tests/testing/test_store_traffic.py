"""Store-traffic accounting (parallel_state_ng/testing/store_traffic.py) and what it shows of compat's init.

Unit: every operation of a :class:`CountingStore` is forwarded and filed under its key's
category. Gloo worlds of 4 and 8 ranks, tp 2 pp 2: besides one arrival mark per group of two or
more members (member path) or per split (split path: one per group kind, as many at both
sizes), compat's protocol (agreement round, closing round, readiness marks) costs each rank the
same number of store operations at both sizes, through a ``FileStore`` and a ``TCPStore``; the
agreement round is the 5 operations its protocol states, the closing round at most 4. Counts,
no timing.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch.distributed as dist

from parallel_state_ng.testing.store_traffic import CATEGORIES, CountingStore, classify, counting_default_store


def test_classify_files_each_key_under_its_protocol_step():
    assert classify("default_pg/0//psng_agreement/initialize_model_parallel/world4/0/fp/1") == "agreement"
    assert classify("default_pg/0//psng-arrive/psng-split-3/2") == "arrival"
    assert classify("default_pg/0//psng-init/initialize_model_parallel/0-3-4/0/count") == "closing"
    assert classify("default_pg/0//psng-abc-0/psng-ready/1") == "readiness"
    assert classify("default_pg/0//stand-in-split/4") == "stand-in"
    assert classify("default_pg/0//psng-abc-0/rank_1") == "connect"
    assert classify(None) == "other"
    assert set(CATEGORIES) >= {"agreement", "arrival", "closing", "readiness", "connect", "stand-in", "other"}


def test_counting_store_forwards_and_counts_every_operation():
    store = CountingStore(dist.HashStore())
    store.set("psng-arrive/x/0", b"1")
    assert store.get("psng-arrive/x/0") == b"1"
    assert store.add("psng_agreement/n/arrived", 2) == 2
    assert store.compare_set("psng_agreement/n/verdict", "", "ok") == b"ok"
    assert store.check(["psng-arrive/x/0"])
    store.wait(["psng-arrive/x/0"], timedelta(seconds=1))
    store.wait(["psng-arrive/x/0"])
    assert store.delete_key("psng-arrive/x/0")
    traffic = store.reset()
    rows = traffic.by_category()
    assert rows["arrival"]["ops"] == 6 and rows["arrival"]["wait"] == 2
    assert rows["agreement"] == {"ops": 2, "seconds": rows["agreement"]["seconds"], "add": 1, "compare_set": 1}
    assert traffic.count() == 8 and traffic.count("arrival", "set") == 1
    assert traffic.seconds() >= traffic.seconds("agreement") >= 0.0
    assert store.traffic.count() == 0  # a new record


def test_counting_default_store_refuses_a_bad_kind_and_no_world():
    with pytest.raises(ValueError, match="kind must be 'launcher', 'file' or 'tcp', got 'redis'"):
        with counting_default_store("redis"):  # type: ignore[arg-type]
            pass


def protocol_counts(store: str, path: str) -> dict:
    """One compat init on this rank with the store counted: operations per category, splits."""
    from scripts.bench.init_phases import rank_init_phases

    before = len(dist.distributed_c10d._world.pg_map)  # the world is shared with other tests
    (record,) = rank_init_phases("compat", "tp2-pp2", store, path, 1, False)
    ops = {category: row["ops"] for category, row in record["init_traffic"].items()}
    return {
        "ops": ops,
        "splits": record["split_calls"],
        "multi_rank_groups": record["multi_rank_groups"],
        "bad": record["bad_sums"],
        "left": len(dist.distributed_c10d._world.pg_map) - before,
    }


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize(("store", "path"), [("file", "member"), ("tcp", "split")])
def test_protocol_ops_per_rank_do_not_grow_with_the_world(gloo_world, store, path):
    protocol = ("agreement", "arrival", "closing", "readiness")
    per_world = {}
    for size in (4, 8):
        results = gloo_world(size).run(protocol_counts, store, path, timeout=600)
        for rank, r in enumerate(results):
            assert r["bad"] == [] and r["left"] == 0, (size, rank, r)
            assert r["ops"]["agreement"] == 5, (size, rank, r)  # set, set, add, then wait + read or compare_set
            assert r["ops"]["closing"] <= 4, (size, rank, r)
            if path == "split":  # one mark per split (one per group kind), one per gloo group the stand-in made
                assert r["ops"].get("arrival", 0) == r["splits"] + r["multi_rank_groups"], (size, rank, r)
                assert r["splits"] > 0
            else:  # one mark per gloo group of two or more members the rank created
                assert r["ops"].get("arrival", 0) == r["multi_rank_groups"] > 0, (size, rank, r)
        fixed = {sum(r["ops"].get(c, 0) for c in protocol) - r["ops"].get("arrival", 0) for r in results}
        per_world[size] = (fixed, {r["splits"] for r in results})
    assert per_world[4] == per_world[8], per_world
